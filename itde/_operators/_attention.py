r"""Self-attention as a quadrature-discretised nonlocal integral operator in the tokens."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from ._abstract import AbstractAttention
from ._blocked import blocked_attention, dense_attention, fused_attention
from ._precision import contract

ATTENTION_CORES = {
    "dense": dense_attention,
    "blocked": blocked_attention,
    "fused": fused_attention,
}
ATTENTION_IMPLS = tuple(ATTENTION_CORES)


def _weighted(u, weights):
    """Multiply the last axis by quadrature weights (skipped for the unit grid)."""
    if weights is None:
        return u
    return u * jnp.asarray(weights, dtype=u.dtype)


def _add_bias(x, b):
    return x if b is None else x + b.astype(x.dtype)[:, None, :]


class Attention(AbstractAttention):
    r"""Multi-head self-attention $A(u)$, the nonlocal integral operator of the paper's §2.

    For head $m$, query, key and value are integral transforms over the feature domain,
    $Q_m(x,\cdot) = \int_{\Omega_y} W^Q_m(\xi,\cdot)\,u(x,\xi)\,d\xi$ (likewise $K_m$,
    $V_m$), and
    $$A(u)(x,y)=\sum_m \frac{\int_{\Omega_x} e^{s_m(x,\tilde x)}\,\tilde V_m(\tilde x,y)\,d\tilde x}
      {\int_{\Omega_x} e^{s_m(x,\eta)}\,d\eta},\qquad
      s_m = \frac{\langle Q_m(x,\cdot), K_m(\tilde x,\cdot)\rangle_{\Omega_h}}{\sqrt{|\Omega_h|}},$$
    where $\tilde V_m(\tilde x, y) = \int_{\Omega_h} W^O_m(\eta, y) V_m(\tilde x,\eta)\,d\eta$ is
    the value with the head's output block absorbed (stored factored, $W^V_m$ then
    $W^O_m$, which is the same operator at lower cost). Token quadrature weights $w_p$
    enter as a log-bias, $\gamma_{kp} = \mathrm{softmax}_p(s_{kp} + \log w_p)$, exact for
    the ratio of the two integrals. On the unit grid (all weights 1) this is PyTorch's
    `nn.MultiheadAttention` with scaling $1/\sqrt{d_\mathrm{head}}$. The causal (Volterra)
    form integrates over $\tilde x \le x$ only.

    Parameters are stored per head: `wq, wk, wv` of shape `[heads, features, head_dim]`,
    `wo` of shape `[heads, head_dim, features]`, optional biases `bq, bk, bv`
    (`[heads, head_dim]`) and `bo` (`[features]`).
    """

    wq: Float[Array, "heads features head_dim"]
    wk: Float[Array, "heads features head_dim"]
    wv: Float[Array, "heads features head_dim"]
    wo: Float[Array, "heads head_dim features"]
    bq: Float[Array, "heads head_dim"] | None
    bk: Float[Array, "heads head_dim"] | None
    bv: Float[Array, "heads head_dim"] | None
    bo: Float[Array, " features"] | None

    def __check_init__(self):
        h, d, dh = self.wq.shape
        for name in ("wk", "wv"):
            if getattr(self, name).shape != (h, d, dh):
                raise ValueError(
                    f"`Attention.{name}` has shape {getattr(self, name).shape}, expected "
                    f"{(h, d, dh)} to match `wq`."
                )
        if self.wo.shape != (h, dh, d):
            raise ValueError(f"`Attention.wo` has shape {self.wo.shape}, expected {(h, dh, d)}.")

    def discretise(self, grid) -> tuple[Attention, None]:
        """Already discrete: `(self, None)` (unit head weights), on a grid of its width."""
        _check_width("Attention", self.n_features, grid)
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

    @classmethod
    def init(
        cls, key: PRNGKeyArray, n_features: int, n_heads: int, *, bias: bool = True, dtype=None
    ) -> Attention:
        """Random discrete kernels (Xavier-uniform, as `nn.MultiheadAttention`)."""
        n_features, n_heads = check_heads(n_features, n_heads)
        d, h = n_features, n_heads
        dh = d // h
        dtype = dtype or jnp.zeros(()).dtype
        kq, kk, kv, ko = jax.random.split(key, 4)
        lim = math.sqrt(6.0 / (d + 3 * d))  # xavier on the packed [3d, d] in_proj
        u = lambda k, s, a: jax.random.uniform(k, s, dtype, -a, a)  # noqa: E731
        zeros = (lambda s: jnp.zeros(s, dtype)) if bias else (lambda s: None)
        return cls(
            wq=u(kq, (h, d, dh), lim),
            wk=u(kk, (h, d, dh), lim),
            wv=u(kv, (h, d, dh), lim),
            wo=u(ko, (h, dh, d), 1 / math.sqrt(d)),
            bq=zeros((h, dh)),
            bk=zeros((h, dh)),
            bv=zeros((h, dh)),
            bo=zeros((d,)),
        )

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
        impl: str = "dense",
        block_size: int = 512,
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
        - `impl`: `"dense"` (the `[heads, tokens, tokens]` score matrix), `"blocked"`
          (token blocks of `block_size` with an online softmax: memory linear in the
          tokens, the same result to round-off) or `"fused"`
          (`jax.nn.dot_product_attention`, whose softmax runs in float32).
        """
        dtype = u.dtype
        uw = _weighted(u, feature_weights)
        q = _add_bias(contract("nd,hde->hne", uw, self.wq), self.bq)
        k = _add_bias(contract("nd,hde->hne", uw, self.wk), self.bk)
        v = _add_bias(contract("nd,hde->hne", uw, self.wv), self.bv)
        head_len = self.head_dim if head_weights is None else float(np.sum(head_weights))
        q = _weighted(q, head_weights) * jnp.asarray(1.0 / math.sqrt(head_len), dtype)
        if impl not in ATTENTION_CORES:
            raise ValueError(f"`impl`={impl!r} is not known; choose one of {ATTENTION_IMPLS}.")
        lw = None if token_log_weights is None else token_log_weights.astype(dtype)
        core = ATTENTION_CORES[impl]
        o = core(
            q,
            k,
            v,
            token_log_weights=lw,
            query_weights=query_weights,
            score_bias=score_bias,
            signed_weights=signed_weights,
            causal=causal,
            block_size=block_size,
        )
        out = contract("hne,hed->nd", _weighted(o, head_weights), self.wo)
        if self.bo is not None:
            out = out + self.bo.astype(dtype)
        return out


def _check_width(name: str, n_features: int, grid) -> None:
    if grid.n_features != n_features:
        raise ValueError(
            f"`grid.n_features`={grid.n_features} does not match the discrete {name}'s "
            f"{n_features} feature nodes; use a grid with n_features={n_features}."
        )


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
