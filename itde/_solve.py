"""One entry point for solving the equation: `itde.solve`."""

from __future__ import annotations

import math
from typing import NamedTuple

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from itde_solvers import (
    AbstractSplittingSolver,
    FrozenTime,
    LieTrotter,
    Projected,
    ProjectionTerm,
    SplitTerm,
    result_index,
    result_messages,
)

from ._abstract import AbstractEquation
from ._buckets import AbstractTokenBuckets, PowerOfTwoBuckets, check_buckets
from ._checks import as_array, check_bool, check_float, check_int, warn_at_caller
from ._controls import PiecewiseConstant
from ._host import to_device
from ._programs import check, checks_on_host
from ._token_padding import cut_leaves, has_tracer, run_on_tokens

MAX_FIXED_STEPS = 1_000_000  # a larger fixed grid is a mistaken dt0, not a solve

#: The kinds of terms an equation gives a solver (see `TransformerIDE.terms`).
TERMS_KINDS: tuple[str, ...] = ("paper", "split", "tangent")
"""The kinds of terms an equation gives a solver (see `TransformerIDE.terms`)."""


class DepthStepWarning(UserWarning):
    """A solve whose depth step makes it compute something other than what the model is:
    steps below one layer of a per-layer post-norm network whose norms have per-feature
    gains or shifts (see [`TransformerIDE.continuum_form`][itde.TransformerIDE.continuum_form])."""


def terms_kind(solver: diffrax.AbstractSolver) -> str:
    """The kind of terms a solver integrates by default: the paper's sub-flows for
    `LieTrotter`, the tangent sub-flows for any other splitting solver, the whole tangent
    field for any other solver (wrapped in `Projected` where the equation has a
    constraint). The one place this choice is made."""
    if isinstance(solver, LieTrotter):
        return "paper"
    if isinstance(solver, AbstractSplittingSolver):
        return "split"
    return "tangent"


def fixed_steps(
    t0: float, t1: float, dt0: float, jumps: tuple[float, ...] = (), *, name: str = "dt0"
) -> np.ndarray:
    """The step times of a fixed-step solve (float64 NumPy): steps of `dt0` from `t0`,
    restarted at every jump of the controls in $(t_0, t_1)$ and ending exactly at `t1`, so
    that no step straddles a jump (the last step of each segment is shortened when `dt0`
    does not divide it). Refuses more than `MAX_FIXED_STEPS` steps before allocating."""
    knots = [t0, *(t for t in jumps if t0 < t < t1), t1]
    counts = [max(1, math.ceil((b - a) / dt0 - 1e-9)) for a, b in zip(knots[:-1], knots[1:])]
    total = sum(counts)
    if total > MAX_FIXED_STEPS:
        raise ValueError(
            f"`{name}`={dt0} would take {total:.3g} steps over [{t0}, {t1}] (more than "
            f"{MAX_FIXED_STEPS:.0e}); choose a larger `{name}`, or an adaptive "
            "`stepsize_controller=diffrax.PIDController(...)`."
        )
    pieces = [a + dt0 * np.arange(n, dtype=np.float64) for a, n in zip(knots[:-1], counts)]
    return np.concatenate([*pieces, np.array([t1], np.float64)])


def _time_dtype(u0):
    """Times are float32 or wider whatever the state: in bfloat16 the 301 times of
    dt = 0.02 over [0, 6] collapse to 265 distinct values."""
    return jnp.promote_types(u0.dtype, jnp.float32)


def check_depth_step(dt: float, layer_length: float, *, name: str = "dt0",
                     error: type[Exception] = ValueError) -> None:  # fmt: skip
    """The one rule for the depth step of per-layer controls: a fixed step longer than a
    layer would straddle layer boundaries and skip layers' controls. `name`: the argument
    named in the error (`"--dt"`, `"model.dt"`, ...); `error`: its type (a config's
    `ConfigError`)."""
    if dt > layer_length * (1 + 1e-9):
        h = layer_length
        raise error(
            f"`{name}`={dt!r} is longer than one layer (the layers have depth length {h:g}): "
            "a step would straddle a layer boundary and skip layers' controls; choose "
            f"0 < {name} <= {h:g}, e.g. {h:g} (one step per layer, the discrete Transformer) "
            f"or {h / 2:g} (two steps per layer)."
        )


def _check_depth_step(controls, dt0) -> None:
    if isinstance(controls, PiecewiseConstant):
        check_depth_step(dt0, float(controls.layer_length))


def solve(
    model: AbstractEquation,
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
    throw: bool = True,
    args=None,
    buckets: AbstractTokenBuckets | None = PowerOfTwoBuckets(),
) -> diffrax.Solution:
    r"""Solve the Transformer IDE from the initial state `u0` and return diffrax's `Solution`.

    The solution is the state $u(t)$ of the equation: a model's output map (`final_norm`,
    e.g. GPT-2's `ln_f`) is not applied here; calling the model applies it
    (`model(u0)` = `model.final_norm(solve(model, u0).ys[-1])` for a discrete model).

    Defaults give the paper's scheme: `LieTrotter` splitting with $\Delta t$ equal to the
    layer length (1 for the standard Transformer) from $t_0$ to the model's depth, saving
    the final state. Fixed steps are taken with `diffrax.StepTo` on the exact grid
    $t_0, t_0 + \Delta t, \dots, t_1$, restarted at every layer boundary (the last step
    of a layer shortened if $\Delta t$ does not divide it), and `max_steps` set to the
    number of steps, so reverse-mode memory is sized exactly.

    **No step straddles a layer boundary.** Per-layer controls jump at each boundary; a
    step across one would use one layer's controls for part of the next (or skip a layer
    altogether). So: a fixed `dt0` longer than a layer is an error; the default grid
    contains every boundary; `diffrax.ConstantStepSize` needs a `dt0` dividing the layer
    length; a `StepTo` grid must contain the boundaries; adaptive controllers are wrapped
    in `diffrax.ClipStepSizeController(jump_ts=...)` so that they step onto them.

    **Precision.** Times are float32 or wider whatever the state's dtype (diffrax then
    carries a bfloat16 state in float32; matrix products still run in the parameters'
    dtype).

    **Arguments:**

    - `model`: a [`TransformerIDE`][itde.TransformerIDE] (any `AbstractEquation`).
    - `u0`: one initial state `[tokens, features]` (vmap for a batch).
    - `t1`: final depth (default `model.depth`; beyond it the controls are undefined).
    - `solver`: any diffrax solver whose terms fit the model's `SplitTerm` (default
      `LieTrotter()`). On per-layer controls it runs wrapped in
      `itde_solvers.FrozenTime` with the layer boundaries as jumps, so that every
      evaluation of a step reads the step's own layer, the last step's too; a
      `FrozenTime` given here (at any depth of wrappers) gets the boundaries added to its
      own `jump_ts` (its other jumps are kept: they only cost a re-evaluation where a
      step starts on one).
    - `dt0`: the depth step (fixed-step solves; default one layer, `controls.default_step`).
    - `stepsize_controller`: e.g. `diffrax.PIDController(...)` for adaptive solves; then
      `dt0` is the initial step (or None to let diffrax choose).
    - `saveat`, `adjoint`, `max_steps`, `progress_meter`: as in `diffrax.diffeqsolve`
      (defaults: final state; `RecursiveCheckpointAdjoint`, with one checkpoint per step
      for fixed steps; the exact step count for fixed steps, 4096 for adaptive ones).
      With `BacksolveAdjoint` fixed steps use `ConstantStepSize` (its backward solve
      cannot run a `StepTo` grid in reverse).
    - `terms`: the terms to integrate: a kind for `model.terms(kind)` — `"paper"`
      (default for `LieTrotter`), `"split"` (default for `Strang`, `ParallelSplitting`
      and any other `AbstractSplittingSolver`), `"tangent"` (default for any other
      solver, e.g.
      `itde_solvers.Projected(diffrax.Tsit5())`) — or a `SplitTerm`. For the continuum
      kinds (`"split"`, `"tangent"`) the solution starts from $P_{S_1(t_0)}(u_0)$: the
      equation lives on the constraint set, and the projection term moves the initial
      condition onto it at $t_0^+$. The `"paper"` kind starts from `u0` itself (the
      Transformer's first block sees the unnormalised embedding).
    - `batched`: `u0` has a leading batch axis, `[batch, tokens, features]`; the
      sub-flows are mapped over it inside one solve (`model.terms(kind, batched=True)`).
      Same result as `jax.vmap` of the solve, with a cheaper backward pass.
    - `throw`: as in `diffrax.diffeqsolve`: raise if the solve fails (e.g. `max_steps`
      reached); with `False` the failure is in `Solution.result`.
    - `args`: per-sequence data handed to the vector fields, as diffrax's `args`: for a
      `TransformerIDE`, the key mask (`[tokens]` booleans, False on padding; `[batch,
      tokens]` with `batched=True`), or None.
    - `buckets`: how an eager solve at a new token count reuses a compiled program: the
      bucket policy ([`PowerOfTwoBuckets()`][itde.PowerOfTwoBuckets], the default, or
      [`BlockBuckets(block)`][itde.BlockBuckets]), or None for none (see below).

    **Compiled programs.** An eager call runs as one program held in the bounded cache
    [`itde.programs`][itde.programs] (its checks and its output's checks included: nothing
    else compiles per shape). Where the discretisation allows it, the state of $N$ tokens
    is padded to its bucket $B \ge N$ with masked tokens and the token rule's nodes and
    weights are data of length $B$ (padded nodes of weight zero): one program serves every
    $N$ of the bucket and the result is the $N$-token solve's to round-off. A sliding
    `window`, a `DiscreteBias`, a token domain of fixed count (`TensorGrid2D`), a
    `SplitTerm` given as `terms`, an adaptive `stepsize_controller`, and `saveat` with
    dense output, solver or controller state or an `fn` solve at $N$ itself (one program
    per $N$, still held in the bounded cache); the table in `itde/_token_padding.py` says
    why for each. Called under a trace (`jax.jit`, `grad`, `vmap`), the solve is part of
    the caller's program and nothing is padded.

    **Checks at run time.** A NaN or infinite `u0`, and a state that overflows during the
    solve, raise with a message that says which (`equinox.error_if`). Under
    `eqx.filter_jit` that message is the exception's own (`EquinoxRuntimeError: itde.solve:
    ...`). Under plain `jax.jit` JAX wraps it: the exception is a `JaxRuntimeError`
    starting `INTERNAL: CpuCallback error`, and the message is the line beginning
    `itde.solve:` inside it. Jit with `eqx.filter_jit` to read it first.
    """
    solver = LieTrotter() if solver is None else solver
    u0 = as_array("u0", u0)
    t0, t1, dt0, max_steps, batched = _check_arguments(
        model, u0, t1, solver, dt0, max_steps, batched, saveat, adjoint, stepsize_controller,
        progress_meter,
    )  # fmt: skip
    throw = check_bool("throw", throw)
    buckets = check_buckets(buckets)
    saveat = diffrax.SaveAt(t1=True) if saveat is None else saveat
    default_adjoint = adjoint is None
    adjoint = diffrax.RecursiveCheckpointAdjoint() if adjoint is None else adjoint
    solver = _freeze_layers(model.controls, solver, t0, t1)
    if isinstance(solver, (Projected, FrozenTime)) and solver.scan_kind is None:
        if isinstance(adjoint, diffrax.DirectAdjoint):
            solver = solver.with_scan_kind("bounded")
        elif isinstance(adjoint, diffrax.ForwardMode):
            solver = solver.with_scan_kind("lax")
    kind = terms_kind(solver) if terms is None else terms
    tdtype = _time_dtype(u0)
    controller, first_dt, steps, checkpoints, divides = _step_grid(
        model.controls, t0, t1, dt0, stepsize_controller, max_steps, adjoint, tdtype
    )
    if kind == "paper":
        _warn_if_not_a_refinement(model, dt0, stepsize_controller)
    if checkpoints is not None and _step_ends_only(saveat):
        solver = _for_fixed_steps(solver)
    if default_adjoint and checkpoints is not None:
        # a fixed number of steps: keep every step's state (memory n_steps states, no
        # binomial recomputation of the forward)
        adjoint = diffrax.RecursiveCheckpointAdjoint(checkpoints=checkpoints)
    plan = _Plan(
        t0, t1, solver, kind, saveat, controller, first_dt, steps, adjoint, progress_meter,
        batched, throw, divides,
    )  # fmt: skip
    if has_tracer(model, u0, args, plan):
        return _solve_planned(model, u0, args, plan)  # part of the caller's program
    return run_on_tokens(
        _solve_planned, model, u0, args, plan, axis=-2,
        batch=u0.shape[0] if batched else None, buckets=buckets,
        cut=lambda sol, n: eqx.tree_at(lambda s: s.ys, sol, cut_leaves(sol.ys, n, -2)),
        pad=_pads(kind, stepsize_controller, saveat),
    )  # fmt: skip


class _Plan(NamedTuple):
    """A checked solve's options (what `solve` decided before running it): arrays in
    them are the program's inputs, everything else is part of the program."""

    t0: float
    t1: float
    solver: diffrax.AbstractSolver
    kind: str | SplitTerm
    saveat: diffrax.SaveAt
    controller: diffrax.AbstractStepSizeController
    first_dt: object
    steps: int
    adjoint: diffrax.AbstractAdjoint
    progress_meter: diffrax.AbstractProgressMeter | None
    batched: bool
    throw: bool
    divides: bool


_SAVE_STATE = diffrax.SubSaveAt(t1=True).fn  # diffrax's default `fn`: the state itself


def _pads(kind, stepsize_controller, saveat) -> bool:
    """Whether a solve with these options computes its real tokens alone, so that it may
    run padded: the model's own sub-flows (a kind, not a user's `SplitTerm`), fixed steps
    (an adaptive controller's error norm would count the padded tokens) and the state
    saved as it is (no dense output, solver or controller state, or `fn` of it)."""
    fixed = stepsize_controller is None or isinstance(
        stepsize_controller, (diffrax.StepTo, diffrax.ConstantStepSize)
    )
    subs = jax.tree.leaves(saveat.subs, is_leaf=lambda x: isinstance(x, diffrax.SubSaveAt))
    plain = not (saveat.dense or saveat.solver_state or saveat.controller_state) and all(
        sub.fn is _SAVE_STATE for sub in subs
    )
    return isinstance(kind, str) and fixed and plain


def _solve_planned(model, u0, args, plan: _Plan) -> diffrax.Solution:
    """The solve itself, from checked options: one program (see `itde.programs`)."""
    terms, u0 = _choose_terms(model, u0, plan.kind, plan.batched, plan.t0)
    tdtype = _time_dtype(u0)
    if plan.divides:  # a traced dt0 with constant steps: checked on the state at run time
        r = model.controls.layer_length / plan.first_dt  # type: ignore[attr-defined]
        u0 = _error_if(
            u0,
            jnp.abs(r - jnp.round(r)) > 1e-6 * r,
            "itde.solve: `dt0` does not divide the layers' depth length, so constant "
            "steps would straddle layer boundaries; use a dt0 that divides it.",
        )
    u0 = _error_if(
        u0,
        ~jnp.all(jnp.isfinite(u0)),
        "itde.solve: the initial state `u0` has a NaN or infinite entry; check the "
        "embedding or the data that produced it.",
    )
    kwargs = {} if plan.progress_meter is None else {"progress_meter": plan.progress_meter}
    sol = diffrax.diffeqsolve(
        terms,
        plan.solver,
        t0=jnp.asarray(plan.t0, tdtype),
        t1=jnp.asarray(plan.t1, tdtype),
        dt0=None if plan.first_dt is None else jnp.asarray(plan.first_dt, tdtype),
        y0=u0,
        saveat=plan.saveat,
        stepsize_controller=plan.controller,
        adjoint=plan.adjoint,
        max_steps=plan.steps,
        throw=False,  # diffrax's check passes the whole solution through it: see _error_if
        args=args,
        **kwargs,
    )
    if not plan.throw:
        return sol
    failed = ~diffrax.is_okay(sol.result)
    if checks_on_host():
        # the program returns diffrax's failure as a flag per result, raised on the host
        # after it ran (no callback: JAX's persistent cache can write the program); the
        # output's own checks only where the solve succeeded (a failed one holds inf)
        index = result_index(sol.result)
        for i, message in enumerate(result_messages()):
            if i:
                u0 = check(u0, index == i, message)
        if not isinstance(sol.ys, jax.Array):
            return sol
        return eqx.tree_at(lambda s: s.ys, sol, _check_output(sol.ys, u0, unless=failed))
    if not isinstance(sol.ys, jax.Array):
        return sol.result.error_if(sol, failed)
    ys = sol.ys + sol.result.error_if(jnp.zeros((), sol.ys.dtype), failed)
    return eqx.tree_at(lambda s: s.ys, sol, _check_output(ys, u0))


def _step_ends_only(saveat) -> bool:
    """Whether `saveat` reads the solution at step ends only (no dense output, no `ts`
    between them)."""
    if saveat.dense:
        return False
    subs = jax.tree.leaves(saveat.subs, is_leaf=lambda x: isinstance(x, diffrax.SubSaveAt))
    return all(sub.ts is None for sub in subs)


def _for_fixed_steps(solver):
    """A fixed-step solve read at step ends never uses a projected method's error estimate
    or dense output: each `Projected` inside `solver` (at any depth of wrappers) drops a
    stage evaluated only for them (`Projected.for_fixed_steps`)."""

    def swap(x):  # `type`: diffrax's isinstance sees through wrappers
        return x.for_fixed_steps() if type(x) is Projected else x

    return jax.tree.map(swap, solver, is_leaf=lambda y: type(y) is Projected)


def _check_output(ys, u0, unless=None):
    """A finite `u0` whose solution is not finite overflowed: say so, and why, instead of
    returning NaN (the input check above covers a non-finite `u0`)."""
    dtype = jnp.dtype(u0.dtype)
    root = float(np.sqrt(np.finfo(dtype).max))
    big = jnp.max(jnp.abs(u0)) > jnp.asarray(root, u0.dtype)
    messages = (
        f"itde.solve: the state overflowed ({dtype}): `u0` is finite but has entries above "
        f"{root:.1e}, the square root of {dtype}'s largest value, so their squares in the "
        "norms and scores are infinite. Scale `u0` down, or compute in float64.",
        f"itde.solve: the state became NaN or infinite during the solve although `u0` is "
        f"finite: the dynamics overflowed {dtype} (parameters grown too large, e.g. a "
        "training step that diverged: lower the learning rate; or a depth step too large "
        "for an explicit scheme).",
    )
    # two checks, not one `branched_error_if`: its message index is reduced with a `max`
    # over the batch, which has no value under `jax.vmap` over an empty batch
    bad = ~jnp.all(jnp.isfinite(ys))
    if unless is not None:  # a failed solve says why itself
        bad = bad & ~unless
    ys = _error_if(ys, bad & big, messages[0])
    return _error_if(ys, bad & ~big, messages[1])


def _error_if(x, pred, msg):
    """`x`, raising `msg` at run time where `pred` holds.

    Only a scalar goes through equinox's check (a `lax.cond` that XLA places on one
    device), then is added to `x`: passing `x` itself would make a sharded `x` be
    gathered onto that device and scattered back ("involuntary full rematerialization")."""
    if checks_on_host():  # the top level of an itde.programs program: a flag, no callback
        return check(x, pred, msg)
    return x + eqx.error_if(jnp.zeros((), x.dtype), pred, msg)


def _warn_if_not_a_refinement(model, dt0, stepsize_controller) -> None:
    """The paper's sub-flows with steps below one layer re-apply every norm once per
    step: a refinement only when the norms are projections (no per-feature gain/shift)."""
    controls, block = model.controls, getattr(model, "block", None)
    if not (isinstance(controls, PiecewiseConstant) and getattr(block, "has_constraint", False)):
        return
    if all(_is_projection(n) for n in (controls.blocks.norm1, controls.blocks.norm2)):
        return
    h = controls.layer_length
    if stepsize_controller is None or isinstance(stepsize_controller, diffrax.ConstantStepSize):
        step = h if dt0 is None else dt0
        if isinstance(step, jax.core.Tracer) or step >= h * (1 - 1e-9):
            return
        what = f"dt0={step:g} is below one layer (length {h:g})"
    elif isinstance(stepsize_controller, diffrax.StepTo):
        ts = np.asarray(stepsize_controller.ts, np.float64)
        layers = np.asarray(controls.layer_times())
        if all(np.any(np.abs(layers - t) <= 1e-9 * max(1.0, abs(t))) for t in ts):
            return
        what = "the StepTo grid has steps inside layers"
    else:
        what = f"the {type(stepsize_controller).__name__} takes steps inside layers"
    warn_at_caller(
        f"itde.solve: {what} on a per-layer post-norm model whose norms have per-feature "
        "gains or shifts. Such a norm is not a projection (applying it twice moves the "
        "state) and every Lie step re-applies it, so this solve computes a different "
        "network, not a refinement of this one, and has no continuum limit as the step "
        "shrinks. To refine the depth, solve the model's continuum form, "
        "`model.continuum_form()` (the same network at one step per layer; any solver, "
        f"any step); for the network itself, use dt0={h:g}.",
        DepthStepWarning,
    )


def _is_projection(norm) -> bool:
    """No per-feature affine map, or (concretely) the identity one: a fresh network's
    gain of ones and shift of zeros. Exact equality: a fresh network's gain and shift are
    the numbers 1 and 0 themselves (`identity`), and this only decides whether to warn."""
    for value, identity in ((norm.gain, 1.0), (norm.shift, 0.0)):
        if value is None:
            continue
        if isinstance(value, jax.core.Tracer) or not np.all(np.asarray(value) == identity):
            return False
    return True


def _freeze_layers(controls, solver, t0: float, t1: float):
    """Per-layer controls are constant inside each layer and jump at its ends: every
    evaluation of a step must read the step's own layer, including a Runge–Kutta stage at
    the step's end, which sits on the next layer's start. That holds for the last step of
    a solve too: `t1` is a layer boundary with layers after it whenever the solve covers
    part of the depth (a `FlowMap` over some layers), so the solver is wrapped whether or
    not the interval holds a jump. `FrozenTime` reads each step at its midpoint, so every
    solver keeps its order; for the paper's scheme (vector fields read at the step's
    start, projections at its end) it changes nothing.

    A solver the caller wrapped in `FrozenTime` (at any depth) gets the model's jumps in
    the interval added to its own: a first-same-as-last method must re-evaluate after
    every jump of the field, and one it was not told of makes it first order. Jumps of
    its own that are not the model's are kept (they cost one evaluation where a step
    starts on one and change nothing else)."""
    if not controls.constant_between_jumps:
        return solver
    jumps = tuple(t for t in controls.jump_times() if t0 < t < t1)

    def merge(x):
        if type(x) is FrozenTime:
            return FrozenTime(merge_inner(x.solver), (*x.jump_ts, *jumps))
        return x

    def merge_inner(x):
        return jax.tree.map(merge, x, is_leaf=lambda y: type(y) is FrozenTime)

    solver = merge_inner(solver)
    # diffrax's isinstance sees through wrappers: HalfSolver(FrozenTime(...)) is frozen
    return solver if isinstance(solver, FrozenTime) else FrozenTime(solver, jumps)


def _check_arguments(
    model, u0, t1, solver, dt0, max_steps, batched, saveat, adjoint, stepsize_controller,
    progress_meter,
):  # fmt: skip
    """Trace-time checks of `solve`'s arguments, each error naming the argument and the fix.
    Returns the checked `(t0, t1, dt0, max_steps, batched)`."""
    if not isinstance(model, AbstractEquation):
        raise TypeError(
            f"`model` must be an itde.TransformerIDE (an itde equation), got "
            f"{type(model).__name__}."
        )
    batched = check_bool("batched", batched)
    if batched:
        if type(u0).__module__.startswith("torch"):
            model.check_state(u0, "u0")
        if getattr(u0, "ndim", None) != 3:
            raise ValueError(
                f"`u0` with batched=True must be [batch, tokens, {model.n_features}], got "
                f"shape {getattr(u0, 'shape', None)}."
            )
        if u0.shape[0] == 0:
            raise ValueError("`u0` is an empty batch (shape[0] == 0); give at least one sequence.")
        model.check_state(u0[0], "u0[i]")
    else:
        model.check_state(u0, "u0")
    t0 = float(model.t0)
    if t1 is None:
        t1 = float(model.depth)
    else:
        t1 = check_float("t1", t1)
        if t1 > model.depth + 1e-9 * max(1.0, abs(model.depth)):
            raise ValueError(
                f"`t1`={t1} is past the depth T={model.depth} up to which the model's "
                f"controls are defined; give t1 <= {model.depth} (the default), or controls "
                "that extend that far (more layers)."
            )
    if not t1 > t0:
        raise ValueError(
            f"`t1`={t1} must be finite and greater than t0={t0}; give the final depth, e.g. "
            f"t1={model.depth}."
        )
    if dt0 is not None and not isinstance(dt0, jax.core.Tracer):
        dt0 = check_float("dt0", dt0)
        if not dt0 > 0:
            raise ValueError(
                f"`dt0`={dt0} must be a positive depth step, e.g. dt0=1.0 (one layer per "
                "step) or dt0=0.1."
            )
    if max_steps is not None:
        max_steps = check_int("max_steps", max_steps, minimum=1)
    if model.has_constraint and not isinstance(solver, (AbstractSplittingSolver, Projected)):
        raise TypeError(
            f"`solver`={type(solver).__name__} would integrate the equation without its "
            "projections onto S1; wrap it in a projection method, e.g. "
            f"`itde_solvers.Projected(diffrax.{type(solver).__name__}())`, or use a "
            "splitting solver (itde_solvers.LieTrotter, Strang, ParallelSplitting)."
        )
    for name, value, cls, example in (
        ("saveat", saveat, diffrax.SaveAt, "diffrax.SaveAt(ts=...)"),
        ("adjoint", adjoint, diffrax.AbstractAdjoint, "diffrax.DirectAdjoint()"),
        ("stepsize_controller", stepsize_controller, diffrax.AbstractStepSizeController,
         "diffrax.PIDController(rtol=1e-6, atol=1e-6)"),
        ("progress_meter", progress_meter, diffrax.AbstractProgressMeter,
         "diffrax.TqdmProgressMeter()"),
    ):  # fmt: skip
        if value is not None and not isinstance(value, cls):
            raise TypeError(
                f"`{name}`={value!r} must be a diffrax.{cls.__name__}, e.g. `{example}`."
            )
    if isinstance(stepsize_controller, diffrax.AbstractAdaptiveStepSizeController) and not (
        isinstance(solver, diffrax.AbstractAdaptiveSolver)
    ):
        raise ValueError(
            f"`stepsize_controller`={type(stepsize_controller).__name__} adapts the step to the "
            f"solver's error estimate, but `solver`={type(solver).__name__} makes none. Use a "
            "solver with an embedded estimate (e.g. itde_solvers.Projected(diffrax.Tsit5())), "
            f"wrap this one in diffrax.HalfSolver({type(solver).__name__}()), or take fixed "
            "steps (a `dt0` and no controller)."
        )
    if isinstance(stepsize_controller, diffrax.AbstractAdaptiveStepSizeController):
        model.refuse_discontinuous(
            f"`stepsize_controller`={type(stepsize_controller).__name__} (an adaptive step, "
            "chosen from an error estimate)",
            "Take fixed steps (a `dt0` and no controller; the default one step per layer with "
            "LieTrotter is the network itself), or keep every expert (top_k = the number of "
            "experts: a smooth field, but another network).",
        )  # fmt: skip
    _check_save_times(saveat, t0, t1)
    return t0, t1, dt0, max_steps, batched


def _check_save_times(saveat, t0: float, t1: float) -> None:
    """Concrete `SaveAt(ts=...)` times must lie in [t0, t1] (diffrax's own message comes
    from deep inside the solve)."""
    if saveat is None:
        return
    for sub in jax.tree.leaves(saveat.subs, is_leaf=lambda x: isinstance(x, diffrax.SubSaveAt)):
        ts = getattr(sub, "ts", None)
        if ts is None or isinstance(ts, jax.core.Tracer):
            continue
        ts = np.asarray(ts, np.float64)
        tol = 1e-9 * max(1.0, abs(t0), abs(t1))
        bad = ts[(ts < t0 - tol) | (ts > t1 + tol)]
        if bad.size:
            raise ValueError(
                f"`saveat`=SaveAt(ts=...) asks for depths {bad[:5].tolist()} outside the solve's "
                f"interval [t0, t1] = [{t0}, {t1}]; save at depths inside it (e.g. "
                f"np.linspace({t0}, {t1}, 5))."
            )


def _choose_terms(model, u0, terms, batched, t0):
    """The terms to integrate (a kind, or the user's `SplitTerm`), and the initial state
    they start from."""
    if isinstance(terms, str):
        if terms not in TERMS_KINDS:
            raise ValueError(f"`terms`={terms!r} is not known; choose one of {list(TERMS_KINDS)}.")
        if terms != "paper":
            # the continuum equation lives on S1(t): its solution starts from the
            # projection of the initial condition, u(t0+) = P_{S1(t0)}(f)
            if batched:
                u0 = jax.vmap(lambda v: model.project(t0, v))(u0)
            else:
                u0 = model.project(t0, u0)
        return model.terms(terms, batched=batched), u0
    if not isinstance(terms, SplitTerm):
        raise TypeError(
            f"`terms` must be a kind {list(TERMS_KINDS)} or an itde_solvers.SplitTerm, got "
            f"{type(terms).__name__}."
        )
    if batched:
        _check_batched_terms(terms, u0, t0)
    return terms, u0


def _check_batched_terms(terms: SplitTerm, u0, t0) -> None:
    """With `batched=True` a user's sub-flows receive the whole batch: check at trace time
    that they take it (a field written for one sequence fails deep inside an einsum)."""
    t = jnp.asarray(t0, _time_dtype(u0))
    for i, term in enumerate(terms.terms):
        if isinstance(term, ProjectionTerm):
            call, what = (lambda term=term: term.project(t, u0)), "projection"
        else:
            call, what = (lambda term=term: term.vf(t, u0, None)), "vector field"
        try:
            out = jax.eval_shape(call)
        except Exception as e:  # noqa: BLE001 - re-raised with the fix named
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"`terms`: with batched=True every sub-flow receives the whole batch "
                f"{tuple(u0.shape)} ([batch, tokens, features]), and sub-flow {i} (a {what}) "
                f"fails on it ({first}). Give sub-flows that act on a batch, e.g. "
                "`model.terms(kind, batched=True)` or your fields wrapped in `jax.vmap`, or "
                "solve one sequence at a time (batched=False, `jax.vmap` of the solve)."
            ) from e
        if getattr(out, "shape", None) != tuple(u0.shape):
            raise ValueError(
                f"`terms`: with batched=True sub-flow {i} (a {what}) maps the batch "
                f"{tuple(u0.shape)} to shape {getattr(out, 'shape', None)}; it must keep the "
                "state's shape. Give sub-flows that act on a batch (e.g. "
                "`model.terms(kind, batched=True)`), or solve with batched=False."
            )


def _step_grid(controls, t0, t1, dt0, stepsize_controller, max_steps, adjoint, tdtype):
    """The step-size controller, first step and step budget of a solve, such that no step
    straddles a jump of the controls. Returns `(controller, first_dt, max_steps,
    checkpoints, divides)`: `checkpoints` is the exact step count of a fixed-step grid
    (None for adaptive steps); `divides`: a traced `dt0` of constant steps, to be checked
    on the state at run time (it must divide the layers)."""
    traced_dt0 = isinstance(dt0, jax.core.Tracer)
    jumps = tuple(t for t in controls.jump_times() if t0 < t < t1)
    if stepsize_controller is not None:
        controller = _respect_jumps(stepsize_controller, controls, jumps, dt0, tdtype)
        divides = bool(jumps) and traced_dt0 and isinstance(controller, diffrax.ConstantStepSize)
        return controller, dt0, 4096 if max_steps is None else max_steps, None, divides
    if traced_dt0:
        raise TypeError(
            "a traced `dt0` needs `stepsize_controller=diffrax.ConstantStepSize()` (the "
            "default fixed-step grid is built at trace time from a concrete dt0)."
        )
    dt = float(controls.default_step if dt0 is None else dt0)
    _check_depth_step(controls, dt)
    ts = fixed_steps(t0, t1, dt, jumps)
    steps = len(ts) - 1 if max_steps is None else max_steps
    if isinstance(adjoint, diffrax.BacksolveAdjoint):
        # its backward solve reuses the controller in reverse, which StepTo forbids
        if jumps:
            _check_constant_steps(controls, dt, "BacksolveAdjoint takes constant steps")
        return diffrax.ConstantStepSize(), dt, steps + 1, steps + 1, False  # +1: a sliver at t1
    # the grid goes to the device from the host (`jnp.asarray` would compile a conversion
    # per grid length)
    return diffrax.StepTo(ts=to_device(ts.astype(tdtype))), None, steps, steps, False


def _check_constant_steps(controls, dt0: float, why: str) -> None:
    """Constant steps from a layer boundary land on every later one only if `dt0` divides
    the layer length; otherwise they straddle boundaries."""
    h = controls.layer_length
    r = h / dt0
    if abs(r - round(r)) > 1e-9 * r:
        raise ValueError(
            f"`dt0`={dt0} does not divide the layers' depth length {h}: constant steps ({why}) "
            f"would straddle layer boundaries. Use dt0={h / max(1, round(r))} (or omit "
            "`stepsize_controller`: the default fixed grid restarts at every boundary)."
        )


def _respect_jumps(controller, controls, jumps, dt0, tdtype):
    """A user's step-size controller made to step onto every jump of the controls (the
    jumps in the solve's time dtype: diffrax compares them with its float32 times when the
    state is float32, even where float64 is enabled)."""
    if not jumps:
        return controller
    if isinstance(controller, diffrax.StepTo):
        ts = np.asarray(controller.ts, np.float64)
        missing = [j for j in jumps if not np.any(np.abs(ts - j) <= 1e-9 * max(1.0, abs(j)))]
        if missing:
            raise ValueError(
                f"`stepsize_controller`=StepTo(ts) lacks the layer boundaries {missing[:5]}: a "
                "step would straddle them and mix two layers' controls. Add every boundary "
                f"to ts (the model's are {list(jumps)[:5]}...)."
            )
        return controller
    if isinstance(controller, diffrax.ConstantStepSize):
        if dt0 is None:
            raise ValueError("`dt0` is needed with diffrax.ConstantStepSize(); e.g. dt0=1.0.")
        if isinstance(dt0, jax.core.Tracer):
            return controller  # checked on the state when the solve runs (see `solve`)
        _check_depth_step(controls, float(dt0))
        _check_constant_steps(controls, float(dt0), "diffrax.ConstantStepSize takes them")
        return controller
    if isinstance(controller, diffrax.ClipStepSizeController):
        return controller
    # an adaptive controller: clip its steps to land on every jump (diffrax's jump_ts)
    return diffrax.ClipStepSizeController(controller, jump_ts=np.asarray(jumps, np.dtype(tdtype)))
