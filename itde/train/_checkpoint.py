"""Checkpoints of a training run: the leaves of `(model, opt_state)` and a JSON sidecar.

A checkpoint directory holds

- `state-<step>.eqx`: `eqx.tree_serialise_leaves((step, model, opt_state))` (no pickle),
  so the state file records its own step;
- `checkpoint.json`: the sidecar — format, step, the name, size and SHA-256 of the leaves
  file, the config dict and its SHA-256 (an edit of the stored config is refused on
  resume), the run's id (every `metrics.jsonl` row carries it, so rows of another run are
  refused), the data-stream key, package versions, the shape and dtype of every array
  leaf, and task metadata (e.g. a character vocabulary).

Both files are written atomically: to a temporary file in the same directory, flushed and
`fsync`ed, then `os.replace`d over the final name (and the directory `fsync`ed). The leaves
file goes first and the sidecar, which names it, last: the sidecar is the commit point,
so a crash at any moment leaves the previous checkpoint or the new one, never a mix.
A sharded run writes format 3 instead, each process its own shards
(`itde.train._shards`), under the same sidecar. Reading checks everything and raises
[`CheckpointError`][] with the reason — a missing, truncated, corrupted or mismatched
checkpoint is never silently replaced by a fresh start.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import platform
import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from .._io import atomic_write

SIDECAR = "checkpoint.json"
FORMAT = 2  # 2: the state file begins with its own step (format 1 did not record it)
SHARDED = 3  # per-process shards in a state directory: `itde.train._shards`


class CheckpointError(ValueError):
    """A checkpoint directory is missing, truncated, corrupted or does not fit the run."""


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("itde", "jax", "jaxlib", "equinox", "diffrax", "optax", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover
            out[name] = "unknown"
    return out


def shapes(tree) -> dict[str, list]:
    """`{path: [shape, dtype]}` for every array leaf of `tree`."""
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {
        jax.tree_util.keystr(p): [list(a.shape), str(a.dtype)] for p, a in leaves if a is not None
    }


def _host(x):
    """A host copy of an array leaf (the first addressable shard of a replicated array)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.sharding.is_fully_replicated:
            raise ValueError(
                f"a leaf of shape {x.shape} is sharded across processes ({x.sharding}); "
                "gather the state first (`itde.train._sharding.to_host`, on every process) "
                "and save that"
            )
        x = x.addressable_data(0)
    return np.asarray(x)


def config_digest(config: dict) -> str:
    """The SHA-256 of a config dict in canonical JSON: the sidecar records it, so an edit of
    the stored config is seen on resume."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def save(directory: str | Path, step: int, state, meta: dict) -> Path:
    """Write the checkpoint of `state = (model, opt_state)` at `step` into `directory`.

    `meta` (JSON-serialisable) is stored in the sidecar with the bookkeeping fields added.
    Older `state-*.eqx` files of the directory are removed once the sidecar is committed.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"state-{step:08d}.eqx"
    host_state = jax.tree.map(lambda x: _host(x) if eqx.is_array(x) else x, state)
    digest = hashlib.sha256()
    size = 0

    class _Hashing:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            nonlocal size
            digest.update(b)
            size += len(b)
            return self.f.write(b)

    leaves = (np.asarray(step, np.int64), host_state)
    atomic_write(directory / name, lambda f: eqx.tree_serialise_leaves(_Hashing(f), leaves))
    sidecar = dict(meta)
    sidecar.update(
        format=FORMAT,
        step=int(step),
        leaves=name,
        bytes=size,
        sha256=digest.hexdigest(),
        versions=versions(),
        shapes=shapes(state),
        config_sha256=config_digest(meta["config"]),
    )
    text = json.dumps(sidecar, indent=1, sort_keys=True).encode()
    atomic_write(directory / SIDECAR, lambda f: f.write(text))
    for old in directory.glob("state-*"):  # a sharded (format-3) state is a directory
        if old.name != name:
            with contextlib.suppress(OSError):
                shutil.rmtree(old) if old.is_dir() else old.unlink()
    return directory / SIDECAR


def read_meta(directory: str | Path) -> dict:
    """The sidecar of a checkpoint directory, checked for the fields a resume needs, the
    paths of its config absolute (also those of an earlier itde's sidecar, which holds them
    as given: see `itde.train.load`)."""
    directory = Path(directory)
    path = directory / SIDECAR
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(
            f"checkpoint {str(directory)!r} is a file, not a checkpoint directory; give the "
            f"`out` directory of an `itde train` run (the directory holding {SIDECAR})"
        )
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint directory {str(directory)!r} does not exist; give the `out` directory "
            "of an earlier `itde train` run"
        )
    if not path.is_file():
        raise CheckpointError(
            f"{str(directory)!r} holds no checkpoint ({SIDECAR} is missing); it is not the "
            "output directory of an `itde train` run, or the run stopped before its first "
            "checkpoint"
        )
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{str(path)!r} is not valid JSON ({e}); the sidecar is damaged")
    if not isinstance(meta, dict):
        raise CheckpointError(f"{str(path)!r} is not an itde checkpoint sidecar (not an object)")
    if isinstance(meta.get("format"), int) and meta["format"] < FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is a format-{meta['format']} checkpoint of an earlier itde; this "
            f"version reads format {FORMAT} (the state file records its own step). Evaluate or "
            "resume it with the itde that wrote it, or train again"
        )
    if isinstance(meta.get("format"), int) and meta["format"] > SHARDED:
        raise CheckpointError(
            f"{str(path)!r} is a format-{meta['format']} checkpoint of a later itde; this "
            f"version reads formats {FORMAT} (one file) and {SHARDED} (per-process shards). "
            "Upgrade itde to resume or evaluate it"
        )
    fields = ("format", "step", "leaves", "bytes", "sha256", "config", "shapes")
    fields += ("files",) if meta.get("format") == SHARDED else ()
    missing = [k for k in fields if k not in meta]
    if missing or meta.get("format") not in (FORMAT, SHARDED):
        raise CheckpointError(
            f"{str(path)!r} is not a format-{FORMAT} or format-{SHARDED} itde checkpoint "
            f"sidecar (missing {missing}, format {meta.get('format')!r})"
        )
    digest = meta.get("config_sha256")
    if digest is not None and digest != config_digest(meta["config"]):
        raise CheckpointError(
            f"{str(path)!r}: its `config` was edited after the checkpoint was written (the "
            "recorded config_sha256 differs); resuming would continue the run under settings "
            "it was not trained with. Restore the file, or change what may change "
            "(run.log_every, run.eval_every, run.checkpoint_every, run.out, run.progress) with "
            "--config / `cfg=` instead"
        )
    from ._config import stored_paths

    # (after the digest, which is of the config as written)
    meta["config"] = stored_paths(meta["config"], directory, (meta.get("init") or {}).get("sha256"))
    return meta


def read_leaves(directory: str | Path, meta: dict) -> bytes:
    """The leaves file named by the sidecar `meta`, checked for existence, size and SHA-256."""
    directory = Path(directory)
    path = directory / meta["leaves"]
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {str(directory)!r}: the state file {meta['leaves']!r} named by "
            f"{SIDECAR} is missing"
        )
    raw = path.read_bytes()
    if len(raw) != meta["bytes"]:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is truncated or damaged: {len(raw)} bytes, the sidecar "
            f"records {meta['bytes']}"
        )
    if hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise CheckpointError(
            f"checkpoint {str(path)!r} is corrupted: its SHA-256 differs from the sidecar's"
        )
    return raw


#: Fields renamed since a sidecar may have been written, as they appear in its `shapes`
#: paths: `TokenModel.ide` and `FieldModel.ide` are `.equation` since issue 46 (the state
#: file holds the leaves in the same order: only the sidecar's names differ).
_RENAMED_FIELDS = {".ide.": ".equation."}


def _current_path(path: str) -> str:
    """A `shapes` path of a sidecar in the current names of its fields."""
    for old, new in _RENAMED_FIELDS.items():
        path = path.replace(old, new)
    return path


def check_shapes(directory: Path, template, meta: dict) -> None:
    """Raise unless the sidecar's array shapes and dtypes are those of `template` (the
    paths of a sidecar written before a field was renamed read in its new name)."""
    want = shapes(template)
    got = {_current_path(k): v for k, v in meta["shapes"].items()}
    if want != got:
        bad = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
        k = bad[0]
        raise CheckpointError(
            f"checkpoint {str(directory)!r} holds parameters of another model: {len(bad)} "
            f"leaves differ, e.g. {k}: {got.get(k)} in the checkpoint, {want.get(k)} for this "
            "config. Resume with the checkpoint's own config (omit --config)."
        )


def load(directory: str | Path, template, meta: dict | None = None, raw: bytes | None = None):
    """Read `(model, opt_state)` from a checkpoint into the structure of `template`.

    Checks, in order: the sidecar, the leaves file's existence, size and SHA-256, and the
    shape and dtype of every array leaf against `template` (built from the config).
    `raw`, if given, is the leaves file's content read elsewhere (by process 0 of a
    multi-host run); its SHA-256 is checked against the sidecar's again.

    **Returns:** `(state, meta)`.
    """
    directory = Path(directory)
    meta = read_meta(directory) if meta is None else meta
    if meta["format"] == SHARDED:
        raise CheckpointError(
            f"checkpoint {str(directory)!r} holds per-process shards (format {SHARDED}), not "
            "one state file; read it with `itde.train.load(directory)` or restore it with "
            "`itde.train.Run(cfg).restore(directory)`"
        )
    if raw is None:
        raw = read_leaves(directory, meta)
    elif hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise CheckpointError(
            f"checkpoint {str(directory)!r}: the state received from process 0 differs from "
            "the SHA-256 its sidecar records"
        )
    check_shapes(directory, template, meta)
    import io

    step, state = eqx.tree_deserialise_leaves(
        io.BytesIO(raw), (np.zeros((), np.int64), template)
    )
    if int(step) != meta["step"]:
        raise CheckpointError(
            f"checkpoint {str(directory)!r}: the state file {meta['leaves']!r} holds step "
            f"{int(step)} but {SIDECAR} says step {meta['step']!r}; the sidecar was edited or "
            f"mixed with another run's state file. Set \"step\": {int(step)} in {SIDECAR} if "
            "that state file is the one to resume, or resume another checkpoint"
        )
    return state, meta
