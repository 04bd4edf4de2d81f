r"""The optimiser and the training step. Training solves the control problem of the paper —
minimise the loss of $u(\cdot, \cdot, T)$ over the controls $\theta(t)$ — by AdamW through
the depth solve.

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
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._roles import DECAY, FROZEN, parameter_roles
from . import _sharding as shd
from ._continuity import regularised_loss
from ._model import loss_fn


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
