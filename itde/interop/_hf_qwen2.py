"""Qwen2: the Llama equation with biases on the query, key and value projections (none on
the output projection); its sliding window is refused."""

from __future__ import annotations

from typing import ClassVar

from . import _hf_glue as g
from ._hf_llama import AbstractLlamaLike, causal_checks

QWEN2_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "is_causal", "use_sliding_window", "sliding_window", "max_window_layers",
    "layer_types",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class Qwen2Family(AbstractLlamaLike):
    """`Qwen2Model` (grouped-query attention, q/k/v biases; full attention in every layer).

    `config.sliding_window` is inert while every entry of `config.layer_types` is
    `"full_attention"`: `Qwen2Attention` passes the window to the attention only in
    `"sliding_attention"` layers and `Qwen2Model` builds the windowed mask only when such a
    layer exists (`Qwen2Config` itself sets `sliding_window=None` unless
    `use_sliding_window`)."""

    classes: ClassVar[tuple[str, ...]] = ("Qwen2Model",)
    module: ClassVar[str] = "qwen2"
    prefix: ClassVar[str] = "Qwen2"
    fields: ClassVar[frozenset[str]] = QWEN2_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        causal_checks(config)
        g.refuse(
            config, "use_sliding_window", lambda v: not v,
            "Qwen2's window depends on the layer (layers from config.max_window_layers on "
            "attend within config.sliding_window tokens, the others to every token); the "
            "converted attention is full in every layer.",
        )  # fmt: skip
        g.refuse(
            config, "layer_types",
            lambda v: v is None or all(t == "full_attention" for t in v),
            "the converted attention is full ('full_attention') in every layer.",
        )  # fmt: skip
