"""Generic depth-time integration on top of diffrax: operator splitting and projections.

This package knows nothing of Transformers: a vector field is a diffrax term and a
projection is a callable `(t, y) -> y`. The terms of a split problem are a `SplitTerm`,
an ordered tuple of sub-flows (`diffrax.ODETerm`s and `ProjectionTerm`s); the solvers are
ordinary diffrax solvers, so `diffrax.diffeqsolve`, its adjoints and `SaveAt` work as usual.

- Splitting: `LieTrotter` (order 1), `Strang` (order 2), `ParallelSplitting` (order 1),
  all subclasses of `AbstractSplittingSolver`.
- Projection methods: `Projected` wraps any diffrax solver and projects after each step.
- `FrozenTime` wraps any solver for a field that is constant in time on each step (a
  piecewise-constant field whose jumps are step ends): every stage reads the step's own
  piece, so the wrapped solver keeps its order.
- `RK4`, the classical Runge–Kutta tableau; `observed_order` and `error_norm` for
  convergence studies.

**Writing a new splitting solver.** Subclass `AbstractSplittingSolver`, give it a
`solvers` field with a default, an `order`, and a `compose` that builds one step from the
public helpers `advance` (one sub-flow over an interval: a sub-solver step, or the
projection) and `combine_results`. `split_flows`, `resolve_subsolvers` and
`is_projection` are there for solvers that need to look at the terms themselves. For
example, Lie–Trotter with the sub-flows applied last to first (the adjoint of
`LieTrotter`, also order 1):

```python
import diffrax
import itde_solvers


class ReversedLieTrotter(itde_solvers.AbstractSplittingSolver):
    solvers: diffrax.AbstractSolver = diffrax.Euler()

    def order(self, terms):
        return 1

    def compose(self, flows, subs, t0, t1, y0, args):
        y, results = y0, []
        for term, sub in reversed(tuple(zip(flows, subs))):
            y, result = itde_solvers.advance(term, sub, t0, t1, y, args)
            results.append(result)
        return y, itde_solvers.combine_results(results)


terms = itde_solvers.SplitTerm(
    (diffrax.ODETerm(lambda t, y, args: -y), diffrax.ODETerm(lambda t, y, args: t * y))
)
sol = diffrax.diffeqsolve(terms, ReversedLieTrotter(), 0.0, 1.0, 0.01, 1.0)
```
"""

from ._convergence import error_norm, observed_order
from ._diffrax_private import result_index, result_messages
from ._frozen import FrozenTime
from ._lie import LieTrotter
from ._parallel import ParallelSplitting
from ._projected import Projected
from ._rk4 import RK4
from ._splitting import AbstractSplittingSolver
from ._strang import Strang
from ._subflows import advance, combine_results, is_projection, resolve_subsolvers, split_flows
from ._terms import ProjectionTerm, SplitTerm

__all__ = [
    "AbstractSplittingSolver",
    "FrozenTime",
    "LieTrotter",
    "ParallelSplitting",
    "Projected",
    "ProjectionTerm",
    "RK4",
    "SplitTerm",
    "Strang",
    "advance",
    "combine_results",
    "error_norm",
    "is_projection",
    "observed_order",
    "resolve_subsolvers",
    "result_index",
    "result_messages",
    "split_flows",
]
