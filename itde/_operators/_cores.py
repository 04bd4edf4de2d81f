r"""Attention cores: how the softmax-weighted token quadrature of one head is computed.

Every core computes the same sum (see [`dense_attention`][itde.dense_attention]),
$o_{mk} = \sum_p \mathrm{softmax}_p(q_{mk}\cdot k_{mp} + \log w_p + b_{mkp})\, v_{mp}$, with
its own memory and speed: a core is a variant of the operator's evaluation, not of the
operator. [`Attention`][itde.Attention] takes one as `core=`, a
[`TransformerIDE`][itde.TransformerIDE] as `attention_core=`; a new core is a subclass of
[`AbstractAttentionCore`][itde.AbstractAttentionCore] plus an entry in
`itde.ATTENTION_CORES`, the names `TransformerIDE(attention_core=...)` accepts (no config
key or command-line flag reads them).
"""

from __future__ import annotations

import abc
from typing import ClassVar

import equinox as eqx
from jaxtyping import Array, Float

from .._checks import check_int, check_variant
from ._blocked import blocked_attention, dense_attention, fused_attention
from ._window import TokenBand


class AbstractAttentionCore(eqx.Module):
    r"""The evaluation of the attention quadrature for queries, keys and values
    `[heads, tokens, size]` (queries already scaled), the token log-weights, per-query
    weights, a score bias, the causal (Volterra) restriction and a sliding window (a
    [`TokenBand`][itde.TokenBand]: the keys each query reads).

    `signed_weights`: whether the core can take signed per-query weights (the
    partial-interval weights of a causal rule of order above 2)."""

    signed_weights: ClassVar[bool] = True

    @abc.abstractmethod
    def __call__(
        self,
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
    ) -> Float[Array, "heads tokens value_dim"]:
        """The attention output `[heads, tokens, value_dim]`. (`window` is passed only
        when there is one, so a core written before windows existed still runs every
        model without one.)"""


class Dense(AbstractAttentionCore):
    r"""The `[heads, tokens, tokens]` score matrix and its softmax in one piece: the
    reference, and the fastest for short sequences (XLA:CPU fuses it into one kernel).
    Memory $O(N^2)$ per head."""

    def __call__(self, q, k, v, **pair_terms):
        return dense_attention(q, k, v, **pair_terms)


class Blocked(AbstractAttentionCore):
    r"""Token blocks of `block_size` with an online softmax (FlashAttention's running
    maximum and sum): memory $O(N\,B)$ per head for $N$ tokens and block size $B$, the same
    result as [`Dense`][itde.Dense] to round-off (see
    [`blocked_attention`][itde.blocked_attention]). Key blocks outside the causal
    restriction or the sliding window are skipped: with a fixed window the time is linear
    in $N$."""

    block_size: int = eqx.field(static=True, default=512)

    def __check_init__(self):
        check_int("block_size", self.block_size, minimum=1)

    def __call__(self, q, k, v, **pair_terms):
        return blocked_attention(q, k, v, block_size=self.block_size, **pair_terms)


class Fused(AbstractAttentionCore):
    r"""`jax.nn.dot_product_attention` (softmax in float32; on an NVIDIA GPU
    `implementation="cudnn"` selects cuDNN's fused kernel). Takes non-negative per-query
    weights only (they become a log-bias): signed ones raise; a sliding window on an
    equispaced grid goes in as its `local_window_size` (see
    [`fused_attention`][itde.fused_attention]).

    `implementation`: `jax.nn.dot_product_attention`'s `implementation`: None (JAX
    chooses), `"xla"` or `"cudnn"`."""

    implementation: str | None = eqx.field(static=True, default=None)
    signed_weights: ClassVar[bool] = False

    def __check_init__(self):
        if self.implementation not in (None, "xla", "cudnn"):
            raise ValueError(
                f"`implementation`={self.implementation!r} must be None (JAX chooses), 'xla' "
                "or 'cudnn' (jax.nn.dot_product_attention's choices)."
            )

    def __call__(self, q, k, v, **pair_terms):
        return fused_attention(q, k, v, implementation=self.implementation, **pair_terms)


#: Attention cores by name, as `TransformerIDE(attention_core="blocked")` takes them.
ATTENTION_CORES: dict[str, type[AbstractAttentionCore]] = {
    "dense": Dense,
    "blocked": Blocked,
    "fused": Fused,
}
"""Attention cores by name, as `TransformerIDE(attention_core="blocked")` takes them (no
config key or command-line flag reads them)."""


def as_attention_core(core) -> AbstractAttentionCore:
    """An attention core from an instance or a name of `ATTENTION_CORES` (the edge where
    `TransformerIDE(attention_core=...)`'s string becomes a module)."""
    return check_variant(
        "attention_core", core, AbstractAttentionCore, ATTENTION_CORES,
        "an itde attention core (itde.Dense(), itde.Blocked(block_size=...), itde.Fused())",
    )  # fmt: skip
