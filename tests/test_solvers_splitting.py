"""Splitting solvers (Lie–Trotter, Strang, parallel), RK4 and the convergence helpers.

Orders are measured against exact or high-accuracy references in float64; a float32
smoke test checks that the solvers also run (and converge) in single precision.
"""

import chex
import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from diffrax import ODETerm

import itde_solvers
from itde_solvers import (
    RK4,
    AbstractSplittingSolver,
    LieTrotter,
    ParallelSplitting,
    ProjectionTerm,
    SplitTerm,
    Strang,
    advance,
    error_norm,
    observed_order,
)

TOL = 0.15  # tolerance on an observed order


@pytest.fixture(scope="module", autouse=True)
def _float64():
    # Scoped to this module so that float32 test files elsewhere are unaffected.
    with jax.enable_x64(True):
        yield


def _final(terms, solver, t0, t1, n_steps, y0, **kwargs):
    """The state at `t1` after `n_steps` constant steps (dt0 traced: one compile per solver)."""
    sol = diffrax.diffeqsolve(
        terms, solver, t0, t1, jnp.asarray((t1 - t0) / n_steps), y0, max_steps=4096, **kwargs
    )
    return sol.ys[-1]


def _order(terms, solver, reference, ns, *, t0=0.0, t1=1.0, y0, asymptotic=None):
    errors = [float(error_norm(_final(terms, solver, t0, t1, n, y0), reference)) for n in ns]
    return observed_order([abs(t1 - t0) / n for n in ns], errors, asymptotic=asymptotic), errors


def _reference(field, t0, t1, y0):
    """Dopri8 with rtol = atol = 1e-12 on the summed field."""
    return diffrax.diffeqsolve(
        ODETerm(field),
        diffrax.Dopri8(),
        t0,
        t1,
        0.01,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
        max_steps=100_000,
    ).ys[-1]


# --- two non-commuting linear operators: y' = (A + B) y, exact via expm ---------------


@pytest.fixture(scope="module")
def linear():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(k1, (4, 4), dtype=jnp.float64) / 2
    b = jax.random.normal(k2, (4, 4), dtype=jnp.float64) / 2
    assert float(jnp.linalg.norm(a @ b - b @ a)) > 0.5  # genuinely non-commuting
    y0 = jnp.full((4,), 0.5)
    terms = SplitTerm((ODETerm(lambda t, y, args: a @ y), ODETerm(lambda t, y, args: b @ y)))
    exact = jax.scipy.linalg.expm(a + b) @ y0  # T = 1
    return terms, y0, exact, a, b


@pytest.mark.parametrize(
    "solver, expected",
    [
        (LieTrotter(), 1.0),
        (Strang(), 2.0),
        (Strang(RK4()), 2.0),
        (ParallelSplitting(), 1.0),
    ],
    ids=["lie", "strang-heun", "strang-rk4", "parallel"],
)
def test_order_linear_noncommuting(linear, solver, expected):
    terms, y0, exact, _, _ = linear
    order, _ = _order(terms, solver, exact, [16, 32, 64, 128, 256], y0=y0)
    assert abs(order - expected) < TOL, order


def test_strang_backward_in_time(linear):
    """diffeqsolve flips time for t1 < t0; every sub-flow must see the user's time."""
    terms, y0, exact, _, _ = linear
    order, errors = _order(terms, Strang(), y0, [16, 32, 64, 128], t0=1.0, t1=0.0, y0=exact)
    assert abs(order - 2.0) < TOL, order
    assert errors[-1] < 1e-4


def test_strang_adaptive_through_halfsolver(linear):
    """Strang makes no error estimate; diffrax.HalfSolver supplies one for a PIDController."""
    terms, y0, exact, _, _ = linear
    sol = diffrax.diffeqsolve(
        terms,
        diffrax.HalfSolver(Strang(solvers=(RK4(), diffrax.Heun()))),
        0.0,
        1.0,
        None,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
    )
    assert float(error_norm(sol.ys[-1], exact)) < 1e-4


# --- the trap: time-dependent (non-autonomous) fields ---------------------------------


def _alpha(t):
    return 1.0 + 0.5 * jnp.sin(3.0 * t)


def _beta(t):
    return jnp.cos(2.0 * t)


@pytest.fixture(scope="module")
def nonautonomous(linear):
    _, y0, _, a, b = linear
    fa = lambda t, y, args: _alpha(t) * (a @ y)  # noqa: E731
    fb = lambda t, y, args: _beta(t) * (b @ y)  # noqa: E731
    reference = _reference(lambda t, y, args: fa(t, y, args) + fb(t, y, args), 0.0, 1.0, y0)
    return SplitTerm((ODETerm(fa), ODETerm(fb))), y0, reference


class _NaiveStrang(AbstractSplittingSolver):
    """Strang where every sub-step runs its own clock from t0 (the trap; not exported)."""

    solvers: diffrax.AbstractSolver = diffrax.Heun()

    def order(self, terms):
        return 2

    def compose(self, flows, subs, t0, t1, y0, args):
        (fa, fb), (sa, sb) = flows, subs
        half = t0 + (t1 - t0) / 2
        y, r1 = advance(fa, sa, t0, half, y0, args)
        y, r2 = advance(fb, sb, t0, t1, y, args)
        y, r3 = advance(fa, sa, t0, half, y, args)
        return y, itde_solvers.combine_results([r1, r2, r3])


@pytest.mark.parametrize(
    "solver, expected",
    [
        (Strang(), 2.0),
        (Strang(clock=0), 2.0),
        (LieTrotter(), 1.0),
        (ParallelSplitting(), 1.0),
    ],
    ids=["strang", "strang-clock0", "lie", "parallel"],
)
def test_order_nonautonomous(nonautonomous, solver, expected):
    terms, y0, reference = nonautonomous
    order, _ = _order(terms, solver, reference, [32, 64, 128, 256, 512], y0=y0)
    assert abs(order - expected) < TOL, order


def test_naive_strang_fails_the_nonautonomous_test(nonautonomous):
    """The trap is real: the same measurement sees a clock-per-sub-step Strang at order ~1."""
    terms, y0, reference = nonautonomous
    order, _ = _order(
        terms, _NaiveStrang(), reference, [32, 64, 128, 256, 512], y0=y0, asymptotic=3
    )
    assert order < 2.0 - 3 * TOL, order


# --- projections inside a splitting: the unit sphere ----------------------------------


def _normalise(t, y):
    return y / jnp.linalg.norm(y)


def _tangential(y, v):
    return v - jnp.dot(v, y) * y


def test_strang_with_projections_tangent_fields():
    """Two time-dependent rotations (tangent to the sphere): order 2, states on the sphere."""
    w1 = lambda t: jnp.array([1.0, 0.3 * t, 0.0])  # noqa: E731
    w2 = lambda t: jnp.array([0.0, jnp.cos(t), 1.0])  # noqa: E731
    fa = lambda t, y, args: jnp.cross(w1(t), y)  # noqa: E731
    fb = lambda t, y, args: jnp.cross(w2(t), y)  # noqa: E731
    y0 = jnp.array([1.0, 2.0, 2.0]) / 3
    reference = _reference(lambda t, y, args: fa(t, y, args) + fb(t, y, args), 0.0, 1.0, y0)
    terms = SplitTerm(
        (ODETerm(fa), ProjectionTerm(_normalise), ODETerm(fb), ProjectionTerm(_normalise))
    )
    order, _ = _order(terms, Strang(), reference, [16, 32, 64, 128, 256], y0=y0)
    assert abs(order - 2.0) < TOL, order
    sol = diffrax.diffeqsolve(
        terms, Strang(), 0.0, 1.0, jnp.asarray(1 / 64), y0, saveat=diffrax.SaveAt(steps=True)
    )
    ys = sol.ys[: int(sol.stats["num_accepted_steps"])]
    assert ys.shape[0] == 64
    assert float(jnp.max(jnp.abs(jnp.linalg.norm(ys, axis=-1) - 1.0))) < 1e-12
    # one sub-solver per sub-flow (None for projections) is the same scheme
    per_flow = Strang(solvers=(diffrax.Heun(), None, diffrax.Heun(), None))
    assert jnp.array_equal(_final(terms, per_flow, 0.0, 1.0, 64, y0), ys[-1])


def test_strang_projections_need_tangential_fields():
    """Documents the assumption in `Strang`'s docstring on a nonlinear, non-tangent field.

    The constrained solution follows $P_T(f_a + f_b)$. "Flow of $f_i$, then project" is
    only first order for it, so Strang is order 1; splitting the tangential parts
    $P_T f_i$ instead restores order 2.
    """
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    a = jax.random.normal(k1, (3, 3), dtype=jnp.float64)
    b = jax.random.normal(k2, (3, 3), dtype=jnp.float64)
    c = jnp.array([0.5, -1.0, 0.7])
    fa = lambda t, y, args: jnp.tanh(a @ y) + c  # noqa: E731
    fb = lambda t, y, args: b @ y  # noqa: E731
    y0 = jnp.array([1.0, 2.0, 2.0]) / 3
    reference = _reference(
        lambda t, y, args: _tangential(y, fa(t, y, args) + fb(t, y, args)), 0.0, 1.0, y0
    )
    p = ProjectionTerm(_normalise)
    raw = SplitTerm((ODETerm(fa), p, ODETerm(fb), p))
    tangential = SplitTerm(
        (
            ODETerm(lambda t, y, args: _tangential(y, fa(t, y, args))),
            p,
            ODETerm(lambda t, y, args: _tangential(y, fb(t, y, args))),
            p,
        )
    )
    ns = [32, 64, 128, 256, 512]
    order_raw, _ = _order(raw, Strang(), reference, ns, y0=y0)
    order_tangential, _ = _order(tangential, Strang(), reference, ns, y0=y0)
    assert abs(order_raw - 1.0) < TOL, order_raw
    assert abs(order_tangential - 2.0) < TOL, order_tangential


# --- RK4 on its own -------------------------------------------------------------------


def test_rk4_order():
    field = ODETerm(lambda t, y, args: -y + jnp.sin(t))
    y0 = jnp.array([1.0])
    exact = (y0 + 0.5) * jnp.exp(-1.0) + (jnp.sin(1.0) - jnp.cos(1.0)) / 2  # T = 1
    ns = [8, 16, 32, 64, 128]
    errors = [float(error_norm(_final(field, RK4(), 0.0, 1.0, n, y0), exact)) for n in ns]
    order = observed_order([1.0 / n for n in ns], errors)
    assert abs(order - 4.0) < TOL, order


def test_rk4_drives_a_pid_controller():
    """The embedded third-order estimate makes RK4 adaptive."""
    field = ODETerm(lambda t, y, args: -y + jnp.sin(t))
    sol = diffrax.diffeqsolve(
        field,
        RK4(),
        0.0,
        2.0,
        None,
        jnp.array([1.0]),
        stepsize_controller=diffrax.PIDController(rtol=1e-9, atol=1e-9),
    )
    exact = 1.5 * jnp.exp(-2.0) + (jnp.sin(2.0) - jnp.cos(2.0)) / 2
    assert float(jnp.abs(sol.ys[-1, 0] - exact)) < 1e-7


# --- one step against the textbook formula, jitted and not ----------------------------


def _f(t, y):
    return jnp.cos(t) * y**2 - y


def _g(t, y):
    return jnp.sin(2.0 * t) * y[::-1] + 0.3 * y


T0, H = 0.3, 0.2
Y0 = jnp.array([0.7, -0.4])
FIELDS = SplitTerm((ODETerm(lambda t, y, args: _f(t, y)), ODETerm(lambda t, y, args: _g(t, y))))


def _one_step(solver, terms=FIELDS, h=H):
    state = solver.init(terms, T0, T0 + h, Y0, None)
    y1, y_error, _, _, result = solver.step(terms, T0, T0 + h, Y0, None, state, False)
    return y1, y_error, result


def _heun(f, t0, h, y):
    k1 = f(t0, y)
    return y + h / 2 * (k1 + f(t0 + h, y + h * k1))


class TestOneStep(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_rk4_is_classical(self):
        k1 = _f(T0, Y0)
        k2 = _f(T0 + H / 2, Y0 + H / 2 * k1)
        k3 = _f(T0 + H / 2, Y0 + H / 2 * k2)
        k4 = _f(T0 + H, Y0 + H * k3)
        textbook = Y0 + H / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        y1, y_error, _ = self.variant(lambda: _one_step(RK4(), FIELDS.terms[0]))()
        chex.assert_trees_all_close(y1, textbook, rtol=0, atol=1e-15)
        chex.assert_trees_all_close(y_error, H / 6 * (k4 - _f(T0 + H, y1)), rtol=0, atol=1e-15)

    @chex.variants(with_jit=True, without_jit=True)
    def test_lie_trotter_is_euler_then_euler(self):
        y = Y0 + H * _f(T0, Y0)
        y = y + H * _g(T0, y)
        y1, y_error, result = self.variant(lambda: _one_step(LieTrotter()))()
        chex.assert_trees_all_close(y1, y, rtol=0, atol=1e-15)
        assert y_error is None
        assert result == diffrax.RESULTS.successful

    @chex.variants(with_jit=True, without_jit=True)
    def test_parallel_with_euler_is_euler_on_the_sum(self):
        # (1/K) sum_i (y0 + K h f_i(t0, y0)) = y0 + h sum_i f_i(t0, y0)
        y = Y0 + H * (_f(T0, Y0) + _g(T0, Y0))
        y1, _, _ = self.variant(lambda: _one_step(ParallelSplitting()))()
        chex.assert_trees_all_close(y1, y, rtol=0, atol=1e-15)

    @chex.variants(with_jit=True, without_jit=True)
    def test_strang_is_half_full_half_with_the_clock_in_the_middle_flow(self):
        # f for h/2 frozen at t0, g over [t0, t1], f for h/2 frozen at t1 (Heun sub-steps)
        y = _heun(lambda t, y: _f(T0, y), T0, H / 2, Y0)
        y = _heun(_g, T0, H, y)
        y = _heun(lambda t, y: _f(T0 + H, y), T0, H / 2, y)
        y1, _, _ = self.variant(lambda: _one_step(Strang()))()
        chex.assert_trees_all_close(y1, y, rtol=0, atol=1e-15)


def test_orders_from_theory():
    """Lie–Trotter and parallel: 1; Strang: min(2, sub-solver orders), or the sub-solver's
    order when there is a single vector field."""
    single = SplitTerm((ODETerm(lambda t, y, args: -y), ProjectionTerm(lambda t, y: y)))
    assert LieTrotter().order(FIELDS) == 1
    assert ParallelSplitting(RK4()).order(FIELDS) == 1
    assert Strang().order(FIELDS) == 2
    assert Strang(RK4()).order(FIELDS) == 2
    assert Strang(solvers=(diffrax.Euler(), RK4())).order(FIELDS) == 1
    assert Strang(RK4()).order(single) == 4


# --- a new splitting solver from the public helpers (the package docstring's example) --


class _ReversedLieTrotter(AbstractSplittingSolver):
    solvers: diffrax.AbstractSolver = diffrax.Euler()

    def order(self, terms):
        return 1

    def compose(self, flows, subs, t0, t1, y0, args):
        y, results = y0, []
        for term, sub in reversed(tuple(zip(flows, subs, strict=True))):
            y, result = itde_solvers.advance(term, sub, t0, t1, y, args)
            results.append(result)
        return y, itde_solvers.combine_results(results)


def test_a_new_splitting_solver_from_the_public_helpers(linear):
    """The docstring's example: applying (f_a, f_b) last to first is Lie–Trotter on
    (f_b, f_a), bit for bit, forwards and backwards in time (so its order is Lie–Trotter's)."""
    terms, y0, _, _, _ = linear
    swapped = SplitTerm(terms.terms[::-1])
    for t0, t1 in [(0.0, 1.0), (1.0, 0.0)]:
        ours = _final(terms, _ReversedLieTrotter(), t0, t1, 16, y0)
        theirs = _final(swapped, LieTrotter(), t0, t1, 16, y0)
        assert jnp.array_equal(ours, theirs)
    assert isinstance(_ReversedLieTrotter(), diffrax.AbstractSolver)
    with pytest.raises(TypeError, match="abstract"):
        AbstractSplittingSolver()  # type: ignore[abstract]


# --- gradients and float32 ------------------------------------------------------------


def test_strang_gradient_matches_finite_differences(linear):
    terms, y0, _, _, _ = linear

    def loss(y):
        return jnp.sum(_final(terms, Strang(), 0.0, 1.0, 16, y) ** 2)

    grad = jax.jit(jax.grad(loss))(y0)
    eps = 1e-6
    fd = jnp.array(
        [(loss(y0.at[i].add(eps)) - loss(y0.at[i].add(-eps))) / (2 * eps) for i in range(4)]
    )
    assert jnp.allclose(grad, fd, rtol=1e-6, atol=1e-8)


def test_float32_splitting_runs_and_converges():
    with jax.enable_x64(False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(0))
        a = jax.random.normal(k1, (4, 4)) / 2
        b = jax.random.normal(k2, (4, 4)) / 2
        y0 = jnp.full((4,), 0.5)
        terms = SplitTerm((ODETerm(lambda t, y, args: a @ y), ODETerm(lambda t, y, args: b @ y)))
        exact = jax.scipy.linalg.expm(a + b) @ y0
        for solver, expected in [(Strang(), 2.0), (LieTrotter(), 1.0)]:
            out = _final(terms, solver, 0.0, 1.0, 32, y0)
            assert out.dtype == jnp.float32
            order, _ = _order(terms, solver, exact, [8, 16, 32], y0=y0)
            assert abs(order - expected) < 2 * TOL, (solver, order)


# --- trace-time errors ----------------------------------------------------------------


@pytest.mark.parametrize("solver", [Strang(), ParallelSplitting(), LieTrotter()])
def test_non_split_term_is_a_type_error(solver):
    with pytest.raises(TypeError, match="SplitTerm"):
        diffrax.diffeqsolve(ODETerm(lambda t, y, args: -y), solver, 0.0, 1.0, 0.1, 1.0)


@pytest.mark.parametrize("cls", [Strang, ParallelSplitting, LieTrotter])
def test_wrong_number_of_subsolvers_is_a_value_error(linear, cls):
    terms, y0, _, _, _ = linear
    with pytest.raises(ValueError, match="2 sub-flows"):
        diffrax.diffeqsolve(terms, cls(solvers=(diffrax.Heun(),)), 0.0, 1.0, 0.1, y0)


@pytest.mark.parametrize("cls", [Strang, ParallelSplitting, LieTrotter, _ReversedLieTrotter])
def test_only_projections_is_a_value_error(cls):
    terms = SplitTerm((ProjectionTerm(lambda t, y: y),))
    with pytest.raises(ValueError, match="at least one vector-field"):
        diffrax.diffeqsolve(terms, cls(), 0.0, 1.0, 0.1, jnp.array([1.0]))


def test_strang_clock_must_be_a_vector_field():
    terms = SplitTerm((ODETerm(lambda t, y, args: -y), ProjectionTerm(lambda t, y: y)))
    with pytest.raises(ValueError, match="clock"):
        diffrax.diffeqsolve(terms, Strang(clock=1), 0.0, 1.0, 0.1, jnp.array([1.0]))


# --- convergence helpers --------------------------------------------------------------


def test_observed_order_recovers_a_known_slope():
    steps = 2.0 ** -np.arange(1, 9)
    errors = 3.0 * steps**2.5
    assert observed_order(steps, errors) == pytest.approx(2.5, abs=1e-12)
    # round-off points below the floor are dropped, in any order of the inputs
    noisy = np.concatenate([errors, [1e-17, 3e-16]])
    all_steps = np.concatenate([steps, [1e-6, 1e-7]])
    assert observed_order(all_steps[::-1], noisy[::-1]) == pytest.approx(2.5, abs=1e-12)
    # the asymptotic range keeps the smallest steps only
    bent = np.where(steps > 0.05, 10 * errors, errors)
    assert observed_order(steps, bent, asymptotic=4) == pytest.approx(2.5, abs=1e-12)
    with pytest.raises(ValueError, match="at least two"):
        observed_order(steps[:3], [1e-20, 1e-20, 1e-3])


def test_error_norm():
    a = {"x": jnp.array([1.0, 2.0]), "y": jnp.array([[3.0]])}
    b = {"x": jnp.array([1.0, 2.5]), "y": jnp.array([[1.0]])}
    assert float(error_norm(a, b)) == pytest.approx(2.0)
    assert float(error_norm(a, b, "rel_l2")) == pytest.approx(
        np.sqrt(0.25 + 4.0) / np.sqrt(1.0 + 6.25 + 1.0)
    )
    with pytest.raises(ValueError, match="kind"):
        error_norm(a, b, "l3")


def test_combine_results_keeps_static_success_static_and_reports_a_failure():
    """Sub-steps that succeed at trace time give a step result known at trace time; a
    traced failure among them is the combined result, whatever its place."""
    ok, bad = diffrax.RESULTS.successful, diffrax.RESULTS.max_steps_reached

    @jax.jit
    def all_static(x):  # inside a trace, where a combined result would become a tracer
        assert not itde_solvers.combine_results([ok, ok, ok]).is_traced()
        return x

    all_static(0.0)

    @jax.jit
    def combined(fail_at):
        traced = [diffrax.RESULTS.where(fail_at == i, bad, ok) for i in range(3)]
        return itde_solvers.combine_results([ok, traced[0], ok, traced[1], traced[2]])._value

    for i in range(3):
        assert int(combined(i)) == int(bad._value)
    assert int(combined(5)) == int(ok._value)
