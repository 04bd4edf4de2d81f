"""Any diffrax solver for a field that is constant in time on each step."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import equinox as eqx
import jax.numpy as jnp
from diffrax import AbstractSolver, AbstractTerm

from ._diffrax_private import AdjointTerm, WrapTerm
from ._terms import ProjectionTerm, SplitTerm
from ._wrapped import AbstractForwardingSolver


class _AtTime(AbstractTerm):
    """A term whose vector field is read at the fixed time `t` whatever time it is asked
    at; the control (the step length) is the real one."""

    term: AbstractTerm
    t: object

    def vf(self, t, y, args):
        return self.term.vf(self.t, y, args)

    def contr(self, t0, t1, **kwargs):
        return self.term.contr(t0, t1, **kwargs)

    def prod(self, vf, control):
        return self.term.prod(vf, control)


def _project_at(projection: Callable, t_fixed, t, y):
    del t
    return projection(t_fixed, y)


def _direction(terms):
    """+1 for a forward solve, -1 for a backward one: `diffeqsolve` runs a solve with
    $t_0 > t_1$ in the time $-t$ and hands the solver its terms wrapped in `WrapTerm`."""
    return terms.direction if isinstance(terms, WrapTerm) else 1


def _as_jump_times(jump_ts) -> tuple[float, ...]:
    """`jump_ts` as the sorted tuple of distinct finite floats `FrozenTime` holds; a
    non-finite or non-real entry is refused (a jump at NaN matches no step and silently
    freezes nothing)."""
    if jump_ts is None:
        return ()
    try:
        values = [float(t) for t in jump_ts]
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"`FrozenTime(jump_ts=...)` must be a sequence of real depths where the field "
            f"jumps, e.g. jump_ts=(1.0, 2.0); got {jump_ts!r}."
        ) from e
    bad = [t for t in values if not math.isfinite(t)]
    if bad:
        raise ValueError(
            f"`FrozenTime(jump_ts=...)` has the non-finite value(s) {bad}: a jump is a finite "
            "depth where the field changes (e.g. a layer boundary); drop them, e.g. "
            "jump_ts=(1.0, 2.0)."
        )
    return tuple(sorted(set(values)))


def _at_time(terms, t):
    """`terms` with every vector field and projection read at time `t` (the user's
    time), keeping the structure the solvers look for (`WrapTerm`, `SplitTerm`,
    `ProjectionTerm`)."""
    if isinstance(terms, WrapTerm):
        return WrapTerm(_at_time(terms.term, t * terms.direction), terms.direction)
    if isinstance(terms, SplitTerm):
        return SplitTerm(tuple(_at_time(term, t) for term in terms.terms))
    if isinstance(terms, ProjectionTerm):
        return ProjectionTerm(partial(_project_at, terms.projection, t))
    if isinstance(terms, AdjointTerm):  # a backward (adjoint) solve: see `FrozenTime`
        return terms
    return _AtTime(terms, t)


class FrozenTime(AbstractForwardingSolver):
    r"""Any diffrax solver, for a field that is constant in time on each step.

    A field that is piecewise constant in time, $f(t, y) = f_j(y)$ on
    $(\tau_j, \tau_{j+1})$, integrated on steps that end on every jump $\tau_j$, is
    smooth on every step; but a Runge–Kutta stage placed at the end of a step sits on the
    next jump, where the field reads $f_{j+1}$, and one stage in the wrong piece per step
    makes every method order 1. This wrapper hands the wrapped solver terms that read
    every evaluation of a step from $t_0$ to $t_1$ — every stage, every sub-flow of a
    splitting, every projection — at the step's midpoint $(t_0 + t_1)/2$, which lies in
    the step's own piece. A step that starts on a jump is told `made_jump=True`, so a
    first-same-as-last method (Tsit5, Dopri5, `RK4`) evaluates the new piece's field
    instead of reusing the old one's.

    **Both directions.** In a backward solve ($t_0 > t_1$; diffrax runs it in the time
    $-t$) the midpoint and the jumps are read in the user's time, so a step from $t_0$
    down to $t_1$ reads the piece between them, and a step that starts on a jump going
    down re-evaluates too. Solving forward over $[a, b]$ and $[b, c]$ gives the same map as
    over $[a, c]$ whenever $b$ is a step end, in either direction (the semigroup property).

    **Order:** the wrapped solver's, for fields constant in time between consecutive
    jumps and steps that never straddle a jump. For a field that varies in time inside a
    piece the frozen clock is a first-order error: do not wrap such a solver.

    **Arguments:**

    - `solver`: the diffrax solver to wrap (a splitting solver, `Projected(...)`, or any
      other).
    - `jump_ts`: the times where the field jumps (e.g. layer boundaries): finite reals,
      stored sorted and without repeats. A jump that is not one of the field's costs
      one extra evaluation of a step that starts there; a jump of the field missing from
      them makes a first-same-as-last method reuse the old piece's field after it (order
      1). `itde.solve` adds the model's jumps to those of a `FrozenTime` it is given.

    A backward adjoint solve (`diffrax.BacksolveAdjoint`) runs unfrozen.
    """

    solver: AbstractSolver
    jump_ts: tuple[float, ...] = eqx.field(static=True, default=(), converter=_as_jump_times)

    def __check_init__(self):
        if not isinstance(self.solver, AbstractSolver):
            raise TypeError(
                f"`FrozenTime(solver=...)` must be a diffrax solver, got {self.solver!r}."
            )

    @property
    def term_structure(self):  # pyright: ignore
        return self.solver.term_structure

    @property
    def interpolation_cls(self):  # pyright: ignore
        return self.solver.interpolation_cls

    def order(self, terms):
        return self.solver.order(terms)

    def error_order(self, terms):
        return self.solver.error_order(terms)

    def strong_order(self, terms):
        return self.solver.strong_order(terms)

    def init(self, terms, t0, t1, y0, args):
        # `t1` is the first step's end: read its piece, as `step` will (at `t0` itself, a
        # backward solve starting on a jump would read the piece above it)
        return self.solver.init(_at_time(terms, t0 + 0.5 * (t1 - t0)), t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        mid = t0 + 0.5 * (t1 - t0)
        if self.jump_ts:
            jumps = jnp.asarray(self.jump_ts, jnp.result_type(t0))
            tol = 16 * jnp.finfo(jumps.dtype).eps * jnp.maximum(1.0, jnp.abs(jumps))
            start = t0 * _direction(terms)  # the step's start in the user's time
            made_jump = made_jump | jnp.any(jnp.abs(start - jumps) <= tol)
        return self.solver.step(
            _at_time(terms, mid), t0, t1, y0, args, solver_state, made_jump
        )

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)


__all__ = ["FrozenTime"]
