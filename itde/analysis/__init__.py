"""Analysis of the depth dynamics: the sensitivity of the flow (finite-time Lyapunov
exponents, for the whole state and per token)."""

# sensitivity of the depth flow
from ._flow import FlowJacobian, FlowMap
from ._sensitivity import (
    LyapunovSpectrum,
    TokenExponents,
    lyapunov_spectrum,
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
]
