"""Conversion between PyTorch / Hugging Face Transformer modules and `itde` models."""

from ._hf import HFTransformer, from_hf
from ._torch import from_torch, to_torch

__all__ = ["HFTransformer", "from_hf", "from_torch", "to_torch"]
