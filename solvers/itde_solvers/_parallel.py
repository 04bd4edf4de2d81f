"""Parallel (averaged) operator splitting as a diffrax solver."""

from __future__ import annotations

from typing import Any

import diffrax
import jax.tree_util as jtu
from diffrax import AbstractSolver, AbstractTerm

from ._splitting import AbstractSplittingSolver
from ._subflows import advance, combine_results, is_projection


class _ScaledControl(AbstractTerm):
    """A sub-flow whose control is `scale` times the inner one: `y' = scale * f(t, y)`."""

    term: AbstractTerm
    scale: Any

    def vf(self, t, y, args):
        return self.term.vf(t, y, args)

    def contr(self, t0, t1, **kwargs):
        return jtu.tree_map(lambda c: self.scale * c, self.term.contr(t0, t1, **kwargs))

    def prod(self, vf, control):
        return self.term.prod(vf, control)


class ParallelSplitting(AbstractSplittingSolver):
    r"""Parallel (averaged) splitting of $y_t = \sum_{i=1}^K f_i(t, y)$.

    One step from $t_0$ to $t_1 = t_0 + h$ advances each of the $K$ vector-field sub-flows
    of a [`SplitTerm`][itde_solvers.SplitTerm] *from the same start* $y_0$ with $K h$,
    averages the $K$ results, then applies the projection sub-flows in tuple order at $t_1$:

    $$y_1 = P_m \circ \cdots \circ P_1\Big(\tfrac1K \sum_{i=1}^K \Phi^{(i)}_{Kh}(y_0)\Big).$$

    The $K$ sub-flows are independent, so they can run in parallel. Sub-flow $i$ is stepped
    as $y' = K f_i(t, y)$ over $[t_0, t_1]$: the flow of $f_i$ for $K h$ with its clock
    slowed by $K$, so a time-dependent field is only ever read inside $[t_0, t_1]$ (with
    explicit Euler this is exactly $y_0 + K h f_i(t_0, y_0)$).

    **Order:** 1 (global), for fields Lipschitz in $y$ and $C^1$ in $t$, whatever the
    order of the sub-solvers (averaging is only consistent to first order). No error
    estimate; wrap in `diffrax.HalfSolver` for adaptive steps.

    **Arguments:**

    - `solvers`: a diffrax solver used for every vector-field sub-flow, or a tuple with
      one solver per sub-flow (None for projections). Default: `diffrax.Euler()`.
    """

    solvers: AbstractSolver | tuple[AbstractSolver | None, ...] = diffrax.Euler()

    def order(self, terms):
        self.sub_flows(terms)
        return 1

    def compose(self, flows, subs, t0, t1, y0, args):
        fields = [(term, sub) for term, sub in zip(flows, subs) if not is_projection(term)]
        k = len(fields)
        outs, results = [], []
        for term, sub in fields:
            y_i, result = advance(_ScaledControl(term, k), sub, t0, t1, y0, args)
            outs.append(y_i)
            results.append(result)
        y = jtu.tree_map(lambda *leaves: sum(leaves) / k, *outs)
        for term, sub in zip(flows, subs):
            if is_projection(term):
                y, result = advance(term, sub, t0, t1, y, args)
                results.append(result)
        return y, combine_results(results)


__all__ = ["ParallelSplitting"]
