r"""How a run is laid out over its devices: a 2-D mesh, the batch split over all of it, and
the parameters and optimiser state sharded over one of its axes (FSDP), all through JAX's
own sharding (`NamedSharding`, `with_sharding_constraint`): no collective is written by
hand, XLA inserts them.

**The mesh.** [`make_mesh`][itde.train.make_mesh]`(devices, fsdp)` arranges the devices
as `(len(devices) / fsdp, fsdp)` with the axes `("data", "fsdp")`; consecutive devices
(those of one host, or of one fast interconnect) share the `"fsdp"` axis, whose
all-gathers are the most frequent collectives of a step.

**The batch** is split along its first axis over both axes,
`PartitionSpec(("data", "fsdp"))`: every device holds `batch_size / devices` examples.

**The parameters and the optimiser state** follow one rule,
[`fsdp_spec`][itde.train.fsdp_spec], applied to every array leaf by its shape alone (so
Adam's moments are laid out as their parameters): an array of at least
[`MIN_SHARD_SIZE`][itde.train.MIN_SHARD_SIZE] elements is split over `"fsdp"` along its
largest axis whose length `fsdp` divides (the first such axis on a tie); a smaller array,
a scalar, or one with no axis `fsdp` divides stays replicated. With `fsdp = 1` everything
is replicated: plain data parallelism.

**The step** (`itde.train.make_step` with `mesh=`) gathers the parameters (a sharding
constraint to replicated: one all-gather) for the forward and backward passes, constrains
the gradient to the parameters' layout (a reduce-scatter instead of an all-reduce), and
updates each device's shard of the parameters and Adam moments, which leave the step in the
same layout. What FSDP saves is therefore the memory that persists between steps —
parameters, gradients' accumulator and optimiser state, about three copies of the model,
divided by `fsdp` — not the transient full copy the solve uses within a step.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA, FSDP = "data", "fsdp"  # the mesh axes
BATCH = PartitionSpec((DATA, FSDP))  # the batch: first axis over every device
MIN_SHARD_SIZE = 1024
"""Arrays with fewer elements stay replicated (4 KiB in float32): sharding them would save
less memory than the latency of their all-gather costs."""


def check_fsdp(fsdp: int, n: int, what: str = "`parallel.fsdp`") -> None:
    """Raise unless `fsdp` is a positive integer that divides the `n` devices."""
    if isinstance(fsdp, bool) or not isinstance(fsdp, int | np.integer) or fsdp < 1:
        raise ValueError(f"{what}={fsdp!r} must be a positive integer (1: no sharding).")
    if n % fsdp:
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"{what}={fsdp} does not divide the {n} devices of the run: the mesh is "
            f"(devices / fsdp, fsdp). Set it to a divisor of {n} ({divisors}), or run on a "
            f"multiple of {fsdp} devices (with --resume: pass --config, the checkpoint's "
            "config with that one change; `parallel.fsdp` may change on resume)."
        )


def make_mesh(devices=None, fsdp: int = 1) -> Mesh:
    """The run's 2-D mesh `("data", "fsdp")` of shape `(len(devices) / fsdp, fsdp)`.

    **Arguments:**

    - `devices`: the devices (default `jax.devices()`, every process's in a multi-host
      run); consecutive devices share the `"fsdp"` axis.
    - `fsdp`: how many devices share one copy of the parameters (1: replicated).
    """
    devices = jax.devices() if devices is None else list(devices)
    check_fsdp(fsdp, len(devices), "`fsdp`")
    return Mesh(np.asarray(devices).reshape(len(devices) // fsdp, fsdp), (DATA, FSDP))


def fsdp_spec(shape, fsdp: int, min_size: int = MIN_SHARD_SIZE) -> PartitionSpec:
    """The `PartitionSpec` of a parameter or optimiser-state array of `shape` on a mesh
    whose `"fsdp"` axis has `fsdp` devices.

    The largest axis whose length `fsdp` divides (the first on a tie) is split over
    `"fsdp"`; replicated (`PartitionSpec()`) when `fsdp == 1`, when the array has fewer
    than `min_size` elements (default [`MIN_SHARD_SIZE`][itde.train.MIN_SHARD_SIZE]) or
    when no axis is divisible.
    """
    shape = tuple(shape)
    if fsdp == 1 or math.prod(shape) < min_size:
        return PartitionSpec()
    axes = [i for i, n in enumerate(shape) if n % fsdp == 0]
    if not axes:
        return PartitionSpec()
    axis = max(axes, key=lambda i: (shape[i], -i))
    return PartitionSpec(*(FSDP if i == axis else None for i in range(axis + 1)))


def fsdp_sharding(x, mesh: Mesh, min_size: int = MIN_SHARD_SIZE) -> NamedSharding:
    """The `NamedSharding` of the array `x` on `mesh` by [`fsdp_spec`][itde.train.fsdp_spec]."""
    return NamedSharding(mesh, fsdp_spec(x.shape, mesh.shape[FSDP], min_size))


def shard(tree, mesh: Mesh, min_size: int = MIN_SHARD_SIZE):
    """Put every array leaf of `tree` (a model, an optimiser state) on `mesh`, each laid
    out as [`fsdp_spec`][itde.train.fsdp_spec] lays out its shape: split over the mesh's
    `"fsdp"` axis along its largest divisible axis, replicated where it is small, has no
    divisible axis or the mesh has `fsdp = 1`.

    Training places its state with it; it also serves inference on a model that does not
    fit one device, e.g. a converted Hugging Face model:

        lm = itde.train.shard(itde.from_hf(model), itde.train.make_mesh(fsdp=8))
        logits = jax.jit(lambda m, x: m(x))(lm, ids)   # XLA gathers the weights per use

    The sharded model computes the same function (the sharded products only reorder
    sums). Works across hosts: each process supplies its own shards of the same global
    value, which must be on the host or fully addressable (an initial or restored state).

    **Arguments:**

    - `tree`: any PyTree; its non-array leaves (static fields, None) are kept as they are.
    - `mesh`: a `jax.sharding.Mesh` with an axis `"fsdp"`, e.g.
      [`make_mesh`][itde.train.make_mesh]`(fsdp=n)`.
    - `min_size`: arrays with fewer elements stay replicated (default
      [`MIN_SHARD_SIZE`][itde.train.MIN_SHARD_SIZE]).

    **Returns:** `tree` with every array leaf a `jax.Array` on `mesh`.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"`mesh` must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one with "
            "itde.train.make_mesh(fsdp=n)."
        )
    if FSDP not in mesh.axis_names:
        raise ValueError(
            f"`mesh` has the axes {tuple(mesh.axis_names)}, without {FSDP!r}, the axis "
            "parameters are split over; build it with itde.train.make_mesh(devices, fsdp)."
        )
    if isinstance(min_size, bool) or not isinstance(min_size, int | np.integer) or min_size < 0:
        raise ValueError(
            f"`min_size`={min_size!r} must be a non-negative integer (a number of elements)."
        )

    def put(x):
        if not eqx.is_array(x):
            return x
        host = np.asarray(x)
        sharding = fsdp_sharding(host, mesh, min_size)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree)


def constrain(tree, mesh: Mesh, *, replicated: bool = False, min_size: int = MIN_SHARD_SIZE):
    """Inside `jit`: constrain every array leaf of `tree` to its FSDP layout on `mesh`
    (or, `replicated=True`, to a full copy on every device: the all-gather of FSDP)."""
    whole = NamedSharding(mesh, PartitionSpec())

    def put(x):
        if not eqx.is_array(x):
            return x
        sharding = whole if replicated else fsdp_sharding(x, mesh, min_size)
        return jax.lax.with_sharding_constraint(x, sharding)

    return jax.tree.map(put, tree)


def to_host(tree):
    """Every array leaf of `tree` as a whole NumPy array on every process (for a
    checkpoint). A sharded array that spans processes is gathered with
    `multihost_utils.process_allgather`, a collective: every process must call this, at
    the same point, with the same tree."""

    def get(x):
        if not isinstance(x, jax.Array):
            return np.asarray(x) if eqx.is_array(x) else x
        if x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(get, tree)
