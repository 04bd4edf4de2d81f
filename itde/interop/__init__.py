"""Conversion between PyTorch / Hugging Face Transformer modules and `itde` models."""

from ._hf import HF_FAMILIES, from_hf, hf_float64, to_hf
from ._hf_family import AbstractHFFamily
from ._hf_lm import CausalLMFamily, HFCausalLM, HFDecoder
from ._hf_model import HFTransformer
from ._hf_vit import HFVisionTransformer
from ._hf_vit_domain import (
    AbstractImageTokenWeights,
    AbstractPositionInterpolant,
    AreaTokenWeights,
    ClassTokenGrid2D,
    HFBicubic,
    KeysCubic,
    UnitTokenWeights,
)
from ._pretrained import gemma3_270m_gguf, minilm_dir, smollm2_dir, smollm2_gguf
from ._torch import from_torch, to_torch

__all__ = [
    "HF_FAMILIES",
    "AbstractHFFamily",
    "AbstractImageTokenWeights",
    "AbstractPositionInterpolant",
    "AreaTokenWeights",
    "ClassTokenGrid2D",
    "HFBicubic",
    "CausalLMFamily",
    "HFCausalLM",
    "HFDecoder",
    "HFTransformer",
    "HFVisionTransformer",
    "KeysCubic",
    "UnitTokenWeights",
    "from_hf",
    "from_torch",
    "gemma3_270m_gguf",
    "hf_float64",
    "minilm_dir",
    "smollm2_dir",
    "smollm2_gguf",
    "to_hf",
    "to_torch",
]
