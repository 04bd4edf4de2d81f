r"""Resolution-independent kernel primitives: functions in a Legendre or Fourier basis,
sampled on any grid.

A discrete Transformer's weight matrix is one sample of a kernel function. Here the
kernel is the function itself,
$$W(\xi, y) = \sum_{a,b} c_{ab}\,\varphi_a(\xi)\,\psi_b(y),$$
([`FunctionKernel`][]), with bias functions ([`FunctionBias`][]) and states
([`FunctionField`][]) in the same bases. Sampling gives the kernel's *values*
$W(\xi_i, y_j)$, never multiplied by quadrature weights: the discrete operators weight
the state.

A grid with fewer nodes than a basis has modes in some direction cannot resolve the
kernel; sampling then warns (`UserWarning`) but proceeds.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .._quadrature._rules import AbstractQuadrature, Grid
from .._random import normal
from ._bases import AbstractBasis, check_resolution


def _n(x) -> int:
    return int(np.shape(x)[0])


def _coeffs(key, shape, decay, scale, dtype):
    """Standard-normal coefficients damped by `decay**(a + b)` over the mode axes."""
    c = normal(key, shape, dtype)
    damp = np.ones(())
    for m in shape[-2:] if len(shape) >= 2 else shape[-1:]:
        damp = np.multiply.outer(damp, decay ** np.arange(m))
    return c * jnp.asarray(scale * damp, dtype)


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
    r"""A bias function $b(y) = \sum_b c_b\,\psi_b(y)$; `coeffs` is `[*batch, M]`.

    `basis`: the basis $\psi$ of the domain of $y$ (the feature, head or hidden domain of
    the operator the bias belongs to), with `basis.n_modes` $= M$."""

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
        c = normal(key, (*batch, basis.n_modes), dtype)
        return cls(c * jnp.asarray(scale * decay ** np.arange(basis.n_modes), dtype), basis)

    def sample(self, nodes: Float[Array, " n"], *, check: bool = True) -> Float[Array, "*b n"]:
        if check:
            check_resolution(self.basis, _n(nodes), "FunctionBias")
        dtype = self.coeffs.dtype
        return jnp.einsum("...b,jb->...j", self.coeffs, self.basis(jnp.asarray(nodes, dtype)))


class FunctionField(eqx.Module):
    r"""A state $f(x, y) = \sum_{a,b} c_{ab}\,\varphi_a(x)\,\psi_b(y)$ on
    $\Omega_x \times \Omega_y$, e.g. the initial condition $u(x, y, 0)$.

    **Fields:**

    - `coeffs`: $c_{ab}$, `[M_x, M_y]` (`basis_x.n_modes`, `basis_y.n_modes`).
    - `basis_x`: the basis $\varphi$ of the token domain $\Omega_x$.
    - `basis_y`: the basis $\psi$ of the feature domain $\Omega_y$.
    """

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
    # a check with a tolerance (accept or refuse), not a choice of path
    if not (math.isclose(a, c, abs_tol=1e-12) and math.isclose(b, d, abs_tol=1e-12)):
        raise ValueError(
            f"`{name}` covers [{a}, {b}] but the kernel's {type(basis).__name__} lives on "
            f"[{c}, {d}]; build the rule with interval={tuple(basis.interval)}."
        )
    return rule.nodes_weights(n)[0]
