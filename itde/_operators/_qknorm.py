r"""Query/key normalisation: the projection of the queries and keys onto their constraint
sets inside the attention operator.

Some decoders (Qwen3, Gemma 3, OLMo 2, OLMoE) normalise the queries and keys after their
projections and before RoPE: $Q_m = g^Q \circ P(W^Q_m u)$, $K_m = g^K \circ P(W^K_m u)$,
where $P$ is RMSNorm's projection onto a sphere ([`RMSNormProjection`][itde.RMSNormProjection])
and $g^Q, g^K$ its learned per-feature gains. The constraint set is a sphere of one of two
domains, and each is a module here:

- [`PerHeadQKNorm`][itde.PerHeadQKNorm]: each head's query (key) on the sphere of
  $\Omega_h$, the head's own domain of `head_dim` features, one gain of `[head_dim]` shared by
  the heads (Qwen3, Gemma 3: `q_norm`/`k_norm` over `head_dim`);
- [`JointQKNorm`][itde.JointQKNorm]: all the heads' queries (keys) of a token together on
  the sphere of $\Omega_h^{h}$, the whole projection of `heads * head_dim` features, one gain
  of that size (OLMo 2, OLMoE: over `num_heads * head_dim`, before the split into heads).

As an operator this is part of $A(u)$, not a constraint on the state: the scores
$s_m = \langle Q_m, K_m\rangle / \sqrt{d_\mathrm{head}}$ are then bounded by
$|g^Q|\,|g^K|\,\sqrt{d_\mathrm{head}}$ (each factor on its sphere). With $\varepsilon > 0$
the map is smooth in $u$, so the attention stays a smooth operator of the state: every
depth solver (splittings, projected explicit Runge-Kutta, adaptive steps) and the continuum
form ([`itde.continuum_form`][itde.continuum_form], which folds the block norms' gains into
the attention's *input* weights, ahead of this map) accept it unchanged. With
$\varepsilon = 0$ a zero query has no projection (RMSNormProjection's runtime error). It
belongs to a discrete [`Attention`][itde.Attention] (`Attention(..., qk_norm=...)`): the
function-space attention (`itde.function`) has none, and a discrete attention with it is
written to PyTorch's `nn.MultiheadAttention` by no one (`itde.to_torch` refuses it by name).

`QK_NORMS` maps the names (`"per_head"`, `"joint"`) to the classes.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from ._rmsnorm import RMSNormProjection


class AbstractQueryKeyNorm(eqx.Module):
    r"""The projection of an attention's queries and keys onto their constraint sets (after
    the projections $W^Q, W^K$ and their biases, before RoPE): `q_norm` acts on the
    queries, `k_norm` on the keys, each an [`RMSNormProjection`][itde.RMSNormProjection]
    (with its gain). A subclass says over which domain: `gain_size` and `__call__`."""

    q_norm: eqx.AbstractVar[RMSNormProjection]
    k_norm: eqx.AbstractVar[RMSNormProjection]

    @staticmethod
    @abc.abstractmethod
    def gain_size(heads: int, head_dim: int) -> int:
        """The number of features each norm (of `heads` heads of `head_dim`) acts on."""

    @abc.abstractmethod
    def __call__(
        self,
        q: Float[Array, "heads tokens head_dim"],
        k: Float[Array, "kv_heads tokens head_dim"],
    ) -> tuple[Float[Array, "heads tokens head_dim"], Float[Array, "kv_heads tokens head_dim"]]:
        """The normalised queries and keys (same shapes)."""

    @classmethod
    def identity(
        cls, n_heads: int, n_kv_heads: int, head_dim: int, *, eps: float = 1e-6, dtype=None
    ) -> AbstractQueryKeyNorm:
        """The norms as a fresh network holds them: unit spheres, gains of ones."""
        return cls(
            RMSNormProjection.identity(cls.gain_size(n_heads, head_dim), eps=eps, dtype=dtype),
            RMSNormProjection.identity(cls.gain_size(n_kv_heads, head_dim), eps=eps, dtype=dtype),
        )

    def check_shapes(self, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        """Raise `ValueError` unless the gains fit an attention of these head counts and
        size (called by [`Attention`][itde.Attention] when built)."""
        for which, norm, heads in (("q_norm", self.q_norm, n_heads),
                                   ("k_norm", self.k_norm, n_kv_heads)):  # fmt: skip
            if not isinstance(norm, RMSNormProjection):
                raise TypeError(
                    f"`{type(self).__name__}.{which}` must be an itde.RMSNormProjection, got "
                    f"{type(norm).__name__}."
                )
            size = self.gain_size(heads, head_dim)
            gain = norm.gain
            if gain is not None and gain.shape[-1:] != (size,):
                raise ValueError(
                    f"`{type(self).__name__}.{which}.gain` has shape {gain.shape}, expected "
                    f"[{size}] for {heads} heads of {head_dim} features; PerHeadQKNorm "
                    "normalises each head over head_dim, JointQKNorm a token's whole "
                    "projection over heads * head_dim."
                )

    def scale_queries(self, factor: float) -> AbstractQueryKeyNorm:
        """The same norms with the queries' gain multiplied by `factor`: a score scaling
        other than $1/\\sqrt{d_\\mathrm{head}}$ folded into the queries (folding it into
        $W^Q$ would be undone by the projection)."""
        if factor == 1.0:  # exact: 1.0 is the number a family passes when nothing is folded
            return self
        q = self.q_norm
        if q.gain is None:  # the sphere's radius carries it
            return type(self)(RMSNormProjection(q.sigma * factor, None, q.eps), self.k_norm)
        return type(self)(RMSNormProjection(q.sigma, q.gain * factor, q.eps), self.k_norm)


class PerHeadQKNorm(AbstractQueryKeyNorm):
    r"""Each head's query and key projected onto the sphere of its own $d_\mathrm{head}$
    features, then the gain (`[head_dim]`, shared by the heads): Qwen3's and Gemma 3's
    `q_norm`/`k_norm`, applied to `q_proj(x).view(..., heads, head_dim)`."""

    q_norm: RMSNormProjection
    k_norm: RMSNormProjection

    @staticmethod
    def gain_size(heads: int, head_dim: int) -> int:
        return head_dim

    def __call__(self, q, k):
        return self.q_norm(q), self.k_norm(k)


class JointQKNorm(AbstractQueryKeyNorm):
    r"""A token's queries of every head, side by side (`heads * head_dim` features, the
    whole projection $W^Q u$), projected onto one sphere, then the gain
    (`[heads * head_dim]`); the keys likewise over `kv_heads * head_dim`: OLMo 2's and
    OLMoE's `q_norm`/`k_norm`, applied to `q_proj(x)` before the split into heads."""

    q_norm: RMSNormProjection
    k_norm: RMSNormProjection

    @staticmethod
    def gain_size(heads: int, head_dim: int) -> int:
        return heads * head_dim

    def __call__(self, q, k):
        return _joint(self.q_norm, q), _joint(self.k_norm, k)


def _joint(norm, x):
    """`norm` over the heads and features of each token of `x` (`[heads, tokens, size]`)."""
    h, n, e = x.shape
    flat = jnp.moveaxis(x, 0, 1).reshape(n, h * e)
    return jnp.moveaxis(norm(flat).reshape(n, h, e), 1, 0)


QK_NORMS: dict[str, type[AbstractQueryKeyNorm]] = {
    "per_head": PerHeadQKNorm,
    "joint": JointQKNorm,
}
"""Query/key normalisations by name: `"per_head"` -> `PerHeadQKNorm` (Qwen3, Gemma 3),
`"joint"` -> `JointQKNorm` (OLMo 2, OLMoE)."""
