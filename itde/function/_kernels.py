r"""Resolution-independent kernels: functions in a Legendre or Fourier basis, sampled on
any grid.

A discrete Transformer's weight matrix is one sample of a kernel function. Here the
kernel is the function itself,
$$W(\xi, y) = \sum_{a,b} c_{ab}\,\varphi_a(\xi)\,\psi_b(y),$$
and [`FunctionAttention`][] / [`FunctionFeedForward`][] sample their kernels at the nodes
of a grid to give the discrete [`Attention`][itde.Attention] /
[`FeedForward`][itde.FeedForward], which apply the grid's quadrature weights. The sampled
matrices are the kernel's *values* $W(\xi_i, y_j)$, never multiplied by weights (the
discrete operators weight the state, `feature_weights`), so refining the grid converges
to the integral operator at the order of the quadrature rule (paper §4).

A grid with fewer nodes than a basis has modes in some direction cannot resolve the
kernel; sampling then warns (`UserWarning`) but proceeds.
"""

from __future__ import annotations

import abc
import math
import os
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._operators._attention import Attention
from .._operators._feedforward import FeedForward, check_activation
from .._quadrature._rules import AbstractQuadrature, Grid, _check_interval, check_weights

# ---------------------------------------------------------------------------- bases


class AbstractBasis(eqx.Module):
    r"""$M$ functions $\varphi_0, \dots, \varphi_{M-1}$ on an interval $[a, b]$,
    orthonormal in $L^2(a, b)$.

    Calling the basis on nodes `x` of shape `[n]` returns `[n, M]`, in the dtype of `x`
    (differentiable in `x`).
    """

    n_modes: int = eqx.field(static=True)
    interval: tuple[float, float] = eqx.field(static=True, default=(0.0, 1.0))

    def __check_init__(self):
        name = type(self).__name__
        m = self.n_modes
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"`{name}(n_modes=...)` must be a positive int, got {m!r}.")
        if self.interval is None:
            raise ValueError(f"`{name}(interval=...)` must be a pair (a, b), got None.")
        _check_interval(name, self.interval)

    @property
    def length(self) -> float:
        a, b = self.interval
        return float(b) - float(a)

    @abc.abstractmethod
    def _reference(self, s: Array) -> Array:
        """The basis on the reference interval [0, 1] (each final basis defines it)."""

    def __call__(self, x: Float[Array, " n"]) -> Float[Array, "n modes"]:
        x = jnp.asarray(x)
        if x.ndim != 1:
            raise ValueError(f"basis nodes `x` must be one-dimensional, got shape {x.shape}.")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(jnp.zeros(()).dtype)
        a = float(self.interval[0])
        return self._reference((x - a) / self.length)

    def same_as(self, other: AbstractBasis) -> bool:
        return (
            type(self) is type(other)
            and self.n_modes == other.n_modes
            and tuple(map(float, self.interval)) == tuple(map(float, other.interval))
        )


class LegendreBasis(AbstractBasis):
    r"""Orthonormal Legendre polynomials on $[a, b]$:
    $\varphi_k(x) = \sqrt{(2k+1)/L}\;P_k\big(2(x-a)/L - 1\big)$, $L = b - a$, $k < M$.

    Spans the polynomials of degree $< M$; Gauss–Legendre with $N$ nodes integrates
    a product $\varphi_j\varphi_k$ exactly when $N \ge M$.
    """

    def _reference(self, s):
        t = 2.0 * s - 1.0
        ps = [jnp.ones_like(t)]
        if self.n_modes > 1:
            ps.append(t)
        for k in range(1, self.n_modes - 1):
            ps.append(((2 * k + 1) * t * ps[k] - k * ps[k - 1]) / (k + 1))
        norm = np.sqrt((2 * np.arange(self.n_modes) + 1) / self.length)
        return jnp.stack(ps, axis=-1) * jnp.asarray(norm, t.dtype)


class FourierBasis(AbstractBasis):
    r"""Orthonormal trigonometric functions of period $L = b - a$: $1/\sqrt L$, then
    $\sqrt{2/L}\cos(2\pi j (x-a)/L)$, $\sqrt{2/L}\sin(2\pi j (x-a)/L)$ for
    $j = 1, 2, \dots$, the first $M$ of them.

    For periodic domains (pair it with [`PeriodicTrapezoid`][itde.PeriodicTrapezoid],
    exact for trigonometric polynomials of degree $< N$).
    """

    def _reference(self, s):
        cols = [jnp.full_like(s, 1.0 / math.sqrt(self.length))]
        c = math.sqrt(2.0 / self.length)
        j = 1
        while len(cols) < self.n_modes:
            cols.append(c * jnp.cos(2 * math.pi * j * s))
            if len(cols) < self.n_modes:
                cols.append(c * jnp.sin(2 * math.pi * j * s))
            j += 1
        return jnp.stack(cols, axis=-1)


def check_resolution(basis: AbstractBasis, n_nodes: int, where: str) -> None:
    """Warn (`UserWarning`) when `n_nodes` nodes are too few to resolve the basis."""
    if n_nodes < basis.n_modes:
        warnings.warn(
            f"{where}: the grid has {n_nodes} nodes on {tuple(basis.interval)} but the "
            f"{type(basis).__name__} has {basis.n_modes} modes; the grid cannot resolve the "
            f"modes (aliasing). Use at least {basis.n_modes} nodes.",
            UserWarning,
            stacklevel=_caller_level(),
        )


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside this module and equinox's wrappers."""
    frame, level = sys._getframe(2), 2
    while frame is not None and (
        frame.f_code.co_filename == __file__
        or f"{os.sep}equinox{os.sep}" in frame.f_code.co_filename
    ):
        frame, level = frame.f_back, level + 1
    return level


def _n(x) -> int:
    return int(np.shape(x)[0])


def _coeffs(key, shape, decay, scale, dtype):
    """Standard-normal coefficients damped by `decay**(a + b)` over the mode axes."""
    c = jax.random.normal(key, shape, dtype)
    damp = np.ones(())
    for m in shape[-2:] if len(shape) >= 2 else shape[-1:]:
        damp = np.multiply.outer(damp, decay ** np.arange(m))
    return c * jnp.asarray(scale * damp, dtype)


# ---------------------------------------------------------------------------- kernels


class FunctionKernel(eqx.Module):
    r"""A kernel $W(\xi, y) = \sum_{a,b} c_{ab}\,\varphi_a(\xi)\,\psi_b(y)$ from the domain
    of $\xi$ (basis $\varphi$, `basis_in`) to that of $y$ (basis $\psi$, `basis_out`).

    `coeffs` has shape `[*batch, M_in, M_out]` (e.g. a leading head axis).
    """

    coeffs: Float[Array, "*batch modes_in modes_out"]
    basis_in: AbstractBasis
    basis_out: AbstractBasis

    def __check_init__(self):
        want = (self.basis_in.n_modes, self.basis_out.n_modes)
        if tuple(self.coeffs.shape[-2:]) != want:
            raise ValueError(
                f"`FunctionKernel.coeffs` has shape {self.coeffs.shape}; its last two axes "
                f"must be (basis_in.n_modes, basis_out.n_modes) = {want}."
            )

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        basis_in: AbstractBasis,
        basis_out: AbstractBasis,
        *,
        batch: tuple[int, ...] = (),
        scale: float = 1.0,
        decay: float = 0.7,
        dtype=None,
    ) -> FunctionKernel:
        """Random coefficients $c_{ab} \\sim \\mathcal N(0, 1)\\cdot$ `scale`
        $\\cdot$ `decay`$^{a+b}$ (a smooth kernel for `decay < 1`)."""
        dtype = dtype or jnp.zeros(()).dtype
        shape = (*batch, basis_in.n_modes, basis_out.n_modes)
        return cls(_coeffs(key, shape, decay, scale, dtype), basis_in, basis_out)

    def sample(
        self,
        nodes_in: Float[Array, " n_in"],
        nodes_out: Float[Array, " n_out"],
        *,
        check: bool = True,
    ) -> Float[Array, "*batch n_in n_out"]:
        """The values $W(\\xi_i, y_j)$ (no quadrature weights), in the coefficients' dtype."""
        if check:
            check_resolution(self.basis_in, _n(nodes_in), "FunctionKernel (input direction)")
            check_resolution(self.basis_out, _n(nodes_out), "FunctionKernel (output direction)")
        dtype = self.coeffs.dtype
        phi = self.basis_in(jnp.asarray(nodes_in, dtype))
        psi = self.basis_out(jnp.asarray(nodes_out, dtype))
        return jnp.einsum("ia,...ab,jb->...ij", phi, self.coeffs, psi)


class FunctionBias(eqx.Module):
    r"""A bias function $b(y) = \sum_b c_b\,\psi_b(y)$; `coeffs` is `[*batch, M]`."""

    coeffs: Float[Array, "*batch modes"]
    basis: AbstractBasis

    def __check_init__(self):
        if self.coeffs.ndim < 1 or self.coeffs.shape[-1] != self.basis.n_modes:
            raise ValueError(
                f"`FunctionBias.coeffs` has shape {self.coeffs.shape}; its last axis must be "
                f"basis.n_modes = {self.basis.n_modes}."
            )

    @classmethod
    def init(cls, key, basis, *, batch=(), scale=1.0, decay=0.7, dtype=None) -> FunctionBias:
        dtype = dtype or jnp.zeros(()).dtype
        c = jax.random.normal(key, (*batch, basis.n_modes), dtype)
        return cls(c * jnp.asarray(scale * decay ** np.arange(basis.n_modes), dtype), basis)

    def sample(self, nodes: Float[Array, " n"], *, check: bool = True) -> Float[Array, "*b n"]:
        if check:
            check_resolution(self.basis, _n(nodes), "FunctionBias")
        dtype = self.coeffs.dtype
        return jnp.einsum("...b,jb->...j", self.coeffs, self.basis(jnp.asarray(nodes, dtype)))


class FunctionField(eqx.Module):
    r"""A state $f(x, y) = \sum_{a,b} c_{ab}\,\varphi_a(x)\,\psi_b(y)$ on
    $\Omega_x \times \Omega_y$, e.g. the initial condition $u(x, y, 0)$."""

    coeffs: Float[Array, "modes_x modes_y"]
    basis_x: AbstractBasis
    basis_y: AbstractBasis

    def __check_init__(self):
        want = (self.basis_x.n_modes, self.basis_y.n_modes)
        if tuple(self.coeffs.shape) != want:
            raise ValueError(
                f"`FunctionField.coeffs` has shape {self.coeffs.shape}, expected {want} "
                "(basis_x.n_modes, basis_y.n_modes)."
            )

    @classmethod
    def init(cls, key, basis_x, basis_y, *, scale=1.0, decay=0.7, dtype=None) -> FunctionField:
        dtype = dtype or jnp.zeros(()).dtype
        shape = (basis_x.n_modes, basis_y.n_modes)
        return cls(_coeffs(key, shape, decay, scale, dtype), basis_x, basis_y)

    def sample(
        self, nodes_x: Float[Array, " n_x"], nodes_y: Float[Array, " n_y"], *, check=True
    ) -> Float[Array, "n_x n_y"]:
        """The values $f(x_k, y_l)$: a state `[tokens, features]`."""
        if check:
            check_resolution(self.basis_x, _n(nodes_x), "FunctionField (token direction)")
            check_resolution(self.basis_y, _n(nodes_y), "FunctionField (feature direction)")
        dtype = self.coeffs.dtype
        phi = self.basis_x(jnp.asarray(nodes_x, dtype))
        psi = self.basis_y(jnp.asarray(nodes_y, dtype))
        return phi @ self.coeffs @ psi.T

    def sample_grid(self, grid: Grid, n_tokens: int) -> Float[Array, "tokens features"]:
        """The state on a [`Grid`][itde.Grid] with `n_tokens` token nodes."""
        x = _rule_nodes(grid.tokens, n_tokens, self.basis_x, "grid.tokens")
        y = _rule_nodes(grid.features, grid.n_features, self.basis_y, "grid.features")
        return self.sample(x, y)


def _rule_nodes(rule: AbstractQuadrature, n: int, basis: AbstractBasis, name: str):
    """The rule's nodes, after checking that it covers the basis's interval."""
    if not isinstance(rule, AbstractQuadrature):
        raise ValueError(
            f"`{name}` is a {type(rule).__name__} (a 2-D token domain) but the "
            f"{type(basis).__name__} here is 1-D; sample a 1-D model on a 1-D rule, or give "
            "the 2-D domain a 2-D state."
        )
    a, b = rule.bounds(n)
    c, d = basis.interval
    if not (math.isclose(a, c, abs_tol=1e-12) and math.isclose(b, d, abs_tol=1e-12)):
        raise ValueError(
            f"`{name}` covers [{a}, {b}] but the kernel's {type(basis).__name__} lives on "
            f"[{c}, {d}]; build the rule with interval={tuple(basis.interval)}."
        )
    return rule.nodes_weights(n)[0]


def _sample_bias(b: FunctionBias | None, nodes):
    return None if b is None else b.sample(nodes, check=False)


def _same(*bases: AbstractBasis) -> bool:
    return all(bases[0].same_as(b) for b in bases[1:])


# ---------------------------------------------------------------------------- operators


class FunctionAttention(eqx.Module):
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

    wq: FunctionKernel
    wk: FunctionKernel
    wv: FunctionKernel
    wo: FunctionKernel
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


class FunctionFeedForward(eqx.Module):
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

    w1: FunctionKernel
    b1: FunctionBias | None
    w2: FunctionKernel
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
        y = _rule_nodes(grid.features, grid.n_features, self.w1.basis_in, "grid.features")
        return self.sample_nodes(y)

    def __call__(self, u: Float[Array, "tokens features"], grid: Grid) -> Array:
        """Sample on `grid` and apply with its feature weights and the hidden weights."""
        return self.sample(grid)(
            u, feature_weights=grid.feature_weights(), hidden_weights=self.hidden_weights()
        )
