r"""Training: the control problem of the paper — minimise the loss of $u(\cdot, \cdot, T)$ over
the controls $\theta(t)$ — solved by AdamW through the depth solve.

**The step.** [`make_step`][] returns `step(model, opt_state, batch) -> (model,
opt_state, loss)`, a pure function under `eqx.filter_jit`: the loss is the batch mean of
the per-example loss (`jax.vmap` of the model), its gradient flows back through
`itde.solve` with `diffrax.RecursiveCheckpointAdjoint` (discretise-then-optimise: the
exact gradient of the discrete scheme), and the update is
`optax.chain(clip_by_global_norm, adamw)` with a linear warm-up and cosine decay. With
`[run] dtype = "bfloat16"` the forward and backward passes run on a bfloat16 copy of the
parameters and inputs; the master parameters, gradients and optimiser state stay float32.

**Data parallelism and FSDP.** The devices form a 2-D `jax.sharding.Mesh` with axes
`("data", "fsdp")` of shape `(devices / fsdp, fsdp)` (`[parallel] fsdp`, default 1). The
batch axis is sharded over both (`PartitionSpec(("data", "fsdp"))`); with `fsdp = 1` the
parameters and optimiser state are replicated and XLA inserts the gradient all-reduce;
with `fsdp > 1` each large array of them is split over `"fsdp"` (the rule and the step's
gather / reduce-scatter: `itde.train._sharding`). The batch size must be a multiple of
the device count (times `[optim] accumulate`). On a CPU, test with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` set before JAX starts.

**Gradient accumulation.** With `[optim] accumulate = K` the step runs the batch as $K$
micro-batches of `batch_size / K` in a `jax.lax.scan` and applies the mean of their
gradients: the gradient of the whole batch, to round-off (`optax.MultiSteps` would instead
make $K$ calls one step, drawing $K$ batches and changing the step count, the schedule
and the checkpoint's optimiser state).

**Multi-host.** Call `jax.distributed.initialize()` (arguments or the cluster's
environment: coordinator address, process count and id) in every process before anything
else touches JAX, then run the same `itde train` command on every host. `jax.devices()`
is then the global device list, so the mesh spans all hosts; every process computes the
same global batch from `(seed, step)` and `jax.make_array_from_callback` places only its
own shards on its devices. Only process 0 reads or writes the output directory (sidecar,
checkpoint, metrics, plot): on `--resume` it checks the checkpoint and broadcasts the
sidecar and the state file to the other processes, and an error it finds stops every
process with the same message; after each save every process waits for process 0's
outcome, so none runs ahead of a checkpoint that failed. The exception is the sharded
checkpoint (`[run] checkpoint_format`, `itde.train._formats`; the default of a run of
several processes or `fsdp > 1`): each process writes and reads its own shards, in a
directory every process must see.

**Reproducibility.** Initialisation, the training batches and the held-out data are pure
functions of `optim.seed` (`fold_in(key(seed), 0 | 1 | 2)`; batch $s$ from
`fold_in(data_key, s)`), so a run resumed from its step-$k$ checkpoint ends bit-for-bit
equal to an uninterrupted run (same devices, layout and versions).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._io import check_output_location
from .._roles import DECAY, FROZEN, parameter_roles
from . import _checkpoint as ckpt
from . import _distributed as dist
from . import _formats as formats
from . import _sharding as shd
from ._budget import check_fits
from ._config import (
    COMPUTE_DTYPES,
    RESUMABLE_KEYS,
    ConfigError,
    TrainExperiment,
    differences,
    from_dict,
    to_dict,
)
from ._continuity import DepthRegularisation, continuity_metrics, regularised_loss
from ._evaluate import evaluate
from ._finetune import export, export_refusal
from ._model import loss_fn
from ._multilevel import MOMENTS, PROLONGATIONS, RESTRICTIONS, LevelSchedule, Transfer
from ._tasks import TASKS

_ERRORS = (ckpt.CheckpointError, ConfigError)  # raised again on every process of a run


# ----------------------------------------------------------------------- optimiser
def make_schedule(o) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup` steps, cosine decay to
    `lr * final_lr_ratio` at `steps`."""
    return optax.warmup_cosine_decay_schedule(
        0.0, o.lr, o.warmup, o.steps, end_value=o.lr * o.final_lr_ratio
    )


def _decay_mask(params):
    """Weight decay on the parameters whose fields declare it (kernels and embeddings:
    `itde.parameter_roles`), not on biases, gains or constraint sets."""
    return jax.tree.map(lambda role: role == DECAY, parameter_roles(params))


def _labels(params):
    r"""`"frozen"` where a module declares a parameter frozen (e.g. the scalars
    $\sigma_1, \sigma_2$ of a LayerNorm that also has a per-feature gain), `"train"`
    elsewhere (see `itde.parameter_roles`)."""
    roles = parameter_roles(params)
    return jax.tree.map(lambda role: "frozen" if role == FROZEN else "train", roles)


@functools.lru_cache(maxsize=32)
def make_optimizer(o) -> optax.GradientTransformation:
    """`clip_by_global_norm(clip_norm)` then AdamW on [`make_schedule`][], for every
    parameter but the redundant constraint-set scalars (see `_labels`). Cached per
    `[optim]` table, so that equal configs share one compiled step."""
    adamw = optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(
            make_schedule(o), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay, mask=_decay_mask
        ),
    )
    return optax.multi_transform({"train": adamw, "frozen": optax.set_to_zero()}, _labels)


def _micro_batches(batch, k: int, n: int, mesh):
    """`batch` as `k` micro-batches stacked on a new first axis: micro-batch $j$ takes the
    $j$-th `1/k` of each of the `n` device shards, so splitting it moves no data."""

    def split(x):
        if x.shape[0] % (n * k):
            raise ValueError(
                f"a batch of {x.shape[0]} examples does not split into `accumulate`={k} "
                f"micro-batches over {n} devices; make `optim.batch_size` a multiple of "
                f"{n * k} (accumulate x devices)."
            )
        m = x.shape[0] // (n * k)
        x = jnp.swapaxes(x.reshape(n, k, m, *x.shape[1:]), 0, 1)
        return x.reshape(k, n * m, *x.shape[3:])

    micro = jax.tree.map(split, batch)
    if mesh is not None:
        spec = NamedSharding(mesh, PartitionSpec(None, *shd.BATCH))
        micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), micro)
    return micro


def _value_and_grad(
    model, batch, task, compute_dtype, accumulate, mesh, fsdp_mesh, regularisation=None
):
    """The loss of `batch` and its gradient, as `accumulate` micro-batches summed in a
    `jax.lax.scan` and divided by their number (the running sum in the parameters'
    layout on `fsdp_mesh`, if given); the loss with the continuity terms of
    `regularisation`, if active."""
    if regularisation is not None and regularisation.active:
        objective = functools.partial(regularised_loss, reg=regularisation)
    else:
        objective = loss_fn
    value_and_grad = eqx.filter_value_and_grad(objective)
    if accumulate == 1:
        return value_and_grad(model, batch, task, compute_dtype)
    n = 1 if mesh is None else mesh.size
    micro = _micro_batches(batch, accumulate, n, mesh)

    def layout(tree):
        return tree if fsdp_mesh is None else shd.constrain(tree, fsdp_mesh)

    def body(carry, part):
        loss_sum, grad_sum = carry
        loss, grads = value_and_grad(model, part, task, compute_dtype)
        grad_sum = jax.tree.map(jnp.add, grad_sum, layout(grads))
        return (loss_sum + loss.astype(jnp.float32), grad_sum), None

    zeros = layout(jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array)))
    (loss, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
    return loss / accumulate, jax.tree.map(lambda g: g / accumulate, grads)


@eqx.filter_jit
def train_step(
    model, opt_state, batch, optimizer, task, compute_dtype=None, accumulate=1, mesh=None,
    regularisation=None,
):
    """One step of `optimizer` on the loss of `batch`: `(model, opt_state, loss)`.

    Pure in `(model, opt_state, batch)`; `optimizer`, `task`, `compute_dtype`,
    `accumulate`, `mesh` and `regularisation` (a
    [`DepthRegularisation`][itde.train.DepthRegularisation] or None) are static (compiled
    in). On a `mesh` with `fsdp > 1` the parameters are gathered for the passes, the
    gradient is reduce-scattered to their layout, and the parameters and optimiser state
    leave in it."""
    fsdp_mesh = mesh if mesh is not None and mesh.shape[shd.FSDP] > 1 else None
    params = eqx.filter(model, eqx.is_inexact_array)
    whole = model if fsdp_mesh is None else shd.constrain(model, fsdp_mesh, replicated=True)
    loss, grads = _value_and_grad(
        whole, batch, task, compute_dtype, accumulate, mesh, fsdp_mesh, regularisation
    )
    if fsdp_mesh is not None:
        grads = shd.constrain(grads, fsdp_mesh)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    model = eqx.apply_updates(model, updates)
    if fsdp_mesh is not None:
        model, opt_state = shd.constrain(model, fsdp_mesh), shd.constrain(opt_state, fsdp_mesh)
    return model, opt_state, loss


def make_step(
    optimizer: optax.GradientTransformation,
    task,
    compute_dtype=None,
    *,
    accumulate: int = 1,
    mesh: Mesh | None = None,
    regularisation=None,
):
    """The training step as a function of `(model, opt_state, batch)` only.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation`, e.g. `Run(cfg).optimizer`.
    - `task`: the task, an instance of a class of [`TASKS`][itde.train.TASKS] (its `loss`).
    - `compute_dtype`: e.g. `jnp.bfloat16` for the forward and backward passes (default:
      the parameters' dtype).
    - `accumulate`: micro-batches per step (`[optim] accumulate`): the batch is split
      into this many equal parts whose mean gradient the step applies.
    - `mesh`: the run's mesh (`Run(cfg).mesh`), where the parameters are sharded
      (`fsdp > 1`) or the batch is split into micro-batches; None: as the arrays come.
    - `regularisation`: the continuity terms added to the loss, a
      [`DepthRegularisation`][itde.train.DepthRegularisation] (e.g. `Run(cfg).regularisation`)
      or None.
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(
            f"`accumulate`={accumulate!r} must be a positive integer number of micro-batches "
            "(1: the whole batch at once)."
        )
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh such as `Run(cfg).mesh`, got "
            f"{type(mesh).__name__}."
        )
    if mesh is not None and set(mesh.axis_names) != {shd.DATA, shd.FSDP}:
        raise ValueError(
            f"`mesh` has the axes {mesh.axis_names}; the step needs {(shd.DATA, shd.FSDP)}, "
            "as `itde.train.make_mesh` builds."
        )
    return functools.partial(
        train_step,
        optimizer=optimizer,
        task=task,
        compute_dtype=compute_dtype,
        accumulate=accumulate,
        mesh=mesh,
        regularisation=regularisation,
    )


# ----------------------------------------------------------------------- sharding
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


def scalar(x) -> float:
    """A replicated scalar as a Python float (on any host of a multi-host mesh)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = x.addressable_data(0)
    return float(x)


def place(tree, sharding: NamedSharding):
    """Put every array leaf of `tree` on `sharding` (works across hosts: each process
    supplies only its addressable shards, from the same global value)."""

    def put(x):
        if not eqx.is_array(x):
            return x
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


# ----------------------------------------------------------------------- the run
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


def config_for_resume(directory, cfg: TrainExperiment | None, source: str, meta=None):
    """The config of a resumed run: the checkpoint's, or `cfg` if it agrees with it on
    everything but the keys in `RESUMABLE_KEYS`. `meta`: the sidecar, if already read."""
    meta = ckpt.read_meta(directory) if meta is None else meta
    stored = from_dict(TrainExperiment, meta["config"], f"{directory}/{ckpt.SIDECAR}")
    if cfg is None:
        return stored, meta
    # against the stored config read again, so that a key added since (at its default)
    # is no difference
    diff = [k for k in differences(to_dict(cfg), to_dict(stored)) if k not in RESUMABLE_KEYS]
    if diff:
        raise ConfigError(
            f"{source}: cannot resume {str(directory)!r} with this config: it differs from the "
            f"checkpoint's in {diff} (only {sorted(RESUMABLE_KEYS)} may change); omit "
            "--config to resume with the checkpoint's own config"
        )
    return cfg, meta


def _refuse_existing(out: Path) -> None:
    if (out / ckpt.SIDECAR).is_file():
        raise ckpt.CheckpointError(
            f"{str(out)!r} already holds a checkpoint (step "
            f"{ckpt.read_meta(out)['step']}); continue it (`itde train --resume {out}`, or "
            f"`itde.train.train(resume={str(out)!r})`), write elsewhere (`--out` / `out=`), "
            "or replace it (`--overwrite` / `overwrite=True`)"
        )


def _save(run, out: Path, step: int, state, meta: dict) -> None:
    """A collective: every process calls it (`itde.train._formats`)."""
    formats.writer(run.cfg.run.checkpoint_format, run.mesh).save(out, step, state, meta)


def restart_clock(bar) -> None:
    """Restart a tqdm bar's clock and rate averages at its current count, so that its rate
    and ETA come from the steps after this point (not from a step that compiled)."""
    n = bar.n
    bar.reset()  # count 0, clock and moving averages restarted
    bar.initial = bar.n = bar.last_print_n = n
    bar.refresh()


def _read_metrics(path: Path, upto: int, run_id: str | None = None) -> list[dict]:
    """The rows of `metrics.jsonl` up to step `upto`. A torn last line (a crash while it was
    appended) is dropped; every complete row is kept; damage elsewhere is an error, and so
    is a row of another run than `run_id` (the checkpoint's)."""
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                raise ValueError("not a row with an integer `step`")
        except ValueError as e:
            if all(not rest.strip() for rest in lines[i + 1 :]):
                break  # the torn tail of an interrupted write
            raise ValueError(
                f"{str(path)!r} line {i + 1} is damaged ({e}); remove that line to resume"
            ) from None
        if run_id is not None and row.get("run", run_id) != run_id:
            raise ValueError(
                f"{str(path)!r} line {i + 1} belongs to run {row['run']!r}, the checkpoint "
                f"beside it to run {run_id!r}: another run's checkpoint or metrics were copied "
                "into this directory. Resume each run from its own directory (or remove the "
                "rows that are not the checkpoint's run)"
            )
        rows.append(row)
    return [r for r in rows if r["step"] <= upto]


def _open(cfg, out, resume, devices, source, overwrite):
    """A run's configuration, output directory, `Run` and starting state (fresh, or
    restored from `resume`): `(cfg, out, run, model, opt_state, start, wall0, rows)`, with
    the metrics rows logged up to the restored step."""
    if cfg is not None and not isinstance(cfg, TrainExperiment):
        raise TypeError(
            f"`cfg` must be an itde.train.TrainExperiment, got {type(cfg).__name__}; read a "
            "TOML file with `itde.train.load_config(TrainExperiment, path)`."
        )
    meta = None
    if resume is not None:
        meta = dist.on_main(lambda: ckpt.read_meta(resume), errors=_ERRORS)
        cfg, meta = config_for_resume(resume, cfg, source, meta)
    cfg = TrainExperiment() if cfg is None else cfg
    if out is not None and not str(out).strip():
        raise ValueError(
            "`out`='' names no directory (it would write the run into the working "
            "directory); give a directory for metrics.jsonl, loss_curve.png and checkpoints."
        )
    out_name = "out"  # the argument, or the key it came from, named in errors
    if out is None:
        out_name = "resume" if resume is not None else "run.out"
        out = resume if resume is not None else (cfg.run.out or f"runs/{cfg.task.name}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"`out`={str(out)!r} is an existing file, not a directory; give a directory "
            "(new or one of an earlier run) for metrics.jsonl, loss_curve.png and checkpoints"
        )
    if resume is None and not overwrite:
        dist.on_main(lambda: _refuse_existing(out), errors=_ERRORS)
    # under a file, not writable, or a system path (/sys, /proc): said before any work
    dist.on_main(lambda: check_output_location(out, out_name), errors=_ERRORS)
    run = Run(cfg, devices)
    check_batch(cfg.optim.batch_size, run.mesh.size, k=cfg.optim.accumulate)
    if resume is not None:
        dist.on_main(lambda: run.check_init(meta, resume), errors=_ERRORS)
        model, opt_state, meta = run.restore(resume, meta)
        run.run_id = meta.get("run_id") or run.run_id  # checkpoints before run ids: a new one
        start, wall0 = int(meta["step"]), float(meta.get("wall_s", 0.0))
        path = Path(resume) / "metrics.jsonl"
        rows = _read_metrics(path, start, meta.get("run_id")) if dist.is_main() else []
    else:
        model, opt_state = run.place_state(*run.init_state())
        start, wall0, rows = 0, 0.0, []
    return cfg, out, run, model, opt_state, start, wall0, rows


def _diverged(error, step: int, last: dict, cfg) -> FloatingPointError:
    """A run-time check failed inside a training step: almost always the parameters grew
    non-finite (a learning rate too large). Say so, name `optim.lr`, and keep the check's own
    message."""
    fired = re.search(r"itde\.solve: [^\n]*", str(error))
    said = f" The check that fired: {fired.group(0)}" if fired else ""
    loss = f"{last['loss']:.4g} at step {last['step']}" if "loss" in last else "not logged yet"
    return FloatingPointError(
        f"training stopped at step {step + 1}: the state of the model's solve is not finite "
        f"(last logged loss: {loss}). The parameters most likely diverged: lower `optim.lr` "
        f"(now {cfg.optim.lr:g}) or `optim.clip_norm` (now {cfg.optim.clip_norm:g}), or "
        f"lengthen `optim.warmup` (now {cfg.optim.warmup}); the last checkpoint is kept.{said}"
    )


def _finish(out: Path, total: int, task, saved: bool) -> list[str]:
    """The loss curve of the run's metrics, and every file the run wrote."""
    from ._plot import plot_metrics

    plot_metrics(_read_metrics(out / "metrics.jsonl", total), out / "loss_curve.png", task)
    files = [out / "metrics.jsonl", out / "loss_curve.png"]
    if saved:
        files += [out / ckpt.SIDECAR, out / ckpt.read_meta(out)["leaves"]]
    return [str(f) for f in files]


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What [`train`][itde.train.train] returns.

    **Fields:** `step` (the last step taken), `metrics` (the last logged row: loss, lr,
    evaluation metrics), `wall_s` (training time, resumed runs included), `out` (the output
    directory), `files` (every file written, the checkpoint's state file included; empty
    when a resumed run was already complete), `complete` (the run reached `optim.steps`),
    `model` and `opt_state` (the trained model and optimiser state)."""

    step: int
    metrics: dict
    wall_s: float
    out: str
    files: list[str]
    complete: bool
    model: Any
    opt_state: Any


def train(
    cfg: TrainExperiment | None = None,
    *,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    devices=None,
    source: str = "<built-in default>",
    stop_at: int | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
    on_eval: Callable[[dict], None] | None = None,
) -> TrainResult:
    """Train a model; write `metrics.jsonl`, `loss_curve.png` and checkpoints into `out`.

    **Arguments:**

    - `cfg`: the experiment (default: the built-in sort task); with `resume` it may be
      None (use the checkpoint's config) or must agree with the checkpoint's.
    - `out`: output directory (default `resume`, else `cfg.run.out`).
    - `resume`: a checkpoint directory to continue from, exactly.
    - `devices`: the devices of the mesh (default all; `[parallel] fsdp` must divide
      their number).
    - `source`: the config's file name, for error messages.
    - `stop_at`: stop after this step (after its checkpoint, if one is due), as if the
      run were killed there; for tests and time-sliced jobs.
    - `progress`: show the progress (default `cfg.run.progress`): a tqdm bar on a
      terminal, a line each tenth of the run in a log.
    - `overwrite`: start afresh even if `out` holds a checkpoint (otherwise an error).
    - `on_eval`: called (on process 0) with each evaluated metrics row as it is logged, e.g.
      to print progress without a bar (`itde train --no-progress` prints one line each).

    A run started from a Hugging Face model (`[model] init = "hf:DIR"`) that completes as
    a per-layer network at `dt = 1` also writes the fine-tuned model to `out/hf`
    ([`export_hf`][itde.train.export_hf]).

    **Returns:** a [`TrainResult`][itde.train.TrainResult].
    """
    if on_eval is not None and not callable(on_eval):
        raise TypeError(
            f"`on_eval`={on_eval!r} must be a function of one metrics row (a dict) or None."
        )
    cfg, out, run, model, opt_state, start, wall0, rows = _open(
        cfg, out, resume, devices, source, overwrite
    )
    is_main = dist.is_main()
    total, r, bs = cfg.optim.steps, cfg.run, cfg.optim.batch_size
    if start >= total:  # a finished run: nothing to train, nothing is written
        return TrainResult(
            step=start,
            metrics=rows[-1] if rows else {},
            wall_s=wall0,
            out=str(out),
            files=[],
            complete=True,
            model=model,
            opt_state=opt_state,
        )
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write(
            out / "metrics.jsonl",
            lambda f: f.write("".join(json.dumps(r) + "\n" for r in rows).encode()),
        )
    step_fn = run.make_step()
    refine = cfg.continuity.refine if cfg.model.continuous else 0
    chunks = run.eval_chunks()
    show = r.progress if progress is None else progress
    from .._progress import progress_bar

    bar = progress_bar(total, "itde train", initial=start, enabled=show and is_main)
    t_start, t_log, n_log = time.perf_counter(), time.perf_counter(), 0
    done, saved = start, False
    last: dict = {}
    levels, ends = run.levels, () if run.levels is None else run.levels.ends
    for s in range(start, total):
        # JAX runs asynchronously: a check that fires in the step surfaces where its result
        # is first read (the loss, the evaluation, the checkpoint), so all of it is covered
        try:
            model, opt_state = run.at_level(model, opt_state, s)  # a multilevel switch
            model, opt_state, loss = step_fn(model, opt_state, run.batch(s))
            done, n_log = s + 1, n_log + 1
            evaluating = done % r.eval_every == 0 or done == total
            if done % r.log_every == 0 or evaluating or done in ends:
                loss_v = scalar(loss)
                now = time.perf_counter()
                rate = n_log * bs / max(now - t_log, 1e-9)
                t_log, n_log = now, 0
                row = {
                    "run": run.run_id,
                    "step": done,
                    "loss": loss_v,
                    "lr": float(run.schedule(s)),
                    "wall_s": wall0 + now - t_start,
                    "examples_per_s": rate,
                }
                if levels is not None:  # what each step of the interval ran at, and cost
                    depth = run.cfg.model.n_layers
                    row.update(level=levels.phase(s), dt=model.dt,
                               depth_steps=round(depth / model.dt), step_s=bs / rate)  # fmt: skip
                if evaluating:
                    row.update(evaluate(model, chunks, run.task, run.compute_dtype))
                    if refine:  # how far the model is from its own equation, refined
                        row.update(continuity_metrics(model, chunks[0][0], refine))
                last = row
                if is_main:
                    with open(out / "metrics.jsonl", "a") as f:
                        f.write(json.dumps(row) + "\n")
                    if evaluating and on_eval is not None:
                        on_eval(row)
                bar.set_postfix(loss=f"{loss_v:.4g}", ex_s=f"{rate:.0f}")
            if done % r.checkpoint_every == 0 or done == total:
                m = run.meta()
                m["wall_s"] = wall0 + time.perf_counter() - t_start
                _save(run, out, done, (model, opt_state), m)  # every process; a barrier
                saved = True
            bar.update(1)
            if s == start:
                restart_clock(bar)  # the first step compiled: its time says nothing of the rest
            if stop_at is not None and done >= stop_at:
                break
        except eqx.EquinoxRuntimeError as e:
            raise _diverged(e, s, last, cfg) from e
    bar.close()
    files = _finish(out, total, run.task, saved) if is_main else []
    init = cfg.model.hf_init
    if is_main and done >= total and export_refusal(model, from_hf=init is not None) is None:
        hf = export(shd.to_host(model), init, out / "hf", name="out/hf")
        files += sorted(str(f) for f in hf.iterdir())
    return TrainResult(
        step=done,
        metrics=last,
        wall_s=wall0 + time.perf_counter() - t_start,
        out=str(out),
        files=files,
        complete=done >= total,
        model=model,
        opt_state=opt_state,
    )
