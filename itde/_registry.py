"""The one registry mapping names to objects: quadrature rules, depth schemes,
activations, feed-forward forms, attention cores and kinds of split terms.

Configs, the CLI and constructors check names against these and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import diffrax

import itde_solvers as solvers

from ._operators._attention import ATTENTION_IMPLS
from ._operators._feedforward import ACTIVATIONS
from ._quadrature._rules import RULES

#: How the last substep of the feed-forward combines: u + F(u), or the relaxation (u + F(u))/2.
FFN_FORMS: tuple[str, ...] = ("residual", "relaxation")
#: Where the normalisations sit in a block (see `TransformerIDE`): constraints after each
#: sub-flow (the paper), maps before each operator, or one parallel field.
BLOCK_FORMS: tuple[str, ...] = ("post_norm", "pre_norm", "parallel")
#: How a model splits its right-hand side (see `TransformerIDE.terms`).
TERMS_KINDS: tuple[str, ...] = ("paper", "split", "tangent")


class Scheme(NamedTuple):
    """A depth integrator: how to build it, its expected global order, its terms kind."""

    make: Callable[[], diffrax.AbstractSolver]
    order: float
    terms: str
    label: str


SCHEMES: dict[str, Scheme] = {
    "lie": Scheme(solvers.LieTrotter, 1, "paper", "Lie-Trotter splitting (the paper's sub-flows)"),
    "strang": Scheme(solvers.Strang, 2, "split", "Strang splitting (Heun sub-steps)"),
    "parallel": Scheme(solvers.ParallelSplitting, 1, "split", "parallel (averaged) splitting"),
    "euler": Scheme(lambda: solvers.Projected(diffrax.Euler()), 1, "tangent", "projected Euler"),
    "heun": Scheme(lambda: solvers.Projected(diffrax.Heun()), 2, "tangent", "projected Heun"),
    "midpoint": Scheme(
        lambda: solvers.Projected(diffrax.Midpoint()), 2, "tangent", "projected midpoint"
    ),
    "rk4": Scheme(lambda: solvers.Projected(solvers.RK4()), 4, "tangent", "projected RK4"),
    "tsit5": Scheme(lambda: solvers.Projected(diffrax.Tsit5()), 5, "tangent", "projected Tsit5"),
    "dopri5": Scheme(lambda: solvers.Projected(diffrax.Dopri5()), 5, "tangent", "projected Dopri5"),
    "dopri8": Scheme(lambda: solvers.Projected(diffrax.Dopri8()), 8, "tangent", "projected Dopri8"),
}

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_IMPLS",
    "BLOCK_FORMS",
    "FFN_FORMS",
    "RULES",
    "SCHEMES",
    "TERMS_KINDS",
    "Scheme",
]
