r"""Partial-interval (Volterra) quadrature: per-query weights for $\int_a^{x_i}$.

Causal attention is the Volterra operator
$$A(u)(x) = \frac{\int_a^x e^{s(x,\tilde x)}\,V(\tilde x)\,d\tilde x}
{\int_a^x e^{s(x,\eta)}\,d\eta},$$
so each query node $x_i$ needs its own quadrature of the partial interval $[a, x_i]$:
weights $W_{ip}$ with $\int_a^{x_i} g \approx \sum_p W_{ip}\,g(x_p)$. The attention cores
take them as `query_weights` in both the numerator and the normaliser. Summing the full
rule's weights over the nodes $x_p \le x_i$ (the discrete Transformer's mask) integrates
over the wrong interval by $O(h)$, which is why causal attention used to converge at
first order for every rule.

At $x_i = a$ the interval is empty and the ratio is its limit $V(a)$: any single positive
weight on $x_i$ gives it exactly. Only the ratio matters, so each row is fixed up to a
positive factor.

| rule | weights (class) | strictly causal | signs | order |
|---|---|---|---|---|
| midpoint | [`MidpointVolterra`][] | yes | positive | 2 |
| trapezoid, periodic trapezoid | [`TrapezoidVolterra`][] | yes | positive | 2 |
| Simpson | [`GregoryVolterra`][] | no: query $x_1$ reads $x_2, x_3$ | signed (row 1) | 4 |
| Gauss–Legendre | [`SpectralVolterra`][] | no: reads every node | signed | geometric |

Conditions: the orders need the integrand $\tilde x \mapsto e^{s(x,\tilde x)} V(\tilde x)$
smooth on $[a, x]$ ($C^2$ for order 2, $C^4$ for order 4); the rules that read nodes past
$x_i$ (Simpson's first rows, Gauss–Legendre) need it smooth across $\tilde x = x$ as well,
up to $b$ for Gauss–Legendre (analytic for geometric convergence). That holds for the
continuum model (kernels and states are smooth functions of $x$), not for a causal
decoder: a rule that is not strictly causal lets a token read later tokens, so it is a
quadrature of the Volterra operator, not an autoregressive model. A token-by-token
decoder needs a strictly causal rule (midpoint, trapezoid). Why Simpson's row 1 reads
ahead: with only $x_0, x_1$ the ratio over $[x_0, x_1]$ is accurate to $O(h^2)$ at best,
which caps the whole operator near order 3.
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._host import to_device


class AbstractVolterraWeights(eqx.Module):
    r"""Per-query weights $W_{ip}$ for $\int_a^{x_i}$ on the $N$ nodes of a rule.

    Called with integer query and key indices, it returns the block
    `[len(query_index), len(key_index)]` of $W$, so the blocked attention core never forms
    the `tokens × tokens` matrix when the weights are a formula in the indices.

    - `signed`: some weights are negative (the attention then multiplies by them instead
      of adding their logarithm; the fused core refuses such weights).
    - `strict`: $W_{ip} = 0$ for $p > i$ (the rule reads no later token).
    - `order`: the order of the operator for smooth integrands (`inf`: geometric).
    - `n`: the number of nodes $N$ of the rule: $W$ is `[n, n]`, rows $i$ the queries,
      columns $p$ the keys.
    """

    n: int = eqx.field(static=True)
    signed: ClassVar[bool] = False
    strict: ClassVar[bool] = True
    order: ClassVar[float] = 2.0

    def __call__(
        self, query_index: Int[Array, " q"], key_index: Int[Array, " k"]
    ) -> Float[Array, "q k"]:
        raise NotImplementedError

    def matrix(self) -> np.ndarray:
        """The whole `[n, n]` matrix as float64 NumPy (for tests and studies)."""
        i = jnp.arange(self.n)
        return np.asarray(self(i, i), dtype=np.float64)

    def padded(self, n_padded: int) -> AbstractVolterraWeights | None:
        """These weights on `n_padded` >= `n` nodes, with everything that depends on `n`
        held as data (so that one compiled program serves every `n` up to `n_padded`): the
        rows and columns of the first `n` nodes are these, and no row `i < n` reads a node
        past `n - 1` (its weight there is 0). `None` where the structure itself depends on
        `n` (then a solve runs unpadded). This default is `None`."""
        return None


class _Equispaced(AbstractVolterraWeights):
    """Weights $h\\,c(i, p)$ on equispaced nodes, with $c$ a formula in the indices that
    does not depend on $N$ (so row $i$ is the same on any number of nodes past $i$)."""

    h: float | Float[Array, ""]

    def __call__(self, query_index, key_index):
        i = jnp.asarray(query_index)[:, None]
        p = jnp.asarray(key_index)[None, :]
        return self.h * self._c(i, p)

    def padded(self, n_padded: int) -> AbstractVolterraWeights | None:
        """The same formula on `n_padded` nodes, the spacing `h` as data (an array): rows
        `i < n` are unchanged and read no node past `i` (strictly causal) or past the
        rule's own start rows."""
        if n_padded < self.n:
            raise ValueError(f"`n_padded`={n_padded} is below the rule's {self.n} nodes.")
        return type(self)(n=int(n_padded), h=to_device(np.float64(self.h)))


class MidpointVolterra(_Equispaced):
    r"""Cell-centred nodes $x_p = a + (p + \tfrac12)h$: the $i$ full cells by the midpoint
    rule and the half cell $[x_i - h/2, x_i]$ by the linear interpolant through
    $x_{i-1}, x_i$ (weights $\tfrac18 h$, $\tfrac38 h$). Row $i$:
    $h\,(1, \dots, 1, \tfrac98, \tfrac38)$; row 0 (the half cell with one node): $\tfrac12 h$.
    Positive, strictly causal, order 2 ($C^2$ integrand).

    `n`: the number of cells (nodes) $N$; `h`: the cell width $h = (b - a)/N$, which
    multiplies every row's coefficients."""

    def _c(self, i, p):
        c = jnp.where(p < i - 1, 1.0, jnp.where(p == i - 1, 9 / 8, 3 / 8))
        c = jnp.where(i == 0, 0.5, c)
        return jnp.where(p > i, 0.0, c)


class TrapezoidVolterra(_Equispaced):
    r"""Nodes $x_p = a + p h$: the trapezoid rule on $x_0, \dots, x_i$; row 0 (the empty
    interval, whose ratio is the limit $V(a)$) a single weight $h$. Positive, strictly
    causal, order 2 ($C^2$ integrand).

    `n`: the number of nodes $N$; `h`: the node spacing, $(b - a)/(N - 1)$ for the
    trapezoid rule and $(b - a)/N$ for the periodic trapezoid rule, which multiplies every
    row's coefficients."""

    def _c(self, i, p):
        c = jnp.where((p == 0) | (p == i), 0.5, 1.0)
        c = jnp.where(i == 0, 1.0, c)
        return jnp.where(p > i, 0.0, c)


# rows 0..4 of the fourth-order rule: a cubic through x_0..x_3 integrated over [x_0, x_1]
# for row 1 (it reads x_2, x_3), Simpson, Simpson's 3/8 and composite Simpson for rows 2-4
_GREGORY_START = np.array(
    [
        [1.0, 0.0, 0.0, 0.0, 0.0],
        [9 / 24, 19 / 24, -5 / 24, 1 / 24, 0.0],
        [1 / 3, 4 / 3, 1 / 3, 0.0, 0.0],
        [3 / 8, 9 / 8, 9 / 8, 3 / 8, 0.0],
        [1 / 3, 4 / 3, 2 / 3, 4 / 3, 1 / 3],
    ]
)
# with three nodes only (N = 3) row 1 is the quadratic through x_0..x_2 over [x_0, x_1]
_ROW1_QUADRATIC = np.array([5 / 12, 8 / 12, -1 / 12, 0.0, 0.0])
_GREGORY_END = np.array([3 / 8, 7 / 6, 23 / 24])


class GregoryVolterra(_Equispaced):
    r"""Nodes $x_p = a + p h$: Gregory's fourth-order rule on $x_0, \dots, x_i$ for
    $i \ge 5$ (the trapezoid rule with end weights $h(\tfrac38, \tfrac76, \tfrac{23}{24})$
    at both ends), Newton–Cotes rules for $i = 2, 3, 4$, and for $i = 1$ the cubic through
    $x_0, \dots, x_3$ integrated over $[x_0, x_1]$, $h(\tfrac{9}{24}, \tfrac{19}{24},
    -\tfrac{5}{24}, \tfrac{1}{24})$: the starting procedure of Volterra quadrature. Order 4
    ($C^4$ integrand, smooth up to $x_3$); signed (row 1) and not strictly causal (row 1
    reads $x_2, x_3$).

    `n`: the number of nodes $N$ (any $N \ge 3$, odd or even; with $N = 3$ row 1 is the
    quadratic through $x_0, x_1, x_2$); `h`: the node spacing $(b - a)/(N - 1)$, which
    multiplies every row's coefficients."""

    signed: ClassVar[bool] = True
    strict: ClassVar[bool] = False
    order: ClassVar[float] = 4.0

    def padded(self, n_padded: int) -> AbstractVolterraWeights | None:
        """As for every equispaced rule, except below 4 nodes: there row 1 is another rule
        (the quadratic through 3 nodes), so `None` (unpadded)."""
        return None if self.n < 4 else super().padded(n_padded)

    def _c(self, i, p):
        start = np.array(_GREGORY_START)
        if self.n < 4:
            start[1] = _ROW1_QUADRATIC
        start = jnp.asarray(start)
        small = start[jnp.clip(i, 0, 4), jnp.clip(p, 0, 4)] * (p < 5)
        end = jnp.asarray(_GREGORY_END)
        big = jnp.where(
            p < 3, end[jnp.clip(p, 0, 2)], jnp.where(i - p < 3, end[jnp.clip(i - p, 0, 2)], 1.0)
        )
        big = jnp.where(p > i, 0.0, big)
        return jnp.where(i < 5, small, big)


class SpectralVolterra(AbstractVolterraWeights):
    r"""Spectral integration on Gauss–Legendre nodes: $W_{ip} = \int_a^{x_i} \ell_p$, with
    $\ell_p$ the Lagrange polynomial of degree $N-1$ on all $N$ nodes. Computed stably in
    the Legendre basis, $\ell_p(t) = w_p \sum_{k<N} \tfrac{2k+1}{2} P_k(t_p) P_k(t)$ and
    $\int_{-1}^{t} P_k = (P_{k+1} - P_{k-1})(t)/(2k+1)$. Geometric convergence for an
    integrand analytic on $[a, b]$; signed; reads every node (not strictly causal).

    `n`: the number of Gauss–Legendre nodes $N$; `weights`: the matrix $W_{ip}$, `[n, n]`
    (row $i$ the query, column $p$ the key): $\tfrac{b - a}{2}$ times the same integrals
    on $[-1, 1]$ (computed in float64 NumPy)."""

    weights: Float[Array, "n n"]
    signed: ClassVar[bool] = True
    strict: ClassVar[bool] = False
    order: ClassVar[float] = math.inf

    def __call__(self, query_index, key_index):
        return self.weights[jnp.asarray(query_index)[:, None], jnp.asarray(key_index)[None, :]]

    def padded(self, n_padded: int) -> AbstractVolterraWeights | None:
        """The matrix zero-padded to `[n_padded, n_padded]` (on the host: no program per
        `n`)."""
        if n_padded < self.n:
            raise ValueError(f"`n_padded`={n_padded} is below the rule's {self.n} nodes.")
        w = np.zeros((n_padded, n_padded))
        w[: self.n, : self.n] = np.asarray(self.weights, np.float64)
        return SpectralVolterra(n=int(n_padded), weights=to_device(w))


def legendre_integration_matrix(n: int) -> np.ndarray:
    r"""$M_{ip} = \int_{-1}^{t_i} \ell_p(t)\,dt$ on the $n$ Gauss–Legendre nodes $t_i$
    (float64 NumPy, `[n, n]`)."""
    leg = np.polynomial.legendre
    t, w = leg.leggauss(n)
    vand = leg.legvander(t, n)  # [i, k] = P_k(t_i), k = 0..n
    pk = vand[:, :n]  # P_k(t_p), k < n
    integral = np.empty((n, n))  # [i, k] = int_{-1}^{t_i} P_k
    integral[:, 0] = t + 1.0
    for k in range(1, n):
        integral[:, k] = (vand[:, k + 1] - vand[:, k - 1]) / (2 * k + 1)
    scale = (2 * np.arange(n) + 1) / 2
    return (integral * scale[None, :]) @ (pk * w[:, None]).T


#: Partial-interval weights by rule name: `(a, b, n) -> AbstractVolterraWeights`.
VOLTERRA_WEIGHTS = {
    "midpoint": lambda a, b, n: MidpointVolterra(n=n, h=(b - a) / n),
    "trapezoid": lambda a, b, n: TrapezoidVolterra(n=n, h=(b - a) / (n - 1)),
    "periodic-trapezoid": lambda a, b, n: TrapezoidVolterra(n=n, h=(b - a) / n),
    "simpson": lambda a, b, n: GregoryVolterra(n=n, h=(b - a) / (n - 1)),
    "gauss-legendre": lambda a, b, n: SpectralVolterra(
        n=n, weights=jnp.asarray((b - a) / 2 * legendre_integration_matrix(n))
    ),
}


def volterra_weights(rule, n: int) -> AbstractVolterraWeights:
    """The partial-interval weights of `rule` (an `itde.AbstractQuadrature`) at `n` nodes,
    on the rule's interval; a `ValueError` naming the rule where none is defined.

    `n` is an integer of at least the rule's `min_nodes` (`Trapezoid` 2, `Simpson` 3). It
    need not have the parity of a composite full-interval rule: the partial-interval
    weights of Simpson's equispaced nodes are Gregory's ([`GregoryVolterra`][]), defined
    and of order 4 at every `n >= 3`, odd or even (only composite Simpson on the whole
    interval, `Simpson.nodes_weights`, needs an odd `n`)."""
    # a rule is anything with the quadrature interface (this module sits below _rules)
    if not all(callable(getattr(rule, m, None)) for m in ("_check_n", "bounds", "nodes_weights")):
        raise TypeError(
            f"`rule`={rule!r} must be an itde quadrature rule (e.g. itde.Simpson()), got "
            f"{type(rule).__name__}."
        )
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"`n`={n!r} must be an integer number of nodes.")
    n, least = int(n), getattr(rule, "min_nodes", 1)
    if n < least:
        raise ValueError(f"`{type(rule).__name__}` needs n >= {least} nodes, got n={n}.")
    make = VOLTERRA_WEIGHTS.get(rule.name)
    if make is None:
        raise ValueError(
            f"no partial-interval (Volterra) weights for the token rule {rule.name!r}; causal "
            f"attention at quadrature order is defined for {', '.join(VOLTERRA_WEIGHTS)}."
        )
    a, b = rule.bounds(n)
    return make(a, b, n)
