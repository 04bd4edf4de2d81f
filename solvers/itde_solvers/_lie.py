"""Lie–Trotter (sequential) operator splitting as a diffrax solver."""

from __future__ import annotations

from typing import ClassVar

import diffrax
from diffrax import AbstractSolver, AbstractTerm, LocalLinearInterpolation

from ._terms import check_split, is_projection


def _resolve_subsolvers(
    solvers: AbstractSolver | tuple[AbstractSolver | None, ...],
    terms: tuple[AbstractTerm, ...],
    name: str,
) -> tuple[AbstractSolver | None, ...]:
    """One sub-solver per sub-flow (None for projections), checked at trace time."""
    n = len(terms)
    if isinstance(solvers, AbstractSolver):
        return tuple(None if is_projection(t) else solvers for t in terms)
    if len(solvers) != n:
        raise ValueError(
            f"`{name}(solvers=...)` has {len(solvers)} entries but the SplitTerm has {n} "
            "sub-flows; give one solver per sub-flow (None for a projection), or a single "
            "solver to use for every vector-field sub-flow."
        )
    for i, (term, sub) in enumerate(zip(terms, solvers)):
        if is_projection(term) and sub is not None:
            raise ValueError(
                f"`{name}(solvers=...)`: entry {i} is a projection and takes no sub-solver; "
                "put None there."
            )
        if not is_projection(term) and not isinstance(sub, AbstractSolver):
            raise TypeError(
                f"`{name}(solvers=...)`: entry {i} must be a diffrax solver for the "
                f"vector field {type(term).__name__}, got {sub!r}."
            )
    return tuple(solvers)


def advance(term: AbstractTerm, sub: AbstractSolver | None, t0, t1, y, args):
    """Advance one sub-flow over `[t0, t1]`: one sub-solver step, or the projection at `t1`.

    Returns `(y1, result)`.
    """
    if sub is None:
        return term.project(t1, y), diffrax.RESULTS.successful  # type: ignore[attr-defined]
    state = sub.init(term, t0, t1, y, args)
    y1, _, _, _, result = sub.step(term, t0, t1, y, args, state, made_jump=False)
    return y1, result


def combine_results(results):
    out = diffrax.RESULTS.successful
    for r in results:
        out = diffrax.RESULTS.where(out == diffrax.RESULTS.successful, r, out)
    return out


class LieTrotter(AbstractSolver):
    r"""Lie–Trotter (sequential) splitting of $y_t = \sum_i f_i(t, y)$.

    One step from $t_0$ to $t_1$ applies the sub-flows of a
    [`SplitTerm`][solvers.SplitTerm] one after another, each over the whole interval
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

    term_structure: ClassVar = AbstractTerm
    interpolation_cls: ClassVar = LocalLinearInterpolation

    def order(self, terms):
        return 1

    def init(self, terms, t0, t1, y0, args):
        return None

    def step(self, terms, t0, t1, y0, args, solver_state, made_jump):
        del solver_state, made_jump
        flows = check_split(terms, "LieTrotter")
        subs = _resolve_subsolvers(self.solvers, flows, "LieTrotter")
        y = y0
        results = []
        for term, sub in zip(flows, subs):
            y, result = advance(term, sub, t0, t1, y, args)
            results.append(result)
        return y, None, dict(y0=y0, y1=y), None, combine_results(results)

    def func(self, terms, t0, y0, args):
        return terms.vf(t0, y0, args)
