"""Generic depth-time integration on top of diffrax: operator splitting and projections.

This package knows nothing of Transformers: a vector field is a diffrax term and a
projection is a callable `(t, y) -> y`.
"""

from ._convergence import error_norm, observed_order
from ._lie import LieTrotter
from ._parallel import ParallelSplitting
from ._projected import Projected
from ._rk4 import RK4
from ._strang import Strang
from ._terms import ProjectionTerm, SplitTerm

__all__ = [
    "LieTrotter",
    "ProjectionTerm",
    "SplitTerm",
    "Strang",
    "ParallelSplitting",
    "Projected",
    "RK4",
    "observed_order",
    "error_norm",
]
