r"""OLMo 2: a norm after each sublayer, inside the residual
([`OutputNorm`][itde.OutputNorm]: $u_t = N_1 A(u) + N_2 F(u)$), and the queries and keys
of a token projected together onto their spheres ([`JointQKNorm`][itde.JointQKNorm]: one
RMSNorm over the whole `heads * head_dim` projection, before RoPE)."""

from __future__ import annotations

from typing import ClassVar

from .._blocks import OutputNorm
from .._controls import Block
from .._operators._qknorm import JointQKNorm
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_llama import causal_checks, check_rotary, float64_patches, q_scale
from ._hf_model import HFTransformer
from ._positions import NoPositions

OLMO2_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "attention_bias",
    "is_causal",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


class Olmo2Family(AbstractHFFamily):
    r"""`Olmo2Model`: per layer $u \mapsto v + N_2 F(v)$, $v = u + N_1 A(u)$, the sublayers
    reading the state itself and their outputs normalised (`post_attention_layernorm`
    $N_1$, `post_feedforward_layernorm` $N_2$, RMSNorms computed in float32: the
    [`OutputNorm`][itde.OutputNorm] block); the queries and keys of a token normalised over
    the whole projection (`q_norm` over `num_attention_heads * head_dim`, `k_norm` over
    `num_key_value_heads * head_dim`, then split into heads and rotated:
    [`JointQKNorm`][itde.JointQKNorm]); grouped-query attention, biases on all four
    projections when `attention_bias`; the SwiGLU feed-forward of `hidden_act`; scores
    scaled by `head_dim ** -0.5`."""

    classes: ClassVar[tuple[str, ...]] = ("Olmo2Model",)
    fields: ClassVar[frozenset[str]] = OLMO2_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)

    def convert(self, model, name):
        config = model.config
        act = g.activation("hidden_act", config.hidden_act)
        h = config.num_attention_heads
        hkv = config.num_key_value_heads or h
        head_dim = model.layers[0].self_attn.head_dim
        rope = check_rotary(model, name, head_dim)
        blocks = []
        for layer in model.layers:
            at, mlp = layer.self_attn, layer.mlp
            qk = g.qk_norm(JointQKNorm, at.q_norm, at.k_norm)
            blocks.append(
                Block(
                    g.attention(
                        at.q_proj,
                        at.k_proj,
                        at.v_proj,
                        at.o_proj,
                        h,
                        hkv,
                        q_scale(at, head_dim),
                        qk,
                    ),  # fmt: skip
                    g.rms_norm(layer.post_attention_layernorm),
                    g.gated_feedforward(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act),
                    g.rms_norm(layer.post_feedforward_layernorm),
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
                block=OutputNorm(),
                final_norm=g.rms_norm(model.norm),
                rope=rope,
            ),  # fmt: skip
            positions=NoPositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        if not isinstance(m.equation.block, OutputNorm):
            raise ValueError(
                f"`to_hf`: the model's block is {m.equation.block!r}, not OLMo 2's "
                "OutputNorm() (a norm after each sublayer)."
            )
        g.put(model.embed_tokens.weight, m.word_embeddings)
        g.put_rms_norm(m.equation.final_norm, model.norm)
        g.check_rope(m.equation.rope, model.rotary_emb)
        for block, layer in zip(g.layers(m), model.layers, strict=True):
            at, mlp = layer.self_attn, layer.mlp
            g.put_attention(
                block.attention, at.q_proj, at.k_proj, at.v_proj, at.o_proj,
                q_scale(at, at.head_dim), (at.q_norm, at.k_norm),
            )  # fmt: skip
            g.put_rms_norm(block.norm1, layer.post_attention_layernorm)
            g.put_gated_feedforward(block.feedforward, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            g.put_rms_norm(block.norm2, layer.post_feedforward_layernorm)

    def float64_patches(self):
        from transformers.models.olmo2 import modeling_olmo2

        return float64_patches(modeling_olmo2, "Olmo2")
