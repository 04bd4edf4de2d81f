r"""The flow map of the depth dynamics between two depths, $\varphi_{s,t}: u(s) \mapsto u(t)$,
and its Jacobian $\partial u(t) / \partial u(s)$ as a matrix-free linear operator."""

from __future__ import annotations

import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from itde_solvers import SplitTerm

from .._abstract import AbstractEquation
from .._checks import check_float, check_int
from .._controls import AbstractBlock, AbstractControls, PiecewiseConstant
from .._operators._mask import key_mask
from .._solve import TERMS_KINDS, fixed_steps, solve


class _ControlsFrom(AbstractControls):
    """A model's controls seen from the depth `start` on: the same controls at every
    depth, with the interval (and so the solve) starting at `start`. For per-layer
    controls whose layer boundary `start` is, `FlowMap` slices the layers instead."""

    inner: AbstractControls
    start: float = eqx.field(static=True)

    @property
    def t0(self) -> float:
        return self.start

    @property
    def t1(self) -> float:
        return self.inner.t1

    def __call__(self, t, side: str = "right", part: str | None = None) -> AbstractBlock:
        return self.inner(t, side, part)

    @property
    def blocks(self) -> AbstractBlock:
        return self.inner.blocks

    @property
    def default_step(self) -> float:
        return self.inner.default_step

    @property
    def layer_length(self) -> float:
        return getattr(self.inner, "layer_length", self.inner.default_step)

    @property
    def constant_between_jumps(self) -> bool:  # type: ignore[override]
        return self.inner.constant_between_jumps

    def jump_times(self) -> tuple[float, ...]:
        return tuple(j for j in self.inner.jump_times() if j > self.start + _tol(self.start))


def _tol(t: float) -> float:
    return 1e-9 * max(1.0, abs(t))


def _starting_at(model: AbstractEquation, s: float) -> AbstractEquation:
    """The same model, whose depth interval starts at `s` (so `itde.solve` starts there)."""
    controls = model.controls
    if abs(s - controls.t0) <= _tol(s):
        return model
    if isinstance(controls, PiecewiseConstant):
        h = controls.layer_length
        r = (s - controls.t0) / h
        n = round(r)
        if abs(r - n) <= 1e-9 * max(1.0, r):  # a layer boundary: the layers from n on
            values = jax.tree.map(lambda a: a[n:], controls.values)
            sliced = PiecewiseConstant(values, t0=controls.t0 + n * h, layer_length=h)
            return eqx.tree_at(lambda m: m.controls, model, sliced)
    return eqx.tree_at(lambda m: m.controls, model, _ControlsFrom(controls, s))


class FlowMap(eqx.Module):
    r"""The flow map $\varphi_{s,t}: u(s) \mapsto u(t)$ of a model's depth dynamics.

    `FlowMap(model, s, t)(u)` is the state at depth $t$ of the solution that is `u` at
    depth $s$, computed by [`itde.solve`][itde.solve] on $[s, t]$ with the solver, step and
    terms given here (the defaults are `itde.solve`'s: for per-layer controls, the
    paper's Lie scheme with one step per layer, i.e. the discrete network's layers
    $s, \dots, t - 1$). The map is on the equation's state, not the model's output: a
    `final_norm` or `readout` is not applied.

    - **The discrete network**: `FlowMap(model)`, per-layer controls at $\Delta t = 1$;
      `s`, `t` on layer boundaries pick a range of layers.
    - **Its continuum**: `FlowMap(model.continuum_form(), solver=itde_solvers.Strang(),
      dt0=0.25)` (any solver, any step). The continuum kinds of terms (`"split"`,
      `"tangent"`) start from $P_{S_1(s)}(u)$, as `itde.solve` does, so the map includes
      that projection and its Jacobian is the flow's restricted to the tangent space of
      the constraint set (its normal directions are singular directions with value 0).

    A depth $s$ inside a layer of per-layer controls is allowed: the step grid then
    restarts at $s$ and at every later layer boundary.

    **Maps compose.** Every step reads its own layer (`itde.solve` freezes each step of
    per-layer controls, `itde_solvers.FrozenTime`), including a last stage on $t$ when
    layers follow it, so for $r$ on the step grid `FlowMap(model, r, t)` after
    `FlowMap(model, s, r)` is `FlowMap(model, s, t)` to round-off, for every solver
    whose steps end on the grid.

    **Arguments:**

    - `model`: a [`TransformerIDE`][itde.TransformerIDE] (any `AbstractEquation`), e.g.
      `itde.from_hf(m).equation`.
    - `s`, `t`: the depths, `model.t0 <= s < t <= model.depth` (defaults: the whole
      interval).
    - `solver`, `dt0`, `stepsize_controller`, `terms`, `max_steps`: as in
      [`itde.solve`][itde.solve].

    Call it as `flow(u, mask=None)` with `u` one state `[tokens, features]` at depth $s$
    and `mask` the key mask (`[tokens]` booleans or 0/1, False on padding), as the
    model takes it.

    **Fields:** the arguments as given, except `terms`, stored as `kind` (a name of
    `itde.TERMS_KINDS`, `"paper"`, `"split"` or `"tangent"`: the model builds the
    sub-flows) or `split` (an `itde_solvers.SplitTerm` of the caller's own sub-flows): at
    most one is not None, and both None means `itde.solve`'s choice for the solver
    (`"paper"` for `LieTrotter`, `"split"` for another splitting solver, `"tangent"`
    otherwise).
    """

    model: AbstractEquation
    s: float = eqx.field(static=True)
    t: float = eqx.field(static=True)
    solver: diffrax.AbstractSolver | None
    dt0: float | None = eqx.field(static=True)
    stepsize_controller: diffrax.AbstractStepSizeController | None
    kind: str | None = eqx.field(static=True)
    split: SplitTerm | None
    max_steps: int | None = eqx.field(static=True)

    def __init__(
        self,
        model: AbstractEquation,
        s: float | None = None,
        t: float | None = None,
        *,
        solver: diffrax.AbstractSolver | None = None,
        dt0: float | None = None,
        stepsize_controller: diffrax.AbstractStepSizeController | None = None,
        terms: str | SplitTerm | None = None,
        max_steps: int | None = None,
    ):
        if not isinstance(model, AbstractEquation):
            raise TypeError(
                f"`model` must be an itde equation (e.g. an itde.TransformerIDE, or "
                f"`itde.from_hf(m).equation`), got {type(model).__name__}."
            )
        t0, depth = float(model.t0), float(model.depth)
        s = t0 if s is None else check_float("s", s)
        t = depth if t is None else check_float("t", t)
        if s < t0 - _tol(t0):
            raise ValueError(
                f"`s`={s} is before the model's first depth t0={t0}; give t0 <= s < t."
            )
        if t > depth + _tol(depth):
            raise ValueError(
                f"`t`={t} is past the model's depth T={depth} (its controls end there); give "
                f"s < t <= {depth}."
            )
        if not t > s:
            raise ValueError(
                f"`s`={s} must be smaller than `t`={t}: the flow map goes forward in depth "
                f"from u(s) to u(t); e.g. s={t0}, t={depth}."
            )
        if dt0 is not None:
            dt0 = check_float("dt0", dt0, positive=True)
        if max_steps is not None:
            max_steps = check_int("max_steps", max_steps, minimum=1)
        if isinstance(terms, str) and terms not in TERMS_KINDS:
            raise ValueError(f"`terms`={terms!r} is not known; choose one of {list(TERMS_KINDS)}.")
        if terms is not None and not isinstance(terms, (str, SplitTerm)):
            raise TypeError(
                f"`terms` must be a kind {list(TERMS_KINDS)} or an itde_solvers.SplitTerm, got "
                f"{type(terms).__name__}."
            )
        _check_layers(model.controls, s, dt0, stepsize_controller)
        self.model = model
        self.s, self.t = s, t
        self.solver, self.dt0, self.stepsize_controller = solver, dt0, stepsize_controller
        self.kind = terms if isinstance(terms, str) else None
        self.split = terms if isinstance(terms, SplitTerm) else None
        self.max_steps = max_steps

    @property
    def duration(self) -> float:
        """The depth length $t - s$ (what the Lyapunov exponents are rates over)."""
        return self.t - self.s

    def check_state(self, u, name: str = "u") -> None:
        """Trace-time check of one state `[tokens, features]`: the model's own, and a
        dtype that can resolve a sensitivity (float32 or float64)."""
        self.model.check_state(u, name)
        if jnp.finfo(u.dtype).bits < 32:
            raise TypeError(
                f"`{name}` has dtype {u.dtype}, too coarse to resolve a Jacobian (3 significant "
                f"digits or fewer); compute the sensitivity in float32 or float64, e.g. "
                f"`{name}.astype(jnp.float32)` with the model cast alike."
            )

    def _key_mask(self, u, mask) -> Bool[Array, " tokens"] | None:
        """The key mask as booleans `[tokens]` (checked against `u`), or None."""
        return key_mask(mask, u.shape[0])

    def _solve(self, u, mask, adjoint=None, saveat=None):
        terms = self.kind if self.split is None else self.split
        sol = solve(
            _starting_at(self.model, self.s),
            u,
            t1=self.t,
            solver=self.solver,
            dt0=self.dt0,
            stepsize_controller=self.stepsize_controller,
            terms=terms,
            max_steps=self.max_steps,
            adjoint=adjoint,
            saveat=saveat,
            args=mask,
        )
        assert sol.ys is not None
        return sol.ys

    def solve(self, u, mask=None, adjoint: diffrax.AbstractAdjoint | None = None):
        """$u(t)$ from $u(s) =$ `u`, with a chosen diffrax `adjoint` (`ForwardMode()` for
        forward-mode derivatives; default: reverse mode)."""
        return self._solve(u, mask, adjoint)[-1]

    def step_depths(self) -> np.ndarray:
        r"""The depths $s = \tau_0 < \tau_1 < \dots < \tau_K = t$ of the solve's fixed
        steps (float64 NumPy): steps of `dt0` (default: the controls' own step, one layer
        of per-layer controls) from $s$, restarted at every later layer boundary, as
        [`itde.solve`][itde.solve] takes them. An adaptive `stepsize_controller` has no
        such grid: a `ValueError`."""
        if isinstance(self.stepsize_controller, diffrax.AbstractAdaptiveStepSizeController):
            raise ValueError(
                f"this flow map's steps are chosen by its `stepsize_controller`="
                f"{type(self.stepsize_controller).__name__} while it solves, so it has no "
                "fixed step grid; give FlowMap a fixed `dt0` and no adaptive controller."
            )
        controls = _starting_at(self.model, self.s).controls
        dt0 = controls.default_step if self.dt0 is None else self.dt0
        return fixed_steps(self.s, self.t, dt0, tuple(controls.jump_times()))

    def states(
        self, u: Float[Array, "tokens features"], ts, mask=None
    ) -> Float[Array, "depths tokens features"]:
        """The states at the depths `ts` (increasing, within $[s, t]$) of the solution that
        is `u` at $s$, along this map's own solve (its solver, step and terms):
        `[depths, tokens, features]`."""
        self.check_state(u, "u")
        ts = jnp.asarray(ts, jnp.promote_types(u.dtype, jnp.float32))
        return self._solve(u, self._key_mask(u, mask), saveat=diffrax.SaveAt(ts=ts))

    def __call__(
        self, u: Float[Array, "tokens features"], mask=None
    ) -> Float[Array, "tokens features"]:
        """$u(t)$ from $u(s) =$ `u` (one sequence `[tokens, features]`); `mask`: the key
        mask (`[tokens]`, False on padding) or None."""
        self.check_state(u, "u")
        return self.solve(u, self._key_mask(u, mask))

    def jacobian(self, u: Float[Array, "tokens features"], mask=None) -> FlowJacobian:
        """The Jacobian $\\partial u(t) / \\partial u(s)$ at `u`, as a matrix-free
        [`FlowJacobian`][itde.analysis.FlowJacobian]."""
        self.check_state(u, "u")
        return FlowJacobian(self, u, self._key_mask(u, mask))


class FlowJacobian(eqx.Module):
    r"""The Jacobian $J = \partial u(t) / \partial u(s)$ of a [`FlowMap`][itde.analysis.FlowMap]
    at a state `u`, as a matrix-free linear operator on states `[tokens, features]`.

    - `mv(v)` $= J v$: a Jacobian-vector product, forward mode through the solve
      (`jax.jvp` with `diffrax.ForwardMode()`): one solve carrying the tangent.
    - `rmv(w)` $= J^\top w$: a vector-Jacobian product, reverse mode (`jax.vjp`, the
      solve's checkpointed adjoint). For many products, `pullback()` linearises once
      and applies $J^\top$ to each.
    - `as_matrix()`: the dense `[tokens * features, tokens * features]` matrix (one JVP
      per column): only for small states and tests.

    With a `mask`, the solve runs with that key mask (the real tokens never see the
    padded ones), and the operator is the flow's own Jacobian, padded tokens included:
    the sensitivity functions restrict it to the real tokens.

    **Fields:** `flow`: the [`FlowMap`][itde.analysis.FlowMap] $\varphi_{s,t}$ that is
    differentiated (its model, depths $s, t$ and solver); `u`: the state $u(s)$ at which,
    `[tokens, features]`; `mask`: the key mask `[tokens]` (booleans), or None.
    """

    flow: FlowMap
    u: Float[Array, "tokens features"]
    mask: Bool[Array, " tokens"] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """`(n, n)` with $n$ = tokens × features."""
        n = math.prod(self.u.shape)
        return (n, n)

    def _forward(self, u):
        flow = eqx.tree_at(lambda f: f.solver, self.flow, _lax_stages(self.flow.solver),
                           is_leaf=lambda x: x is None)  # fmt: skip
        return flow.solve(u, self.mask, diffrax.ForwardMode())

    def _reverse(self, u):
        return self.flow.solve(u, self.mask)

    def mv(self, v: Float[Array, "tokens features"]) -> Float[Array, "tokens features"]:
        """$J v$ (forward mode)."""
        return jax.jvp(self._forward, (self.u,), (jnp.asarray(v, self.u.dtype),))[1]

    def pullback(self):
        """`w -> J^T w`, from one reverse-mode linearisation of the solve (its
        checkpoints kept: memory one state per step), to apply to many `w`."""
        _, pull = jax.vjp(self._reverse, self.u)
        return lambda w: pull(jnp.asarray(w, self.u.dtype))[0]

    def rmv(self, w: Float[Array, "tokens features"]) -> Float[Array, "tokens features"]:
        """$J^\\top w$ (reverse mode)."""
        return self.pullback()(w)

    def as_matrix(self) -> Float[Array, "n n"]:
        """The dense matrix $J$, `[tokens * features, tokens * features]`, row-major
        over `(token, feature)`: one JVP per column (`jax.jacfwd`), for small states."""
        n = self.shape[0]
        basis = jnp.eye(n, dtype=self.u.dtype).reshape(n, *self.u.shape)
        cols = jax.vmap(self.mv)(basis)
        return cols.reshape(n, n).T


def _lax_stages(solver):
    """`solver` with every Runge–Kutta solver inside it (a splitting solver's sub-solvers
    too) evaluating its stages in a `lax.scan`: diffrax's default checkpointed scan is a
    `custom_vjp`, which forward mode cannot differentiate, and `diffrax.ForwardMode` only
    rewrites the outermost solver."""
    if solver is None:
        return None

    def lax(x):
        if isinstance(x, diffrax.AbstractRungeKutta) and x.scan_kind is None:
            return eqx.tree_at(lambda s: s.scan_kind, x, "lax", is_leaf=lambda v: v is None)
        return x

    return jax.tree.map(lax, solver, is_leaf=lambda x: isinstance(x, diffrax.AbstractRungeKutta))


def _check_layers(controls: AbstractControls, s: float, dt0, stepsize_controller) -> None:
    """Per-layer controls: no step longer than a layer, and constant steps from `s`
    that land on every later layer boundary (`itde.solve` checks this from a boundary)."""
    if not isinstance(controls, PiecewiseConstant):
        return
    h = controls.layer_length
    if dt0 is not None and dt0 > h * (1 + 1e-9):
        raise ValueError(
            f"`dt0`={dt0} is longer than one layer (the layers have depth length {h}): a step "
            f"would straddle a layer boundary. Use dt0 <= {h}, e.g. dt0={h} (the discrete "
            "network) or a divisor of it."
        )
    if isinstance(stepsize_controller, diffrax.ConstantStepSize) and dt0 is not None:
        later = [j for j in controls.layer_times() if j > s + _tol(s)]
        off = [j for j in later if abs((j - s) / dt0 - round((j - s) / dt0)) > 1e-9 * (j - s)]
        if off:
            raise ValueError(
                f"`s`={s} with constant steps dt0={dt0} misses the layer boundaries "
                f"{np.round(off[:3], 12).tolist()}: steps would straddle them. Start `s` on "
                "a layer boundary, or omit `stepsize_controller` (the default grid restarts "
                "at every boundary)."
            )
