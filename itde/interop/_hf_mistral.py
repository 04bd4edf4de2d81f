"""Mistral: the Llama equation (no biases) with its sliding window as the equation's
`SlidingWindow` (a length on the token domain)."""

from __future__ import annotations

from typing import ClassVar

from .._operators._window import SlidingWindow
from ._hf_llama import AbstractLlamaLike, causal_checks

MISTRAL_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "is_causal", "sliding_window",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class MistralFamily(AbstractLlamaLike):
    """`MistralModel` (grouped-query attention, any `head_dim`; `sliding_window` W: every
    query reads the keys less than W tokens back)."""

    classes: ClassVar[tuple[str, ...]] = ("MistralModel",)
    module: ClassVar[str] = "mistral"
    prefix: ClassVar[str] = "Mistral"
    fields: ClassVar[frozenset[str]] = MISTRAL_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)
        self.check_window(model.config)

    @staticmethod
    def check_window(config) -> None:
        """Refuse a `sliding_window` that is not None or an integer >= 1."""
        w = getattr(config, "sliding_window", None)
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(
                f"`config.sliding_window`={w!r} is not supported: it is the number of tokens "
                "each query reads (itself and those before it), so it must be an integer >= 1; "
                "set it to None for attention without a window."
            )

    def window(self, config):
        """Mistral's `sliding_window = W`: a query attends to the keys less than W tokens
        back (`kv_idx > q_idx - W`), the causal `SlidingWindow(W)` on the unit grid."""
        w = getattr(config, "sliding_window", None)
        return None if w is None else SlidingWindow(float(w))
