r"""What the equation asks of an attention or a feed-forward operator: its discrete form
on a grid.

Discrete operators ([`Attention`][itde.Attention], [`FeedForward`][itde.FeedForward])
hold kernels sampled at a grid's nodes and are their own discrete form. Function-space
operators ([`FunctionAttention`][itde.FunctionAttention],
[`FunctionFeedForward`][itde.FunctionFeedForward]) hold kernel functions and sample them
on the grid they are given. The equation calls `discretise` and never asks which.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

if TYPE_CHECKING:
    from .._quadrature._rules import Grid
    from ._attention import Attention
    from ._feedforward import FeedForward


class AbstractAttention(eqx.Module):
    r"""An attention operator $A(u)$ that has a discrete form on any admissible grid."""

    @abc.abstractmethod
    def discretise(self, grid: Grid) -> tuple[Attention, np.ndarray | None]:
        """The discrete attention on `grid`'s feature nodes, and the quadrature weights
        of its head domain $\\Omega_h$ to apply it with (`head_weights`), or `None` when
        every head weight is 1 (the discrete Transformer's heads).

        A discrete `Attention` returns `(self, None)`."""

    def with_input_affine(self, scale, shift, feature_weights: np.ndarray | None = None):
        r"""The same operator applied to $a \circ z + b$, with the affine map folded into
        its input weights: `op.with_input_affine(a, b)(z) == op(a * z + b)`. Discrete
        operators only (a per-feature map lives on one grid's nodes)."""
        _no_fold(self)


class AbstractFeedForward(eqx.Module):
    r"""A feed-forward operator $F(u)$ that has a discrete form on any admissible grid."""

    @abc.abstractmethod
    def discretise(self, grid: Grid) -> tuple[FeedForward, np.ndarray | None]:
        """The discrete feed-forward on `grid`'s feature nodes, and the quadrature weights
        of its hidden domain $\\Omega_z$ to apply it with (`hidden_weights`), or `None`
        when every hidden weight is 1.

        A discrete `FeedForward` returns `(self, None)`."""

    @property
    def discontinuity(self) -> str | None:
        """None for an operator continuous in the state (every feed-forward but a routed
        mixture of experts); else where it jumps, in words, which the solvers and continuum
        forms that assume a smooth field (adaptive step-size controllers, `continuum_form`)
        name when they refuse it."""
        return None

    def with_input_affine(self, scale, shift, feature_weights: np.ndarray | None = None):
        r"""The same operator applied to $a \circ z + b$, with the affine map folded into
        its input weights: `op.with_input_affine(a, b)(z) == op(a * z + b)`. Discrete
        operators only (a per-feature map lives on one grid's nodes)."""
        _no_fold(self)


class AbstractNorm(eqx.Module):
    r"""A normalisation read as the projection onto a constraint set on the feature domain,
    then an optional per-feature affine map $u \mapsto g \circ u + \beta$:
    [`LayerNormProjection`][itde.LayerNormProjection] (the set
    $S_1(\sigma_1, \sigma_2)$ of fixed mean and variance) or
    [`RMSNormProjection`][itde.RMSNormProjection] (the sphere of fixed mean square).

    In a post-norm equation the normalisation is a constraint on the state (a projection
    sub-flow); in a pre-norm equation it is a map inside each operator. The continuum
    (tangent) form of a post-norm equation asks the norm for the tangent projection of its
    set (`tangent`) and for the motion of the set in depth (`drift`).

    Every norm declares its regulariser (`eps`: the $\varepsilon \ge 0$ added to the
    variance or mean square before dividing by its square root; 0 is the exact projection),
    its per-feature affine parameters (`gain`, `shift`: `[features]`
    arrays, or None where the norm has none), reports the distance of a state from its set
    (`residuals`), and builds its identity-initialised and exact members
    (`identity`, `exact`), so that a model can hold any norm without asking which.
    """

    eps: eqx.AbstractVar[float]
    gain: eqx.AbstractVar[Float[Array, " features"] | None]
    shift: eqx.AbstractVar[Float[Array, " features"] | None]

    @abc.abstractmethod
    def __call__(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> Float[Array, "tokens features"]:
        """The normalised state (projection, then gain and shift)."""

    @property
    def is_exact(self) -> bool:
        """True when the map is exactly the projection onto the constraint set: `eps=0`
        and no per-feature affine map (what the continuum form needs)."""
        # exact: `eps` is the number the user gave (0 asks for the exact projection)
        return self.gain is None and self.shift is None and self.eps == 0.0

    @abc.abstractmethod
    def residuals(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> dict[str, Array]:
        """The largest deviation, over the tokens, of each defining quantity of the set from
        its value (after undoing the per-feature affine map), by name: e.g.
        `{"mean": ..., "var": ...}` for $S_1$. Zero (to round-off) on the set."""

    def residual(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> Array:
        """The largest of [`residuals`][itde.AbstractNorm.residuals]: the state's distance
        from the constraint set in the set's own quantities."""
        return jnp.max(jnp.stack(list(self.residuals(u, feature_weights).values())))

    @abc.abstractmethod
    def tangent(self, u, w, feature_weights: np.ndarray | None = None):
        r"""The projection of a velocity `w` onto the tangent space of the set at `u`
        (`u` on the set)."""

    @abc.abstractmethod
    def drift(self, u, d_norm: AbstractNorm, feature_weights: np.ndarray | None = None):
        r"""The velocity of the point of the moving set that follows `u`, when the set's
        parameters move at rate `d_norm` (a tangent of this module, from `jax.jvp`)."""

    @classmethod
    @abc.abstractmethod
    def identity(
        cls, n_features: int, *, eps: float, bias: bool = True, dtype=None
    ) -> AbstractNorm:
        """The normalisation as a freshly initialised network holds it: the unit set, a
        gain of ones and (where the norm has one and `bias`) a shift of zeros."""

    @classmethod
    @abc.abstractmethod
    def scalar(cls, sigma1: Array, sigma2: Array, *, eps: float = 0.0) -> AbstractNorm:
        r"""The normalisation onto the set of mean `sigma1` and scale `sigma2` with no
        per-feature affine map (a norm without a mean condition ignores `sigma1`): a set
        that means the same on every feature grid. The arrays may carry a leading mode
        axis (smooth controls)."""

    @abc.abstractmethod
    def unit_and_affine(
        self, n_features: int
    ) -> tuple[AbstractNorm, Float[Array, " features"], Float[Array, " features"] | None]:
        r"""The norm as a unit normalisation followed by a per-feature affine map:
        `(unit, scale, shift)` with $N(v) = \mathrm{scale} \circ P(v) + \mathrm{shift}$
        exactly, `unit` the same normalisation (same $\varepsilon$) onto the unit set
        with no affine map, and `shift` None where the norm has no mean condition."""

    @abc.abstractmethod
    def fixed_points(self) -> AbstractNorm:
        r"""The exact projection onto the set of fixed points of this map (no per-feature
        affine map allowed): the set itself when $\varepsilon = 0$; with
        $\varepsilon > 0$ the set of scale $\sqrt{\sigma^2 - \varepsilon}$, where
        $\sigma^2\,v/(\mathrm{var}\,v + \varepsilon) = v$. This is the constraint set
        of the continuum: Lie steps with the regularised map converge, as the step goes
        to 0, to the flow on it (each application contracts the distance to it by a
        factor of order $\varepsilon$)."""

    def _fixed_scale(self, sigma: Array) -> Array:
        r"""$\sqrt{\sigma^2 - \varepsilon}$, the scale of the fixed points of a regularised
        norm of scale $\sigma$ (a `ValueError` when $\sigma^2 \le \varepsilon$: none)."""
        if not isinstance(sigma, jax.core.Tracer) and np.any(np.asarray(sigma) ** 2 <= self.eps):
            raise ValueError(
                f"`eps`={self.eps} is not below the set's squared scale "
                f"{np.asarray(sigma) ** 2}: the map has no fixed points (every output lies "
                "strictly inside the set)."
            )
        return jnp.sqrt(sigma * sigma - self.eps)

    def _refuse_affine(self, what: str) -> None:
        if self.gain is not None or self.shift is not None:
            raise ValueError(
                f"{what}: this {type(self).__name__} has a per-feature gain or shift, so it is "
                "not a projection (applying it twice moves the state); take the model's "
                "continuum form first (`itde.continuum_form(model)`), which folds the gains "
                "into the next operators."
            )

    @classmethod
    def exact(cls, sigma1: Array, sigma2: Array) -> AbstractNorm:
        r"""The exact projection ($\varepsilon = 0$, no affine map) onto the set of mean
        `sigma1` and scale `sigma2`: the constraint set of the continuum."""
        return cls.scalar(sigma1, sigma2, eps=0.0)

    def field_roles(self) -> dict[str, str]:
        """Roles of parameters that depend on the module's values (see `itde.train`):
        none by default."""
        return {}


def _no_fold(op) -> None:
    raise TypeError(
        f"{type(op).__name__} holds kernel functions; folding a per-feature affine map into "
        "it needs discrete kernels (a converted or per-layer model)."
    )


def feature_mean(u: Float[Array, "tokens features"], weights: np.ndarray | None):
    r"""Per-token mean over the feature domain, $\frac{1}{|\Omega_y|}\int_{\Omega_y} u\,dy$."""
    if weights is None:
        return jnp.mean(u, axis=-1, keepdims=True)
    w = jnp.asarray(weights / weights.sum(), dtype=u.dtype)
    return jnp.sum(u * w, axis=-1, keepdims=True)
