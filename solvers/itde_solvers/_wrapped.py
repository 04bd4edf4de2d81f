"""What a transparent wrapper of a diffrax solver forwards to the solver it wraps."""

from __future__ import annotations

import equinox as eqx
from diffrax import AbstractWrappedSolver


class AbstractForwardingSolver(AbstractWrappedSolver):
    """A wrapper (`solver` field) that forwards what diffrax reads off a solver's
    attributes: the root finder of an implicit solver (so that `diffeqsolve` sets its
    tolerances) and `scan_kind` of a Runge–Kutta solver. diffrax's `DirectAdjoint` and
    `ForwardMode` rewrite a None `scan_kind` to `"bounded"`/`"lax"` with `eqx.tree_at`,
    which cannot reach a wrapped solver's field; `with_scan_kind` sets it on the wrapped
    solver (through any depth of wrappers)."""

    @property
    def root_finder(self):
        return self.solver.root_finder  # pyright: ignore

    @property
    def root_find_max_steps(self):
        return self.solver.root_find_max_steps  # pyright: ignore

    @property
    def scan_kind(self):
        return getattr(self.solver, "scan_kind", None)

    def with_scan_kind(self, kind: str):
        """A copy whose wrapped Runge–Kutta solver uses `scan_kind=kind` for its stages
        (needed with `diffrax.DirectAdjoint`: `kind="bounded"`)."""
        inner = self.solver
        if hasattr(inner, "with_scan_kind"):
            inner = inner.with_scan_kind(kind)  # pyright: ignore
        elif hasattr(inner, "scan_kind"):
            inner = eqx.tree_at(lambda s: s.scan_kind, inner, kind, is_leaf=lambda x: x is None)
        else:
            return self
        return eqx.tree_at(lambda s: s.solver, self, inner)
