"""One entry point for solving the equation: `itde.solve`."""

from __future__ import annotations

import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from itde_solvers import LieTrotter, ParallelSplitting, Projected, SplitTerm, Strang

from ._equation import TransformerIDE


def fixed_steps(t0: float, t1: float, dt0: float) -> np.ndarray:
    """The step times of a fixed-step solve, ending exactly at `t1` (float64 NumPy)."""
    n = max(1, math.ceil((t1 - t0) / dt0 - 1e-9))
    ts = t0 + dt0 * np.arange(n + 1, dtype=np.float64)
    ts[-1] = t1
    return ts


def solve(
    model: TransformerIDE,
    u0,
    *,
    t1: float | None = None,
    solver: diffrax.AbstractSolver | None = None,
    dt0: float | None = None,
    stepsize_controller: diffrax.AbstractStepSizeController | None = None,
    saveat: diffrax.SaveAt | None = None,
    adjoint: diffrax.AbstractAdjoint | None = None,
    max_steps: int | None = None,
    progress_meter: diffrax.AbstractProgressMeter | None = None,
    terms: str | SplitTerm | None = None,
    batched: bool = False,
) -> diffrax.Solution:
    r"""Solve the Transformer IDE from the initial state `u0` and return diffrax's `Solution`.

    Defaults give the paper's scheme: `LieTrotter` splitting with $\Delta t$ equal to the
    layer width (1 for the standard Transformer) from $t_0$ to the model's depth, saving
    the final state. Fixed steps are taken with `diffrax.StepTo` on the exact grid
    $t_0, t_0 + \Delta t, \dots, t_1$ (the last step shortened if $\Delta t$ does not
    divide $t_1 - t_0$) and `max_steps` set to the number of steps, so reverse-mode
    memory is sized exactly.

    **Arguments:**

    - `model`: a [`TransformerIDE`][itde.TransformerIDE].
    - `u0`: one initial state `[tokens, features]` (vmap for a batch).
    - `t1`: final depth (default `model.depth`).
    - `solver`: any diffrax solver whose terms fit the model's `SplitTerm` (default
      `LieTrotter()`).
    - `dt0`: the depth step (fixed-step solves; default the layer width).
    - `stepsize_controller`: e.g. `diffrax.PIDController(...)` for adaptive solves; then
      `dt0` is the initial step (or None to let diffrax choose).
    - `saveat`, `adjoint`, `max_steps`, `progress_meter`: as in `diffrax.diffeqsolve`
      (defaults: final state; `RecursiveCheckpointAdjoint`, with one checkpoint per step
      for fixed steps; the exact step count for fixed steps, 4096 for adaptive ones).
      With `BacksolveAdjoint` fixed steps use `ConstantStepSize` (its backward solve
      cannot run a `StepTo` grid in reverse).
    - `terms`: the terms to integrate: a kind for `model.terms(kind)` — `"paper"`
      (default for `LieTrotter`), `"split"` (default for `Strang` and
      `ParallelSplitting`), `"tangent"` (default for any other solver, e.g.
      `solvers.Projected(diffrax.Tsit5())`) — or a `SplitTerm`. For the continuum
      kinds (`"split"`, `"tangent"`) the solution starts from $P_{S_1(t_0)}(u_0)$: the
      equation lives on the constraint set, and the projection term moves the initial
      condition onto it at $t_0^+$. The `"paper"` kind starts from `u0` itself (the
      Transformer's first block sees the unnormalised embedding).
    - `batched`: `u0` has a leading batch axis, `[batch, tokens, features]`; the
      sub-flows are mapped over it inside one solve (`model.terms(kind, batched=True)`).
      Same result as `jax.vmap` of the solve, with a cheaper backward pass.
    """
    if not isinstance(model, TransformerIDE):
        raise TypeError(f"`model` must be an itde.TransformerIDE, got {type(model).__name__}.")
    if batched:
        if getattr(u0, "ndim", None) != 3:
            raise ValueError(
                f"`u0` with batched=True must be [batch, tokens, {model.n_features}], got "
                f"shape {getattr(u0, 'shape', None)}."
            )
        model.check_state(u0[0], "u0[i]")
    else:
        model.check_state(u0, "u0")
    t0 = float(model.t0)
    t1 = float(model.depth if t1 is None else t1)
    if not math.isfinite(t1) or t1 <= t0:
        raise ValueError(
            f"`t1`={t1} must be finite and greater than t0={t0}; give the final depth, "
            f"e.g. t1={model.depth} (the number of layers)."
        )
    if (
        dt0 is not None
        and not isinstance(dt0, jax.core.Tracer)
        and not (math.isfinite(float(dt0)) and float(dt0) > 0)
    ):
        raise ValueError(
            f"`dt0`={dt0} must be a positive finite depth step, e.g. dt0=1.0 (one layer per "
            "step) or dt0=0.1."
        )
    solver = LieTrotter() if solver is None else solver
    if not isinstance(solver, (LieTrotter, Strang, ParallelSplitting, Projected)):
        raise TypeError(
            f"`solver`={type(solver).__name__} would integrate the equation without its "
            "projections onto S1; wrap it in a projection method, e.g. "
            f"`solvers.Projected(diffrax.{type(solver).__name__}())`, or use a splitting "
            "solver (solvers.LieTrotter, Strang, ParallelSplitting)."
        )
    saveat = diffrax.SaveAt(t1=True) if saveat is None else saveat
    default_adjoint = adjoint is None
    adjoint = diffrax.RecursiveCheckpointAdjoint() if adjoint is None else adjoint
    if isinstance(solver, Projected) and solver.scan_kind is None:
        if isinstance(adjoint, diffrax.DirectAdjoint):
            solver = solver.with_scan_kind("bounded")
        elif isinstance(adjoint, diffrax.ForwardMode):
            solver = solver.with_scan_kind("lax")
    if terms is None:
        if isinstance(solver, LieTrotter):
            terms = "paper"
        elif isinstance(solver, (Strang, ParallelSplitting)):
            terms = "split"
        else:
            terms = "tangent"
    if isinstance(terms, str):
        if terms in ("split", "tangent"):
            # the continuum equation lives on S1(t): its solution starts from the
            # projection of the initial condition, u(t0+) = P_{S1(t0)}(f)
            if batched:
                u0 = jax.vmap(lambda v: model.project(t0, v))(u0)
            else:
                u0 = model.project(t0, u0)
        terms = model.terms(terms, batched=batched)
    # diffrax promotes the state to the dtype of the times: keep the state's precision.
    tdtype = u0.dtype
    if stepsize_controller is None:
        if isinstance(dt0, jax.core.Tracer):
            raise TypeError(
                "a traced `dt0` needs `stepsize_controller=diffrax.ConstantStepSize()` (the "
                "default fixed-step grid is built at trace time from a concrete dt0)."
            )
        dt = float(model.controls.width if dt0 is None else dt0)
        ts = fixed_steps(t0, t1, dt)
        steps = len(ts) - 1 if max_steps is None else max_steps
        if isinstance(adjoint, diffrax.BacksolveAdjoint):
            # its backward solve reuses the controller in reverse, which StepTo forbids
            controller, first_dt = diffrax.ConstantStepSize(), dt
            steps += 1  # room for a round-off sliver at t1
        else:
            controller, first_dt = diffrax.StepTo(ts=jnp.asarray(ts, dtype=tdtype)), None
        if default_adjoint:
            # a fixed number of steps: keep every step's state (memory n_steps states, no
            # binomial recomputation of the forward)
            adjoint = diffrax.RecursiveCheckpointAdjoint(checkpoints=steps)
    else:
        controller = stepsize_controller
        first_dt = dt0
        steps = 4096 if max_steps is None else max_steps
    u0 = eqx.error_if(
        u0,
        ~jnp.all(jnp.isfinite(u0)),
        "itde.solve: the initial state `u0` has a NaN or infinite entry; check the "
        "embedding or the data that produced it.",
    )
    kwargs = {} if progress_meter is None else {"progress_meter": progress_meter}
    return diffrax.diffeqsolve(
        terms,
        solver,
        t0=jnp.asarray(t0, tdtype),
        t1=jnp.asarray(t1, tdtype),
        dt0=None if first_dt is None else jnp.asarray(first_dt, tdtype),
        y0=u0,
        saveat=saveat,
        stepsize_controller=controller,
        adjoint=adjoint,
        max_steps=steps,
        **kwargs,
    )
