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


class GPT2Family(AbstractHFFamily):
    """`GPT2Model` (Conv1D weights stored `[in, out]`; Q, K, V in one `c_attn`)."""

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
            config, "scale_attn_by_inverse_layer_idx", lambda v: not v,
            "the equation's attention scales scores by 1/sqrt(head_dim) in every layer.",
        )  # fmt: skip
        g.refuse(
            config, "reorder_and_upcast_attn", lambda v: not v,
            "the converted attention computes in the model's dtype; set it to False.",
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
        for layer in model.h:
            c_attn = _np(layer.attn.c_attn.weight)  # Conv1D: [features, 3 * features]
            b_attn = _np(layer.attn.c_attn.bias)
            wq, wk, wv = np.split(c_attn, 3, axis=1)
            bq, bk, bv = np.split(b_attn, 3)
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
        for block, layer in zip(g.layers(m), model.h, strict=True):
            at, mlp = block.attention, layer.mlp
            flat = [g.heads_flat_in(w) for w in (at.wq, at.wk, at.wv)]
            g.put(layer.attn.c_attn.weight, np.concatenate(flat, axis=1))
            biases = [np.asarray(b).reshape(-1) for b in (at.bq, at.bk, at.bv)]
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
