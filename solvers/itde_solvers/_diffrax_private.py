r"""The two diffrax classes this package needs that diffrax does not re-export.

- `WrapTerm`: `diffeqsolve` hands a solver every term wrapped in it (it flips time for a
  backward solve, $t \mapsto$ `direction` $\cdot t$). The splitting solvers unwrap it to
  reach the `SplitTerm` and push the wrap down onto each sub-flow.
- `AdjointTerm`: `diffrax.BacksolveAdjoint` runs its backward (adjoint) solve over the
  terms wrapped in it; `Projected` recognises that solve and runs it unprojected.

Both live in `diffrax._term`, a private module, so they may move in any release. They are
known to exist and to be used as above in diffrax 0.6.0 to 0.7.2 (checked in the sources
of 0.6.0, 0.6.2, 0.7.0 and 0.7.2; the test suite runs on 0.7.2), which is the range pinned
in `pyproject.toml`. `tests/test_solvers_boundary.py` checks both assumptions against the
installed diffrax and names this pin when they fail. Import them from here only.
"""

from diffrax._term import AdjointTerm, WrapTerm

KNOWN_DIFFRAX = ">=0.6.0,<0.8"  # keep equal to the `diffrax` line of pyproject.toml

__all__ = ["AdjointTerm", "KNOWN_DIFFRAX", "WrapTerm"]
