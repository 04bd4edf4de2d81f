r"""Quadrature rules on an interval, and the token × feature grid built from two of them.

A rule turns a number of nodes $N$ into nodes $x_k$ and positive weights $w_k$ with
$\int_a^b g \approx \sum_k w_k g(x_k)$. Nodes and weights are computed in float64 NumPy
at trace time (they depend only on the static $N$) and cast to the state's dtype.
"""

from __future__ import annotations

import abc
import math
from decimal import Decimal
from fractions import Fraction
from typing import ClassVar

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float

from ._domain import AbstractTokenDomain, check_weights
from ._padded import PaddedTokens, check_padded
from ._volterra import volterra_weights


def _check_interval(name: str, interval) -> tuple[float, float] | None:
    if interval is None:
        return None
    if isinstance(interval, (str, bytes)):
        raise TypeError(
            f"`{name}(interval=...)` must be a pair of numbers (a, b) or None, got {interval!r}."
        )
    try:
        a, b = (float(v) for v in interval)
    except (TypeError, ValueError):
        raise TypeError(
            f"`{name}(interval=...)` must be a pair of numbers (a, b) or None, got {interval!r}."
        ) from None
    if not (math.isfinite(a) and math.isfinite(b) and b > a):
        raise ValueError(
            f"`{name}(interval=...)` must be finite with b > a, got {interval!r}; "
            "swap the ends or give a non-empty interval."
        )
    return (a, b)


def _exact(v) -> Fraction:
    """The number `v` as given, exactly: an integer, a `Fraction` or a `Decimal` as it is; a
    float (Python's, NumPy's of any width, a 0-d array) as the shortest decimal that reads
    back as it, i.e. as it was written (`0.1` is 1/10, not the binary float nearest it)."""
    if isinstance(v, (Fraction, Decimal)):
        return Fraction(v)
    x = np.asarray(v)[()]
    if isinstance(x, (np.integer, np.bool_)):
        return Fraction(int(x))
    if isinstance(x, np.floating):
        return Fraction(str(x))  # NumPy's shortest round-trip repr for x's own width
    return Fraction(repr(float(v)))


class AbstractQuadrature(AbstractTokenDomain):
    r"""A quadrature rule on an interval $[a, b]$, for any number of nodes.

    As a token domain it takes the number of tokens from the state. `interval=None`
    means the unit-spacing interval $[0, N]$ for $N$ nodes, the grid on which the
    discrete Transformer lives (every weight is 1 for the midpoint rule).

    **Fields:** `interval`: the domain $[a, b]$ of the rule as a pair of floats `(a, b)`,
    $b > a$, on which the nodes lie and whose length the weights sum to; or None for
    $[0, N]$ (then the interval grows with the number of nodes, at fixed spacing). The ends
    as given (an integer, a `Fraction`, a float as the decimal it was written as) are kept
    exactly beside it, for [`is_unit`][itde.AbstractQuadrature.is_unit].
    """

    interval: tuple[float, float] | None = eqx.field(default=None, static=True)
    # the ends as given, exactly (see `_exact`): what `is_unit` decides from
    _exact_interval: tuple[Fraction, Fraction] | None = eqx.field(
        default=None, static=True, init=False, repr=False
    )

    name: ClassVar[str] = "abstract"
    order: ClassVar[float] = 0.0  # global order for smooth integrands; inf = geometric
    min_nodes: ClassVar[int] = 1

    def __post_init__(self):
        # store the checked pair of floats, not whatever was given (e.g. the string "01"),
        # and beside it the pair as given, exactly
        given = self.interval
        checked = _check_interval(type(self).__name__, given)
        object.__setattr__(self, "interval", checked)
        exact = None if given is None else tuple(_exact(v) for v in given)
        object.__setattr__(self, "_exact_interval", exact)

    def bounds(self, n: int) -> tuple[float, float]:
        if self.interval is None:
            return (0.0, float(n))
        return self.interval

    def length(self, n: int) -> float:
        a, b = self.bounds(n)
        return b - a

    def _check_n(self, n) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"number of nodes `n` must be an int, got {n!r}.")
        n = int(n)
        if n < self.min_nodes:
            raise ValueError(
                f"`{type(self).__name__}` needs n >= {self.min_nodes} nodes, got n={n}."
            )
        return n

    def nodes_weights(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Nodes and weights (float64 NumPy arrays of shape `[n]`) on the interval. On the
        unit grid ([`is_unit`][itde.AbstractQuadrature.is_unit]) the weights are exactly 1
        and the nodes [`unit_nodes`][itde.AbstractQuadrature.unit_nodes], not the
        interval's length times those of $[0, 1]$ ($N \\cdot (1/N)$ is not 1 in floating
        point for some $N$)."""
        n = self._check_n(n)
        a, b = self.bounds(n)
        if self.is_unit(n):
            return a + self.unit_nodes(n), np.ones(n)
        x, w = self._reference(n)  # on [0, 1]
        return a + (b - a) * x, (b - a) * w

    def unit_nodes(self, n: int) -> np.ndarray:
        """The nodes on $[0, N]$ (`interval=None`; shifted by $a$ on an interval $[a, a + N]$),
        float64 `[n]`: $N$ times those of $[0, 1]$; rules whose unit-grid nodes are whole or
        half numbers give them exactly."""
        n = self._check_n(n)
        return n * self._reference(n)[0]

    @abc.abstractmethod
    def _reference(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Nodes and weights on [0, 1] (each final rule defines them)."""

    def causal_weights(self, n_tokens: int):
        r"""The partial-interval (Volterra) weights for causal attention at `n_tokens`
        nodes: `None` on the unit grid (every weight 1: the Transformer's masked sum, the
        first-order member of the family), otherwise the rule's per-query weights for
        $\int_a^{x_i}$, with their order, signs and causality stated in
        [`volterra_weights`][itde.volterra_weights]."""
        n = self._check_n(n_tokens)
        if self.is_unit(n):
            return None
        return volterra_weights(self, n)

    def padded(self, n_tokens: int, n_padded: int, *, causal: bool = False):
        r"""The rule at `n_tokens` nodes as data on `n_padded` >= `n_tokens` nodes: a
        [`PaddedTokens`][itde.PaddedTokens] holding the rule's nodes and weights (then
        padded nodes of weight zero), its log-weights unless its weights are uniform
        ([`uniform_weights`][itde.AbstractQuadrature.uniform_weights]) and, with `causal`,
        its partial-interval weights padded
        ([`AbstractVolterraWeights.padded`][itde.AbstractVolterraWeights.padded]) unless
        it is the unit grid ([`is_unit`][itde.AbstractQuadrature.is_unit]). `None` where
        the Volterra weights at `n_tokens` have a structure of their own (Gregory's rule
        below 4 nodes). Raises as
        [`nodes_weights`][itde.AbstractQuadrature.nodes_weights] does for a count the rule
        refuses (e.g. an even count for `Simpson`)."""
        n = self._check_n(n_tokens)
        n_padded = check_padded(n, n_padded)
        x, w = self.nodes_weights(n)
        volterra = None
        if causal:
            cw = self.causal_weights(n)
            if cw is not None:
                volterra = cw.padded(n_padded)
                if volterra is None:
                    return None
        return PaddedTokens.from_rule(x, w, self.uniform_weights(n), volterra, n_padded)

    def uniform_weights(self, n: int) -> bool:
        """True when the rule's `n` weights are all equal, by construction of the rule (its
        formula, not a comparison of computed weights): one node always; every `n` for the
        midpoint and periodic trapezoid rules; `n = 2` for the trapezoid and Gauss–Legendre
        rules."""
        return self._check_n(n) == 1

    def is_unit(self, n: int) -> bool:
        """True when every weight is 1 (the standard Transformer's grid): the rule's weights
        are all equal ([`uniform_weights`][itde.AbstractQuadrature.uniform_weights]) and
        the interval is $N$ long ($[0, N]$ for `interval=None`), so each is $N/N = 1$.
        Decided by what the rule is, never by comparing computed numbers: the length is
        $b - a$ in exact rational arithmetic of the ends as given (an integer or a
        `Fraction` as it is, a float as the decimal it was written as: `(0.1, 4.1)` is 4
        long, although `4.1 - 0.1` is `3.9999999999999996` in floating point)."""
        if not self.uniform_weights(n):
            return False
        if self._exact_interval is None:
            return True  # [0, N]
        a, b = self._exact_interval
        return b - a == n


class Midpoint(AbstractQuadrature):
    r"""Composite midpoint rule: $N$ cells of width $h$, one node at each centre.

    Order 2 for $C^2$ integrands. With `interval=None` the width is 1 and every weight
    is 1: the standard Transformer's sum over tokens or features.

    `interval`: the domain $[a, b]$ (`(a, b)`), cut into $N$ cells of width
    $h = (b - a)/N$, nodes $a + (k + \tfrac12)h$ and weights $h$; or None for $[0, N]$.
    """

    name: ClassVar[str] = "midpoint"
    order: ClassVar[float] = 2.0

    def _reference(self, n):
        h = 1.0 / n
        return (np.arange(n) + 0.5) * h, np.full(n, h)

    def uniform_weights(self, n):
        self._check_n(n)
        return True  # every cell has width h

    def unit_nodes(self, n):
        return np.arange(self._check_n(n)) + 0.5  # the cell centres k + 1/2, exactly


class Trapezoid(AbstractQuadrature):
    r"""Composite trapezoid rule on $N \ge 2$ equispaced nodes including both ends.

    Order 2 for $C^2$ integrands; exact for polynomials of degree 1.

    `interval`: the domain $[a, b]$ (`(a, b)`), nodes $a + k h$, $h = (b - a)/(N - 1)$,
    weights $h$ inside and $h/2$ at the two ends; or None for $[0, N]$.
    """

    name: ClassVar[str] = "trapezoid"
    order: ClassVar[float] = 2.0
    min_nodes: ClassVar[int] = 2

    def _reference(self, n):
        h = 1.0 / (n - 1)
        w = np.full(n, h)
        w[0] = w[-1] = h / 2
        return np.linspace(0.0, 1.0, n), w

    def uniform_weights(self, n):
        return self._check_n(n) == 2  # (h/2, h/2): both nodes are ends


class Simpson(AbstractQuadrature):
    r"""Composite Simpson rule on an odd number $N \ge 3$ of equispaced nodes.

    Order 4 for $C^4$ integrands; exact for polynomials of degree 3.

    `interval`: the domain $[a, b]$ (`(a, b)`), nodes $a + k h$, $h = (b - a)/(N - 1)$,
    weights $\tfrac{h}{3}(1, 4, 2, 4, \dots, 2, 4, 1)$; or None for $[0, N]$.
    """

    name: ClassVar[str] = "simpson"
    order: ClassVar[float] = 4.0
    min_nodes: ClassVar[int] = 3

    def _check_n(self, n):
        n = super()._check_n(n)
        if n % 2 == 0:
            raise ValueError(f"`Simpson` needs an odd number of nodes, got n={n}; use n={n + 1}.")
        return n

    def _reference(self, n):
        h = 1.0 / (n - 1)
        w = np.full(n, 2.0)
        w[1::2] = 4.0
        w[0] = w[-1] = 1.0
        return np.linspace(0.0, 1.0, n), w * h / 3


class GaussLegendre(AbstractQuadrature):
    r"""Gauss–Legendre rule with $N$ nodes inside the interval.

    Exact for polynomials of degree $2N - 1$; geometric convergence for analytic
    integrands.

    `interval`: the domain $[a, b]$ (`(a, b)`) onto which the Gauss–Legendre nodes and
    weights of $[-1, 1]$ are mapped affinely (weights scaled by $(b - a)/2$); or None for
    $[0, N]$.
    """

    name: ClassVar[str] = "gauss-legendre"
    order: ClassVar[float] = math.inf

    def _reference(self, n):
        x, w = np.polynomial.legendre.leggauss(n)
        return (x + 1) / 2, w / 2

    def uniform_weights(self, n):
        return self._check_n(n) <= 2  # (1) and (1/2, 1/2) on [0, 1]; unequal from n = 3 on


class PeriodicTrapezoid(AbstractQuadrature):
    r"""Trapezoid rule for periodic integrands: $N$ equispaced nodes $a + k h$, $h = L/N$.

    Exact for trigonometric polynomials of degree $< N$; geometric convergence for
    analytic periodic integrands. For a non-periodic integrand it is a left Riemann
    sum: order 1 only.

    `interval`: one period $[a, b]$ (`(a, b)`), $L = b - a$, every weight $h$ (the node
    $b$ is the node $a$ again, so it is left out); or None for $[0, N]$.
    """

    name: ClassVar[str] = "periodic-trapezoid"
    order: ClassVar[float] = math.inf

    def _reference(self, n):
        return np.arange(n) / n, np.full(n, 1.0 / n)

    def uniform_weights(self, n):
        self._check_n(n)
        return True  # every weight is the spacing h

    def unit_nodes(self, n):
        return np.arange(self._check_n(n), dtype=np.float64)  # 0, 1, ..., N - 1 exactly

    # NB: for a non-periodic integrand it drops the right end point: a left Riemann sum,
    # order 1 only.


RULES: dict[str, type[AbstractQuadrature]] = {
    cls.name: cls for cls in (Midpoint, Trapezoid, Simpson, GaussLegendre, PeriodicTrapezoid)
}
"""The quadrature rules by name, for configs and the CLI (`[grid] tokens = "gauss-legendre"`):
name -> rule class."""


class Grid(eqx.Module):
    r"""A token × feature grid: nodes and weights on $\Omega_x$ and on $\Omega_y$.

    **Arguments:**

    - `tokens`: the token domain $\Omega_x$: a 1-D rule (its number of nodes is taken
      from the state at call time), or a [`TensorGrid2D`][itde.TensorGrid2D] for a 2-D
      token domain (image patches), whose node count is fixed.
    - `features`: the rule on the feature domain $\Omega_y$.
    - `n_features`: the number of feature nodes $N_y$ (the model width).
    """

    tokens: AbstractTokenDomain
    features: AbstractQuadrature
    n_features: int = eqx.field(static=True)

    def __check_init__(self):
        if not isinstance(self.tokens, AbstractTokenDomain):
            raise TypeError(
                "`Grid(tokens=...)` must be a token domain: a quadrature rule such as "
                f"`Midpoint()` or a 2-D `TensorGrid2D`, got {self.tokens!r}."
            )
        if not isinstance(self.features, AbstractQuadrature):
            raise TypeError(
                "`Grid(features=...)` must be a quadrature rule such as `Midpoint()`, "
                f"got {self.features!r}."
            )
        self.features.nodes_weights(self.n_features)  # validates n for the rule

    @classmethod
    def unit(cls, n_features: int) -> Grid:
        """The standard Transformer's grid: unit-spacing midpoint in tokens and features."""
        return cls(Midpoint(), Midpoint(), n_features)

    def feature_weights(self) -> np.ndarray:
        return check_weights("feature weights", self.features.nodes_weights(self.n_features)[1])

    def token_weights(self, n_tokens: int) -> np.ndarray:
        """The token weights $w_p$ (see [`AbstractTokenDomain`][])."""
        return self.tokens.token_weights(n_tokens)

    def token_log_weights(self, n_tokens: int, dtype=None) -> Float[Array, " tokens"] | None:
        """$\\log w_p$ for the attention log-bias, or `None` for uniform weights (the
        token domain's convention: a constant log-bias cancels in the softmax)."""
        return self.tokens.token_log_weights(n_tokens, dtype)

    def causal_weights(self, n_tokens: int):
        """Per-query weights for causal attention (see
        [`AbstractTokenDomain.causal_weights`][]), or `None` for the discrete causal sum."""
        return self.tokens.causal_weights(n_tokens)
