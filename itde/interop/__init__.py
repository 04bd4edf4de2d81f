"""Conversion between PyTorch Transformer modules and `itde` models."""

from ._torch import from_torch, to_torch

__all__ = ["from_torch", "to_torch"]
