"""Causal (Volterra) attention at quadrature order: the partial-interval weights of each
rule, the order of the causal attention operator per rule against an independent per-query
Gauss rule, and the model with causal weights in every attention core."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde

RULES = ["midpoint", "trapezoid", "periodic-trapezoid", "simpson", "gauss-legendre"]
ORDER = {"midpoint": 2, "trapezoid": 2, "periodic-trapezoid": 2, "simpson": 4}


def _rule(name):
    return itde.RULES[name](interval=(0.0, 1.0))


@pytest.mark.parametrize(
    "name,degree",
    [("midpoint", 1), ("trapezoid", 1), ("periodic-trapezoid", 1), ("simpson", 3),
     ("gauss-legendre", 10)],
)  # fmt: skip
def test_partial_interval_weights_are_exact_on_polynomials(name, degree):
    """Row i integrates x^d over [0, x_i] exactly up to the rule's degree, and not beyond
    (for the finite-order rules): the weights are for the partial interval, not the
    masked full-interval weights."""
    n = 11
    rule = _rule(name)
    x, w = rule.nodes_weights(n)
    cw = rule.causal_weights(n)
    W = cw.matrix()
    for d in range(degree + 1):
        np.testing.assert_allclose((W @ x**d)[1:], (x ** (d + 1) / (d + 1))[1:], atol=1e-13)
    if name != "gauss-legendre":
        d = degree + 1
        assert np.abs((W @ x**d)[1:] - (x ** (d + 1) / (d + 1))[1:]).max() > 1e-8
    masked = np.tril(np.broadcast_to(w, (n, n)))  # the old first-order weights
    assert np.abs((masked @ x)[1:] - (x**2 / 2)[1:]).max() > 1e-3
    assert cw.strict == (name not in ("simpson", "gauss-legendre"))
    assert cw.signed == bool((W < 0).any())
    if cw.strict:
        assert np.all(np.triu(W, 1) == 0)


def test_unit_grid_keeps_the_transformers_masked_sum():
    assert itde.Midpoint().causal_weights(16) is None  # the discrete Transformer
    assert itde.Grid.unit(8).causal_weights(16) is None
    assert itde.Midpoint(interval=(0.0, 1.0)).causal_weights(16) is not None


# ---------------------------------------------------------------- operator-level orders
E = 3


def _fields(x):
    """Smooth query, key and value functions of the token position, [heads=1, n, E]."""
    x = np.asarray(x)[:, None]
    q = np.concatenate([np.sin(2 * x + 0.3), np.cos(3 * x), 0.5 + x * x], -1)
    k = np.concatenate([np.cos(x - 0.2), np.sin(4 * x) * 0.7, np.exp(-x)], -1)
    v = np.concatenate([np.exp(x) * np.sin(3 * x), np.cos(5 * x), x**3 - x], -1)
    return q[None], k[None], v[None]


def _exact(x):
    """The Volterra operator at the query positions `x` by a 40-node Gauss rule on each
    [0, x_i] (a different method from every rule under test); V(0) at x = 0."""
    t, wt = np.polynomial.legendre.leggauss(40)
    out = []
    for xi in x:
        if xi == 0.0:  # the empty interval: the ratio's limit V(a)
            out.append(_fields([0.0])[2][0, 0])
            continue
        xs, ws = xi * (t + 1) / 2, wt * xi / 2
        qi = _fields([xi])[0][0, 0]
        _, k, v = _fields(xs)
        e = np.exp(k[0] @ qi) * ws
        out.append(e @ v[0] / e.sum())
    return np.array(out)


def _operator_error(name, n):
    rule = _rule(name)
    x, w = rule.nodes_weights(n)
    q, k, v = (jnp.asarray(a) for a in _fields(x))
    cw = rule.causal_weights(n)
    got = jax.jit(  # one compile per size instead of one per operation
        lambda q, k, v: itde.dense_attention(
            q, k, v, query_weights=cw, signed_weights=cw.signed, causal=cw.strict
        )
    )(q, k, v)
    err = np.abs(np.asarray(got)[0, 1:] - _exact(x[1:])).max(axis=-1)
    # the rule's own weighted L1 norm (row 0, the limit at a or a half cell, weighs h)
    return float(np.sum(w[1:] * err)) + float(w[0] * np.abs(got[0, 0] - _exact(x[:1])[0]).max())


@pytest.mark.parametrize("name", list(ORDER))
def test_causal_operator_order_per_rule(name):
    ns = [13, 25, 49] if name == "simpson" else [12, 24, 48]
    errs = [_operator_error(name, n) for n in ns]
    h = [float(np.diff(_rule(name).nodes_weights(n)[0])[1]) for n in ns]
    slope = np.polyfit(np.log(h), np.log(errs), 1)[0]
    assert abs(slope - ORDER[name]) < 0.3, (name, errs, slope)


def test_causal_operator_gauss_legendre_is_geometric():
    errs = [_operator_error("gauss-legendre", n) for n in (8, 16, 24)]
    assert errs[1] < 1e-3 * errs[0] and errs[2] < 1e-4 * errs[1] and errs[2] < 1e-10, errs


# ---------------------------------------------------------------- the model, every core
def _model(rule, impl, n_features=6):
    ctrl = itde.PiecewiseConstant(
        itde.stack(
            [
                itde.Block.init(
                    jax.random.key(0),
                    n_features=n_features,
                    n_heads=2,
                    n_hidden=8,
                    dtype=jnp.float64,
                )
            ]
        )
    )
    grid = itde.Grid(rule, itde.Midpoint(), n_features)
    return itde.TransformerIDE(
        ctrl, grid, causal=True, attention_core=itde.Blocked(4) if impl == "blocked" else impl
    )


# default: one positive rule and the two signed ones; the other positive rules (the same
# log-weight path) with -m slow
BLOCKED_CASES = [pytest.param(r, marks=pytest.mark.slow) if r in ("midpoint", "periodic-trapezoid")
                 else r for r in RULES]  # fmt: skip


@pytest.mark.parametrize("name", BLOCKED_CASES)
def test_causal_rules_blocked_equals_dense_with_gradients(name):
    n = 9
    u0 = jax.random.normal(jax.random.key(1), (n, 6), jnp.float64)
    outs, grads = {}, {}
    for impl in ("dense", "blocked"):
        m = _model(_rule(name), impl)

        # jitted: one compile instead of an op-by-op gradient of the block loop
        @jax.jit
        def field_and_grad(u, m=m):
            g = jax.grad(lambda v: jnp.sum(jnp.sin(m.attention_field(0.0, v))))(u)
            return m.attention_field(0.0, u), g

        outs[impl], grads[impl] = field_and_grad(u0)
    np.testing.assert_allclose(outs["blocked"], outs["dense"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(grads["blocked"], grads["dense"], rtol=0, atol=1e-12)
    assert np.all(np.isfinite(grads["dense"]))
    cw = _rule(name).causal_weights(n)
    if cw.signed:
        with pytest.raises(ValueError, match="signed"):
            _model(_rule(name), "fused").attention_field(0.0, u0)
    else:
        fused = _model(_rule(name), "fused").attention_field(0.0, u0)
        np.testing.assert_allclose(fused, outs["dense"], rtol=0, atol=1e-5)
    if cw.strict:  # a strictly causal rule never reads a later token
        u1 = u0.at[5:].set(7.0)
        np.testing.assert_allclose(
            _model(_rule(name), "dense").attention_field(0.0, u1)[:5], outs["dense"][:5],
            rtol=0, atol=1e-12,
        )  # fmt: skip


@pytest.mark.slow  # up to 33 nodes of two signed rules: the default-suite budget
def test_signed_rule_normaliser_stays_positive():
    """The signed partial-interval weights still give a positive quadrature of the
    normaliser for positive integrands (no division by a vanishing sum)."""
    for name in ("simpson", "gauss-legendre"):
        for n in (3, 5, 9, 33):
            W = _rule(name).causal_weights(n).matrix()
            x = _rule(name).nodes_weights(n)[0]
            assert np.all(W @ np.exp(-4 * x) > 0)
            assert math.isfinite(float(np.abs(W).sum()))


@pytest.mark.parametrize(
    "rule, n, error, match",
    [
        (itde.Simpson(), 2, ValueError, r"`Simpson` needs n >= 3"),
        (itde.Midpoint(), -3, ValueError, r"`Midpoint` needs n >= 1"),
        (itde.Midpoint(), 0, ValueError, r"`Midpoint` needs n >= 1"),
        (itde.Midpoint(), 4.5, TypeError, r"`n`=4.5 must be an integer"),
        (itde.Trapezoid(), 1, ValueError, r"`Trapezoid` needs n >= 2"),
        (itde.GaussLegendre(), 0, ValueError, r"`GaussLegendre` needs n >= 1"),
        ("simpson", 3, TypeError, r"`rule`='simpson' must be an itde quadrature rule"),
    ],
)
def test_volterra_weights_check_the_node_count(rule, n, error, match):
    """Once accepted silently (Simpson at 2 nodes integrated 1 to 1.083), or a 0x0 matrix,
    or weights of no rule, or a ZeroDivisionError."""
    with pytest.raises(error, match=match):
        itde.volterra_weights(rule, n)


@pytest.mark.parametrize("n", [4, 8, 9])
def test_gregory_weights_on_simpsons_nodes_at_even_n(n):
    """`volterra_weights(Simpson(), n)` at even n: the partial-interval (Gregory) weights need
    no odd n (composite Simpson on the whole interval does). The node-count check once
    applied Simpson's parity here and stopped `itde converge --axis tokens` at its
    causal-Simpson row. The weights are exact on cubics over every [0, x_i] (rows >= 1),
    not on quartics, at any n >= 4."""
    W = itde.volterra_weights(itde.Simpson(interval=(0.0, 1.0)), n).matrix()
    x = np.linspace(0.0, 1.0, n)  # Simpson's equispaced nodes, both ends included
    for d in range(4):
        np.testing.assert_allclose((W @ x**d)[1:], (x ** (d + 1) / (d + 1))[1:], atol=1e-13)
    assert np.abs((W @ x**4)[1:] - (x**5 / 5)[1:]).max() > 1e-6
    with pytest.raises(ValueError, match=r"`Simpson` needs an odd number of nodes, got n=8"):
        itde.Simpson(interval=(0.0, 1.0)).nodes_weights(8)  # the full rule keeps its parity


def test_gregory_weights_are_fourth_order_at_even_n():
    """Max over the rows i >= 1 of |sum_p W_ip f(x_p) - int_0^{x_i} f| for f = cos 3x + e^x
    (integral sin(3x)/3 + e^x - 1, in closed form) at n = 16, 32, 64 nodes: order 4."""
    errs, hs = [], []
    for n in (16, 32, 64):
        x = np.linspace(0.0, 1.0, n)
        W = itde.volterra_weights(itde.Simpson(interval=(0.0, 1.0)), n).matrix()
        exact = np.sin(3 * x) / 3 + np.exp(x) - 1
        errs.append(np.abs(W @ (np.cos(3 * x) + np.exp(x)) - exact)[1:].max())  # row 0: V(a)
        hs.append(1 / (n - 1))
    slope = np.polyfit(np.log(hs), np.log(errs), 1)[0]
    assert abs(slope - 4) < 0.3, (errs, slope)
