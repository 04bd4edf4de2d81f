"""Analysis of a model along depth: the sensitivity of its flow (finite-time Lyapunov
exponents, for the whole state and per token), the spectra of its operators, the geometry
of its tokens, energies."""

# sensitivity of the depth flow
# spectra, token geometry, energies
from ._attention_weights import attention_entropy, attention_weights
from ._energy import EnergyTrace, energy_along, interaction_energy
from ._flow import FlowJacobian, FlowMap
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
from ._report import analyze, figure_report, plot_report, report_depths
from ._sensitivity import LyapunovSpectrum, TokenExponents, lyapunov_spectrum
from ._spectra import (
    HeadSpectra,
    Spectra,
    feedforward_eigenvalues,
    feedforward_singular_values,
    head_spectra,
    spectra,
)
from ._token_exponents import (
    TOKEN_EXPONENTS,
    AbstractTokenExponent,
    FlowJacobianExponent,
    TongExponent,
    token_lyapunov_exponents,
)

__all__ = [
    # sensitivity of the depth flow
    "FlowJacobian",
    "FlowMap",
    "LyapunovSpectrum",
    "TokenExponents",
    "lyapunov_spectrum",
    "token_lyapunov_exponents",
    "AbstractTokenExponent",
    "FlowJacobianExponent",
    "TongExponent",
    "TOKEN_EXPONENTS",
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
    "feedforward_eigenvalues",
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
    # everything against depth (`itde analyze`)
    "analyze",
    "figure_report",
    "plot_report",
    "report_depths",
]
