r"""Softmax attention over token blocks with linear memory, and its dense and fused twins.

All three functions compute, for each head $m$ and query token $k$,
$$o_{mk} = \sum_p \gamma_{mkp}\, v_{mp},\qquad
\gamma_{mkp} = \mathrm{softmax}_p\big(q_{mk}\cdot k_{mp} + \log w_p\big),$$
the quadrature form of the attention integral: $\log w_p$ are the token quadrature
weights as a log-bias (exact for the ratio of the two integrals), and the causal
(Volterra) form keeps only $p \le k$. The queries come already scaled
($1/\sqrt{|\Omega_h|}$ and any head weights folded in), so the score is a plain dot product.

- [`dense_attention`][] forms the `[heads, tokens, tokens]` score matrix: the reference.
- [`blocked_attention`][] streams over key blocks with an online softmax (running maximum
  and running sum, as FlashAttention), one query block at a time, so no `tokens × tokens`
  matrix exists at once: peak memory $O(N\,B)$ per head for $N$ tokens and block size $B$.
- [`fused_attention`][] calls `jax.nn.dot_product_attention`.

Shapes: `q, k, v` are `[heads, tokens, head_dim]`; `token_log_weights` is `[tokens]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def _check(q, k, v, token_log_weights, block_size=None):
    if q.ndim != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2] or v.ndim != 3:
        raise ValueError(
            "`q`, `k`, `v` must have shape [heads, tokens, head_dim] with equal heads and "
            f"tokens (and q, k equal head_dim); got q {q.shape}, k {k.shape}, v {v.shape}."
        )
    n = q.shape[1]
    if token_log_weights is not None and jnp.shape(token_log_weights) != (n,):
        raise ValueError(
            f"`token_log_weights` must have shape [tokens] = ({n},), got "
            f"{jnp.shape(token_log_weights)}."
        )
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
    ):
        raise ValueError(f"`block_size` must be a positive int, got {block_size!r}.")


def dense_attention(
    q: Float[Array, "heads tokens head_dim"],
    k: Float[Array, "heads tokens head_dim"],
    v: Float[Array, "heads tokens value_dim"],
    *,
    token_log_weights: Float[Array, " tokens"] | None = None,
    causal: bool = False,
    block_size: int | None = None,
) -> Float[Array, "heads tokens value_dim"]:
    r"""Softmax attention with the full score matrix (memory $O(N^2)$ per head).

    The reference for [`blocked_attention`][]; `block_size` is accepted and ignored so
    that the three functions share one signature.

    **Arguments:**

    - `q`, `k`, `v`: `[heads, tokens, head_dim]`, with `q` already scaled.
    - `token_log_weights`: $\log w_p$, added to every score in column $p$ (`None`: 0).
    - `causal`: keep only keys $p \le k$ for query $k$.

    **Returns:** `[heads, tokens, head_dim]`.
    """
    _check(q, k, v, token_log_weights)
    n = q.shape[1]
    s = jnp.einsum("hne,hme->hnm", q, k)
    if token_log_weights is not None:
        s = s + token_log_weights.astype(s.dtype)[None, None, :]
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((n, n), dtype=bool)), s, -jnp.inf)
    # softmax that gives 0, not NaN, to a row with no admissible key (every score -inf:
    # a padded query before every real token under `causal`), as the blocked form does;
    # a NaN row would reach the real tokens through the next layer's values (0 * NaN).
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("hnm,hme->hne", p, v)


def blocked_attention(
    q: Float[Array, "heads tokens head_dim"],
    k: Float[Array, "heads tokens head_dim"],
    v: Float[Array, "heads tokens value_dim"],
    *,
    token_log_weights: Float[Array, " tokens"] | None = None,
    causal: bool = False,
    block_size: int | None = 512,
) -> Float[Array, "heads tokens value_dim"]:
    r"""Softmax attention by blocks of tokens with an online softmax (linear memory).

    The tokens are padded to a multiple of $B$ = `block_size` (padded keys get weight 0,
    padded queries are dropped). Query blocks are processed one after another
    (`jax.lax.map`); for each, a `jax.lax.scan` over key blocks keeps the running row
    maximum $m$, the running sum $\ell = \sum_p e^{s_p - m}$ and the running
    $\sum_p e^{s_p - m} v_p$, rescaling them by $e^{m_\text{old} - m_\text{new}}$ when the
    maximum grows; the output is the last divided by $\ell$. This is the same sum as
    [`dense_attention`][] in another order (equal to round-off). In the causal form, key
    blocks wholly after the query block are skipped (`jax.lax.cond`).

    **Memory.** Forward: $O(h\,N\,e + h\,B^2)$ for $h$ heads, $N$ tokens, head size $e$.
    Reverse mode recomputes each query block's forward (`jax.checkpoint`), so the
    backward pass holds $O(h\,N\,B)$ (one query block's residuals), never $O(N^2)$.
    Forward-mode and higher-order derivatives work too (plain JAX control flow, no
    custom rule).

    **Arguments:** as [`dense_attention`][], plus `block_size` ($B$; `None`: one block of
    all tokens).

    **Returns:** `[heads, tokens, head_dim]`.
    """
    _check(q, k, v, token_log_weights, block_size)
    h, n, e = q.shape
    ev = v.shape[-1]
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    bs = n if block_size is None else min(block_size, n)
    nb = -(-n // bs)
    pad = nb * bs - n
    if token_log_weights is None:
        bias = jnp.zeros((n,), dtype)
    else:
        bias = token_log_weights.astype(dtype)
    bias = jnp.pad(bias, (0, pad), constant_values=-jnp.inf)  # padded keys: weight 0
    qb = jnp.pad(q, ((0, 0), (0, pad), (0, 0))).reshape(h, nb, bs, e).transpose(1, 0, 2, 3)
    kb = jnp.pad(k, ((0, 0), (0, pad), (0, 0))).reshape(h, nb, bs, e).transpose(1, 0, 2, 3)
    vb = jnp.pad(v, ((0, 0), (0, pad), (0, 0))).reshape(h, nb, bs, ev).transpose(1, 0, 2, 3)
    bb = bias.reshape(nb, bs)
    offsets = jnp.arange(bs)

    @jax.checkpoint
    def query_block(args):
        i, qi = args  # qi: [h, bs, e]
        q_idx = i * bs + offsets

        def step(carry, xs):
            j, kj, vj, bj = xs

            def update(carry):
                m, ell, acc = carry
                s = jnp.einsum("hqe,hke->hqk", qi, kj) + bj[None, None, :]
                if causal:
                    k_idx = j * bs + offsets
                    s = jnp.where(q_idx[:, None] >= k_idx[None, :], s, -jnp.inf)
                # The shift cancels in acc / ell, so it carries no gradient.
                m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # row all -inf so far
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                ell = alpha * ell + jnp.sum(p, axis=-1)
                acc = alpha[..., None] * acc + jnp.einsum("hqk,hke->hqe", p, vj)
                return m_new, ell, acc

            if causal:
                carry = jax.lax.cond(j <= i, update, lambda c: c, carry)
            else:
                carry = update(carry)
            return carry, None

        init = (
            jnp.full((h, bs), -jnp.inf, dtype),
            jnp.zeros((h, bs), dtype),
            jnp.zeros((h, bs, ev), dtype),
        )
        (_, ell, acc), _ = jax.lax.scan(step, init, (jnp.arange(nb), kb, vb, bb))
        return acc / jnp.where(ell > 0, ell, 1.0)[..., None]

    out = jax.lax.map(query_block, (jnp.arange(nb), qb))  # [nb, h, bs, ev]
    return out.transpose(1, 0, 2, 3).reshape(h, nb * bs, ev)[:, :n]


def fused_attention(
    q: Float[Array, "heads tokens head_dim"],
    k: Float[Array, "heads tokens head_dim"],
    v: Float[Array, "heads tokens head_dim"],
    *,
    token_log_weights: Float[Array, " tokens"] | None = None,
    causal: bool = False,
    block_size: int | None = None,
    implementation: str | None = None,
) -> Float[Array, "heads tokens head_dim"]:
    r"""Softmax attention through `jax.nn.dot_product_attention` (`scale=1`, the token
    log-weights as its additive `bias`, `is_causal=causal`).

    `implementation=None` lets JAX choose: on CPU that is XLA's composition (which forms
    the full score matrix, memory $O(N^2)$); on an NVIDIA GPU `implementation="cudnn"`
    selects cuDNN's fused flash kernel, which needs float16/bfloat16 inputs and its own
    head-size limits and raises where they are not met. `block_size` is ignored (the
    shared signature).

    **Returns:** `[heads, tokens, head_dim]`.
    """
    _check(q, k, v, token_log_weights)
    if v.shape != q.shape:
        raise ValueError(
            f"`fused_attention` needs `v` of the same shape as `q` {q.shape}, got {v.shape}."
        )
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    bias = None
    if token_log_weights is not None:
        bias = token_log_weights.astype(dtype)[None, None, None, :]  # [B, N, T, S]
    t = lambda a: jnp.swapaxes(a, 0, 1)[None]  # noqa: E731  [heads, T, e] -> [1, T, heads, e]
    out = jax.nn.dot_product_attention(
        t(q), t(k), t(v), bias, scale=1.0, is_causal=causal, implementation=implementation
    )
    return jnp.swapaxes(out[0], 0, 1)
