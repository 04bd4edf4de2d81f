r"""Layer normalisation as the projection onto $S_1(\sigma_1, \sigma_2)$ (paper, Theorem 3.1)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_float
from .._roles import FROZEN
from ._abstract import AbstractNorm, feature_mean

__all__ = ["LayerNormProjection", "feature_mean"]


class LayerNormProjection(AbstractNorm):
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
    returning NaN or a point whose sign round-off chose. "Equal" is judged relative to the
    token's own scale: a constant token of value $c$ leaves a variance of order
    $(\epsilon_\mathrm{mach} c)^2$ after its mean is subtracted, so a variance below
    $(16\,\epsilon_\mathrm{mach} \max_y |u|)^2$ counts as zero.

    **Precision.** Mean and variance are taken in float32 or wider whatever the state's
    dtype (bfloat16 would lose the variance of a token with a large mean); the result has
    the state's dtype.

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
        eps = check_float("eps", eps, nonnegative=True)
        self.sigma1 = jnp.asarray(sigma1)
        self.sigma2 = jnp.asarray(sigma2)
        self.gain = None if gain is None else jnp.asarray(gain)
        self.shift = None if shift is None else jnp.asarray(shift)
        self.eps = eps
        s2 = self.sigma2
        if s2.ndim == 0 and not isinstance(s2, jax.core.Tracer) and not float(s2) > 0:
            raise ValueError(
                f"`sigma2`={float(s2)} must be > 0: it is the standard deviation of the "
                "constraint set (with sigma2 < 0 the 'projection' is the farthest point)."
            )
        for name, v in (("gain", self.gain), ("shift", self.shift)):
            if v is not None and v.ndim != 1 and self.sigma1.ndim == 0:
                raise ValueError(
                    f"`{name}` must be one value per feature, shape [features], got shape "
                    f"{v.shape}."
                )

    def __call__(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> Float[Array, "tokens features"]:
        out_dtype = u.dtype
        dtype = jnp.promote_types(u.dtype, jnp.float32)
        u = u.astype(dtype)
        centred = u - feature_mean(u, feature_weights)
        var = feature_mean(centred * centred, feature_weights)
        # exact: `eps` is the number the user gave (0 asks for the exact projection)
        if self.eps == 0.0:
            scale = jnp.max(jnp.abs(u), axis=-1, keepdims=True)
            floor = (16 * jnp.finfo(dtype).eps * scale) ** 2
            var = eqx.error_if(
                var,
                jnp.any(var <= floor),
                "LayerNormProjection: a token has zero feature variance up to round-off "
                "(its features are equal to within 16 ulps of their size), so its "
                "projection onto S1 is undefined with eps=0. Use eps > 0 (e.g. 1e-5, as "
                "LayerNorm does) or give a state whose tokens are not constant.",
            )
        z = centred * jnp.reciprocal(jnp.sqrt(var + jnp.asarray(self.eps, dtype)))
        out = self.sigma2.astype(dtype) * z + self.sigma1.astype(dtype)
        if self.gain is not None:
            out = out * self.gain.astype(dtype)
        if self.shift is not None:
            out = out + self.shift.astype(dtype)
        return out.astype(out_dtype)

    def residuals(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> dict[str, Array]:
        """Largest deviation of the per-token mean from σ1 (`"mean"`) and of the variance
        from σ2² (`"var"`), after undoing the per-feature affine map."""
        z = u
        if self.shift is not None:
            z = z - self.shift.astype(u.dtype)
        if self.gain is not None:
            z = z / self.gain.astype(u.dtype)
        mean = feature_mean(z, feature_weights)
        var = feature_mean((z - mean) ** 2, feature_weights)
        return {
            "mean": jnp.max(jnp.abs(mean - self.sigma1.astype(u.dtype))),
            "var": jnp.max(jnp.abs(var - self.sigma2.astype(u.dtype) ** 2)),
        }

    @classmethod
    def identity(cls, n_features: int, *, eps: float, bias: bool = True, dtype=None):
        """PyTorch's fresh `nn.LayerNorm`: $S_1(0, 1)$, gain 1, shift 0 (none without
        `bias`)."""
        ones = jnp.ones((n_features,), dtype)
        shift = jnp.zeros((n_features,), dtype) if bias else None
        return cls(jnp.zeros((), dtype), jnp.ones((), dtype), ones, shift, eps)

    @classmethod
    def scalar(cls, sigma1, sigma2, *, eps: float = 0.0):
        r"""The projection onto $S_1(\sigma_1, \sigma_2)$ with no affine map."""
        return cls(sigma1, sigma2, None, None, eps)

    def field_roles(self) -> dict[str, str]:
        r"""With a per-feature gain, $u \mapsto g(\sigma_2 z + \sigma_1) + \beta$ makes
        the scalars $\sigma_1, \sigma_2$ redundant (PyTorch's LayerNorm has none): frozen."""
        return {"sigma1": FROZEN, "sigma2": FROZEN} if self.gain is not None else {}

    def unit_and_affine(self, n_features: int):
        r"""$N(v) = g(\sigma_2 P_0(v) + \sigma_1) + \beta$: scale $g\sigma_2$, shift
        $g\sigma_1 + \beta$, `unit` $= P_0$ onto $S_1(0, 1)$ with the same $\varepsilon$."""
        dtype = self.sigma2.dtype
        g = jnp.ones((n_features,), dtype) if self.gain is None else self.gain
        scale = g * self.sigma2
        shift = g * self.sigma1 + (0 if self.shift is None else self.shift)
        unit = type(self)(jnp.zeros((), dtype), jnp.ones((), dtype), None, None, self.eps)
        return unit, scale, shift

    def fixed_points(self):
        r"""The exact projection onto $S_1(\sigma_1, \sqrt{\sigma_2^2 - \varepsilon})$."""
        self._refuse_affine("the continuum constraint set")
        # exact: `eps` is the number the user gave (0 asks for the exact projection)
        if self.eps == 0.0:
            return self
        return type(self)(self.sigma1, self._fixed_scale(self.sigma2), None, None, 0.0)

    def tangent(self, u, w, feature_weights=None):
        r"""$P_T(z)\,w = w - \overline{w} - \overline{w z}\,z$ with
        $z = (u - \sigma_1)/\sigma_2$: the tangent space of $S_1$ at `u`."""
        s1, s2 = self.sigma1.astype(u.dtype), self.sigma2.astype(u.dtype)
        z = (u - s1) / s2
        return w - feature_mean(w, feature_weights) - feature_mean(w * z, feature_weights) * z

    def drift(self, u, d_norm, feature_weights=None):
        r"""$\sigma_1' + \sigma_2' z$: the point $\sigma_1 + \sigma_2 z$ with $z$ fixed."""
        s1, s2 = self.sigma1.astype(u.dtype), self.sigma2.astype(u.dtype)
        z = (u - s1) / s2
        return d_norm.sigma1.astype(u.dtype) + d_norm.sigma2.astype(u.dtype) * z
