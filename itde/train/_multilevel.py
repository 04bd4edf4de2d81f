r"""Multilevel training in depth (Lauga et al. 2025, arXiv 2504.18590; Chang et al., ICLR
2018): train the same equation at a coarse depth step first, then at the model's own.

A network is an equation on $[0, T]$; a *level* is the depth step $\Delta t$ it is solved
with. A [`LevelSchedule`][itde.train.LevelSchedule] says which level each training step
runs at (phases in order, each a share of the steps; a V-cycle is the phases
`[1, 2, 1]`-like in steps of layers); [`Transfer`][itde.train.Transfer] moves the
parameters and the optimiser's moments from one level to the next.

- **Per-layer controls** (`scheme = "lie"`, a `PiecewiseConstant` of $L$ layers of length
  $h$): the level $r\,\Delta t$ is the network of $L/r$ layers of length $r h$ run at
  $r\,\Delta t$. *Restriction* ([`RESTRICTIONS`][itde.train.RESTRICTIONS]) picks its layers
  from each group of $r$ consecutive fine layers: `"even"` the first of the group (layers
  0, 2, 4, ... for $r = 2$), `"odd"` the last (1, 3, 5, ...), `"mean"` their average.
  *Prolongation* ([`PROLONGATIONS`][itde.train.PROLONGATIONS]) gives back $L$ layers:
  `"copy"` repeats coarse layer $k$ on the $r$ fine layers of its group (two Euler steps of
  $h$ with the controls of one step of $2h$), `"linear"` interpolates the coarse layers,
  read at their midpoints, at the fine midpoints (constant beyond the first and last).
- **Smooth controls** (Legendre, spline): the parameters are the same at every step; a
  transfer changes $\Delta t$ only.

**The optimiser's moments** ([`MOMENTS`][itde.train.MOMENTS]): with `"transfer"` (the
default) Adam's first and second moments are parameter-shaped trees and go through the
same restriction or prolongation as the parameters (an injection or copy moves them
exactly; `"mean"` and `"linear"` average them, so the second moment stays $\ge 0$); with
`"reset"` they restart at zero on every switch. Either way the step counts are kept, so
the learning-rate schedule and Adam's bias correction run on over the whole run.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp

from .._controls import PiecewiseConstant

__all__ = [
    "MOMENTS",
    "PROLONGATIONS",
    "RESTRICTIONS",
    "AbstractMoments",
    "AbstractProlongation",
    "AbstractRestriction",
    "LevelSchedule",
    "Transfer",
    "coarsen",
]


# ----------------------------------------------------------------------- layer maps
class AbstractRestriction(eqx.Module):
    """Fine layers `[L, ...]` to coarse layers `[L / r, ...]`, one per group of `r`."""

    @abc.abstractmethod
    def restrict(self, a: jax.Array, r: int) -> jax.Array: ...


class Injection(AbstractRestriction):
    """The layer at position `offset` of each group of `r` (`-1`: the last)."""

    offset: int = eqx.field(static=True, default=0)

    def restrict(self, a, r):
        return a.reshape(a.shape[0] // r, r, *a.shape[1:])[:, self.offset]


class GroupMean(AbstractRestriction):
    """The mean of each group of `r` layers."""

    def restrict(self, a, r):
        return a.reshape(a.shape[0] // r, r, *a.shape[1:]).mean(axis=1).astype(a.dtype)


class AbstractProlongation(eqx.Module):
    """Coarse layers `[L / r, ...]` to fine layers `[L, ...]`."""

    @abc.abstractmethod
    def prolong(self, a: jax.Array, r: int) -> jax.Array: ...


class Copy(AbstractProlongation):
    """Coarse layer `k` on each fine layer `r k, ..., r k + r - 1`."""

    def prolong(self, a, r):
        return jnp.repeat(a, r, axis=0)


class Linear(AbstractProlongation):
    r"""Linear interpolation in depth between the coarse layers' midpoints
    $(k + 1/2) r h$, read at the fine midpoints $(j + 1/2) h$; constant beyond the first
    and last coarse midpoint."""

    def prolong(self, a, r):
        n = a.shape[0]
        x = (jnp.arange(n * r) + 0.5) / r - 0.5  # fine midpoints in coarse-layer units
        lo = jnp.clip(jnp.floor(x), 0, n - 1).astype(jnp.int32)
        hi = jnp.clip(lo + 1, 0, n - 1)
        w = jnp.clip(x - lo, 0.0, 1.0).reshape(-1, *([1] * (a.ndim - 1)))
        return ((1 - w) * a[lo] + w * a[hi]).astype(a.dtype)


#: Restrictions of per-layer controls by name (`[multilevel] restriction`).
RESTRICTIONS: dict[str, AbstractRestriction] = {
    "even": Injection(0),
    "odd": Injection(-1),
    "mean": GroupMean(),
}
"""Restrictions of per-layer controls by name (`[multilevel] restriction`): `"even"` the
first layer of each group of r (0, 2, 4, ... for r = 2), `"odd"` the last, `"mean"` their
mean."""
#: Prolongations of per-layer controls by name (`[multilevel] prolongation`).
PROLONGATIONS: dict[str, AbstractProlongation] = {"copy": Copy(), "linear": Linear()}
"""Prolongations of per-layer controls by name (`[multilevel] prolongation`): `"copy"`
repeats coarse layer k on its r fine layers, `"linear"` interpolates between the coarse
layers' midpoints."""


# ----------------------------------------------------------------------- moments
def _is_model(x) -> bool:
    return hasattr(x, "equation") and hasattr(x, "dt")


class AbstractMoments(eqx.Module):
    """What a level switch does to the parameter-shaped trees of the optimiser state,
    given `move` (the transfer of one such tree)."""

    @abc.abstractmethod
    def apply(self, opt_state, move): ...


class TransferMoments(AbstractMoments):
    """The moments go through the same restriction / prolongation as the parameters."""

    def apply(self, opt_state, move):
        return jax.tree.map(lambda x: move(x) if _is_model(x) else x, opt_state,
                            is_leaf=_is_model)  # fmt: skip


class ResetMoments(AbstractMoments):
    """The moments restart at zero (the step counts are kept)."""

    def apply(self, opt_state, move):
        def zero(x):
            return jax.tree.map(jnp.zeros_like, move(x)) if _is_model(x) else x

        return jax.tree.map(zero, opt_state, is_leaf=_is_model)


#: What a level switch does to the optimiser's moments (`[multilevel] moments`).
MOMENTS: dict[str, AbstractMoments] = {"transfer": TransferMoments(), "reset": ResetMoments()}
"""What a level switch does to Adam's moments (`[multilevel] moments`): `"transfer"` maps
them as the parameters, `"reset"` restarts them at zero; the step counts are kept."""


# ----------------------------------------------------------------------- transfer
def _replaced(module, **fields):
    """`module` with `fields` replaced, without its `__init__` checks: the optimiser's
    moments are model-shaped trees whose leaves may be masks (as `jax.tree.map` builds
    them), which a constructor would refuse."""
    new = copy.copy(module)
    for k, v in fields.items():
        object.__setattr__(new, k, v)
    return new


def _ratio(a: float, b: float, what: str) -> int:
    r = round(a / b)
    if r < 1 or not math.isclose(r * b, a, rel_tol=1e-9):
        raise ValueError(f"{what}: {a:g} is not a whole multiple of {b:g}")
    return r


def _on_arrays(fn, tree):
    return jax.tree.map(lambda a: fn(a) if eqx.is_array(a) else a, tree)


class Transfer(eqx.Module):
    """Moves a model (and the model-shaped trees of its optimiser state) to another depth
    step. Per-layer controls go through `restriction` / `prolongation`; smooth controls
    keep their parameters. `moments`: what happens to the optimiser's moments."""

    restriction: AbstractRestriction = RESTRICTIONS["even"]
    prolongation: AbstractProlongation = PROLONGATIONS["copy"]
    moments: AbstractMoments = MOMENTS["transfer"]

    def model(self, model, dt: float):
        """`model` (or a tree shaped like it) at depth step `dt`."""
        controls = model.equation.controls
        if not isinstance(controls, PiecewiseConstant):  # smooth: the same parameters
            return _replaced(model, dt=float(dt))
        if dt > model.dt:
            r = _ratio(dt, model.dt, "`dt` (coarser)")
            values = _on_arrays(lambda a: self.restriction.restrict(a, r), controls.values)
            length = controls.layer_length * r
        elif dt < model.dt:
            r = _ratio(model.dt, dt, "`dt` (finer)")
            values = _on_arrays(lambda a: self.prolongation.prolong(a, r), controls.values)
            length = controls.layer_length / r
        else:
            return model
        new = _replaced(controls, values=values, layer_length=length)
        return _replaced(model, equation=_replaced(model.equation, controls=new), dt=float(dt))

    def __call__(self, model, opt_state, dt: float):
        """`(model, opt_state)` at depth step `dt`."""
        move = functools.partial(self.model, dt=dt)
        return self.model(model, dt), self.moments.apply(opt_state, move)


def coarsen(model, dt: float, restriction: str | AbstractRestriction = "even", *, name="dt"):
    """`model` at depth step `dt`: for per-layer controls longer than a layer, the network
    of every `r`-th layer (or their `restriction`) run at `dt` = `r` layers; otherwise
    the same parameters at `dt`. E.g. `coarsen(gpt, 2.0)`: half the layers, half the cost.
    `name`: how errors name `dt` (the CLI passes `--dt`)."""
    if isinstance(restriction, str):
        if restriction not in RESTRICTIONS:
            raise ValueError(
                f"`restriction`={restriction!r} is not known; choose one of {sorted(RESTRICTIONS)}"
            )
        restriction = RESTRICTIONS[restriction]
    controls = model.equation.controls
    if not math.isfinite(dt):
        raise ValueError(f"`{name}`={dt!r} must be a finite depth step, e.g. {2 * model.dt:g}")
    if isinstance(controls, PiecewiseConstant) and dt > model.dt:
        r = round(dt / model.dt)
        if not math.isclose(r * model.dt, dt, rel_tol=1e-9) or controls.n_layers % r:
            raise ValueError(
                f"`{name}`={dt:g} must be the step {model.dt:g} times a divisor r of the "
                f"{controls.n_layers} layers (the coarse network has n_layers / r layers), "
                f"e.g. {2 * model.dt:g}"
            )
        return Transfer(restriction=restriction).model(model, dt)
    raise ValueError(
        f"`{name}`={dt:g}: `coarsen` takes a per-layer model to a step longer than its own "
        f"({model.dt:g}); for other steps use `itde.train.with_depth(model, dt=...)`"
    )


# ----------------------------------------------------------------------- schedule
@dataclasses.dataclass(frozen=True)
class LevelSchedule:
    """The depth step of each training step.

    - `dts`: the depth step of each phase, in order.
    - `ends`: the step at which each phase ends: phase `i` runs the training steps
      `[ends[i-1], ends[i])` (`ends[-1]` = the run's steps).
    """

    dts: tuple[float, ...]
    ends: tuple[int, ...]

    @classmethod
    def from_shares(cls, dts, shares, steps: int) -> LevelSchedule:
        acc, ends = 0.0, []
        for s in shares:
            acc += s
            ends.append(round(acc * steps))
        ends[-1] = steps
        return cls(tuple(float(d) for d in dts), tuple(ends))

    def phase(self, step: int) -> int:
        """The phase that training step `step` (0-based) runs in."""
        for i, end in enumerate(self.ends):
            if step < end:
                return i
        return len(self.ends) - 1

    def dt(self, step: int) -> float:
        return self.dts[self.phase(step)]
