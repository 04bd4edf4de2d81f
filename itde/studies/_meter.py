"""Progress inside one long solve: a diffrax progress meter that reports through
`itde._progress.progress_bar` (tqdm's bar on a terminal, about ten whole lines with the
elapsed and remaining time in a log), labelled by the Python code around the solve.

The meter itself holds no label, so a compiled solve is reused whatever the label: the
label and whether to show anything are set on the host by `solve_progress` around the
call, and read when the solve starts (its first callback). Outside `solve_progress` the
meter shows nothing.
"""

from __future__ import annotations

import contextlib
import math

import diffrax
import equinox as eqx
import equinox.internal as eqxi
import jax
import jax.numpy as jnp

# diffrax's host-side registry of open bars (threads each callback's bar through the solve),
# a diffrax private reached through the project's one shim for those
from itde_solvers._diffrax_private import progress_meter_manager as _manager

_CURRENT: list[tuple] = []  # (label, enabled, postfix) of the solves now running


@contextlib.contextmanager
def solve_progress(desc: str, *, enabled: bool = True, postfix=None):
    """Label the `StageMeter` of the solves run inside (`desc: 40% ... [12s<18s]`); with
    `enabled` false they show nothing. `postfix(fraction, seconds)`, if given, says more
    at each refresh from the fraction of the solve done and the seconds it has run (e.g.
    an estimate of the whole computation the solve is part of)."""
    _CURRENT.append((desc, enabled, postfix))
    try:
        yield
    finally:
        _CURRENT.pop()


def _open():
    from .._progress import progress_bar

    desc, enabled, postfix = _CURRENT[-1] if _CURRENT else ("solve", False, None)
    bar = progress_bar(100, desc, enabled=enabled, unit="%")
    bar.itde_postfix = postfix if enabled else None
    return bar


def _step(bar, progress) -> None:
    bar.n = math.floor(100 * float(progress))  # whole percents
    postfix = getattr(bar, "itde_postfix", None)
    if postfix is not None and float(progress) > 0:
        bar.set_postfix_str(postfix(float(progress), bar.format_dict["elapsed"]), refresh=False)
    bar.update(n=0)
    bar.refresh()


def _close(bar) -> None:
    bar.n = 100
    bar.update(n=0)
    bar.close()


class _MeterState(eqx.Module):
    meter_idx: jax.Array
    step: jax.Array


class StageMeter(diffrax.AbstractProgressMeter):
    """A progress meter for `diffrax.diffeqsolve` (through `itde.solve(progress_meter=)`)
    whose bar is `itde._progress.progress_bar`, labelled by `solve_progress`; refreshed
    every `refresh_steps` steps (a host callback each)."""

    refresh_steps: int = eqx.field(static=True, default=1)

    def init(self) -> _MeterState:
        return _MeterState(meter_idx=_manager.init(_open), step=jnp.array(0))

    def step(self, state: _MeterState, progress) -> _MeterState:
        idx = jax.lax.cond(
            eqxi.nonbatchable(eqxi.unvmap_max(state.step) % self.refresh_steps == 0),
            lambda i: _manager.step(_step, progress, i),
            lambda i: i,
            state.meter_idx,
        )
        return _MeterState(meter_idx=idx, step=state.step + 1)

    def close(self, state: _MeterState):
        _manager.close(_close, state.meter_idx)
