"""Analysis of a model along depth: spectra of its operators, the geometry of its tokens,
energies."""

# spectra, token geometry, energies
from ._attention_weights import attention_entropy, attention_weights
from ._energy import EnergyTrace, energy_along, interaction_energy
from ._geometry import (
    TokenGeometry,
    cluster_count,
    cluster_labels,
    cosines,
    effective_rank,
    geometry_along,
    mean_cosine,
    min_cosine,
    norm_residuals,
    numerical_rank,
    singular_values,
    token_geometry,
)
from ._spectra import (
    HeadSpectra,
    Spectra,
    feedforward_singular_values,
    head_spectra,
    spectra,
)

__all__ = [
    # spectra, token geometry, energies
    "EnergyTrace",
    "HeadSpectra",
    "Spectra",
    "TokenGeometry",
    "attention_entropy",
    "attention_weights",
    "cluster_count",
    "cluster_labels",
    "cosines",
    "effective_rank",
    "energy_along",
    "feedforward_singular_values",
    "geometry_along",
    "head_spectra",
    "interaction_energy",
    "mean_cosine",
    "min_cosine",
    "norm_residuals",
    "numerical_rank",
    "singular_values",
    "spectra",
    "token_geometry",
]
