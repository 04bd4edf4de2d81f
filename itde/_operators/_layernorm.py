r"""Layer normalisation as the projection onto $S_1(\sigma_1, \sigma_2)$ (paper, Theorem 3.1)."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float


def feature_mean(u: Float[Array, "tokens features"], weights: np.ndarray | None):
    r"""Per-token mean over the feature domain, $\frac{1}{|\Omega_y|}\int_{\Omega_y} u\,dy$."""
    if weights is None:
        return jnp.mean(u, axis=-1, keepdims=True)
    w = jnp.asarray(weights / weights.sum(), dtype=u.dtype)
    return jnp.sum(u * w, axis=-1, keepdims=True)


class LayerNormProjection(eqx.Module):
    r"""Projection onto $S_1(\sigma_1,\sigma_2)=\{u:\ \mathrm{mean}_y u=\sigma_1,\
    \mathrm{var}_y u=\sigma_2^2\}$ for every token, then an optional per-feature affine map.

    The nearest point of $S_1$ to $v$ is
    $P(v) = \sigma_2 (v - \bar v)/\sqrt{\mathrm{var}\,v + \varepsilon} + \sigma_1$,
    with mean and variance taken as feature quadratures
    $\frac{1}{|\Omega_y|}\int_{\Omega_y}\cdot\,dy$. With $\varepsilon = 0$ this is the exact
    projection (Theorem 3.1); $\varepsilon > 0$ is LayerNorm's regularisation (the
    result then has variance $\sigma_2^2\,\mathrm{var}/(\mathrm{var}+\varepsilon)$,
    slightly inside the sphere). The per-feature gain $g(y)$ and shift $\beta(y)$ of
    real checkpoints act after the projection: $u \mapsto g\,P(u) + \beta$ **[ext]**.

    **Zero variance.** The projection is undefined for a token whose features are all
    equal. With $\varepsilon > 0$ such a token maps to $\sigma_1$ (as LayerNorm does);
    with $\varepsilon = 0$ the call raises a runtime error (`eqx.error_if`) instead of
    returning NaN.

    **Arguments:**

    - `sigma1`, `sigma2`: scalar mean and standard deviation of the constraint set.
    - `gain`, `shift`: optional per-feature arrays of shape `[features]`.
    - `eps`: the variance regulariser $\varepsilon \ge 0$.
    """

    sigma1: Float[Array, ""]
    sigma2: Float[Array, ""]
    gain: Float[Array, " features"] | None
    shift: Float[Array, " features"] | None
    eps: float = eqx.field(static=True)

    def __init__(self, sigma1=0.0, sigma2=1.0, gain=None, shift=None, eps: float = 1e-5):
        eps = float(eps)
        if not np.isfinite(eps) or eps < 0:
            raise ValueError(f"`LayerNormProjection(eps=...)` must be finite and >= 0, got {eps}.")
        self.sigma1 = jnp.asarray(sigma1)
        self.sigma2 = jnp.asarray(sigma2)
        self.gain = None if gain is None else jnp.asarray(gain)
        self.shift = None if shift is None else jnp.asarray(shift)
        self.eps = eps

    def __call__(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> Float[Array, "tokens features"]:
        dtype = u.dtype
        centred = u - feature_mean(u, feature_weights)
        var = feature_mean(centred * centred, feature_weights)
        if self.eps == 0.0:
            var = eqx.error_if(
                var,
                jnp.any(var <= 0),
                "LayerNormProjection: a token has zero feature variance, so its projection "
                "onto S1 is undefined (eps=0). Use eps > 0 or give a non-constant state.",
            )
        z = centred * jnp.reciprocal(jnp.sqrt(var + jnp.asarray(self.eps, dtype)))
        out = self.sigma2.astype(dtype) * z + self.sigma1.astype(dtype)
        if self.gain is not None:
            out = out * self.gain.astype(dtype)
        if self.shift is not None:
            out = out + self.shift.astype(dtype)
        return out

    def residuals(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> tuple[Array, Array]:
        """Largest deviation of the per-token mean from σ1 and of the variance from σ2²,
        after undoing the per-feature affine map (the constraint-set residual)."""
        z = u
        if self.shift is not None:
            z = z - self.shift.astype(u.dtype)
        if self.gain is not None:
            z = z / self.gain.astype(u.dtype)
        mean = feature_mean(z, feature_weights)
        var = feature_mean((z - mean) ** 2, feature_weights)
        return (
            jnp.max(jnp.abs(mean - self.sigma1.astype(u.dtype))),
            jnp.max(jnp.abs(var - self.sigma2.astype(u.dtype) ** 2)),
        )
