r"""[`Run`][itde.train.Run]: everything a training run needs, built from its config (task, model template,
optimiser, keys, mesh), used by the loop ([`train`][itde.train.train]) and by `eval` /
`sample` to rebuild a checkpoint.

**Reproducibility.** Initialisation, the training batches and the held-out data are pure
functions of `optim.seed` (`fold_in(key(seed), 0 | 1 | 2)`; batch $s$ from
`fold_in(data_key, s)`), so a run resumed from its step-$k$ checkpoint ends bit-for-bit
equal to an uninterrupted run (same devices, layout and versions).
"""

from __future__ import annotations

import math
import uuid

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import _checkpoint as ckpt
from . import _distributed as dist
from . import _formats as formats
from . import _sharding as shd
from ._budget import check_fits
from ._config import COMPUTE_DTYPES, ConfigError, TrainExperiment, to_dict
from ._continuity import DepthRegularisation
from ._multilevel import MOMENTS, PROLONGATIONS, RESTRICTIONS, LevelSchedule, Transfer
from ._optim import make_optimizer, make_schedule, make_step
from ._tasks import TASKS

_ERRORS = (ckpt.CheckpointError, ConfigError)  # raised again on every process of a run


def check_batch(batch_size: int, n: int, what: str = "`optim.batch_size`", k: int = 1) -> None:
    """Raise unless `batch_size` is a multiple of the `n` devices of the mesh (times the
    `k` micro-batches of `[optim] accumulate`)."""
    if batch_size % n:
        up = -(-batch_size // n) * n
        raise ValueError(
            f"{what}={batch_size} is not divisible by the {n} devices of the data-parallel "
            f"mesh; set it to a multiple of {n} (e.g. {up}), or run on fewer devices "
            "(CUDA_VISIBLE_DEVICES / XLA_FLAGS)."
        )
    if batch_size % (n * k):
        up = -(-batch_size // (n * k)) * n * k
        raise ValueError(
            f"{what}={batch_size} does not split into `optim.accumulate`={k} micro-batches "
            f"over the {n} devices (each device needs the same share of every micro-batch); "
            f"set it to a multiple of {n * k} (e.g. {up}), or lower `optim.accumulate`."
        )


def place(tree, sharding: NamedSharding):
    """Put every array leaf of `tree` on `sharding` (works across hosts: each process
    supplies only its addressable shards, from the same global value)."""

    def put(x):
        if not eqx.is_array(x):
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


class Run:
    """Everything a run needs, built from a config: the task (data, model, loss), model
    template, optimiser, keys, mesh. Used by `train`, and by `eval` / `sample` to rebuild a
    checkpoint.

    **Arguments:**

    - `cfg`: the [`TrainExperiment`][itde.train.TrainExperiment].
    - `devices`: the devices of the mesh (default all).
    - `task`: the task object (default `TASKS[cfg.task.name](cfg.task)`; pass
      `TASKS[name].from_checkpoint(...)` to evaluate without the data files).
    - `fsdp`: the devices that share one copy of the parameters (default
      `cfg.parallel.fsdp`; 1 to evaluate a sharded run's checkpoint on any devices).

    **Attributes** used by the loop: `mesh` (`("data", "fsdp")`), `batch_sharding`,
    `replicated`, `optimizer`, `schedule`, `compute_dtype`, and
    [`place_state`][itde.train.Run.place_state], which puts a state on the run's layout.
    """

    def __init__(self, cfg: TrainExperiment, devices=None, *, task=None, fsdp=None):
        self.cfg = cfg
        self.task = TASKS[cfg.task.name](cfg.task) if task is None else task
        key = type(self.task).tokens_key
        check_fits(cfg, int(getattr(cfg.task, key)), tokens_name=f"task.{key}")
        root = jax.random.key(cfg.optim.seed)
        self.init_key = jax.random.fold_in(root, 0)
        self.data_key = jax.random.fold_in(root, 1)
        self.eval_key = jax.random.fold_in(root, 2)
        devices = jax.devices() if devices is None else list(devices)
        self.fsdp = cfg.parallel.fsdp if fsdp is None else fsdp
        shd.check_fsdp(self.fsdp, len(devices), "`parallel.fsdp`" if fsdp is None else "`fsdp`")
        check_batch(cfg.optim.batch_size, len(devices))
        self.mesh = shd.make_mesh(devices, self.fsdp)
        self.batch_sharding = NamedSharding(self.mesh, shd.BATCH)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.optimizer = make_optimizer(cfg.optim)
        self.schedule = make_schedule(cfg.optim)
        dtype = COMPUTE_DTYPES[cfg.run.dtype]
        self.compute_dtype = None if dtype is None else jnp.dtype(dtype)
        c = cfg.continuity
        self.regularisation = DepthRegularisation(c.consistency, c.transport)
        # who the checkpoints and metrics rows belong to (process 0's is the one written)
        self.run_id = uuid.uuid4().hex[:16]
        ml = cfg.multilevel
        self.levels = self.transfer = None  # multilevel training in depth, if configured
        if ml.active:
            self.levels = LevelSchedule.from_shares(
                ml.levels(cfg.model), ml.shares, cfg.optim.steps
            )
            self.transfer = Transfer(
                RESTRICTIONS[ml.restriction], PROLONGATIONS[ml.prolongation], MOMENTS[ml.moments]
            )

    def at_level(self, model, opt_state, step: int):
        """`(model, opt_state)` at the depth step training step `step` runs at (the
        `[multilevel]` schedule; unchanged without one), placed on the run's layout."""
        if self.levels is None or model.dt == self.levels.dt(step):
            return model, opt_state
        return self.place_state(*self.transfer(model, opt_state, self.levels.dt(step)))

    def init_state(self):
        """The untrained `(model, opt_state)` of the config (also the checkpoint template)."""
        model = self.task.init_model(self.cfg.model, self.init_key, dtype=jnp.float32)
        opt_state = self.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        return model, opt_state

    def place_state(self, model, opt_state):
        """`(model, opt_state)` placed on the run's mesh: each array sharded over `"fsdp"`
        by `itde.train.fsdp_spec`, or replicated where `fsdp = 1` (host or fully
        addressable arrays, e.g. from [`init_state`][itde.train.Run.init_state])."""
        return shd.shard(model, self.mesh), shd.shard(opt_state, self.mesh)

    def make_step(self):
        """[`make_step`][itde.train.make_step] with this run's optimiser, task, compute
        dtype, `[optim] accumulate`, mesh and `[continuity]` terms: the step `train`
        takes."""
        check_batch(self.cfg.optim.batch_size, self.mesh.size, k=self.cfg.optim.accumulate)
        return make_step(
            self.optimizer,
            self.task,
            self.compute_dtype,
            accumulate=self.cfg.optim.accumulate,
            mesh=self.mesh,
            regularisation=self.regularisation,
        )

    def meta(self) -> dict:
        out = {
            "config": to_dict(self.cfg),
            "run_id": self.run_id,
            "data_key": np.asarray(jax.random.key_data(self.data_key)).tolist(),
            "data_key_impl": str(jax.random.key_impl(self.data_key)),
            "task": self.task.checkpoint_meta(),
        }
        if self.cfg.model.hf_init is not None:
            out["init"] = self.init_meta()
        return out

    def init_meta(self) -> dict:
        """The Hugging Face directory of `[model] init` and the SHA-256 of its files
        (`HFInit.record`, computed once per run)."""
        if getattr(self, "_init_meta", None) is None:
            self._init_meta = self.cfg.model.hf_init.record()
        return self._init_meta

    def check_init(self, meta: dict, directory) -> None:
        """Raise if the Hugging Face directory a checkpoint's run started from has changed
        since (resuming would not continue the same run)."""
        if self.cfg.model.hf_init is None:
            return
        stored = (meta.get("init") or {}).get("sha256")
        if stored != self.init_meta()["sha256"]:
            raise ckpt.CheckpointError(
                f"checkpoint {str(directory)!r} started from `model.init`={self.cfg.model.init!r}"
                ", whose files (config.json, weights, tokenizer.json) have changed since (their "
                "SHA-256 differs from the checkpoint's): resuming would not continue the same "
                "run. Restore the directory, or start a new run (--overwrite / another --out)"
            )

    def batch(self, step: int):
        """Training batch `step` of the stream, sharded over the mesh."""
        x, y = self.task.train_batch(
            jax.random.fold_in(self.data_key, step), self.cfg.optim.batch_size
        )
        return place((x, y), self.batch_sharding)

    def eval_chunks(self, size: int | None = None, task=None):
        """The held-out set, `size` examples (default `task.eval_size`) rounded up to whole
        batches, as sharded chunks; fixed by the seed. `task`: another task to draw them
        from (e.g. `run.task.on_grid(128)`)."""
        task = self.task if task is None else task
        bs = self.cfg.optim.batch_size
        size = self.cfg.task.eval_size if size is None else size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"`size`={size!r} must be a positive number of held-out examples.")
        n = math.ceil(size / bs)
        return [
            place(task.eval_batch(jax.random.fold_in(self.eval_key, i), bs), self.batch_sharding)
            for i in range(n)
        ]

    def check_meta(self, meta: dict, directory) -> None:
        """Raise if a checkpoint's data stream or task data differs from this run's."""
        mine = self.meta()
        for key in ("data_key", "data_key_impl", "task"):
            if meta.get(key) != mine[key]:
                raise ckpt.CheckpointError(
                    f"checkpoint {str(directory)!r} was written with another `{key}` than this "
                    "run reproduces (a different seed, PRNG implementation or data file); "
                    "resuming would not continue the same run"
                )

    def restore(self, directory, meta: dict | None = None):
        """`(model, opt_state, meta)` from a checkpoint directory, placed on the mesh in
        the run's layout ([`place_state`][itde.train.Run.place_state]).

        Only process 0 reads the sidecar and a single-file (format 2) checkpoint: they
        reach the other processes by broadcast, and so does any error it finds. A sharded
        (format 3) checkpoint is read by every process, each the pieces its devices hold
        on this run's mesh, which may differ from the writer's."""
        if meta is None:
            meta = dist.on_main(lambda: ckpt.read_meta(directory), errors=_ERRORS)
        # the state of a multilevel run is at the level of its last step
        template = self.at_level(*self.init_state(), max(int(meta["step"]) - 1, 0))
        self.check_meta(meta, directory)
        reader = formats.READERS[meta["format"]]  # read_meta accepts no other number
        (model, opt_state), meta = reader.load(directory, template, meta, self.mesh)
        return model, opt_state, meta
