"""A flow map over part of the depth is the map the whole solve takes there: maps compose.

Per-layer controls jump at every layer boundary. A multi-stage solver has a stage at its
step's end; at a layer's end that stage sits on the next layer's start, and unless the
step is frozen (`itde_solvers.FrozenTime`: every evaluation of a step reads the step's own
layer) it reads the next layer's controls. The references are independent of the code
under test:

- the PyTorch float64 pre-LN encoder's own sub-blocks, `_sa_block(norm1(u)) +
  _ff_block(norm2(u))`, stepped layer by layer by a NumPy RK4 (and a NumPy Strang with Heun
  sub-steps);
- the semigroup property $\\varphi_{a,c} = \\varphi_{b,c} \\circ \\varphi_{a,b}$ for every
  $a < b < c$ on the layer grid, forward (`FlowMap`) and backward (`diffrax.diffeqsolve`
  from $c$ down to $a$), for every scheme of `tests/helpers.py`'s `LAYER_SOLVERS`;
- a scalar $y' = a_j y$ with a jump, whose solution is $y(t_1) = y(t_0) e^{\\int a}$ in
  closed form, solved forward and backward.

Compiles are shared: one model for the module; the default tier runs the schemes the
issue measured (RK4, Strang; backward RK4, whose first-same-as-last stage is what a missed
jump corrupts) at one step per layer; the whole registry at two step sizes is `slow`.
"""

import itertools

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import LAYER_SOLVERS

import itde
import itde_solvers as S
from itde.analysis import FlowMap


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The torch references here compute on tiny tensors: one torch thread (on a loaded
    2-core machine two threads synchronise on every small op, many times slower), the
    thread count restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


N, D, H, F, LAYERS = 5, 8, 2, 16, 3
GRID = range(LAYERS + 1)
TRIPLES = list(itertools.combinations(GRID, 3))  # every a < b < c on the layer grid
DEFAULT = ("rk4", "strang")  # the default tier's schemes (dt = 1): the issue's


@pytest.fixture(scope="module")
def encoder():
    """A pre-norm 3-layer PyTorch encoder in float64 whose layers differ (the encoder
    deep-copies one layer: each is moved by its own noise), a state, and the model."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        D, H, F, dropout=0.0, activation="gelu", norm_first=True, batch_first=True,
        dtype=torch.float64,
    )  # fmt: skip
    enc = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = np.random.default_rng(1).standard_normal((N, D))
    model = itde.from_torch(enc)
    assert isinstance(model.block, itde.PreNorm) and model.n_layers == LAYERS
    return enc, x, model


def _fields(layer):
    """The layer's own attention and feed-forward fields, NumPy in and out."""

    def run(block, norm, u):
        with torch.no_grad():
            v = torch.as_tensor(u[None])
            out = block(norm(v), None, None) if block == layer._sa_block else block(norm(v))
        return out[0].numpy()

    def attention(u):
        return run(layer._sa_block, layer.norm1, u)

    def feedforward(u):
        return run(layer._ff_block, layer.norm2, u)

    return attention, feedforward


def _rk4(f, u, h, n):
    for _ in range(n):
        k1 = f(u)
        k2 = f(u + h / 2 * k1)
        k3 = f(u + h / 2 * k2)
        k4 = f(u + h * k3)
        u = u + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return u


def _heun(f, u, h):
    k = f(u)
    return u + h / 2 * (k + f(u + h * k))


def _reference_layers(enc, x, scheme: str, dt: float):
    """The state at every layer boundary 0..L of a NumPy solve on the torch layers: RK4 on
    the sum of the fields, or Strang (attention half-step, feed-forward step, attention
    half-step, each a Heun step), with `dt` dividing the layer."""
    n = round(1 / dt)
    states = [np.asarray(x, np.float64)]
    for layer in enc.layers:
        a, f = _fields(layer)
        u = states[-1]
        if scheme == "rk4":
            u = _rk4(lambda v, a=a, f=f: a(v) + f(v), u, dt, n)
        else:
            for _ in range(n):
                u = _heun(a, _heun(f, _heun(a, u, dt / 2), dt), dt / 2)
        states.append(u)
    return states


def _err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


# --------------------------------------------- each layer's map against the torch layers
@pytest.mark.parametrize("scheme,solver", [("rk4", S.RK4()), ("strang", S.Strang())])
def test_one_layer_maps_and_the_whole_solve_are_the_torch_layers(encoder, scheme, solver):
    """`FlowMap(model, a, a + 1)` is layer a (it read layer a + 1 at its last stage: 0.29
    and 0.17 off for layers 0 and 1 with RK4), and `itde.solve` over [0, 3] is the
    three layers."""
    enc, x, model = encoder
    ref = _reference_layers(enc, x, scheme, 1.0)
    for a in range(LAYERS):
        got = FlowMap(model, a, a + 1, solver=solver, dt0=1.0)(jnp.asarray(ref[a]))
        assert _err(got, ref[a + 1]) < 1e-13, (scheme, a)
    whole = itde.solve(model, jnp.asarray(x), solver=solver, dt0=1.0).ys[-1]
    assert _err(whole, ref[-1]) < 1e-13


@pytest.mark.slow
@pytest.mark.parametrize("scheme,solver", [("rk4", S.RK4()), ("strang", S.Strang())])
def test_one_layer_maps_at_two_steps_per_layer(encoder, scheme, solver):
    enc, x, model = encoder
    ref = _reference_layers(enc, x, scheme, 0.5)
    for a in range(LAYERS):
        got = FlowMap(model, a, a + 1, solver=solver, dt0=0.5)(jnp.asarray(ref[a]))
        assert _err(got, ref[a + 1]) < 1e-13, (scheme, a)


# --------------------------------------------------------------- the semigroup property
def _check_semigroup(flow, u, where):
    """`flow(a, c)` is a map from the state at depth a to the state at c: for every
    a < b < c on the layer grid, flow(a, c) = flow(b, c) after flow(a, b), from the state
    the whole map has at a."""
    for a, b, c in TRIPLES:
        start = flow(0, a)(u) if a else u
        direct, composed = flow(a, c)(start), flow(b, c)(flow(a, b)(start))
        # the same steps on the same layers in the same order: equal to round-off
        assert _err(direct, composed) < 1e-12, (where, (a, b, c), _err(direct, composed))


def _run_forward(encoder, name, dt):
    _, x, model = encoder
    solver = LAYER_SOLVERS[name]()
    maps = {}

    def flow(a, c):  # one FlowMap (one compilation) per interval
        if (a, c) not in maps:
            maps[(a, c)] = FlowMap(model, a, c, solver=solver, dt0=dt)
        return maps[(a, c)]

    _check_semigroup(flow, jnp.asarray(x), f"forward {name} dt={dt}")


@pytest.mark.parametrize("name", DEFAULT)
def test_flow_maps_compose_forward(encoder, name):
    _run_forward(encoder, name, 1.0)


EVERY = [(n, dt) for n in sorted(LAYER_SOLVERS) for dt in (1.0, 0.5) if (n, dt) not in
         [(d, 1.0) for d in DEFAULT]]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name,dt", EVERY)
def test_flow_maps_compose_forward_every_scheme(encoder, name, dt):
    _run_forward(encoder, name, dt)


def _backward_map(model, solver, dt):
    """u(a) from u(c), c > a, by `diffrax.diffeqsolve` run from c down to a on the layer
    grid: the model's terms, the solver wrapped in `FrozenTime` with the model's jumps (as
    `itde.solve` wraps it forward). Constant steps of -dt from c (dt divides the layers:
    every step lands on the grid), c and a traced: one compilation for every interval."""
    jumps = model.controls.jump_times()
    frozen = S.FrozenTime(solver, jumps)
    # a pre-norm model's "paper" and "split" sub-flows are the same two fields
    terms = model.terms("split" if isinstance(solver, S.AbstractSplittingSolver) else "tangent")

    @jax.jit
    def run(c, a, u):
        sol = diffrax.diffeqsolve(
            terms, frozen, c, a, -dt, u, stepsize_controller=diffrax.ConstantStepSize(),
            max_steps=round(LAYERS / dt),
        )  # fmt: skip
        return sol.ys[-1]

    def backward(c, a):
        return lambda u: run(jnp.asarray(float(c)), jnp.asarray(float(a)), u)

    return backward


def _run_backward(encoder, name, dt):
    _, x, model = encoder
    back = _backward_map(model, LAYER_SOLVERS[name](), dt)
    # flow(a, c) goes down from c to a: composing down from c to b, then to a
    _check_semigroup(lambda a, c: back(LAYERS - a, LAYERS - c), jnp.asarray(x),
                     f"backward {name} dt={dt}")  # fmt: skip


BACKWARD = ("rk4",)  # the default tier's backward scheme (dt = 1)
EVERY_BACKWARD = [(n, dt) for n in sorted(LAYER_SOLVERS) for dt in (1.0, 0.5)
                  if (n, dt) not in [(d, 1.0) for d in BACKWARD]]  # fmt: skip


@pytest.mark.parametrize("name", BACKWARD)
def test_flow_maps_compose_backward(encoder, name):
    """From c down to a equals from c down to b, then down to a: every backward step reads
    the layer it crosses (before the fix, the first-same-as-last stage was reused across a
    layer boundary going down)."""
    _run_backward(encoder, name, 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name,dt", EVERY_BACKWARD)
def test_flow_maps_compose_backward_every_scheme(encoder, name, dt):
    _run_backward(encoder, name, dt)


# ------------------------------------------------- a scalar jump, in closed form, both ways
RATES = (1.0, -2.0)  # y' = a_j y on [j, j + 1): y(2) = y(0) e^{a_0 + a_1}


def _piecewise(t, y, args):
    a = jnp.asarray(RATES, y.dtype)
    return a[jnp.clip(jnp.floor(t), 0, len(RATES) - 1).astype(int)] * y


def _scalar_solve(solver, t0, t1, y0, n_steps):
    ts = jnp.asarray(np.linspace(t0, t1, n_steps + 1))
    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(_piecewise), S.FrozenTime(solver, jump_ts=(1.0,)), t0, t1, None,
        jnp.asarray(y0), stepsize_controller=diffrax.StepTo(ts=ts), max_steps=n_steps,
    )  # fmt: skip
    return float(sol.ys[-1])


E = np.exp(-sum(RATES))  # y(0) when y(2) = 1: e


@pytest.mark.parametrize(
    "solver,tol", [(diffrax.Dopri8(), 2e-9), (diffrax.Tsit5(), 2e-5)], ids=["dopri8", "tsit5"]
)
def test_frozen_time_backward_through_a_jump_is_exact(solver, tol):
    """Backward from y(2) = 1 down to 0 in steps of 1/4: y(0) = e^{-(a_0 + a_1)} = e, to the
    method's accuracy (measured 1e-10 for Dopri8, 2e-6 for Tsit5), as forward. Before the
    fix a backward FrozenTime(Dopri8) was 2% off: the jump was looked for in diffrax's
    reversed time, so the first-same-as-last stage carried the field across it."""
    assert abs(_scalar_solve(solver, 2.0, 0.0, 1.0, 8) - E) / E < tol
    assert abs(_scalar_solve(solver, 0.0, 2.0, E, 8) - 1.0) < tol


def test_frozen_rk4_backward_is_its_stability_polynomial_per_piece():
    """RK4 on $y' = a y$ multiplies by $R(ha) = 1 + z + z^2/2 + z^3/6 + z^4/24$ per step
    ($z = ha$, $h < 0$ going down): from 2 down to 0 in steps of 1/4, exactly
    $R(-a_1/4)^4 R(-a_0/4)^4$ when every step reads its own piece."""

    def R(z):
        return 1 + z + z**2 / 2 + z**3 / 6 + z**4 / 24

    exact = R(-RATES[1] / 4) ** 4 * R(-RATES[0] / 4) ** 4
    assert abs(_scalar_solve(S.RK4(), 2.0, 0.0, 1.0, 8) - exact) < 1e-14 * exact
    forward = R(RATES[0] / 4) ** 4 * R(RATES[1] / 4) ** 4
    assert abs(_scalar_solve(S.RK4(), 0.0, 2.0, 1.0, 8) - forward) < 1e-14


# ------------------------------------------------ a FrozenTime the caller wraps in solve
def test_a_users_frozen_time_gets_the_models_jumps(encoder):
    """`FrozenTime(RK4())` without jumps, or with jumps that are not the layers' (0.5,
    1.5), is the plain solver (and the torch layers' RK4) in `itde.solve`: the model's
    jumps are added to the wrapper's. Before, the wrapper was left without them, and the
    first-same-as-last stage carried layer n's field into layer n + 1 (600x the error)."""
    enc, x, model = encoder
    dt = 1 / 8
    ref = _reference_layers(enc, x, "rk4", dt)[-1]
    for solver in (S.FrozenTime(S.RK4()), S.FrozenTime(S.RK4(), jump_ts=(0.5, 1.5))):
        got = itde.solve(model, jnp.asarray(x), solver=solver, dt0=dt).ys[-1]
        assert _err(got, ref) < 1e-12, solver.jump_ts


def test_frozen_time_refuses_jumps_that_are_no_depths():
    for bad in ((float("nan"),), (1.0, float("inf"))):
        with pytest.raises(ValueError, match=r"`FrozenTime\(jump_ts=...\)` has the non-finite"):
            S.FrozenTime(S.RK4(), jump_ts=bad)
    with pytest.raises(TypeError, match=r"`FrozenTime\(jump_ts=...\)` must be a sequence of real"):
        S.FrozenTime(S.RK4(), jump_ts=("one",))
    # held sorted, without repeats, whatever sequence it was given as
    assert S.FrozenTime(S.RK4(), jump_ts=np.array([2.0, 1.0, 2.0])).jump_ts == (1.0, 2.0)


# --------------------------------------------------- fits through layers know the block
def test_fits_through_a_pre_norm_network_take_its_block_form(encoder):
    """A pre-norm network reads its norms at the layer starts. The fit takes the block
    form from the model (a post-norm default fitted the norms at the ends: 2.57 off), and
    refuses bare controls without `block`; solved by Lie at one step per layer the fit is
    the torch network."""
    enc, x, model = encoder
    with torch.no_grad():
        y = enc(torch.as_tensor(x[None]))[0].numpy()
    fit = itde.LegendreControls.from_layers(model)
    smooth = itde.TransformerIDE(fit, model.grid, block=model.block)
    assert _err(itde.solve(smooth, jnp.asarray(x), dt0=1.0).ys[-1], y) < 1e-12
    assert max(itde.fit_residuals(fit, model).values()) < 1e-13
    spline = itde.SplineControls.from_layers(model, 1)
    assert max(itde.fit_residuals(spline, model).values()) < 1e-13
    for make in (itde.LegendreControls.from_layers, itde.SplineControls.from_layers):
        with pytest.raises(TypeError, match=r"needs the block form.*block=m\.block"):
            make(model.controls)
        with pytest.raises(ValueError, match=r"block form is PreNorm, and `block`='post_norm'"):
            make(model, block="post_norm")
    with pytest.raises(TypeError, match=r"`fit_residuals\(per_layer=...\)` needs the block"):
        itde.fit_residuals(fit, model.controls)
