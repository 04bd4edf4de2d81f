"""Phi-3: the Llama equation with its query, key and value projections fused in one
`qkv_proj` and its gate and up projections in one `gate_up_proj` (split here into the
equation's per-head kernels and gated feed-forward, fused again by `to_hf`), a rotation of
the first `partial_rotary_factor` of each head, and Mistral's sliding window in every
layer."""

from __future__ import annotations

import types
from typing import ClassVar

from .._blocks import PreNorm
from .._controls import Block
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_llama import causal_checks, check_rotary, float64_patches, rope_type
from ._hf_mistral import MistralFamily
from ._hf_model import HFTransformer
from ._positions import NoPositions

PHI3_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
    "sliding_window", "is_causal",
    # read only by the longrope scaling, which is refused
    "original_max_position_embeddings",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "resid_pdrop", "embd_pdrop", "tie_word_embeddings",
    # the remote code a hub loader would import instead of transformers' class: the model
    # converted is transformers' own Phi3 class (from_hf looks it up), which never reads it
    "auto_map",
})  # fmt: skip

# Phi-3's rope scalings: `su` and `yarn` are the names `Phi3Config` turns into `longrope`.
_LONGROPE = ("longrope", "su", "yarn")


class Phi3Family(AbstractHFFamily):
    """`Phi3Model`: grouped-query attention with no biases, `qkv_proj` (rows: the queries of
    every head, then the keys, then the values) and `gate_up_proj` (rows: the gate, then the
    up projection; `down(up * act(gate))`), RMSNorm, the rotary embedding on the first
    `partial_rotary_factor * head_dim` features of each head (rope type `default`), and
    `sliding_window` W in every layer (a query reads the keys less than W tokens back, as
    Mistral's: the equation's `SlidingWindow(W)`). The LongRoPE scaling (`rope_type`
    `longrope`, spelled `su` or `yarn` in older configs: Phi-3's 128k checkpoints) is
    refused by name."""

    classes: ClassVar[tuple[str, ...]] = ("Phi3Model",)
    fields: ClassVar[frozenset[str]] = PHI3_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        causal_checks(config)
        for field in ("rope_parameters", "rope_scaling"):
            params = getattr(config, field, None)
            kind = rope_type(params) if isinstance(params, dict) else None
            if kind in _LONGROPE:
                raise ValueError(
                    f"`config.{field}['rope_type']`={kind!r} (LongRoPE, the scaling of Phi-3's "
                    "128k checkpoints) is not supported: it rotates by its short factors up to "
                    "config.original_max_position_embeddings tokens and by its long factors "
                    "beyond, so one set of frequencies is not the model at every length, and "
                    "it multiplies cos and sin by an attention factor. Convert a checkpoint "
                    "without it (Phi-3's 4k checkpoints: rope_scaling null, the default rope)."
                )
        MistralFamily.check_window(config)

    def window(self, config):
        """`sliding_window = W` in every layer: `SlidingWindow(W)`, as Mistral's
        (`create_sliding_window_causal_mask`: `kv_idx > q_idx - W`), or None."""
        return MistralFamily().window(config)

    def convert(self, model, name):
        config = model.config
        act = g.activation("hidden_act", config.hidden_act)
        h = config.num_attention_heads
        hkv = config.num_key_value_heads or h
        head_dim = model.layers[0].self_attn.head_dim
        rope = check_rotary(model, name, head_dim, partial=True)
        blocks = []
        for layer in model.layers:
            q, k, v = _split_qkv(layer.self_attn, h, hkv, head_dim)
            gate, up = _split_gate_up(layer.mlp)
            blocks.append(
                Block(
                    g.attention(q, k, v, layer.self_attn.o_proj, h, hkv),
                    g.rms_norm(layer.input_layernorm),
                    g.gated_feedforward(gate, up, layer.mlp.down_proj, act),
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
                rope=rope,
                window=self.window(config),
            ),
            positions=NoPositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        config = model.config
        h = config.num_attention_heads
        hkv = config.num_key_value_heads or h
        g.put(model.embed_tokens.weight, m.word_embeddings)
        g.put_rms_norm(m.equation.final_norm, model.norm)
        g.check_rope(m.equation.rope, model.rotary_emb)
        for block, layer in zip(g.layers(m), model.layers, strict=True):
            at, mlp = layer.self_attn, layer.mlp
            q, k, v = _split_qkv(at, h, hkv, at.head_dim)
            gate, up = _split_gate_up(mlp)
            g.put_attention(block.attention, q, k, v, at.o_proj)
            g.put_rms_norm(block.norm1, layer.input_layernorm)
            g.put_gated_feedforward(block.feedforward, gate, up, mlp.down_proj)
            g.put_rms_norm(block.norm2, layer.post_attention_layernorm)

    def float64_patches(self):
        from transformers.models.phi3 import modeling_phi3

        return float64_patches(modeling_phi3, "Phi3")


def _rows(linear, start: int, stop: int):
    """Rows `start:stop` of a bias-free `nn.Linear` as a linear of its own: a view, so
    reading it reads the fused weight and writing it (`to_hf`) writes into the fused weight."""
    return types.SimpleNamespace(weight=linear.weight[start:stop], bias=None)


def _split_qkv(attention, h: int, hkv: int, head_dim: int):
    """`qkv_proj` as the query, key and value linears (Phi-3's row order)."""
    qkv = attention.qkv_proj
    q, kv = h * head_dim, hkv * head_dim
    return _rows(qkv, 0, q), _rows(qkv, q, q + kv), _rows(qkv, q + kv, q + 2 * kv)


def _split_gate_up(mlp):
    """`gate_up_proj` as the gate and up linears (`gate, up = gate_up_proj(x).chunk(2)`)."""
    n = mlp.gate_up_proj.weight.shape[0] // 2
    return _rows(mlp.gate_up_proj, 0, n), _rows(mlp.gate_up_proj, n, 2 * n)
