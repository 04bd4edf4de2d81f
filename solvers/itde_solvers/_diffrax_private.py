r"""The diffrax internals this project needs that diffrax does not re-export (the one place
they are imported, for itde_solvers and itde alike).

- `WrapTerm`: `diffeqsolve` hands a solver every term wrapped in it (it flips time for a
  backward solve, $t \mapsto$ `direction` $\cdot t$). The splitting solvers unwrap it to
  reach the `SplitTerm` and push the wrap down onto each sub-flow.
- `AdjointTerm`: `diffrax.BacksolveAdjoint` runs its backward (adjoint) solve over the
  terms wrapped in it; `Projected` recognises that solve and runs it unprojected.

- `progress_meter_manager`: diffrax's host-side registry of open progress bars (`init`,
  `step`, `close`, each threaded through a solve by the meter's callbacks), which a
  progress meter of one's own reports through (`itde.studies._meter.StageMeter`); it lives
  in `diffrax._progress_meter`.

Also the messages of `diffrax.RESULTS` by index and a result's index (equinox's
`Enumeration` keeps them in `_index_to_message` and `_value`): a program that returns
its failure as data (so that it calls back into Python for no check) raises the message
of the result it returned on the host.

The two classes live in `diffrax._term`, a private module, so they may move in any release. The
pinned range is where this was verified by running the solver tests (diffrax 0.7.0 and
0.7.2, on JAX 0.10). The sources of 0.6.0 and 0.6.2 define and use both the same way,
but those releases do not run on JAX 0.10 (they call the removed `jax.core.get_aval`), so
they were not tested and are not claimed.
`tests/test_solvers_boundary.py` checks both assumptions against the installed diffrax and
names the pin when they fail. Import them from here only.
"""

import diffrax
from diffrax._progress_meter import _progress_meter_manager as progress_meter_manager
from diffrax._term import AdjointTerm, WrapTerm

KNOWN_DIFFRAX = ">=0.7.2,<0.8"  # keep equal to the `diffrax` line of pyproject.toml


def result_messages() -> tuple[str, ...]:
    """The message of each `diffrax.RESULTS` item, by index (index 0: successful, "")."""
    return tuple(diffrax.RESULTS._index_to_message)


def result_index(result):
    """The index of a `diffrax.RESULTS` item (a traced int32 array inside a program)."""
    return result._value


__all__ = [
    "AdjointTerm",
    "KNOWN_DIFFRAX",
    "WrapTerm",
    "progress_meter_manager",
    "result_index",
    "result_messages",
]
