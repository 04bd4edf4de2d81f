r"""Attention and feed-forward with kernel functions, sampled on any grid.

[`FunctionAttention`][] / [`FunctionFeedForward`][] sample their kernels at the nodes of a
grid to give the discrete [`Attention`][itde.Attention] / [`FeedForward`][itde.FeedForward]
(`discretise`), which apply the grid's quadrature weights; refining the grid converges to
the integral operator at the order of the quadrature rule (paper §4).
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._operators._abstract import AbstractAttention, AbstractFeedForward
from .._operators._attention import Attention
from .._operators._feedforward import FeedForward, check_activation
from .._quadrature._domain import check_weights
from .._quadrature._rules import AbstractQuadrature, Grid
from .._roles import kernel
from ._bases import AbstractBasis, check_resolution
from ._kernels import FunctionBias, FunctionKernel, _n, _rule_nodes


def _sample_bias(b: FunctionBias | None, nodes):
    return None if b is None else b.sample(nodes, check=False)


def _none_if_unit(rule: AbstractQuadrature, n: int, weights: np.ndarray) -> np.ndarray | None:
    """None on the rule's unit grid (every weight 1: multiplying by them would be a no-op),
    decided by the rule ([`is_unit`][itde.AbstractQuadrature.is_unit]); else `weights`."""
    return None if rule.is_unit(n) else weights


def _same(*bases: AbstractBasis) -> bool:
    return all(bases[0].same_as(b) for b in bases[1:])


class FunctionAttention(AbstractAttention):
    r"""Multi-head attention with kernel functions on $\Omega_y$ and on a head domain
    $\Omega_h$: $W^{Q,K,V}_m(\xi, \eta)$ from $\Omega_y$ to $\Omega_h$,
    $W^O_m(\eta, y)$ from $\Omega_h$ to $\Omega_y$, and optional bias functions
    $b^{Q,K,V}_m(\eta)$, $b^O(y)$.

    [`sample`][] evaluates them at the nodes of a grid and returns the discrete
    [`Attention`][itde.Attention]; applied with the grid's feature weights, the head
    weights ([`head_weights`][]) and the token log-weights, it is the quadrature of the
    integral operator $A(u)$, converging with the rules' orders as the grids refine.
    The score scale $1/\sqrt{|\Omega_h|}$ is the head domain's length.

    **Arguments:**

    - `wq`, `wk`, `wv`: [`FunctionKernel`][]s with coefficients `[heads, M_y, M_h]`
      (input basis on $\Omega_y$, output basis on $\Omega_h$).
    - `wo`: a `FunctionKernel` with coefficients `[heads, M_h, M_y]`.
    - `bq`, `bk`, `bv`: `FunctionBias` `[heads, M_h]` on $\Omega_h$, or `None`.
    - `bo`: `FunctionBias` `[M_y]` on $\Omega_y$, or `None`.
    - `head_rule`: the quadrature rule on $\Omega_h$ (its interval must be the head
      basis's), and `n_head_nodes` its number of nodes (the discrete head size).
    """

    wq: FunctionKernel = kernel()
    wk: FunctionKernel = kernel()
    wv: FunctionKernel = kernel()
    wo: FunctionKernel = kernel()
    bq: FunctionBias | None
    bk: FunctionBias | None
    bv: FunctionBias | None
    bo: FunctionBias | None
    head_rule: AbstractQuadrature
    n_head_nodes: int = eqx.field(static=True)

    def __check_init__(self):
        fy, fh = self.wq.basis_in, self.wq.basis_out
        ok = _same(fy, self.wk.basis_in, self.wv.basis_in, self.wo.basis_out) and _same(
            fh, self.wk.basis_out, self.wv.basis_out, self.wo.basis_in
        )
        for b, basis in ((self.bq, fh), (self.bk, fh), (self.bv, fh), (self.bo, fy)):
            ok = ok and (b is None or b.basis.same_as(basis))
        if not ok:
            raise ValueError(
                "`FunctionAttention`: wq, wk, wv must map the feature basis to the head basis, "
                "wo the head basis to the feature basis, and bq, bk, bv (bo) live on the head "
                "(feature) basis."
            )
        h = self.wq.coeffs.shape[:-2]
        for name in ("wk", "wv", "wo"):
            if getattr(self, name).coeffs.shape[:-2] != h or len(h) != 1:
                raise ValueError(
                    f"`FunctionAttention.{name}.coeffs` must have one leading head axis equal "
                    f"to wq's {h}, got {getattr(self, name).coeffs.shape}."
                )
        _rule_nodes(self.head_rule, self.n_head_nodes, fh, "head_rule")

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        n_heads: int,
        feature_basis: AbstractBasis,
        head_basis: AbstractBasis,
        head_rule: AbstractQuadrature,
        n_head_nodes: int,
        bias: bool = True,
        scale: float = 1.0,
        decay: float = 0.7,
        dtype=None,
    ) -> FunctionAttention:
        """Random smooth kernels (coefficients as [`FunctionKernel.init`][])."""
        ks = jax.random.split(key, 8)
        kw = dict(batch=(n_heads,), scale=scale, decay=decay, dtype=dtype)
        fb = lambda k, basis, batch: (  # noqa: E731
            FunctionBias.init(k, basis, batch=batch, scale=scale, decay=decay, dtype=dtype)
            if bias
            else None
        )
        return cls(
            wq=FunctionKernel.init(ks[0], feature_basis, head_basis, **kw),
            wk=FunctionKernel.init(ks[1], feature_basis, head_basis, **kw),
            wv=FunctionKernel.init(ks[2], feature_basis, head_basis, **kw),
            wo=FunctionKernel.init(ks[3], head_basis, feature_basis, **kw),
            bq=fb(ks[4], head_basis, (n_heads,)),
            bk=fb(ks[5], head_basis, (n_heads,)),
            bv=fb(ks[6], head_basis, (n_heads,)),
            bo=fb(ks[7], feature_basis, ()),
            head_rule=head_rule,
            n_head_nodes=n_head_nodes,
        )

    @property
    def n_heads(self) -> int:
        return self.wq.coeffs.shape[0]

    def head_nodes_weights(self) -> tuple[np.ndarray, np.ndarray]:
        """Nodes and weights of the head domain $\\Omega_h$ (float64 NumPy)."""
        x, w = self.head_rule.nodes_weights(self.n_head_nodes)
        return x, check_weights("head weights", w)

    def head_weights(self) -> np.ndarray:
        """The `head_weights` to pass to the sampled [`Attention`][itde.Attention]."""
        return self.head_nodes_weights()[1]

    def sample_nodes(self, feature_nodes: Float[Array, " features"]) -> Attention:
        """The discrete attention whose kernels are the values at `feature_nodes` (and at
        the head rule's nodes)."""
        fy, fh = self.wq.basis_in, self.wq.basis_out
        check_resolution(fy, _n(feature_nodes), "FunctionAttention (feature domain)")
        check_resolution(fh, self.n_head_nodes, "FunctionAttention (head domain)")
        hx = self.head_nodes_weights()[0]
        s = lambda k: k.sample(feature_nodes, hx, check=False)  # noqa: E731
        return Attention(
            wq=s(self.wq),
            wk=s(self.wk),
            wv=s(self.wv),
            wo=self.wo.sample(hx, feature_nodes, check=False),
            bq=_sample_bias(self.bq, hx),
            bk=_sample_bias(self.bk, hx),
            bv=_sample_bias(self.bv, hx),
            bo=_sample_bias(self.bo, feature_nodes),
        )

    def sample(self, grid: Grid) -> Attention:
        """The discrete attention on `grid`'s feature nodes (the grid's feature rule must
        cover the feature basis's interval)."""
        y = _rule_nodes(grid.features, grid.n_features, self.wq.basis_in, "grid.features")
        return self.sample_nodes(y)

    def discretise(self, grid: Grid) -> tuple[Attention, np.ndarray | None]:
        """The sampled attention on `grid` ([`sample`][]) and its head weights (`None`
        when all are 1)."""
        weights = _none_if_unit(self.head_rule, self.n_head_nodes, self.head_weights())
        return self.sample(grid), weights

    def __call__(
        self, u: Float[Array, "tokens features"], grid: Grid, *, causal: bool = False
    ) -> Float[Array, "tokens features"]:
        """Sample on `grid` and apply with its feature, head and token weights."""
        lw = grid.token_log_weights(u.shape[0], u.dtype)
        return self.sample(grid)(
            u,
            feature_weights=grid.feature_weights(),
            head_weights=self.head_weights(),
            token_log_weights=lw,
            causal=causal,
        )


class FunctionFeedForward(AbstractFeedForward):
    r"""$F(u)(x,y) = \int_{\Omega_z} W_2(z,y)\,\rho\big(\int_{\Omega_y} W_1(\xi,z)\,u(x,\xi)\,d\xi
    + b_1(z)\big)\,dz + b_2(y)$ with kernel functions, the hidden domain $\Omega_z$ carrying
    its own rule.

    [`sample`][] returns the discrete [`FeedForward`][itde.FeedForward] on a grid's feature
    nodes and the hidden rule's nodes; apply it with the grid's feature weights and
    [`hidden_weights`][].

    **Arguments:**

    - `w1`: [`FunctionKernel`][] `[M_y, M_z]` ($\Omega_y \to \Omega_z$); `b1` on $\Omega_z$.
    - `w2`: `FunctionKernel` `[M_z, M_y]` ($\Omega_z \to \Omega_y$); `b2` on $\Omega_y$.
    - `hidden_rule`, `n_hidden_nodes`: the rule on $\Omega_z$ and its number of nodes.
    - `activation`: `"relu"` (the projection onto $S_2$), `"gelu"` or `"gelu_tanh"`.
    """

    w1: FunctionKernel = kernel()
    b1: FunctionBias | None
    w2: FunctionKernel = kernel()
    b2: FunctionBias | None
    hidden_rule: AbstractQuadrature
    n_hidden_nodes: int = eqx.field(static=True)
    activation: str = eqx.field(static=True, default="relu")

    def __check_init__(self):
        check_activation(self.activation)
        fy, fz = self.w1.basis_in, self.w1.basis_out
        ok = fy.same_as(self.w2.basis_out) and fz.same_as(self.w2.basis_in)
        ok = ok and (self.b1 is None or self.b1.basis.same_as(fz))
        ok = ok and (self.b2 is None or self.b2.basis.same_as(fy))
        if not ok or self.w1.coeffs.ndim != 2 or self.w2.coeffs.ndim != 2:
            raise ValueError(
                "`FunctionFeedForward`: w1 must map the feature basis to the hidden basis and "
                "w2 back (2-D coefficients), b1 (b2) live on the hidden (feature) basis."
            )
        _rule_nodes(self.hidden_rule, self.n_hidden_nodes, fz, "hidden_rule")

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        feature_basis: AbstractBasis,
        hidden_basis: AbstractBasis,
        hidden_rule: AbstractQuadrature,
        n_hidden_nodes: int,
        activation: str = "relu",
        bias: bool = True,
        scale: float = 1.0,
        decay: float = 0.7,
        dtype=None,
    ) -> FunctionFeedForward:
        """Random smooth kernels (coefficients as [`FunctionKernel.init`][])."""
        k1, k2, k3, k4 = jax.random.split(key, 4)
        kw = dict(scale=scale, decay=decay, dtype=dtype)
        return cls(
            w1=FunctionKernel.init(k1, feature_basis, hidden_basis, **kw),
            b1=FunctionBias.init(k2, hidden_basis, **kw) if bias else None,
            w2=FunctionKernel.init(k3, hidden_basis, feature_basis, **kw),
            b2=FunctionBias.init(k4, feature_basis, **kw) if bias else None,
            hidden_rule=hidden_rule,
            n_hidden_nodes=n_hidden_nodes,
            activation=activation,
        )

    def hidden_nodes_weights(self) -> tuple[np.ndarray, np.ndarray]:
        x, w = self.hidden_rule.nodes_weights(self.n_hidden_nodes)
        return x, check_weights("hidden weights", w)

    def hidden_weights(self) -> np.ndarray:
        """The `hidden_weights` to pass to the sampled [`FeedForward`][itde.FeedForward]."""
        return self.hidden_nodes_weights()[1]

    def sample_nodes(self, feature_nodes: Float[Array, " features"]) -> FeedForward:
        """The discrete feed-forward whose kernels are the values at `feature_nodes` (and
        at the hidden rule's nodes)."""
        fy, fz = self.w1.basis_in, self.w1.basis_out
        check_resolution(fy, _n(feature_nodes), "FunctionFeedForward (feature domain)")
        check_resolution(fz, self.n_hidden_nodes, "FunctionFeedForward (hidden domain)")
        zx = self.hidden_nodes_weights()[0]
        return FeedForward(
            w1=self.w1.sample(feature_nodes, zx, check=False),
            w2=self.w2.sample(zx, feature_nodes, check=False),
            b1=_sample_bias(self.b1, zx),
            b2=_sample_bias(self.b2, feature_nodes),
            activation=self.activation,
        )

    def sample(self, grid: Grid) -> FeedForward:
        """The discrete feed-forward on `grid`'s feature nodes (the grid's feature rule must
        cover the input basis's interval)."""
        y = _rule_nodes(grid.features, grid.n_features, self.w1.basis_in, "grid.features")
        return self.sample_nodes(y)

    def discretise(self, grid: Grid) -> tuple[FeedForward, np.ndarray | None]:
        """The sampled feed-forward on `grid` ([`sample`][]) and its hidden weights
        (`None` when all are 1)."""
        weights = _none_if_unit(self.hidden_rule, self.n_hidden_nodes, self.hidden_weights())
        return self.sample(grid), weights

    def __call__(self, u: Float[Array, "tokens features"], grid: Grid) -> Array:
        """Sample on `grid` and apply with its feature weights and the hidden weights."""
        return self.sample(grid)(
            u, feature_weights=grid.feature_weights(), hidden_weights=self.hidden_weights()
        )
