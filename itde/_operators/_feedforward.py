r"""The feed-forward operator: integral operators over the feature domain, with ReLU
read as the projection onto $S_2 = \{u \ge 0\}$."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._random import uniform
from .._roles import kernel
from ._abstract import AbstractFeedForward
from ._feature_weights import check_width, weighted
from ._precision import contract

ACTIVATIONS: dict[str, object] = {
    "relu": jax.nn.relu,  # the projection onto S2 = {u >= 0}
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,  # x sigmoid(x), a.k.a. swish (Llama's SwiGLU)
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),  # CLIP's approximation
}
"""The activations $\\rho$ of the feed-forward by name (`activation = "gelu"`): name -> the
function."""


def _linear(x, w, b):
    """`x @ w` (in mixed precision as `contract`) plus an optional bias, in `x`'s dtype: one
    integral operator over the feature or hidden nodes, with its bias."""
    out = contract("nd,dh->nh", x, w)
    return out if b is None else out + b.astype(x.dtype)


def check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"`activation`={activation!r} is not known; choose one of {sorted(ACTIVATIONS)}."
        )
    return activation


class _AbstractDiscreteFeedForward(AbstractFeedForward):
    """A feed-forward with discrete kernels: its input kernels (`_input_kernels`, name to
    bias name) take a folded input affine map."""

    _input_kernels: ClassVar[dict[str, str]]

    def with_input_affine(self, scale, shift, feature_weights=None):
        r"""`F(a \circ z + b)` as one feed-forward: $a$ scales the rows of the input
        kernels, $b$ enters their biases."""
        sw = None if shift is None else weighted(shift, feature_weights)

        def fold(b, w):
            if sw is None:
                return b
            return sw @ w if b is None else b + sw @ w

        kw = {n: scale[:, None] * getattr(self, n) for n in self._input_kernels}
        kb = {b: fold(getattr(self, b), getattr(self, n)) for n, b in self._input_kernels.items()}
        return dataclasses.replace(self, **kw, **kb)


class FeedForward(_AbstractDiscreteFeedForward):
    r"""$F(u)(x,y) = \int_{\Omega_z} W_2(z,y)\,\rho\Big(\int_{\Omega_y} W_1(\xi,z)\,u(x,\xi)\,d\xi
    + b_1(z)\Big)\,dz + b_2(y)$.

    $\rho$ is ReLU — the projection onto $S_2 = \{u \ge 0\}$, the paper's semi-implicit
    substep — or a smooth activation (GELU exact or tanh, SiLU, quick GELU: see
    `itde.ACTIVATIONS`), for clean high-order convergence studies and converted models.
    The hidden domain $\Omega_z$ may have a different number of nodes from $\Omega_y$
    (`d_ff != d`). On the unit grid this is PyTorch's `linear2(act(linear1(u)))`.

    **Fields** (the kernels' values at the nodes; the feature and hidden quadrature
    weights are applied to the state, not stored in them):

    - `w1`: $W_1(\xi_i, z_k)$, `[features, hidden]`: the input kernel, from the feature
      domain $\Omega_y$ to the hidden domain $\Omega_z$ (PyTorch's `linear1.weight.T`).
    - `w2`: $W_2(z_k, y_j)$, `[hidden, features]`: the output kernel, from $\Omega_z$
      back to $\Omega_y$ (`linear2.weight.T`).
    - `b1`: $b_1(z_k)$, `[hidden]`, added before the activation; or None.
    - `b2`: $b_2(y_j)$, `[features]`, added to the output; or None.
    - `activation`: the name of $\rho$ in `itde.ACTIVATIONS` (`"relu"`, the projection
      onto $S_2$, by default).
    """

    w1: Float[Array, "features hidden"] = kernel()
    w2: Float[Array, "hidden features"] = kernel()
    b1: Float[Array, " hidden"] | None
    b2: Float[Array, " features"] | None
    _input_kernels: ClassVar[dict[str, str]] = {"w1": "b1"}
    activation: str = eqx.field(static=True, default="relu")

    def __check_init__(self):
        check_activation(self.activation)
        d, dff = self.w1.shape[-2:]
        if self.w2.shape[-2:] != (dff, d):
            raise ValueError(
                f"`FeedForward.w2` has shape {self.w2.shape}, expected {(dff, d)} to match "
                f"`w1` of shape {self.w1.shape}."
            )

    def discretise(self, grid) -> tuple[FeedForward, None]:
        """Already discrete: `(self, None)` (unit hidden weights), on a grid of its width."""
        check_width("FeedForward", self.w1.shape[-2], grid)
        return self, None

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        n_features: int,
        n_hidden: int,
        *,
        activation: str = "relu",
        bias: bool = True,
        dtype=None,
    ) -> FeedForward:
        """Random discrete kernels (uniform $\\pm 1/\\sqrt{\\text{fan-in}}$, as `nn.Linear`)."""
        dtype = dtype or jnp.zeros(()).dtype
        k1, k2, k3, k4 = jax.random.split(key, 4)
        a1, a2 = 1 / math.sqrt(n_features), 1 / math.sqrt(n_hidden)
        u = lambda k, s, a: uniform(k, s, dtype, -a, a)  # noqa: E731
        return cls(
            w1=u(k1, (n_features, n_hidden), a1),
            w2=u(k2, (n_hidden, n_features), a2),
            b1=u(k3, (n_hidden,), a1) if bias else None,
            b2=u(k4, (n_features,), a2) if bias else None,
            activation=check_activation(activation),
        )

    def __call__(
        self,
        u: Float[Array, "tokens features"],
        *,
        feature_weights: np.ndarray | None = None,
        hidden_weights: np.ndarray | None = None,
    ) -> Float[Array, "tokens features"]:
        act = ACTIVATIONS[self.activation]
        h = _linear(weighted(u, feature_weights), self.w1, self.b1)
        return _linear(weighted(act(h), hidden_weights), self.w2, self.b2)  # type: ignore[operator]


class GatedFeedForward(_AbstractDiscreteFeedForward):
    r"""The gated feed-forward operator (GLU family: SwiGLU with `silu`, GeGLU with `gelu`):

    $$
    F(u)(x,y) = \int_{\Omega_z} W_2(z,y)\,\rho\big(G(x,z)\big)\,H(x,z)\,dz + b_2(y),
    $$

    $G = \int_{\Omega_y} W_g(\xi,z)\,u(x,\xi)\,d\xi + b_g(z)$ and
    $H = \int_{\Omega_y} W_1(\xi,z)\,u(x,\xi)\,d\xi + b_1(z)$: a pointwise product of an
    activated gate and a linear transform, both integral operators over the feature domain.
    On the unit grid this is Llama's `down_proj(act(gate_proj(u)) * up_proj(u))`.

    Parameters: `w_gate`, `w1` of shape `[features, hidden]`, `w2` of shape
    `[hidden, features]`, optional biases `b_gate`, `b1` (`[hidden]`), `b2` (`[features]`).
    `w_gate`, `b_gate` are $W_g, b_g$ (the gate $G$, Llama's `gate_proj`), `w1`, `b1` are
    $W_1, b_1$ (the linear transform $H$, `up_proj`), `w2`, `b2` are $W_2, b_2$
    (`down_proj`). `activation`: the name of $\rho$ in `itde.ACTIVATIONS`, applied to the
    gate only (`"silu"` by default: SwiGLU).
    """

    w_gate: Float[Array, "features hidden"] = kernel()
    w1: Float[Array, "features hidden"] = kernel()
    w2: Float[Array, "hidden features"] = kernel()
    b_gate: Float[Array, " hidden"] | None
    b1: Float[Array, " hidden"] | None
    b2: Float[Array, " features"] | None
    _input_kernels: ClassVar[dict[str, str]] = {"w_gate": "b_gate", "w1": "b1"}
    activation: str = eqx.field(static=True, default="silu")

    def __check_init__(self):
        check_activation(self.activation)
        d, dff = self.w1.shape[-2:]
        if self.w_gate.shape[-2:] != (d, dff):
            raise ValueError(
                f"`GatedFeedForward.w_gate` has shape {self.w_gate.shape}, expected {(d, dff)} "
                f"to match `w1` of shape {self.w1.shape}."
            )
        if self.w2.shape[-2:] != (dff, d):
            raise ValueError(
                f"`GatedFeedForward.w2` has shape {self.w2.shape}, expected {(dff, d)} to "
                f"match `w1` of shape {self.w1.shape}."
            )

    def discretise(self, grid) -> tuple[GatedFeedForward, None]:
        """Already discrete: `(self, None)` (unit hidden weights), on a grid of its width."""
        check_width("GatedFeedForward", self.w1.shape[-2], grid)
        return self, None

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        n_features: int,
        n_hidden: int,
        *,
        activation: str = "silu",
        bias: bool = False,
        dtype=None,
    ) -> GatedFeedForward:
        """Random discrete kernels (uniform $\\pm 1/\\sqrt{\\text{fan-in}}$, as `nn.Linear`)."""
        dtype = dtype or jnp.zeros(()).dtype
        kg, k1, k2, k3, k4, k5 = jax.random.split(key, 6)
        a1, a2 = 1 / math.sqrt(n_features), 1 / math.sqrt(n_hidden)
        u = lambda k, s, a: uniform(k, s, dtype, -a, a)  # noqa: E731
        return cls(
            w_gate=u(kg, (n_features, n_hidden), a1),
            w1=u(k1, (n_features, n_hidden), a1),
            w2=u(k2, (n_hidden, n_features), a2),
            b_gate=u(k3, (n_hidden,), a1) if bias else None,
            b1=u(k4, (n_hidden,), a1) if bias else None,
            b2=u(k5, (n_features,), a2) if bias else None,
            activation=check_activation(activation),
        )

    def __call__(
        self,
        u: Float[Array, "tokens features"],
        *,
        feature_weights: np.ndarray | None = None,
        hidden_weights: np.ndarray | None = None,
    ) -> Float[Array, "tokens features"]:
        act = ACTIVATIONS[self.activation]
        uw = weighted(u, feature_weights)
        z = act(_linear(uw, self.w_gate, self.b_gate)) * _linear(uw, self.w1, self.b1)  # type: ignore[operator]
        return _linear(weighted(z, hidden_weights), self.w2, self.b2)
