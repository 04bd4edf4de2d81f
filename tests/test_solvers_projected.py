"""`Projected` (a diffrax solver on the summed field, then the projections) on the unit sphere.

The field is a time-dependent rotation plus a tangential drift, so the exact solution
stays on the sphere and a projection method keeps the order of the solver it wraps.
"""

import chex
import diffrax
import jax
import jax.numpy as jnp
import pytest
from diffrax import ODETerm

from itde_solvers import RK4, Projected, ProjectionTerm, SplitTerm, error_norm, observed_order

TOL = 0.15  # tolerance on an observed order
T = 2.0


@pytest.fixture(scope="module", autouse=True)
def _float64():
    # Scoped to this module so that float32 test files elsewhere are unaffected.
    with jax.enable_x64(True):
        yield


def _rotation(t, y, args):
    omega = jnp.stack([jnp.cos(t), 0.5 + 0.0 * t, jnp.sin(2.0 * t)])
    return jnp.cross(omega, y)


def _drift(t, y, args):
    c = jnp.array([0.3, -0.7, 0.5], dtype=y.dtype)
    return (1.0 + 0.5 * jnp.sin(t)) * (c - jnp.dot(c, y) * y)  # tangential part of c


def _normalise(t, y):
    return y / jnp.linalg.norm(y)


def _tangential_part(y, v):
    return v - jnp.dot(v, y) * y


def _sphere_distance(ys):
    return float(jnp.max(jnp.abs(jnp.linalg.norm(ys, axis=-1) - 1.0)))


def _accepted(sol):
    return sol.ys[: int(sol.stats["num_accepted_steps"])]


@pytest.fixture(scope="module")
def sphere():
    terms = SplitTerm((ODETerm(_rotation), ODETerm(_drift), ProjectionTerm(_normalise)))
    y0 = jnp.array([1.0, 2.0, 2.0]) / 3
    reference = diffrax.diffeqsolve(
        ODETerm(lambda t, y, args: _rotation(t, y, args) + _drift(t, y, args)),
        diffrax.Dopri8(),
        0.0,
        T,
        0.01,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-14, atol=1e-14),
        max_steps=100_000,
        saveat=diffrax.SaveAt(t1=True, dense=True),
    )
    assert abs(float(jnp.linalg.norm(reference.ys[-1])) - 1.0) < 1e-12
    return terms, y0, reference


def _fixed(terms, solver, n_steps, y0, saveat=None):
    return diffrax.diffeqsolve(
        terms,
        solver,
        0.0,
        T,
        jnp.asarray(T / n_steps),
        y0,
        saveat=saveat or diffrax.SaveAt(steps=True),
        max_steps=4096,
    )


# Global orders from theory (Hairer, Norsett & Wanner), written here rather than read from
# the solvers under test. Step counts are chosen so that every error is well above both the
# round-off floor and the reference's error (~1e-13) and inside the asymptotic range, so a
# 5th-order method measures ~5 (not capped by round-off) and Dopri8 ~8.
@pytest.mark.parametrize(
    "solver, theory, ns, low, high",
    [
        (Projected(diffrax.Euler()), 1, [32, 64, 128, 256], 1 - TOL, 1 + TOL),
        (Projected(diffrax.Heun()), 2, [16, 32, 64, 128], 2 - TOL, 2 + TOL),
        (Projected(diffrax.Midpoint()), 2, [64, 128, 256, 512], 2 - TOL, 2 + TOL),
        (Projected(RK4()), 4, [32, 64, 128, 256], 4 - TOL, 4 + TOL),
        (Projected(RK4(), reuse_fsal=True), 4, [32, 64, 128, 256], 4 - TOL, 4 + TOL),
        # order 5; the slope approaches 5 from above as h shrinks
        (Projected(diffrax.Tsit5()), 5, [8, 16, 32, 64], 4.7, 5.5),
        (Projected(diffrax.Dopri5()), 5, [8, 16, 32, 64], 4.7, 5.5),
        # order 8; at n = 16 the error is ~2e-12, so smaller steps would meet the reference
        (Projected(diffrax.Dopri8()), 8, [4, 6, 8, 12, 16], 7.5, 8.5),
    ],
    ids=["euler", "heun", "midpoint", "rk4", "rk4-reuse-fsal", "tsit5", "dopri5", "dopri8"],
)
def test_projected_keeps_the_order_and_the_sphere(sphere, solver, theory, ns, low, high):
    terms, y0, reference = sphere
    errors, worst = [], 0.0
    for n in ns:
        ys = _accepted(_fixed(terms, solver, n, y0))
        assert ys.shape[0] == n
        errors.append(float(error_norm(ys[-1], reference.ys[-1])))
        worst = max(worst, _sphere_distance(ys))
    assert min(errors) > 1e-12, errors  # no point is at round-off or at the reference's error
    order = observed_order([T / n for n in ns], errors)
    assert low < order < high, (order, errors)
    assert worst < 1e-12
    assert solver.order(terms) == theory


def test_dense_output_passes_through_the_projected_states(sphere):
    terms, y0, reference = sphere
    sol = _fixed(terms, Projected(diffrax.Tsit5()), 20, y0, diffrax.SaveAt(steps=True, dense=True))
    ys = _accepted(sol)
    grid = jnp.linspace(0.0, T, 21)[1:]
    assert jnp.allclose(jax.vmap(sol.evaluate)(grid), ys, rtol=0, atol=1e-14)
    assert _sphere_distance(jax.vmap(sol.evaluate)(grid)) < 1e-12
    between = grid - T / 40
    dense_error = jnp.max(
        jnp.abs(jax.vmap(sol.evaluate)(between) - jax.vmap(reference.evaluate)(between))
    )
    assert float(dense_error) < 1e-6


@pytest.mark.parametrize("inner", [diffrax.Tsit5(), RK4(), diffrax.Dopri5()], ids=str)
def test_adaptive_steps_with_pid(sphere, inner):
    terms, y0, reference = sphere
    solver = Projected(inner)
    assert isinstance(solver, diffrax.AbstractAdaptiveSolver)
    sol = diffrax.diffeqsolve(
        terms,
        solver,
        0.0,
        T,
        None,
        y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-8, atol=1e-8),
        saveat=diffrax.SaveAt(steps=True),
    )
    ys = _accepted(sol)
    assert _sphere_distance(ys) < 1e-12
    assert float(error_norm(ys[-1], reference.ys[-1])) < 1e-6
    assert 5 < ys.shape[0] < 200


def test_no_error_estimate_no_adaptive_steps(sphere):
    terms, y0, _ = sphere
    solver = Projected(diffrax.Euler())
    assert not isinstance(solver, diffrax.AbstractAdaptiveSolver)
    with pytest.raises(Exception, match="error estimates"):
        diffrax.diffeqsolve(
            terms,
            solver,
            0.0,
            T,
            0.1,
            y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
        )


def test_backward_in_time(sphere):
    terms, _, reference = sphere
    y0 = jnp.array([1.0, 2.0, 2.0]) / 3
    sol = diffrax.diffeqsolve(terms, Projected(RK4()), T, 0.0, -T / 128, reference.ys[-1])
    assert float(error_norm(sol.ys[-1], y0)) < 1e-7
    assert _sphere_distance(sol.ys) < 1e-12


@pytest.mark.slow  # the default-suite budget; same property at small size: see note
def test_gradient_matches_finite_differences(sphere):
    terms, y0, _ = sphere
    weights = jnp.array([1.0, 2.0, 3.0])

    def loss(y):
        return jnp.dot(weights, _fixed(terms, Projected(diffrax.Tsit5()), 8, y).ys[7])

    grad = jax.jit(jax.grad(loss))(y0)
    eps = 1e-6
    fd = jnp.array(
        [(loss(y0.at[i].add(eps)) - loss(y0.at[i].add(-eps))) / (2 * eps) for i in range(3)]
    )
    assert jnp.allclose(grad, fd, rtol=1e-6, atol=1e-8)


@pytest.mark.slow  # ~12 s; BacksolveAdjoint's gradient is also checked in test_continuum
def test_backsolve_adjoint_runs_the_backward_solve_unprojected(sphere):
    """BacksolveAdjoint steps `Projected` over diffrax's AdjointTerm (no SplitTerm, no
    projections): its gradient, of the continuous problem, agrees with the discrete one
    to the method's accuracy along the sphere. (Radially they differ: the discrete solve
    normalises a scaled start, the unconstrained ODE does not.)"""
    terms, y0, _ = sphere
    weights = jnp.array([1.0, 2.0, 3.0])

    def loss(y, adjoint):
        sol = diffrax.diffeqsolve(
            terms, Projected(RK4()), 0.0, T, T / 32, y, adjoint=adjoint, max_steps=64
        )
        return jnp.dot(weights, sol.ys[-1])

    backsolve = jax.grad(loss)(y0, diffrax.BacksolveAdjoint())
    discrete = jax.grad(loss)(y0, diffrax.RecursiveCheckpointAdjoint())
    tangent = lambda g: _tangential_part(y0, g)  # noqa: E731
    chex.assert_trees_all_close(tangent(backsolve), tangent(discrete), rtol=0, atol=1e-4)
    assert float(jnp.linalg.norm(tangent(discrete))) > 0.1


class TestOneStep(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_one_step_is_the_wrapped_step_then_the_projection(self):
        terms = SplitTerm((ODETerm(_rotation), ODETerm(_drift), ProjectionTerm(_normalise)))
        summed = ODETerm(lambda t, y, args: _rotation(t, y, args) + _drift(t, y, args))
        t0, t1, y0 = 0.3, 0.5, jnp.array([1.0, 2.0, 2.0]) / 3

        @self.variant
        def steps():
            solver = Projected(RK4())
            state = solver.init(terms, t0, t1, y0, None)
            y1, y_error, _, _, _ = solver.step(terms, t0, t1, y0, None, state, False)
            rk4 = RK4()
            state = rk4.init(summed, t0, t1, y0, None)
            raw, raw_error, _, _, _ = rk4.step(summed, t0, t1, y0, None, state, False)
            return y1, y_error, raw, raw_error

        y1, y_error, raw, raw_error = steps()
        chex.assert_trees_all_close(y1, raw / jnp.linalg.norm(raw), rtol=0, atol=1e-15)
        chex.assert_trees_all_close(y_error, raw_error, rtol=0, atol=1e-15)
        assert float(jnp.abs(jnp.linalg.norm(raw) - 1.0)) > 1e-9  # the projection did work


def test_float32_projected_runs_on_the_sphere():
    with jax.enable_x64(False):
        terms = SplitTerm((ODETerm(_rotation), ODETerm(_drift), ProjectionTerm(_normalise)))
        y0 = jnp.array([1.0, 2.0, 2.0]) / 3
        sol = _fixed(terms, Projected(RK4()), 32, y0)
        ys = _accepted(sol)
        assert ys.dtype == jnp.float32
        assert _sphere_distance(ys) < 1e-6


def test_non_split_term_is_a_type_error():
    with pytest.raises(TypeError, match="SplitTerm"):
        diffrax.diffeqsolve(
            ODETerm(lambda t, y, args: -y), Projected(diffrax.Tsit5()), 0.0, 1.0, 0.1, 1.0
        )


def test_projected_needs_a_solver():
    with pytest.raises(TypeError, match="solver"):
        Projected(lambda t, y: y)  # type: ignore[arg-type]
