r"""Mixtral: Mistral's equation (its attention, with the sliding window as the equation's
`SlidingWindow`) with a sparse mixture of experts as the feed-forward
([`MixtureOfExperts`][itde.MixtureOfExperts]): each token's `num_experts_per_tok`
experts of the `num_local_experts`, their softmax probabilities renormalised to sum to one
([`RenormalisedTopK`][itde.RenormalisedTopK]).

The router's logits and its auxiliary loss (`output_router_logits`,
`router_aux_loss_coef`) are outputs beside the hidden states, not part of them: the
converted model's hidden states and logits are Hugging Face's, and its `loss` is the
cross-entropy without the auxiliary term. `router_jitter_noise` multiplies the router's
input in training only (the converted model is the model in evaluation).
"""

from __future__ import annotations

from typing import ClassVar

from . import _hf_moe as moe
from ._hf_llama import AbstractLlamaLike, causal_checks, convert_llama_like, write_llama_like
from ._hf_mistral import MISTRAL_FIELDS, MistralFamily

MIXTRAL_FIELDS = MISTRAL_FIELDS | frozenset({
    "num_experts_per_tok", "num_local_experts",
    # outputs beside the hidden states, and noise in training only
    "output_router_logits", "router_aux_loss_coef", "router_jitter_noise",
})  # fmt: skip


class MixtralFamily(AbstractLlamaLike):
    """`MixtralModel`: Mistral's attention (grouped-query, `sliding_window`) and a sparse
    mixture of `num_local_experts` SwiGLU experts, `num_experts_per_tok` per token, gates
    renormalised over them."""

    classes: ClassVar[tuple[str, ...]] = ("MixtralModel",)
    module: ClassVar[str] = "mixtral"
    prefix: ClassVar[str] = "Mixtral"
    fields: ClassVar[frozenset[str]] = MIXTRAL_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)
        MistralFamily.check_window(model.config)

    def window(self, config):
        """Mistral's window (see `MistralFamily.window`)."""
        return MistralFamily().window(config)

    def convert(self, model, name):
        config = model.config
        k = config.num_experts_per_tok

        def feedforward(layer, act):
            return moe.mixture(layer.mlp, act, k, renormalise=True)

        return convert_llama_like(
            self, model, name, window=self.window(config), feedforward=feedforward
        )

    def write(self, m, model):
        write_llama_like(m, model, put_feedforward=lambda ff, layer: moe.put_mixture(ff, layer.mlp))

    def float64_patches(self):
        from transformers.models.mixtral import modeling_mixtral

        router = modeling_mixtral.MixtralTopKRouter
        moe.router_float64.original = router.forward
        return (*super().float64_patches(), (router, "forward", moe.router_float64))
