"""itde: the Transformer solved as an integro-differential equation in depth-time.

Tai, Liu, Li and Chan, "A Mathematical Explanation of Transformers" (SIAM J. Imaging
Sciences, 2026): self-attention is a nonlocal integral operator discretised by
quadrature, layer normalisation a projection onto a constraint set, and one Lie
operator-splitting step with $\\Delta t = 1$ exactly one post-LN Transformer block.
"""

from ._abstract import AbstractEquation
from ._config import ConfigError
from ._controls import AbstractControls, Block, LegendreControls, PiecewiseConstant, stack
from ._equation import TransformerIDE
from ._operators._abstract import AbstractAttention, AbstractFeedForward, AbstractNorm
from ._operators._attention import Attention
from ._operators._blocked import blocked_attention, dense_attention, fused_attention
from ._operators._feedforward import FeedForward, GatedFeedForward
from ._operators._layernorm import LayerNormProjection
from ._operators._rmsnorm import RMSNormProjection
from ._operators._rope import Rope
from ._quadrature._domain import AbstractTokenDomain
from ._quadrature._grid2d import TensorGrid2D
from ._quadrature._rules import (
    RULES,
    AbstractQuadrature,
    GaussLegendre,
    Grid,
    Midpoint,
    PeriodicTrapezoid,
    Simpson,
    Trapezoid,
)
from ._registry import (
    ACTIVATIONS,
    ATTENTION_IMPLS,
    BLOCK_FORMS,
    FFN_FORMS,
    SCHEMES,
    TERMS_KINDS,
    Scheme,
)
from ._solve import solve
from .function import (
    FourierBasis,
    FunctionAttention,
    FunctionBias,
    FunctionBlock,
    FunctionFeedForward,
    FunctionField,
    FunctionKernel,
    LegendreBasis,
)
from .interop._hf import HFTransformer, from_hf
from .interop._torch import from_torch, to_torch

__version__ = "0.1.0"

__all__ = [
    "ACTIVATIONS",
    "ATTENTION_IMPLS",
    "AbstractControls",
    "AbstractEquation",
    "ConfigError",
    "FFN_FORMS",
    "SCHEMES",
    "Scheme",
    "TERMS_KINDS",
    "AbstractAttention",
    "AbstractFeedForward",
    "RULES",
    "AbstractQuadrature",
    "AbstractTokenDomain",
    "Attention",
    "Block",
    "FeedForward",
    "FourierBasis",
    "FunctionAttention",
    "FunctionBias",
    "FunctionBlock",
    "FunctionFeedForward",
    "FunctionField",
    "FunctionKernel",
    "LegendreBasis",
    "TensorGrid2D",
    "blocked_attention",
    "dense_attention",
    "fused_attention",
    "GaussLegendre",
    "Grid",
    "LayerNormProjection",
    "LegendreControls",
    "Midpoint",
    "PeriodicTrapezoid",
    "PiecewiseConstant",
    "Simpson",
    "TransformerIDE",
    "Trapezoid",
    "from_torch",
    "solve",
    "stack",
    "to_torch",
    "AbstractNorm",
    "BLOCK_FORMS",
    "GatedFeedForward",
    "RMSNormProjection",
    "Rope",
    "HFTransformer",
    "from_hf",
]
