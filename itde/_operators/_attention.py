r"""Self-attention as a quadrature-discretised nonlocal integral operator in the tokens."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._checks import check_int
from .._random import uniform
from .._roles import kernel
from ._abstract import AbstractAttention
from ._cores import AbstractAttentionCore, Dense
from ._feature_weights import check_width, weighted
from ._mask import key_mask as _key_mask
from ._precision import contract
from ._qknorm import AbstractQueryKeyNorm
from ._rope import rotate
from ._softcap import SoftCap, check_score_cap
from ._window import TokenBand

#: The most rows (tokens) for which attention reads each projection weight in its own
#: layout (see `Attention._qkv`).
FEW_ROWS = 8


class Attention(AbstractAttention):
    r"""Multi-head self-attention $A(u)$, the nonlocal integral operator of the paper's §2.

    For head $m$, query, key and value are integral transforms over the feature domain,
    $Q_m(x,\cdot) = \int_{\Omega_y} W^Q_m(\xi,\cdot)\,u(x,\xi)\,d\xi$ (likewise $K_m$,
    $V_m$), and

    $$
    A(u)(x,y)=\sum_m \frac{\int_{\Omega_x} e^{s_m(x,\tilde x)}\,\tilde V_m(\tilde x,y)\,d\tilde x}
      {\int_{\Omega_x} e^{s_m(x,\eta)}\,d\eta},\qquad
      s_m = \frac{\langle Q_m(x,\cdot), K_m(\tilde x,\cdot)\rangle_{\Omega_h}}{\sqrt{|\Omega_h|}},
    $$

    where $\tilde V_m(\tilde x, y) = \int_{\Omega_h} W^O_m(\eta, y) V_m(\tilde x,\eta)\,d\eta$ is
    the value with the head's output block absorbed (stored factored, $W^V_m$ then
    $W^O_m$, which is the same operator at lower cost). Token quadrature weights $w_p$
    enter as a log-bias, $\gamma_{kp} = \mathrm{softmax}_p(s_{kp} + \log w_p)$, exact for
    the ratio of the two integrals. On the unit grid (all weights 1) this is PyTorch's
    `nn.MultiheadAttention` with scaling $1/\sqrt{d_\mathrm{head}}$. The causal (Volterra)
    form integrates over $\tilde x \le x$ only.

    **Grouped-query attention.** Keys and values may have fewer heads than queries
    (`n_kv_heads` dividing `n_heads`; 1 is multi-query attention): query head $m$ reads
    key/value head $\lfloor m / (h / h_{kv}) \rfloor$, as Hugging Face's `repeat_kv`. The
    head size need not be `n_features / n_heads`, and the value size may differ from the
    query/key size.

    **Positions and masks** (keywords of `__call__`): `rotary` rotates queries and keys by
    their token positions ([`Rope`][itde.Rope]); `key_mask` removes keys from the token
    domain (padding), as quadrature weights that vanish on them; `window` restricts each
    query to the keys within a length $L$ of it (sliding-window attention,
    [`SlidingWindow`][itde.SlidingWindow]).

    Parameters are stored per head: `wq` of shape `[heads, features, head_dim]`, `wk`
    `[kv_heads, features, head_dim]`, `wv` `[kv_heads, features, value_dim]`, `wo`
    `[heads, value_dim, features]`, optional biases `bq` (`[heads, head_dim]`), `bk`
    (`[kv_heads, head_dim]`), `bv` (`[kv_heads, value_dim]`) and `bo` (`[features]`).

    **Query/key normalisation** (`qk_norm`, optional): an
    [`AbstractQueryKeyNorm`][itde.AbstractQueryKeyNorm]
    ([`PerHeadQKNorm`][itde.PerHeadQKNorm], [`JointQKNorm`][itde.JointQKNorm]) projects the
    queries and keys onto their spheres after the projections (biases included) and before
    RoPE, as Qwen3, Gemma 3, OLMo 2 and OLMoE do.

    **Soft-capping** (`score_cap`, optional): an [`itde.SoftCap`][itde.SoftCap] $c$ bounds
    the kernel's exponent, $e^{c \tanh(s_m / c)}$ instead of $e^{s_m}$ (Gemma 2's
    `attn_logit_softcapping`); the token weights, masks and windows act on top. The dense
    and blocked cores and the key/value cache cap exactly; `Fused()` refuses it.
    """

    wq: Float[Array, "heads features head_dim"] = kernel()
    wk: Float[Array, "kv_heads features head_dim"] = kernel()
    wv: Float[Array, "kv_heads features value_dim"] = kernel()
    wo: Float[Array, "heads value_dim features"] = kernel()
    bq: Float[Array, "heads head_dim"] | None
    bk: Float[Array, "kv_heads head_dim"] | None
    bv: Float[Array, "kv_heads value_dim"] | None
    bo: Float[Array, " features"] | None
    qk_norm: AbstractQueryKeyNorm | None = None
    score_cap: SoftCap | None = None

    def __check_init__(self):
        if getattr(self.wq, "ndim", None) != 3:
            raise ValueError(
                f"`Attention.wq` must have shape [heads, features, head_dim], got "
                f"{getattr(self.wq, 'shape', None)}; for one head use wq[None]."
            )
        h, d, dh = self.wq.shape
        hkv = self.wk.shape[0] if getattr(self.wk, "ndim", None) == 3 else None
        if hkv is None or self.wk.shape != (hkv, d, dh) or h % hkv:
            raise ValueError(
                f"`Attention.wk` has shape {getattr(self.wk, 'shape', None)}, expected "
                f"[kv_heads, {d}, {dh}] with kv_heads dividing the {h} query heads of `wq`."
            )
        if getattr(self.wv, "ndim", None) != 3 or self.wv.shape[:2] != (hkv, d):
            raise ValueError(
                f"`Attention.wv` has shape {getattr(self.wv, 'shape', None)}, expected "
                f"[{hkv}, {d}, value_dim] to match `wk`."
            )
        dv = self.wv.shape[2]
        if self.wo.shape != (h, dv, d):
            raise ValueError(f"`Attention.wo` has shape {self.wo.shape}, expected {(h, dv, d)}.")
        for name, shape in (("bq", (h, dh)), ("bk", (hkv, dh)), ("bv", (hkv, dv)), ("bo", (d,))):
            b = getattr(self, name)
            if b is not None and b.shape != shape:
                raise ValueError(f"`Attention.{name}` has shape {b.shape}, expected {shape}.")
        if self.qk_norm is not None:
            if not isinstance(self.qk_norm, AbstractQueryKeyNorm):
                raise TypeError(
                    f"`Attention.qk_norm`={self.qk_norm!r} must be None or an itde query/key "
                    "norm: itde.PerHeadQKNorm(q_norm, k_norm) or itde.JointQKNorm(...)."
                )
            self.qk_norm.check_shapes(h, hkv, dh)
        check_score_cap("Attention.score_cap", self.score_cap)

    def with_input_affine(self, scale, shift, feature_weights=None) -> Attention:
        r"""`A(a \circ z + b)` as one attention: $a$ scales the rows of $W^Q, W^K, W^V$
        and $b$ enters their biases ($b_Q + \int b\,W^Q$, with the feature weights)."""
        wq, wk, wv = (scale[None, :, None] * w for w in (self.wq, self.wk, self.wv))
        bq, bk, bv = self.bq, self.bk, self.bv
        if shift is not None:
            sw = weighted(shift, feature_weights)

            def fold(b, w):
                folded = jnp.einsum("d,hde->he", sw, w)
                return folded if b is None else b + folded

            bq, bk, bv = fold(bq, self.wq), fold(bk, self.wk), fold(bv, self.wv)
        return Attention(
            wq=wq, wk=wk, wv=wv, wo=self.wo, bq=bq, bk=bk, bv=bv, bo=self.bo, qk_norm=self.qk_norm,
            score_cap=self.score_cap,
        )

    def discretise(self, grid) -> tuple[Attention, None]:
        """Already discrete: `(self, None)` (unit head weights), on a grid of its width."""
        check_width("Attention", self.n_features, grid)
        return self, None

    @property
    def n_heads(self) -> int:
        return self.wq.shape[-3]

    @property
    def n_features(self) -> int:
        return self.wq.shape[-2]

    @property
    def head_dim(self) -> int:
        return self.wq.shape[-1]

    @property
    def n_kv_heads(self) -> int:
        return self.wk.shape[-3]

    @property
    def value_dim(self) -> int:
        return self.wv.shape[-1]

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        n_features: int,
        n_heads: int,
        *,
        bias: bool = True,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype=None,
    ) -> Attention:
        """Random discrete kernels (Xavier-uniform, as `nn.MultiheadAttention`).

        `n_kv_heads` (default `n_heads`) must divide `n_heads`; `head_dim` defaults to
        `n_features // n_heads`, which then must be exact."""
        if head_dim is None:
            n_features, n_heads = check_heads(n_features, n_heads)
            head_dim = n_features // n_heads
        else:
            n_features = check_int("n_features", n_features, minimum=1)
            n_heads = check_int("n_heads", n_heads, minimum=1)
            head_dim = check_int("head_dim", head_dim, minimum=1)
        hkv = n_heads if n_kv_heads is None else check_int("n_kv_heads", n_kv_heads, minimum=1)
        if n_heads % hkv:
            raise ValueError(
                f"`n_kv_heads`={hkv} must divide `n_heads`={n_heads} (each key/value head "
                "serves the same number of query heads)."
            )
        d, h, dh = n_features, n_heads, head_dim
        dtype = dtype or jnp.zeros(()).dtype
        kq, kk, kv, ko = jax.random.split(key, 4)
        lim = math.sqrt(6.0 / (d + 3 * h * dh))  # xavier on the packed [3 h dh, d] in_proj
        u = lambda k, s, a: uniform(k, s, dtype, -a, a)  # noqa: E731
        zeros = (lambda s: jnp.zeros(s, dtype)) if bias else (lambda s: None)
        return cls(
            wq=u(kq, (h, d, dh), lim),
            wk=u(kk, (hkv, d, dh), lim),
            wv=u(kv, (hkv, d, dh), lim),
            wo=u(ko, (h, dh, d), 1 / math.sqrt(h * dh)),
            bq=zeros((h, dh)),
            bk=zeros((hkv, dh)),
            bv=zeros((hkv, dh)),
            bo=zeros((d,)),
        )

    def fused_qkv(self) -> tuple[Float[Array, "features size"], Float[Array, " size"]]:
        """The query, key and value weights side by side, `[features, all sizes]`, and
        their biases `[all sizes]` (zero where a projection has none): the one matrix the
        projection multiplies by. It is a transposed copy of the weights; a loop that
        projects many times with the same weights (a prefill by chunks) computes it once
        and passes it to [`project_qkv`][itde.Attention.project_qkv]."""
        ws = (self.wq, self.wk, self.wv)
        bs = (self.bq, self.bk, self.bv)
        d = self.wq.shape[-2]
        flat = [jnp.moveaxis(w, 1, 0).reshape(d, -1).astype(self.wq.dtype) for w in ws]
        bias = jnp.concatenate([
            jnp.zeros(f.shape[1:], self.wq.dtype) if b is None else b.reshape(-1)
            for b, f in zip(bs, flat)
        ])  # fmt: skip
        return jnp.concatenate(flat, axis=1), bias

    def _qkv(self, uw, fused=None):
        """Queries, keys and values, each `[heads, tokens, size]`, from one matrix product:
        the three weights side by side as one `[features, all sizes]` matrix
        ([`fused_qkv`][itde.Attention.fused_qkv], or `fused` when given: one GEMM instead
        of three, the same sums; 0.885x the forward's time at batch 16, 128 tokens, width
        128, 4 layers in one interleaved run). For a few rows (a decode step: at most
        `FEW_ROWS`) without `fused`, each weight is read in its own
        `[heads, features, size]` layout by a product batched over the heads instead: the
        side-by-side matrix is a transposed copy of every weight, which costs more than
        the product itself when there is one row (a third of a GPT-2 decode step,
        measured)."""
        ws = (self.wq, self.wk, self.wv)
        bs = (self.bq, self.bk, self.bv)
        if fused is None and uw.shape[0] <= FEW_ROWS:
            out = []
            for w, b in zip(ws, bs):
                rows = jnp.broadcast_to(uw, (w.shape[0], *uw.shape))
                y = contract("hnd,hdk->hnk", rows, w)
                out.append(y if b is None else y + b[:, None, :].astype(y.dtype))
            return tuple(out)
        matrix, bias = self.fused_qkv() if fused is None else fused
        y = contract("nd,dk->nk", uw, matrix)
        if any(b is not None for b in bs):
            y = y + bias.astype(y.dtype)
        out, start = [], 0
        for w in ws:
            size = w.shape[0] * w.shape[2]
            part = y[:, start : start + size].reshape(uw.shape[0], w.shape[0], w.shape[2])
            out.append(jnp.moveaxis(part, 1, 0))
            start += size
        return tuple(out)

    def __call__(
        self,
        u: Float[Array, "tokens features"],
        *,
        feature_weights: np.ndarray | None = None,
        head_weights: np.ndarray | None = None,
        token_log_weights: Float[Array, " tokens"] | None = None,
        query_weights=None,
        score_bias=None,
        signed_weights: bool = False,
        causal: bool = False,
        core: AbstractAttentionCore = Dense(),
        key_mask: Bool[Array, " tokens"] | None = None,
        rotary: tuple[Array, Array] | None = None,
        window: TokenBand | None = None,
    ) -> Float[Array, "tokens features"]:
        """Apply $A$ to one sequence.

        **Arguments:**

        - `u`: the state, `[tokens, features]`.
        - `feature_weights`: quadrature weights on $\\Omega_y$ (`None`: all 1).
        - `head_weights`: quadrature weights on each head's domain $\\Omega_h$
          (`None`: all 1, so $|\\Omega_h| = d_\\mathrm{head}$).
        - `token_log_weights`: $\\log w_p$ on $\\Omega_x$ (`None`: uniform weights, whose
          constant log cancels in the softmax).
        - `query_weights`, `score_bias`, `signed_weights`: per-query token weights
          $W_{kp}$ and a score bias $b_m(x_k, x_p)$, passed to the attention core (see
          [`dense_attention`][itde.dense_attention]).
        - `causal`: integrate over $\\tilde x \\le x$ only.
        - `core`: how the token quadrature is evaluated: [`Dense()`][itde.Dense] (the
          `[heads, tokens, tokens]` score matrix), [`Blocked(block_size)`][itde.Blocked]
          (an online softmax over token blocks: memory linear in the tokens, the same
          result to round-off) or [`Fused()`][itde.Fused]
          (`jax.nn.dot_product_attention`, whose softmax runs in float32).
        - `key_mask`: `[tokens]` booleans (or integers 0/1), False on keys outside the
          sequence (padding): their quadrature weight is 0. A query keeps its own output;
          a query with no admissible key (e.g. a padded token before every real one under
          `causal`) gets attention output 0 (`bo` only).
        - `rotary`: `(cos, sin)` from [`Rope.cos_sin`][itde.Rope.cos_sin] at the token
          positions: queries and keys are rotated by them before the score.
        - `window`: the keys each query reads, a [`TokenBand`][itde.TokenBand]
          ([`SlidingWindow(length).on_nodes(nodes)`][itde.SlidingWindow.on_nodes] at the
          token nodes): sliding-window attention, $|x - \\tilde x| < L$ (with `causal`,
          $0 \\le x - \\tilde x < L$). `None`: every key.
        """
        q, k, v = self.project_qkv(u, feature_weights=feature_weights, rotary=rotary)
        if not isinstance(core, AbstractAttentionCore):
            raise TypeError(
                f"`core`={core!r} must be an itde attention core: itde.Dense(), "
                "itde.Blocked(block_size=...) or itde.Fused()."
            )
        lw = None if token_log_weights is None else token_log_weights.astype(u.dtype)
        key_mask = _key_mask(key_mask, u.shape[0], "key_mask")
        if key_mask is not None:
            if key_mask.ndim != 1:
                raise ValueError(
                    f"`key_mask` must be [tokens] for one sequence, got shape {key_mask.shape}."
                )
            lw = jnp.zeros((u.shape[0],), u.dtype) if lw is None else lw
            lw = jnp.where(key_mask, lw, jnp.asarray(-jnp.inf, u.dtype))
        # the window is passed only when there is one: a core written before windows still
        # serves every model without one
        extra = {} if window is None else {"window": window}
        return self.attend(
            q,
            k,
            v,
            head_weights=head_weights,
            core=core,
            token_log_weights=lw,
            query_weights=query_weights,
            score_bias=score_bias,
            signed_weights=signed_weights,
            causal=causal,
            **extra,
        )

    def project_qkv(self, u, *, feature_weights=None, rotary=None, fused=None):
        """The first half of the call: queries, keys and values
        `[heads or kv_heads, tokens, size]` of the tokens of `u`, queries and keys rotated
        by `rotary` after `qk_norm` (keys and values not yet repeated for grouped-query
        attention). A token's
        own row depends on that token alone, so a key/value cache
        ([`itde.KVCache`][itde.KVCache]) stores these rows. `fused`: this operator's
        [`fused_qkv`][itde.Attention.fused_qkv], computed once by a caller that projects
        many times."""
        q, k, v = self._qkv(weighted(u, feature_weights), fused)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if rotary is not None:
            q, k = rotate(q, rotary), rotate(k, rotary)
        return q, k, v

    def attend(self, q, k, v, *, head_weights=None, core=Dense(), **pair_terms):
        """The second half of the call: the attention output
        `[queries, features]` of queries `q` against keys `k` and values `v` from
        [`project_qkv`][itde.Attention.project_qkv] (grouped-query heads repeated here,
        queries scaled, the core's token quadrature, then the output projection). `core`:
        any callable `core(q, k, v, **pair_terms)`; `pair_terms` as the cores take them. A
        core with a true class attribute `reads_grouped_heads` gets the `n_kv_heads` keys
        and values as they are (query head m reads key/value head m // (h / h_kv)) and
        groups the queries itself: no copy of the keys and values per query head."""
        dtype = q.dtype
        rep = self.n_heads // self.n_kv_heads
        if rep > 1 and not getattr(core, "reads_grouped_heads", False):
            # grouped-query attention: query head m reads key/value head m // rep
            k, v = jnp.repeat(k, rep, axis=0), jnp.repeat(v, rep, axis=0)
        head_len = self.head_dim if head_weights is None else float(np.sum(head_weights))
        q = weighted(q, head_weights) * jnp.asarray(1.0 / math.sqrt(head_len), dtype)
        if self.score_cap is not None:  # passed only when set: older cores run the rest
            pair_terms = {**pair_terms, "score_cap": self.score_cap}
        o = core(q, k, v, **pair_terms)
        # the heads' outputs side by side, [queries, heads * value_dim], against W^O as one
        # [heads * value_dim, features] matrix (a view of it): XLA otherwise transposes
        # W^O at every call to match `o`'s head-major layout (a third of a decode step's
        # time at GPT-2's shape)
        h, n, e = o.shape
        o = jnp.moveaxis(weighted(o, head_weights), 0, 1).reshape(n, h * e)
        out = contract("nk,kd->nd", o, self.wo.reshape(h * e, self.wo.shape[-1]))
        if self.bo is not None:
            out = out + self.bo.astype(dtype)
        return out


def check_heads(n_features, n_heads) -> tuple[int, int]:
    """Validate a (model width, head count) pair, naming the argument and the fix."""
    for name, val in (("n_features", n_features), ("n_heads", n_heads)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"`{name}` must be a positive int, got {val!r}.")
    if n_features % n_heads:
        divisors = [h for h in range(1, n_features + 1) if n_features % h == 0]
        raise ValueError(
            f"`n_heads`={n_heads} does not divide the model width `n_features`={n_features}; "
            f"choose n_heads among {divisors}."
        )
    return int(n_features), int(n_heads)
