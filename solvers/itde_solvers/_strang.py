"""Strang (symmetric) operator splitting as a diffrax solver, with time as a state variable."""

from __future__ import annotations

from typing import Any

import diffrax
from diffrax import AbstractSolver, AbstractTerm

from ._splitting import AbstractSplittingSolver
from ._subflows import advance, combine_results, is_projection


class _FrozenTime(AbstractTerm):
    """A sub-flow whose vector field reads the clock value `time`, whatever the solver's time.

    This is the sub-flow $(y, s)' = (f_i(s, y), 0)$ of the time-augmented system: the
    state moves, the clock $s$ does not. Only the increment of the control (`t1 - t0`)
    of the interval it is stepped over matters.
    """

    term: AbstractTerm
    time: Any

    def vf(self, t, y, args):
        del t
        return self.term.vf(self.time, y, args)

    def contr(self, t0, t1, **kwargs):
        return self.term.contr(t0, t1, **kwargs)

    def prod(self, vf, control):
        return self.term.prod(vf, control)


def _split_blocks(flows) -> tuple[list[tuple[int, list[int]]], list[int]]:
    """Group sub-flows into blocks: a vector field and the projections that follow it.

    Returns `(blocks, leading)`: each block is `(vector_field_index, projection_indices)`,
    and `leading` are the indices of projections that come before the first vector field.
    """
    blocks: list[tuple[int, list[int]]] = []
    leading: list[int] = []
    for i, term in enumerate(flows):
        if is_projection(term):
            (blocks[-1][1] if blocks else leading).append(i)
        else:
            blocks.append((i, []))
    return blocks, leading


class Strang(AbstractSplittingSolver):
    r"""Strang (symmetric) splitting of $y_t = \sum_i f_i(t, y)$, time-dependent fields included.

    The sub-flows of a [`SplitTerm`][itde_solvers.SplitTerm] are grouped into $M$ blocks: a
    vector field $f_i$ followed by the projections that come after it in the tuple. One
    step of length $h$ from $t_0$ to $t_1$ applies blocks $1, \dots, M-1$ for $h/2$ in
    order, block $M$ (the last vector field) for $h$, then blocks $M-1, \dots, 1$ for
    $h/2$ in reverse order:

    $$\Phi^{(1)}_{h/2} \to \cdots \to \Phi^{(M-1)}_{h/2} \to \Phi^{(M)}_{h} \to
    \Phi^{(M-1)}_{h/2} \to \cdots \to \Phi^{(1)}_{h/2}.$$

    A vector-field sub-flow takes one step of its sub-solver; each projection in a block
    is applied right after its vector field. Projections placed before the first vector
    field in the tuple are applied once, at the end of the step. With $M = 1$ this is a
    single sub-solver step followed by the projections.

    **Time is a state variable owned by one sub-flow.** The step integrates the
    autonomous augmented system $(y, s)' = (\sum_i f_i(s, y), 1)$: the clock $s$ advances
    only inside the *clock owner* `clock` (default: the last vector field, which runs
    once over the whole $[t_0, t_1]$), which is stepped as the non-autonomous
    $y' = f_{\mathrm{clock}}(t, y)$ over its part of $[t_0, t_1]$. Every other
    vector field is stepped with its time frozen at the current clock value, and every
    projection maps onto the constraint set at the current clock value. With the default
    owner the first half-steps see $s = t_0$, the middle flow runs from $t_0$ to $t_1$,
    and the second half-steps (and the final projections) see $s = t_1$. This composition
    is symmetric, so it is second order for non-autonomous fields too; letting every
    sub-step advance its own clock (each half starting at $t_0$, say) is inconsistent at
    $O(h^2)$ and drops the method to order 1. Put any drift that exists because the
    constraint set moves (terms in $\dot\sigma(t)$) into the clock owner's field only.
    If the owner is a half-step flow, it runs over $[t_0, t_0 + h/2]$ and then over
    $[t_0 + h/2, t_1]$.

    **Order:** 2 (global), when every vector-field sub-solver has order $\geq 2$ and the
    fields are $C^2$ in $(t, y)$ (then $\min(2, p)$ for sub-solvers of order $p$; the
    order of the single sub-solver when $M = 1$). With projections it stays 2 when each
    vector field is tangent to the constraint sets (the projection then only removes the
    sub-solver's drift off the set). For fields with a normal component, "flow, then
    project" approximates the flow of the tangential part only to first order, so expect
    order 1 unless the split fields are the tangential ones. No error estimate is made;
    wrap in `diffrax.HalfSolver` for adaptive steps.

    **Arguments:**

    - `solvers`: a diffrax solver used for every vector-field sub-flow, or a tuple with
      one solver per sub-flow (None for projections). Default: `diffrax.Heun()` (order 2,
      the cheapest explicit choice that keeps order 2; use `itde_solvers.RK4()` for a smaller
      error constant in the sub-flows).
    - `clock`: index, in the `SplitTerm`'s tuple, of the vector-field sub-flow that owns
      the clock. Default None: the last vector field.
    """

    solvers: AbstractSolver | tuple[AbstractSolver | None, ...] = diffrax.Heun()
    clock: int | None = None

    def _plan(self, flows):
        """The blocks, the leading projections and the clock owner, checked."""
        blocks, leading = _split_blocks(flows)
        vector_fields = [i for i, _ in blocks]
        owner = vector_fields[-1] if self.clock is None else self.clock
        if owner not in vector_fields:
            raise ValueError(
                f"`Strang(clock={self.clock!r})` must be the index of a vector-field "
                f"sub-flow of the SplitTerm, one of {vector_fields}."
            )
        return blocks, leading, owner

    def order(self, terms):
        flows, subs = self.sub_flows(terms)
        blocks, _, _ = self._plan(flows)
        orders = [subs[i].order(flows[i]) for i, _ in blocks]  # type: ignore[union-attr]
        if any(p is None for p in orders):
            return None
        return min(orders) if len(blocks) == 1 else min(2, *orders)

    def compose(self, flows, subs, t0, t1, y0, args):
        blocks, leading, owner = self._plan(flows)
        tm = t0 + 0.5 * (t1 - t0)
        schedule = [(b, 0.5) for b in blocks[:-1]]
        schedule += [(blocks[-1], 1.0)] + [(b, 0.5) for b in reversed(blocks[:-1])]
        owned = sum(1 for (i, _), _ in schedule if i == owner)
        clock_times = iter([t1] if owned == 1 else [tm, t1])

        s = t0
        y = y0
        results = []
        for (i, projections), fraction in schedule:
            if i == owner:
                s_end = next(clock_times)
                y, result = advance(flows[i], subs[i], s, s_end, y, args)
                s = s_end
            else:
                tau = fraction * (t1 - t0)
                y, result = advance(_FrozenTime(flows[i], s), subs[i], s, s + tau, y, args)
            results.append(result)
            for j in projections:
                y, result = advance(flows[j], None, s, s, y, args)
                results.append(result)
        for j in leading:
            y, result = advance(flows[j], None, s, s, y, args)
            results.append(result)
        return y, combine_results(results)


__all__ = ["Strang"]
