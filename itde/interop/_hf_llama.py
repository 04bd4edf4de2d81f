"""Llama: a causal pre-norm decoder with RMSNorm, rotary positions, a SwiGLU feed-forward
and grouped-query attention; the template of the rotary families."""

from __future__ import annotations

from typing import ClassVar

from .._blocks import PreNorm
from .._controls import Block
from .._operators._rope import Rope
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_model import HFTransformer
from ._positions import NoPositions

LLAMA_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "attention_bias", "mlp_bias", "pretraining_tp",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


def rope_checks(config, name: str) -> None:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"`config.rope_parameters['rope_type']`={rope_type!r} is not supported: {name} "
            "converts with the default RoPE frequencies only ('default')."
        )
    g.refuse(
        config, "rope_scaling",
        lambda v: not v or v.get("rope_type", v.get("type")) == "default",
        "the equation's RoPE has no frequency scaling; use rope_scaling=None.",
    )  # fmt: skip


def rms_norm_float64(gain_offset: float = 0.0):
    """An RMSNorm forward computing in the input's dtype when it is float64 (Hugging Face
    computes in float32), with gain `gain_offset + weight`."""

    def forward(self, h):
        import torch

        if h.dtype != torch.float64:
            return forward.original(self, h)
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        var = h.pow(2).mean(-1, keepdim=True)
        return (gain_offset + self.weight) * (h * torch.rsqrt(var + eps))

    return forward


def rotary_float64(self, x, position_ids):
    """A rotary embedding's forward computing its angles in the input's dtype when it is
    float64 (Hugging Face computes them in float32)."""
    import torch

    if x.dtype != torch.float64:
        return rotary_float64.originals[type(self)](self, x, position_ids)
    freqs = position_ids[..., None].to(x.dtype) * self.inv_freq.to(x.dtype)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling


rotary_float64.originals = {}


def float64_patches(module, prefix: str, gain_offset: float = 0.0):
    """The RMSNorm and rotary patches of a Llama-like `modeling_<family>` module."""
    norm = getattr(module, f"{prefix}RMSNorm")
    rotary = getattr(module, f"{prefix}RotaryEmbedding")
    rms = rms_norm_float64(gain_offset)
    rms.original = norm.forward
    rotary_float64.originals[rotary] = rotary.forward
    return ((norm, "forward", rms), (rotary, "forward", rotary_float64))


class LlamaFamily(AbstractHFFamily):
    """`LlamaModel` (any `head_dim`, `attention_bias`, `mlp_bias`, grouped-query
    attention)."""

    classes: ClassVar[tuple[str, ...]] = ("LlamaModel",)
    fields: ClassVar[frozenset[str]] = LLAMA_FIELDS

    def check(self, model, name):
        super().check(model, name)
        rope_checks(model.config, name)
        g.refuse(
            model.config, "pretraining_tp", lambda v: v in (None, 1),
            "pretraining_tp only splits the matrices; it must be 1 for an exact forward.",
        )  # fmt: skip

    def convert(self, model, name):
        config = model.config
        act = g.activation("hidden_act", config.hidden_act)
        h = config.num_attention_heads
        hkv = config.num_key_value_heads or h
        blocks = []
        for layer in model.layers:
            at, mlp = layer.self_attn, layer.mlp
            blocks.append(
                Block(
                    g.attention(at.q_proj, at.k_proj, at.v_proj, at.o_proj, h, hkv),
                    g.rms_norm(layer.input_layernorm),
                    g.gated_feedforward(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act),
                    g.rms_norm(layer.post_attention_layernorm),
                )
            )
        return HFTransformer(
            word_embeddings=g.a(model.embed_tokens.weight),
            position_embeddings=None,
            token_type_embeddings=None,
            embedding_norm=None,
            equation=g.equation(
                blocks,
                causal=True,
                block=PreNorm(),
                final_norm=g.rms_norm(model.norm),
                rope=Rope(g.a(model.rotary_emb.inv_freq)),
            ),  # fmt: skip
            positions=NoPositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        g.put(model.embed_tokens.weight, m.word_embeddings)
        g.put_rms_norm(m.equation.final_norm, model.norm)
        g.check_rope(m.equation.rope, model.rotary_emb)
        for block, layer in zip(g.layers(m), model.layers, strict=True):
            at, mlp = layer.self_attn, layer.mlp
            g.put_attention(block.attention, at.q_proj, at.k_proj, at.v_proj, at.o_proj)
            g.put_rms_norm(block.norm1, layer.input_layernorm)
            g.put_gated_feedforward(block.feedforward, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            g.put_rms_norm(block.norm2, layer.post_attention_layernorm)

    def float64_patches(self):
        from transformers.models.llama import modeling_llama

        return float64_patches(modeling_llama, "Llama")
