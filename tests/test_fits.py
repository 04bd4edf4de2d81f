"""Fits through a network's layers (Legendre series, linear and natural cubic splines): each
part interpolated where the scheme reads it (operators at the layer starts, post-norm
projections at the ends), so one Lie step per layer is the network again; the splines'
mathematics; their residuals; their orders in a solve with the knots as jumps."""

import dataclasses
import functools

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
import itde_solvers

L = 4


@functools.cache
def _network(block, activation="relu", key=0):
    """A float64 per-layer model whose norms have random per-feature gains and shifts (so a
    fit that reads a norm at the wrong depth shows)."""
    m = itde.TransformerIDE.init(
        jax.random.key(key), n_layers=L, n_features=8, n_heads=2, dtype=jnp.float64,
        block=block, activation=activation,
    )  # fmt: skip
    v = m.controls.values
    ks = jax.random.split(jax.random.key(key + 1), 4)
    noise = [0.3 * jax.random.normal(k, v.norm1.gain.shape, jnp.float64) for k in ks]
    new = (1 + noise[0], noise[1], 1 + noise[2], noise[3])
    v = eqx.tree_at(lambda b: (b.norm1.gain, b.norm1.shift, b.norm2.gain, b.norm2.shift), v, new)
    return eqx.tree_at(lambda m: m.controls.values, m, v)


@eqx.filter_jit
def _at(controls, t, side="right", part=None):
    """The controls at a depth, compiled once per controls structure and part (eagerly,
    every leaf's every operation would compile on its own)."""
    return controls(jnp.asarray(t, jnp.float64), side, part)


FITS = {
    "legendre": lambda c, block: itde.LegendreControls.from_layers(c, block=block),
    "linear": lambda c, block: itde.SplineControls.from_layers(c, 1, block=block),
    "cubic": lambda c, block: itde.SplineControls.from_layers(c, 3, block=block),
}


@pytest.fixture(scope="module", params=["post_norm", "pre_norm"])
def network(request):
    m = _network(request.param)
    u0 = jax.random.normal(jax.random.key(5), (5, 8), jnp.float64)
    return m, u0, itde.solve(m, u0).ys[-1]


@pytest.mark.parametrize(
    "fit", [f if f == "cubic" else pytest.param(f, marks=pytest.mark.slow) for f in FITS]
)  # the cubic spline in the default run (the budget); all three under -m slow
def test_interpolating_fit_at_one_lie_step_per_layer_is_the_network(network, fit):
    m, u0, want = network
    smooth = itde.TransformerIDE(FITS[fit](m.controls, m.block), m.grid, block=m.block)
    got = itde.solve(smooth, u0, dt0=1.0).ys[-1]  # the default scheme, Lie
    assert float(jnp.max(jnp.abs(got - want))) < 1e-12
    res = itde.fit_residuals(smooth.controls, m.controls, block=m.block)
    assert {"attention.wq", "feedforward.w1", "norm1.gain", "norm2.shift"} <= set(res)
    assert max(res.values()) < 1e-13


@pytest.mark.parametrize("fit", list(FITS))
@pytest.mark.parametrize("block", ["post_norm", "pre_norm"])
def test_fit_reads_operators_at_layer_starts_and_projections_at_ends(fit, block):
    m = _network(block)
    c, layers = FITS[fit](m.controls, m.block), m.controls.values
    norm_offset = 1 if block == "post_norm" else 0  # pre-norm reads its norms inside, at t_n
    for n in range(L):
        np.testing.assert_allclose(_at(c, n, "right", "attention").wq, layers.attention.wq[n],
                                   atol=1e-12)  # fmt: skip
        np.testing.assert_allclose(_at(c, n, "right", "feedforward").w1,
                                   layers.feedforward.w1[n], atol=1e-12)  # fmt: skip
        t = float(n + norm_offset)
        np.testing.assert_allclose(
            _at(c, t, "left", "norm2").gain, layers.norm2.gain[n], atol=1e-12
        )
        np.testing.assert_allclose(
            _at(c, t, "left", "norm1").shift, layers.norm1.shift[n], atol=1e-12
        )


def test_fewer_modes_leave_the_least_squares_residual():
    m = _network("post_norm")
    c = itde.LegendreControls.from_layers(m, 2)
    res = itde.fit_residuals(c, m)
    # an independent least-squares line through W^Q at the layer starts, and through the
    # second norm's gain at the layer ends
    v = m.controls.values
    for key, ts, a in [
        ("attention.wq", np.arange(L), v.attention.wq),
        ("norm2.gain", np.arange(1, L + 1), v.norm2.gain),
    ]:
        a = np.asarray(a).reshape(L, -1)
        coef = np.polynomial.legendre.legfit(2.0 * ts / L - 1.0, a, 1)
        fit = np.polynomial.legendre.legval(2.0 * ts / L - 1.0, coef).T
        assert res[key] == pytest.approx(np.max(np.abs(fit - a)) / np.max(np.abs(a)), rel=1e-9)
        assert res[key] > 1e-2


def _from_function(fn):
    """Per-layer (post-norm) controls whose every parameter of layer n is `fn(tau_n)` times
    a fixed array (returned too), tau_n the depth at which the scheme reads that part."""
    one = jax.tree.map(lambda a: a[0], _network("post_norm").controls.values)

    def part(name):
        tau = np.arange(L) + (1.0 if name in ("norm1", "norm2") else 0.0)
        return jax.tree.map(lambda a: jnp.stack([fn(t) * a for t in tau]), getattr(one, name))

    parts = ("attention", "norm1", "feedforward", "norm2")
    return itde.PiecewiseConstant(dataclasses.replace(one, **{n: part(n) for n in parts})), one


@pytest.mark.parametrize("degree", [1, 3])
def test_splines_are_exact_on_linear_data(degree):
    fn = lambda t: 0.5 - 0.3 * t  # noqa: E731
    per_layer, one = _from_function(fn)
    c = itde.SplineControls.from_layers(per_layer, degree, block="post_norm")
    for t in np.linspace(0.0, L - 1, 13):  # the operators' knots span [t_0, t_{L-1}]
        np.testing.assert_allclose(_at(c, t, part="attention").wq, fn(t) * one.attention.wq,
                                   atol=1e-13)  # fmt: skip
    for t in np.linspace(1.0, L, 13):  # the norms' knots span [t_1, t_L]
        np.testing.assert_allclose(_at(c, t, part="norm2").gain, fn(t) * one.norm2.gain, atol=1e-13)


def test_natural_cubic_spline_interpolates_is_c2_and_has_zero_curvature_at_its_ends():
    """Interpolation, C^2 at every interior knot and zero second derivative at both end
    knots characterise the natural cubic spline. The data is a cubic, which the natural
    spline does not reproduce: a cubic with zero curvature at both ends is a line."""
    p = lambda t: 1.0 + t - 0.7 * t**2 + 0.25 * t**3  # noqa: E731
    per_layer, one = _from_function(p)
    c = itde.SplineControls.from_layers(per_layer, 3, block="post_norm")
    scale = float(one.attention.wq[0, 0, 0])

    def w(t):
        return c(t, part="attention").wq[0, 0, 0] / scale

    d1, d2 = jax.grad(w), jax.grad(jax.grad(w))
    for k in range(L):
        assert float(w(float(k))) == pytest.approx(p(k), rel=1e-12)
    for k in range(1, L - 1):  # both pieces meet with equal first and second derivatives
        for d in (d1, d2):
            assert float(d(k - 1e-12)) == pytest.approx(float(d(float(k))), abs=1e-9)
    assert abs(float(d2(0.0))) < 1e-12 and abs(float(d2(L - 1 - 1e-12))) < 1e-10
    assert abs(float(d2(1.5)) - (-1.4 + 1.5 * 1.5)) > 1e-2  # not the cubic itself


def test_spline_is_constant_beyond_its_knots_and_reports_them_as_jumps():
    m = _network("post_norm")
    c, v = itde.SplineControls.from_layers(m, 3), m.controls.values
    assert c.jump_times() == (1.0, 2.0, 3.0) and (c.t0, c.t1, c.default_step) == (0.0, L, 1.0)
    for t in (L - 1.0, L - 0.5, L, L + 2.0):  # operators: beyond t_{L-1}
        np.testing.assert_allclose(_at(c, t, part="attention").wq, v.attention.wq[-1], atol=1e-13)
    for t in (-1.0, 0.0, 0.5, 1.0):  # projections: before t_1
        np.testing.assert_allclose(_at(c, t, part="norm1").gain, v.norm1.gain[0], atol=1e-13)
    assert c.blocks.attention.n_heads == 2 and c.n_features == 8
    assert itde.TransformerIDE(c, m.grid, score_bias=itde.ALiBi.init(2)).controls is c


@pytest.mark.parametrize("fit", ["linear", "cubic", "legendre"])
def test_traced_depth_matches_eager_without_retracing_and_keeps_dtype(fit):
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=L, n_features=8, n_heads=2,
                                 dtype=jnp.float32)  # fmt: skip
    c = FITS[fit](m.controls, "post_norm")

    @eqx.debug.assert_max_traces(max_traces=1)
    def at(c, t):
        return c(t, "right")

    jit_at = eqx.filter_jit(at)
    for t in (0.0, 0.37, 1.0, 2.5, 3.999):
        eager, traced = c(t), jit_at(c, jnp.asarray(t, jnp.float32))
        assert jax.tree.map(lambda a: a.dtype, eager) == jax.tree.map(lambda a: a.dtype, traced)
        assert traced.attention.wq.dtype == jnp.float32
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6),
                     eager, traced)  # fmt: skip


def _smooth_pre_norm(degree):
    m = _network("pre_norm", activation="gelu")  # a smooth field: the order is the solver's
    c = itde.SplineControls.from_layers(m.controls, degree, block="pre_norm")
    assert c.jump_times() == (1.0, 2.0, 3.0)
    u0 = jax.random.normal(jax.random.key(5), (3, 8), jnp.float64)
    return itde.TransformerIDE(c, m.grid, block=m.block), u0


@eqx.filter_jit
def _rk4_constant_steps(model, u0, dt0):
    """RK4 with constant steps of a traced `dt0` (one compilation for every step size)."""
    sol = itde.solve(model, u0, solver=itde_solvers.RK4(), dt0=dt0,
                     stepsize_controller=diffrax.ConstantStepSize(), max_steps=300)  # fmt: skip
    return sol.ys[-1]


def _orders(errs, dts):
    errs, dts = np.asarray(errs), np.asarray(dts)
    return np.log(errs[:-1] / errs[1:]) / np.log(dts[:-1] / dts[1:])


def test_rk4_through_a_cubic_spline_has_order_four():
    model, u0 = _smooth_pre_norm(3)
    ref = _rk4_constant_steps(model, u0, jnp.asarray(1 / 64))
    dts = [1 / 4, 1 / 8, 1 / 16]
    errs = [float(jnp.max(jnp.abs(_rk4_constant_steps(model, u0, jnp.asarray(dt)) - ref)))
            for dt in dts]  # fmt: skip
    assert np.all(_orders(errs, dts) > 3.6), _orders(errs, dts)


def test_rk4_keeps_order_four_through_linear_kinks_because_they_are_jumps():
    """Steps that do not divide a layer (0.15, 0.075): the fixed grid restarts at every
    knot that `jump_times` reports; steps straddling the kinks of the linear spline would
    cost the order (2.7 observed)."""
    model, u0 = _smooth_pre_norm(1)
    ref = _rk4_constant_steps(model, u0, jnp.asarray(1 / 64))
    dts = [0.15, 0.075]
    sols = [itde.solve(model, u0, solver=itde_solvers.RK4(), dt0=dt).ys[-1] for dt in dts]
    errs = [float(jnp.max(jnp.abs(y - ref))) for y in sols]
    assert np.all(_orders(errs, dts) > 3.6), _orders(errs, dts)


def test_fit_errors_name_the_argument_and_the_fix():
    m = _network("post_norm")
    with pytest.raises(ValueError, match=r"`degree`=2.*1 \(piecewise linear\) or 3"):
        itde.SplineControls.from_layers(m, 2)
    for bad in (0, L + 1):
        with pytest.raises(ValueError, match=rf"`n_modes`={bad} must be between 1 and the {L}"):
            itde.LegendreControls.from_layers(m, bad)
    smooth = itde.LegendreControls.from_layers(m)
    for call in (lambda: itde.SplineControls.from_layers(smooth),
                 lambda: itde.LegendreControls.from_layers(smooth),
                 lambda: itde.fit_residuals(smooth, smooth)):  # fmt: skip
        with pytest.raises(TypeError, match="PiecewiseConstant.*got LegendreControls"):
            call()
    with pytest.raises(TypeError, match="`block`='post-norm'.*'post_norm'"):
        itde.SplineControls.from_layers(m.controls, block="post-norm")
