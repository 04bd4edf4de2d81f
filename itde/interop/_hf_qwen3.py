"""Qwen3: the Llama equation with its queries and keys projected, head by head, onto their
spheres (RMSNorm with a learned gain over `head_dim`, before RoPE), and Qwen2's layers."""

from __future__ import annotations

from typing import ClassVar

from .._operators._qknorm import PerHeadQKNorm
from ._hf_llama import AbstractLlamaLike, causal_checks, convert_llama_like
from ._hf_qwen2 import check_layer_types, layer_window

QWEN3_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "attention_bias", "is_causal", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class Qwen3Family(AbstractLlamaLike):
    """`Qwen3Model`: grouped-query attention with `head_dim` independent of
    `hidden_size / num_attention_heads`, biases on all four attention projections when
    `attention_bias` (none by default), and `q_norm`/`k_norm` (`Qwen3RMSNorm` over
    `head_dim`, eps `rms_norm_eps`) on each head's query and key after the projection and
    before RoPE: the equation's [`PerHeadQKNorm`][itde.PerHeadQKNorm]. Its layers attend as
    `config.layer_types` says, as Qwen2's (every layer full, or every layer within
    `sliding_window` tokens; both kinds are refused)."""

    classes: ClassVar[tuple[str, ...]] = ("Qwen3Model",)
    module: ClassVar[str] = "qwen3"
    prefix: ClassVar[str] = "Qwen3"
    fields: ClassVar[frozenset[str]] = QWEN3_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)
        check_layer_types(model.config, "Qwen3")

    def window(self, config):
        """As Qwen2's: `SlidingWindow(config.sliding_window)` when every layer is a
        `"sliding_attention"` layer, None when every layer is full."""
        return layer_window(config)

    def convert(self, model, name):
        return convert_llama_like(
            self, model, name, qk_norm=PerHeadQKNorm, window=self.window(model.config)
        )
