r"""Qwen3-MoE: Qwen3's attention (each head's query and key projected onto its sphere,
[`PerHeadQKNorm`][itde.PerHeadQKNorm]: RMSNorm over `head_dim` with a learned gain, before
RoPE; `head_dim` free of `hidden_size / num_attention_heads`) with a sparse mixture of
experts as the feed-forward ([`MixtureOfExperts`][itde.MixtureOfExperts]): each token's
`num_experts_per_tok` of the `num_experts` SwiGLU experts, their softmax probabilities
renormalised over the chosen ones with `norm_topk_prob` (Qwen3-30B-A3B's,
[`RenormalisedTopK`][itde.RenormalisedTopK]) or kept as they are
([`SoftmaxTopK`][itde.SoftmaxTopK]); no shared expert.

Which layers are sparse is `mlp_only_layers` and `decoder_sparse_step`, as in Qwen2-MoE: a
model whose layers are all sparse converts to mixtures, one whose layers are all dense to
the gated feed-forward of `intermediate_size`, one with both is refused (the equation's
controls are one layer structure stacked in depth). With `use_sliding_window` every layer
attends within `sliding_window` tokens (`Qwen3MoeConfig` sets `sliding_window` to None
otherwise): the causal [`SlidingWindow`][itde.SlidingWindow], as Mistral's.

The router's logits and auxiliary loss (`output_router_logits`, `router_aux_loss_coef`) are
outputs beside the hidden states: the converted model's hidden states and logits are
Hugging Face's, its `loss` the cross-entropy without the auxiliary term.
"""

from __future__ import annotations

from typing import ClassVar

from .._operators._qknorm import PerHeadQKNorm
from ._hf_llama import AbstractLlamaLike, causal_checks, convert_llama_like, write_llama_like
from ._hf_mistral import MistralFamily
from ._hf_qwen2_moe import check_sparse_layers, put_sparse_or_dense, sparse_or_dense

QWEN3_MOE_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "attention_bias", "use_sliding_window", "sliding_window",
    "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
    # outputs beside the hidden states
    "output_router_logits", "router_aux_loss_coef",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class Qwen3MoeFamily(AbstractLlamaLike):
    """`Qwen3MoeModel`: grouped-query attention with `q_norm`/`k_norm` on each head's query
    and key (`Qwen3MoeRMSNorm` over `head_dim`, eps `rms_norm_eps`, after the projection and
    before RoPE: [`PerHeadQKNorm`][itde.PerHeadQKNorm]), biases on all four projections when
    `attention_bias`, every layer within `sliding_window` tokens when it is set; in every
    layer a mixture of `num_experts` SwiGLU experts of `moe_intermediate_size`,
    `num_experts_per_tok` per token (`norm_topk_prob`: renormalised over them), or every
    layer dense."""

    classes: ClassVar[tuple[str, ...]] = ("Qwen3MoeModel",)
    module: ClassVar[str] = "qwen3_moe"
    prefix: ClassVar[str] = "Qwen3Moe"
    fields: ClassVar[frozenset[str]] = QWEN3_MOE_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)
        MistralFamily.check_window(model.config)
        check_sparse_layers(model, "Qwen3-30B-A3B")

    def window(self, config):
        """Mistral's window (see `MistralFamily.window`): `Qwen3MoeModel` masks with
        `sliding_window` in every layer when it is not None."""
        return MistralFamily().window(config)

    def convert(self, model, name):
        config = model.config
        return convert_llama_like(
            self, model, name, qk_norm=PerHeadQKNorm, window=self.window(config),
            feedforward=sparse_or_dense(config),
        )  # fmt: skip

    def write(self, m, model):
        write_llama_like(m, model, put_feedforward=put_sparse_or_dense)
