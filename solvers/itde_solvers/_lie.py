"""Lie–Trotter (sequential) operator splitting as a diffrax solver."""

from __future__ import annotations

import diffrax
from diffrax import AbstractSolver

from ._splitting import AbstractSplittingSolver
from ._subflows import advance, combine_results


class LieTrotter(AbstractSplittingSolver):
    r"""Lie–Trotter (sequential) splitting of $y_t = \sum_i f_i(t, y)$.

    One step from $t_0$ to $t_1$ applies the sub-flows of a
    [`SplitTerm`][itde_solvers.SplitTerm] one after another, each over the whole interval
    and each starting from the previous result:
    $y \leftarrow \Phi^{(i)}_{t_0 \to t_1}(y)$ for $i = 1, \dots, M$. A vector-field
    sub-flow takes one step of its sub-solver (explicit Euler by default); a
    projection sub-flow maps the state to the constraint set at $t_1$.

    **Order:** 1 (global), for sub-flows that are Lipschitz in $y$ and $C^1$ in $t$,
    whatever the order of the sub-solvers. With $\Delta t = 1$, piecewise-constant
    controls and the six sub-flows of the paper this is exactly one post-LN
    Transformer block per step.

    **Arguments:**

    - `solvers`: a diffrax solver used for every vector-field sub-flow, or a tuple with
      one solver per sub-flow (None for projections). Default: `diffrax.Euler()`.
    """

    solvers: AbstractSolver | tuple[AbstractSolver | None, ...] = diffrax.Euler()

    def order(self, terms):
        self.sub_flows(terms)
        return 1

    def compose(self, flows, subs, t0, t1, y0, args):
        y = y0
        results = []
        for term, sub in zip(flows, subs):
            y, result = advance(term, sub, t0, t1, y, args)
            results.append(result)
        return y, combine_results(results)


__all__ = ["LieTrotter"]
