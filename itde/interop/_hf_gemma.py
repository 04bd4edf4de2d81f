r"""Gemma (1): the Llama equation with RMSNorm gains $1 + w$, token embeddings scaled by
$\sqrt{d}$ and a GeGLU feed-forward."""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from . import _hf_glue as g
from ._hf_family import AbstractHFFamily
from ._hf_llama import causal_checks, convert_llama_like, float64_patches, write_llama_like
from ._torch import _np

GEMMA_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "hidden_activation", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
    "rope_scaling", "rope_theta", "attention_bias", "is_causal",
    "use_bidirectional_attention",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class GemmaFamily(AbstractHFFamily):
    r"""`GemmaModel`: RMSNorm gain $1 + w$ (`GemmaRMSNorm`, computed in float32), token
    embeddings times $\sqrt{d}$ rounded to the embeddings' dtype (as
    `GemmaTextScaledWordEmbedding` multiplies by its `embed_scale` cast to the weight's
    dtype), the feed-forward `down(act(gate(x)) * up(x))` with `act` = `config.hidden_act`
    (`gelu_pytorch_tanh`: `GemmaConfig` turns a legacy `"gelu"` into it when built),
    scores scaled by `head_dim ** -0.5` (Gemma 1 has no `query_pre_attn_scalar`)."""

    classes: ClassVar[tuple[str, ...]] = ("GemmaModel",)
    fields: ClassVar[frozenset[str]] = GEMMA_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        causal_checks(config)
        g.refuse(
            config, "use_bidirectional_attention", lambda v: not v,
            "the converted decoder is causal; Gemma's bidirectional attention is not "
            "converted.",
        )  # fmt: skip
        act = g.activation("hidden_act", config.hidden_act)
        g.refuse(
            config, "hidden_activation",
            lambda v: v is None or g.HF_ACTIVATIONS.get(v) == act,
            f"transformers 5 computes config.hidden_act={config.hidden_act!r} and ignores "
            "hidden_activation (which transformers 4 preferred), so the model's activation "
            "is ambiguous; make the two agree or drop hidden_activation.",
        )  # fmt: skip

    def convert(self, model, name):
        emb = model.embed_tokens
        # Hugging Face multiplies by the buffer cast to the weight's dtype: that number
        scale = float(_np(emb.embed_scale.to(emb.weight.dtype)))
        return convert_llama_like(self, model, name, gain_offset=1.0, embedding_scale=scale)

    def write(self, m, model):
        emb = model.embed_tokens
        d = model.config.hidden_size
        scale = m.embedding_scale
        # a tolerance on purpose: the scale is sqrt(d) rounded to the weights' dtype
        if scale is None or not np.isclose(scale, math.sqrt(d), rtol=1e-6, atol=0.0):
            raise ValueError(
                f"`to_hf`: the model's `embedding_scale`={scale!r} is not Gemma's "
                f"sqrt(hidden_size) = {math.sqrt(d)!r} (up to the dtype's rounding); GemmaModel "
                "rebuilds it from the config (a buffer save_pretrained does not keep)."
            )
        write_llama_like(m, model, gain_offset=1.0)
        g.put(emb.embed_scale, np.asarray(scale))

    def float64_patches(self):
        from transformers.models.gemma import modeling_gemma

        return float64_patches(modeling_gemma, "Gemma", gain_offset=1.0)
