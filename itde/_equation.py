r"""The Transformer integro-differential equation and its solution through diffrax.

$$u_t = A(u) + \partial I_{S_1(\sigma_1,\sigma_2)}(u) + F(u) + \partial I_{S_1}(u),
\qquad u(x, y, 0) = f(x, y)$$

(post-norm), and its pre-norm and parallel relatives $u_t = A(N_1 u) + F(N_2 u)$.
"""

from __future__ import annotations

import dataclasses
import math

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from itde_solvers import ProjectionTerm, SplitTerm

from ._abstract import AbstractEquation
from ._blocks import AbstractBlockForm, PostNorm, as_block_form
from ._buckets import PowerOfTwoBuckets
from ._checks import as_array, check_bool, check_key, warn_if_vmapped_over_tokens
from ._continuum import fold_norms
from ._controls import AbstractControls, Block, PiecewiseConstant, stack
from ._operators._abstract import AbstractNorm
from ._operators._affine import FeatureAffine
from ._operators._attention import check_heads
from ._operators._bias import AbstractScoreBias
from ._operators._cores import AbstractAttentionCore, Dense, as_attention_core
from ._operators._feedforward import check_activation
from ._operators._mask import key_mask
from ._operators._rope import Rope
from ._operators._window import SlidingWindow
from ._quadrature._rules import AbstractQuadrature, Grid
from ._solve import TERMS_KINDS, solve
from ._token_padding import has_tracer, run_on_tokens, take_rows


def _batched(flow):
    """A sub-flow mapped over a leading batch axis of the state (and of `args`, the
    per-sequence key masks, when given)."""
    if isinstance(flow, ProjectionTerm):
        p = flow.projection
        return ProjectionTerm(lambda t, u: jax.vmap(lambda v: p(t, v))(u))
    f = flow.vector_field

    def field(t, u, args):
        axes = (0, None if args is None else 0)
        return jax.vmap(lambda v, a: f(t, v, a), in_axes=axes)(u, args)

    return diffrax.ODETerm(field)


def _unit_or(rule: AbstractQuadrature, n: int, weights: np.ndarray) -> np.ndarray | None:
    """None on the rule's unit grid (every weight 1: the multiplication would be a no-op),
    decided by the rule ([`is_unit`][itde.AbstractQuadrature.is_unit]); else `weights`."""
    return None if rule.is_unit(n) else weights


class TransformerIDE(AbstractEquation):
    r"""The equation of the paper, with its controls, grid and options: one object for
    the Transformer regime ($\Delta t = 1$, piecewise-constant controls) and the
    continuum regime ($\Delta t \to 0$).

    Calling the model on one sequence `u0` of shape `[tokens, features]` solves the
    equation to depth $T$ with the paper's scheme — Lie–Trotter splitting with
    $\Delta t = 1$ over the sub-flows (attention, projection onto $S_1$, feed-forward,
    projection onto $S_1$) — and applies the optional final projection. That is exactly
    a post-LN Transformer encoder (`nn.TransformerEncoderLayer(norm_first=False)`).
    Batch with `jax.vmap(model)` or [`batch`][itde.TransformerIDE.batch].

    **The family** (`block`, a block form module):

    - [`PostNorm()`][itde.PostNorm] (the paper; BERT, the 2017 Transformer): the
      normalisations are projections onto constraint sets, sub-flows of their own:
      $u_t = A(u) + \partial I_{S^{(1)}}(u) + F(u) + \partial I_{S^{(2)}}(u)$.
    - [`PreNorm()`][itde.PreNorm] (GPT-2, Llama, ViT, `norm_first=True`): the
      normalisations are maps inside the operators, not constraints on the state,
      $u_t = A(N_1 u) + F(N_2 u)$, an ODE with no constraint. Lie splitting with Euler
      sub-steps and $\Delta t = 1$ is the pre-norm block $u \mapsto v + F(N_2 v)$,
      $v = u + A(N_1 u)$; the final norm (`final_norm`, GPT-2's `ln_f`) is the output
      map. Its continuum limit is integrated by any diffrax solver directly.
    - [`Parallel()`][itde.Parallel] (GPT-J, PaLM): the same field $A(N_1 u) + F(N_2 u)$
      taken as one sub-flow; one Euler step with $\Delta t = 1$ is the parallel block
      $u + A(N_1 u) + F(N_2 u)$ (GPT-J shares one norm: $N_1 = N_2$).

    The normalisations are [`LayerNormProjection`][itde.LayerNormProjection] or
    [`RMSNormProjection`][itde.RMSNormProjection] (in any placement); the feed-forward a
    [`FeedForward`][itde.FeedForward] or a gated [`GatedFeedForward`][itde.GatedFeedForward].

    **Padding.** `model(u0, mask=m)` with `m` a `[tokens]` boolean (or 0/1) array, False on
    padded tokens: the token domain of the sequence loses the padded tokens (their
    quadrature weight is 0), so real tokens never see them. The mask is data, not an
    option: one compiled model serves every mask (it reaches the vector fields as diffrax's
    `args`). Padded tokens themselves evolve like any token that attends to the real
    ones, and their output is defined but carries no meaning; a query with no admissible
    key (a padded token before every real one, with `causal`) gets attention output 0.

    **Arguments:**

    - `controls`: the per-depth parameters: `PiecewiseConstant` over layer blocks (a
      discrete Transformer), `LegendreControls` (smooth in depth) or `SplineControls`
      (a spline through a network's layers).
    - `grid`: token and feature quadrature ([`Grid`][itde.Grid]); `Grid.unit(d)` is the
      standard Transformer.
    - `block`: the block form (see above): `PostNorm()` (default), `PostNorm(relaxation=
      True)` (the paper's relaxation $u_5 = \tfrac12(u_4 + u_2)$, $u_4 = F(u_2)$, instead
      of $u_5 = u_2 + F(u_2)$: the same block when $\varepsilon = 0$, slightly different
      when $\varepsilon > 0$), `PreNorm()` or `Parallel()`; a name of `itde.BLOCK_FORMS`
      is turned into its module.
    - `causal`: Volterra (decoder) attention, integrating over $\tilde x \le x$: on the
      unit grid the Transformer's masked sum; on any other 1-D rule its partial-interval
      weights ([`volterra_weights`][itde.volterra_weights]: order 2, 4 or geometric).
    - `final_norm`: an optional normalisation applied after the solve
      (`nn.TransformerEncoder(norm=...)`, GPT-2's `ln_f`, Llama's `norm`).
    - `readout`: None, or the [`FeatureAffine`][itde.FeatureAffine]
      $z \mapsto g \circ z + \beta$ that [`output`][itde.TransformerIDE.output] applies to
      the solution state before `final_norm`: set by
      [`continuum_form`][itde.TransformerIDE.continuum_form] to the last norm's gain $g$
      and shift $\beta$, mapping the normalised state $z$ back to the network's hidden
      state.
    - `rope`: rotary position embedding ([`Rope`][itde.Rope]): queries and keys rotated by
      the token positions, the nodes of the grid's token rule (so it evaluates on any 1-D
      token grid).
    - `score_bias`: a score bias $b_m(x, \tilde x)$ added to every head's score: a function
      of the token positions ([`ALiBi`][itde.ALiBi], [`T5RelativeBias`][itde.T5RelativeBias])
      sampled at the grid's token nodes at every evaluation, or a fixed
      [`DiscreteBias`][itde.DiscreteBias] `[heads, N, N]` (one token count only).
    - `window`: sliding-window attention ([`SlidingWindow(length)`][itde.SlidingWindow]):
      a query at $x$ reads the keys at $|x - \tilde x| < L$ only, $0 \le x - \tilde x < L$
      with `causal` (on the unit grid `SlidingWindow(W)` with `causal=True` is Mistral's
      `sliding_window = W`). $L$ is a length on the token domain, so it is the same
      interval on every grid ([`on_grid`][] keeps it); needs a 1-D token rule. Every
      attention core takes it; the blocked one skips the key blocks outside it.
    - `attention_core`: how attention's token quadrature is evaluated:
      [`Dense()`][itde.Dense] (default), [`Blocked(block_size)`][itde.Blocked] (token
      blocks, memory linear in the number of tokens, same result to round-off) or
      [`Fused()`][itde.Fused] (`jax.nn.dot_product_attention`; float32 softmax); a name
      of `itde.ATTENTION_CORES` is turned into its module.
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
    block: AbstractBlockForm = eqx.field(default=PostNorm(), converter=as_block_form)
    final_norm: AbstractNorm | None = None
    attention_core: AbstractAttentionCore = eqx.field(default=Dense(), converter=as_attention_core)
    batch_axis: int = eqx.field(static=True, default=0)
    rope: Rope | None = None
    score_bias: AbstractScoreBias | None = None
    readout: FeatureAffine | None = None
    window: SlidingWindow | None = None

    def __check_init__(self):
        if not isinstance(self.controls, AbstractControls):
            raise TypeError(
                "`controls` must be itde controls (PiecewiseConstant, LegendreControls, "
                "SplineControls or another AbstractControls), got "
                f"{type(self.controls).__name__}."
            )
        if not isinstance(self.grid, Grid):
            raise TypeError(f"`grid` must be an itde.Grid, got {type(self.grid).__name__}.")
        check_bool("causal", self.causal)
        if self.score_bias is not None:
            if not isinstance(self.score_bias, AbstractScoreBias):
                raise TypeError(
                    "`score_bias` must be an itde.ALiBi, itde.T5RelativeBias, "
                    f"itde.DiscreteBias or None, got {type(self.score_bias).__name__}."
                )
            if self.score_bias.needs_positions and not isinstance(
                self.grid.tokens, AbstractQuadrature
            ):
                raise ValueError(
                    "a position `score_bias` needs a 1-D token rule (e.g. Midpoint()); this "
                    f"grid's token domain is {type(self.grid.tokens).__name__}."
                )
            self._check_score_bias_heads()
        if self.rope is not None:
            if not isinstance(self.rope, Rope):
                raise TypeError(f"`rope` must be an itde.Rope or None, got {self.rope!r}.")
            if not isinstance(self.grid.tokens, AbstractQuadrature):
                raise ValueError(
                    "`rope` rotates by a 1-D token position; this grid's token domain is "
                    f"{type(self.grid.tokens).__name__}. Use a 1-D token rule (e.g. Midpoint())."
                )
        if self.window is not None:
            if not isinstance(self.window, SlidingWindow):
                raise TypeError(
                    f"`window`={self.window!r} must be an itde.SlidingWindow(length) or None; "
                    "e.g. window=itde.SlidingWindow(4096.0) for Mistral's sliding_window = 4096."
                )
            if not isinstance(self.grid.tokens, AbstractQuadrature):
                raise ValueError(
                    "`window` is a length on a 1-D token domain; this grid's token domain is "
                    f"{type(self.grid.tokens).__name__}. Use a 1-D token rule (e.g. "
                    "Midpoint()), or window=None."
                )
        if self.batch_axis not in (0, 1) or isinstance(self.batch_axis, bool):
            raise ValueError(
                f"`batch_axis`={self.batch_axis!r} must be 0 ([batch, tokens, features]) or 1 "
                "([tokens, batch, features], PyTorch's batch_first=False)."
            )
        if self.readout is not None and not isinstance(self.readout, FeatureAffine):
            raise TypeError(
                f"`readout` must be an itde.FeatureAffine or None, got "
                f"{type(self.readout).__name__}."
            )
        if self.final_norm is not None and not isinstance(self.final_norm, AbstractNorm):
            raise TypeError(
                f"`final_norm` must be an itde.LayerNormProjection, itde.RMSNormProjection or "
                f"None, got {type(self.final_norm).__name__}."
            )
        self.block.check_controls(self.controls)
        self._check_layer_kernel()
        d = self.controls.n_features
        if d is not None and self.grid.n_features != d:
            raise ValueError(
                f"`grid.n_features`={self.grid.n_features} does not match the kernels' "
                f"feature count {d}; build the grid with n_features={d}."
            )
        if self.readout is not None:
            self.readout.check_width(self.grid.n_features, "readout")
        for name in ("affine1", "affine2"):
            affine = getattr(self.controls.blocks, name, None)
            if affine is not None:
                affine.check_width(self.grid.n_features, f"controls.blocks.{name}")

    def _check_layer_kernel(self) -> None:
        """Per-layer windows and RoPE (controls of the attention kernel) need per-layer
        controls and a 1-D token rule."""
        blocks = self.controls.blocks
        for part, what in (("window", "sliding window"), ("rope", "RoPE")):
            if getattr(blocks, part, None) is None:
                continue
            if not isinstance(self.controls, PiecewiseConstant):
                raise ValueError(
                    f"the controls carry a per-layer {what} (`Block.{part}`), which jumps "
                    f"from layer to layer; {type(self.controls).__name__} are smooth in depth "
                    "and have no such control (a window length or RoPE base between two "
                    "layers is not defined): keep PiecewiseConstant controls, or fit a model "
                    f"whose layers share one {what} (the equation's `{part}`)."
                )
            if not isinstance(self.grid.tokens, AbstractQuadrature):
                raise ValueError(
                    f"a per-layer {what} (`Block.{part}`) acts at 1-D token positions; this "
                    f"grid's token domain is {type(self.grid.tokens).__name__}. Use a 1-D "
                    "token rule (e.g. Midpoint())."
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
        grid: Grid | None = None,
        block: AbstractBlockForm | str = "post_norm",
        norm: type[AbstractNorm] | str = "layer",
        gated: bool = False,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        rope_base: float | None = None,
        final_norm: bool = False,
        window: SlidingWindow | None = None,
        dtype=None,
    ) -> TransformerIDE:
        """A model with random discrete per-layer controls (PyTorch's initialisation).

        `n_hidden` defaults to `4 * n_features`; `grid` to the unit grid. The family:
        `block` (a block form, e.g. `itde.PreNorm()`, or its name `"post_norm"`,
        `"pre_norm"`, `"parallel"`), `norm` (a norm class, e.g. `itde.RMSNormProjection`,
        or its name `"layer"`, `"rms"`),
        `gated` (SwiGLU/GeGLU feed-forward), `n_kv_heads` (grouped-query attention),
        `head_dim`, `rope_base` (rotary positions with that base, e.g. 10000.0; None: no
        RoPE), `final_norm` (a final normalisation of the same kind, identity-initialised),
        `window` (sliding-window attention, e.g. `itde.SlidingWindow(256.0)`).
        For example a small Llama: `block=itde.PreNorm(), norm="rms", gated=True,
        activation="silu", bias=False, rope_base=10000.0, final_norm=True, causal=True`.
        """
        block = as_block_form(block)
        check_bool("final_norm", final_norm)
        if head_dim is None:
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
                norm=norm,
                gated=gated,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                out_norms=block.output_norms,
            )
            for k in keys
        ]
        rope = None
        if rope_base is not None:
            hd = blocks[0].attention.head_dim
            if (
                isinstance(rope_base, bool)
                or not isinstance(rope_base, (int, float))
                or not (math.isfinite(rope_base) and rope_base > 0)
            ):
                raise ValueError(
                    f"`rope_base`={rope_base!r} must be a positive finite number (the RoPE "
                    "frequency base, e.g. 10000.0), or None for no rotary embedding."
                )
            if hd % 2:
                raise ValueError(
                    f"`rope_base` needs an even head size to rotate pairs of features; this "
                    f"model's head size is {hd} (n_features / n_heads, or `head_dim`): give "
                    "an even `head_dim`, or rope_base=None."
                )
            rope = Rope.init(hd, base=float(rope_base))
        return cls(
            PiecewiseConstant(stack(blocks)),
            grid if grid is not None else Grid.unit(n_features),
            causal=causal,
            final_norm=blocks[0].norm2 if final_norm else None,
            block=block,
            rope=rope,
            window=window,
        )

    # ----------------------------------------------------------------- properties
    @property
    def n_layers(self) -> int:
        """The number of layers (per-layer controls only)."""
        return self.controls.n_layers

    @property
    def n_features(self) -> int:
        return self.grid.n_features

    @property
    def has_constraint(self) -> bool:
        """Post-norm equations live on the constraint set of their normalisation; pre-norm
        and parallel ones are unconstrained ODEs (any diffrax solver applies directly)."""
        return self.block.has_constraint

    # ----------------------------------------------------------------- the operators
    def feature_weights(self) -> np.ndarray | None:
        """The feature quadrature weights, or None when every weight is 1 (the unit grid:
        the multiplications are skipped)."""
        features = self.grid.features
        return _unit_or(features, self.grid.n_features, self.grid.feature_weights())

    def _rotary(self, u, t=None):
        """The RoPE angles at the token nodes of `u`: the layer's own `rope` at depth `t`
        when the controls carry one per layer, else the equation's."""
        rope = self.rope
        if t is not None and getattr(self.controls.blocks, "rope", None) is not None:
            rope = self.controls(t, "right", "rope")
        if rope is None:
            return None
        x, _ = self.grid.tokens.nodes_weights(u.shape[0])
        return rope.cos_sin(x, u.dtype)

    def _window(self, u):
        if self.window is None:
            return None
        x, _ = self.grid.tokens.nodes_weights(u.shape[0])
        return self.window.on_nodes(x)

    def _check_score_bias_heads(self) -> None:
        heads = getattr(self.controls.blocks.attention, "n_heads", None)
        if self.score_bias is not None and heads is not None:
            if self.score_bias.n_heads not in (1, heads):
                raise ValueError(
                    f"`score_bias` has values for {self.score_bias.n_heads} heads but the "
                    f"attention has {heads}; give a bias with {heads} heads (e.g. "
                    f"ALiBi.init({heads}))."
                )

    def check_state(self, u0, name: str = "u0") -> None:
        """Trace-time check of one state `[tokens, features]`, and of the score bias's head
        count again (a bias swapped in with `eqx.tree_at` skips `__check_init__`)."""
        super().check_state(u0, name)
        self._check_score_bias_heads()

    def _score_bias(self, u, t=None):
        r"""The score bias at the token nodes of `u`, with the layer's window at depth `t`
        (a [`LayerWindow`][itde.LayerWindow] in the controls: $-\infty$ outside it) when
        the controls carry one."""
        bias = None
        if self.score_bias is not None:
            x, _ = self.grid.tokens.nodes_weights(u.shape[0])
            bias = self.score_bias.on_nodes(x)
        if t is not None and getattr(self.controls.blocks, "window", None) is not None:
            x, _ = self.grid.tokens.nodes_weights(u.shape[0])
            bias = self.controls(t, "right", "window").score_bias(x, bias)
        return bias

    def attention_field(self, t, u, args=None):
        """The vector field $A(u)$ at depth `t` ($A(N_1 u)$ for pre-norm and parallel
        blocks). `args` is the key mask (`[tokens]` booleans) or None."""
        att, head_weights = self.controls(t, "right", "attention").discretise(self.grid)
        fw = self.feature_weights()
        v = self.block.attention_input(self, t, u)
        lw = self.grid.token_log_weights(u.shape[0], u.dtype)
        causal, volterra = self.causal, dict()
        cw = self.grid.causal_weights(u.shape[0]) if self.causal else None
        if cw is not None:  # causal at quadrature order: per-query weights for [a, x_i]
            lw, causal = None, cw.strict
            volterra = dict(query_weights=cw, signed_weights=cw.signed)
        out = att(
            v,
            feature_weights=fw,
            head_weights=head_weights,
            token_log_weights=lw,
            causal=causal,
            core=self.attention_core,
            key_mask=args,
            rotary=self._rotary(u, t),
            score_bias=self._score_bias(u, t),
            window=self._window(u),
            **volterra,
        )
        out = self.block.attention_output(self, t, out)
        if self.controls.blocks.affine1 is not None:
            out = out + self.controls(t, "right", "affine1")(u)
        return out

    def feedforward_field(self, t, u, args=None):
        """The vector field $F(u)$ at depth `t` ($F(N_2 u)$ for pre-norm and parallel
        blocks; $\\tfrac12(F(u) - u)$ in the post-norm relaxation form)."""
        ff, hidden_weights = self.controls(t, "right", "feedforward").discretise(self.grid)
        v = self.block.feedforward_input(self, t, u)
        f = ff(v, feature_weights=self.feature_weights(), hidden_weights=hidden_weights)
        if self.controls.blocks.affine2 is not None:
            f = f + self.controls(t, "right", "affine2")(u)
        return self.block.feedforward_output(self, t, f, u)

    def field(self, t, u, args=None):
        """The whole unconstrained right-hand side $A(N_1 u) + F(N_2 u)$ of a pre-norm or
        parallel equation (for a post-norm one see `tangent_field`)."""
        return self.attention_field(t, u, args) + self.feedforward_field(t, u, args)

    def project1(self, t, u):
        """Projection onto the first constraint set of the layer acting at `t`."""
        return self.controls(t, "left", "norm1")(u, self.feature_weights())

    def project2(self, t, u):
        """Projection onto the second constraint set of the layer acting at `t`."""
        return self.controls(t, "left", "norm2")(u, self.feature_weights())

    # ------------------------------------------------------------- continuum limit
    def constraint(self, t) -> AbstractNorm:
        r"""The exact projection onto the constraint set of the continuum post-norm
        equation at `t`: the set of fixed points of the second normalisation (the one
        every layer's output lies on), e.g. $S_1(\sigma_1(t), \sigma_2(t))$ for
        $\varepsilon = 0$ and $S_1(\sigma_1, \sqrt{\sigma_2^2 - \varepsilon})$ for
        $\varepsilon > 0$ (see [`AbstractNorm.fixed_points`][itde.AbstractNorm.fixed_points]).
        A norm with a per-feature gain or shift is no projection and has no such set: take
        [`continuum_form`][itde.TransformerIDE.continuum_form] first."""
        if not self.block.has_constraint:
            raise ValueError(
                f"a `block`={self.block!r} equation has no constraint set: its normalisations "
                "are maps inside the operators, and its continuum is an unconstrained ODE."
            )
        return self.controls(t, "left", "norm2").fixed_points()

    def project(self, t, u):
        """Exact projection onto the continuum constraint set at `t` (the identity for
        pre-norm and parallel equations, which have none)."""
        if not self.block.has_constraint:
            return u
        return self.constraint(t)(u, self.feature_weights())

    def _tangent(self, t, u, w, drift: bool):
        r"""$P_T(u) w$ plus, with `drift`, the motion of the constraint set (for
        $S_1$: $P_T(z) w + \sigma_1'(t) + \sigma_2'(t) z$, $z = (u - \sigma_1)/\sigma_2$)."""
        fw = self.feature_weights()
        norm = self.constraint(t)
        out = norm.tangent(u, w, fw)
        if drift:
            t = jnp.asarray(t, u.dtype)
            _, d_norm = jax.jvp(
                lambda s: self.controls(s, "left", "norm2").fixed_points(),
                (t,),
                (jnp.ones_like(t),),
            )
            out = out + norm.drift(u, d_norm, fw)
        return out

    def attention_tangent(self, t, u, args=None):
        """$P_T A(u)$ (no drift: the feed-forward sub-flow owns the constraint's motion)."""
        return self._tangent(t, u, self.attention_field(t, u, args), drift=False)

    def feedforward_tangent(self, t, u, args=None):
        """$P_T F(u)$ plus the drift of the moving constraint: the last vector field, the
        one that owns the clock in `solvers.Strang` by default."""
        return self._tangent(t, u, self.feedforward_field(t, u, args), drift=True)

    def tangent_field(self, t, u, args=None):
        r"""The continuum equation on $S_1(t)$:
        $u_t = P_T(z)[A(u) + F(u)] + \sigma_1'(t) + \sigma_2'(t) z$."""
        w = self.attention_field(t, u, args) + self.feedforward_field(t, u, args)
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

        A pre-norm equation has no projections: `"paper"` and `"split"` are the two vector
        fields $A(N_1 u)$, $F(N_2 u)$ (Lie with $\Delta t = 1$: the pre-norm block), and
        `"tangent"` their sum. A parallel one: `"paper"` and `"tangent"` are the sum (one
        Euler step with $\Delta t = 1$: the parallel block), `"split"` the two fields.
        """
        if kind not in TERMS_KINDS:
            raise ValueError(f"`kind`={kind!r} is not known; choose one of {list(TERMS_KINDS)}.")
        flows = getattr(self.block, f"{kind}_flows")(self)
        if batched:
            flows = tuple(_batched(f) for f in flows)
        return SplitTerm(flows)

    def continuum_form(self, input_affine: FeatureAffine | None = None) -> TransformerIDE:
        r"""The same network in normalised coordinates, whose depth can be refined.

        A post-norm network's LayerNorms with per-feature gains $g$ and shifts $\beta$ are
        not projections: solving it with a step below one layer re-applies them and
        computes another network, and the continuum solvers refuse it. Its continuum form
        is an exact change of variables $u = g \circ z + \beta$ onto the unit set $S_1$:
        the gains are folded into the next operators' input weights, the rest of them is an
        extra affine field $(g - 1) \circ z + \beta$ per sub-flow (`Block.affine1`,
        `affine2`), and the last norm's map is the `readout`. Then

        - `model.continuum_form()(u0)` (the paper's scheme, $\Delta t = 1$) equals the
          network to round-off (float64: 1e-15 against Hugging Face and PyTorch in the
          tests);
        - `itde.solve(cf, u0, solver=..., dt0=h)` with `Strang()` or
          `Projected(any diffrax solver)` integrates its continuum limit, an equation on
          the fixed set $S_1(0, \sqrt{1 - \varepsilon})$ of the regularised projection,
          at any step, at the solver's order; Lie steps converge to the same limit.

        The solution states are $z$; `cf.output(z)` (the readout, then any `final_norm`)
        turns the last one into the network's output. A pre-norm or parallel model is
        returned unchanged: its norms sit inside the operators and it is already its own
        continuum form. See `itde/_continuum.py` for the derivation.

        **Arguments:**

        - `input_affine`: when the input is itself the output of a normalisation
          $g_0 \circ P_0(e) + \beta_0$ (BERT's embedding LayerNorm),
          `FeatureAffine(g_0, beta_0)`; the form then takes $P_0(e)$.
          [`HFTransformer.continuum_form`][itde.interop.HFTransformer.continuum_form] does this.
        """
        return fold_norms(self, input_affine)

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

    def padded_tokens(self, n_tokens: int, n_padded: int) -> TransformerIDE | None:
        """The model for `n_tokens` real tokens padded to `n_padded` (see
        [`AbstractEquation.padded_tokens`][itde.AbstractEquation.padded_tokens]): its
        token rule as data on `n_padded` nodes
        ([`AbstractTokenDomain.padded`][itde.AbstractQuadrature.padded]). None with a
        sliding `window` (its band is static token indices), a `score_bias` of one token
        count (`DiscreteBias`), or a token domain that has no padded form (`TensorGrid2D`,
        causal `Simpson` below 4 nodes)."""
        if self.window is not None:
            return None
        if self.score_bias is not None and not self.score_bias.needs_positions:
            return None
        tokens = self.grid.tokens.padded(n_tokens, n_padded, causal=self.causal)
        if tokens is None:
            return None
        return eqx.tree_at(lambda m: m.grid.tokens, self, tokens)

    # ----------------------------------------------------------------- solving
    def __call__(
        self, u0: Float[Array, "tokens features"], mask: Bool[Array, " tokens"] | None = None
    ) -> Float[Array, "tokens features"]:
        """The encoder's output for one sequence: $u(T)$ from the paper's scheme, in the
        dtype of `u0`. `mask`: `[tokens]` booleans (or 0/1), False on padded tokens.

        An eager call (outside `jax.jit`) runs one program for the solve and the output
        map, shared by every token count of a bucket where the model allows it (see
        [`itde.solve`][itde.solve]'s "Compiled programs"); so do `batch` and
        `trajectory`."""
        u0 = as_array("u0", u0)
        warn_if_vmapped_over_tokens(u0, self.batch_axis)
        mask = None if mask is None else key_mask(mask, np.shape(u0)[0])
        if has_tracer(self, u0, mask):
            return _output(self, u0, mask)
        self.check_state(u0, "u0")
        return run_on_tokens(
            _output, self, u0, mask, axis=-2, batch=None, buckets=PowerOfTwoBuckets(),
            cut=lambda u, n: take_rows(u, n, -2),
        )  # fmt: skip

    def output(self, u: Float[Array, "tokens features"]) -> Float[Array, "tokens features"]:
        r"""The model's output map applied to a solution state $u(T)$ of one sequence: the
        `readout` (a continuum form's $z \mapsto g \circ z + \beta$), then the
        `final_norm`; the identity when the model has neither."""
        if self.readout is not None:
            u = self.readout(u)
        if self.final_norm is not None:
            u = self.final_norm(u, self.feature_weights())
        return u

    def batch(
        self,
        u0: Float[Array, "batch tokens features"],
        mask: Bool[Array, "batch tokens"] | None = None,
    ) -> Float[Array, "batch tokens features"]:
        """`jax.vmap(model)(u0)`, computed as one solve over the batch.

        The vector fields and projections are mapped over the batch inside a single
        `diffeqsolve`, instead of mapping the solve: the same numbers, and a cheaper
        backward pass (diffrax's checkpointed loop is then not batched).

        The batch is on axis `batch_axis` of `u0` (0 by default; 1 for a model converted
        from a PyTorch module with `batch_first=False`), and stays there in the output.
        `mask` is `[batch, tokens]` whatever the layout (booleans or 0/1, False on
        padding), as Hugging Face's `attention_mask`. An empty batch (no sequence) gives an
        empty output of the same shape and dtype, as `jax.vmap(model)` does."""
        u0 = as_array("u0", u0)
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
        # the layout is read from the shape: moving the axis here would compile a
        # transpose per shape (it happens inside the solve's program)
        x = jax.ShapeDtypeStruct(_moved(u0.shape, self.batch_axis), u0.dtype)
        if mask is not None:
            mask = key_mask(mask, x.shape[1])
            if mask.shape != x.shape[:2]:
                raise ValueError(
                    f"`mask` must have shape [batch, tokens] = {x.shape[:2]}, got {mask.shape}."
                )
        if x.shape[0] == 0:  # no sequence: nothing to solve, the empty output of vmap
            self.check_state(jax.ShapeDtypeStruct(x.shape[1:], x.dtype), "u0[i]")
            return jnp.zeros_like(u0)
        if has_tracer(self, u0, mask):
            return _batch_output(self, u0, mask)
        self.check_state(jax.ShapeDtypeStruct(x.shape[1:], x.dtype), "u0[i]")
        axis = 1 - self.batch_axis - 3  # the token axis of u0, counted from the end
        return run_on_tokens(
            _batch_output, self, u0, mask, axis=axis, batch=x.shape[0],
            buckets=PowerOfTwoBuckets(), cut=lambda u, n: take_rows(u, n, axis),
        )  # fmt: skip

    def trajectory(
        self, u0: Float[Array, "tokens features"], mask: Bool[Array, " tokens"] | None = None
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
        u0 = as_array("u0", u0)
        self.check_state(u0, "u0")
        mask = None if mask is None else key_mask(mask, np.shape(u0)[0])
        if has_tracer(self, u0, mask):
            return _trajectory(self, u0, mask)
        return run_on_tokens(
            _trajectory, self, u0, mask, axis=-2, batch=None, buckets=PowerOfTwoBuckets(),
            cut=lambda u, n: take_rows(u, n, -2),
        )  # fmt: skip


def _output(model: TransformerIDE, u0, mask):
    """`model(u0, mask)`: the solve and the output map, one program."""
    sol = solve(model, u0, args=mask)
    assert sol.ys is not None
    return model.output(sol.ys[-1]).astype(u0.dtype)


def _batch_output(model: TransformerIDE, u0, mask):
    """`model.batch(u0, mask)`: one solve over the batch and the output map, one program."""
    x = jnp.moveaxis(u0, model.batch_axis, 0)
    sol = solve(model, x, batched=True, args=mask)
    assert sol.ys is not None
    u = jax.vmap(model.output)(sol.ys[-1])
    return jnp.moveaxis(u.astype(u0.dtype), 0, model.batch_axis)


def _trajectory(model: TransformerIDE, u0, mask):
    """`model.trajectory(u0, mask)`: the solve saved at every layer boundary, one program."""
    ts = np.asarray(model.controls.layer_times())
    sol = solve(model, u0, saveat=diffrax.SaveAt(ts=ts), args=mask)
    assert sol.ys is not None
    return sol.ys.astype(u0.dtype)


def _moved(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """`shape` with `axis` moved to the front."""
    shape = tuple(shape)
    return (shape[axis], *shape[:axis], *shape[axis + 1 :])
