"""BERT, RoBERTa and DistilBERT: post-LN encoders (`block=PostNorm()`) whose word, position
(and token type) embeddings and their LayerNorm are the initial condition; BERT and RoBERTa
also as decoders (`is_decoder=True`: causal self-attention, no cross-attention)."""

from __future__ import annotations

from typing import ClassVar

from .._blocks import PostNorm
from .._controls import Block
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_model import HFTransformer
from ._positions import AbsolutePositions, RobertaPositions

_BERT_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "is_decoder", "add_cross_attention",
    # transformers 5's BertModel and RobertaModel no longer read it (learned absolute
    # positions whatever its value): inert, as the outputs show (test_hf)
    "position_embedding_type",
    # dropout and heads outside the base model leave the hidden states unchanged
    "hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout",
    "tie_word_embeddings",
})  # fmt: skip


class BertFamily(AbstractHFFamily):
    r"""`BertModel` and `RobertaModel` (RoBERTa's positions count from `padding_idx + 1`).

    With `config.is_decoder=True` the self-attention is causal: Hugging Face builds its mask
    with `create_causal_mask` (key $\le$ query, and not padding), which is the equation's
    Volterra attention (`causal=True`) with the padding removed from the token domain.
    Positions stay those of the encoder (`0..N-1`; RoBERTa's from the token ids).
    Cross-attention (`add_cross_attention=True`) reads a second sequence and is refused."""

    classes: ClassVar[tuple[str, ...]] = ("BertModel", "RobertaModel")
    fields: ClassVar[frozenset[str]] = _BERT_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        g.refuse(
            config, "add_cross_attention", lambda v: not v,
            "cross-attention reads a second sequence, which the equation does not have.",
        )  # fmt: skip

    def build_kwargs(self, name, m=None):
        return {"add_pooling_layer": False}

    def convert(self, model, name):
        config = model.config
        act = g.activation("hidden_act", config.hidden_act)
        h = config.num_attention_heads
        blocks = []
        for layer in model.encoder.layer:
            sa, out = layer.attention.self, layer.attention.output
            blocks.append(
                Block(
                    g.attention(sa.query, sa.key, sa.value, out.dense, h),
                    g.layer_norm(out.LayerNorm),
                    g.feedforward(layer.intermediate.dense, layer.output.dense, act),
                    g.layer_norm(layer.output.LayerNorm),
                )
            )
        emb = model.embeddings
        roberta = name == "RobertaModel"
        return HFTransformer(
            word_embeddings=g.a(emb.word_embeddings.weight),
            position_embeddings=g.a(emb.position_embeddings.weight),
            token_type_embeddings=g.a(emb.token_type_embeddings.weight),
            embedding_norm=g.layer_norm(emb.LayerNorm),
            equation=g.equation(blocks, causal=bool(config.is_decoder), block=PostNorm()),
            positions=RobertaPositions(int(emb.padding_idx)) if roberta else AbsolutePositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        decoder = bool(model.config.is_decoder)
        if m.equation.causal != decoder:
            raise ValueError(
                f"`to_hf`: the itde model's attention is {'' if m.equation.causal else 'not '}"
                f"causal but its config has is_decoder={decoder}; set `config.is_decoder` to "
                "match `m.equation.causal`."
            )
        emb = model.embeddings
        g.put(emb.word_embeddings.weight, m.word_embeddings)
        g.put(emb.position_embeddings.weight, m.position_embeddings)
        g.put(emb.token_type_embeddings.weight, m.token_type_embeddings)
        g.put_layer_norm(m.embedding_norm, emb.LayerNorm)
        for block, layer in zip(g.layers(m), model.encoder.layer, strict=True):
            sa, out = layer.attention.self, layer.attention.output
            g.put_attention(block.attention, sa.query, sa.key, sa.value, out.dense)
            g.put_layer_norm(block.norm1, out.LayerNorm)
            g.put_feedforward(block.feedforward, layer.intermediate.dense, layer.output.dense)
            g.put_layer_norm(block.norm2, layer.output.LayerNorm)


class DistilBertFamily(AbstractHFFamily):
    """`DistilBertModel`: BERT without token types (sinusoidal position tables are read as
    the learned table they are stored as)."""

    classes: ClassVar[tuple[str, ...]] = ("DistilBertModel",)
    fields: ClassVar[frozenset[str]] = frozenset({
        "vocab_size", "dim", "n_layers", "n_heads", "hidden_dim", "activation",
        "max_position_embeddings", "sinusoidal_pos_embds", "dropout", "attention_dropout",
        "qa_dropout", "seq_classif_dropout", "tie_word_embeddings",
    })  # fmt: skip

    def convert(self, model, name):
        config = model.config
        act = g.activation("activation", config.activation)
        h = config.n_heads
        blocks = []
        for layer in model.transformer.layer:
            at = layer.attention
            blocks.append(
                Block(
                    g.attention(at.q_lin, at.k_lin, at.v_lin, at.out_lin, h),
                    g.layer_norm(layer.sa_layer_norm),
                    g.feedforward(layer.ffn.lin1, layer.ffn.lin2, act),
                    g.layer_norm(layer.output_layer_norm),
                )
            )
        emb = model.embeddings
        return HFTransformer(
            word_embeddings=g.a(emb.word_embeddings.weight),
            position_embeddings=g.a(emb.position_embeddings.weight),
            token_type_embeddings=None,
            embedding_norm=g.layer_norm(emb.LayerNorm),
            equation=g.equation(blocks, causal=False, block=PostNorm()),
            positions=AbsolutePositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        emb = model.embeddings
        g.put(emb.word_embeddings.weight, m.word_embeddings)
        g.put(emb.position_embeddings.weight, m.position_embeddings)
        g.put_layer_norm(m.embedding_norm, emb.LayerNorm)
        for block, layer in zip(g.layers(m), model.transformer.layer, strict=True):
            at = layer.attention
            g.put_attention(block.attention, at.q_lin, at.k_lin, at.v_lin, at.out_lin)
            g.put_layer_norm(block.norm1, layer.sa_layer_norm)
            g.put_feedforward(block.feedforward, layer.ffn.lin1, layer.ffn.lin2)
            g.put_layer_norm(block.norm2, layer.output_layer_norm)
