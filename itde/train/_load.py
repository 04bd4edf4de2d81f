"""`itde.train.load`: the trained model of a run directory, with its config and metadata."""

from __future__ import annotations

import os
from pathlib import Path

import jax

from . import _checkpoint as ckpt
from ._config import TrainExperiment, from_dict, load_config


def load(directory, path=None):
    """The trained model of a run directory written by `itde train` (or
    [`train`][itde.train.train]), with its config and metadata.

    ```python
    model, cfg, meta = itde.train.load("runs/sort")
    logits = itde.train.predict(model, x)   # x: token ids, shape (batch, tokens)
    print(meta["step"], meta["run_id"], cfg.model.scheme)
    ```

    The directory's last checkpoint is read and checked as on `--resume` (the sidecar,
    the state file's size and SHA-256, every array's shape and dtype against the model
    the stored config builds); the task is rebuilt from the checkpoint, so no data file
    is read. The model is placed on one (local) device, whole, whatever `[parallel] fsdp` the
    run trained with and whichever format it wrote (one file, or the shards of every
    process of a sharded run: each array is assembled from its shards).

    The sidecar holds the config's paths absolute (the Hugging Face directory of
    `[model] init` above all, whose model the run's architecture is read from), so a run
    loads from any working directory. A run written by an itde before that holds them as
    given, relative to the folder it was trained in: they are read from the working
    directory or the folders above `directory`, the first where `init` is the directory
    the run started from (its files' SHA-256 is the sidecar's).

    **Arguments:**

    - `directory`: the run's output directory (`--out`, `out=`), the one holding
      `checkpoint.json`.
    - `path`: only for the earlier spelling `load(TrainExperiment, path)`, which reads a
      TOML config as [`load_config`][itde.train.load_config] does.

    **Returns:** `(model, cfg, meta)`: the trained model (a
    [`TokenModel`][itde.train.TokenModel] or [`FieldModel`][itde.train.FieldModel]), its
    [`TrainExperiment`][itde.train.TrainExperiment], and the checkpoint's sidecar as a
    dict: `step`, `run_id`, `wall_s` (training time), `config`, `versions` (of Python,
    JAX, Equinox, ...), `task` (task metadata, e.g. a character vocabulary), `data_key`,
    `shapes`, and the state file's `leaves`, `bytes` and `sha256`.

    **Raises:** [`CheckpointError`][itde.train.CheckpointError] naming `directory` for a
    missing directory, one without a checkpoint, or a damaged or mismatched checkpoint.
    """
    if isinstance(directory, type):  # the earlier `load(TrainExperiment, path)`
        if path is None:
            raise TypeError(
                f"`load({directory.__name__})` needs the TOML file: "
                f"`itde.train.load_config({directory.__name__}, path)`; to read a run "
                "directory, pass only the directory: `itde.train.load('runs/sort')`."
            )
        return load_config(directory, path)
    if path is not None:
        raise TypeError(
            f"`path`={path!r} is only for `load(TrainExperiment, path)` (a TOML config); a "
            "run is read from its directory alone: `model, cfg, meta = itde.train.load(dir)`."
        )
    return read_run(directory, "`directory`")


def read_run(directory, name: str, spread: bool = False):
    """`load(directory)`, naming the argument `name` (e.g. `--checkpoint`) in errors.
    `spread`: place the model, replicated, on the most devices of the run's processes whose
    number divides the batch size (where `Run(cfg, devices=model_devices(cfg), fsdp=1)`
    splits its batches), not one local device."""
    if not isinstance(directory, str | os.PathLike):
        raise TypeError(
            f"{name}={directory!r} must be the path (str or pathlib.Path) of a run "
            "directory written by `itde train`, e.g. 'runs/sort'."
        )
    directory = Path(directory)
    if directory.is_file() and directory.suffix == ".toml":
        raise ckpt.CheckpointError(
            f"{name}={str(directory)!r} is a TOML config, not a run directory; read a "
            "config with `itde.train.load_config(TrainExperiment, path)`, a trained model "
            "from the run's output directory (`--out`), e.g. `itde.train.load('runs/sort')`."
        )
    from ._run import Run
    from ._tasks import TASKS

    try:
        meta = ckpt.read_meta(directory)
        source = f"{directory}/{ckpt.SIDECAR}"
        cfg = from_dict(TrainExperiment, meta["config"], source)
        task = TASKS[cfg.task.name].from_checkpoint(cfg.task, meta.get("task", {}))
        devices = batch_devices(cfg) if spread else jax.local_devices()[:1]
        run = Run(cfg, devices=devices, task=task, fsdp=1)
        model, _, meta = run.restore(directory, meta)
    except ckpt.CheckpointError as e:
        damaged = (directory / ckpt.SIDECAR).is_file()
        fix = "; restore the directory's files from a copy, or train again" if damaged else ""
        raise ckpt.CheckpointError(f"{name}={str(directory)!r}: {e}{fix}") from None
    return model, cfg, meta


def batch_devices(cfg) -> list:
    """The first `n` of `jax.devices()`, `n` the most that divides `optim.batch_size`."""
    every = jax.devices()
    n = max(d for d in range(1, len(every) + 1) if cfg.optim.batch_size % d == 0)
    return every[:n]
