"""Checkpoints that scale out (format 3): every process writes its own shards with Orbax.

The single-file format (`itde.train._checkpoint`, format 2) gathers the whole state on
every process and lets process 0 write it: at the sizes where a run must be sharded that
gather is the step that does not fit. This format writes the state as it lies on the mesh:

- `state-<step>/`: an Orbax checkpoint (`orbax.checkpoint.StandardCheckpointHandler`,
  TensorStore's OCDBT driver) of a flat dict `{"leaf_00000": ..., "step": step}` of the
  array leaves of `(model, opt_state)` in `jax.tree` order. Each process writes the shards
  its devices hold (one replica of each), so no array is ever gathered. Orbax writes into a
  temporary directory and renames it when every process has finished.
- `checkpoint.json`: the same sidecar as format 2 (config and its SHA-256, run id, data key,
  versions, shapes, task metadata), with `format: 3`, `leaves` the state directory, and
  `files`: the size and SHA-256 of every file under it (hashed by all processes, each a
  share of the files), `bytes` their total and `sha256` the SHA-256 of that list. Process
  0 writes it atomically, after the state directory is complete: it is still the commit
  point, so a crash at any moment leaves the previous checkpoint or the new one.

Reading checks the sidecar, the presence, size and SHA-256 of every listed file (each
process a share, the first failure raised on all of them), every array's shape and dtype
against the config's model, and the step stored in the state against the sidecar's; then
each process reads the pieces of the arrays its devices hold **in the layout of the
resuming run's mesh**, which may differ from the writer's (another `fsdp`, another number
of devices, one device for `itde.train.load`): Orbax reads each requested slice from the
stored chunks, so a checkpoint of a `(data, fsdp) = (2, 4)` run resumes as `fsdp = 8` or on
one device.

The state directory must be on a filesystem every process sees (as Orbax requires); the
single-file format (`[run] checkpoint_format = "file"`) needs only process 0's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from .._io import atomic_write
from . import _checkpoint as ckpt
from . import _distributed as dist
from . import _sharding as shd

FORMAT = 3  # 3: per-process shards (Orbax) in state-<step>/, file digests in the sidecar
_STEP = "step"
_CHUNK = 1 << 20


def _key(i: int) -> str:
    return f"leaf_{i:05d}"


def _arrays(state) -> list:
    return [x for x in jax.tree.leaves(state) if eqx.is_array(x)]


def _gather(value) -> list:
    """`value` (JSON-able) of every process, in process order, on every process (an
    all-gather: every process must call this at the same point)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental.multihost_utils import process_allgather

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(process_allgather(np.array([data.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    rows = np.asarray(process_allgather(buf)).reshape(len(sizes), -1)
    return [json.loads(row[:n].tobytes()) for row, n in zip(rows, sizes, strict=True)]


def _sha256(path: Path) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def _listing(files: dict) -> str:
    """The SHA-256 of the sidecar's file list (sizes and digests) in canonical JSON."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _checkpointer():
    try:
        import orbax.checkpoint as ocp
    except ImportError:  # pragma: no cover - the `scale` extra is not installed
        raise ImportError(
            'a sharded checkpoint (`[run] checkpoint_format` "shards", the default of a run '
            "with `parallel.fsdp` > 1 or several processes) needs orbax-checkpoint: "
            "`pip install 'itde[scale]'`, or set `run.checkpoint_format = \"file\"` (the "
            "whole state gathered into one file by process 0)"
        ) from None
    return ocp, ocp.Checkpointer(ocp.StandardCheckpointHandler())


def save(directory: str | Path, step: int, state, meta: dict) -> Path:
    """Write `state = (model, opt_state)` at `step` into `directory`, each process its own
    shards. A collective: every process calls it, at the same point, with its part of the
    same global state (which stays where it is: nothing is gathered)."""
    directory = Path(directory)
    ocp, checkpointer = _checkpointer()
    name = f"state-{step:08d}"
    tree = {_key(i): x for i, x in enumerate(_arrays(state))}
    tree[_STEP] = np.asarray(step, np.int64)
    # force: a state directory of this step without a sidecar naming it is the remnant of
    # a run killed between the two (never a committed checkpoint): it is replaced
    checkpointer.save((directory / name).absolute(), args=ocp.args.StandardSave(tree),
                      force=True)  # fmt: skip
    # every process hashes a share of the files; all of them learn every digest
    root = directory / name
    paths = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    mine = {p: list(_sha256(root / p)) for p in paths[jax.process_index() :: jax.process_count()]}
    files = {}
    for part in _gather(mine):
        files.update(part)
    sidecar = dict(meta)
    sidecar.update(
        format=FORMAT,
        step=int(step),
        leaves=name,
        files=files,
        bytes=sum(n for n, _ in files.values()),
        sha256=_listing(files),
        versions=ckpt.versions(),
        shapes=ckpt.shapes(state),
        config_sha256=ckpt.config_digest(meta["config"]),
        processes=jax.process_count(),
    )
    text = json.dumps(sidecar, indent=1, sort_keys=True).encode()

    def commit():
        atomic_write(directory / ckpt.SIDECAR, lambda f: f.write(text))
        remove_others(directory, name)

    # process 0 commits; the broadcast of its outcome is the barrier after the save
    dist.on_main(commit, errors=(ckpt.CheckpointError,))
    return directory / ckpt.SIDECAR


def remove_others(directory: Path, keep: str) -> None:
    """Remove the state files and directories of `directory` other than `keep` (once the
    sidecar naming `keep` is committed)."""
    for old in Path(directory).glob("state-*"):
        if old.name == keep:
            continue
        with contextlib.suppress(OSError):
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()


def check_files(directory: str | Path, meta: dict) -> None:
    """Raise [`CheckpointError`][itde.train.CheckpointError] unless every file the sidecar
    lists is there with its size and SHA-256. A collective: the processes share the files,
    and the first failure (in sidecar order) is raised on all of them."""
    directory = Path(directory)
    root = directory / meta["leaves"]
    files = meta["files"]
    if not isinstance(files, dict) or _listing(files) != meta["sha256"]:
        raise ckpt.CheckpointError(
            f"checkpoint {str(directory)!r}: the file list of {ckpt.SIDECAR} differs from the "
            "SHA-256 it records; the sidecar was edited or damaged"
        )
    names = sorted(files)
    problems = []
    if not root.is_dir():
        problems.append(
            f"the state directory {meta['leaves']!r} named by {ckpt.SIDECAR} is missing"
        )
    else:
        for name in names[jax.process_index() :: jax.process_count()]:
            path = root / name
            if not path.is_file():
                problems.append(f"the file {name!r} of its state directory is missing")
                continue
            size, digest = _sha256(path)
            if size != files[name][0]:
                problems.append(
                    f"{str(path)!r} is truncated or damaged: {size} bytes, the sidecar "
                    f"records {files[name][0]}"
                )
            elif digest != files[name][1]:
                problems.append(f"{str(path)!r} is corrupted: its SHA-256 differs from the "
                                "sidecar's")  # fmt: skip
    found = [p for part in _gather(problems) for p in part]
    if found:
        raise ckpt.CheckpointError(f"checkpoint {str(directory)!r}: {found[0]}")


def load(directory: str | Path, template, meta: dict, mesh):
    """Read `(model, opt_state)` of a format-3 checkpoint into the structure of `template`,
    every array leaf placed on `mesh` in its FSDP layout
    ([`fsdp_sharding`][itde.train.fsdp_sharding]), whatever mesh wrote it. A collective.

    **Returns:** `(state, meta)`.
    """
    directory = Path(directory)
    ckpt.check_shapes(directory, template, meta)
    check_files(directory, meta)
    ocp, checkpointer = _checkpointer()
    arrays = _arrays(template)
    target = {
        _key(i): jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shd.fsdp_sharding(x, mesh))
        for i, x in enumerate(arrays)
    }
    target[_STEP] = np.zeros((), np.int64)
    path = (directory / meta["leaves"]).absolute()
    try:
        got = checkpointer.restore(path, args=ocp.args.StandardRestore(target))
    except (ValueError, OSError, KeyError) as e:  # pragma: no cover - digests checked above
        raise ckpt.CheckpointError(f"checkpoint {str(directory)!r}: Orbax cannot read it: {e}")
    if int(got[_STEP]) != meta["step"]:
        raise ckpt.CheckpointError(
            f"checkpoint {str(directory)!r}: the state directory {meta['leaves']!r} holds step "
            f"{int(got[_STEP])} but {ckpt.SIDECAR} says step {meta['step']!r}; the sidecar was "
            "edited or mixed with another run's state. Resume another checkpoint"
        )
    restored = iter([got[_key(i)] for i in range(len(arrays))])
    state = jax.tree.map(lambda x: next(restored) if eqx.is_array(x) else x, template)
    return state, meta
