r"""Score-bias kernels $b_m(x, \tilde x)$: added to the attention scores of head $m$.

$$\gamma_m(x, \tilde x) \propto e^{s_m(x, \tilde x) + b_m(x, \tilde x)}.$$

A bias that is a function of the positions ([`ALiBi`][], [`T5RelativeBias`][], both of
$x - \tilde x$) is sampled on any grid: [`AbstractScoreBias.on_nodes`][] binds it to a
grid's token nodes and returns a function of the token indices, which the attention
cores (`score_bias=`) evaluate one block at a time, so the blocked core never forms a
`tokens × tokens` array. A [`DiscreteBias`][] is a fixed `[heads, N, N]` array (one
resolution only). Positions are measured in units of `spacing` (default 1, the unit
grid's token spacing, where the biases equal the discrete models' ones).
"""

from __future__ import annotations

import abc
import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._random import normal
from .._roles import kernel


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
    return int(value)


def _check_spacing(spacing):
    if isinstance(spacing, bool) or not isinstance(spacing, (int, float)):
        raise TypeError(f"`spacing` must be a positive number, got {spacing!r}.")
    if not (math.isfinite(spacing) and spacing > 0):
        raise ValueError(f"`spacing` must be finite and positive, got {spacing!r}.")
    return float(spacing)


class AbstractScoreBias(eqx.Module):
    r"""A score bias $b_m(x, \tilde x)$ for `n_heads` heads, added to every head's score.

    The attention cores take a bias as a function of the token indices
    `(query_index, key_index) -> [heads, q, k]`; [`on_nodes`][] gives that function for a
    grid's token nodes. `needs_positions`: whether the bias is a function of the token
    positions (then the token domain must be a 1-D rule) or a fixed array of one
    resolution."""

    needs_positions: ClassVar[bool] = True

    @property
    @abc.abstractmethod
    def n_heads(self) -> int:
        """The number of heads the bias has a value for."""

    @abc.abstractmethod
    def on_nodes(self, nodes):
        """The bias on the token nodes `nodes` (`[tokens]`), as the function of the token
        indices that the attention cores take as `score_bias`."""


class AbstractPositionBias(AbstractScoreBias):
    r"""A score bias that is a function of the positions, sampled on any grid."""

    @abc.abstractmethod
    def __call__(
        self, x: Float[Array, " q"], x_tilde: Float[Array, " k"]
    ) -> Float[Array, "heads q k"]:
        """The bias at query positions `x` and key positions `x_tilde`."""

    def on_nodes(self, nodes) -> SampledBias:
        return SampledBias(self, jnp.asarray(nodes))


class SampledBias(eqx.Module):
    """A position bias bound to token nodes: `(query_index, key_index) -> [heads, q, k]`."""

    bias: AbstractPositionBias
    nodes: Float[Array, " tokens"]

    def __call__(self, query_index: Int[Array, " q"], key_index: Int[Array, " k"]):
        return self.bias(self.nodes[query_index], self.nodes[key_index])


def alibi_slopes(n_heads: int) -> np.ndarray:
    """The ALiBi head slopes of Press, Smith and Lewis (2022), as in their code and in
    Hugging Face's BLOOM: $2^{-8k/n}$, $k = 1..n$, for $n$ a power of two; otherwise those
    of the nearest lower power of two followed by every other slope of the next one."""
    n = _check_positive_int("n_heads", n_heads)

    def power_of_two(m):
        start = 2.0 ** (-(2.0 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if n & (n - 1) == 0:  # a power of two, decided in integers
        return np.asarray(power_of_two(n))
    closest = 1 << (n.bit_length() - 1)  # the largest power of two below n
    extra = alibi_slopes(2 * closest)[0::2][: n - closest]
    return np.concatenate([power_of_two(closest), extra])


class ALiBi(AbstractPositionBias):
    r"""Attention with linear biases (Press, Smith and Lewis 2022):
    $b_m(x, \tilde x) = -\mu_m\,|x - \tilde x| / \ell$, with the slopes $\mu_m$ of
    [`alibi_slopes`][] and the length unit $\ell$ = `spacing`. Causal attention sees only
    $\tilde x \le x$, where this is the paper's $-\mu_m (x - \tilde x)$ (Hugging Face
    adds $\mu_m \tilde x$ instead, which differs by a constant per query and gives the same
    softmax). Lipschitz in $x - \tilde x$ (a kink at $x = \tilde x$, which non-causal
    attention integrates across).

    **Fields:** `slopes`: the per-head slopes $\mu_m > 0$, `[heads]`, which multiply the
    distance $-|x - \tilde x| / \ell$ (`ALiBi.init` gives `alibi_slopes(n_heads)`);
    `spacing`: the length unit $\ell$."""

    slopes: Float[Array, " heads"]
    spacing: float = eqx.field(static=True, default=1.0)

    def __check_init__(self):
        _check_spacing(self.spacing)

    @classmethod
    def init(cls, n_heads: int, *, spacing: float = 1.0, dtype=None) -> ALiBi:
        """ALiBi with the standard slopes for `n_heads` heads."""
        return cls(jnp.asarray(alibi_slopes(n_heads), dtype=dtype), spacing)

    @property
    def n_heads(self) -> int:
        return self.slopes.shape[0]

    def __call__(self, x, x_tilde):
        d = jnp.abs(jnp.asarray(x)[:, None] - jnp.asarray(x_tilde)[None, :]) / self.spacing
        return -self.slopes[:, None, None] * d[None]


def t5_bucket(
    relative_position: Int[Array, "*shape"],
    *,
    bidirectional: bool = True,
    n_buckets: int = 32,
    max_distance: int = 128,
) -> Int[Array, "*shape"]:
    """T5's relative-position bucket of `relative_position` = key position - query
    position, as Hugging Face's `T5Attention._relative_position_bucket`: exact buckets
    for small distances, logarithmic ones up to `max_distance`, the last bucket beyond;
    with `bidirectional`, half the buckets for keys after the query."""
    rel = jnp.asarray(relative_position)
    buckets = jnp.zeros_like(rel)
    if bidirectional:
        n_buckets //= 2
        buckets = buckets + (rel > 0).astype(rel.dtype) * n_buckets
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    max_exact = n_buckets // 2
    is_small = rel < max_exact
    safe = jnp.maximum(rel, 1).astype(jnp.float32)  # log of 0 is never selected
    large = max_exact + (
        jnp.log(safe / max_exact) / math.log(max_distance / max_exact) * (n_buckets - max_exact)
    ).astype(rel.dtype)
    large = jnp.minimum(large, n_buckets - 1)
    return buckets + jnp.where(is_small, rel, large)


class T5RelativeBias(AbstractPositionBias):
    r"""T5's relative position bias: a learned value per head and bucket,
    $b_m(x, \tilde x) = E[\mathrm{bucket}(r), m]$ with $r$ the key-minus-query distance
    $(\tilde x - x)/\ell$ rounded to the nearest integer ($\ell$ = `spacing`) and the
    buckets of [`t5_bucket`][] (Hugging Face's). Piecewise constant in $x - \tilde x$, so
    it limits the quadrature order of attention to 1 on refined grids; on the unit grid
    it is T5's bias exactly.

    **Arguments:** `embedding` `[n_buckets, heads]` (Hugging Face's
    `relative_attention_bias.weight`), `bidirectional` (encoder: True; decoder: False),
    `max_distance`, `spacing`."""

    embedding: Float[Array, "buckets heads"] = kernel()
    bidirectional: bool = eqx.field(static=True, default=True)
    max_distance: int = eqx.field(static=True, default=128)
    spacing: float = eqx.field(static=True, default=1.0)

    def __check_init__(self):
        if jnp.ndim(self.embedding) != 2:
            raise ValueError(
                f"`embedding` must have shape [n_buckets, heads], got {jnp.shape(self.embedding)}."
            )
        if not isinstance(self.bidirectional, bool):
            raise TypeError(f"`bidirectional`={self.bidirectional!r} must be True or False.")
        _check_positive_int("max_distance", self.max_distance)
        _check_spacing(self.spacing)

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        n_heads: int,
        *,
        n_buckets: int = 32,
        max_distance: int = 128,
        bidirectional: bool = True,
        spacing: float = 1.0,
        scale: float = 0.1,
        dtype=None,
    ) -> T5RelativeBias:
        """A random (normal, standard deviation `scale`) bias table."""
        n_heads = _check_positive_int("n_heads", n_heads)
        n_buckets = _check_positive_int("n_buckets", n_buckets)
        emb = scale * normal(key, (n_buckets, n_heads), dtype or jnp.float32)
        return cls(emb, bidirectional, max_distance, spacing)

    @property
    def n_heads(self) -> int:
        return self.embedding.shape[1]

    def __call__(self, x, x_tilde):
        r = (jnp.asarray(x_tilde)[None, :] - jnp.asarray(x)[:, None]) / self.spacing
        b = t5_bucket(
            jnp.round(r).astype(jnp.int32),
            bidirectional=self.bidirectional,
            n_buckets=self.embedding.shape[0],
            max_distance=self.max_distance,
        )
        return jnp.moveaxis(self.embedding[b], -1, 0)  # [q, k, heads] -> [heads, q, k]


class DiscreteBias(AbstractScoreBias):
    """A fixed `[heads, N, N]` score bias (one resolution: the token count is `N`).

    Called with token indices it returns the block `[heads, q, k]`; pass it (or the array
    itself) as `score_bias`.

    **Fields:** `matrix`: `[heads, N, N]`, `matrix[m, k, p]` $= b_m(x_k, x_p)$, the bias
    added to head $m$'s score of query $k$ and key $p$."""

    matrix: Float[Array, "heads tokens tokens"]
    needs_positions: ClassVar[bool] = False

    def on_nodes(self, nodes) -> DiscreteBias:
        """Itself, on a grid of exactly `N` tokens (an error naming the counts otherwise)."""
        n = np.shape(nodes)[0]
        if self.matrix.shape[-1] != n:
            raise ValueError(
                f"`score_bias` is a DiscreteBias for {self.matrix.shape[-1]} tokens, but the "
                f"state has {n}; use a position bias (ALiBi, T5RelativeBias) to run at any "
                "token count."
            )
        return self

    def __check_init__(self):
        shape = jnp.shape(self.matrix)
        if len(shape) != 3 or shape[1] != shape[2]:
            raise ValueError(f"`matrix` must have shape [heads, N, N], got {shape}.")

    @property
    def n_heads(self) -> int:
        return self.matrix.shape[0]

    def __call__(self, query_index, key_index):
        return self.matrix[:, jnp.asarray(query_index)[:, None], jnp.asarray(key_index)[None, :]]
