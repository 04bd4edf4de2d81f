"""Projection methods: any diffrax solver on the summed field, then the projections."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from diffrax import (
    AbstractERK,
    AbstractLocalInterpolation,
    AbstractSolver,
    AbstractTerm,
    ButcherTableau,
)

from ._diffrax_private import AdjointTerm, WrapTerm
from ._rk4 import _linear
from ._subflows import advance, combine_results, is_projection, split_flows
from ._wrapped import AbstractForwardingSolver


class _ProjectedInterpolation(AbstractLocalInterpolation):
    """The wrapped solver's dense output plus a linear correction to the projected end.

    `inner(t) + (t - t0) / (t1 - t0) * (y1_projected - y1_unprojected)`: continuous, equal
    to the projected state at every step end, and as accurate as `inner`.
    """

    t0: Any
    t1: Any
    inner: AbstractLocalInterpolation
    correction: Any

    def evaluate(self, t0, t1=None, left=True):
        if t1 is not None:
            return jtu.tree_map(
                jnp.subtract, self.evaluate(t1, left=left), self.evaluate(t0, left=left)
            )
        same = self.t1 == self.t0  # exact: guards the division below, needed only at 0
        theta = jnp.where(same, 0.0, t0 - self.t0) / jnp.where(same, 1.0, self.t1 - self.t0)
        base = self.inner.evaluate(t0, left=left)
        return jtu.tree_map(lambda b, c: b + theta * c, base, self.correction)


def _build_interpolation(inner_cls, *, t0, t1, inner, correction):
    return _ProjectedInterpolation(
        t0=t0, t1=t1, inner=inner_cls(t0=t0, t1=t1, **inner), correction=correction
    )


class Projected(AbstractForwardingSolver):
    r"""A projection method: a diffrax solver on $\sum_i f_i$, then the projections at $t_1$.

    The terms are a [`SplitTerm`][itde_solvers.SplitTerm]. Each step integrates the sum of its
    vector-field sub-flows (the `SplitTerm`'s own `vf`) from $t_0$ to $t_1$ with one step
    of the wrapped solver, then applies the projection sub-flows in tuple order, each
    onto its constraint set at $t_1$:
    $y_1 = P_m \circ \cdots \circ P_1(\Psi_h(y_0))$.

    **Order:** the wrapped solver's order $p$ (Euler 1, Heun/Midpoint 2, `RK4` 4, Tsit5
    and Dopri5 5, Dopri8 8), when the exact solution stays on the constraint sets (the
    summed field is tangent to them, drift of a moving set included), the field is
    smooth, and the projections are smooth near the sets: projecting a point within
    $O(h^{p+1})$ of the set moves it by $O(h^{p+1})$. For a field with a normal
    component the method converges, at order 1 in general, to the flow of the field's
    tangential part.

    **Adaptive steps.** The error estimate is the wrapped solver's (embedded) estimate
    for the unprojected step, and `error_order` is the wrapped solver's; the projection
    only removes error normal to the set. So `Projected(diffrax.Tsit5())` works with
    `diffrax.PIDController` exactly as `Tsit5` does, and `Projected(diffrax.Euler())`
    (no estimate) does not; `isinstance` checks (adaptive, implicit, ...) are forwarded to
    the wrapped solver.

    **Solver state and dense output.** The wrapped solver's state is carried from step to
    step. First-same-as-last methods (Tsit5, Dopri5, `RK4`) would reuse $f$ at the
    *unprojected* end point; by default every inner step is told `made_jump=True`, so it
    re-evaluates $f$ at the projected start (one extra evaluation per step) and each step
    is exactly the wrapped method from the projected state. `reuse_fsal=True` keeps the
    stale evaluation instead: the order is unchanged (the perturbation is
    $O(h^{p+2})$ a step) and the extra evaluation is saved. Dense output is the wrapped
    solver's interpolation plus the linear-in-time correction that makes it pass through
    the projected end point; between step ends it is as accurate as the wrapped solver's
    dense output but is not itself projected.

    Implicit solvers work too: their root-finder settings are forwarded, so `diffeqsolve`
    sets their tolerances from the step-size controller as usual.

    **Arguments:**

    - `solver`: the diffrax solver to wrap, e.g. `diffrax.Tsit5()` or `itde_solvers.RK4()`.
    - `reuse_fsal`: reuse a first-same-as-last evaluation made before the projection.
      Default False.
    """

    solver: AbstractSolver
    reuse_fsal: bool = False

    term_structure: ClassVar = AbstractTerm

    def __check_init__(self):
        if not isinstance(self.solver, AbstractSolver):
            raise TypeError(
                f"`Projected(solver=...)` must be a diffrax solver, got {self.solver!r}."
            )

    @property
    def interpolation_cls(self) -> Callable[..., AbstractLocalInterpolation]:  # pyright: ignore
        return partial(_build_interpolation, self.solver.interpolation_cls)

    def order(self, terms):
        _flows(terms)
        return self.solver.order(terms)

    def for_fixed_steps(self) -> Projected:
        """This solver for a fixed-step solve that reads the solution only at step ends:
        where the wrapped method has a first-same-as-last stage that is evaluated only for
        its error estimate and dense output (`RK4`: `without_error_estimate`), and this
        wrapper restarts every step (`reuse_fsal=False`), the stage is dropped. The
        solution is the same; a step costs one evaluation less (RK4: 4 instead of 5; any
        other explicit Runge–Kutta method whose tableau is first-same-as-last, e.g.
        diffrax's Tsit5, Dopri5, Dopri8: its tableau without the last row, see
        `_without_last_stage`)."""
        drop = getattr(self.solver, "without_error_estimate", None)
        if drop is None and _droppable(self.solver):
            drop = partial(_without_last_stage, self.solver)
        if self.reuse_fsal or drop is None:
            return self
        return Projected(drop(), reuse_fsal=False)

    def error_order(self, terms):
        _flows(terms)
        return self.solver.error_order(terms)

    def init(self, terms, t0, t1, y0, args):
        _flows(terms)
        return self.solver.init(terms, t0, t1, y0, args)

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        flows = _flows(terms)
        if flows is None:  # BacksolveAdjoint's backward solve: no projections (see below)
            y, y_error, dense_info, solver_state, result = self.solver.step(
                terms, t0, t1, y0, args, solver_state, made_jump
            )
            zero = jtu.tree_map(jnp.zeros_like, y)
            return y, y_error, dict(inner=dense_info, correction=zero), solver_state, result
        jump = made_jump if self.reuse_fsal else True
        y_raw, y_error, dense_info, solver_state, result = self.solver.step(
            terms, t0, t1, y0, args, solver_state, jump
        )
        y = y_raw
        results = [result]
        for term in flows:
            if is_projection(term):
                y, r = advance(term, None, t0, t1, y, args)
                results.append(r)
        correction = jtu.tree_map(jnp.subtract, y, y_raw)
        dense_info = dict(inner=dense_info, correction=correction)
        return y, y_error, dense_info, solver_state, combine_results(results)

    def func(self, terms, t0, y0, args):
        return self.solver.func(terms, t0, y0, args)


def _flows(terms):
    """The sub-flows of the SplitTerm, or None for diffrax's `AdjointTerm`.

    `diffrax.BacksolveAdjoint` integrates the continuous adjoint equations backwards
    with the same solver, over an `AdjointTerm` built on the (tangent) vector field.
    The projections are a numerical correction of the forward solve, not part of the
    ODE (whose exact flow stays on the constraint set), so the backward solve runs the
    wrapped solver unprojected. The gradient is then that of the continuous problem
    (optimise-then-discretise), not the exact gradient of the projected discrete solve.
    """
    inner = terms.term if isinstance(terms, WrapTerm) else terms
    if isinstance(inner, AdjointTerm):
        return None
    return split_flows(terms, "Projected")


__all__ = ["Projected"]


def _droppable(solver) -> bool:
    """An explicit Runge–Kutta method with one first-same-as-last Butcher tableau."""
    tab = getattr(type(solver), "tableau", None)
    return (isinstance(solver, AbstractERK) and isinstance(tab, ButcherTableau)
            and tab.fsal and tab.a_diagonal is None and float(tab.b_sol[-1]) == 0.0)  # fmt: skip


_STAGES: dict[type, type] = {}


def _without_last_stage(solver):
    r"""`solver` (an explicit first-same-as-last Runge–Kutta method) without its last
    stage $f(t_1, y_1)$: the tableau's rows but the last, the solution weights but the last
    (zero), no error estimate, linear dense output. `y1` is the same sum of the same
    stages. One class per method (cached, so that jit sees one type)."""
    cls = type(solver)
    if cls not in _STAGES:
        tab = cls.tableau
        stages = ButcherTableau(a_lower=tab.a_lower[:-1], b_sol=tab.b_sol[:-1],
                                b_error=np.zeros(len(tab.b_sol) - 1), c=tab.c[:-1])  # fmt: skip
        order = cls.order
        _STAGES[cls] = type(f"{cls.__name__}Stages", (AbstractERK,), {
            "__doc__": f"{cls.__name__}'s stages without its first-same-as-last one.",
            "__module__": __name__,
            "__annotations__": {"tableau": ClassVar[ButcherTableau],
                                "interpolation_cls": ClassVar[Callable]},
            "tableau": stages,
            "interpolation_cls": staticmethod(_linear),
            "order": lambda self, terms: order(solver, terms),
        })  # fmt: skip
    return _STAGES[cls](scan_kind=solver.scan_kind)
