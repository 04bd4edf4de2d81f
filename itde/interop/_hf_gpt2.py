"""GPT-2: a causal pre-LN decoder with learned absolute positions and a final `ln_f`."""

from __future__ import annotations

from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from .._blocks import PreNorm
from .._controls import Block
from .._operators._attention import Attention
from .._operators._feedforward import FeedForward
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_model import HFTransformer
from ._positions import AbsolutePositions
from ._torch import _np


def _layer_divisor(config, i: int) -> int:
    r"""The divisor folded into layer `i`'s $W^Q$ and query bias: Hugging Face scales the
    scores of layer `i` by $1/(i+1)$ on top of $1/\sqrt{d_\mathrm{head}}$ when
    `scale_attn_by_inverse_layer_idx` is set (1 otherwise)."""
    return i + 1 if config.scale_attn_by_inverse_layer_idx else 1


class GPT2Family(AbstractHFFamily):
    """`GPT2Model` (Conv1D weights stored `[in, out]`; Q, K, V in one `c_attn`).

    `scale_attn_by_inverse_layer_idx=True` (scores of layer $i$ scaled by $1/(i+1)$) is
    folded into that layer's $W^Q$ and query bias (divided by $i+1$), and multiplied back
    by `to_hf`. Where $i+1$ is not a power of two that division rounds, so those query
    weights come back within one unit in the last place, not always bit for bit.
    `reorder_and_upcast_attn=True` computes the same scores in another order and in float32
    (eager attention only): the same function, converted as it is; a float64 model's
    reference runs it in float64 inside [`hf_float64`][itde.interop.hf_float64]."""

    classes: ClassVar[tuple[str, ...]] = ("GPT2Model",)
    fields: ClassVar[frozenset[str]] = frozenset({
        "vocab_size", "n_embd", "n_head", "n_inner", "n_layer", "n_positions",
        "activation_function", "layer_norm_epsilon", "scale_attn_weights",
        "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention",
        # dropout and the sequence-summary head leave the hidden states unchanged
        "attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_activation",
        "summary_first_dropout", "summary_proj_to_labels", "summary_type",
        "summary_use_proj", "tie_word_embeddings",
    })  # fmt: skip

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        g.refuse(
            config, "scale_attn_weights", lambda v: v is None or bool(v),
            "the equation's attention scales scores by 1/sqrt(head_dim) "
            "(scale_attn_weights=True).",
        )  # fmt: skip
        g.refuse(
            config, "add_cross_attention", lambda v: not v,
            "cross-attention reads a second sequence, which the equation does not have.",
        )  # fmt: skip

    def convert(self, model, name):
        config = model.config
        act = g.activation("activation_function", config.activation_function)
        h = config.num_attention_heads
        blocks = []
        for i, layer in enumerate(model.h):
            c_attn = _np(layer.attn.c_attn.weight)  # Conv1D: [features, 3 * features]
            b_attn = _np(layer.attn.c_attn.bias)
            wq, wk, wv = np.split(c_attn, 3, axis=1)
            bq, bk, bv = np.split(b_attn, 3)
            k = _layer_divisor(config, i)
            if k != 1:  # one correctly rounded division
                wq, bq = wq / np.asarray(k, wq.dtype), bq / np.asarray(k, bq.dtype)
            mlp = layer.mlp
            blocks.append(
                Block(
                    Attention(
                        wq=g.heads_in(wq, h),
                        wk=g.heads_in(wk, h),
                        wv=g.heads_in(wv, h),
                        wo=g.heads_out(_np(layer.attn.c_proj.weight), h),
                        bq=jnp.asarray(bq.reshape(h, -1)),
                        bk=jnp.asarray(bk.reshape(h, -1)),
                        bv=jnp.asarray(bv.reshape(h, -1)),
                        bo=g.a(layer.attn.c_proj.bias),
                    ),
                    g.layer_norm(layer.ln_1),
                    FeedForward(
                        w1=g.a(mlp.c_fc.weight),
                        w2=g.a(mlp.c_proj.weight),
                        b1=g.a(mlp.c_fc.bias),
                        b2=g.a(mlp.c_proj.bias),
                        activation=act,
                    ),
                    g.layer_norm(layer.ln_2),
                )
            )
        return HFTransformer(
            word_embeddings=g.a(model.wte.weight),
            position_embeddings=g.a(model.wpe.weight),
            token_type_embeddings=None,
            embedding_norm=None,
            equation=g.equation(
                blocks, causal=True, block=PreNorm(), final_norm=g.layer_norm(model.ln_f)
            ),
            positions=AbsolutePositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        g.put(model.wte.weight, m.word_embeddings)
        g.put(model.wpe.weight, m.position_embeddings)
        g.put_layer_norm(m.equation.final_norm, model.ln_f)
        for i, (block, layer) in enumerate(zip(g.layers(m), model.h, strict=True)):
            at, mlp = block.attention, layer.mlp
            k = _layer_divisor(model.config, i)  # exact in float64, then rounded once by `put`
            flat = [g.heads_flat_in(w).astype(np.float64) for w in (at.wq, at.wk, at.wv)]
            flat[0] = flat[0] * k
            g.put(layer.attn.c_attn.weight, np.concatenate(flat, axis=1))
            biases = [np.asarray(b).reshape(-1) for b in (at.bq, at.bk, at.bv)]
            biases[0] = biases[0].astype(np.float64) * k
            g.put(layer.attn.c_attn.bias, np.concatenate(biases))
            g.put(layer.attn.c_proj.weight, np.asarray(at.wo).reshape(-1, at.wo.shape[-1]))
            g.put(layer.attn.c_proj.bias, at.bo)
            g.put_layer_norm(block.norm1, layer.ln_1)
            ff = block.feedforward
            g.put(mlp.c_fc.weight, ff.w1)
            g.put(mlp.c_fc.bias, ff.b1)
            g.put(mlp.c_proj.weight, ff.w2)
            g.put(mlp.c_proj.bias, ff.b2)
            g.put_layer_norm(block.norm2, layer.ln_2)

    def float64_patches(self):
        from transformers.models.gpt2 import modeling_gpt2

        attention = modeling_gpt2.GPT2Attention
        reordered = _reordered_float64
        reordered.original = attention._upcast_and_reordered_attn
        return ((attention, "_upcast_and_reordered_attn", reordered),)


def _reordered_float64(self, query, key, value, attention_mask=None):
    """GPT-2's `reorder_and_upcast_attn` eager attention computing in the input's dtype when
    it is float64 (Hugging Face casts the scores to float32)."""
    import torch

    if query.dtype != torch.float64:
        return _reordered_float64.original(self, query, key, value, attention_mask)
    scores = torch.matmul(query, key.transpose(-1, -2)) * self.scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.nn.functional.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2), weights
