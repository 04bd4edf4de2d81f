"""The tensor-product token grid integrates separable polynomials exactly up to the 1-D
rules' degrees, and plugs into attention as a log-bias."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import EXACT_DEGREE, QUADRATURES

import itde
from itde import TensorGrid2D

I1, I2 = (-0.3, 1.7), (0.5, 2.0)


def _moment(k, a, b):
    return (b ** (k + 1) - a ** (k + 1)) / (k + 1)


@pytest.mark.parametrize(
    "r1,n1,r2,n2",
    [
        ("midpoint", 4, "gauss-legendre", 3),
        ("simpson", 5, "trapezoid", 4),
        ("gauss-legendre", 4, "simpson", 7),
        ("trapezoid", 3, "midpoint", 6),
    ],
)
def test_separable_polynomials_exact_up_to_the_1d_degrees(r1, n1, r2, n2):
    g = TensorGrid2D(QUADRATURES[r1](interval=I1), QUADRATURES[r2](interval=I2), n1, n2)
    x, w = g.nodes_weights()
    assert x.shape == (n1 * n2, 2) and w.shape == (n1 * n2,)
    d1, d2 = EXACT_DEGREE[r1](n1), EXACT_DEGREE[r2](n2)
    for i in range(d1 + 2):
        for j in range(d2 + 2):
            exact = _moment(i, *I1) * _moment(j, *I2)
            got = float(g.integrate(jnp.asarray(x[:, 0] ** i * x[:, 1] ** j)))
            if i <= d1 and j <= d2:
                assert got == pytest.approx(exact, rel=1e-12, abs=1e-12), (i, j)
            else:  # beyond the degree in one direction: not exact (the degree is sharp)
                assert abs(got - exact) > 1e-10, (i, j)
    assert g.area() == pytest.approx((I1[1] - I1[0]) * (I2[1] - I2[0]))


def test_raster_order_and_log_weights():
    g = TensorGrid2D(itde.Midpoint(), itde.Trapezoid(interval=(0.0, 1.0)), 2, 3)
    x, w = g.nodes_weights(6)
    np.testing.assert_allclose(x[:3, 0], 0.5)  # first row: x1 fixed, x2 runs fastest
    np.testing.assert_allclose(x[:3, 1], [0.0, 0.5, 1.0])
    np.testing.assert_allclose(w, np.tile([0.25, 0.5, 0.25], 2))
    np.testing.assert_allclose(g.token_log_weights(6), np.log(w))
    assert g.token_log_weights(dtype=jnp.float32).dtype == jnp.float32
    with pytest.raises(ValueError, match="2 x 3 = 6"):
        g.token_weights(7)
    with pytest.raises(ValueError, match="odd"):
        TensorGrid2D(itde.Simpson(), itde.Midpoint(), 4, 3)
    with pytest.raises(TypeError, match="quadrature rule"):
        TensorGrid2D("midpoint", itde.Midpoint(), 2, 2)


UNIFORM = [
    lambda: itde.Midpoint(),
    lambda: itde.Midpoint(interval=(0.0, 3.0)),
    lambda: itde.PeriodicTrapezoid(interval=(0.0, 1.0)),
    lambda: TensorGrid2D(itde.Midpoint(), itde.Midpoint(interval=(0.0, 2.0)), 2, 3),
]
NON_UNIFORM = [
    lambda: itde.Trapezoid(interval=(0.0, 1.0)),
    lambda: itde.GaussLegendre(interval=(0.0, 1.0)),
    lambda: TensorGrid2D(itde.Midpoint(), itde.Trapezoid(interval=(0.0, 1.0)), 2, 3),
]


@pytest.mark.parametrize("make", UNIFORM + NON_UNIFORM)
def test_token_domains_share_one_log_weight_convention(make):
    """Every token domain (1-D rule or 2-D grid) is an `AbstractTokenDomain`: `None` for
    uniform weights, `log w` otherwise; attention gives the same either way."""
    dom = make()
    assert isinstance(dom, itde.AbstractTokenDomain)
    grid = itde.Grid(dom, itde.Midpoint(), 4)
    w = grid.token_weights(6)
    lw = grid.token_log_weights(6, jnp.float64)
    assert (lw is None) == bool(np.all(w == w[0])) == (make in UNIFORM)
    explicit = jnp.log(jnp.asarray(w))
    if lw is not None:
        np.testing.assert_allclose(lw, explicit, rtol=0, atol=0)
    att = itde.Attention.init(jax.random.PRNGKey(0), 4, 2, dtype=jnp.float64)
    u = jax.random.normal(jax.random.PRNGKey(1), (6, 4), jnp.float64)
    np.testing.assert_allclose(
        att(u, token_log_weights=lw), att(u, token_log_weights=explicit), rtol=1e-13, atol=1e-14
    )


def test_attention_over_2d_patches_converges_geometrically_with_gauss_legendre():
    """The 2-D attention integral at a fixed query, with a smooth analytic key/value."""
    att = itde.Attention.init(jax.random.PRNGKey(0), 4, 1, dtype=jnp.float64)

    def at(n):
        g = TensorGrid2D(
            itde.GaussLegendre(interval=(0, 1)), itde.GaussLegendre(interval=(0, 1)), n, n
        )
        x = np.concatenate([g.nodes(), [[0.4, 0.6]]])  # query joins with weight 0
        u = jnp.stack(
            [jnp.sin(2 * x[:, 0]), jnp.cos(x[:, 1]), x[:, 0] * x[:, 1], jnp.exp(-x[:, 0])], axis=-1
        )
        # explicit log-weights (token_log_weights is None for n=2: GL's 2 weights are equal)
        lw = jnp.concatenate([jnp.log(g.token_weights()), jnp.array([-math.inf])])
        return att(u, token_log_weights=lw)[-1]

    ref = at(24)
    errs = [float(jnp.max(jnp.abs(at(n) - ref))) for n in (2, 4, 8)]
    assert errs[2] < 1e-12 and errs[1] < 1e-3 * errs[0], errs
