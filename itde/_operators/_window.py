r"""Sliding-window attention: an attention kernel with compact support in the token variable.

The window multiplies the attention kernel by the indicator of $|x - \tilde x| < L$,
$$A_L(u)(x) = \frac{\int_{\Omega_x} \chi_L(x - \tilde x)\,e^{s(x,\tilde x)}\,
  \tilde V(\tilde x)\,d\tilde x}{\int_{\Omega_x} \chi_L(x - \eta)\,e^{s(x,\eta)}\,d\eta},
\qquad \chi_L(r) = [\,|r| < L\,],$$
with the causal (Volterra) restriction $\tilde x \le x$ on top where the equation has
it, so that a causal model reads $0 \le x - \tilde x < L$. $L$ is a length on the token
domain, not a number of tokens: on a grid of spacing $h$ the window holds about $L/h$
tokens on each side, and it means the same interval on every grid.

**Hugging Face.** On the unit grid (nodes $x = \tfrac12, \tfrac32, \dots$, so node
distances are whole numbers) a causal window of length $L = W$ is exactly Mistral's
`sliding_window = W`: `transformers.masking_utils.sliding_window_overlay` keeps
`kv_idx > q_idx - W`, i.e. $x - \tilde x < W$ strictly, which with the causal mask keeps
the $W$ tokens $x - W < \tilde x \le x$ (the query's own token and the $W - 1$ before it).
Its bidirectional overlay keeps $|q - kv| \le W$ (inclusive): that is $L = W + \tfrac12$
here (any $L$ in $(W, W + 1]$ gives the same tokens on the unit grid; $W + \tfrac12$ is
half the length of the $2W + 1$ cells the tokens cover).

**Order.** The indicator jumps at $\tilde x = x \pm L$; a quadrature rule integrates the
windowed kernel to first order in the token spacing there (the edge falls anywhere in a
cell), whatever its order on smooth integrands. Node distances that equal $L$ up to
round-off ($10^{-12}$ relative) count as equal to $L$, so they are outside.

[`SlidingWindow.on_nodes`][itde.SlidingWindow.on_nodes] binds the window to a grid's
token nodes: a [`TokenBand`][itde.TokenBand], the range of keys each query reads, which
the attention cores take as `window=` (the blocked core skips every key block outside
it, so its time and memory grow linearly in the tokens for a fixed window).
"""

from __future__ import annotations

import math
import numbers

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from ._pair_terms import pair_block

_ROUND_OFF = 1e-12  # relative: a node distance this close to L counts as L (outside)


def _check_length(length) -> float:
    if isinstance(length, bool) or not isinstance(length, numbers.Real):
        raise TypeError(
            f"`SlidingWindow(length)`={length!r} must be a number, the window's length on the "
            f"token domain (not {type(length).__name__}); e.g. SlidingWindow(4096.0) for "
            "Mistral's sliding_window = 4096 on the unit grid."
        )
    v = float(length)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(
            f"`SlidingWindow(length)`={length!r} must be positive and finite; for attention "
            "without a window use window=None."
        )
    return v


class SlidingWindow(eqx.Module):
    r"""Sliding-window attention: a query at $x$ reads the keys at $\tilde x$ with
    $|x - \tilde x| < L$ (and $\tilde x \le x$ in a causal equation: $0 \le x - \tilde x
    < L$). See the module's notes above for the Hugging Face conventions and the order.

    A [`TransformerIDE`][itde.TransformerIDE] takes it as `window=`; for the attention
    cores, bind it to the token nodes with [`on_nodes`][itde.SlidingWindow.on_nodes].

    **Arguments:**

    - `length`: $L > 0$, a length on the token domain (on the unit grid, a number of
      tokens: Mistral's `sliding_window = W` is `SlidingWindow(W)` in a causal model).
    """

    length: float = eqx.field(static=True, converter=_check_length)

    def on_nodes(self, nodes) -> TokenBand:
        r"""The window on sorted token nodes `nodes` (`[tokens]`, increasing, e.g.
        `grid.tokens.nodes_weights(n)[0]`; the unit grid's are `np.arange(n) + 0.5`):
        query $k$ reads keys $p$ with $|x_k - x_p| < L$, a contiguous range of
        indices. Computed in float64 NumPy (the nodes must be concrete).

        **Returns:** a [`TokenBand`][itde.TokenBand]."""
        x = np.asarray(nodes, dtype=np.float64)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(
                f"`nodes` must be the 1-D token nodes [tokens], got shape {x.shape}; a window "
                "needs a 1-D token rule."
            )
        if not np.all(np.isfinite(x)) or not np.all(np.diff(x) > 0):
            raise ValueError(
                f"`nodes` must be finite and increasing (a 1-D rule's nodes), got {x!r}."
            )
        ell = self.length
        tol = _ROUND_OFF * max(ell, float(np.max(np.abs(x))))
        first = np.searchsorted(x, x - ell + tol, side="right")
        last = np.searchsorted(x, x + ell - tol, side="left") - 1
        k = np.arange(x.size)
        first, last = np.minimum(first, k), np.maximum(last, k)  # a query reads itself
        return TokenBand(tuple(int(i) for i in first), tuple(int(i) for i in last))


class TokenBand(eqx.Module):
    r"""The keys each query reads, as index ranges: query $k$ reads keys
    $p$ with `first[k]` $\le p \le$ `last[k]` (both non-decreasing in $k$). A
    [`SlidingWindow`][itde.SlidingWindow] bound to token nodes; the attention cores take it
    as `window=` (the causal restriction, token weights and other pair terms act on top).

    The bounds are static (Python integers known when the computation is traced), so the
    blocked core can plan which key blocks each query block visits.

    **Fields:**

    - `first`: `first[k]`, the index of the first key that query $k$ reads (the smallest
      $p$ with $x_k - x_p < L$ for a window of length $L$), one per token.
    - `last`: `last[k]`, the index of the last key it reads (the largest $p$ with
      $x_p - x_k < L$), one per token.
    """

    first: tuple[int, ...] = eqx.field(static=True)
    last: tuple[int, ...] = eqx.field(static=True)

    def __check_init__(self):
        f, ell = np.asarray(self.first), np.asarray(self.last)
        n = f.size
        k = np.arange(n)
        if (
            n == 0
            or ell.shape != f.shape
            or np.any(f > k)
            or np.any(ell < k)
            or np.any(f < 0)
            or np.any(ell >= n)
            or np.any(np.diff(f) < 0)
            or np.any(np.diff(ell) < 0)
        ):
            raise ValueError(
                "`TokenBand(first, last)` must hold one non-decreasing range per query with "
                "0 <= first[k] <= k <= last[k] < tokens; build it with "
                "SlidingWindow(length).on_nodes(nodes)."
            )

    @property
    def n_tokens(self) -> int:
        return len(self.first)

    def __call__(
        self, query_index: Int[Array, " q"], key_index: Int[Array, " k"]
    ) -> Bool[Array, "q k"]:
        """The block of admitted pairs for query indices and key indices."""
        first = jnp.asarray(self.first, jnp.int32)[query_index]
        last = jnp.asarray(self.last, jnp.int32)[query_index]
        p = key_index[None, :]
        return (p >= first[:, None]) & (p <= last[:, None])

    def matrix(self) -> np.ndarray:
        """The whole `[tokens, tokens]` boolean matrix (NumPy; for tests and small N)."""
        p = np.arange(self.n_tokens)[None, :]
        return (p >= np.asarray(self.first)[:, None]) & (p <= np.asarray(self.last)[:, None])

    def offsets(self) -> tuple[int, int] | None:
        """`(behind, ahead)` when the band is the same at every query, `first[k] =
        max(0, k - behind)` and `last[k] = min(tokens - 1, k + ahead)` (an equispaced
        grid): the form of `jax.nn.dot_product_attention`'s `local_window_size`. `None`
        otherwise (e.g. Gauss–Legendre nodes)."""
        f, ell = np.asarray(self.first), np.asarray(self.last)
        k = np.arange(self.n_tokens)
        behind, ahead = int(np.max(k - f)), int(np.max(ell - k))
        n = self.n_tokens
        # exact: `first`, `last` and the offsets are integer token indices
        if np.array_equal(f, np.maximum(0, k - behind)) and np.array_equal(
            ell, np.minimum(n - 1, k + ahead)
        ):
            return behind, ahead
        return None

    def key_blocks(self, block_size: int, causal: bool) -> tuple[np.ndarray, np.ndarray]:
        """For token blocks of `block_size`, the first and last key block that each query
        block needs (`[blocks]` integer arrays): the blocks that meet the band (and, with
        `causal`, lie at or before the query block)."""
        n, bs = self.n_tokens, block_size
        nb = -(-n // bs)
        starts = np.arange(nb) * bs
        ends = np.minimum(starts + bs, n) - 1
        lo = np.asarray(self.first)[starts] // bs  # first[] is non-decreasing
        hi = np.asarray(self.last)[ends] // bs
        if causal:
            hi = np.minimum(hi, np.arange(nb))
        return lo, hi


class LayerWindow(eqx.Module):
    r"""A sliding window whose length is data: a depth-dependent control of the attention
    kernel, one length per layer in the controls (`Block(..., window=LayerWindow(L))`),
    so that the layers of a network that mixes windowed and full attention (Gemma 2 and
    3's `layer_types`) run one compiled layer step. A query at $x$ reads the keys at
    $|x - \tilde x| < L_n$ in layer $n$ ($0 \le x - \tilde x < L_n$ with the causal
    restriction); $L_n = +\infty$ is full attention. On the unit grid
    `LayerWindow(W)` in a causal model keeps the keys Hugging Face's sliding-window mask
    keeps (`kv_idx > q_idx - W`), as [`SlidingWindow`][itde.SlidingWindow] does.

    It enters the attention cores as a score bias ($0$ inside, $-\infty$ outside), so every
    core takes it; unlike `SlidingWindow` its band is not known when the computation is
    traced, so the blocked core visits every key block (the time is quadratic in the
    tokens). A length jumps between layers: smooth controls (`LegendreControls`,
    `SplineControls`) have no per-layer window, and an equation refuses them by name.

    **Arguments:**

    - `length`: $L > 0$, a length on the token domain (a scalar array per layer; `inf`
      for no window).
    """

    length: Float[Array, "*dims"]

    def __check_init__(self):
        a = np.asarray(self.length) if not _traced(self.length) else None
        if a is not None and not np.all(a > 0):
            raise ValueError(
                f"`LayerWindow(length)`={a!r} must be positive (a length on the token "
                "domain, inf for full attention)."
            )

    def admits(self, xq, xk) -> Bool[Array, "q k"]:
        """Which pairs of query nodes `xq` and key nodes `xk` lie inside the window (node
        distances within 1e-12 relative of $L$ count as $L$: outside, as `SlidingWindow`)."""
        dist = jnp.abs(jnp.asarray(xq)[:, None] - jnp.asarray(xk)[None, :])
        length = jnp.asarray(self.length, dist.dtype)
        return dist < length * (1.0 - _ROUND_OFF)

    def score_bias(self, nodes, other=None):
        """The window on token `nodes` as a score-bias function `(query_index, key_index)
        -> [..., q, k]` ($0$ inside, $-\\infty$ outside), plus the pair term `other` (an
        equation's own score bias: an array or such a function) when given."""
        x = jnp.asarray(nodes)

        def bias(iq, ik):
            b = jnp.where(self.admits(x[iq], x[ik]), 0.0, -jnp.inf)
            if other is None:
                return b
            o = pair_block(other, iq, ik, b.dtype)
            return b + o

        return bias


def _traced(a) -> bool:
    import jax

    return isinstance(a, jax.core.Tracer)
