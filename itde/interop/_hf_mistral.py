"""Mistral: the Llama equation (no biases); its sliding window is refused until the
equation has a windowed attention kernel."""

from __future__ import annotations

from typing import ClassVar

from . import _hf_glue as g
from ._hf_family import AbstractHFFamily
from ._hf_llama import causal_checks, convert_llama_like, float64_patches, write_llama_like

MISTRAL_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "is_causal", "sliding_window",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class MistralFamily(AbstractHFFamily):
    """`MistralModel` with `sliding_window=None` (grouped-query attention, any
    `head_dim`)."""

    classes: ClassVar[tuple[str, ...]] = ("MistralModel",)
    fields: ClassVar[frozenset[str]] = MISTRAL_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)
        g.refuse(
            model.config, "sliding_window", lambda v: v is None,
            "Mistral attends within the last sliding_window tokens, which needs the windowed "
            "attention kernel; the converted attention sees every earlier token. For sequences "
            "no longer than the window, sliding_window=None is the same model.",
        )  # fmt: skip

    def equation_fields(self, config) -> dict:
        """Keywords of the equation besides the Llama equation's: where the window goes
        (one keyword, the windowed attention kernel of `config.sliding_window`) once the
        equation has it."""
        return {}

    def convert(self, model, name):
        return convert_llama_like(self, model, name, **self.equation_fields(model.config))

    def write(self, m, model):
        write_llama_like(m, model)

    def float64_patches(self):
        from transformers.models.mistral import modeling_mistral

        return float64_patches(modeling_mistral, "Mistral")
