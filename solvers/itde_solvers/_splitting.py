"""The shared body of every operator-splitting solver."""

# No `from __future__ import annotations`: equinox reads the AbstractVar annotation at runtime.

import abc
from typing import Any, ClassVar

from diffrax import AbstractSolver, AbstractTerm, LocalLinearInterpolation
from equinox import AbstractVar

from ._subflows import is_projection, resolve_subsolvers, split_flows


class AbstractSplittingSolver(AbstractSolver):
    r"""A diffrax solver for $y_t = \sum_i f_i(t, y)$ that composes the flows of the parts.

    The terms are an [`itde_solvers.SplitTerm`][]: an ordered tuple of sub-flows, each a
    vector field (advanced by a diffrax sub-solver) or a projection (applied instantly).
    This class does everything but the composition: it unwraps the terms that
    `diffeqsolve` hands over ([`itde_solvers.split_flows`][]), picks one sub-solver per
    sub-flow ([`itde_solvers.resolve_subsolvers`][]), checks at trace time that there is
    at least one vector field, and returns the step in diffrax's format (no error
    estimate, linear dense output between step ends, no solver state carried between
    steps). `func` is the summed field, which `diffeqsolve` uses to pick a first step.

    A subclass is final and says only how one step composes the sub-flows:

    - `solvers`: a field, a diffrax solver for every vector-field sub-flow or a tuple
      with one entry per sub-flow (None for a projection), with the scheme's default;
    - `order(terms)`: the global order of the scheme; `init` calls it, so it is also
      where a scheme checks its own options against the terms (at trace time);
    - `compose(flows, subs, t0, t1, y0, args)`: one step, returning `(y1, result)`.
      Build it from [`itde_solvers.advance`][] (one sub-flow over an interval) and
      [`itde_solvers.combine_results`][].

    No error estimate is made; wrap a splitting solver in `diffrax.HalfSolver` for
    adaptive steps.
    """

    solvers: AbstractVar[AbstractSolver | tuple[AbstractSolver | None, ...]]

    term_structure: ClassVar = AbstractTerm
    interpolation_cls: ClassVar = LocalLinearInterpolation

    @abc.abstractmethod
    def order(self, terms) -> int | None:
        """The global order of the scheme for these terms."""

    @abc.abstractmethod
    def compose(
        self,
        flows: tuple[Any, ...],
        subs: tuple[AbstractSolver | None, ...],
        t0,
        t1,
        y0,
        args,
    ) -> tuple[Any, Any]:
        """One step from `t0` to `t1`: compose the sub-flows.

        **Arguments:**

        - `flows`: the sub-flows, from [`itde_solvers.split_flows`][] (at least one is
          a vector field).
        - `subs`: one sub-solver per sub-flow, None for projections.
        - `t0`, `t1`, `y0`, `args`: as in `diffrax.AbstractSolver.step`.

        **Returns:** `(y1, result)`, with `result` a `diffrax.RESULTS`.
        """

    def sub_flows(self, terms) -> tuple[tuple[Any, ...], tuple[AbstractSolver | None, ...]]:
        """The sub-flows of `terms` and their sub-solvers, checked at trace time."""
        name = type(self).__name__
        flows = split_flows(terms, name)
        subs = resolve_subsolvers(self.solvers, flows, name)
        if all(is_projection(term) for term in flows):
            raise ValueError(
                f"`{name}` needs at least one vector-field sub-flow in the SplitTerm, got "
                f"only projections ({len(flows)} of them)."
            )
        return flows, subs

    def init(self, terms, t0, t1, y0, args):
        self.sub_flows(terms)
        self.order(terms)  # where a scheme checks its own options against the terms
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        flows, subs = self.sub_flows(terms)
        y1, result = self.compose(flows, subs, t0, t1, y0, args)
        return y1, None, dict(y0=y0, y1=y1), None, result

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)


__all__ = ["AbstractSplittingSolver"]
