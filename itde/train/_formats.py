"""The checkpoint formats of a run (`[run] checkpoint_format`), and the reader of each
sidecar `format` number.

- `"file"` (format 2, `itde.train._checkpoint`): the state gathered whole on every
  process and written by process 0 into one file; only process 0 needs to see the output
  directory.
- `"shards"` (format 3, `itde.train._shards`): each process writes the shards its
  devices hold (Orbax); nothing is gathered, and every process must see the directory.
- `"auto"` (the default): `"shards"` where the run is sharded (`parallel.fsdp` > 1 or
  several processes), `"file"` on one process with replicated parameters.

A checkpoint is read by its own format number, whatever the resuming run would write.
"""

from __future__ import annotations

import jax

from . import _checkpoint as ckpt
from . import _distributed as dist
from . import _sharding as shd
from . import _shards
from ._config import ConfigError

_ERRORS = (ckpt.CheckpointError, ConfigError)


class File:
    """One state file, gathered; process 0 writes it and reads it for everyone."""

    format = ckpt.FORMAT

    @staticmethod
    def save(out, step, state, meta):
        # every process gathers the (sharded) state; process 0 writes it, and the
        # broadcast of its outcome is the barrier after the save
        host = shd.to_host(state)

        def write() -> None:  # None: on_main broadcasts the result (a Path is not JSON)
            ckpt.save(out, step, host, meta)

        dist.on_main(write, errors=_ERRORS)

    @staticmethod
    def load(directory, template, meta, mesh):
        raw = dist.on_main(lambda: ckpt.read_leaves(directory, meta), errors=_ERRORS)
        state, meta = ckpt.load(directory, template, meta, raw=raw)
        return shd.shard(state, mesh), meta


class Shards:
    """Per-process shards (Orbax), read back in the layout of any mesh."""

    format = ckpt.SHARDED

    @staticmethod
    def save(out, step, state, meta):
        _shards.save(out, step, state, meta)

    @staticmethod
    def load(directory, template, meta, mesh):
        return _shards.load(directory, template, meta, mesh)


FORMATS = {"file": File, "shards": Shards}
READERS = {f.format: f for f in FORMATS.values()}


def writer(name: str, mesh):
    """The format a run on `mesh` writes for `[run] checkpoint_format` = `name`."""
    if name in FORMATS:
        return FORMATS[name]
    sharded = mesh.shape[shd.FSDP] > 1 or jax.process_count() > 1
    return Shards if sharded else File
