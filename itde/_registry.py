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
- `ROUTERS` (`itde._operators._experts`): the routings of a mixture of experts,
  `"softmax_top_k"` -> `SoftmaxTopK`, `"renormalised_top_k"` -> `RenormalisedTopK`.
- `RULES` (`itde._quadrature._rules`): quadrature rules.
- `SCHEMES` (here): depth integrators (`Scheme`: the solver, its order read from it, and
  `solve_options`, the one route from a name to `itde.solve`'s arguments).
- `TERMS_KINDS` (`itde._solve`): the kinds of terms an equation gives a solver.

Two registries live outside the core, because the core never imports what is above it:
the Hugging Face families (`itde.interop.HF_FAMILIES`) and the training tasks
(`itde.train.TASKS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import diffrax

import itde_solvers as solvers

from ._blocks import BLOCK_FORMS, FFN_FORMS
from ._controls import NORMS, PiecewiseConstant
from ._operators._cores import ATTENTION_CORES
from ._operators._experts import ROUTERS
from ._operators._feedforward import ACTIVATIONS
from ._operators._qknorm import QK_NORMS
from ._quadrature._rules import RULES
from ._solve import TERMS_KINDS, check_depth_step, terms_kind


class Scheme(NamedTuple):
    """A depth integrator: its name, how to build its solver, and its label. Its expected
    global order is the solver's own (`order()`, as diffrax's solvers carry it); the kind
    of terms it integrates is `terms` (from `itde.solve`'s one rule, `terms_kind`).
    [`solve_options`][itde.Scheme.solve_options] is the one route from a scheme name to
    `itde.solve`'s arguments, with the depth step checked against the model."""

    name: str
    make: Callable[[], diffrax.AbstractSolver]
    label: str

    @property
    def terms(self) -> str:
        return terms_kind(self.make())

    @property
    def order(self) -> int:
        """The solver's global order (its `order(terms)`, asked with two vector-field
        sub-flows: every scheme here integrates a `SplitTerm`)."""
        return int(self.make().order(_PROBE_TERMS))

    def check(self, controls, dt, *, name: str = "dt") -> None:
        """Check that this scheme and the fixed step `dt` fit `controls`: per-layer controls
        take the paper's scheme `"lie"` with $0 < \\Delta t \\le$ one layer (`itde.solve`'s
        rule, `check_depth_step`), controls smooth in depth any scheme with
        $0 < \\Delta t \\le T$. `name`: the argument named in an error (`"--dt"` for the CLI)."""
        if isinstance(dt, bool) or not (isinstance(dt, int | float) and math.isfinite(dt)
                                        and dt > 0):  # fmt: skip
            raise ValueError(f"`{name}`={dt!r} must be a positive depth step, e.g. 1.0.")
        if isinstance(controls, PiecewiseConstant):
            if self.name != "lie":
                raise ValueError(
                    f"`scheme`={self.name!r} integrates the continuum equation, which needs "
                    "controls smooth in depth with the exact projection (eps = 0); this model "
                    "has per-layer controls (trained with scheme 'lie'): evaluate it with "
                    "scheme 'lie' and any dt."
                )
            check_depth_step(dt, float(controls.layer_length), name=name)
            return
        limit = float(controls.t1 - controls.t0)
        if dt > limit * (1 + 1e-12):
            raise ValueError(
                f"`{name}`={dt!r} is longer than the depth T ({limit:g}): a step may not skip "
                f"depth; choose 0 < {name} <= {limit:g} (e.g. {limit / 2:g})."
            )

    def solve_options(self, dt, controls=None, *, name: str = "dt") -> dict:
        """`itde.solve`'s `solver`, `terms` and `dt0` for this scheme at the fixed step
        `dt`, checked against `controls` where given (`check`)."""
        if controls is not None:
            self.check(controls, dt, name=name)
        return {"solver": self.make(), "terms": self.terms, "dt0": dt}


def _probe_field(t, y, args):
    return y


_PROBE_TERMS = solvers.SplitTerm((diffrax.ODETerm(_probe_field), diffrax.ODETerm(_probe_field)))


def _projected(solver: diffrax.AbstractSolver) -> Callable[[], diffrax.AbstractSolver]:
    return lambda: solvers.Projected(solver)


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("lie", solvers.LieTrotter, "Lie-Trotter splitting (the paper's sub-flows)"),
        Scheme("strang", solvers.Strang, "Strang splitting (Heun sub-steps)"),
        Scheme("parallel", solvers.ParallelSplitting, "parallel (averaged) splitting"),
        Scheme("euler", _projected(diffrax.Euler()), "projected Euler"),
        Scheme("heun", _projected(diffrax.Heun()), "projected Heun"),
        Scheme("midpoint", _projected(diffrax.Midpoint()), "projected midpoint"),
        Scheme("rk4", _projected(solvers.RK4()), "projected RK4"),
        Scheme("tsit5", _projected(diffrax.Tsit5()), "projected Tsit5"),
        Scheme("dopri5", _projected(diffrax.Dopri5()), "projected Dopri5"),
        Scheme("dopri8", _projected(diffrax.Dopri8()), "projected Dopri8"),
    )
}
"""The depth integrators by name, for configs and the CLI (`scheme = "rk4"`): name -> `Scheme`
(how to make the solver, which terms it integrates, its order)."""


def scheme(name, *, what: str = "`scheme`") -> Scheme:
    """The `Scheme` called `name`; a `ValueError` naming `what`, the value and the choices
    where there is none."""
    if not isinstance(name, str) or name not in SCHEMES:
        raise ValueError(f"{what}={name!r} is not known; choose one of {sorted(SCHEMES)}.")
    return SCHEMES[name]


__all__ = [
    "ACTIVATIONS",
    "ATTENTION_CORES",
    "BLOCK_FORMS",
    "FFN_FORMS",
    "NORMS",
    "QK_NORMS",
    "ROUTERS",
    "RULES",
    "SCHEMES",
    "TERMS_KINDS",
    "Scheme",
    "scheme",
]
