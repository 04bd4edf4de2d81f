r"""The token domain $\Omega_x$ as attention sees it: nodes and positive quadrature weights.

A 1-D quadrature rule ([`AbstractQuadrature`][itde.AbstractQuadrature]) and a 2-D
tensor-product rule ([`TensorGrid2D`][itde.TensorGrid2D]) are both token domains, so a
[`Grid`][itde.Grid] holds either and the operators never ask which.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def check_weights(name: str, weights: np.ndarray) -> np.ndarray:
    """Reject non-finite or non-positive quadrature weights, naming the argument."""
    w = np.asarray(weights, dtype=np.float64)
    bad = ~np.isfinite(w) | (w <= 0)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise ValueError(
            f"`{name}` must hold finite positive quadrature weights; entry {i} is {w[i]!r}. "
            "Use a rule with positive weights (midpoint, trapezoid, Simpson, "
            "Gauss-Legendre, periodic trapezoid)."
        )
    return w


class AbstractTokenDomain(eqx.Module):
    r"""A token domain $\Omega_x$ with a quadrature rule: $\int_{\Omega_x} g\,dx \approx
    \sum_p w_p\,g(x_p)$ over the $N$ tokens of a state.

    Attention uses the weights only through the log-bias $\log w_p$ of its softmax.
    `n_tokens` is the state's token count: a 1-D rule needs it (any $N$ within the rule's
    limits), a domain with a fixed count ([`TensorGrid2D`][itde.TensorGrid2D]) checks it
    and also accepts `None`.

    **Convention for uniform weights.** When every weight is equal, $\log w_p$ is a
    constant, which cancels in the softmax: [`token_log_weights`][] returns `None` then
    (the attention skips the bias), and an array otherwise. Every token domain follows it.
    """

    @abc.abstractmethod
    def nodes_weights(self, n_tokens: int | None) -> tuple[np.ndarray, np.ndarray]:
        """Nodes and weights of `n_tokens` tokens (float64 NumPy; weights of shape
        `[n_tokens]`)."""

    def token_weights(self, n_tokens: int | None = None) -> np.ndarray:
        """The weights $w_p$ of `n_tokens` tokens, checked finite and positive."""
        return check_weights("token weights", self.nodes_weights(n_tokens)[1])

    def token_log_weights(
        self, n_tokens: int | None = None, dtype=None
    ) -> Float[Array, " tokens"] | None:
        r"""$\log w_p$ as a JAX array in `dtype`, or `None` when the weights are uniform
        (a constant log-bias cancels in the softmax)."""
        w = self.token_weights(n_tokens)
        if self.uniform_weights(n_tokens):
            return None
        return jnp.asarray(np.log(w), dtype=dtype)

    def uniform_weights(self, n_tokens: int | None = None) -> bool:
        """True when every token weight is the same, so that [`token_log_weights`][] is
        `None`. Quadrature rules and tensor grids decide it from what they are; this default,
        for any other domain, compares the weights themselves: exact equality proves the
        log-bias constant, and weights that are equal only up to round-off keep their
        nearly constant log-bias, which the softmax cancels as well (the same operator
        either way)."""
        w = self.token_weights(n_tokens)
        return bool(np.all(w == w[0]))

    def causal_weights(self, n_tokens: int | None = None):
        r"""Per-query weights $W_{ip}$ for causal (Volterra) attention over
        $[a, x_i]$, or `None` for the discrete causal sum: the token weights over the
        nodes $x_p \le x_i$ (first order in the tokens). This default is `None`; 1-D
        rules override it (see [`AbstractQuadrature.causal_weights`][itde.AbstractQuadrature])."""
        return None

    def padded(self, n_tokens: int, n_padded: int, *, causal: bool = False):
        r"""This domain at `n_tokens` tokens as data on `n_padded` >= `n_tokens` nodes (a
        [`PaddedTokens`][itde.PaddedTokens]: the nodes and weights are arrays, padded with
        weight zero), so that one compiled program serves every token count up to
        `n_padded`; `causal`: with the partial-interval (Volterra) weights of causal
        attention. `None` where the domain's structure depends on the token count beyond
        its nodes and weights: then a solve runs unpadded, one program per count. This
        default is `None` (a domain with a fixed count, e.g.
        [`TensorGrid2D`][itde.TensorGrid2D], or any other domain); 1-D rules override it
        (see [`AbstractQuadrature.padded`][itde.AbstractQuadrature.padded])."""
        return None
