r"""GPT-NeoX (Pythia): a causal decoder with LayerNorm, partial rotary positions, one fused
`query_key_value` projection and, by default, the parallel block
$u + A(N_1 u) + F(N_2 u)$."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .._blocks import Parallel, PreNorm
from .._controls import Block
from .._operators._attention import Attention
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_llama import causal_checks, check_rotary, rotary_patch
from ._hf_model import HFTransformer
from ._positions import NoPositions
from ._torch import _np

NEOX_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "hidden_act", "max_position_embeddings", "layer_norm_eps",
    "rope_parameters", "rope_scaling", "use_parallel_residual", "attention_bias", "is_causal",
    # no cross-attention in GPTNeoXModel: is_decoder changes nothing
    "is_decoder",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "hidden_dropout", "classifier_dropout", "tie_word_embeddings",
})  # fmt: skip


def split_qkv(w: np.ndarray, b, heads: int):
    """`query_key_value` (`[features, heads * 3 * head_size]`, `[in, out]`) into Q, K, V
    `[features, heads * head_size]` and their biases.

    `GPTNeoXAttention` views the projection as `[..., heads, 3 * head_size]` and chunks the
    last axis: each head's output holds its query, key and value one after another (not
    all queries, then all keys, then all values as GPT-2's `c_attn` does)."""
    d = w.shape[0]
    w = w.reshape(d, heads, 3, -1)
    ws = [w[:, :, i, :].reshape(d, -1) for i in range(3)]
    if b is None:
        return ws, [None] * 3
    b = b.reshape(heads, 3, -1)
    return ws, [b[:, i, :] for i in range(3)]


def join_qkv(att: Attention) -> tuple[np.ndarray, np.ndarray | None]:
    """The inverse of `split_qkv`: `[features, heads * 3 * head_size]` and its bias."""
    w = np.stack([np.asarray(x) for x in (att.wq, att.wk, att.wv)], axis=2)  # [h, d, 3, hs]
    w = w.transpose(1, 0, 2, 3).reshape(w.shape[1], -1)
    if att.bq is None:
        return w, None
    b = np.stack([np.asarray(x) for x in (att.bq, att.bk, att.bv)], axis=1)  # [h, 3, hs]
    return w, b.reshape(-1)


class GPTNeoXFamily(AbstractHFFamily):
    """`GPTNeoXModel`: `use_parallel_residual=True` is the `Parallel()` block
    $u + A(N_1 u) + F(N_2 u)$, False the `PreNorm()` block; partial rotary (the first
    `2 * len(rotary_emb.inv_freq)` features of each head rotate, the rest pass, as
    `apply_rotary_pos_emb` splits by the cos size); LayerNorms; `attention_bias` on the
    fused projection and the output `dense`; final `final_layer_norm`."""

    classes: ClassVar[tuple[str, ...]] = ("GPTNeoXModel",)
    fields: ClassVar[frozenset[str]] = NEOX_FIELDS

    def check(self, model, name):
        super().check(model, name)
        causal_checks(model.config)
        if int(model.rotary_emb.inv_freq.shape[-1]) == 0:
            params = model.config.rope_parameters or {}
            factor = params.get("partial_rotary_factor")
            head = model.config.hidden_size // model.config.num_attention_heads
            raise ValueError(
                f"`config.rotary_pct`={factor!r} (`config.rope_parameters"
                f"['partial_rotary_factor']`) is not supported: it rotates none of the {head} "
                f"features of a head, a {name} without positions, which itde does not "
                f"convert; give a fraction with at least 2 rotary features per head "
                f"(rotary_pct >= {2 / head:g})."
            )

    def convert(self, model, name):
        config = model.config
        act = g.activation("hidden_act", config.hidden_act)
        h = config.num_attention_heads
        head_size = model.layers[0].attention.head_size
        rope = check_rotary(model, name, head_size, partial=True)
        blocks = []
        for layer in model.layers:
            at = layer.attention
            b = at.query_key_value.bias
            (wq, wk, wv), (bq, bk, bv) = split_qkv(
                g.lin(at.query_key_value), None if b is None else _np(b), h
            )
            blocks.append(
                Block(
                    Attention(
                        wq=g.heads_in(wq, h),
                        wk=g.heads_in(wk, h),
                        wv=g.heads_in(wv, h),
                        wo=g.heads_out(g.lin(at.dense), h),
                        bq=None if bq is None else jnp.asarray(bq),
                        bk=None if bk is None else jnp.asarray(bk),
                        bv=None if bv is None else jnp.asarray(bv),
                        bo=g.a(at.dense.bias),
                    ),
                    g.layer_norm(layer.input_layernorm),
                    g.feedforward(layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h, act),
                    g.layer_norm(layer.post_attention_layernorm),
                )
            )
        return HFTransformer(
            word_embeddings=g.a(model.embed_in.weight),
            position_embeddings=None,
            token_type_embeddings=None,
            embedding_norm=None,
            equation=g.equation(
                blocks,
                causal=True,
                block=Parallel() if config.use_parallel_residual else PreNorm(),
                final_norm=g.layer_norm(model.final_layer_norm),
                rope=rope,
            ),
            positions=NoPositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        g.put(model.embed_in.weight, m.word_embeddings)
        g.put_layer_norm(m.equation.final_norm, model.final_layer_norm)
        g.check_rope(m.equation.rope, model.rotary_emb)
        form = Parallel if model.config.use_parallel_residual else PreNorm
        if not isinstance(m.equation.block, form):
            raise ValueError(
                f"`to_hf`: the model's block is {type(m.equation.block).__name__}() but its "
                f"config has use_parallel_residual={model.config.use_parallel_residual!r}; "
                "GPT-NeoX's parallel block is Parallel(), its sequential one PreNorm()."
            )
        for block, layer in zip(g.layers(m), model.layers, strict=True):
            at = layer.attention
            w, b = join_qkv(block.attention)
            g.put_linear(at.query_key_value, w, b)
            g.put_linear(at.dense, np.asarray(block.attention.wo).reshape(-1, w.shape[0]),
                         block.attention.bo)  # fmt: skip
            g.put_layer_norm(block.norm1, layer.input_layernorm)
            g.put_feedforward(block.feedforward, layer.mlp.dense_h_to_4h, layer.mlp.dense_4h_to_h)
            g.put_layer_norm(block.norm2, layer.post_attention_layernorm)

    def float64_patches(self):
        from transformers.models.gpt_neox import modeling_gpt_neox

        return (rotary_patch(modeling_gpt_neox, "GPTNeoX"),)
