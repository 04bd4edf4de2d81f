"""Terms for operator splitting: an ordered tuple of sub-flows, some of them projections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import AbstractTerm
from diffrax._term import WrapTerm  # diffeqsolve wraps terms in it; not re-exported


class ProjectionTerm(AbstractTerm):
    r"""A sub-flow that is a projection, $y \mapsto P_{C(t)}(y)$, applied instantly.

    In a splitting scheme the projection is the exact (implicit) solution of the
    sub-problem $y_t \in -\partial I_{C(t)}(y)$ over a step: whatever the step length,
    the state lands on the nearest point of the constraint set $C(t)$ at the step's
    end time. It contributes no vector field of its own.

    **Arguments:**

    - `projection`: a callable `(t, y) -> y` returning the projection of `y` onto the
      constraint set at time `t`.
    """

    projection: Callable[[Any, Any], Any]

    def project(self, t, y):
        return self.projection(t, y)

    def vf(self, t, y, args):
        return jtu.tree_map(jnp.zeros_like, y)

    def contr(self, t0, t1, **kwargs):
        return t1 - t0

    def prod(self, vf, control):
        return jtu.tree_map(lambda v: control * v, vf)


class SplitTerm(AbstractTerm):
    r"""An ordered tuple of sub-flows $y_t = \sum_i f_i(t, y)$ for a splitting solver.

    Each entry is either a vector-field term (typically `diffrax.ODETerm`), advanced
    by the splitting solver's sub-solver for that entry, or a
    [`ProjectionTerm`][solvers.ProjectionTerm], applied as a projection. The
    combined vector field (`vf`) is the sum of the vector-field entries; it is what a
    non-splitting solver would integrate, and what `diffeqsolve` uses to pick an
    initial step.

    **Arguments:**

    - `terms`: the sub-flows, in the order a sequential splitting applies them.
    """

    terms: tuple[AbstractTerm, ...]

    def __check_init__(self):
        if not isinstance(self.terms, tuple) or len(self.terms) == 0:
            raise ValueError(
                f"`SplitTerm(terms=...)` needs a non-empty tuple of terms, got {self.terms!r}."
            )
        for i, term in enumerate(self.terms):
            if not isinstance(term, AbstractTerm):
                raise TypeError(
                    f"`SplitTerm(terms=...)`: entry {i} is {type(term).__name__}, not a "
                    "diffrax term; wrap a vector field in `diffrax.ODETerm` and a "
                    "projection in `solvers.ProjectionTerm`."
                )

    def vf(self, t, y, args):
        total = jtu.tree_map(jnp.zeros_like, y)
        for term in self.terms:
            if not isinstance(term, ProjectionTerm):
                total = jtu.tree_map(jnp.add, total, term.vf(t, y, args))
        return total

    def contr(self, t0, t1, **kwargs):
        return t1 - t0

    def prod(self, vf, control):
        return jtu.tree_map(lambda v: control * v, vf)


def is_projection(term) -> bool:
    """Whether a sub-flow is a projection (applied instantly, no sub-solver)."""
    return isinstance(term, (ProjectionTerm, _DirectedProjection))


class _DirectedProjection(eqx.Module):
    """A projection seen through diffrax's time-direction wrapper (t -> direction * t)."""

    term: ProjectionTerm
    direction: Any

    def project(self, t, y):
        return self.term.project(t * self.direction, y)


def check_split(terms: Any, solver_name: str) -> tuple[AbstractTerm, ...]:
    """The sub-flows of a `SplitTerm`, as seen inside `diffeqsolve`.

    `diffeqsolve` hands a solver its terms wrapped in `diffrax.WrapTerm` (which flips
    time for backward solves); the wrap is pushed down onto each sub-flow so that
    every sub-flow sees the user's time. Raises a trace-time error naming the fix when
    the terms are not a `SplitTerm`.
    """
    direction = None
    inner = terms
    if isinstance(inner, WrapTerm):
        direction, inner = inner.direction, inner.term
    if not isinstance(inner, SplitTerm):
        raise TypeError(
            f"`{solver_name}` integrates a `solvers.SplitTerm` (an ordered tuple of "
            f"sub-flows), got terms of type {type(inner).__name__}. Build the terms as "
            "`SplitTerm((ODETerm(f1), ProjectionTerm(p), ODETerm(f2), ...))`."
        )
    if direction is None:
        return inner.terms
    return tuple(
        _DirectedProjection(t, direction)
        if isinstance(t, ProjectionTerm)
        else WrapTerm(t, direction)
        for t in inner.terms
    )


__all__ = ["ProjectionTerm", "SplitTerm", "check_split", "is_projection"]
