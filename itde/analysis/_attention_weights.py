r"""The attention weights of a model at a state, as its equation applies them, and their
entropies."""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from .._operators._blocked import dense_softmax_parts
from .._operators._feature_weights import weighted
from .._operators._mask import key_mask
from ._common import _mask, _state, equation_of


def _softmax_weights(
    q, k, *, token_log_weights, query_weights, score_bias, signed, causal, window, score_cap=None
):
    """The weights `[heads, tokens, tokens]` that `dense_attention` applies to the values
    (its own scores, shift and normalisation)."""
    p, ell = dense_softmax_parts(
        q, k, jnp.result_type(q.dtype, k.dtype), token_log_weights=token_log_weights,
        query_weights=query_weights, score_bias=score_bias, signed_weights=signed,
        causal=causal, window=window, score_cap=score_cap,
    )  # fmt: skip
    return p / ell


def _attention_parts(eq, t, u, mask):
    """Everything `TransformerIDE.attention_field` passes to the attention at depth `t`."""
    n = u.shape[0]
    att, head_weights = eq.controls(t, "right", "attention").discretise(eq.grid)
    v = eq.block.attention_input(eq, t, u)
    lw = eq.grid.token_log_weights(n, v.dtype)
    causal, query_weights, signed = eq.causal, None, False
    cw = eq.grid.causal_weights(n) if eq.causal else None
    if cw is not None:  # causal at quadrature order: per-query weights for [a, x_i]
        lw, causal, query_weights, signed = None, cw.strict, cw, cw.signed
    return att, head_weights, v, lw, causal, query_weights, signed


def attention_weights(
    model,
    t,
    u: Float[Array, "tokens features"],
    mask: Bool[Array, " tokens"] | None = None,
) -> Float[Array, "heads tokens tokens"]:
    r"""The attention weights $\gamma_m(x_k, x_p)$ of every head at the state `u` and depth
    `t`: row $k$ holds the weights query $k$ gives the keys, as the equation applies them
    (`TransformerIDE.attention_field`): the layer's attention at `t`
    (`controls(t, "right")`), its input (the state, or its normalisation in a pre-norm or
    parallel block), the grid's feature, head and token weights, RoPE, the causal
    (Volterra) restriction and its per-query weights, the sliding window, the score bias and
    the key `mask`. Each row sums to 1 over the admissible keys (0 for a query with none).

    The operator has no public method that returns its weights; this function repeats
    `Attention.__call__`'s preparation of queries and keys with the operator's own pieces
    (`project_qkv`: its QKV product, query/key norm and RoPE; the grouped-query repeat, the
    head-weight scaling) and
    the dense core's pair terms and normalisation, and returns the weights instead of
    applying them to the values. So $\sum_p \gamma_m(x_k, x_p) V_m(x_p) W^O_m$, summed over
    the heads, plus the output bias, is the attention field (the tests check this against
    `attention_field` for every option), before the output norm of a block that normalises
    the sublayer's output ([`SandwichNorm`][itde.SandwichNorm], [`OutputNorm`][itde.OutputNorm]).

    **Arguments:**

    - `model`: an `itde.TransformerIDE` or a model holding one (e.g. from `itde.from_hf`).
    - `t`: the depth.
    - `u`: the state `[tokens, features]`.
    - `mask`: `[tokens]` booleans (or 0/1), False on padded tokens (keys removed from the
      token domain, as in the model; the padded queries' rows are defined, with no meaning).

    **Returns:** `[heads, tokens, tokens]`. With the partial-interval weights of a causal
    rule of order above 2 (Simpson, Gauss–Legendre tokens) some weights are negative.
    """
    eq = equation_of(model)
    u = _state(u)
    return _attention_weights(eq, jnp.asarray(t), u, key_mask(mask, u.shape[0]))


@eqx.filter_jit
def _attention_weights(eq, t, u, m):
    n = u.shape[0]
    if m is not None and m.ndim != 1:
        raise ValueError(f"`mask` must be [tokens] for one state, got shape {m.shape}.")
    att, head_weights, v, lw, causal, query_weights, signed = _attention_parts(eq, t, u, m)
    dtype = v.dtype
    # the operator's own queries and keys: its query/key norm, then RoPE
    q, k, _ = att.project_qkv(v, feature_weights=eq.feature_weights(), rotary=eq._rotary(u, t))
    rep = att.n_heads // att.n_kv_heads
    if rep > 1:  # grouped-query attention: query head m reads key head m // rep
        k = jnp.repeat(k, rep, axis=0)
    head_len = att.head_dim if head_weights is None else float(np.sum(head_weights))
    q = weighted(q, head_weights) * jnp.asarray(1.0 / math.sqrt(head_len), dtype)
    lw = None if lw is None else lw.astype(dtype)
    if m is not None:
        lw = jnp.zeros((n,), dtype) if lw is None else lw
        lw = jnp.where(m, lw, jnp.asarray(-jnp.inf, dtype))
    return _softmax_weights(
        q,
        k,
        token_log_weights=lw,
        query_weights=query_weights,
        score_bias=eq._score_bias(u, t),
        signed=signed,
        causal=causal,
        window=eq._window(u),
        score_cap=getattr(att, "score_cap", None),
    )


def _signed_weights(eq, n: int) -> bool:
    cw = eq.grid.causal_weights(n) if eq.causal else None
    return cw is not None and cw.signed


def attention_entropy(
    model,
    t,
    u: Float[Array, "tokens features"],
    mask: Bool[Array, " tokens"] | None = None,
) -> Float[Array, "heads tokens"]:
    r"""The entropy of every head's attention distribution at each query,
    $H_m(x_k) = -\sum_p \gamma_m(x_k, x_p) \log \gamma_m(x_k, x_p)$ (natural log,
    $0 \log 0 = 0$), from [`attention_weights`][itde.analysis.attention_weights]:
    $\log n$ for a query that spreads its attention evenly over $n$ keys, 0 for one that
    reads a single key. On a grid with non-uniform token weights $w_p$ an attention uniform
    in $x$ has $\gamma_p = w_p / \sum w$, whose entropy is below $\log n$. 0 on padded
    queries (`mask` False) and on a query with no admissible key.

    Raises a `ValueError` for a causal model on a token rule whose partial-interval weights
    are signed (Simpson, Gauss–Legendre): its weights are no probability distribution."""
    eq = equation_of(model)
    u = _state(u)
    if _signed_weights(eq, u.shape[0]):
        raise ValueError(
            "attention_entropy: this causal model's token rule "
            f"({type(eq.grid.tokens).__name__}) has signed partial-interval weights, so its "
            "attention weights are no probability distribution and have no entropy; use a "
            "Midpoint or Trapezoid token rule."
        )
    return _attention_entropy(eq, jnp.asarray(t), u, _mask(mask, u.shape[0]))


@eqx.filter_jit
def _attention_entropy(eq, t, u, m):
    g = _attention_weights(eq, t, u, m)
    h = -jnp.sum(jnp.where(g > 0, g * jnp.log(jnp.where(g > 0, g, 1)), 0), axis=-1)
    return jnp.where(m[None, :], h, 0)
