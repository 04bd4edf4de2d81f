"""The continuum regime: smooth controls, depth integrators, adjoints, bad input."""

import chex
import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import itde
import itde_solvers as solvers
from itde import SCHEMES
from itde.studies._internal import ProblemConfig, build_problem


@pytest.fixture(scope="module")
def problem():
    model, u0 = build_problem(ProblemConfig(n_tokens=6, n_features=8, n_heads=2, n_hidden=12))
    ref = itde.solve(
        model,
        u0,
        solver=solvers.Projected(diffrax.Dopri8()),
        stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
        dt0=0.05,
    ).ys[-1]
    return model, u0, ref


def _errors(model, u0, ref, name, ns):
    scheme = SCHEMES[name]
    f = jax.jit(
        lambda dt: itde.solve(
            model,
            u0,
            solver=scheme.make(),
            terms=scheme.terms,
            dt0=dt,
            stepsize_controller=diffrax.ConstantStepSize(),
            max_steps=max(ns) + 2,
        ).ys[-1]
    )
    return [float(jnp.max(jnp.abs(f(jnp.asarray(1.0 / n)) - ref))) for n in ns]


# Global orders from the theory of each scheme (not read from the registry under test):
# Lie-Trotter and the averaged (parallel) splitting are first order; Strang splitting is
# symmetric, hence second order; the projected Runge-Kutta methods keep the order of the
# underlying method (the projection onto the smooth constraint set is an O(dt^{p+1})
# perturbation per step): Heun 2, RK4 4, Tsit5 5.
THEORY_ORDER = {"lie": 1, "parallel": 1, "strang": 2, "heun": 2, "rk4": 4, "tsit5": 5}
# Tsit5 reaches its round-off floor early: three step sizes. Measured local rates for
# n = 4, 8, 16 are 5.56 and 5.44, falling towards 5: its leading error constant is small,
# so the next term still shows; the window above the theoretical order is wider for it.
NS_FOR_ORDER = {name: [4, 8, 16, 32] for name in THEORY_ORDER} | {"tsit5": [4, 8, 16]}
ORDER_WINDOW = {name: (0.15, 0.15) for name in THEORY_ORDER} | {"tsit5": (0.15, 0.6)}
# one splitting and one projected Runge-Kutta scheme run by default, the rest with -m slow
DEFAULT_ORDER_CASES = {"lie", "rk4"}


def _slope(ns, errs):
    """Least-squares slope of log error on log step (written here, independent of
    `itde_solvers.observed_order`)."""
    return float(np.polyfit(np.log(1.0 / np.asarray(ns)), np.log(errs), 1)[0])


@pytest.mark.parametrize(
    "name",
    [
        n if n in DEFAULT_ORDER_CASES else pytest.param(n, marks=pytest.mark.slow)
        for n in THEORY_ORDER
    ],
)
def test_observed_depth_order_matches_theory(problem, name):
    model, u0, ref = problem
    ns = NS_FOR_ORDER[name]
    errs = _errors(model, u0, ref, name, ns)
    assert min(errs) > 1e-11, errs  # above the reference's own error: a meaningful slope
    slope = _slope(ns, errs)
    below, above = ORDER_WINDOW[name]
    p = THEORY_ORDER[name]
    assert p - below <= slope <= p + above, (name, slope, errs)


@pytest.mark.parametrize("name", ["lie", "rk4", pytest.param("strang", marks=pytest.mark.slow)])
def test_every_saved_state_lies_on_the_moving_constraint(problem, name):
    model, u0, _ = problem
    ts = jnp.linspace(0.0, 1.0, 9)
    sol = itde.solve(
        model, u0, solver=SCHEMES[name].make(), dt0=1 / 16, saveat=diffrax.SaveAt(ts=ts)
    )
    for t, u in zip(ts, sol.ys, strict=True):
        rm, rv = model.constraint(t).residuals(u).values()
        assert float(rm) < 1e-12 and float(rv) < 1e-12, (name, float(t))
    sigma2 = [float(model.constraint(t).sigma2) for t in (0.0, 1.0)]
    assert abs(sigma2[1] - sigma2[0]) > 0.1  # the constraint set really moves


def test_adaptive_projected_solve_and_progress_meter(problem, capsys):
    model, u0, ref = problem
    sol = itde.solve(
        model,
        u0,
        solver=solvers.Projected(diffrax.Tsit5()),
        stepsize_controller=diffrax.PIDController(rtol=1e-9, atol=1e-9),
        progress_meter=diffrax.TextProgressMeter(),
    )
    jax.block_until_ready(sol.ys)
    assert float(jnp.max(jnp.abs(sol.ys[-1] - ref))) < 1e-7
    out = capsys.readouterr()
    assert "100.00%" in out.out + out.err  # the meter reported the whole solve


def test_regime_switch_lie_at_dt_one_is_the_transformer():
    """A discrete model through the same entry point, Lie at dt = 1, equals the layer stack;
    and its smooth interpolation is a continuum model of the same object."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        12, 3, 20, dropout=0.0, batch_first=True, dtype=torch.float64
    )
    enc = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False).eval()
    x = np.random.default_rng(0).standard_normal((5, 12))
    with torch.no_grad():
        for p in enc.parameters():  # the layers are copies of one: make them differ
            p.add_(0.2 * torch.randn_like(p))
        y = enc(torch.as_tensor(x[None]))[0].numpy()
    model = itde.from_torch(enc)
    sol = itde.solve(model, jnp.asarray(x), solver=solvers.LieTrotter(), dt0=1.0)
    assert float(np.max(np.abs(np.asarray(sol.ys[-1]) - y))) < 1e-12
    smooth = itde.TransformerIDE(itde.LegendreControls.from_layers(model), model.grid)
    # it interpolates where the scheme reads: layer n's operators at its start t_n, its
    # projections at its end t_{n+1}; so Lie at dt = 1 is the encoder again
    layer1 = model.controls.layer(1)
    np.testing.assert_allclose(smooth.controls(1.0).attention.wq, layer1.attention.wq, atol=1e-12)
    np.testing.assert_allclose(smooth.controls(2.0).norm2.gain, layer1.norm2.gain, atol=1e-12)
    assert float(jnp.max(jnp.abs(smooth.controls(1.5).attention.wq - layer1.attention.wq))) > 1e-3
    sol = itde.solve(smooth, jnp.asarray(x), solver=solvers.LieTrotter(), dt0=1.0)
    assert float(np.max(np.abs(np.asarray(sol.ys[-1]) - y))) < 1e-12


# ------------------------------------------------------------------ gradients through depth
def _loss_fn(adjoint, scheme="rk4", dt=0.25):
    def loss(model, f):
        # the initial state is projected inside the loss, so that every parameter
        # (sigma(0) included) acts on the solution the same way in every adjoint
        u0 = model.project(0.0, f)
        sol = itde.solve(model, u0, solver=SCHEMES[scheme].make(), dt0=dt, adjoint=adjoint)
        u = sol.ys[-1]
        return jnp.sum(jnp.sin(u) * jnp.arange(u.size).reshape(u.shape))

    return loss


@pytest.mark.slow  # the default-suite budget; same property at small size: see note
def test_adjoints_agree_and_match_finite_differences(problem):
    model, u0, _ = problem
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grads = {}
    for name, adj in [
        ("recursive", diffrax.RecursiveCheckpointAdjoint()),
        ("direct", diffrax.DirectAdjoint()),
    ]:
        g = jax.grad(lambda p: _loss_fn(adj)(eqx.combine(p, static), u0))(params)
        grads[name] = g
    chex.assert_trees_all_close(grads["recursive"], grads["direct"], rtol=1e-10, atol=1e-12)
    # central finite differences on a few parameters
    loss = _loss_fn(diffrax.RecursiveCheckpointAdjoint())
    g = grads["recursive"]
    checks = [
        (lambda m: m.controls.coeffs.attention.wq, (1, 0, 3, 2), g.controls.coeffs.attention.wq),
        (lambda m: m.controls.coeffs.attention.wq, (0, 1, 5, 1), g.controls.coeffs.attention.wq),
        (lambda m: m.controls.coeffs.norm2.sigma1, (1,), g.controls.coeffs.norm2.sigma1),
        (lambda m: m.controls.coeffs.feedforward.w2, (2, 3, 4), g.controls.coeffs.feedforward.w2),
    ]
    h = 1e-6
    for where, idx, gleaf in checks:
        leaf = where(model)
        plus = eqx.tree_at(where, model, leaf.at[idx].add(h))
        minus = eqx.tree_at(where, model, leaf.at[idx].add(-h))
        fd = (loss(plus, u0) - loss(minus, u0)) / (2 * h)
        assert float(gleaf[idx]) == pytest.approx(float(fd), rel=1e-6, abs=1e-8)


@pytest.mark.slow
def test_backsolve_adjoint_converges_to_the_discrete_gradient(problem):
    """Optimise-then-discretise: BacksolveAdjoint solves the adjoint ODE backwards with the
    same Tsit5 steps, so it is not the exact gradient of the discrete solve; the two differ
    by the discretisation error of a fifth-order method, O(dt^5): halving dt divides the
    difference by about 2^5 = 32 (measured: 1.44e-4 at dt = 1/2, 1.42e-6 at dt = 1/4)."""
    model, u0, _ = problem
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def gradient(adjoint, dt):
        g = jax.grad(lambda p: _loss_fn(adjoint, "tsit5", dt)(eqx.combine(p, static), u0))
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(g(params))])

    rel = []
    for dt in (0.5, 0.25):
        a = gradient(diffrax.RecursiveCheckpointAdjoint(), dt)
        b = gradient(diffrax.BacksolveAdjoint(), dt)
        rel.append(np.linalg.norm(a - b) / np.linalg.norm(a))
    assert rel[1] > 1e-12, rel  # a different gradient: the option really is in effect
    assert np.log2(rel[0] / rel[1]) >= 5 - 0.3, rel


# ------------------------------------------------------------------ bad input
def test_unprojected_solver_is_rejected(problem):
    model, u0, _ = problem
    with pytest.raises(TypeError, match=r"solvers.Projected\(diffrax.Tsit5\(\)\)"):
        itde.solve(model, u0, solver=diffrax.Tsit5(), dt0=0.1)


def test_adaptive_solve_past_max_steps_is_an_error(problem):
    model, u0, _ = problem
    with pytest.raises(Exception, match="max_steps"):
        itde.solve(
            model,
            u0,
            solver=solvers.Projected(diffrax.Tsit5()),
            stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
            dt0=0.01,
            max_steps=3,
        ).ys.block_until_ready()


def test_tangent_form_needs_a_projection():
    # a fresh network's norms carry a per-feature gain: no projection, no constraint set
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=2, n_features=8, n_heads=2, eps=1e-5)
    with pytest.raises(ValueError, match="per-feature gain or shift.*continuum_form"):
        itde.solve(m, jnp.ones((3, 8)) + jnp.arange(8.0), solver=solvers.Strang(), dt0=0.5)
    with pytest.raises(ValueError, match="kind"):
        m.terms("exact")


def test_traced_dt_needs_constant_step_size(problem):
    model, u0, _ = problem
    with pytest.raises(TypeError, match="ConstantStepSize"):
        jax.jit(lambda dt: itde.solve(model, u0, solver=solvers.LieTrotter(), dt0=dt).ys)(0.1)
