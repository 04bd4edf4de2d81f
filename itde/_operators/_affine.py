r"""A per-feature affine map $z \mapsto a \circ z + b$: the part of a normalisation's gain and
shift that the continuum form of a network keeps as an operator of its own."""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float


class FeatureAffine(eqx.Module):
    r"""The pointwise map $z(x, y) \mapsto a(y)\,z(x, y) + b(y)$ on the feature domain.

    In the continuum form of a post-norm network
    ([`continuum_form`][itde.TransformerIDE.continuum_form]) it appears twice: as the
    extra vector field $(g - 1) \circ z + \beta$ that a LayerNorm's per-feature gain $g$
    and shift $\beta$ leave once they are folded into the next operator's weights (then
    `scale` $= g - 1$), and as the readout $z \mapsto g \circ z + \beta$ that turns the
    normalised state back into the network's hidden state (`scale` $= g$).

    **Arguments:**

    - `scale`: `[features]`.
    - `shift`: `[features]`, or None for none.
    """

    scale: Float[Array, " features"]
    shift: Float[Array, " features"] | None = None

    def __check_init__(self):
        if getattr(self.scale, "ndim", None) not in (1, 2):
            raise ValueError(
                f"`FeatureAffine.scale` must be one value per feature, shape [features], got "
                f"shape {getattr(self.scale, 'shape', None)}."
            )
        if self.shift is not None and self.shift.shape != self.scale.shape:
            raise ValueError(
                f"`FeatureAffine.shift` has shape {self.shift.shape}; it must match `scale` "
                f"{self.scale.shape}."
            )

    def check_width(self, n_features: int, name: str) -> None:
        """Raise unless the map acts on `n_features` features (`name`: the argument or field
        that holds it, for the message)."""
        width = self.scale.shape[-1]
        if width != n_features:
            raise ValueError(
                f"`{name}` is a FeatureAffine of width {width} (`scale` shape "
                f"{tuple(self.scale.shape)}), but the state has {n_features} features; give "
                f"`scale` and `shift` one value per feature, shape ({n_features},)."
            )

    def __call__(self, u: Float[Array, "tokens features"]) -> Float[Array, "tokens features"]:
        if self.scale.ndim == 1:  # (a [layers, features] stack is read per layer first)
            self.check_width(u.shape[-1], "FeatureAffine")
        out = u * self.scale.astype(u.dtype)
        if self.shift is not None:
            out = out + self.shift.astype(u.dtype)
        return out

    @classmethod
    def identity(cls, n_features: int, dtype=None) -> FeatureAffine:
        """$z \\mapsto z$ (scale one, no shift)."""
        return cls(jnp.ones((n_features,), dtype))
