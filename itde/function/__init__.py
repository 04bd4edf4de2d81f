"""Function-space models: operators defined by kernels on continuous domains.

A [`FunctionBlock`][] holds kernels over the token and feature domains; `on_grid`
discretises it at any resolution with any quadrature.
"""

from ._bases import AbstractBasis, FourierBasis, LegendreBasis
from ._block import FunctionBlock
from ._kernels import FunctionBias, FunctionField, FunctionKernel
from ._operators import FunctionAttention, FunctionFeedForward

__all__ = [
    "AbstractBasis",
    "FourierBasis",
    "FunctionAttention",
    "FunctionBias",
    "FunctionBlock",
    "FunctionFeedForward",
    "FunctionField",
    "FunctionKernel",
    "LegendreBasis",
]
