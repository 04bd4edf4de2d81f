"""The `burgers` task: the pseudo-spectral solver against exact solutions, its time order,
its invariants, and the dataset generator."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from itde.data import BurgersTask, burgers_solve, relative_l2


def grid(n):
    return 2 * np.pi * np.arange(n) / n


def cole_hopf(x, t, nu, c=1.2, a=0.1):
    r"""$u = -2\nu\,\phi_x/\phi$ with $\phi = c + e^{-\nu t}\cos x + a e^{-4\nu t}\sin 2x$,
    which solves $\phi_t = \nu\phi_{xx}$ and stays positive for $c > 1 + |a|$."""
    phi = c + np.exp(-nu * t) * np.cos(x) + a * np.exp(-4 * nu * t) * np.sin(2 * x)
    phi_x = -np.exp(-nu * t) * np.sin(x) + 2 * a * np.exp(-4 * nu * t) * np.cos(2 * x)
    return -2 * nu * phi_x / phi


def rel_max(u, exact):
    return float(np.max(np.abs(np.asarray(u) - exact)) / np.max(np.abs(exact)))


def observed_order(steps, errors):
    return -np.polyfit(np.log(steps), np.log(errors), 1)[0]


def test_small_data_follow_the_heat_equation():
    # Amplitude 1e-10: the nonlinear term is 1e-10 of the linear one, which the integrating
    # factor integrates exactly; the error is the O(A) nonlinear correction plus round-off.
    n, nu, t, amp = 64, 0.1, 1.0, 1e-10
    x = grid(n)
    for k in (1, 3, 10):
        u = burgers_solve(jnp.asarray(amp * np.sin(k * x)), nu=nu, t_final=t, n_steps=10)
        exact = amp * np.exp(-nu * k * k * t) * np.sin(k * x)
        assert rel_max(u, exact) < 1e-9


def test_cole_hopf_exact_solution_float64():
    n, nu, t = 128, 0.2, 1.0
    x = grid(n)
    u0, exact = cole_hopf(x, 0.0, nu), cole_hopf(x, t, nu)
    u = burgers_solve(jnp.asarray(u0), nu=nu, t_final=t, n_steps=200)
    assert u.dtype == jnp.float64
    assert rel_max(u, exact) < 1e-8  # measured ~2e-11
    # ... and the nonlinearity matters: the heat equation alone is 17% off.
    k = np.arange(n // 2 + 1)
    heat = np.fft.irfft(np.fft.rfft(u0) * np.exp(-nu * k * k * t), n)
    assert np.linalg.norm(heat - exact) / np.linalg.norm(exact) > 0.1


def test_cole_hopf_exact_solution_float32():
    n, nu, t = 128, 0.2, 1.0
    x = grid(n)
    u = burgers_solve(jnp.asarray(cole_hopf(x, 0.0, nu), jnp.float32), nu=nu, t_final=t, n_steps=50)
    assert u.dtype == jnp.float32
    assert rel_max(u, cole_hopf(x, t, nu)) < 1e-5


def test_time_order_is_four_against_cole_hopf():
    n, nu, t = 128, 0.2, 1.0
    x = grid(n)
    u0, exact = jnp.asarray(cole_hopf(x, 0.0, nu)), cole_hopf(x, t, nu)
    steps = [20, 40, 80, 160]
    errors = [rel_max(burgers_solve(u0, nu=nu, t_final=t, n_steps=s), exact) for s in steps]
    assert abs(observed_order(steps, errors) - 4) < 0.3


def test_time_order_is_four_by_self_convergence():
    # A random O(1) initial condition of the default task on its solve grid (256 points,
    # nu k_max^2 h up to ~2: the stiff regime the integrating factor is for).
    task = BurgersTask()
    u0 = task.initial_condition(jax.random.key(0))
    solve = functools.partial(burgers_solve, u0, nu=task.nu, t_final=task.t_final)
    reference = solve(n_steps=2048)
    steps = [64, 128, 256]
    errors = [float(relative_l2(solve(n_steps=s), reference)) for s in steps]
    assert errors[-1] > 1e-12  # still above round-off
    assert abs(observed_order(steps, errors) - 4) < 0.3


def test_mass_is_conserved():
    task = BurgersTask(n_grid=64, oversample=1)
    u0 = task.initial_condition(jax.random.key(3)) + 0.3  # non-zero mean: advected
    uT = burgers_solve(u0, nu=0.05, t_final=2.0, n_steps=200)
    assert abs(float(jnp.mean(uT) - jnp.mean(u0))) < 1e-14
    assert float(jnp.max(jnp.abs(uT - u0))) > 0.1  # the solution did change


def test_maximum_principle():
    u0 = BurgersTask(n_grid=64, oversample=4).initial_condition(jax.random.key(4))
    uT = burgers_solve(u0, nu=0.05, t_final=1.0, n_steps=200)
    assert float(jnp.max(jnp.abs(uT))) <= float(jnp.max(jnp.abs(u0))) + 1e-6


def test_vmap_and_jit():
    u0 = BurgersTask(n_grid=32, oversample=1).sample(jax.random.key(0), 3)[0]
    solve = functools.partial(burgers_solve, nu=0.1, t_final=0.5, n_steps=20)
    batched = jax.vmap(solve)(u0)
    jitted = jax.jit(solve)(u0[1])
    np.testing.assert_allclose(batched[1], solve(u0[1]), rtol=0, atol=1e-14)
    np.testing.assert_allclose(jitted, solve(u0[1]), rtol=0, atol=1e-14)


def test_task_sample():
    task = BurgersTask(n_grid=32, n_modes=3, amplitude=0.7)
    key = jax.random.key(0)
    u0, uT = task.sample(key, 5)
    assert u0.shape == uT.shape == (5, 32)
    assert u0.dtype == jnp.float64
    np.testing.assert_allclose(jnp.max(jnp.abs(u0), axis=1), 0.7, rtol=1e-12)
    np.testing.assert_allclose(jnp.mean(u0, axis=1), 0.0, atol=1e-14)
    # at most n_modes Fourier modes, and the returned u0 is the one that was solved
    spectrum = np.abs(np.fft.rfft(np.asarray(u0), axis=1))
    assert np.all(spectrum[:, 4:] < 1e-12)
    # deterministic in the key, different across keys
    again = task.sample(key, 5)
    np.testing.assert_array_equal(u0, again[0])
    np.testing.assert_array_equal(uT, again[1])
    other = task.sample(jax.random.split(key)[0], 5)
    assert not np.allclose(u0, other[0])
    # example is sample's single-pair function
    one = task.example(jax.random.split(key, 5)[2])
    np.testing.assert_allclose(one[1], uT[2], rtol=0, atol=1e-13)


def test_task_is_resolved_at_defaults():
    # The default task (n_grid 64, nu 0.05, max|u0| = 1) forms fronts of width ~nu, which
    # 64 points do not resolve; the 4x solve grid does, to ~1e-8 against a 16x solve.
    key = jax.random.key(1)
    task = BurgersTask()
    fine = BurgersTask(oversample=16, n_steps=1024)
    u0, uT = task.sample(key, 32)
    f0, fT = fine.sample(key, 32)
    np.testing.assert_array_equal(u0, f0)
    assert float(relative_l2(uT, fT)) < 1e-6
    coarse = BurgersTask(oversample=1).sample(key, 32)[1]
    assert float(relative_l2(coarse, fT)) > 1e-4  # why oversampling is the default


def test_task_float32():
    """Data and solve in float32 (as in training), asked for explicitly; the float32 solve
    agrees with a float64 solve of the same initial condition to float32 round-off
    amplified by the ~100 RK4 steps."""
    task = BurgersTask(n_grid=32)
    key = jax.random.key(0)
    u0, uT = task.sample(key, 4, dtype=jnp.float32)
    assert u0.dtype == uT.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(uT)))
    k0 = jax.random.split(key, 4)[0]
    ic = task.initial_condition(k0, jnp.float32)
    np.testing.assert_allclose(u0[0], ic[:: task.oversample], atol=1e-6)  # jit vs eager
    ref = burgers_solve(
        ic.astype(jnp.float64), nu=task.nu, t_final=task.t_final, n_steps=task.n_steps
    )[:: task.oversample]
    assert ref.dtype == jnp.float64
    assert float(relative_l2(uT[0].astype(jnp.float64), ref)) < 1e-5
    with pytest.raises(ValueError, match="`dtype`"):
        task.sample(key, 4, dtype=jnp.int32)


def test_relative_l2():
    target = jnp.array([[3.0, 4.0], [1.0, 0.0]])
    pred = jnp.array([[3.0, 4.0 + 5.0], [1.0, 0.5]])
    assert float(relative_l2(pred, target)) == pytest.approx((1.0 + 0.5) / 2)
    assert float(relative_l2(target[0], target[0])) == 0.0
    with pytest.raises(ValueError, match="`pred` and `target`"):
        relative_l2(pred, target[:, :1])
    with pytest.raises(ValueError, match="`pred`"):
        relative_l2(jnp.zeros((2, 2, 2)), jnp.zeros((2, 2, 2)))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(nu=0.0), "nu"),
        (dict(nu=-1.0), "nu"),
        (dict(nu=float("nan")), "nu"),
        (dict(nu="a"), "nu"),
        (dict(t_final=-1.0), "t_final"),
        (dict(t_final=float("inf")), "t_final"),
        (dict(n_steps=0), "n_steps"),
        (dict(n_steps=2.0), "n_steps"),
        (dict(n_steps=True), "n_steps"),
    ],
)
def test_solve_bad_arguments(kwargs, name):
    args = dict(nu=0.1, t_final=1.0, n_steps=10) | kwargs
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        burgers_solve(jnp.zeros(16), **args)
    assert repr(kwargs[name]) in str(info.value)


@pytest.mark.parametrize(
    ("u0", "name"),
    [
        (np.zeros((2, 16)), "`u0`"),
        (np.zeros(15), r"`u0.shape\[0\]`"),
        (np.zeros(6), r"`u0.shape\[0\]`"),
        (np.zeros(16, np.int32), "`u0`"),
    ],
)
def test_solve_bad_initial_condition(u0, name):
    with pytest.raises(ValueError, match=name):
        burgers_solve(u0, nu=0.1, t_final=1.0, n_steps=10)


def test_solve_zero_time_is_identity():
    u0 = BurgersTask(n_grid=16, n_modes=2, oversample=1).initial_condition(jax.random.key(0))
    np.testing.assert_allclose(burgers_solve(u0, nu=0.1, t_final=0.0, n_steps=3), u0, atol=1e-15)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(n_grid=63), "n_grid"),
        (dict(n_grid=6), "n_grid"),
        (dict(n_grid=64.0), "n_grid"),
        (dict(nu=0.0), "nu"),
        (dict(t_final=0.0), "t_final"),
        (dict(n_steps=0), "n_steps"),
        (dict(n_modes=0), "n_modes"),
        (dict(n_modes=22), "n_modes"),
        (dict(decay=-1.0), "decay"),
        (dict(amplitude=0.0), "amplitude"),
        (dict(oversample=0), "oversample"),
    ],
)
def test_task_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        BurgersTask(**kwargs)
    assert repr(kwargs[name]) in str(info.value)


@pytest.mark.parametrize("batch", [0, -1, 2.0])
def test_sample_bad_batch(batch):
    with pytest.raises(ValueError, match="`batch`"):
        BurgersTask(n_grid=16, n_modes=2).sample(jax.random.key(0), batch)
