r"""Controls $\theta(t)$: the per-depth parameters of the equation."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from ._attention import Attention, check_heads
from ._feedforward import FeedForward
from ._layernorm import LayerNormProjection


class Block(eqx.Module):
    r"""The controls of one layer: attention kernels, the two constraint sets and the
    feed-forward kernels, $\theta_n = \{W^Q, W^K, W^V, W^O, S_1^{(1)}, W_1, b_1, W_2, b_2,
    S_1^{(2)}\}$."""

    attention: Attention
    norm1: LayerNormProjection
    feedforward: FeedForward
    norm2: LayerNormProjection

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
        dtype=None,
    ) -> Block:
        """Random discrete controls for one layer (PyTorch's default initialisation)."""
        check_heads(n_features, n_heads)
        dtype = dtype or jnp.zeros(()).dtype
        ka, kf = jax.random.split(key)

        def norm():
            ones, zeros = jnp.ones((n_features,), dtype), jnp.zeros((n_features,), dtype)
            return LayerNormProjection(
                jnp.zeros((), dtype), jnp.ones((), dtype), ones, zeros if bias else None, eps
            )

        return cls(
            Attention.init(ka, n_features, n_heads, bias=bias, dtype=dtype),
            norm(),
            FeedForward.init(
                kf, n_features, n_hidden, activation=activation, bias=bias, dtype=dtype
            ),
            norm(),
        )


def stack(blocks: list[Block]) -> Block:
    """Stack per-layer controls along a new leading (depth) axis."""
    structures = {jax.tree_util.tree_structure(b) for b in blocks}
    if len(structures) != 1:
        raise ValueError(
            "every layer must have the same structure (activation, eps, which biases exist) "
            "to be stacked into piecewise-constant controls."
        )
    return jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)


class PiecewiseConstant(eqx.Module):
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
    - `width`: the depth length $h$ of each layer (1 for the standard Transformer).
    """

    values: Block
    t0: float = eqx.field(static=True, default=0.0)
    width: float = eqx.field(static=True, default=1.0)

    @property
    def n_layers(self) -> int:
        return int(jax.tree.leaves(self.values)[0].shape[0])

    @property
    def t1(self) -> float:
        return self.t0 + self.n_layers * self.width

    def index(self, t, side: str = "right") -> Float[Array, ""]:
        s = (jnp.asarray(t) - self.t0) / self.width
        # Times within a few ulps of a layer boundary count as on the boundary.
        tol = 64 * jnp.finfo(s.dtype).eps * jnp.maximum(1.0, jnp.abs(s))
        s = jnp.where(jnp.abs(s - jnp.round(s)) < tol, jnp.round(s), s)
        i = jnp.floor(s) if side == "right" else jnp.ceil(s) - 1
        return jnp.clip(i, 0, self.n_layers - 1).astype(jnp.int32)

    def __call__(self, t, side: str = "right") -> Block:
        i = self.index(t, side)
        return jax.tree.map(lambda a: a[i], self.values)

    def layer(self, n: int) -> Block:
        return jax.tree.map(lambda a: a[n], self.values)
