"""`Projected` (a diffrax solver on the summed field, then the projections) on the unit sphere.

The field is a time-dependent rotation plus a tangential drift, so the exact solution
stays on the sphere and a projection method keeps the order of the solver it wraps.
"""

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
        stepsize_controller=diffrax.PIDController(rtol=1e-13, atol=1e-13),
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


@pytest.mark.parametrize(
    "solver, expected, ns, at_least",
    [
        (Projected(diffrax.Euler()), 1.0, [32, 64, 128, 256], False),
        (Projected(diffrax.Heun()), 2.0, [16, 32, 64, 128], False),
        (Projected(diffrax.Midpoint()), 2.0, [64, 128, 256, 512], False),
        (Projected(RK4()), 4.0, [32, 64, 128, 256], False),
        (Projected(RK4(), reuse_fsal=True), 4.0, [32, 64, 128, 256], False),
        (Projected(diffrax.Tsit5()), 4.0, [4, 8, 16, 32], True),
        (Projected(diffrax.Dopri5()), 4.0, [4, 8, 16, 32], True),
        (Projected(diffrax.Dopri8()), 7.0, [2, 4, 8], True),
    ],
    ids=["euler", "heun", "midpoint", "rk4", "rk4-reuse-fsal", "tsit5", "dopri5", "dopri8"],
)
def test_projected_keeps_the_order_and_the_sphere(sphere, solver, expected, ns, at_least):
    terms, y0, reference = sphere
    errors, worst = [], 0.0
    for n in ns:
        ys = _accepted(_fixed(terms, solver, n, y0))
        assert ys.shape[0] == n
        errors.append(float(error_norm(ys[-1], reference.ys[-1])))
        worst = max(worst, _sphere_distance(ys))
    order = observed_order([T / n for n in ns], errors)  # drops errors at round-off
    if at_least:
        assert order > expected - TOL, order
    else:
        assert abs(order - expected) < TOL, order
    assert worst < 1e-12
    assert solver.order(terms) == solver.solver.order(terms)


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
