import math
from fractions import Fraction

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXACT_DEGREE, QUADRATURES

import itde


def _n_for(name, n):
    return n + 1 if name == "simpson" and n % 2 == 0 else n


@pytest.mark.parametrize("name", sorted(EXACT_DEGREE))
@pytest.mark.parametrize("n", [3, 5, 8])
def test_polynomials_integrated_exactly_up_to_degree(name, n):
    n = _n_for(name, n)
    rule = QUADRATURES[name](interval=(-0.3, 1.7))
    x, w = rule.nodes_weights(n)
    a, b = -0.3, 1.7
    deg = EXACT_DEGREE[name](n)
    for k in range(deg + 1):
        exact = (b ** (k + 1) - a ** (k + 1)) / (k + 1)
        assert np.sum(w * x**k) == pytest.approx(exact, rel=1e-12, abs=1e-12), (name, n, k)
    # ... and not beyond (the degree is sharp)
    k = deg + 1
    exact = (b ** (k + 1) - a ** (k + 1)) / (k + 1)
    assert abs(np.sum(w * x**k) - exact) > 1e-10


def test_periodic_trapezoid_exact_for_trig_polynomials():
    rule = itde.PeriodicTrapezoid(interval=(0.0, 2 * math.pi))
    x, w = rule.nodes_weights(8)
    for k in range(1, 8):
        assert abs(np.sum(w * np.cos(k * x))) < 1e-13
        assert abs(np.sum(w * np.sin(k * x))) < 1e-13
    assert np.sum(w) == pytest.approx(2 * math.pi)
    assert abs(np.sum(w * np.cos(8 * x))) > 1  # aliasing at k = N


def _order(name, ns, f, exact, interval=(0.0, 1.0)):
    errs = []
    for n in ns:
        x, w = QUADRATURES[name](interval=interval).nodes_weights(_n_for(name, n))
        errs.append(abs(np.sum(w * f(x)) - exact))
    h = np.array([1.0 / _n_for(name, n) for n in ns])
    return np.polyfit(np.log(h), np.log(errs), 1)[0], errs


@pytest.mark.parametrize("name,expected", [("midpoint", 2), ("trapezoid", 2), ("simpson", 4)])
def test_observed_order_on_smooth_function(name, expected):
    f = lambda x: np.exp(np.sin(3 * x))  # noqa: E731
    from scipy_free_reference import integral_exp_sin3

    slope, _ = _order(name, [17, 33, 65, 129], f, integral_exp_sin3())
    assert slope == pytest.approx(expected, abs=0.15)


def test_gauss_legendre_and_periodic_are_geometric():
    from scipy_free_reference import integral_exp_sin3

    _, errs = _order(
        "gauss-legendre", [4, 8, 16], lambda x: np.exp(np.sin(3 * x)), integral_exp_sin3()
    )
    assert errs[-1] < 1e-13 and errs[1] < errs[0] * 1e-3
    # periodic analytic integrand on one period
    exact = 2 * math.pi * np.i0(1.0)  # int_0^{2pi} exp(cos x) dx = 2 pi I0(1)
    _, errs = _order(
        "periodic-trapezoid",
        [4, 8, 16],
        lambda x: np.exp(np.cos(x)),
        exact,
        interval=(0.0, 2 * math.pi),
    )
    assert errs[1] < 1e-5 and errs[2] < 1e-13 and errs[1] < errs[0] * 1e-3


def test_unit_midpoint_is_the_standard_transformer():
    x, w = itde.Midpoint().nodes_weights(7)
    assert np.all(w == 1.0) and np.allclose(x, np.arange(7) + 0.5)
    assert itde.Midpoint().is_unit(7) and not itde.Trapezoid().is_unit(7)


@pytest.mark.parametrize("cls", [itde.Midpoint, itde.PeriodicTrapezoid], ids=lambda c: c.name)
@pytest.mark.parametrize(
    "interval, n, unit",
    [
        ((0.1, 4.1), 4, True),  # 4 long as written; 4.1 - 0.1 is 3.9999999999999996
        ((0.1, 4.1), 5, False),
        ((Fraction(1, 3), Fraction(13, 3)), 4, True),  # ends no float holds
        ((np.float32(0.1), np.float32(4.1)), 4, True),  # written as float32
        ((-2.5, 1.5), 4, True), ((3, 5), 2, True), (None, 7, True),
        ((0.0, 4.000000000000001), 4, False),  # the float after 4
        ((0.1, 4.1000000000000005), 4, False),  # the float after 4.1
    ],
)  # fmt: skip
def test_unit_grid_is_decided_from_the_ends_as_written(cls, interval, n, unit):
    """Every weight is (b - a)/N: 1 exactly when b - a = N for the ends as given (a float
    read as the decimal it was written as), whatever b - a rounds to in floating point;
    then the causal sum is the Transformer's masked sum, not the Volterra weights."""
    rule = cls(interval=interval)
    assert rule.is_unit(n) is unit
    assert (rule.causal_weights(n) is None) is unit
    if unit:
        assert np.array_equal(rule.nodes_weights(n)[1], np.ones(n))


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: itde.Midpoint(interval=(1.0, 0.0)), "interval"),
        (lambda: itde.Midpoint(interval=(0.0, float("nan"))), "interval"),
        (lambda: itde.Simpson().nodes_weights(4), "odd number of nodes.*n=4"),
        (lambda: itde.Trapezoid().nodes_weights(1), "n >= 2.*n=1"),
        (lambda: itde.GaussLegendre().nodes_weights(0), "n=0"),
        (lambda: itde.Grid(itde.Midpoint(), itde.Simpson(), 8), "odd number of nodes.*n=8"),
        (lambda: itde.Grid(itde.Midpoint(), "midpoint", 8), "features"),
        (lambda: itde.Grid("midpoint", itde.Midpoint(), 8), r"tokens.*token domain"),
    ],
)
def test_bad_rules_are_rejected_with_the_value(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_or_nan_weights_rejected(bad):
    from itde._internal import check_weights

    w = np.ones(5)
    w[2] = bad
    with pytest.raises(ValueError, match=r"entry 2 is"):
        check_weights("token weights", w)


def test_rules_do_not_import_the_2d_grid():
    """The 1-D rules and `Grid` know token domains only through `AbstractTokenDomain`: no
    import of the 2-D grid anywhere in `_rules.py` (not even inside a function)."""
    import ast
    import inspect
    import pathlib

    rules = inspect.getsourcefile(itde.GaussLegendre)  # the rules' module
    assert rules is not None and rules.endswith("_rules.py"), rules
    tree = ast.parse(pathlib.Path(rules).read_text())
    imported = {
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert "_domain" in imported and not any("grid2d" in m for m in imported), imported
    assert itde.Grid.__annotations__["tokens"] in ("AbstractTokenDomain", itde.AbstractTokenDomain)


def test_grid_weights_cast_with_state_dtype():
    grid = itde.Grid(itde.GaussLegendre(interval=(0, 1)), itde.Trapezoid(interval=(0, 1)), 9)
    u = jnp.ones((5, 9), jnp.float32)
    m = itde.TransformerIDE.init(
        __import__("jax").random.key(0),
        n_layers=1,
        n_features=9,
        n_heads=3,
        grid=grid,
        dtype=jnp.float32,
    )
    assert m(u).dtype == jnp.float32
