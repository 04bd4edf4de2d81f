"""Resolution-independent models: per-layer (or smooth-in-depth) blocks of function kernels,
sampled on any token × feature grid."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import PRNGKeyArray

from .._checks import check_dtype, check_int
from .._controls import AbstractBlock, as_norm_class
from .._operators._abstract import AbstractNorm
from .._quadrature._rules import AbstractQuadrature
from ._bases import AbstractBasis
from ._operators import FunctionAttention, FunctionFeedForward


class FunctionBlock(AbstractBlock):
    r"""One layer's controls as functions: attention and feed-forward kernels
    $W(\xi, y)$ on the feature, head and hidden domains, and two normalisations onto
    sets with scalar parameters (e.g. $S_1(\sigma_1, \sigma_2)$, no per-feature affine
    map, so they mean the same on every grid).

    The model samples the kernels at the grid's nodes at every evaluation, so the same
    object runs on any grid (`TransformerIDE.on_grid`).

    **Fields** (one layer's shapes; stacked in controls, every coefficient array has a
    leading layer or mode axis):

    - `attention`: a [`FunctionAttention`][itde.FunctionAttention], the kernels
      $W^{Q,K,V}_m(\xi, \eta)$ from $\Omega_y$ to the head domain $\Omega_h$ and
      $W^O_m(\eta, y)$ back, with coefficients `[heads, M_y, M_h]` and `[heads, M_h, M_y]`.
    - `norm1`: the normalisation of the attention sub-flow (the projection onto $S^{(1)}$
      after attention in a post-norm block, the map $N_1$ in $A(N_1 u)$ in a pre-norm or
      parallel one), with scalar parameters only.
    - `feedforward`: a [`FunctionFeedForward`][itde.FunctionFeedForward], the kernels
      $W_1(\xi, z)$ from $\Omega_y$ to the hidden domain $\Omega_z$ and $W_2(z, y)$ back.
    - `norm2`: the normalisation of the feed-forward sub-flow (the projection onto
      $S^{(2)}$ after it, or $N_2$ in $F(N_2 u)$), scalar parameters only.
    - `affine1`, `affine2`: always None: the per-feature fields of
      [`Block`][itde.Block]'s continuum form exist on one feature grid only.
    """

    attention: FunctionAttention
    norm1: AbstractNorm
    feedforward: FunctionFeedForward
    norm2: AbstractNorm
    affine1: None = None
    affine2: None = None

    def __check_init__(self):
        for name in ("norm1", "norm2"):
            norm = getattr(self, name)
            if isinstance(norm, AbstractNorm) and (
                norm.gain is not None or norm.shift is not None
            ):
                raise ValueError(
                    f"`FunctionBlock.{name}` has a per-feature gain or shift, which exists on "
                    "one feature grid only; give a norm with scalar parameters, e.g. "
                    "`LayerNormProjection.scalar(0.0, 1.0, eps=...)`."
                )

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        n_heads: int,
        feature_basis: AbstractBasis,
        head_basis: AbstractBasis,
        hidden_basis: AbstractBasis,
        head_rule: AbstractQuadrature,
        n_head_nodes: int,
        hidden_rule: AbstractQuadrature,
        n_hidden_nodes: int,
        activation: str = "gelu",
        eps: float = 0.0,
        norm: type[AbstractNorm] | str = "layer",
        scale: float = 1.0,
        decay: float = 0.7,
        dtype=None,
    ) -> FunctionBlock:
        """Random smooth kernels and the unit constraint set of `norm` (a norm class or
        its name in `itde.NORMS`: $S_1(0, 1)$ for `"layer"`, the unit sphere for `"rms"`)
        with regulariser `eps`."""
        check_int("n_heads", n_heads, minimum=1)
        check_int("n_head_nodes", n_head_nodes, minimum=1)
        check_int("n_hidden_nodes", n_hidden_nodes, minimum=1)
        for name, b in (("feature_basis", feature_basis), ("head_basis", head_basis),
                        ("hidden_basis", hidden_basis)):  # fmt: skip
            if not isinstance(b, AbstractBasis):
                raise TypeError(
                    f"`{name}` must be a basis (itde.LegendreBasis or itde.FourierBasis), got "
                    f"{type(b).__name__}."
                )
        dtype = check_dtype("dtype", dtype)
        ka, kf = jax.random.split(key)
        att = FunctionAttention.init(
            ka,
            n_heads=n_heads,
            feature_basis=feature_basis,
            head_basis=head_basis,
            head_rule=head_rule,
            n_head_nodes=n_head_nodes,
            scale=scale,
            decay=decay,
            dtype=dtype,
        )
        ff = FunctionFeedForward.init(
            kf,
            feature_basis=feature_basis,
            hidden_basis=hidden_basis,
            hidden_rule=hidden_rule,
            n_hidden_nodes=n_hidden_nodes,
            activation=activation,
            scale=scale,
            decay=decay,
            dtype=dtype,
        )
        n = as_norm_class(norm).scalar(jnp.zeros((), dtype), jnp.ones((), dtype), eps=eps)
        return cls(att, n, ff, n)


def with_resolution(
    controls, *, n_head_nodes=None, n_hidden_nodes=None, head_rule=None, hidden_rule=None
):
    """The same function-kernel controls with other head / hidden quadratures."""

    def change(block: FunctionBlock) -> FunctionBlock:
        att, ff = block.attention, block.feedforward
        att = dataclasses.replace(
            att,
            n_head_nodes=att.n_head_nodes if n_head_nodes is None else n_head_nodes,
            head_rule=att.head_rule if head_rule is None else head_rule,
        )
        ff = dataclasses.replace(
            ff,
            n_hidden_nodes=ff.n_hidden_nodes if n_hidden_nodes is None else n_hidden_nodes,
            hidden_rule=ff.hidden_rule if hidden_rule is None else hidden_rule,
        )
        return FunctionBlock(att, block.norm1, ff, block.norm2)

    return controls.map_blocks(change)
