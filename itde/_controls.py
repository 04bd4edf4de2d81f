r"""Controls $\theta(t)$: the per-depth parameters of the equation."""

from __future__ import annotations

import abc
import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from ._blocks import AbstractBlockForm, as_block_form
from ._checks import check_bool, check_dtype, check_int, check_key
from ._operators._abstract import AbstractAttention, AbstractFeedForward, AbstractNorm
from ._operators._affine import FeatureAffine
from ._operators._attention import Attention, check_heads
from ._operators._feedforward import FeedForward, GatedFeedForward
from ._operators._layernorm import LayerNormProjection
from ._operators._rmsnorm import RMSNormProjection
from ._operators._rope import Rope
from ._operators._window import LayerWindow
from ._polynomials import legendre
from ._reads import map_parts, read_times, reads_at_end

#: The normalisations by name, for configs, the CLI and `Block.init(norm=...)`.
NORMS: dict[str, type[AbstractNorm]] = {
    "layer": LayerNormProjection,
    "rms": RMSNormProjection,
}
"""The normalisations by name, for configs, the CLI and `Block.init(norm=...)`."""


def as_norm_class(norm) -> type[AbstractNorm]:
    """A norm class from a class or a name of `NORMS` (the edge where a config's string
    becomes a module)."""
    if isinstance(norm, type) and issubclass(norm, AbstractNorm):
        return norm
    if isinstance(norm, str) and norm in NORMS:
        return NORMS[norm]
    raise ValueError(
        f"`norm`={norm!r} is not known; give a norm class (e.g. itde.RMSNormProjection) or "
        f"one of the names {list(NORMS)}."
    )


class AbstractBlock(eqx.Module):
    r"""The controls of one layer: an attention operator, the two normalisations and a
    feed-forward operator, $\theta_n = \{W^Q, W^K, W^V, W^O, S_1^{(1)}, W_1, b_1, W_2, b_2,
    S_1^{(2)}\}$.

    `norm1` is the normalisation that goes with the attention sub-flow and `norm2` the one
    that goes with the feed-forward: constraints after them in a post-norm equation, maps
    before them in a pre-norm one (see [`TransformerIDE`][itde.TransformerIDE]'s `block`).
    [`Block`][itde.Block] holds discrete kernels (matrices on one grid),
    [`FunctionBlock`][itde.FunctionBlock] kernel functions (any grid).

    `affine1`, `affine2`: optional extra vector fields
    ([`FeatureAffine`][itde.FeatureAffine]) added to the attention and the feed-forward
    sub-flow, acting on the state: the per-feature gains and shifts that the continuum form
    of a network keeps (see [`continuum_form`][itde.TransformerIDE.continuum_form]); None
    (no extra field) in every other model.

    `attention`: the attention operator $A$, kernels $W^Q, W^K, W^V, W^O$ per head and
    their biases ([`Attention`][itde.Attention], [`FunctionAttention`][itde.FunctionAttention]);
    `feedforward`: the feed-forward operator $F$, kernels $W_1, W_2$ (and a gate's $W_g$)
    and biases $b_1, b_2$ ([`FeedForward`][itde.FeedForward],
    [`GatedFeedForward`][itde.GatedFeedForward],
    [`FunctionFeedForward`][itde.FunctionFeedForward]).
    """

    attention: eqx.AbstractVar[AbstractAttention]
    norm1: eqx.AbstractVar[AbstractNorm]
    feedforward: eqx.AbstractVar[AbstractFeedForward]
    norm2: eqx.AbstractVar[AbstractNorm]
    affine1: eqx.AbstractVar[FeatureAffine | None]
    affine2: eqx.AbstractVar[FeatureAffine | None]

    def __check_init__(self):
        for name, base, what in (
            ("attention", AbstractAttention, "itde.Attention or itde.FunctionAttention"),
            ("norm1", AbstractNorm, "itde.LayerNormProjection or itde.RMSNormProjection"),
            ("feedforward", AbstractFeedForward, "itde.FeedForward, GatedFeedForward or "
             "FunctionFeedForward"),
            ("norm2", AbstractNorm, "itde.LayerNormProjection or itde.RMSNormProjection"),
            ("affine1", (FeatureAffine, type(None)), "itde.FeatureAffine or None"),
            ("affine2", (FeatureAffine, type(None)), "itde.FeatureAffine or None"),
        ):  # fmt: skip
            if not isinstance(getattr(self, name), base):
                raise TypeError(
                    f"`{type(self).__name__}.{name}` must be an {what}, got "
                    f"{type(getattr(self, name)).__name__}."
                )


class Block(AbstractBlock):
    r"""The discrete controls of one layer: kernels that are matrices on one grid's nodes
    (what a trained Transformer has).

    **Fields** (one layer's shapes; in [`PiecewiseConstant`][itde.PiecewiseConstant] every
    array has a leading layer axis):

    - `attention`: the attention operator $A$, an [`Attention`][itde.Attention]: `wq`
      `[heads, features, head_dim]`, `wk` `[kv_heads, features, head_dim]` and `wv`
      `[kv_heads, features, value_dim]` map the state to each head's queries, keys and
      values, `wo` `[heads, value_dim, features]` maps the heads back to the features.
    - `norm1`: the normalisation of the attention sub-flow
      ([`LayerNormProjection`][itde.LayerNormProjection] or
      [`RMSNormProjection`][itde.RMSNormProjection]): in a post-norm block the projection
      onto $S^{(1)}$ after attention; in a pre-norm or parallel block the map $N_1$
      applied to the state before attention reads it, $A(N_1 u)$.
    - `feedforward`: the feed-forward operator $F$, a [`FeedForward`][itde.FeedForward]
      (`w1` `[features, hidden]`, `w2` `[hidden, features]`) or a
      [`GatedFeedForward`][itde.GatedFeedForward].
    - `norm2`: the normalisation of the feed-forward sub-flow: the projection onto
      $S^{(2)}$ after the feed-forward (post-norm), or the map $N_2$ in $F(N_2 u)$
      (pre-norm, parallel).
    - `affine1`, `affine2`: None, or the [`FeatureAffine`][itde.FeatureAffine] vector
      fields $E(z) = (g - 1) \circ z + \beta$ that
      [`continuum_form`][itde.TransformerIDE.continuum_form] adds to the attention and to
      the feed-forward sub-flow, $z$ the normalised state: `affine1` with the gain and
      shift of the norm before this layer (the previous layer's `norm2`; for the first
      layer `continuum_form`'s `input_affine`, or $g = 1$, $\beta = 0$), `affine2` with
      those of this layer's `norm1`.
    - `out_norm1`, `out_norm2`: None, or the norms of the attention's and the
      feed-forward's outputs that a [`SandwichNorm`][itde.SandwichNorm] block reads
      (Gemma 2 and 3's `post_attention_layernorm`, `post_feedforward_layernorm`).
    - `window`: None, or this layer's sliding window as data
      ([`LayerWindow`][itde.LayerWindow]; `inf` for full attention): a depth-dependent
      control of the attention kernel (Gemma 2 and 3's `layer_types`), acting with the
      equation's own `window`, if any.
    - `rope`: None, or this layer's rotary embedding ([`Rope`][itde.Rope]), used instead of
      the equation's `rope` (Gemma 3's `rope_local_base_freq` in its sliding layers): a
      depth-dependent RoPE base.
    """

    attention: AbstractAttention
    norm1: AbstractNorm
    feedforward: AbstractFeedForward
    norm2: AbstractNorm
    affine1: FeatureAffine | None = None
    affine2: FeatureAffine | None = None
    out_norm1: AbstractNorm | None = None
    out_norm2: AbstractNorm | None = None
    window: LayerWindow | None = None
    rope: Rope | None = None

    def __check_init__(self):
        for name, base, what in (
            ("out_norm1", AbstractNorm, "itde.RMSNormProjection or itde.LayerNormProjection"),
            ("out_norm2", AbstractNorm, "itde.RMSNormProjection or itde.LayerNormProjection"),
            ("window", LayerWindow, "itde.LayerWindow(length)"),
            ("rope", Rope, "itde.Rope"),
        ):
            value = getattr(self, name)
            if value is not None and not isinstance(value, base):
                raise TypeError(
                    f"`Block.{name}` must be None or an {what}, got {type(value).__name__}."
                )

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        n_features: int,
        n_heads: int,
        n_hidden: int,
        activation: str = "relu",
        eps: float = 1e-5,
        bias: bool = True,
        norm: type[AbstractNorm] | str = "layer",
        gated: bool = False,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype=None,
        out_norms: bool = False,
    ) -> Block:
        """Random discrete controls for one layer (PyTorch's default initialisation).

        `norm`: a norm class or its name in `itde.NORMS`, identity-initialised
        (`"layer"`: [`LayerNormProjection`][itde.LayerNormProjection], with a shift when
        `bias`; `"rms"`: [`RMSNormProjection`][itde.RMSNormProjection]);
        `gated`: a [`GatedFeedForward`][itde.GatedFeedForward] (SwiGLU with
        `activation="silu"`); `n_kv_heads`, `head_dim`: see
        [`Attention.init`][itde.Attention.init]; `out_norms`: also `out_norm1`,
        `out_norm2` (identity-initialised, of the same kind), the norms of the sublayers'
        outputs that a [`SandwichNorm`][itde.SandwichNorm] block reads."""
        if head_dim is None:
            check_heads(n_features, n_heads)
        check_int("n_hidden", n_hidden, minimum=1)
        check_bool("bias", bias)
        check_bool("gated", gated)
        check_bool("out_norms", out_norms)
        norm_cls = as_norm_class(norm)
        dtype = check_dtype("dtype", dtype)
        check_key("key", key)
        ka, kf = jax.random.split(key)

        def make_norm():
            return norm_cls.identity(n_features, eps=eps, bias=bias, dtype=dtype)

        ff_cls = GatedFeedForward if gated else FeedForward
        return cls(
            Attention.init(
                ka, n_features, n_heads, bias=bias, n_kv_heads=n_kv_heads, head_dim=head_dim,
                dtype=dtype,
            ),
            make_norm(),
            ff_cls.init(kf, n_features, n_hidden, activation=activation, bias=bias, dtype=dtype),
            make_norm(),
            out_norm1=make_norm() if out_norms else None,
            out_norm2=make_norm() if out_norms else None,
        )


def _n_features(block) -> int | None:
    att = block.attention
    return att.wq.shape[-2] if isinstance(att, Attention) else None


BLOCK_PARTS = (
    "attention", "norm1", "feedforward", "norm2", "affine1", "affine2", "out_norm1",
    "out_norm2", "window", "rope",
)  # fmt: skip


def _part(block: AbstractBlock, part: str | None):
    """The whole block, or one of its four operators."""
    if part is None:
        return block
    if part not in BLOCK_PARTS:
        raise ValueError(f"`part`={part!r} is not a part of a Block; choose one of {BLOCK_PARTS}.")
    return getattr(block, part)


def stack(blocks: list[AbstractBlock]) -> AbstractBlock:
    """Stack per-layer controls along a new leading (depth) axis."""
    blocks = list(blocks)
    check_stackable(blocks)
    return _stack_leaves(blocks)


def check_stackable(blocks: list[AbstractBlock]) -> None:
    """Raise unless `blocks` is a non-empty list of controls with the same structure, options
    and shapes (what `stack` stacks)."""
    if not blocks:
        raise ValueError("`stack(blocks)` needs at least one block (layer or mode), got none.")
    for n, b in enumerate(blocks[1:], start=1):
        where = _first_difference(blocks[0], b)
        if where is not None:
            raise ValueError(
                f"`stack(blocks)`: layer {n} differs from layer 0 at {where}; every layer "
                "needs the same widths (n_features, n_heads, n_hidden), options (activation, "
                "eps) and the same biases to be stacked into per-layer controls."
            )


def _first_difference(a, b, path: str = "") -> str | None:
    """Where two blocks first differ in structure, a static option or an array's shape,
    as `field.subfield (this vs that)`; None when they stack."""
    name = path or "the block"
    if (a is None) != (b is None):
        return f"`{name}` ({'None' if a is None else 'set'} vs {'None' if b is None else 'set'})"
    if type(a) is not type(b) and not (hasattr(a, "shape") and hasattr(b, "shape")):
        return f"`{name}` ({type(a).__name__} vs {type(b).__name__})"
    if a is None:
        return None
    if hasattr(a, "shape") and hasattr(b, "shape"):
        return None if a.shape == b.shape else f"`{name}` (shape {a.shape} vs {b.shape})"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            sub = _first_difference(
                getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}".lstrip(".")
            )
            if sub is not None:
                return sub
        return None
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return f"`{name}` (length {len(a)} vs {len(b)})"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            sub = _first_difference(x, y, f"{path}[{i}]")
            if sub is not None:
                return sub
        return None
    return None if a == b else f"`{name}` ({a!r} vs {b!r})"


@eqx.filter_jit
def _stack_leaves(blocks):
    """Every leaf stacked, in one compiled program (op by op, each leaf's shape would
    compile a program of its own)."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)


@eqx.filter_jit
def _scale_and_stack(blocks, scales: tuple[float, ...]):
    """Mode c's block times `scales[c]`, stacked: one compiled program for every leaf."""
    return stack([jax.tree.map(lambda a: a * s, b) for b, s in zip(blocks, scales)])


class AbstractControls(eqx.Module):
    r"""The per-depth parameters $\theta(t)$ on $[t_0, t_1]$: a [`Block`][itde.Block] for
    every depth `t`.

    Subclasses say where they are defined (`t0`, `t1`), how they are evaluated
    (`__call__(t, side)`), and where they jump (`jump_times`): a fixed-step solve puts every
    jump on its step grid, so no step straddles a discontinuity of the controls.
    """

    @property
    @abc.abstractmethod
    def t0(self) -> float:
        """The depth at which the controls start."""

    @property
    @abc.abstractmethod
    def t1(self) -> float:
        """The depth up to which the controls are defined."""

    @abc.abstractmethod
    def __call__(self, t, side: str = "right", part: str | None = None) -> AbstractBlock:
        """The controls at depth `t`; at a jump, `side` picks the one-sided limit. `part`
        (`"attention"`, `"norm1"`, `"feedforward"` or `"norm2"`): only that operator of
        the block, the others not evaluated (a vector field reads one or two of them)."""

    @property
    @abc.abstractmethod
    def blocks(self) -> AbstractBlock:
        """The stored blocks (leading axis: layers or modes)."""

    @property
    @abc.abstractmethod
    def default_step(self) -> float:
        """The depth step of a solve that does not name one."""

    def jump_times(self) -> tuple[float, ...]:
        """Interior depths where the controls are discontinuous (none by default)."""
        return ()

    #: True when the controls are constant between consecutive `jump_times` (per-layer
    #: controls): then `itde.solve` makes every stage of a step read the step's own
    #: piece (`itde_solvers.FrozenTime`), which is exact for them.
    constant_between_jumps: ClassVar[bool] = False

    @property
    def n_layers(self) -> int:
        raise TypeError(
            f"{type(self).__name__} are smooth in depth and have no layers; use "
            "PiecewiseConstant controls for a per-layer model, or save the states at chosen "
            "depths with `itde.solve(model, u0, saveat=diffrax.SaveAt(ts=...))`."
        )

    @property
    def n_features(self) -> int | None:
        """The discrete kernels' feature count (None for function kernels)."""
        return _n_features(self.blocks)

    def map_blocks(self, fn) -> AbstractControls:
        """The same controls with `fn` applied to every stored block."""
        blocks = _unstack(self.blocks)
        return eqx.tree_at(lambda c: c.blocks, self, stack([fn(b) for b in blocks]))


def _check_blocks(name: str, blocks) -> None:
    """Stored blocks: a Block (or FunctionBlock) whose array leaves share a leading axis."""
    leaves = jax.tree.leaves(blocks)
    if blocks is None or not leaves or not all(hasattr(a, "shape") for a in leaves):
        raise TypeError(
            f"`{name}` must be a Block (or FunctionBlock) whose arrays have a leading layer or "
            f"mode axis, e.g. `itde.stack([Block.init(...), ...])`; got {type(blocks).__name__}."
        )
    if any(a.ndim == 0 for a in leaves) or len({a.shape[0] for a in leaves}) != 1:
        raise ValueError(
            f"`{name}`: every array must have the same leading (layer or mode) axis; build it "
            "with `itde.stack([...])`."
        )


def check_layering(t0: float, layer_length: float) -> None:
    """Layers start at a finite `t0` and have a finite positive depth length."""
    if not (math.isfinite(t0) and math.isfinite(layer_length)):
        raise ValueError(f"`t0`={t0} and `layer_length`={layer_length} must be finite.")
    if not layer_length > 0:
        raise ValueError(f"`layer_length`={layer_length} must be > 0, e.g. 1.0.")


def _unstack(values: AbstractBlock) -> list[AbstractBlock]:
    n = int(jax.tree.leaves(values)[0].shape[0])
    return [jax.tree.map(lambda a: a[i], values) for i in range(n)]


class PiecewiseConstant(AbstractControls):
    r"""Controls constant on each layer interval $[t_n, t_{n+1})$, $t_n = t_0 + n\,h$.

    This is what a trained discrete Transformer gives: one set of controls per layer.
    Evaluation at a time $t$ picks the interval the calling substep acts on: a vector
    field, evaluated at the start of its step, uses the interval to the right of $t$
    (`side="right"`); a projection, applied at the end of its step, uses the interval
    to the left (`side="left"`), so that with $\Delta t = h$ every substep of step $n$
    uses layer $n$'s controls, "frozen at $t_n$" as in the paper.

    **Arguments:**

    - `values`: a [`Block`][itde.Block] whose array leaves have a leading layer axis.
    - `t0`: the depth at which layer 0 starts.
    - `layer_length`: the depth length $h$ of each layer (1 for the standard Transformer).
    """

    values: AbstractBlock
    t0: float = eqx.field(static=True, default=0.0)
    layer_length: float = eqx.field(static=True, default=1.0)
    constant_between_jumps: ClassVar[bool] = True

    def __check_init__(self):
        _check_blocks("values", self.values)
        check_layering(self.t0, self.layer_length)

    @property
    def blocks(self) -> AbstractBlock:
        return self.values

    @property
    def n_layers(self) -> int:
        return int(jax.tree.leaves(self.values)[0].shape[0])

    @property
    def t1(self) -> float:
        return self.t0 + self.n_layers * self.layer_length

    @property
    def default_step(self) -> float:
        """One layer per step: the discrete Transformer."""
        return self.layer_length

    def layer_times(self) -> tuple[float, ...]:
        r"""$t_0, t_1, \dots, t_L$: where each layer starts, and the end of the last."""
        return tuple(self.t0 + n * self.layer_length for n in range(self.n_layers + 1))

    def jump_times(self) -> tuple[float, ...]:
        r"""The interior layer boundaries $t_1, \dots, t_{L-1}$."""
        return self.layer_times()[1:-1]

    def index(self, t, side: str = "right") -> Float[Array, ""]:
        t = jnp.asarray(t)
        t = t.astype(jnp.promote_types(t.dtype, jnp.float32))
        s = (t - self.t0) / self.layer_length
        # Times within a few ulps of a layer boundary count as on the boundary.
        tol = 64 * jnp.finfo(s.dtype).eps * jnp.maximum(1.0, jnp.abs(s))
        s = jnp.where(jnp.abs(s - jnp.round(s)) < tol, jnp.round(s), s)
        i = jnp.floor(s) if side == "right" else jnp.ceil(s) - 1
        return jnp.clip(i, 0, self.n_layers - 1).astype(jnp.int32)

    def __call__(self, t, side: str = "right", part: str | None = None) -> AbstractBlock:
        i = self.index(t, side)
        # lax's own dynamic index: `a[i]` goes through jnp's indexing rewrite, which costs
        # milliseconds of tracing per leaf and per evaluation
        return jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False),
            _part(self.values, part),
        )

    def layer(self, n: int) -> AbstractBlock:
        """The controls of layer `n` (0-based)."""
        n = check_int("n", n, minimum=0)
        if n >= self.n_layers:
            raise ValueError(
                f"`n`={n} is not a layer: the model has {self.n_layers} (0 to {self.n_layers - 1})."
            )
        return jax.tree.map(lambda a: a[n], self.values)


def layers_and_form(name: str, layers, block, where: str):
    """`(controls, block form)` of a fit through a network's layers, from the network
    itself (an equation: its per-layer controls and its block form) or from its
    `PiecewiseConstant` controls and an explicit `block`. The fit reads each part where
    the block form's scheme reads it, so it must know the form: per-layer controls do not
    carry it, and a default would fit another network's reads (a post-norm fit of a
    pre-norm model's norms is off by O(1) with no warning)."""
    form = getattr(layers, "block", None)
    if isinstance(form, AbstractBlockForm) and hasattr(layers, "controls"):
        if block is not None and as_block_form(block).projected_parts != form.projected_parts:
            raise ValueError(
                f"`{where}({name}=...)` was given a model whose block form is "
                f"{type(form).__name__}, and `block`={block!r}, which reads the norms at "
                "other depths: the fit is the model's own only with its own block form. "
                f"Omit `block` (it is taken from the model), or pass the controls "
                f"`{name}.controls` with the block you mean."
            )
        check_layers(name, layers.controls, where)
        return layers.controls, form
    check_layers(name, layers, where)
    if block is None:
        raise TypeError(
            f"`{where}({name}=...)` needs the block form the fit is for: the scheme reads a "
            "post-norm block's norms at the layer ends and a pre-norm or parallel block's at "
            "the starts, and per-layer controls do not say which. Pass the model itself "
            f"(`{where}(m)`, which reads `m.block`) or `block=m.block` (e.g. "
            "block=itde.PreNorm())."
        )
    return layers, as_block_form(block)


def check_layers(name: str, controls, where: str) -> None:
    """A fit through layers needs per-layer controls."""
    if not isinstance(controls, PiecewiseConstant):
        raise TypeError(
            f"`{where}({name}=...)` fits through a network's layers and needs "
            f"itde.PiecewiseConstant controls (e.g. `model.controls` of a per-layer model), "
            f"got {type(controls).__name__}."
        )


class LegendreControls(AbstractControls):
    r"""Controls smooth in depth: every parameter is a Legendre series in $t$,
    $\theta(t) = \sum_{c<C} \theta_c\, P_c(2 (t - t_0)/(t_1 - t_0) - 1)$.

    The kernels, biases and the constraint set $S_1(\sigma_1(t), \sigma_2(t))$ all move
    smoothly, so the continuum limit $\Delta t \to 0$ is well posed and the integrators
    show their orders. The same `TransformerIDE` holds either these or
    [`PiecewiseConstant`][itde.PiecewiseConstant] controls.

    **Arguments:**

    - `coeffs`: a [`Block`][itde.Block] whose array leaves have a leading mode axis $C$.
    - `t0`, `t1`: the depth interval on which the series is defined.
    """

    coeffs: AbstractBlock
    t0: float = eqx.field(static=True, default=0.0)
    t1: float = eqx.field(static=True, default=1.0)

    def __check_init__(self):
        _check_blocks("coeffs", self.coeffs)
        if not self.t1 > self.t0:
            raise ValueError(f"`LegendreControls`: need t1 > t0, got t0={self.t0}, t1={self.t1}.")

    @property
    def blocks(self) -> AbstractBlock:
        return self.coeffs

    @property
    def n_modes(self) -> int:
        return int(jax.tree.leaves(self.coeffs)[0].shape[0])

    @property
    def default_step(self) -> float:
        """The whole interval in one step (name a `dt0` to refine)."""
        return self.t1 - self.t0

    def __call__(self, t, side: str = "right", part: str | None = None) -> AbstractBlock:
        del side  # continuous in t: both one-sided limits agree
        # the series is summed in float32 or wider whatever the parameters' dtype: in
        # bfloat16 the depth itself (and P_c) would carry a relative error of 4e-3
        t = jnp.asarray(t)
        wide = jnp.promote_types(t.dtype, jnp.float32)
        s = 2.0 * (t.astype(wide) - self.t0) / (self.t1 - self.t0) - 1.0
        p = legendre(s, self.n_modes)

        def series(c):
            w = jnp.promote_types(c.dtype, jnp.float32)
            return jnp.tensordot(p.astype(w), c.astype(w), axes=1).astype(c.dtype)

        return jax.tree.map(series, _part(self.coeffs, part))

    @classmethod
    def from_layers(cls, layers, n_modes: int | None = None, *, block=None) -> LegendreControls:
        r"""Smooth controls through a network's layers: every parameter's Legendre series
        of degree `n_modes - 1`, fitted by least squares to its layer values at the depths
        the scheme reads them.

        One Lie step per layer reads layer $n$'s operators (attention, feed-forward, every
        part but the projections) at the step's start $t_n$ and its projections (the
        block form's `projected_parts`: post-norm's `norm1`, `norm2`) at the step's end
        $t_{n+1}$. So the operators are fitted at $t_0, \dots, t_{L-1}$ and the
        projections at $t_1, \dots, t_L$ (pre-norm and parallel blocks read their norms
        inside the operators, at the starts). With `n_modes` $= L$ the series interpolates
        and `TransformerIDE(LegendreControls.from_layers(m), m.grid, block=m.block)`
        solved by Lie with `dt0` one layer is the network `m`, to round-off; fewer modes
        smooth it (see `itde.fit_residuals`).

        **Arguments:**

        - `layers`: the network, a [`TransformerIDE`][itde.TransformerIDE] with
          per-layer controls (its block form is used), or its
          [`PiecewiseConstant`][itde.PiecewiseConstant] controls (then `block` is
          required: controls do not know the block form, and there is no default).
        - `n_modes`: the number of Legendre modes, 1 to the number of layers $L$
          (default $L$: interpolation).
        - `block`: with controls, the block form the smooth model will be solved with (an
          instance or a name of `itde.BLOCK_FORMS`, e.g. `m.block`); with a model, omit it.

        **Returns:** `LegendreControls` on the layers' interval $[t_0, t_L]$.
        """
        controls, form = layers_and_form("layers", layers, block, "LegendreControls.from_layers")
        L = controls.n_layers
        n_modes = L if n_modes is None else check_int("n_modes", n_modes)
        if not 1 <= n_modes <= L:
            raise ValueError(
                f"`n_modes`={n_modes} must be between 1 and the {L} layers (a least-squares "
                f"fit through {L} values has at most {L} modes); e.g. n_modes={L}."
            )
        t0, t1 = controls.t0, controls.t1

        def fit_part(name, part):
            ts = read_times(t0, controls.layer_length, L, reads_at_end(form, name))
            V = np.polynomial.legendre.legvander(2.0 * (ts - t0) / (t1 - t0) - 1.0, n_modes - 1)
            pinv = np.linalg.pinv(V)  # [modes, L], float64

            def fit(a):
                w = jnp.promote_types(a.dtype, jnp.float32)
                return jnp.tensordot(jnp.asarray(pinv, w), a.astype(w), axes=1).astype(a.dtype)

            return jax.tree.map(fit, part)

        return cls(map_parts(controls.values, fit_part), t0, t1)

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        n_modes: int,
        block_init=None,
        t1: float = 1.0,
        amplitude: float = 0.3,
        sigma1: tuple[float, ...] = (0.0, 0.2),
        sigma2: tuple[float, ...] = (1.0, 0.3),
        **block_kwargs,
    ) -> LegendreControls:
        """Random smooth controls: a random block for mode 0, random blocks scaled by
        `amplitude / c**2` for modes $c \\ge 1$, and the constraint set moving as the
        Legendre series with coefficients `sigma1`, `sigma2` (no per-feature affine map,
        so the constraint set is exactly $S_1(\\sigma_1(t), \\sigma_2(t))$; with
        `norm="rms"` the sphere of radius $\\sigma_2(t)$).
        `block_init` (default `Block.init`, or e.g. `FunctionBlock.init`) builds each
        mode's block from `key` and `block_kwargs`."""
        n_modes = check_int("n_modes", n_modes, minimum=1)
        s2 = [float(v) for v in sigma2[:n_modes]]
        if not s2 or s2[0] <= sum(abs(v) for v in s2[1:]):
            raise ValueError(
                f"`sigma2`={tuple(sigma2)} must keep sigma2(t) > 0 on the whole depth: the "
                "first coefficient must exceed the sum of the others' magnitudes (|P_c| <= 1), "
                "e.g. sigma2=(1.0, 0.3). sigma2 <= 0 is no constraint set (the projection "
                "would map every state to sigma1 or to the farthest point)."
            )
        keys = jax.random.split(key, n_modes)
        make = Block.init if block_init is None else block_init
        scales = tuple(1.0 if c == 0 else amplitude / c**2 for c in range(n_modes))
        coeffs = _scale_and_stack([make(k, **block_kwargs) for k in keys], scales)

        def sig(vals):
            v = jnp.zeros((n_modes,), jax.tree.leaves(coeffs.attention)[0].dtype)
            return v.at[: min(len(vals), n_modes)].set(jnp.asarray(vals[:n_modes], v.dtype))

        # the exact set of the block's norm class, moving as the series sigma1, sigma2
        # (for the sphere of RMSNorm: radius sigma2(t))
        norm = as_norm_class(block_kwargs.get("norm", "layer")).exact(sig(sigma1), sig(sigma2))
        coeffs = eqx.tree_at(lambda b: (b.norm1, b.norm2), coeffs, (norm, norm))
        return cls(coeffs, 0.0, float(t1))
