"""Any diffrax solver for a field that is constant in time on each step."""

from __future__ import annotations

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

    **Order:** the wrapped solver's, for fields constant in time between consecutive
    jumps and steps that never straddle a jump. For a field that varies in time inside a
    piece the frozen clock is a first-order error: do not wrap such a solver.

    **Arguments:**

    - `solver`: the diffrax solver to wrap (a splitting solver, `Projected(...)`, or any
      other).
    - `jump_ts`: the times where the field jumps (e.g. layer boundaries).

    A backward adjoint solve (`diffrax.BacksolveAdjoint`) runs unfrozen.
    """

    solver: AbstractSolver
    jump_ts: tuple[float, ...] = eqx.field(static=True, default=())

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
        return self.solver.init(_at_time(terms, t0), t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        mid = t0 + 0.5 * (t1 - t0)
        if self.jump_ts:
            jumps = jnp.asarray(self.jump_ts, jnp.result_type(t0))
            tol = 16 * jnp.finfo(jumps.dtype).eps * jnp.maximum(1.0, jnp.abs(jumps))
            made_jump = made_jump | jnp.any(jnp.abs(t0 - jumps) <= tol)
        return self.solver.step(
            _at_time(terms, mid), t0, t1, y0, args, solver_state, made_jump
        )

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)


__all__ = ["FrozenTime"]
