"""The registries of the core: names (as configs, the CLI and convenience constructors
spell them) mapped to the modules and functions they stand for.

Strings are accepted only at these edges and turned into modules once; the core holds
and calls the modules. Each registry lives beside the variants it lists and is
re-exported here, so this is the one place to look them up:

- `BLOCK_FORMS` (`itde._blocks`): block forms, `"post_norm"` -> `PostNorm`, ...;
  `FFN_FORMS`: the post-norm feed-forward forms (`"relaxation"` -> `PostNorm(relaxation=True)`).
- `NORMS` (`itde._controls`): normalisations, `"layer"` -> `LayerNormProjection`, ...
- `ATTENTION_CORES` (`itde._operators._cores`): `"dense"` -> `Dense`, ...
- `QK_NORMS` (`itde._operators._qknorm`): query/key normalisations, `"per_head"` ->
  `PerHeadQKNorm`, `"joint"` -> `JointQKNorm`.
- `ACTIVATIONS` (`itde._operators._feedforward`): activation functions.
- `RULES` (`itde._quadrature._rules`): quadrature rules.
- `SCHEMES` (here): depth integrators with their expected orders.
- `TERMS_KINDS` (`itde._solve`): the kinds of terms an equation gives a solver.

Two registries live outside the core, because the core never imports what is above it:
the Hugging Face families (`itde.interop.HF_FAMILIES`) and the training tasks
(`itde.train.TASKS`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import diffrax

import itde_solvers as solvers

from ._blocks import BLOCK_FORMS, FFN_FORMS
from ._controls import NORMS
from ._operators._cores import ATTENTION_CORES
from ._operators._feedforward import ACTIVATIONS
from ._operators._qknorm import QK_NORMS
from ._quadrature._rules import RULES
from ._solve import TERMS_KINDS, terms_kind


class Scheme(NamedTuple):
    """A depth integrator: how to build it, its expected global order and its label. The
    kind of terms it integrates is `terms` (from `itde.solve`'s one rule, `terms_kind`)."""

    make: Callable[[], diffrax.AbstractSolver]
    order: float
    label: str

    @property
    def terms(self) -> str:
        return terms_kind(self.make())


SCHEMES: dict[str, Scheme] = {
    "lie": Scheme(solvers.LieTrotter, 1, "Lie-Trotter splitting (the paper's sub-flows)"),
    "strang": Scheme(solvers.Strang, 2, "Strang splitting (Heun sub-steps)"),
    "parallel": Scheme(solvers.ParallelSplitting, 1, "parallel (averaged) splitting"),
    "euler": Scheme(lambda: solvers.Projected(diffrax.Euler()), 1, "projected Euler"),
    "heun": Scheme(lambda: solvers.Projected(diffrax.Heun()), 2, "projected Heun"),
    "midpoint": Scheme(lambda: solvers.Projected(diffrax.Midpoint()), 2, "projected midpoint"),
    "rk4": Scheme(lambda: solvers.Projected(solvers.RK4()), 4, "projected RK4"),
    "tsit5": Scheme(lambda: solvers.Projected(diffrax.Tsit5()), 5, "projected Tsit5"),
    "dopri5": Scheme(lambda: solvers.Projected(diffrax.Dopri5()), 5, "projected Dopri5"),
    "dopri8": Scheme(lambda: solvers.Projected(diffrax.Dopri8()), 8, "projected Dopri8"),
}
"""The depth integrators by name, for configs and the CLI (`scheme = "rk4"`): name -> `Scheme`
(how to make the solver, which terms it integrates, its expected order)."""

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_CORES",
    "BLOCK_FORMS",
    "FFN_FORMS",
    "NORMS",
    "QK_NORMS",
    "RULES",
    "SCHEMES",
    "TERMS_KINDS",
    "Scheme",
]
