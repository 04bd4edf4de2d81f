"""Token and feature domains discretised by quadrature rules."""

from ._domain import AbstractTokenDomain
from ._grid2d import TensorGrid2D
from ._rules import (
    RULES,
    AbstractQuadrature,
    GaussLegendre,
    Grid,
    Midpoint,
    PeriodicTrapezoid,
    Simpson,
    Trapezoid,
)

__all__ = [
    "RULES",
    "AbstractQuadrature",
    "AbstractTokenDomain",
    "GaussLegendre",
    "Grid",
    "Midpoint",
    "PeriodicTrapezoid",
    "Simpson",
    "TensorGrid2D",
    "Trapezoid",
]
