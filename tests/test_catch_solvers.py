"""Solver steps against the textbook formulas, in the cases the order studies do not reach:
Strang with three vector fields (with two, the second half's order cannot be wrong), and
several steps of a projection method (one step cannot see what is carried between steps).
"""

import diffrax
import jax.numpy as jnp
import numpy as np
from diffrax import ODETerm

from itde_solvers import RK4, Projected, ProjectionTerm, SplitTerm, Strang


def _f(t, y):
    return jnp.cos(t) * y**2 - y


def _g(t, y):
    return jnp.sin(2.0 * t) * y[::-1] + 0.3 * y


def _k(t, y):
    return jnp.array([[0.0, 1.0], [-1.0, 0.2]]) @ y * (1.0 + t)


def _heun(f, t0, h, y):
    k1 = f(t0, y)
    return y + h / 2 * (k1 + f(t0 + h, y + h * k1))


def test_strang_with_three_fields_is_symmetric():
    """f, g for h/2 (clock frozen at t0), k over [t0, t1] (the clock owner), then g, f for
    h/2 in reverse order (clock frozen at t1); Heun sub-steps."""
    t0, h, y0 = 0.3, 0.2, jnp.array([0.7, -0.4])
    t1 = t0 + h
    y = _heun(lambda t, y: _f(t0, y), t0, h / 2, y0)
    y = _heun(lambda t, y: _g(t0, y), t0, h / 2, y)
    y = _heun(_k, t0, h, y)
    y = _heun(lambda t, y: _g(t1, y), t0, h / 2, y)
    y = _heun(lambda t, y: _f(t1, y), t0, h / 2, y)
    terms = SplitTerm(tuple(ODETerm(lambda t, y, args, fn=fn: fn(t, y)) for fn in (_f, _g, _k)))
    solver = Strang()
    state = solver.init(terms, t0, t1, y0, None)
    y1, _, _, _, _ = solver.step(terms, t0, t1, y0, None, state, False)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y), rtol=0, atol=1e-15)


def _rotation(t, y):
    omega = jnp.stack([jnp.cos(t), 0.5 + 0.0 * t, jnp.sin(2.0 * t)])
    return jnp.cross(omega, y)


def _rk4(f, t0, h, y):
    k1 = f(t0, y)
    k2 = f(t0 + h / 2, y + h / 2 * k1)
    k3 = f(t0 + h / 2, y + h / 2 * k2)
    k4 = f(t0 + h, y + h * k3)
    return y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def test_projected_steps_restart_from_the_projected_state():
    """Each step of `Projected(RK4())` is RK4 from the projected state, then the projection:
    no stage evaluated at the unprojected end point is carried into the next step."""
    y0, h, n = jnp.array([1.0, 2.0, 2.0]) / 3, 0.4, 3
    terms = SplitTerm((ODETerm(lambda t, y, args: _rotation(t, y)),
                       ProjectionTerm(lambda t, y: y / jnp.linalg.norm(y))))  # fmt: skip
    sol = diffrax.diffeqsolve(
        terms, Projected(RK4()), 0.0, n * h, h, y0, saveat=diffrax.SaveAt(steps=True),
        max_steps=n,
    )  # fmt: skip
    y, expected = y0, []
    for i in range(n):
        raw = _rk4(_rotation, i * h, h, y)
        assert abs(float(jnp.linalg.norm(raw)) - 1.0) > 1e-8  # the projection does work
        y = raw / jnp.linalg.norm(raw)
        expected.append(y)
    np.testing.assert_allclose(np.asarray(sol.ys), np.asarray(jnp.stack(expected)), atol=1e-15)
