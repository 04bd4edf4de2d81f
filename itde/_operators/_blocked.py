r"""Softmax attention over token blocks with linear memory, and its dense and fused twins.

All three functions compute, for each head $m$ and query token $k$,
$$o_{mk} = \sum_p \gamma_{mkp}\, v_{mp},\qquad
\gamma_{mkp} = \mathrm{softmax}_p\big(q_{mk}\cdot k_{mp} + \log w_p\big),$$
the quadrature form of the attention integral: $\log w_p$ are the token quadrature
weights as a log-bias (exact for the ratio of the two integrals), and the causal
(Volterra) form keeps only $p \le k$. The queries come already scaled
($1/\sqrt{|\Omega_h|}$ and any head weights folded in), so the score is a plain dot product.

Two more pair terms ride on the same mechanism, in every core:

- `score_bias` $b_{mkp}$, added to the score (ALiBi, T5-style relative bias, a discrete
  `[heads, tokens, tokens]` bias, or $-\infty$ to mask a pair);
- `window`, a [`TokenBand`][itde.TokenBand] (a [`SlidingWindow`][itde.SlidingWindow]
  bound to the token nodes): query $k$ reads only the keys of its band, the kernel's
  compact support; the blocked core skips every key block outside it;
- `query_weights` $W_{kp}$, per-query quadrature weights (the partial-interval weights
  of causal attention at quadrature order, see `itde.volterra_weights`), so that
  $o_{mk} = \sum_p W_{kp} e^{s_{mkp}} v_{mp} / \sum_p W_{kp} e^{s_{mkp}}$.
  Non-negative weights enter as $\log W_{kp}$ (a zero weight excludes the pair) and work
  in all three cores; signed weights (`signed_weights=True`) multiply the exponentials
  instead (no logarithm of a negative number) and work in the dense and blocked cores
  only: [`fused_attention`][] raises.

Each pair term is an array (`[tokens, tokens]`, or `[heads, tokens, tokens]` for a bias)
or a function `(query_index, key_index) -> block` of the integer token indices, which the
blocked core calls one block at a time (so a bias that is a function of the positions
never forms a `tokens × tokens` array there).

**Empty rows.** A query with no admissible key (every weight 0, every log-weight or bias
$-\infty$, e.g. a padded sequence) has output 0 in every core, with finite gradients.

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
import numpy as np
from jaxtyping import Array, Float

from ._pair_terms import is_function, pair_block
from ._softcap import SoftCap, check_score_cap
from ._window import TokenBand


def _safe_log(w):
    r"""$\log w$ with $\log 0 = -\infty$ and a zero (not NaN) gradient there."""
    pos = w > 0
    return jnp.where(pos, jnp.log(jnp.where(pos, w, 1.0)), -jnp.inf)


def _check_pair(name, x, shapes, n):
    if x is None or is_function(x):
        return
    if jnp.shape(x) not in shapes:
        raise ValueError(
            f"`{name}` must have shape {' or '.join(str(t) for t in shapes)} for {n} tokens "
            f"(or be a function of (query_index, key_index)), got {jnp.shape(x)}."
        )


def _check_signed(signed_weights, query_weights):
    if not isinstance(signed_weights, bool):
        raise TypeError(f"`signed_weights`={signed_weights!r} must be True or False.")
    if signed_weights and query_weights is None:
        raise ValueError("`signed_weights=True` needs `query_weights`; pass them or drop it.")


def _check_window(window, n):
    if window is None:
        return
    if not isinstance(window, TokenBand):
        raise TypeError(
            f"`window`={window!r} must be an itde.TokenBand, the window bound to the token "
            "nodes: `itde.SlidingWindow(length).on_nodes(nodes)`, or None."
        )
    if window.n_tokens != n:
        raise ValueError(
            f"`window` was bound to {window.n_tokens} token nodes but the sequence has {n} "
            "tokens; bind it to this sequence's nodes."
        )


def _check(
    q,
    k,
    v,
    token_log_weights,
    block_size=None,
    query_weights=None,
    score_bias=None,
    signed_weights=False,
    window=None,
):
    if q.ndim != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2] or v.ndim != 3:
        raise ValueError(
            "`q`, `k`, `v` must have shape [heads, tokens, head_dim] with equal heads and "
            f"tokens (and q, k equal head_dim); got q {q.shape}, k {k.shape}, v {v.shape}."
        )
    h, n = q.shape[:2]
    if token_log_weights is not None and jnp.shape(token_log_weights) != (n,):
        raise ValueError(
            f"`token_log_weights` must have shape [tokens] = ({n},), got "
            f"{jnp.shape(token_log_weights)}."
        )
    if block_size is not None and (
        isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1
    ):
        raise ValueError(f"`block_size` must be a positive int, got {block_size!r}.")
    _check_pair("query_weights", query_weights, [(n, n)], n)
    _check_pair("score_bias", score_bias, [(n, n), (1, n, n), (h, n, n)], n)
    _check_signed(signed_weights, query_weights)
    _check_window(window, n)


def _scores(s, iq, ik, dtype, *, query_weights, score_bias, signed_weights, causal, window):
    r"""Add the pair terms to a block of scores `s` `[heads, bq, bk]` and mask it.

    Returns `(s, w)`: the scores with $-\infty$ where a pair is excluded, and the signed
    weights to multiply the exponentials by (`None` on the logarithmic path)."""
    b = pair_block(score_bias, iq, ik, dtype)
    if b is not None:
        s = s + (b if b.ndim == 3 else b[None])
    w = pair_block(query_weights, iq, ik, dtype)
    if w is not None:
        if signed_weights:
            s = jnp.where(w[None] != 0, s, -jnp.inf)  # a zero weight excludes the pair
        else:
            s = s + _safe_log(w)[None]
            w = None
    if causal:  # added, not selected: XLA:CPU then fuses the whole dense core into one kernel
        s = s + jnp.where(iq[:, None] >= ik[None, :], 0.0, -jnp.inf).astype(s.dtype)
    if window is not None:
        s = s + jnp.where(window(iq, ik), 0.0, -jnp.inf).astype(s.dtype)
    return s, w


def _shift(m):
    """The row maximum used as the softmax shift: 0 for a row with no admissible key."""
    return jnp.where(jnp.isfinite(m), m, 0.0)


def dense_attention(
    q: Float[Array, "heads tokens head_dim"],
    k: Float[Array, "heads tokens head_dim"],
    v: Float[Array, "heads tokens value_dim"],
    *,
    token_log_weights: Float[Array, " tokens"] | None = None,
    query_weights=None,
    score_bias=None,
    signed_weights: bool = False,
    causal: bool = False,
    window: TokenBand | None = None,
    block_size: int | None = None,
    score_cap: SoftCap | None = None,
) -> Float[Array, "heads tokens value_dim"]:
    r"""Softmax attention with the full score matrix (memory $O(N^2)$ per head).

    The reference for [`blocked_attention`][]; `block_size` is accepted and ignored so
    that the three functions share one signature.

    **Arguments:**

    - `q`, `k`, `v`: `[heads, tokens, head_dim]`, with `q` already scaled.
    - `token_log_weights`: $\log w_p$, added to every score in column $p$ (`None`: 0;
      $-\infty$ excludes key $p$).
    - `query_weights`: per-query weights $W_{kp}$, `[tokens, tokens]` or a function of
      `(query_index, key_index)` (`None`: all 1).
    - `score_bias`: $b_{mkp}$ added to the scores, `[tokens, tokens]`,
      `[heads, tokens, tokens]` or a function of `(query_index, key_index)` returning
      `[heads or 1, len(query_index), len(key_index)]` (`None`: 0).
    - `signed_weights`: the `query_weights` may be negative (multiplicative path).
    - `causal`: keep only keys $p \le k$ for query $k$.
    - `window`: keep only the keys of query $k$'s band (a [`TokenBand`][itde.TokenBand],
      from [`SlidingWindow.on_nodes`][itde.SlidingWindow.on_nodes]; `None`: every key).
    - `score_cap`: an [`itde.SoftCap`][itde.SoftCap] applied to $q \cdot k$ before every
      other pair term (Gemma 2's `attn_logit_softcapping`), or `None`.

    **Returns:** `[heads, tokens, head_dim]`; 0 for a query with no admissible key.
    """
    _check(q, k, v, token_log_weights, None, query_weights, score_bias, signed_weights, window)
    check_score_cap("score_cap", score_cap)
    p, ell = dense_softmax_parts(
        q, k, jnp.result_type(q.dtype, k.dtype, v.dtype),
        token_log_weights=token_log_weights, query_weights=query_weights,
        score_bias=score_bias, signed_weights=signed_weights, causal=causal, window=window,
        score_cap=score_cap,
    )  # fmt: skip
    return jnp.einsum("hnm,hme->hne", p, v) / ell


def dense_softmax_parts(
    q, k, dtype, *, token_log_weights, query_weights, score_bias, signed_weights, causal, window,
    score_cap=None,
):  # fmt: skip
    """The dense core's unnormalised weights `p` `[heads, tokens, tokens]` and their row
    normaliser `ell` `[heads, tokens, 1]`: the attention output is `p @ v / ell`, the
    attention weights `p / ell` (`itde.analysis.attention_weights` reads them here, so the
    two never drift apart). `dtype`: the scores' dtype."""
    n = q.shape[1]
    idx = jnp.arange(n)
    s = jnp.einsum("hne,hme->hnm", q, k)
    if score_cap is not None:  # the kernel's exponent is capped, not the pair terms
        s = score_cap(s)
    if token_log_weights is not None:
        s = s + token_log_weights.astype(s.dtype)[None, None, :]
    s, w = _scores(
        s,
        idx,
        idx,
        dtype,
        query_weights=query_weights,
        score_bias=score_bias,
        signed_weights=signed_weights,
        causal=causal,
        window=window,
    )
    # The shift of a row with no admissible key (all scores -inf) is the lowest finite
    # number, so that its exponentials are 0 and not NaN. No `where` on the row maximum or
    # on the sum: written with max, exp, sum and division only, XLA:CPU fuses the whole
    # core (both products, the softmax) into one kernel: a 4-layer forward at 128 tokens
    # takes 0.86x the time it took with selects (benchmarks/README.md, issue 12).
    lo = jnp.finfo(s.dtype).min
    m = jnp.maximum(jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)), lo)
    p = jnp.exp(s - m)
    if w is not None:  # signed weights: the sum may be 0 or negative
        p = p * w[None]
        ell = jnp.sum(p, axis=-1, keepdims=True)
        return p, jnp.where(ell != 0, ell, 1.0)
    # A row with an admissible key has ell >= 1 (its maximum contributes e^0 = 1), and
    # e^(lo - m) underflows to exactly 0 there; a row with none has p = 0, m = lo and
    # e^(lo - m) = 1, so its output is 0 / 1 = 0 with finite gradients.
    return p, jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(lo - m)


def blocked_attention(
    q: Float[Array, "heads tokens head_dim"],
    k: Float[Array, "heads tokens head_dim"],
    v: Float[Array, "heads tokens value_dim"],
    *,
    token_log_weights: Float[Array, " tokens"] | None = None,
    query_weights=None,
    score_bias=None,
    signed_weights: bool = False,
    causal: bool = False,
    window: TokenBand | None = None,
    block_size: int | None = 512,
    score_cap: SoftCap | None = None,
) -> Float[Array, "heads tokens value_dim"]:
    r"""Softmax attention by blocks of tokens with an online softmax (linear memory).

    The tokens are padded to a multiple of $B$ = `block_size` (padded keys get weight 0,
    padded queries are dropped). Query blocks are processed one after another
    (`jax.lax.map`); for each, a `jax.lax.scan` over key blocks keeps the running row
    maximum $m$, the running sum $\ell = \sum_p W_{kp} e^{s_p - m}$ and the running
    $\sum_p W_{kp} e^{s_p - m} v_p$, rescaling them by $e^{m_\text{old} - m_\text{new}}$
    when the maximum grows; the output is the last divided by $\ell$. This is the same
    sum as [`dense_attention`][] in another order (equal to round-off).

    **Skipped blocks.** Which key blocks a query block needs is known when the
    computation is traced: in the causal form those at or before it, with a `window`
    those that meet its band. The scan runs over the longest such run of key blocks
    only (a window of length $L$ on a grid of spacing $h$: about $2L/(hB) + 2$ blocks,
    or $L/(hB) + 2$ causal, whatever $N$), starting where each query block's run
    starts, and a key block of that run outside the query block's range is skipped
    (`jax.lax.cond`). So with a fixed window the time is linear in $N$, not quadratic.

    Pair terms given as functions are evaluated one block at a time; given as arrays,
    their blocks are gathered (the array itself is $O(N^2)$).

    **Memory.** Forward: $O(h\,N\,e + h\,B^2)$ for $h$ heads, $N$ tokens, head size $e$.
    Reverse mode recomputes each query block's forward (`jax.checkpoint`), so the
    backward pass holds $O(h\,N\,B)$ (one query block's residuals), never $O(N^2)$.
    Forward-mode and higher-order derivatives work too (plain JAX control flow, no
    custom rule).

    **Arguments:** as [`dense_attention`][], plus `block_size` ($B$; `None`: one block of
    all tokens).

    **Returns:** `[heads, tokens, head_dim]`; 0 for a query with no admissible key.
    """
    _check(
        q, k, v, token_log_weights, block_size, query_weights, score_bias, signed_weights, window
    )
    check_score_cap("score_cap", score_cap)
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
    lo, hi, start, span = key_block_plan(n, bs, causal, window)
    # nothing to skip; exact: the plan is integer block indices
    every = bool(np.all(lo == start) and np.all(hi == start + span - 1))
    lo, hi, start = (jnp.asarray(a, jnp.int32) for a in (lo, hi, start))

    @jax.checkpoint
    def query_block(args):
        i, qi = args  # qi: [h, bs, e]
        q_idx = jnp.minimum(i * bs + offsets, n - 1)  # padded queries: dropped at the end

        def step(carry, xs):
            j, kj, vj, bj = xs

            def update(carry):
                m, ell, acc = carry
                k_idx = jnp.minimum(j * bs + offsets, n - 1)  # padded keys: bj = -inf
                s = jnp.einsum("hqe,hke->hqk", qi, kj)
                if score_cap is not None:  # elementwise: each block capped as the dense core
                    s = score_cap(s)
                s = s + bj[None, None, :]
                s, w = _scores(
                    s,
                    q_idx,
                    k_idx,
                    dtype,
                    query_weights=query_weights,
                    score_bias=score_bias,
                    signed_weights=signed_weights,
                    causal=causal,
                    window=window,
                )
                # The shift cancels in acc / ell, so it carries no gradient.
                m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1)))
                m_safe = _shift(m_new)  # row all -inf so far
                p = jnp.exp(s - m_safe[..., None])
                if w is not None:
                    p = p * w[None]
                alpha = jnp.exp(m - m_safe)
                ell = alpha * ell + jnp.sum(p, axis=-1)
                acc = alpha[..., None] * acc + jnp.einsum("hqk,hke->hqe", p, vj)
                return m_new, ell, acc

            if every:
                carry = update(carry)
            else:  # a key block of the run that this query block does not need
                carry = jax.lax.cond((j >= lo[i]) & (j <= hi[i]), update, lambda c: c, carry)
            return carry, None

        init = (
            jnp.full((h, bs), -jnp.inf, dtype),
            jnp.zeros((h, bs), dtype),
            jnp.zeros((h, bs, ev), dtype),
        )
        if span == nb:
            xs = (jnp.arange(nb), kb, vb, bb)
        else:  # the run of `span` key blocks from this query block's first
            s0 = start[i]
            xs = (s0 + jnp.arange(span),) + tuple(
                jax.lax.dynamic_slice_in_dim(a, s0, span, axis=0) for a in (kb, vb, bb)
            )
        (_, ell, acc), _ = jax.lax.scan(step, init, xs)
        return acc / jnp.where(ell != 0, ell, 1.0)[..., None]

    out = jax.lax.map(query_block, (jnp.arange(nb), qb))  # [nb, h, bs, ev]
    return out.transpose(1, 0, 2, 3).reshape(h, nb * bs, ev)[:, :n]


def key_block_plan(
    n: int, block_size: int, causal: bool, window: TokenBand | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Which key blocks each query block of [`blocked_attention`][] evaluates.

    **Returns:** `(lo, hi, start, span)`: query block $i$ needs key blocks `lo[i]` to
    `hi[i]`; the scan visits the `span` blocks from `start[i]` (the longest run, shifted
    to stay inside the tokens) and evaluates those in `[lo[i], hi[i]]`."""
    bs = min(block_size, n)
    nb = -(-n // bs)
    if window is None:
        lo = np.zeros(nb, np.int64)
        hi = np.arange(nb) if causal else np.full(nb, nb - 1)
    else:
        lo, hi = window.key_blocks(bs, causal)
    span = int(np.max(hi - lo + 1))
    start = np.minimum(lo, nb - span)
    return lo, hi, start, span


def fused_attention(
    q: Float[Array, "heads tokens head_dim"],
    k: Float[Array, "heads tokens head_dim"],
    v: Float[Array, "heads tokens head_dim"],
    *,
    token_log_weights: Float[Array, " tokens"] | None = None,
    query_weights=None,
    score_bias=None,
    signed_weights: bool = False,
    causal: bool = False,
    window: TokenBand | None = None,
    block_size: int | None = None,
    implementation: str | None = None,
    score_cap: SoftCap | None = None,
) -> Float[Array, "heads tokens head_dim"]:
    r"""Softmax attention through `jax.nn.dot_product_attention` (`scale=1`, the token
    log-weights, the log of non-negative `query_weights` and the `score_bias` summed into
    its additive `bias`, `is_causal=causal`).

    `implementation=None` lets JAX choose: on CPU that is XLA's composition (which forms
    the full score matrix, memory $O(N^2)$); on an NVIDIA GPU `implementation="cudnn"`
    selects cuDNN's fused flash kernel, which needs float16/bfloat16 inputs and its own
    head-size limits and raises where they are not met. `block_size` is ignored (the
    shared signature). Signed `query_weights` cannot be a softmax bias: they raise here
    (use the dense or blocked core). Any pair term forms a `[heads, tokens, tokens]` bias.
    A query with no admissible key gets output 0 (its bias row is replaced by 0 before
    the call and its output zeroed after, so the gradients stay finite).

    **Window.** A band that is the same at every query (an equispaced grid:
    [`TokenBand.offsets`][itde.TokenBand.offsets] is `(behind, ahead)`) goes in as
    `local_window_size=(behind, ahead)` (`(behind, 0)` when causal), whose inclusive
    bounds $k - \text{behind} \le p \le k + \text{ahead}$ are the band's; cuDNN reads it
    as its sliding window of `behind + 1` keys. cuDNN has no window that reaches ahead
    (JAX: "cuDNN doesn't support right window"): a non-causal window with
    `implementation="cudnn"` raises. Any other band (Gauss–Legendre nodes) is added to
    the bias as $-\infty$ outside it.

    **Returns:** `[heads, tokens, head_dim]`.
    """
    _check(q, k, v, token_log_weights, None, query_weights, score_bias, signed_weights, window)
    if score_cap is not None:
        raise ValueError(
            f"`fused_attention`: `score_cap`={score_cap!r} (soft-capping, Gemma 2's "
            "attn_logit_softcapping) is not supported: jax.nn.dot_product_attention caps no "
            "score. Use the itde.Dense() or itde.Blocked() core, which cap exactly."
        )
    local = None if window is None else window.offsets()
    if local is not None:
        local = (local[0], 0) if causal else local
        if implementation == "cudnn" and local[1] > 0:
            raise ValueError(
                "`fused_attention`: a non-causal `window` reaches ahead of the query by "
                f"{local[1]} tokens, which cuDNN's sliding window cannot express (it reads "
                "only keys before the query); use implementation=None or 'xla', or the "
                "itde.Dense() / itde.Blocked() core."
            )
    if signed_weights:
        raise ValueError(
            "`fused_attention` cannot take signed `query_weights` (`signed_weights=True`): "
            "a softmax bias is the log of a positive weight. Use the itde.Dense() or "
            "itde.Blocked() core."
        )
    if v.shape != q.shape:
        raise ValueError(
            f"`fused_attention` needs `v` of the same shape as `q` {q.shape}, got {v.shape}."
        )
    n = q.shape[1]
    dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    bias = None
    if token_log_weights is not None:
        bias = token_log_weights.astype(dtype)[None, None, :]  # [heads, T, S]
    band = None if local is not None else window  # a band of no fixed offsets: as a bias
    if query_weights is not None or score_bias is not None or band is not None:
        idx = jnp.arange(n)
        pair, _ = _scores(
            jnp.zeros((1, n, n), dtype),
            idx,
            idx,
            dtype,
            query_weights=query_weights,
            score_bias=score_bias,
            signed_weights=False,
            causal=False,
            window=band,
        )
        bias = pair if bias is None else bias + pair
    keep = None
    if bias is not None:
        ok = jnp.isfinite(bias)
        if causal:
            ok = ok & jnp.tril(jnp.ones((n, n), dtype=bool))
        if local is not None:
            ok = ok & window(jnp.arange(n), jnp.arange(n))[None]
        keep = jnp.any(ok, axis=-1)  # [heads or 1, T]: the row has an admissible key
        bias = jnp.where(keep[..., None], bias, 0.0)[None]  # [B, heads, T, S]
    t = lambda a: jnp.swapaxes(a, 0, 1)[None]  # noqa: E731  [heads, T, e] -> [1, T, heads, e]
    out = jax.nn.dot_product_attention(
        t(q),
        t(k),
        t(v),
        bias,
        scale=1.0,
        is_causal=causal,
        local_window_size=local,
        implementation=implementation,
    )
    out = jnp.swapaxes(out[0], 0, 1)
    if keep is not None:
        out = jnp.where(keep[..., None], out, 0.0)
    return out
