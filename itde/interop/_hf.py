r"""Exact conversion of Hugging Face `transformers` models into equations, and back.

The embeddings of a model are its initial condition $u(x, y, 0) = f(x, y)$; its layers are
the equation's per-layer controls, solved with $\Delta t = 1$; its final norm is the output
map. Each family is a module in its own file (`_hf_<family>.py`); `HF_FAMILIES` maps the
`transformers` model classes to them.
"""

from __future__ import annotations

import contextlib
from typing import Any

from ._hf_bert import BertFamily, DistilBertFamily
from ._hf_export import to_hf
from ._hf_family import HF_FAMILIES, AbstractHFFamily
from ._hf_gemma import GemmaFamily
from ._hf_gemma2 import Gemma2Family
from ._hf_gemma3 import Gemma3TextFamily
from ._hf_glue import HF_ACTIVATIONS  # noqa: F401  (re-exported for the CLI and docs)
from ._hf_gpt2 import GPT2Family
from ._hf_llama import LlamaFamily
from ._hf_lm import CausalLMFamily
from ._hf_missing import unsupported_class_message
from ._hf_mistral import MistralFamily
from ._hf_mixtral import MixtralFamily
from ._hf_model import HFTransformer
from ._hf_neox import GPTNeoXFamily
from ._hf_olmo2 import Olmo2Family
from ._hf_olmoe import OlmoeFamily
from ._hf_phi3 import Phi3Family
from ._hf_qwen2 import Qwen2Family
from ._hf_qwen2_moe import Qwen2MoeFamily
from ._hf_qwen3 import Qwen3Family
from ._hf_qwen3_moe import Qwen3MoeFamily
from ._hf_t5 import T5EncoderFamily
from ._hf_vit import ViTFamily
from ._torch import _torch, check_x64

__all__ = ["HF_FAMILIES", "HFTransformer", "from_hf", "hf_float64", "to_hf"]

# HF_FAMILIES (defined beside AbstractHFFamily, so that a family's refusal can read it
# without importing this module) is filled here, where every family is imported.
for _family in (
    BertFamily(), DistilBertFamily(), GPT2Family(), LlamaFamily(), Qwen2Family(),
    MistralFamily(), GemmaFamily(), GPTNeoXFamily(), T5EncoderFamily(), ViTFamily(),
    Qwen3Family(), Phi3Family(), MixtralFamily(), Qwen2MoeFamily(),
    # causal language models: the head class, its base family, the base and head attributes
    CausalLMFamily("GPT2LMHeadModel", GPT2Family(), base="transformer", head="lm_head"),
    CausalLMFamily("LlamaForCausalLM", LlamaFamily(), base="model", head="lm_head"),
    CausalLMFamily("MistralForCausalLM", MistralFamily(), base="model", head="lm_head"),
    CausalLMFamily("MixtralForCausalLM", MixtralFamily(), base="model", head="lm_head"),
    CausalLMFamily("Qwen2MoeForCausalLM", Qwen2MoeFamily(), base="model", head="lm_head"),
    CausalLMFamily("Qwen2ForCausalLM", Qwen2Family(), base="model", head="lm_head"),
    CausalLMFamily("Qwen3ForCausalLM", Qwen3Family(), base="model", head="lm_head"),
    CausalLMFamily("Phi3ForCausalLM", Phi3Family(), base="model", head="lm_head"),
    CausalLMFamily("GemmaForCausalLM", GemmaFamily(), base="model", head="lm_head"),
    Gemma2Family(),
    CausalLMFamily("Gemma2ForCausalLM", Gemma2Family(), base="model", head="lm_head",
                   logit_cap=True),
    Olmo2Family(),
    CausalLMFamily("Olmo2ForCausalLM", Olmo2Family(), base="model", head="lm_head"),
    OlmoeFamily(),
    CausalLMFamily("OlmoeForCausalLM", OlmoeFamily(), base="model", head="lm_head"),
    Qwen3MoeFamily(),
    CausalLMFamily("Qwen3MoeForCausalLM", Qwen3MoeFamily(), base="model", head="lm_head"),
    Gemma3TextFamily(),
    CausalLMFamily("Gemma3ForCausalLM", Gemma3TextFamily(), base="model", head="lm_head",
                   logit_cap=True),
    CausalLMFamily("GPTNeoXForCausalLM", GPTNeoXFamily(), base="gpt_neox", head="lm_head"),
):  # fmt: skip
    for _name in _family.classes:
        HF_FAMILIES[_name] = _family


def _lookup(model) -> tuple[str, AbstractHFFamily]:
    try:
        import transformers  # noqa: F401
    except ImportError as e:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "itde.from_hf needs Hugging Face transformers: pip install 'itde[hf]'"
        ) from e
    for cls in type(model).__mro__:
        family = HF_FAMILIES.get(cls.__name__)
        if family is not None and cls.__module__.startswith("transformers"):
            return cls.__name__, family
    what = type(model).__name__
    if not any(c.__module__.startswith("transformers") for c in type(model).__mro__):
        raise TypeError(
            f"`model` is a {what}, not a Hugging Face transformers model; itde.from_hf "
            f"converts transformers {', '.join(HF_FAMILIES)} (itde.from_torch converts "
            "PyTorch's nn.TransformerEncoder)."
        )
    base = getattr(model, "base_model", None)
    if base is not None and base is not model and type(base).__name__ in HF_FAMILIES:
        raise TypeError(
            f"`model` is a {what}, whose head itde.from_hf does not convert; its base model, "
            f"a {type(base).__name__}, converts. For a model with a head, convert its base "
            "model: `itde.from_hf(model.base_model)`."
        )
    # name what the model has that no family converts, and the nearest family that does
    raise TypeError(unsupported_class_message(model, HF_FAMILIES))


def from_hf(model: Any) -> Any:
    """Convert a Hugging Face `transformers` model into an equivalent equation.

    Supported (`itde.interop.HF_FAMILIES`; what each expresses and its measured error are on
    the Hugging Face families page of the docs):

    - post-LN encoders `BertModel`, `RobertaModel` (also as decoders, `is_decoder=True`:
      causal) and `DistilBertModel`: word + position (+ token type) embeddings and their
      LayerNorm are the initial condition, `block=PostNorm()`;
    - pre-norm decoders `GPT2Model` (learned positions, final `ln_f`), `LlamaModel`,
      `MistralModel`, `Qwen2Model`, `GemmaModel` (RMSNorm, rotary positions with the
      `linear`/`llama3` scalings, gated feed-forward, grouped-query attention) and
      `GPTNeoXModel` (parallel or sequential block, partial rotary);
    - `T5EncoderModel` (RMSNorm, the relative position bias as a score bias);
    - `ViTModel`: the image as a 2-D token domain (an
      [`HFVisionTransformer`][itde.HFVisionTransformer]);
    - causal language models (`GPT2LMHeadModel`, `LlamaForCausalLM`, `MistralForCausalLM`,
      `Qwen2ForCausalLM`, `GemmaForCausalLM`, `GPTNeoXForCausalLM`): the base model plus its
      logits, loss and generation (an [`HFCausalLM`][itde.HFCausalLM]).

    Parameters keep the model's dtype (float32, float64).

    Returns, for a text model, an [`HFTransformer`][itde.HFTransformer] `m` such that for
    one sequence `m(input_ids, attention_mask=mask)` equals
    `model(input_ids[None], attention_mask=mask[None]).last_hidden_state[0]` on the real
    tokens (dropout off); `jax.vmap(m)` for a batch. The layers are `m.equation`, a
    [`TransformerIDE`][itde.TransformerIDE] whose continuum limit the depth solvers integrate.
    [`to_hf`][itde.interop.to_hf] writes it back.

    A config option the equation cannot express (e.g. cross-attention, `rope_type`
    `"dynamic"`, an activation outside `itde.ACTIVATIONS`), or a set field that transformers
    defines or reads for the model and the family's converter does not convert, raises
    `ValueError` naming the config field, its value and where transformers reads it; metadata
    no transformers code defines or reads (`_model_name_or_path`, `unk_token_id`) cannot
    change the network and is accepted. A model class not listed raises `TypeError` naming
    it, what its forward has that no family converts (query/key normalisation, norms
    around each sublayer, a mixture of experts, soft-capping, layers of different kinds, read
    off the model's modules and config) and the nearest class that converts; quantized
    weights kept packed raise `ValueError`.
    """
    name, family = _lookup(model)
    family.check(model, name)
    check_x64(model, "model")
    return family.convert(model, name)


@contextlib.contextmanager
def hf_float64():
    """Run Hugging Face models in float64 throughout, inside a `with` block.

    A float64 Hugging Face model still computes some steps in float32: the softmax of eager
    attention (`softmax(..., dtype=torch.float32)`), RMSNorm (`.to(torch.float32)`) and
    the rotary angles (`inv_freq.float()`). Each costs float32 round-off (~1e-7), which a
    float64 comparison with the converted model would read as a difference of the models.
    Inside `with itde.interop.hf_float64():` those steps compute in the input's dtype when
    it is float64 (float32 inputs are untouched), for every family in `HF_FAMILIES` (each
    family lists its patches). The patches are global to the process while the block runs
    (not thread-safe) and undone on exit.

        with itde.interop.hf_float64():
            reference = model(ids).last_hidden_state   # float64 model, float64 throughout
    """
    torch = _torch()
    functional = torch.nn.functional
    softmax = functional.softmax

    def softmax64(x, dim=None, _stacklevel=3, dtype=None):
        if dtype == torch.float32 and x.dtype == torch.float64:
            dtype = None
        return softmax(x, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    patches = [(functional, "softmax", softmax64)]
    seen = set()
    for family in HF_FAMILIES.values():
        for owner, attr, new in family.float64_patches():
            if (id(owner), attr) not in seen:
                seen.add((id(owner), attr))
                patches.append((owner, attr, new))
    missing = object()
    saved = [(owner, attr, vars(owner).get(attr, missing)) for owner, attr, _ in patches]
    try:
        for owner, attr, new in patches:
            setattr(owner, attr, new)
        yield
    finally:
        for owner, attr, old in reversed(saved):
            if old is missing:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
