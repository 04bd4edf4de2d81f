"""Terms for operator splitting: an ordered tuple of sub-flows, some of them projections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
from diffrax import AbstractTerm


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

    def __check_init__(self):
        if not callable(self.projection):
            raise TypeError(
                f"`ProjectionTerm(projection)` needs a callable `(t, y) -> y`, got "
                f"{self.projection!r}."
            )

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
    [`ProjectionTerm`][itde_solvers.ProjectionTerm], applied as a projection. The
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
                    "projection in `itde_solvers.ProjectionTerm`."
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


__all__ = ["ProjectionTerm", "SplitTerm"]
