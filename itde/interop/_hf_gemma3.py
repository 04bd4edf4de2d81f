r"""Gemma 3 (text): Gemma 2's equation ([`SandwichNorm`][itde.SandwichNorm], soft-caps
where set, `query_pre_attn_scalar`, sliding and full layers as a
[`LayerWindow`][itde.LayerWindow] per layer) with each head's query and key projected onto
their spheres ([`PerHeadQKNorm`][itde.PerHeadQKNorm], gain $1 + w$), and a RoPE base per
layer: the sliding layers rotate with `rope_local_base_freq`, the full ones with
`rope_theta` (a [`Rope`][itde.Rope] per layer in the controls, `Block.rope`: a
depth-dependent control of the attention kernel, as data)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from .._operators._qknorm import PerHeadQKNorm
from .._operators._rope import Rope
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily
from ._hf_gemma2 import (
    _head_dim,
    check_layer_types,
    check_score_caps,
    convert_gemma,
    write_gemma,
)
from ._hf_llama import EXACT_ROPE_TYPES, causal_checks, rms_norm_float64, rope_type

GEMMA3_FIELDS = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "rope_parameters", "rope_scaling",
    "rope_theta", "rope_local_base_freq", "attention_bias", "is_causal",
    "use_bidirectional_attention", "query_pre_attn_scalar", "sliding_window", "layer_types",
    "attn_logit_softcapping", "final_logit_softcapping", "_sliding_window_pattern",
    "sliding_window_pattern",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip


def layer_ropes(model, name: str) -> list[Rope]:
    """One `Rope` per layer: the frequencies `Gemma3RotaryEmbedding` holds for the layer's
    kind (`<kind>_inv_freq`, the rope type's scaling already in them), after refusing a
    rope type whose cos and sin carry a factor or whose frequencies change with the
    length."""
    rotary = model.rotary_emb
    config = model.config
    params = config.rope_parameters or {}
    ropes = {}
    for kind in sorted(set(config.layer_types)):
        p = params.get(kind) if isinstance(params, dict) else None
        t = rope_type(p)
        if t not in EXACT_ROPE_TYPES:
            raise ValueError(
                f"`config.rope_parameters[{kind!r}]['rope_type']`={t!r} is not supported: "
                f"{name} converts the rope types {', '.join(map(repr, EXACT_ROPE_TYPES))}, "
                "whose frequencies are fixed by the config and whose cos and sin carry no "
                "factor."
            )
        factor = float(getattr(rotary, f"{kind}_attention_scaling", 1.0))
        if factor != 1.0:  # exact: the converted rope types set the number 1.0
            raise ValueError(
                f"`model.rotary_emb.{kind}_attention_scaling`={factor!r} is not supported: "
                "the equation's RoPE rotates queries and keys without scaling them."
            )
        inv = getattr(rotary, f"{kind}_inv_freq")
        if 2 * int(inv.shape[-1]) != _head_dim(model):
            raise ValueError(
                f"`config.rope_parameters[{kind!r}]` gives {2 * int(inv.shape[-1])} rotary "
                f"features for heads of {_head_dim(model)}; {name} rotates whole heads."
            )
        ropes[kind] = Rope(g.a(inv))
    return [ropes[k] for k in config.layer_types]


class Gemma3TextFamily(AbstractHFFamily):
    r"""`Gemma3TextModel` (built from a `Gemma3TextConfig`): Gemma 2's layer
    $u \mapsto v + M_2 F(N_2 v)$, $v = u + M_1 A(N_1 u)$ (four RMSNorms of gain $1 + w$:
    [`SandwichNorm`][itde.SandwichNorm]), `q_norm`/`k_norm` over `head_dim` on each head's
    query and key before RoPE ([`PerHeadQKNorm`][itde.PerHeadQKNorm], gain $1 + w$, the
    factor $\sqrt{d_\mathrm{head} / \text{query\_pre\_attn\_scalar}}$ folded into the
    query gain), soft-caps where `attn_logit_softcapping` / `final_logit_softcapping` are
    set (None in the published configs), `layer_types` read per layer: a sliding layer
    attends within `sliding_window` tokens and rotates with the base of
    `rope_parameters['sliding_attention']` (`rope_local_base_freq`), a full layer to every
    token before with `rope_parameters['full_attention']` (`rope_theta`, with its linear
    scaling where set): a [`LayerWindow`][itde.LayerWindow] and a [`Rope`][itde.Rope] per
    layer in the controls; token embeddings times $\sqrt{d}$ rounded to their dtype.
    `use_bidirectional_attention` (EmbeddingGemma) is refused."""

    classes: ClassVar[tuple[str, ...]] = ("Gemma3TextModel",)
    fields: ClassVar[frozenset[str]] = GEMMA3_FIELDS

    def check(self, model, name):
        super().check(model, name)
        config = model.config
        causal_checks(config)
        g.refuse(
            config, "use_bidirectional_attention", lambda v: not v,
            "the converted decoder is causal; bidirectional attention (EmbeddingGemma) is "
            "not converted.",
        )  # fmt: skip
        act = g.activation("hidden_activation", config.hidden_activation)
        g.refuse(
            config, "hidden_act", lambda v: v is None or g.HF_ACTIVATIONS.get(v) == act,
            f"{name} computes config.hidden_activation={config.hidden_activation!r} and "
            "ignores hidden_act, so the model's activation is ambiguous; make the two agree "
            "or drop hidden_act.",
        )  # fmt: skip
        check_layer_types(config)
        check_score_caps(config)

    def convert(self, model, name):
        return convert_gemma(
            self, model, name, layer_ropes=layer_ropes(model, name), qk_norm=PerHeadQKNorm
        )

    def write(self, m, model):
        write_gemma(m, model)
        want = layer_ropes(model, type(model).__name__)
        for n, (block, rope) in enumerate(zip(g.layers(m), want, strict=True)):
            ours = np.asarray(block.rope.inv_freq, np.float64) if block.rope else None
            theirs = np.asarray(rope.inv_freq, np.float64)
            # a tolerance on purpose: Hugging Face keeps `inv_freq` in float32 (a check)
            if ours is None or not np.allclose(ours, theirs, rtol=1e-6, atol=0.0):
                raise ValueError(
                    f"`to_hf`: layer {n}'s RoPE frequencies are not the ones the config gives "
                    f"its {model.config.layer_types[n]!r} layers; set the config's "
                    "rope_parameters to match them."
                )

    def float64_patches(self):
        from transformers.models.gemma3 import modeling_gemma3

        norm = modeling_gemma3.Gemma3RMSNorm
        rms = rms_norm_float64(1.0)
        rms.original = norm.forward
        rotary = modeling_gemma3.Gemma3RotaryEmbedding
        return ((norm, "forward", rms), (rotary, "forward", _rotary_float64(rotary.forward)))


def _rotary_float64(original):
    """`Gemma3RotaryEmbedding.forward` computing its angles in float64 for a float64 input
    (Hugging Face computes them in float32)."""

    def forward(self, x, position_ids, layer_type=None):
        import torch

        if x.dtype != torch.float64:
            return original(self, x, position_ids, layer_type)
        inv = getattr(self, f"{layer_type}_inv_freq").to(x.dtype)
        scale = getattr(self, f"{layer_type}_attention_scaling")
        freqs = position_ids[..., None].to(x.dtype) * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * scale, emb.sin() * scale

    return forward
