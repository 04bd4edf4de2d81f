r"""Qwen2-MoE: Qwen2's attention (biases on the query, key and value projections, as
`qkv_bias` says; a sliding window in every layer or in none) with a sparse mixture of
experts as the feed-forward ([`MixtureOfExperts`][itde.MixtureOfExperts]): each token's
`num_experts_per_tok` of the `num_experts` experts, their softmax probabilities kept as they
are ([`SoftmaxTopK`][itde.SoftmaxTopK]) or renormalised over the chosen ones with
`norm_topk_prob` ([`RenormalisedTopK`][itde.RenormalisedTopK]), plus a shared expert
gated by the sigmoid of `shared_expert_gate`.

Which layers are sparse is `mlp_only_layers` and `decoder_sparse_step` (a layer is sparse
unless listed in `mlp_only_layers`, when `(layer + 1) % decoder_sparse_step == 0`). A model
whose layers are all sparse converts to mixtures; one whose layers are all dense (no
experts anywhere) to Qwen2's gated feed-forward; a model with both is refused: the
equation's controls are one layer structure stacked in depth (one compiled layer step), and
a dense layer's feed-forward is not a mixture of these experts.

The router's logits and auxiliary loss (`output_router_logits`, `router_aux_loss_coef`) are
outputs beside the hidden states: the converted model's hidden states and logits are
Hugging Face's, its `loss` the cross-entropy without the auxiliary term.
"""

from __future__ import annotations

from typing import ClassVar

from . import _hf_glue as g
from . import _hf_moe as moe
from ._hf_llama import AbstractLlamaLike, causal_checks, convert_llama_like, write_llama_like
from ._hf_qwen2 import QWEN2_FIELDS, check_layer_types, layer_window

QWEN2_MOE_FIELDS = QWEN2_FIELDS | frozenset({
    "qkv_bias", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
    "mlp_only_layers",
    # outputs beside the hidden states
    "output_router_logits", "router_aux_loss_coef",
})  # fmt: skip


def _sparse(layer) -> bool:
    """Whether `transformers` built this decoder layer's `mlp` as a sparse mixture (it has
    `experts`), as `Qwen2MoeDecoderLayer` decides from `mlp_only_layers` and
    `decoder_sparse_step`."""
    return hasattr(layer.mlp, "experts")


def check_sparse_layers(model, example: str) -> None:
    """Refuse a model whose layers are of both kinds, sparse mixtures and dense
    feed-forwards (`mlp_only_layers`, `decoder_sparse_step`; Qwen2-MoE, Qwen3-MoE), read
    off the layers `transformers` built; `example` names a checkpoint whose layers are all
    sparse."""
    config = model.config
    sparse = [_sparse(layer) for layer in model.layers]
    if any(sparse) and not all(sparse):
        dense = [i for i, s in enumerate(sparse) if not s]
        raise ValueError(
            f"`config.mlp_only_layers`={config.mlp_only_layers!r} with "
            f"`config.decoder_sparse_step`={config.decoder_sparse_step!r} is not supported: "
            f"they make layers {dense} dense and the others sparse mixtures of experts, and "
            "the converted equation stacks one layer structure in depth (one compiled layer "
            "step). Convert a model whose layers are all sparse (mlp_only_layers=[], "
            f"decoder_sparse_step=1, as {example}) or all dense (num_experts=0)."
        )


def sparse_or_dense(config):
    """A layer's feed-forward, `feedforward(layer, activation)`: its mixture of experts
    (`num_experts_per_tok` per token, renormalised with `norm_topk_prob`) where the layer
    is sparse, its gated `mlp` where it is dense."""
    k, norm = config.num_experts_per_tok, bool(config.norm_topk_prob)

    def feedforward(layer, act):
        mlp = layer.mlp
        if _sparse(layer):
            return moe.mixture(mlp, act, k, renormalise=norm)
        return g.gated_feedforward(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act)

    return feedforward


def put_sparse_or_dense(ff, layer) -> None:
    """Write a layer's feed-forward back (the inverse of `sparse_or_dense`)."""
    mlp = layer.mlp
    if _sparse(layer):
        moe.put_mixture(ff, mlp)
    else:
        g.put_gated_feedforward(ff, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


class Qwen2MoeFamily(AbstractLlamaLike):
    """`Qwen2MoeModel`: Qwen2's attention (q/k/v biases with `qkv_bias`, grouped-query,
    `layer_types` all full or all sliding) and in every layer a mixture of `num_experts`
    SwiGLU experts, `num_experts_per_tok` per token (`norm_topk_prob`: renormalised over
    them), plus the shared expert with its sigmoid gate; or every layer dense."""

    classes: ClassVar[tuple[str, ...]] = ("Qwen2MoeModel",)
    module: ClassVar[str] = "qwen2_moe"
    prefix: ClassVar[str] = "Qwen2Moe"
    fields: ClassVar[frozenset[str]] = QWEN2_MOE_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        causal_checks(config)
        check_layer_types(config, "Qwen2-MoE")
        check_sparse_layers(model, "Qwen1.5-MoE")

    def window(self, config):
        """Qwen2's window (see `Qwen2Family.window`)."""
        return layer_window(config)

    def convert(self, model, name):
        config = model.config
        return convert_llama_like(
            self, model, name, window=self.window(config), feedforward=sparse_or_dense(config)
        )

    def write(self, m, model):
        write_llama_like(m, model, put_feedforward=put_sparse_or_dense)
