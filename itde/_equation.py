r"""The Transformer integro-differential equation and its solution through diffrax.

$$u_t = A(u) + \partial I_{S_1(\sigma_1,\sigma_2)}(u) + F(u) + \partial I_{S_1}(u),
\qquad u(x, y, 0) = f(x, y).$$
"""

from __future__ import annotations

import dataclasses

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from itde_solvers import ProjectionTerm, SplitTerm

from ._abstract import AbstractEquation
from ._checks import check_bool, check_choice, check_int, check_key
from ._controls import AbstractControls, Block, PiecewiseConstant, stack
from ._operators._attention import check_heads
from ._operators._feedforward import check_activation
from ._operators._layernorm import LayerNormProjection, feature_mean
from ._quadrature._rules import Grid
from ._registry import ATTENTION_IMPLS, FFN_FORMS, TERMS_KINDS
from ._solve import solve


def _batched(flow):
    """A sub-flow mapped over a leading batch axis of the state."""
    if isinstance(flow, ProjectionTerm):
        p = flow.projection
        return ProjectionTerm(lambda t, u: jax.vmap(lambda v: p(t, v))(u))
    f = flow.vector_field
    return diffrax.ODETerm(lambda t, u, args: jax.vmap(lambda v: f(t, v, args))(u))


def _unit_or(weights: np.ndarray) -> np.ndarray | None:
    """None when every weight is 1 (the multiplication would be a no-op)."""
    return None if np.all(weights == 1.0) else weights


class TransformerIDE(AbstractEquation):
    r"""The equation of the paper, with its controls, grid and options: one object for
    the Transformer regime ($\Delta t = 1$, piecewise-constant controls) and the
    continuum regime ($\Delta t \to 0$).

    Calling the model on one sequence `u0` of shape `[tokens, features]` solves the
    equation to depth $T$ with the paper's scheme — Lie–Trotter splitting with
    $\Delta t = 1$ over the sub-flows (attention, projection onto $S_1$, feed-forward,
    projection onto $S_1$) — and applies the optional final projection. That is exactly
    a post-LN Transformer encoder (`nn.TransformerEncoderLayer(norm_first=False)`).
    Batch with `jax.vmap(model)`.

    **Arguments:**

    - `controls`: the per-depth parameters: `PiecewiseConstant` over layer blocks (a
      discrete Transformer) or `LegendreControls` (smooth in depth).
    - `grid`: token and feature quadrature ([`Grid`][itde.Grid]); `Grid.unit(d)` is the
      standard Transformer.
    - `causal`: Volterra (decoder) attention, integrating over $\tilde x \le x$: on the
      unit grid the Transformer's masked sum; on any other 1-D rule its partial-interval
      weights ([`volterra_weights`][itde.volterra_weights]: order 2, 4 or geometric).
    - `ffn_form`: `"residual"` — the feed-forward sub-flow is an Euler step of $F$,
      $u_5 = u_2 + F(u_2)$ (PyTorch's block for any $\varepsilon$) — or `"relaxation"`,
      the paper's $u_5 = \tfrac12(u_4 + u_2)$ with $u_4 = F(u_2)$ (the same block when
      $\varepsilon = 0$, slightly different when $\varepsilon > 0$).
    - `final_norm`: an optional projection applied after the solve
      (`nn.TransformerEncoder(norm=...)`).
    - `attention_impl`: `"dense"`, `"blocked"` (token blocks of `block_size`, memory
      linear in the number of tokens, same result to round-off) or `"fused"`
      (`jax.nn.dot_product_attention`; float32 softmax).
    - `batch_axis`: where [`batch`][] finds the batch in its input: 0 for
      `[batch, tokens, features]` (the default), 1 for PyTorch's `batch_first=False`
      layout `[tokens, batch, features]` (set by `from_torch` from the module it
      converts). `jax.vmap(model)` maps over axis 0 whatever this says; for the other
      layout use `jax.vmap(model, in_axes=1, out_axes=1)`.

    The controls' blocks hold either discrete kernels (matrices on the grid's nodes:
    [`Block`][itde.Block]) or kernel functions ([`FunctionBlock`][itde.FunctionBlock]),
    sampled on the grid at every evaluation; then [`on_grid`][] moves the same model to
    any other grid (zero-shot resolution transfer).
    """

    controls: AbstractControls
    grid: Grid
    causal: bool = eqx.field(static=True, default=False)
    ffn_form: str = eqx.field(static=True, default="residual")
    final_norm: LayerNormProjection | None = None
    attention_impl: str = eqx.field(static=True, default="dense")
    block_size: int = eqx.field(static=True, default=512)
    batch_axis: int = eqx.field(static=True, default=0)

    def __check_init__(self):
        if not isinstance(self.controls, AbstractControls):
            raise TypeError(
                f"`controls` must be itde.PiecewiseConstant or itde.LegendreControls, got "
                f"{type(self.controls).__name__}."
            )
        if not isinstance(self.grid, Grid):
            raise TypeError(f"`grid` must be an itde.Grid, got {type(self.grid).__name__}.")
        check_bool("causal", self.causal)
        check_choice("ffn_form", self.ffn_form, FFN_FORMS)
        check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
        check_int("block_size", self.block_size, minimum=1)
        if self.batch_axis not in (0, 1) or isinstance(self.batch_axis, bool):
            raise ValueError(
                f"`batch_axis`={self.batch_axis!r} must be 0 ([batch, tokens, features]) or 1 "
                "([tokens, batch, features], PyTorch's batch_first=False)."
            )
        if self.final_norm is not None and not isinstance(self.final_norm, LayerNormProjection):
            raise TypeError(
                f"`final_norm` must be an itde.LayerNormProjection or None, got "
                f"{type(self.final_norm).__name__}."
            )
        d = self.controls.n_features
        if d is not None and self.grid.n_features != d:
            raise ValueError(
                f"`grid.n_features`={self.grid.n_features} does not match the kernels' "
                f"feature count {d}; build the grid with n_features={d}."
            )

    # ----------------------------------------------------------------- construction
    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        n_layers: int,
        n_features: int,
        n_heads: int,
        n_hidden: int | None = None,
        activation: str = "relu",
        eps: float = 1e-5,
        bias: bool = True,
        causal: bool = False,
        ffn_form: str = "residual",
        grid: Grid | None = None,
        dtype=None,
    ) -> TransformerIDE:
        """A model with random discrete per-layer controls (PyTorch's initialisation).

        `n_hidden` defaults to `4 * n_features`; `grid` to the unit grid.
        """
        check_heads(n_features, n_heads)
        check_activation(activation)
        check_bool("bias", bias)
        check_key("key", key)
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"`n_layers` must be a positive int, got {n_layers!r}.")
        n_hidden = 4 * n_features if n_hidden is None else n_hidden
        if isinstance(n_hidden, bool) or not isinstance(n_hidden, int) or n_hidden < 1:
            raise ValueError(f"`n_hidden` must be a positive int, got {n_hidden!r}.")
        keys = jax.random.split(key, n_layers)
        blocks = [
            Block.init(
                k,
                n_features=n_features,
                n_heads=n_heads,
                n_hidden=n_hidden,
                activation=activation,
                eps=eps,
                bias=bias,
                dtype=dtype,
            )
            for k in keys
        ]
        return cls(
            PiecewiseConstant(stack(blocks)),
            grid if grid is not None else Grid.unit(n_features),
            causal=causal,
            ffn_form=ffn_form,
        )

    # ----------------------------------------------------------------- properties
    @property
    def n_layers(self) -> int:
        """The number of layers (per-layer controls only)."""
        return self.controls.n_layers

    @property
    def n_features(self) -> int:
        return self.grid.n_features

    # ----------------------------------------------------------------- the operators
    def _feature_weights(self):
        return _unit_or(self.grid.feature_weights())

    def attention_field(self, t, u, args=None):
        """The vector field $A(u)$ at depth `t`."""
        att, head_weights = self.controls(t, "right").attention.discretise(self.grid)
        lw = self.grid.token_log_weights(u.shape[0], u.dtype)
        causal, volterra = self.causal, dict()
        cw = self.grid.causal_weights(u.shape[0]) if self.causal else None
        if cw is not None:  # causal at quadrature order: per-query weights for [a, x_i]
            lw, causal = None, cw.strict
            volterra = dict(query_weights=cw, signed_weights=cw.signed)
        return att(
            u,
            feature_weights=self._feature_weights(),
            head_weights=head_weights,
            token_log_weights=lw,
            causal=causal,
            impl=self.attention_impl,
            block_size=self.block_size,
            **volterra,
        )

    def feedforward_field(self, t, u, args=None):
        """The vector field $F(u)$ at depth `t` (or $\\tfrac12(F(u) - u)$, relaxation form)."""
        ff, hidden_weights = self.controls(t, "right").feedforward.discretise(self.grid)
        f = ff(u, feature_weights=self._feature_weights(), hidden_weights=hidden_weights)
        if self.ffn_form == "relaxation":
            return 0.5 * (f - u)
        return f

    def project1(self, t, u):
        """Projection onto the first constraint set of the layer acting at `t`."""
        return self.controls(t, "left").norm1(u, self._feature_weights())

    def project2(self, t, u):
        """Projection onto the second constraint set of the layer acting at `t`."""
        return self.controls(t, "left").norm2(u, self._feature_weights())

    # ------------------------------------------------------------- continuum limit
    def constraint(self, t) -> LayerNormProjection:
        r"""The constraint set $S_1(\sigma_1(t), \sigma_2(t))$ of the continuum equation
        (the second projection's set: the one every layer's output lies on)."""
        norm = self.controls(t, "left").norm2
        if norm.gain is not None or norm.shift is not None or norm.eps != 0.0:
            raise ValueError(
                "the continuum (tangent) form needs the exact projection onto "
                "S1(sigma1, sigma2): LayerNormProjection with eps=0 and no per-feature "
                f"gain/shift, got eps={norm.eps}, gain={'set' if norm.gain is not None else None}, "
                f"shift={'set' if norm.shift is not None else None}. Use "
                "LegendreControls.init(...) or set them so."
            )
        return norm

    def project(self, t, u):
        """Exact projection onto the continuum constraint set at `t`."""
        return self.constraint(t)(u, self._feature_weights())

    def _tangent(self, t, u, w, drift: bool):
        r"""$P_T(z) w + [\sigma_1'(t) + \sigma_2'(t) z]$, $z = (u - \sigma_1)/\sigma_2$."""
        fw = self._feature_weights()
        norm = self.constraint(t)
        s1, s2 = norm.sigma1.astype(u.dtype), norm.sigma2.astype(u.dtype)
        z = (u - s1) / s2
        out = w - feature_mean(w, fw) - feature_mean(w * z, fw) * z
        if drift:

            def sig(s):
                n = self.controls(s, "left").norm2
                return n.sigma1, n.sigma2

            t = jnp.asarray(t, u.dtype)
            _, (d1, d2) = jax.jvp(sig, (t,), (jnp.ones_like(t),))
            out = out + d1.astype(u.dtype) + d2.astype(u.dtype) * z
        return out

    def attention_tangent(self, t, u, args=None):
        """$P_T A(u)$ (no drift: the feed-forward sub-flow owns the constraint's motion)."""
        return self._tangent(t, u, self.attention_field(t, u), drift=False)

    def feedforward_tangent(self, t, u, args=None):
        """$P_T F(u)$ plus the drift of the moving constraint: the last vector field, the
        one that owns the clock in `solvers.Strang` by default."""
        return self._tangent(t, u, self.feedforward_field(t, u), drift=True)

    def tangent_field(self, t, u, args=None):
        r"""The continuum equation on $S_1(t)$:
        $u_t = P_T(z)[A(u) + F(u)] + \sigma_1'(t) + \sigma_2'(t) z$."""
        w = self.attention_field(t, u) + self.feedforward_field(t, u)
        return self._tangent(t, u, w, drift=True)

    def terms(self, kind: str = "paper", batched: bool = False) -> SplitTerm:
        r"""The equation's sub-flows for a solver.

        - `"paper"`: attention, $P_{S_1}$, feed-forward (substeps 3–5), $P_{S_1}$ — the
          paper's splitting; with `LieTrotter` and $\Delta t = 1$ a post-LN Transformer.
        - `"split"`: the same four sub-flows with each vector field replaced by its
          tangent part on the moving constraint set (the drift owned by the
          feed-forward, the last vector field), for higher-order splittings (Strang).
        - `"tangent"`: the whole tangent field and one projection, for any diffrax
          solver wrapped in a projection method.

        `batched=True` maps every sub-flow over a leading batch axis of the state
        (`[batch, tokens, features]`): one solve for the whole batch, which is cheaper in
        reverse mode than `jax.vmap` of the solve (see `TransformerIDE.batch`).
        """
        if kind == "paper":
            flows = (
                diffrax.ODETerm(self.attention_field),
                ProjectionTerm(self.project1),
                diffrax.ODETerm(self.feedforward_field),
                ProjectionTerm(self.project2),
            )
        elif kind == "split":
            flows = (
                diffrax.ODETerm(self.attention_tangent),
                ProjectionTerm(self.project),
                diffrax.ODETerm(self.feedforward_tangent),
                ProjectionTerm(self.project),
            )
        elif kind == "tangent":
            flows = (diffrax.ODETerm(self.tangent_field), ProjectionTerm(self.project))
        else:
            raise ValueError(f"`kind`={kind!r} is not known; choose one of {TERMS_KINDS}.")
        if batched:
            flows = tuple(_batched(f) for f in flows)
        return SplitTerm(flows)

    def on_grid(
        self,
        grid: Grid,
        *,
        n_head_nodes: int | None = None,
        n_hidden_nodes: int | None = None,
        head_rule=None,
        hidden_rule=None,
    ) -> TransformerIDE:
        """The same model on another token × feature grid (and optionally other head and
        hidden quadratures): zero-shot resolution transfer. Needs function kernels
        (`FunctionBlock` controls); discrete kernels are matrices tied to their grid."""
        from .function._block import with_resolution

        if self.controls.n_features is not None:
            raise TypeError(
                "`on_grid` needs a model whose kernels are functions (FunctionBlock "
                "controls); this model holds discrete kernels for "
                f"{self.controls.n_features} feature nodes, which exist on one grid only."
            )
        if not isinstance(grid, Grid):
            raise TypeError(f"`grid` must be an itde.Grid, got {type(grid).__name__}.")
        controls = self.controls
        if any(v is not None for v in (n_head_nodes, n_hidden_nodes, head_rule, hidden_rule)):
            controls = with_resolution(
                controls,
                n_head_nodes=n_head_nodes,
                n_hidden_nodes=n_hidden_nodes,
                head_rule=head_rule,
                hidden_rule=hidden_rule,
            )
        return dataclasses.replace(self, controls=controls, grid=grid)

    # ----------------------------------------------------------------- solving
    def __call__(self, u0: Float[Array, "tokens features"]) -> Float[Array, "tokens features"]:
        """The encoder's output for one sequence: $u(T)$ from the paper's scheme, in the
        dtype of `u0`."""
        sol = solve(self, u0)
        assert sol.ys is not None
        u = sol.ys[-1]
        if self.final_norm is not None:
            u = self.final_norm(u, self._feature_weights())
        return u.astype(u0.dtype)

    def batch(
        self, u0: Float[Array, "batch tokens features"]
    ) -> Float[Array, "batch tokens features"]:
        """`jax.vmap(model)(u0)`, computed as one solve over the batch.

        The vector fields and projections are mapped over the batch inside a single
        `diffeqsolve`, instead of mapping the solve: the same numbers, and a cheaper
        backward pass (diffrax's checkpointed loop is then not batched).

        The batch is on axis `batch_axis` of `u0` (0 by default; 1 for a model converted
        from a PyTorch module with `batch_first=False`), and stays there in the output."""
        if type(u0).__module__.startswith("torch"):
            self.check_state(u0, "u0")
        if getattr(u0, "ndim", None) != 3:
            layout = (
                "[batch, tokens, features]" if self.batch_axis == 0 else
                "[tokens, batch, features] (batch_axis=1)"
            )  # fmt: skip
            raise ValueError(
                f"`u0` must be a batch {layout}, got shape {getattr(u0, 'shape', None)}; for "
                "one sequence call the model itself."
            )
        x = jnp.moveaxis(u0, self.batch_axis, 0)
        if x.shape[0] == 0:
            raise ValueError(
                f"`u0` is an empty batch (axis {self.batch_axis} has length 0); give at least "
                "one sequence."
            )
        sol = solve(self, x, batched=True)
        assert sol.ys is not None
        u = sol.ys[-1]
        if self.final_norm is not None:
            fw = self._feature_weights()
            u = jax.vmap(lambda v: self.final_norm(v, fw))(u)  # type: ignore[misc]
        return jnp.moveaxis(u.astype(u0.dtype), 0, self.batch_axis)

    def trajectory(
        self, u0: Float[Array, "tokens features"]
    ) -> Float[Array, "layers1 tokens features"]:
        """The state after every layer: `[n_layers + 1, tokens, features]`, $u(t_n)$, in the
        dtype of `u0` (per-layer controls only: for smooth controls save the states at
        chosen depths with `itde.solve(model, u0, saveat=diffrax.SaveAt(ts=...))`)."""
        if not isinstance(self.controls, PiecewiseConstant):
            raise TypeError(
                "`trajectory` returns the state after every layer and needs per-layer "
                f"(PiecewiseConstant) controls; this model has {type(self.controls).__name__}. "
                "Use `itde.solve(model, u0, dt0=..., saveat=diffrax.SaveAt(ts=...))` to save "
                "the states at chosen depths."
            )
        self.check_state(u0, "u0")
        ts = np.asarray(self.controls.layer_times())
        sol = solve(self, u0, saveat=diffrax.SaveAt(ts=ts))
        assert sol.ys is not None
        return sol.ys.astype(u0.dtype)
