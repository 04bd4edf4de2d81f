"""Generic depth-time integration on top of diffrax: operator splitting and projections.

This package knows nothing of Transformers: a vector field is a diffrax term and a
projection is a callable `(t, y) -> y`.
"""

from ._lie import LieTrotter
from ._terms import ProjectionTerm, SplitTerm

__all__ = ["LieTrotter", "ProjectionTerm", "SplitTerm"]
