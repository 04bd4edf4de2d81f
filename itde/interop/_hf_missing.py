"""What a Hugging Face model that `from_hf` does not convert is missing, by name.

A model of a class no family lists is refused with the features of its forward the
converted equation does not express, read off the model itself (its modules and its
config: a `q_norm` module is query/key normalisation wherever it sits), and the nearest
family that converts: the family its own family derives from (`NEAREST`, by
`config.model_type`), or else the supported family that shares its config's fields most.
Never only a list of classes.
"""

from __future__ import annotations

from typing import Any

# config.model_type -> (the family's name, the supported classes nearest to it, first found
# in HF_FAMILIES wins): where the family's forward was derived from.
NEAREST: dict[str, tuple[str, tuple[str, ...]]] = {
    "gemma2": ("Gemma 2", ("GemmaForCausalLM",)),
    "gemma3": ("Gemma 3", ("Gemma2ForCausalLM", "GemmaForCausalLM")),
    "gemma3_text": ("Gemma 3", ("Gemma2ForCausalLM", "GemmaForCausalLM")),
    "olmo": ("OLMo", ("LlamaForCausalLM",)),
    "olmo2": ("OLMo 2", ("LlamaForCausalLM",)),
    "olmoe": ("OLMoE", ("MixtralForCausalLM", "LlamaForCausalLM")),
    "qwen3_moe": ("Qwen3-MoE", ("Qwen2MoeForCausalLM", "Qwen3ForCausalLM")),
    "qwen2_moe": ("Qwen2-MoE", ("Qwen2ForCausalLM",)),
    "mixtral": ("Mixtral", ("MistralForCausalLM",)),
    "phi": ("Phi-1/Phi-2", ("GPTNeoXForCausalLM",)),
    "phimoe": ("Phi-3.5-MoE", ("MixtralForCausalLM", "Phi3ForCausalLM")),
    "starcoder2": ("StarCoder2", ("MistralForCausalLM",)),
    "stablelm": ("StableLM", ("GPTNeoXForCausalLM",)),
    "cohere": ("Cohere", ("LlamaForCausalLM",)),
    "granite": ("Granite", ("LlamaForCausalLM",)),
    "falcon": ("Falcon", ("GPTNeoXForCausalLM",)),
}


def _modules(model) -> set[str]:
    """The last part of every submodule's name (`q_norm`, `experts`, ...)."""
    named = getattr(model, "named_modules", lambda: ())()
    return {name.rsplit(".", 1)[-1] for name, _ in named}


def _set(config, name) -> Any:
    value = getattr(config, name, None)
    return None if value is False else value


def missing_features(model) -> list[str]:
    """The features of `model`'s forward that the converted equation does not express (or
    that no converter reads from a model of its class), each named with where it lives."""
    config = getattr(model, "config", None)
    parts = _modules(model)
    found = []
    if {"q_norm", "k_norm"} & parts or {"q_layernorm", "k_layernorm"} & parts:
        found.append("query/key normalisation (`self_attn.q_norm`, `self_attn.k_norm`)")
    after = sorted(parts & {"post_feedforward_layernorm", "pre_feedforward_layernorm"})
    if after:
        found.append(f"norms around each sublayer (`{'`, `'.join(after)}`)")
    experts = [k for k in ("num_experts", "num_local_experts", "n_routed_experts")
               if _set(config, k)]  # fmt: skip
    if "experts" in parts or experts:
        where = f"`config.{experts[0]}`" if experts else "`mlp.experts`"
        found.append(f"a sparse mixture of experts ({where}, top-k routing per token)")
    caps = [k for k in ("attn_logit_softcapping", "final_logit_softcapping") if _set(config, k)]
    if caps:
        found.append(f"soft-capping (`config.{'`, `config.'.join(caps)}`)")
    kinds = _set(config, "layer_types")
    if isinstance(kinds, (list, tuple)) and len(set(kinds)) > 1:
        found.append(f"layers of different kinds (`config.layer_types`: {sorted(set(kinds))})")
    rope = _set(config, "rope_parameters")
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        found.append(f"a RoPE per layer type (`config.rope_parameters` for {sorted(rope)})")
    if _set(config, "query_pre_attn_scalar") is not None:
        found.append("scores scaled by `config.query_pre_attn_scalar`")
    if _set(config, "is_encoder_decoder"):
        found.append("a decoder with cross-attention (`config.is_encoder_decoder`)")
    return found


def _nearest(model, families) -> tuple[str | None, str | None]:
    """(the model's family name, the nearest supported class) by `NEAREST`, or else the
    supported class whose family reads most of the model's set config fields."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    label, candidates = NEAREST.get(model_type, (None, ()))
    for cls in candidates:
        if cls in families:
            return label, cls
    config = getattr(model, "config", None)
    keys = set(getattr(config, "to_dict", dict)()) if config is not None else set()
    best, score = None, 0
    for cls, family in families.items():
        shared = len(keys & set(getattr(family, "fields", ())))
        if shared > score:
            best, score = cls, shared
    return label, best


def unsupported_class_message(model, families) -> str:
    """Why `model` (of a class no family in `families` lists) is refused: what its forward
    has that the equation does not express, and the nearest class that converts."""
    what = type(model).__name__
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    label, nearest = _nearest(model, families)
    name = label or (f"model_type {model_type!r}" if model_type else what)
    features = missing_features(model)
    if features:
        needs = f"{name} needs {'; '.join(features)}, which no itde family converts for it"
    else:
        needs = (
            f"no itde family lists it, so its forward has not been checked against the "
            f"equation ({name})"
        )
    near = f"; nearest supported: {nearest}" if nearest else ""
    return (
        f"`model` is a {what}, which itde.from_hf does not convert: {needs}{near}. The "
        "classes itde converts are the keys of itde.interop.HF_FAMILIES; a model of another "
        "class is never converted by a family whose forward is not its own."
    )
