"""Resolution-independent kernels: bases, sampling, the under-resolution warning, and
convergence of the sampled operators to the integral operators at each rule's order."""

import functools
import sys
import warnings

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde._internal import legendre
from itde.function import (
    FourierBasis,
    FunctionAttention,
    FunctionBias,
    FunctionFeedForward,
    FunctionField,
    FunctionKernel,
    LegendreBasis,
)

Y, H, X = (0.0, 1.0), (-1.0, 1.0), (0.0, 1.0)


# ---------------------------------------------------------------------------- bases


@pytest.mark.parametrize(
    "basis,rule,n",
    [
        (LegendreBasis(7, (-0.5, 2.0)), itde.GaussLegendre, 7),
        (FourierBasis(7, (-0.5, 2.0)), itde.PeriodicTrapezoid, 8),
    ],
)
def test_bases_are_orthonormal(basis, rule, n):
    x, w = rule(interval=basis.interval).nodes_weights(n)
    phi = basis(jnp.asarray(x))
    assert phi.shape == (n, 7)
    np.testing.assert_allclose((phi.T * w) @ phi, np.eye(7), atol=1e-13)


def test_basis_values_and_derivative():
    x = jnp.array([0.0, 0.25, 1.0])
    phi = LegendreBasis(3, (0.0, 1.0))(x)
    t = 2 * x - 1  # P2 = (3t^2 - 1)/2, orthonormal factor sqrt(2k + 1) on [0, 1]
    np.testing.assert_allclose(phi[:, 2], np.sqrt(5) * (3 * t**2 - 1) / 2, atol=1e-14)
    # differentiable in x: d/dx of the orthonormal P1 = sqrt(3) (2x - 1) is 2 sqrt(3)
    d = jax.jacfwd(lambda z: LegendreBasis(2, (0.0, 1.0))(z)[:, 1])(x)
    np.testing.assert_allclose(jnp.diag(d), 2 * np.sqrt(3), atol=1e-13)
    f = FourierBasis(4, (0.0, 2.0))(jnp.array([0.5]))  # 1, cos(pi x), sin(pi x), cos(2 pi x)
    np.testing.assert_allclose(f[0], [np.sqrt(0.5), 0.0, 1.0, -1.0], atol=1e-15)
    assert LegendreBasis(3)(jnp.zeros(2, jnp.float32)).dtype == jnp.float32


@pytest.mark.parametrize("n", [1, 2, 9])
def test_legendre_recurrence_matches_numpy_legval(n):
    x = np.linspace(-1.0, 1.0, 13)
    ref = np.stack([np.polynomial.legendre.legval(x, np.eye(n)[k]) for k in range(n)])
    got = legendre(jnp.asarray(x), n)
    assert got.shape == (n, 13) and got.dtype == jnp.float64
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-14)
    # one shared recurrence: the depth controls and the basis both agree with numpy
    assert LegendreBasis(n, (-1.0, 1.0))(jnp.asarray(x)).shape == (13, n)
    norm = np.sqrt((2 * np.arange(n) + 1) / 2.0)
    np.testing.assert_allclose(
        LegendreBasis(n, (-1.0, 1.0))(jnp.asarray(x)), (ref * norm[:, None]).T, atol=1e-14
    )


def test_legendre_evaluates_half_precision_in_float32():
    x = np.linspace(-1.0, 1.0, 9)
    ref = np.polynomial.legendre.legval(x.astype(np.float16).astype(np.float64), np.eye(12)[11])
    got = legendre(jnp.asarray(x, jnp.float16), 12)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got[11], ref, rtol=0, atol=1e-5)
    assert legendre(jnp.arange(3), 2).dtype == jnp.zeros(()).dtype  # ints: default float
    with pytest.raises(ValueError, match=r"`n`=0"):
        legendre(x, 0)


def test_bad_bases_raise():
    with pytest.raises(ValueError, match="n_modes"):
        LegendreBasis(0)
    with pytest.raises(ValueError, match="interval"):
        FourierBasis(3, (1.0, 1.0))


# ---------------------------------------------------------------------------- sampling


def test_kernel_bias_field_sampling_shapes_and_values():
    key = jax.random.PRNGKey(0)
    bi, bo = LegendreBasis(3, Y), FourierBasis(4, H)
    k = FunctionKernel.init(key, bi, bo, batch=(2,))
    xi, y = jnp.linspace(0, 1, 5), jnp.linspace(-1, 1, 6)
    m = k.sample(xi, y)
    assert m.shape == (2, 5, 6)
    # value at one point: sum_ab c_ab phi_a(xi) psi_b(y)
    manual = bi(xi[2:3])[0] @ k.coeffs[1] @ bo(y[4:5])[0]
    np.testing.assert_allclose(m[1, 2, 4], manual, atol=1e-14)
    b = FunctionBias.init(key, bo, batch=(3,))
    assert b.sample(y).shape == (3, 6)
    f = FunctionField.init(key, LegendreBasis(4, X), bi)
    assert f.sample(jnp.linspace(0, 1, 9), xi).shape == (9, 5)
    grid = itde.Grid(itde.Simpson(interval=X), itde.GaussLegendre(interval=Y), 5)
    assert f.sample_grid(grid, 7).shape == (7, 5)
    with pytest.raises(ValueError, match="coeffs"):
        FunctionKernel(jnp.zeros((3, 3)), bi, bo)


def test_under_resolved_grid_warns_naming_the_numbers():
    bi, bo = LegendreBasis(6, Y), LegendreBasis(3, H)
    k = FunctionKernel.init(jax.random.PRNGKey(0), bi, bo)
    with pytest.warns(UserWarning, match=r"4 nodes .* 6 modes.*cannot resolve") as rec:
        k.sample(jnp.linspace(0, 1, 4), jnp.linspace(-1, 1, 5))
    assert [(w.filename, w.lineno) for w in rec] == [(__file__, _line() - 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k.sample(jnp.linspace(0, 1, 6), jnp.linspace(-1, 1, 3))  # enough nodes: silent
    att = FunctionAttention.init(
        jax.random.PRNGKey(1),
        n_heads=2,
        feature_basis=bi,
        head_basis=bo,
        head_rule=itde.GaussLegendre(interval=H),
        n_head_nodes=2,
    )
    grid = itde.Grid(itde.Midpoint(), itde.GaussLegendre(interval=Y), 8)
    with pytest.warns(UserWarning, match=r"head domain.*2 nodes .* 3 modes") as rec:
        att.sample(grid)
    assert [(w.filename, w.lineno) for w in rec] == [(__file__, _line() - 1)]
    # through the operator's call, under jit: still the user's line, not the library's
    with pytest.warns(UserWarning, match=r"head domain") as rec:
        eqx.filter_jit(lambda m, u: m(u, grid))(att, jnp.ones((3, 8)))
    assert {(w.filename, w.lineno) for w in rec} == {(__file__, _line() - 1)}


def _line() -> int:
    """The line number of the caller (for checking where a warning points)."""
    return sys._getframe(1).f_lineno


def _attention(n_heads=2, n_head_nodes=6, dtype=None, scale=0.5):
    return FunctionAttention.init(
        jax.random.PRNGKey(1),
        n_heads=n_heads,
        feature_basis=LegendreBasis(5, Y),
        head_basis=LegendreBasis(4, H),
        head_rule=itde.GaussLegendre(interval=H),
        n_head_nodes=n_head_nodes,
        scale=scale,
        dtype=dtype,
    )


def _feedforward(n_hidden_nodes, rule=itde.GaussLegendre, scale=0.4, activation="gelu"):
    return FunctionFeedForward.init(
        jax.random.PRNGKey(0),
        feature_basis=LegendreBasis(6, Y),
        hidden_basis=LegendreBasis(5, Y),
        hidden_rule=rule(interval=Y),
        n_hidden_nodes=n_hidden_nodes,
        activation=activation,
        scale=scale,
    )


def test_sampled_operators_are_the_discrete_modules_without_weights():
    att = _attention()
    grid = itde.Grid(itde.Trapezoid(interval=X), itde.Simpson(interval=Y), 9)
    a = att.sample(grid)
    assert isinstance(a, itde.Attention)
    assert (a.n_heads, a.n_features, a.head_dim) == (2, 9, 6)
    assert a.wo.shape == (2, 6, 9) and a.bq.shape == (2, 6) and a.bo.shape == (9,)
    y, _ = grid.features.nodes_weights(9)
    hx, hw = att.head_nodes_weights()
    # the kernel's values W(y_i, eta_j) = sum_ab c_ab phi_a(y_i) psi_b(eta_j), no weights
    # (the bases from numpy: orthonormal Legendre on Y and on H)
    phi, psi = _np_legendre(5, Y, y), _np_legendre(4, H, hx)
    expected = np.einsum("ia,hab,jb->hij", phi, np.asarray(att.wq.coeffs), psi)
    np.testing.assert_allclose(a.wq, expected, rtol=0, atol=1e-13)
    np.testing.assert_allclose(hw, itde.GaussLegendre(interval=H).nodes_weights(6)[1])
    ffn = _feedforward(7)
    f = ffn.sample(grid)
    assert isinstance(f, itde.FeedForward)
    assert f.w1.shape == (9, 7) and f.w2.shape == (7, 9) and f.activation == "gelu"
    z, _ = ffn.hidden_nodes_weights()
    expected = _np_legendre(5, Y, z) @ np.asarray(ffn.w2.coeffs) @ _np_legendre(6, Y, y).T
    np.testing.assert_allclose(f.w2, expected, rtol=0, atol=1e-13)


def _np_legendre(n, interval, x):
    """Orthonormal Legendre polynomials on `interval` at `x`, `[len(x), n]`, from numpy."""
    a, b = interval
    t = 2 * (np.asarray(x) - a) / (b - a) - 1
    cols = [np.polynomial.legendre.legval(t, np.eye(n)[k]) for k in range(n)]
    return np.stack(cols, -1) * np.sqrt((2 * np.arange(n) + 1) / (b - a))


class FunctionOperatorsApplyTheGridWeights(chex.TestCase):
    """`op(u, grid)`, directly and under `jax.jit`, is the sampled discrete operator
    applied with the grid's feature and token weights and the op's head / hidden weights."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_function_attention_and_feedforward(self):
        grid = itde.Grid(itde.Trapezoid(interval=X), itde.Simpson(interval=Y), 9)
        u = FunctionField.init(jax.random.PRNGKey(2), LegendreBasis(3, X), LegendreBasis(5, Y))
        u = u.sample_grid(grid, 11)
        fw, lw = grid.feature_weights(), jnp.log(jnp.asarray(grid.token_weights(11)))
        att, ffn = _attention(), _feedforward(7)
        ref = att.sample(grid)(
            u, feature_weights=fw, head_weights=att.head_weights(), token_log_weights=lw
        )
        chex.assert_trees_all_close(self.variant(lambda v: att(v, grid))(u), ref, atol=1e-14)
        ref = ffn.sample(grid)(u, feature_weights=fw, hidden_weights=ffn.hidden_weights())
        chex.assert_trees_all_close(self.variant(lambda v: ffn(v, grid))(u), ref, atol=1e-14)


def test_discretise_is_the_one_interface_of_discrete_and_function_operators():
    """The equation calls `discretise(grid)` on any attention / feed-forward: a function
    operator samples itself and hands over its inner weights, a discrete one is itself."""
    grid = itde.Grid(itde.Trapezoid(interval=X), itde.Simpson(interval=Y), 9)
    att, ffn = _attention(), _feedforward(7)
    for op, base, inner in (
        (att, itde.AbstractAttention, att.head_weights()),
        (ffn, itde.AbstractFeedForward, ffn.hidden_weights()),
    ):
        assert isinstance(op, base)
        discrete, weights = op.discretise(grid)
        assert isinstance(discrete, base) and type(discrete) is not type(op)
        chex.assert_trees_all_equal(discrete, op.sample(grid))
        np.testing.assert_array_equal(weights, inner)
        assert discrete.discretise(grid) == (discrete, None)
        with pytest.raises(ValueError, match=r"`grid.n_features`=8 .* n_features=9"):
            discrete.discretise(itde.Grid(itde.Midpoint(), itde.Midpoint(), 8))
    # unit inner weights are reported as None (no multiplication by 1)
    unit = FunctionFeedForward.init(
        jax.random.PRNGKey(0),
        feature_basis=LegendreBasis(3, Y),
        hidden_basis=LegendreBasis(3, (0.0, 4.0)),
        hidden_rule=itde.Midpoint(interval=(0.0, 4.0)),
        n_hidden_nodes=4,
    )
    assert unit.discretise(grid)[1] is None


def test_float32_sampling_and_application():
    att = _attention(dtype=jnp.float32)
    grid = itde.Grid(itde.GaussLegendre(interval=X), itde.GaussLegendre(interval=Y), 8)
    a = att.sample(grid)
    assert a.wq.dtype == jnp.float32
    u = jnp.ones((5, 8), jnp.float32)
    out = att(u, grid)
    assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))


def test_grid_on_another_interval_raises():
    att = _attention()
    with pytest.raises(ValueError, match=r"interval=\(0.0, 1.0\)"):
        att.sample(itde.Grid.unit(8))  # unit grid lives on [0, 8]


# ---------------------------------------------------------------------------- convergence


def _slope(ns, errs, name):
    ns = np.asarray(ns, float)
    h = 1.0 / (ns if name == "midpoint" else ns - 1)
    return np.polyfit(np.log(h[-3:]), np.log(errs[-3:]), 1)[0]


ORDERS = {  # rule -> (node counts, expected order)
    "midpoint": ([8, 16, 32, 64], 2.0),
    "trapezoid": ([9, 17, 33, 65], 2.0),
    "simpson": ([17, 33, 65, 129], 4.0),
}
YSTAR = np.array([0.13, 0.5, 0.77])  # fixed output points (features or tokens)


def _feedforward_at(name, n):
    """F(u) at fixed feature points: they join the feature nodes with weight 0, so the
    output there is the Nyström interpolant of the quadrature operator."""
    rule = itde.RULES[name]
    ffn = _feedforward(n, rule)
    y, w = rule(interval=Y).nodes_weights(n)
    yy, ww = np.concatenate([y, YSTAR]), np.concatenate([w, np.zeros(3)])
    field = FunctionField.init(jax.random.PRNGKey(2), LegendreBasis(4, X), LegendreBasis(6, Y))

    @jax.jit  # one compile per node count instead of one per operation
    def apply():
        u = field.sample(np.array([0.2, 0.6]), yy, check=False)  # two tokens: a batch
        return ffn.sample_nodes(yy)(u, feature_weights=ww, hidden_weights=ffn.hidden_weights())

    return np.asarray(apply()[:, -3:])


@functools.cache
def _ffn_reference():
    return _feedforward_at("gauss-legendre", 64)


# Simpson's case (the most nodes) runs with -m slow; midpoint and trapezoid by default
# one rule in the default run (the code path is the same for every rule); all with -m slow
RULE_CASES = [n if n == "midpoint" else pytest.param(n, marks=pytest.mark.slow)
              for n in sorted(ORDERS)]  # fmt: skip


@pytest.mark.parametrize("name", RULE_CASES)
def test_feedforward_converges_in_features_at_rule_order(name):
    ns, order = ORDERS[name]
    errs = [np.max(np.abs(_feedforward_at(name, n) - _ffn_reference())) for n in ns]
    assert _slope(ns, errs, name) == pytest.approx(order, abs=0.25), errs


def test_feedforward_gauss_legendre_is_geometric():
    errs = [
        np.max(np.abs(_feedforward_at("gauss-legendre", n) - _ffn_reference())) for n in (8, 16, 32)
    ]
    assert errs[2] < 1e-10 and errs[1] < 1e-3 * errs[0], errs


def _attention_at(name, n, basis_x):
    """A(u) at fixed token points x*, joined to the token nodes with log-weight -inf
    (weight 0: they query but add nothing to the token integrals)."""
    att = _attention()
    yn, yw = itde.GaussLegendre(interval=Y).nodes_weights(8)  # exact in features/heads
    x, w = itde.RULES[name](interval=X).nodes_weights(n)
    xx = np.concatenate([x, YSTAR])
    lw = jnp.asarray(np.concatenate([np.log(w), np.full(3, -np.inf)]))
    field = FunctionField.init(jax.random.PRNGKey(3), basis_x, LegendreBasis(5, Y))

    @jax.jit  # one compile per node count instead of one per operation
    def apply():
        return att.sample_nodes(yn)(
            field.sample(xx, yn),
            feature_weights=yw,
            head_weights=att.head_weights(),
            token_log_weights=lw,
        )

    return np.asarray(apply()[-3:])


@functools.cache
def _att_reference(periodic):
    if periodic:
        return _attention_at("periodic-trapezoid", 64, FourierBasis(5, X))
    return _attention_at("gauss-legendre", 64, LegendreBasis(5, X))


@pytest.mark.parametrize("name", RULE_CASES)
def test_attention_converges_in_tokens_at_rule_order(name):
    ns, order = ORDERS[name]
    errs = [
        np.max(np.abs(_attention_at(name, n, LegendreBasis(5, X)) - _att_reference(False)))
        for n in ns
    ]
    assert _slope(ns, errs, name) == pytest.approx(order, abs=0.25), errs


def test_attention_tokens_gauss_legendre_and_periodic_trapezoid_are_geometric():
    errs = [
        np.max(
            np.abs(_attention_at("gauss-legendre", n, LegendreBasis(5, X)) - _att_reference(False))
        )
        for n in (4, 8, 16, 32)
    ]
    assert errs[3] < 1e-10 and errs[2] < 1e-3 * errs[0], errs
    # a periodic state (Fourier in x) on the periodic trapezoid rule
    errs = [
        np.max(
            np.abs(
                _attention_at("periodic-trapezoid", n, FourierBasis(5, X)) - _att_reference(True)
            )
        )
        for n in (4, 8, 16, 32)
    ]
    assert errs[3] < 1e-12 and errs[2] < 1e-4 * errs[0], errs


def test_gradient_in_coefficients_matches_finite_differences_under_jit():
    grid = itde.Grid(itde.Midpoint(interval=X), itde.GaussLegendre(interval=Y), 7)
    u = FunctionField.init(jax.random.PRNGKey(4), LegendreBasis(3, X), LegendreBasis(5, Y))
    u = u.sample_grid(grid, 6)
    att = _attention()

    @eqx.filter_jit
    def loss(m):
        return jnp.sum(jnp.sin(m(u, grid)))

    g = eqx.filter_grad(loss)(att)
    d = jax.random.normal(jax.random.PRNGKey(5), att.wk.coeffs.shape)
    eps = 1e-6
    shift = lambda s: eqx.tree_at(lambda m: m.wk.coeffs, att, att.wk.coeffs + s * d)  # noqa: E731
    fd = (loss(shift(eps)) - loss(shift(-eps))) / (2 * eps)
    assert float(jnp.sum(g.wk.coeffs * d)) == pytest.approx(float(fd), rel=1e-7, abs=1e-9)
