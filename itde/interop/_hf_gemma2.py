r"""Gemma 2: Gemma's equation with a norm before and after each sublayer
([`SandwichNorm`][itde.SandwichNorm]), soft-capped attention scores
([`SoftCap`][itde.SoftCap]), scores scaled by `query_pre_attn_scalar`$^{-1/2}$, and
sliding and full attention layers from `layer_types` (a per-layer window as data,
[`LayerWindow`][itde.LayerWindow]); the logit soft-cap of `Gemma2ForCausalLM` is its
head's."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

from .._blocks import SandwichNorm
from .._controls import Block
from .._operators._softcap import SoftCap
from .._operators._window import LayerWindow
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, config_json
from ._hf_llama import causal_checks, check_rotary, float64_patches, q_scale
from ._hf_model import HFTransformer
from ._positions import NoPositions

GEMMA2_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "attention_bias", "is_causal", "use_bidirectional_attention",
    "query_pre_attn_scalar", "sliding_window", "layer_types", "attn_logit_softcapping",
    "final_logit_softcapping",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip

#: The attention kinds of `config.layer_types` (Gemma 2 and 3).
LAYER_KINDS = ("full_attention", "sliding_attention")


def check_layer_types(config) -> None:
    """Refuse a `layer_types` list of another length or other kinds, and a
    `sliding_window` that is not a positive integer where a layer slides."""
    kinds = list(config.layer_types or [])
    n = config.num_hidden_layers
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if len(kinds) != n or bad:
        raise ValueError(
            f"`config.layer_types`={config.layer_types!r} is not supported: it must name one "
            f"kind per layer ({n}), each of {', '.join(map(repr, LAYER_KINDS))}."
        )
    if "sliding_attention" in kinds:
        w = getattr(config, "sliding_window", None)
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(
                f"`config.sliding_window`={w!r} is not supported: the 'sliding_attention' "
                "layers read the config.sliding_window tokens up to the query (itself "
                "included), so it must be an integer >= 1."
            )


def layer_window(config, kind: str) -> LayerWindow:
    """The window of a layer of kind `kind`: Hugging Face's sliding mask `kv_idx > q_idx -
    W` (the causal `LayerWindow(W)` on the unit grid) or full attention (`inf`)."""
    length = float(config.sliding_window) if kind == "sliding_attention" else math.inf
    return LayerWindow(np.asarray(length, np.float64))


def windows_or_none(config):
    """One `LayerWindow` per layer, or None when every layer attends to every token."""
    kinds = list(config.layer_types)
    if "sliding_attention" not in kinds:
        return None
    return [layer_window(config, k) for k in kinds]


def check_score_caps(config) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = getattr(config, field, None)
        ok = v is None or (
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v > 0
        )
        if not ok:
            raise ValueError(
                f"`config.{field}`={v!r} is not supported: it is the bound c of c * tanh(x / c), "
                "so it must be a positive number, or None for no cap."
            )
    s = getattr(config, "query_pre_attn_scalar", None)
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
        raise ValueError(
            f"`config.query_pre_attn_scalar`={s!r} is not supported: the scores are scaled by "
            "its -1/2 power, so it must be a positive number."
        )


def score_cap(config) -> SoftCap | None:
    v = getattr(config, "attn_logit_softcapping", None)
    return None if v is None else SoftCap(float(v))


def embedding_scale(model) -> float:
    """Hugging Face's `embed_scale` buffer cast to the weights' dtype: that number."""
    from ._torch import _np

    emb = model.embed_tokens
    return float(_np(emb.embed_scale.to(emb.weight.dtype)))


def write_embedding(m, model) -> None:
    """The embeddings and their scale (checked against $\\sqrt{d}$, which the model
    rebuilds from its config)."""
    emb = model.embed_tokens
    d = model.config.hidden_size
    scale = m.embedding_scale
    # a tolerance on purpose: the scale is sqrt(d) rounded to the weights' dtype
    if scale is None or not np.isclose(scale, math.sqrt(d), rtol=1e-6, atol=0.0):
        raise ValueError(
            f"`to_hf`: the model's `embedding_scale`={scale!r} is not Gemma's "
            f"sqrt(hidden_size) = {math.sqrt(d)!r} (up to the dtype's rounding); the model "
            "rebuilds it from the config (a buffer save_pretrained does not keep)."
        )
    g.put(emb.weight, m.word_embeddings)
    g.put(emb.embed_scale, np.asarray(scale))


def check_layer_controls(m, config, cap) -> None:
    """`to_hf`: the model's per-layer windows and score cap must be the config's."""
    blocks = g.layers(m)
    want = windows_or_none(config)
    for n, block in enumerate(blocks):
        got = None if block.window is None else float(np.asarray(block.window.length))
        exp = None if want is None else float(np.asarray(want[n].length))
        if got != exp:
            raise ValueError(
                f"`to_hf`: layer {n}'s window is {got!r} tokens but the config's layer_types "
                f"and sliding_window give {exp!r} (None: no per-layer window); set them to "
                "the model's."
            )
        if block.attention.score_cap != cap:
            raise ValueError(
                f"`to_hf`: layer {n}'s score cap {block.attention.score_cap!r} is not the "
                f"config's attn_logit_softcapping ({cap!r})."
            )


class Gemma2Family(AbstractHFFamily):
    r"""`Gemma2Model`: per layer $u \mapsto v + M_2 F(N_2 v)$, $v = u + M_1 A(N_1 u)$
    (`input_layernorm` $N_1$, `post_attention_layernorm` $M_1$,
    `pre_feedforward_layernorm` $N_2$, `post_feedforward_layernorm` $M_2$, each an RMSNorm
    with gain $1 + w$ computed in float32: the [`SandwichNorm`][itde.SandwichNorm] block);
    scores $q \cdot k$ scaled by `query_pre_attn_scalar ** -0.5` (folded into $W^Q$) then
    capped by `attn_logit_softcapping` ([`SoftCap`][itde.SoftCap] on the attention);
    `layer_types` read per layer: a `"sliding_attention"` layer attends within
    `sliding_window` tokens, a `"full_attention"` layer to every token before, as a
    [`LayerWindow`][itde.LayerWindow] in the controls (one compiled layer step serves
    both); token embeddings times $\sqrt{d}$ rounded to their dtype; the GeGLU
    feed-forward with `hidden_activation`."""

    classes: ClassVar[tuple[str, ...]] = ("Gemma2Model",)
    fields: ClassVar[frozenset[str]] = GEMMA2_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        causal_checks(config)
        g.refuse(
            config, "use_bidirectional_attention", lambda v: not v,
            "the converted decoder is causal; bidirectional attention is not converted.",
        )  # fmt: skip
        act = g.activation("hidden_activation", config.hidden_activation)
        g.refuse(
            config, "hidden_act", lambda v: v is None or g.HF_ACTIVATIONS.get(v) == act,
            f"{name} computes config.hidden_activation={config.hidden_activation!r} and "
            "ignores hidden_act (published configs carry both, equal), so the model's "
            "activation is ambiguous; make the two agree or drop hidden_act.",
        )  # fmt: skip
        check_layer_types(config)
        check_score_caps(config)

    def convert(self, model, name):
        return convert_gemma(self, model, name, rope=check_rotary(model, name, _head_dim(model)))

    def write(self, m, model):
        write_gemma(m, model)
        g.check_rope(m.equation.rope, model.rotary_emb)

    def float64_patches(self):
        from transformers.models.gemma2 import modeling_gemma2

        return float64_patches(modeling_gemma2, "Gemma2", gain_offset=1.0)


def _head_dim(model) -> int:
    return model.layers[0].self_attn.head_dim


def convert_gemma(family, model, name, *, rope=None, layer_ropes=None, qk_norm=None):
    """The equation of a Gemma 2 or Gemma 3 text model: the sandwich block, the score
    cap, the per-layer windows, the scaled embeddings; `rope` (one for every layer) or
    `layer_ropes` (one `Rope` per layer); `qk_norm`: the query/key norm class of
    `self_attn.q_norm`/`k_norm` (gain $1 + w$), or None."""
    config = model.config
    act = g.activation("hidden_activation", config.hidden_activation)
    h = config.num_attention_heads
    hkv = config.num_key_value_heads or h
    head_dim = _head_dim(model)
    cap = score_cap(config)
    windows = windows_or_none(config)
    blocks = []
    for n, layer in enumerate(model.layers):
        at, mlp = layer.self_attn, layer.mlp
        qk = None if qk_norm is None else g.qk_norm(qk_norm, at.q_norm, at.k_norm, 1.0)
        att = g.attention(at.q_proj, at.k_proj, at.v_proj, at.o_proj, h, hkv,
                          q_scale(at, head_dim), qk)  # fmt: skip
        blocks.append(
            Block(
                dataclasses.replace(att, score_cap=cap),
                g.rms_norm(layer.input_layernorm, 1.0),
                g.gated_feedforward(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act),
                g.rms_norm(layer.pre_feedforward_layernorm, 1.0),
                out_norm1=g.rms_norm(layer.post_attention_layernorm, 1.0),
                out_norm2=g.rms_norm(layer.post_feedforward_layernorm, 1.0),
                window=None if windows is None else windows[n],
                rope=None if layer_ropes is None else layer_ropes[n],
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
            block=SandwichNorm(),
            final_norm=g.rms_norm(model.norm, 1.0),
            rope=rope,
        ),  # fmt: skip
        positions=NoPositions(),
        source=name,
        family=family,
        config=config_json(config),
        embedding_scale=embedding_scale(model),
    )


def write_gemma(m, model) -> None:
    """Write a converted Gemma 2 or Gemma 3 text model into `model` (the inverse of
    `convert_gemma`; the query/key norms where the module has them; RoPE is checked by the
    caller)."""
    config = model.config
    check_layer_controls(m, config, score_cap(config))
    if not isinstance(m.equation.block, SandwichNorm):
        raise ValueError(
            f"`to_hf`: the model's block is {m.equation.block!r}, not Gemma's "
            "SandwichNorm() (a norm before and after each sublayer)."
        )
    write_embedding(m, model)
    g.put_rms_norm(m.equation.final_norm, model.norm, 1.0)
    for block, layer in zip(g.layers(m), model.layers, strict=True):
        at, mlp = layer.self_attn, layer.mlp
        scale = q_scale(at, at.head_dim)
        qk = (at.q_norm, at.k_norm) if hasattr(at, "q_norm") else None
        g.put_attention(block.attention, at.q_proj, at.k_proj, at.v_proj, at.o_proj, scale,
                        qk, 1.0)  # fmt: skip
        g.put_rms_norm(block.norm1, layer.input_layernorm, 1.0)
        g.put_rms_norm(block.out_norm1, layer.post_attention_layernorm, 1.0)
        g.put_gated_feedforward(block.feedforward, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        g.put_rms_norm(block.norm2, layer.pre_feedforward_layernorm, 1.0)
        g.put_rms_norm(block.out_norm2, layer.post_feedforward_layernorm, 1.0)
