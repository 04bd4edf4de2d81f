"""Helpers for writing a splitting solver: sub-flows, sub-solvers, one sub-step, results.

These are the pieces that [`itde_solvers.AbstractSplittingSolver`][] subclasses are built
from; they are public so that a new splitting scheme needs nothing private.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import diffrax
import equinox as eqx
from diffrax import AbstractSolver, AbstractTerm

from ._diffrax_private import WrapTerm
from ._terms import ProjectionTerm, SplitTerm


class _DirectedProjection(eqx.Module):
    """A projection seen through diffrax's time-direction wrapper (t -> direction * t)."""

    term: ProjectionTerm
    direction: Any

    def project(self, t, y):
        return self.term.project(t * self.direction, y)


def is_projection(term) -> bool:
    """Whether a sub-flow (as returned by [`itde_solvers.split_flows`][]) is a projection.

    A projection is applied instantly and takes no sub-solver; anything else is a
    vector field.
    """
    return isinstance(term, (ProjectionTerm, _DirectedProjection))


def split_flows(terms: Any, solver_name: str) -> tuple[Any, ...]:
    """The sub-flows of a [`itde_solvers.SplitTerm`][], as a solver sees them inside `diffeqsolve`.

    `diffeqsolve` hands a solver its terms wrapped in diffrax's time-direction wrapper
    (which flips time for a backward solve); the wrap is pushed down onto each sub-flow,
    so that every sub-flow sees the user's time.

    **Arguments:**

    - `terms`: the `terms` a solver's `init`/`step`/`order` receives.
    - `solver_name`: the solver's name, used in the error message.

    **Returns:** a tuple with one entry per sub-flow, in the `SplitTerm`'s order: a
    diffrax term for a vector field, a projection (see
    [`itde_solvers.is_projection`][]) otherwise. Raises `TypeError` at trace time, naming
    the fix, when `terms` is not a `SplitTerm`.
    """
    direction = None
    inner = terms
    if isinstance(inner, WrapTerm):
        direction, inner = inner.direction, inner.term
    if not isinstance(inner, SplitTerm):
        raise TypeError(
            f"`{solver_name}` integrates an `itde_solvers.SplitTerm` (an ordered tuple of "
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


def resolve_subsolvers(
    solvers: AbstractSolver | tuple[AbstractSolver | None, ...],
    flows: tuple[Any, ...],
    solver_name: str,
) -> tuple[AbstractSolver | None, ...]:
    """One sub-solver per sub-flow (None for a projection), checked at trace time.

    **Arguments:**

    - `solvers`: a diffrax solver for every vector-field sub-flow, or a tuple with one
      entry per sub-flow (a diffrax solver for a vector field, None for a projection).
    - `flows`: the sub-flows, from [`itde_solvers.split_flows`][].
    - `solver_name`: the splitting solver's name, used in error messages.

    **Returns:** a tuple as long as `flows`. Raises `ValueError` for a tuple of the
    wrong length or a sub-solver given to a projection, `TypeError` for a vector field
    without a diffrax solver.
    """
    n = len(flows)
    if isinstance(solvers, AbstractSolver):
        return tuple(None if is_projection(t) else solvers for t in flows)
    if not isinstance(solvers, (tuple, list)):
        raise TypeError(
            f"`{solver_name}(solvers=...)` must be a diffrax solver or a tuple of them, got "
            f"{solvers!r}."
        )
    if len(solvers) != n:
        raise ValueError(
            f"`{solver_name}(solvers=...)` has {len(solvers)} entries but the SplitTerm has "
            f"{n} sub-flows; give one solver per sub-flow (None for a projection), or a "
            "single solver to use for every vector-field sub-flow."
        )
    for i, (term, sub) in enumerate(zip(flows, solvers)):
        if is_projection(term) and sub is not None:
            raise ValueError(
                f"`{solver_name}(solvers=...)`: entry {i} is a projection and takes no "
                "sub-solver; put None there."
            )
        if not is_projection(term) and not isinstance(sub, AbstractSolver):
            raise TypeError(
                f"`{solver_name}(solvers=...)`: entry {i} must be a diffrax solver for the "
                f"vector field {type(term).__name__}, got {sub!r}."
            )
    return tuple(solvers)


def advance(term: AbstractTerm | Any, sub: AbstractSolver | None, t0, t1, y, args):
    """Advance one sub-flow over `[t0, t1]`.

    A vector field takes one step of its sub-solver `sub` (from a fresh solver state, so
    no first-same-as-last evaluation is carried between sub-flows); a projection (`sub`
    None) maps `y` onto its constraint set at `t1`.

    **Returns:** `(y1, result)`, with `result` a `diffrax.RESULTS`.
    """
    if sub is None:
        return term.project(t1, y), diffrax.RESULTS.successful  # type: ignore[attr-defined]
    state = sub.init(term, t0, t1, y, args)
    y1, _, _, _, result = sub.step(term, t0, t1, y, args, state, made_jump=False)
    return y1, result


def combine_results(results: Iterable[Any]):
    """The first unsuccessful `diffrax.RESULTS` among `results`, or success if none failed."""
    out = diffrax.RESULTS.successful
    for r in results:
        out = diffrax.RESULTS.where(out == diffrax.RESULTS.successful, r, out)
    return out


__all__ = ["advance", "combine_results", "is_projection", "resolve_subsolvers", "split_flows"]
