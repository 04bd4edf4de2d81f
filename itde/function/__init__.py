"""Function-space models: operators defined by kernels on continuous domains.

A [`FunctionBlock`][] holds kernels over the token and feature domains; `on_grid`
discretises it at any resolution with any quadrature.
"""

from ._block import FunctionBlock
from ._kernels import (
    AbstractBasis,
    FourierBasis,
    FunctionAttention,
    FunctionBias,
    FunctionFeedForward,
    FunctionField,
    FunctionKernel,
    LegendreBasis,
)

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
