"""Llama: a causal pre-norm decoder with RMSNorm, rotary positions, a SwiGLU feed-forward
and grouped-query attention; the template of the rotary families.

The rotary families (Llama, Qwen2, Mistral, Gemma, GPT-NeoX) share the checks of their
rotary embedding (`rope_checks`, `check_rotary`) and of their causality
(`causal_checks`), and the Llama-like ones (Llama, Qwen2, Mistral, Gemma) share the
converter `convert_llama_like` / `write_llama_like`: a family is the refusals of its own
config fields plus the few numbers in which its forward differs (the norm gain's offset,
the embedding scale, keywords of the equation).
"""

from __future__ import annotations

import math
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
    "rope_theta", "attention_bias", "mlp_bias", "pretraining_tp", "is_causal",
    # dropout and the tied head leave the hidden states unchanged
    "attention_dropout", "tie_word_embeddings",
})  # fmt: skip

#: The rope types whose frequencies the config fixes once (`rotary_emb.inv_freq` holds
#: them, scaled where the type scales them) and whose cos and sin carry no factor: the
#: equation's `Rope(inv_freq)` is their rotation exactly.
EXACT_ROPE_TYPES = ("default", "linear", "llama3")

# Why each other rope type of `transformers` is refused.
_ROPE_REFUSALS = {
    "dynamic": "its frequencies are recomputed from the sequence's length once it exceeds "
    "max_position_embeddings (dynamic NTK scaling), so one set of frequencies is not the "
    "model at every length",
    "longrope": "it switches between short and long frequencies with the sequence's length "
    "and multiplies cos and sin by an attention factor",
    "yarn": "it multiplies cos and sin by an attention factor (mscale), which scales every "
    "score by its square on the rotated features only",
}


def rope_type(params) -> str:
    """The rope type of a `rope_parameters` (or legacy `rope_scaling`) dict."""
    if not params:
        return "default"
    return params.get("rope_type", params.get("type", "default"))


def rope_checks(config, name: str, rotary=None) -> None:
    """Refuse a rope type the equation's `Rope` does not compute exactly, and (given the
    model's rotary embedding `rotary`) an attention factor on its cos and sin."""
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(config, field, None)
        if params is not None and not isinstance(params, dict):
            raise ValueError(
                f"`config.{field}`={params!r} is not supported: {name} converts one dict of "
                "rope parameters (per-layer-type rope parameters are not converted)."
            )
        kind = rope_type(params)
        if kind not in EXACT_ROPE_TYPES:
            why = _ROPE_REFUSALS.get(
                kind, "itde has not checked this rope type's frequencies against Hugging Face"
            )
            raise ValueError(
                f"`config.{field}['rope_type']`={kind!r} is not supported: {why}. {name} "
                f"converts the rope types {', '.join(map(repr, EXACT_ROPE_TYPES))}, whose "
                "frequencies are fixed by the config and whose cos and sin carry no factor."
            )
    if rotary is not None:
        factor = float(getattr(rotary, "attention_scaling", 1.0))
        # exact: the rope types itde converts set the number 1.0 (no factor)
        if factor != 1.0:
            raise ValueError(
                f"`model.rotary_emb.attention_scaling`={factor!r} is not supported: the "
                "equation's RoPE rotates queries and keys without scaling them; a factor on "
                "cos and sin scales the scores of the rotated features only."
            )


def check_rotary(model, name: str, head_dim: int, *, partial: bool = False) -> Rope:
    """The equation's `Rope` of `model.rotary_emb` (its frequencies exactly: the rope type's
    scaling is already in `inv_freq`), after the rope checks. Unless `partial`, the rotation
    must cover the whole head, as the family's forward assumes."""
    rotary = model.rotary_emb
    rope_checks(model.config, name, rotary)
    inv_freq = rotary.inv_freq
    rotary_dim = 2 * int(inv_freq.shape[-1])
    if rotary_dim > head_dim or (not partial and rotary_dim != head_dim):
        factor = (model.config.rope_parameters or {}).get("partial_rotary_factor")
        raise ValueError(
            f"`config.rope_parameters['partial_rotary_factor']`={factor!r} is not supported: "
            f"it gives {rotary_dim} rotary features for heads of {head_dim}, and {name} "
            "rotates whole heads (partial rotary is GPT-NeoX's)."
        )
    return Rope(g.a(inv_freq))


def causal_checks(config) -> None:
    """Refuse `config.is_causal=False` (a field whose False switches bidirectional attention
    on: `transformers` builds a bidirectional mask for it)."""
    g.refuse(
        config, "is_causal", lambda v: v is None or bool(v),
        "the converted decoder is causal; a bidirectional mask is not converted.",
    )  # fmt: skip


def q_scale(attention, head_dim: int) -> float:
    """The factor folded into $W^Q$ when a family's score scaling (`attention.scaling`) is
    not $1/\\sqrt{d_\\mathrm{head}}$, the equation's."""
    scaling = float(attention.scaling)
    return 1.0 if scaling == head_dim**-0.5 else scaling * math.sqrt(head_dim)


def convert_llama_like(
    family: AbstractHFFamily,
    model,
    name: str,
    *,
    gain_offset: float = 0.0,
    embedding_scale: float | None = None,
    qk_norm=None,
    feedforward=None,
    **equation_fields,
) -> HFTransformer:
    """The equation of a Llama-like model (`embed_tokens`, `layers` of `self_attn` with
    `q/k/v/o_proj`, `mlp` with `gate/up/down_proj`, `input_layernorm` and
    `post_attention_layernorm`, final `norm`, `rotary_emb`).

    **Arguments:**

    - `gain_offset`: added to every RMSNorm weight (Gemma's gain is `1 + w`).
    - `embedding_scale`: the factor on the token embeddings (Gemma's $\\sqrt{d}$), or None.
    - `qk_norm`: the class of the query/key norm of `self_attn.q_norm`/`k_norm`
      (`PerHeadQKNorm`, `JointQKNorm`; their gains offset by `gain_offset` too), or None.
    - `feedforward`: a layer's feed-forward, `feedforward(layer, activation)` (a mixture of
      experts' `mlp`); None: the gated `mlp.gate_proj`, `up_proj`, `down_proj`.
    - `equation_fields`: further keywords of the equation (`TransformerIDE`), e.g. an
      attention core.
    """
    config = model.config
    act = g.activation("hidden_act", config.hidden_act)
    h = config.num_attention_heads
    hkv = config.num_key_value_heads or h
    head_dim = model.layers[0].self_attn.head_dim
    rope = check_rotary(model, name, head_dim)
    blocks = []
    if feedforward is None:

        def feedforward(layer, act):
            mlp = layer.mlp
            return g.gated_feedforward(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act)

    for layer in model.layers:
        at = layer.self_attn
        qk = None if qk_norm is None else g.qk_norm(qk_norm, at.q_norm, at.k_norm, gain_offset)
        blocks.append(
            Block(
                g.attention(
                    at.q_proj, at.k_proj, at.v_proj, at.o_proj, h, hkv, q_scale(at, head_dim), qk
                ),
                g.rms_norm(layer.input_layernorm, gain_offset),
                feedforward(layer, act),
                g.rms_norm(layer.post_attention_layernorm, gain_offset),
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
            final_norm=g.rms_norm(model.norm, gain_offset),
            rope=rope,
            **equation_fields,
        ),
        positions=NoPositions(),
        source=name,
        family=family,
        config=config_json(config),
        embedding_scale=embedding_scale,
    )


def write_llama_like(
    m: HFTransformer, model, *, gain_offset: float = 0.0, put_feedforward=None
) -> None:
    """Write a Llama-like `m` into `model` (the inverse of `convert_llama_like`; the
    query/key norms into `self_attn.q_norm`/`k_norm` where the module has them);
    `put_feedforward(ff, layer)` writes a layer's feed-forward (None: the gated `mlp`)."""
    g.put(model.embed_tokens.weight, m.word_embeddings)
    g.put_rms_norm(m.equation.final_norm, model.norm, gain_offset)
    g.check_rope(m.equation.rope, model.rotary_emb)
    for block, layer in zip(g.layers(m), model.layers, strict=True):
        at = layer.self_attn
        scale = q_scale(at, at.head_dim)
        qk = (at.q_norm, at.k_norm) if hasattr(at, "q_norm") else None
        g.put_attention(
            block.attention, at.q_proj, at.k_proj, at.v_proj, at.o_proj, scale, qk, gain_offset
        )
        g.put_rms_norm(block.norm1, layer.input_layernorm, gain_offset)
        if put_feedforward is None:
            mlp = layer.mlp
            g.put_gated_feedforward(block.feedforward, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        else:
            put_feedforward(block.feedforward, layer)
        g.put_rms_norm(block.norm2, layer.post_attention_layernorm, gain_offset)


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


def rotary_patch(module, prefix: str):
    """The rotary patch of a `modeling_<family>` module with a `<prefix>RotaryEmbedding`."""
    rotary = getattr(module, f"{prefix}RotaryEmbedding")
    rotary_float64.originals[rotary] = rotary.forward
    return (rotary, "forward", rotary_float64)


def float64_patches(module, prefix: str, gain_offset: float = 0.0):
    """The RMSNorm and rotary patches of a Llama-like `modeling_<family>` module."""
    norm = getattr(module, f"{prefix}RMSNorm")
    rms = rms_norm_float64(gain_offset)
    rms.original = norm.forward
    return ((norm, "forward", rms), rotary_patch(module, prefix))


class AbstractLlamaLike(AbstractHFFamily):
    """A decoder laid out as Llama (`embed_tokens`, `layers` of `self_attn`/`mlp`, `norm`,
    `rotary_emb`): converted by `convert_llama_like` (with the family's `window`), written
    back by `write_llama_like`, its float32 steps patched in
    `transformers.models.<module>.modeling_<module>` (classes `<prefix>RMSNorm`,
    `<prefix>RotaryEmbedding`)."""

    module: ClassVar[str]
    prefix: ClassVar[str]

    def convert(self, model, name):
        return convert_llama_like(self, model, name, window=self.window(model.config))

    def write(self, m, model):
        write_llama_like(m, model)

    def float64_patches(self):
        import importlib

        modeling = importlib.import_module(
            f"transformers.models.{self.module}.modeling_{self.module}"
        )
        return float64_patches(modeling, self.prefix)


class LlamaFamily(AbstractLlamaLike):
    """`LlamaModel` (any `head_dim`, `attention_bias`, `mlp_bias`, grouped-query
    attention; rope types `default`, `linear`, `llama3`)."""

    classes: ClassVar[tuple[str, ...]] = ("LlamaModel",)
    module: ClassVar[str] = "llama"
    prefix: ClassVar[str] = "Llama"
    fields: ClassVar[frozenset[str]] = LLAMA_FIELDS

    def check(self, model, name):
        super().check(model, name)
        rope_checks(model.config, name, model.rotary_emb)
        causal_checks(model.config)
        g.refuse(
            model.config, "pretraining_tp", lambda v: v in (None, 1),
            "pretraining_tp only splits the matrices; it must be 1 for an exact forward.",
        )  # fmt: skip
