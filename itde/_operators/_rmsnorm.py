r"""RMS normalisation as the projection onto a sphere of the feature domain."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_float
from .._roles import FROZEN
from ._abstract import AbstractNorm, feature_mean


class RMSNormProjection(AbstractNorm):
    r"""Projection onto the sphere $S_\mathrm{rms}(\sigma) = \{u:\ \mathrm{mean}_y u^2 =
    \sigma^2\}$ for every token, then an optional per-feature gain (RMSNorm, as in Llama).

    **Closest point.** For $v \ne 0$ the nearest point of the sphere to $v$ in the feature
    inner product $\langle a, b\rangle = \frac{1}{|\Omega_y|}\int_{\Omega_y} a b\,dy$ is

    $$
    P(v) = \sigma\,\frac{v}{\sqrt{\mathrm{mean}_y v^2}}.
    $$

    Proof: every $u$ on the sphere has $\|u\| = \sigma$, so
    $\|u - v\|^2 = \sigma^2 + \|v\|^2 - 2\langle u, v\rangle$, and by Cauchy–Schwarz
    $\langle u, v\rangle \le \sigma\|v\|$ with equality only for $u = \sigma v/\|v\|$
    (the sphere is the constraint set $S_1$ without the mean condition; LayerNorm's proof is
    the same on the subspace of zero mean). With $\varepsilon > 0$ the map is RMSNorm's
    regularisation $\sigma v/\sqrt{\mathrm{mean}\,v^2 + \varepsilon}$, slightly inside the
    sphere. The per-feature gain $g(y)$ of real checkpoints acts after the projection.

    **Zero state.** A token with $v = 0$ has no nearest point: with $\varepsilon > 0$ it
    maps to 0 (as RMSNorm does); with $\varepsilon = 0$ the call raises a runtime error.

    **Precision.** The mean square is taken in float32 or wider whatever the state's dtype,
    the normalised state is cast back to the state's dtype and then multiplied by the gain
    (Hugging Face's `LlamaRMSNorm` order of operations).

    **Arguments:**

    - `sigma`: the root mean square of the sphere (scalar, default 1).
    - `gain`: optional per-feature array of shape `[features]`.
    - `eps`: the regulariser $\varepsilon \ge 0$.

    `shift` is always None (a read-only property, for the [`AbstractNorm`][itde.AbstractNorm]
    interface): RMSNorm has no per-feature shift $\beta$.
    """

    sigma: Float[Array, ""]
    gain: Float[Array, " features"] | None
    eps: float = eqx.field(static=True)

    @property
    def shift(self) -> None:
        """RMSNorm has no per-feature shift."""
        return None

    def __init__(self, sigma=1.0, gain=None, eps: float = 1e-6):
        self.eps = check_float("eps", eps, nonnegative=True)
        self.sigma = jnp.asarray(sigma)
        self.gain = None if gain is None else jnp.asarray(gain)
        s = self.sigma
        if s.ndim == 0 and not isinstance(s, jax.core.Tracer) and not float(s) > 0:
            raise ValueError(
                f"`sigma`={float(s)} must be > 0: it is the radius (root mean square) of the "
                "sphere."
            )
        if self.gain is not None and self.gain.ndim != 1 and self.sigma.ndim == 0:
            raise ValueError(
                f"`gain` must be one value per feature, shape [features], got shape "
                f"{self.gain.shape}."
            )

    def field_roles(self) -> dict[str, str]:
        r"""With a per-feature gain, $u \mapsto g\,\sigma z$ makes the scalar $\sigma$
        redundant (Hugging Face's RMSNorm has none): frozen, as a LayerNorm's
        $\sigma_1, \sigma_2$ (and `to_hf` writes only radius 1)."""
        return {"sigma": FROZEN} if self.gain is not None else {}

    def __call__(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> Float[Array, "tokens features"]:
        out_dtype = u.dtype
        dtype = jnp.promote_types(u.dtype, jnp.float32)
        v = u.astype(dtype)
        ms = feature_mean(v * v, feature_weights)
        # exact: `eps` is the number the user gave (0 asks for the exact projection)
        if self.eps == 0.0:
            scale = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
            ms = eqx.error_if(
                ms,
                jnp.any(ms <= jnp.finfo(dtype).tiny) | jnp.any(scale == 0),
                "RMSNormProjection: a token is zero, so its projection onto the sphere is "
                "undefined with eps=0. Use eps > 0 (e.g. 1e-6, as RMSNorm does).",
            )
        out = v * jax.lax.rsqrt(ms + jnp.asarray(self.eps, dtype))
        out = out * self.sigma.astype(dtype)
        out = out.astype(out_dtype)
        if self.gain is not None:
            out = self.gain.astype(out_dtype) * out
        return out

    def unit_and_affine(self, n_features: int):
        r"""$N(v) = g\,\sigma P_0(v)$: scale $g\sigma$, no shift, `unit` $= P_0$ onto the
        unit sphere with the same $\varepsilon$."""
        dtype = self.sigma.dtype
        g = jnp.ones((n_features,), dtype) if self.gain is None else self.gain
        return type(self)(jnp.ones((), dtype), None, self.eps), g * self.sigma, None

    def fixed_points(self):
        r"""The exact projection onto the sphere of radius $\sqrt{\sigma^2 - \varepsilon}$."""
        self._refuse_affine("the continuum constraint set")
        # exact: `eps` is the number the user gave (0 asks for the exact projection)
        if self.eps == 0.0:
            return self
        return type(self)(self._fixed_scale(self.sigma), None, 0.0)

    def tangent(self, u, w, feature_weights=None):
        r"""$w - \overline{w z}\,z$ with $z = u/\sigma$: the tangent space of the sphere."""
        z = u / self.sigma.astype(u.dtype)
        return w - feature_mean(w * z, feature_weights) * z

    def drift(self, u, d_norm, feature_weights=None):
        r"""$\sigma' z$: the point $\sigma z$ of the growing sphere with $z$ fixed."""
        z = u / self.sigma.astype(u.dtype)
        return d_norm.sigma.astype(u.dtype) * z

    def residuals(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> dict[str, Array]:
        """Largest deviation of the per-token mean square from σ² (`"mean_square"`), after
        undoing the gain."""
        z = u if self.gain is None else u / self.gain.astype(u.dtype)
        ms = feature_mean(z * z, feature_weights)
        return {"mean_square": jnp.max(jnp.abs(ms - self.sigma.astype(u.dtype) ** 2))}

    @classmethod
    def identity(cls, n_features: int, *, eps: float, bias: bool = True, dtype=None):
        """A fresh RMSNorm: the unit sphere and gain 1 (`bias` is ignored: no shift)."""
        del bias
        return cls(jnp.ones((), dtype), jnp.ones((n_features,), dtype), eps)

    @classmethod
    def scalar(cls, sigma1, sigma2, *, eps: float = 0.0):
        """The projection onto the sphere of radius `sigma2` with no gain (`sigma1` is
        ignored: the sphere has no mean condition)."""
        del sigma1
        return cls(sigma2, None, eps)
