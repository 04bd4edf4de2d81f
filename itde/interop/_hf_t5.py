r"""T5's encoder: a pre-norm encoder with T5's RMSNorm, unscaled scores, a relative
position bias shared by all layers, and a feed-forward without biases (ReLU, or gated as in
T5 v1.1).

The equation it becomes: `block=PreNorm()`, RMSNorm (T5's `T5LayerNorm`: no mean, no
bias), [`T5RelativeBias`][itde.T5RelativeBias] as `score_bias` (Hugging Face computes the
bias in layer 0 and passes it to every layer), $\sqrt{d_\mathrm{kv}}$ folded into $W^Q$
(T5 does not scale its scores; the equation's attention divides by
$\sqrt{d_\mathrm{head}}$), and `final_layer_norm` as the final norm. The token embeddings
(`shared`) are the initial condition; there is no position table.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from .._blocks import PreNorm
from .._controls import Block
from .._operators._bias import T5RelativeBias, t5_bucket
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_glue import HF_ACTIVATIONS
from ._hf_llama import rms_norm_float64
from ._hf_model import HFTransformer
from ._positions import NoPositions

T5_FIELDS = frozenset({
    "vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_heads",
    "relative_attention_num_buckets", "relative_attention_max_distance",
    "layer_norm_epsilon", "feed_forward_proj", "dense_act_fn", "is_gated_act", "is_decoder",
    # dropout, initialisation, the decoder's settings and the tied embeddings leave the
    # encoder's hidden states unchanged; `n_positions` is an unused legacy field
    "dropout_rate", "classifier_dropout", "initializer_factor", "num_decoder_layers",
    "scale_decoder_outputs", "tie_word_embeddings", "n_positions",
})  # fmt: skip


_CHUNK = 512


def _check_buckets(config) -> None:
    """The equation's buckets ([`t5_bucket`][itde.t5_bucket]) must be Hugging Face's for
    every distance: both take a float32 logarithm, and where a bucket boundary falls on an
    exact distance the two libraries' logarithms may round to different sides. Buckets are
    constant beyond `max_distance`, so the distances up to it decide."""
    import jax.numpy as jnp
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    n, far = config.relative_attention_num_buckets, config.relative_attention_max_distance
    g.refuse(
        config, "relative_attention_num_buckets",
        lambda v: isinstance(v, int) and v >= 4,
        "T5's bidirectional buckets need at least 4 (half for each direction, half of "
        "those exact).",
    )  # fmt: skip
    g.refuse(
        config, "relative_attention_max_distance",
        lambda v: isinstance(v, int) and v > n // 4,
        f"it must exceed the {n // 4} exact buckets (Hugging Face divides by the logarithm "
        "of their ratio).",
    )  # fmt: skip
    rel = np.arange(-far - 2, far + 3)
    theirs = T5Attention._relative_position_bucket(
        torch.as_tensor(rel), bidirectional=True, num_buckets=n, max_distance=far
    ).numpy()
    size = _CHUNK * -(-rel.size // _CHUNK)  # one shape for every config: compiled once
    padded = jnp.asarray(np.pad(rel, (0, size - rel.size)), jnp.int32)
    ours = np.asarray(t5_bucket(padded, bidirectional=True, n_buckets=n, max_distance=far))
    ours = ours[: rel.size]
    if not np.array_equal(theirs, ours):  # exact: integer bucket indices
        r = int(rel[np.argmax(theirs != ours)])
        raise ValueError(
            f"`config.relative_attention_max_distance`={far!r} with "
            f"`config.relative_attention_num_buckets`={n!r} is not supported: at distance {r} "
            "a bucket boundary falls on the distance itself, and the float32 logarithms of "
            "torch and XLA round it to different buckets, so the converted bias would differ "
            "from Hugging Face's there."
        )


class T5EncoderFamily(AbstractHFFamily):
    """`T5EncoderModel` (T5 and T5 v1.1: `feed_forward_proj` `"relu"` or `"gated-gelu"`,
    any activation of the Hugging Face names itde converts, `"relu"`, `"gelu"`,
    `"gelu_new"`, `"silu"`, ...: another is refused with the list; `n_heads * d_kv` may
    differ from `d_model`)."""

    classes: ClassVar[tuple[str, ...]] = ("T5EncoderModel",)
    fields: ClassVar[frozenset[str]] = T5_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        g.refuse(
            config, "is_decoder", lambda v: not v,
            "a T5 stack with is_decoder=True is causal with one-directional buckets and "
            "cross-attention layers; the encoder (is_decoder=False) is converted.",
        )  # fmt: skip
        act = getattr(config, "dense_act_fn", None)
        if act not in HF_ACTIVATIONS:
            raise ValueError(
                f"`config.feed_forward_proj`={config.feed_forward_proj!r} is not supported: "
                f"its activation {act!r} is not one the equation's feed-forward takes "
                f"({sorted(HF_ACTIVATIONS)}, optionally as 'gated-<name>')."
            )
        _check_buckets(config)

    def convert(self, model, name):
        config = model.config
        act = HF_ACTIVATIONS[config.dense_act_fn]
        h = config.num_heads
        q_scale = math.sqrt(config.d_kv)  # T5's scores are unscaled
        stack = model.encoder
        blocks = []
        for block in stack.block:
            sa, ff = block.layer[0], block.layer[-1]
            at, dense = sa.SelfAttention, ff.DenseReluDense
            blocks.append(
                Block(
                    g.attention(at.q, at.k, at.v, at.o, h, q_scale=q_scale),
                    g.rms_norm(sa.layer_norm),
                    _feedforward(config, dense, act),
                    g.rms_norm(ff.layer_norm),
                )
            )
        table = stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight
        bias = T5RelativeBias(
            g.a(table), bidirectional=True, max_distance=int(config.relative_attention_max_distance)
        )
        return HFTransformer(
            word_embeddings=g.a(model.shared.weight),
            position_embeddings=None,
            token_type_embeddings=None,
            embedding_norm=None,
            equation=g.equation(
                blocks,
                causal=False,
                block=PreNorm(),
                final_norm=g.rms_norm(stack.final_layer_norm),
                score_bias=bias,
            ),
            positions=NoPositions(),
            source=name,
            family=self,
            config=config_json(config),
        )

    def write(self, m, model):
        config = model.config
        bias = m.equation.score_bias
        far = config.relative_attention_max_distance
        if not (
            isinstance(bias, T5RelativeBias)
            and bias.bidirectional
            and bias.max_distance == far
            and bias.spacing == 1.0  # exact: the length unit given (default the number 1)
        ):
            raise ValueError(
                "`to_hf`: a T5 encoder's `equation.score_bias` must be the bidirectional "
                "T5RelativeBias on the unit grid with the config's "
                f"relative_attention_max_distance ({far}); "
                f"got {bias!r}."
            )
        stack = model.encoder
        g.put(model.shared.weight, m.word_embeddings)
        if stack.embed_tokens.weight is not model.shared.weight:
            g.put(stack.embed_tokens.weight, m.word_embeddings)
        g.put(stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight, bias.embedding)
        g.put_rms_norm(m.equation.final_norm, stack.final_layer_norm)
        q_scale = math.sqrt(config.d_kv)
        for block, layer in zip(g.layers(m), stack.block, strict=True):
            sa, ff = layer.layer[0], layer.layer[-1]
            at, dense = sa.SelfAttention, ff.DenseReluDense
            g.put_attention(block.attention, at.q, at.k, at.v, at.o, q_scale=q_scale)
            g.put_rms_norm(block.norm1, sa.layer_norm)
            if config.is_gated_act:
                g.put_gated_feedforward(block.feedforward, dense.wi_0, dense.wi_1, dense.wo)
            else:
                g.put_feedforward(block.feedforward, dense.wi, dense.wo)
            g.put_rms_norm(block.norm2, ff.layer_norm)

    def float64_patches(self):
        from transformers.models.t5 import modeling_t5

        norm = modeling_t5.T5LayerNorm
        forward = rms_norm_float64()
        forward.original = norm.forward
        return ((norm, "forward", forward),)


def _feedforward(config, dense, act):
    if config.is_gated_act:  # act(x W_0) * (x W_1), then W_o
        return g.gated_feedforward(dense.wi_0, dense.wi_1, dense.wo, act)
    return g.feedforward(dense.wi, dense.wo, act)
