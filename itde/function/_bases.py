r"""Orthonormal bases on an interval, in which the kernel functions are expanded."""

from __future__ import annotations

import abc
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import warn_at_caller as _warn
from .._polynomials import legendre
from .._quadrature._rules import _check_interval


class AbstractBasis(eqx.Module):
    r"""$M$ functions $\varphi_0, \dots, \varphi_{M-1}$ on an interval $[a, b]$,
    orthonormal in $L^2(a, b)$.

    Calling the basis on nodes `x` of shape `[n]` returns `[n, M]`, in the dtype of `x`
    (differentiable in `x`).

    **Fields:**

    - `n_modes`: the number of functions $M \ge 1$ (the length of a coefficient axis in
      this basis; a grid needs at least $M$ nodes to resolve them).
    - `interval`: the domain $[a, b]$ as a pair `(a, b)`, $b > a$ (default $(0, 1)$); a
      rule that samples the basis must cover the same interval.
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

    `n_modes`: $M$, the degrees $k = 0, \dots, M - 1$; `interval`: $[a, b]$ (`(a, b)`).
    """

    def _reference(self, s):
        p = jnp.moveaxis(legendre(2.0 * s - 1.0, self.n_modes), 0, -1)  # [n, modes]
        norm = np.sqrt((2 * np.arange(self.n_modes) + 1) / self.length)
        return (p * jnp.asarray(norm, p.dtype)).astype(s.dtype)


class FourierBasis(AbstractBasis):
    r"""Orthonormal trigonometric functions of period $L = b - a$: $1/\sqrt L$, then
    $\sqrt{2/L}\cos(2\pi j (x-a)/L)$, $\sqrt{2/L}\sin(2\pi j (x-a)/L)$ for
    $j = 1, 2, \dots$, the first $M$ of them.

    For periodic domains (pair it with [`PeriodicTrapezoid`][itde.PeriodicTrapezoid],
    exact for trigonometric polynomials of degree $< N$).

    `n_modes`: $M$, the number of functions kept in that order (constant, then cosine and
    sine of frequency $j = 1, 2, \dots$; an even $M$ ends on a cosine); `interval`: one
    period $[a, b]$ (`(a, b)`).
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
        _warn(
            f"{where}: the grid has {n_nodes} nodes on {tuple(basis.interval)} but the "
            f"{type(basis).__name__} has {basis.n_modes} modes; the grid cannot resolve the "
            f"modes (aliasing). Use at least {basis.n_modes} nodes."
        )


