r"""OLMoE: the Llama equation (pre-norm, RMSNorm, rotary, grouped-query attention) with
OLMo's queries and keys of a token projected together onto their spheres
([`JointQKNorm`][itde.JointQKNorm]: one RMSNorm over the whole `heads * head_dim`
projection, before the split into heads and RoPE) and a sparse mixture of experts as the
feed-forward ([`MixtureOfExperts`][itde.MixtureOfExperts]): each token's
`num_experts_per_tok` of the `num_experts` SwiGLU experts, their softmax probabilities kept
as they are ([`SoftmaxTopK`][itde.SoftmaxTopK], OLMoE-1B-7B's `norm_topk_prob=False`) or
renormalised over the chosen ones ([`RenormalisedTopK`][itde.RenormalisedTopK]). Every
layer is sparse; there is no shared expert.

The router's logits and auxiliary loss (`output_router_logits`, `router_aux_loss_coef`) are
outputs beside the hidden states: the converted model's hidden states and logits are
Hugging Face's, its `loss` the cross-entropy without the auxiliary term. `clip_qkv` (an
elementwise clamp of the normalised queries and keys and of the values) is refused unless
None.
"""

from __future__ import annotations

from typing import ClassVar

from .._operators._qknorm import JointQKNorm
from . import _hf_glue as g
from . import _hf_moe as moe
from ._hf_llama import AbstractLlamaLike, causal_checks, convert_llama_like, write_llama_like

OLMOE_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "attention_bias",
    "clip_qkv", "num_experts", "num_local_experts", "num_experts_per_tok", "norm_topk_prob",
    # outputs beside the hidden states
    "output_router_logits", "router_aux_loss_coef",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class OlmoeFamily(AbstractLlamaLike):
    """`OlmoeModel`: per layer $u + A(N_1 u)$, then $+ F(N_2 \\cdot)$ (pre-norm, RMSNorms
    computed in float32 by Hugging Face); `q_norm` over `num_attention_heads * head_dim` and
    `k_norm` over `num_key_value_heads * head_dim` on the projections, before the split into
    heads and RoPE ([`JointQKNorm`][itde.JointQKNorm]); biases on all four projections when
    `attention_bias`; in every layer a mixture of `num_experts` SwiGLU experts,
    `num_experts_per_tok` per token (`norm_topk_prob`: renormalised over them); scores
    scaled by `head_dim ** -0.5` (`head_dim = hidden_size / num_attention_heads`)."""

    classes: ClassVar[tuple[str, ...]] = ("OlmoeModel",)
    module: ClassVar[str] = "olmoe"
    prefix: ClassVar[str] = "Olmoe"
    fields: ClassVar[frozenset[str]] = OLMOE_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        causal_checks(config)
        g.refuse(
            config, "clip_qkv", lambda v: v is None,
            "OLMoE then clamps the normalised queries and keys and the values elementwise to "
            "[-clip_qkv, clip_qkv], which the converted attention does not; convert a model "
            "with clip_qkv=None (as allenai/OLMoE-1B-7B-0924).",
        )  # fmt: skip

    def convert(self, model, name):
        config = model.config
        k, norm = config.num_experts_per_tok, bool(config.norm_topk_prob)

        def feedforward(layer, act):
            return moe.mixture(layer.mlp, act, k, renormalise=norm)

        return convert_llama_like(self, model, name, qk_norm=JointQKNorm, feedforward=feedforward)

    def write(self, m, model):
        write_llama_like(m, model, put_feedforward=lambda ff, layer: moe.put_mixture(ff, layer.mlp))
