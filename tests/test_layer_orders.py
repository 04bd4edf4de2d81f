"""Fixed-step solvers keep their order on per-layer (piecewise-constant) controls.

The reference is independent of the code under test: a PyTorch float64 pre-LN encoder's
own sub-blocks (`_sa_block(norm1(u))`, `_ff_block(norm2(u))`) as the vector field of each
layer, integrated layer by layer with SciPy's DOP853 at tolerance 1e-13.
"""

import diffrax
import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy.integrate import solve_ivp

import itde
import itde_solvers as S


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


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        D, H, F, dropout=0.0, activation="gelu", norm_first=True, batch_first=True,
        dtype=torch.float64,
    )  # fmt: skip
    enc = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval()
    with torch.no_grad():  # distinct layers (the encoder deep-copies one): the jumps matter
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = np.random.default_rng(1).standard_normal((N, D))
    return enc, x


def _reference(enc, x) -> np.ndarray:
    """u(T) of u_t = A_n(N1 u) + F_n(N2 u) on [n, n + 1), by DOP853 layer by layer."""
    u = x.reshape(-1)
    for layer in enc.layers:

        def field(t, y, layer=layer):
            v = torch.as_tensor(y.reshape(1, N, D))
            with torch.no_grad():
                a = layer._sa_block(layer.norm1(v), None, None)
                f = layer._ff_block(layer.norm2(v))
            return (a + f).numpy().reshape(-1)

        sol = solve_ivp(field, (0.0, 1.0), u, method="DOP853", rtol=1e-13, atol=1e-13)
        assert sol.success
        u = sol.y[:, -1]
    return u.reshape(N, D)


@pytest.fixture(scope="module")
def reference(encoder):
    return _reference(*encoder)


# (solver, its order, the depth steps): coarser steps for the high orders so that the
# errors stay far above the reference's 1e-13
SOLVERS = [
    (diffrax.Heun(), 2, (1 / 4, 1 / 8, 1 / 16)),
    pytest.param(diffrax.Midpoint(), 2, (1 / 4, 1 / 8, 1 / 16), marks=pytest.mark.slow),
    pytest.param(diffrax.Bosh3(), 3, (1 / 16, 1 / 32, 1 / 64), marks=pytest.mark.slow),
    (S.RK4(), 4, (1 / 4, 1 / 8, 1 / 16)),
    (diffrax.Tsit5(), 5, (1 / 4, 1 / 8, 1 / 16)),
    pytest.param(diffrax.Dopri5(), 5, (1 / 4, 1 / 8, 1 / 16), marks=pytest.mark.slow),
    # Strang's sub-flows read the same frozen clock; its order is also in test_solvers_splitting
    pytest.param(S.Strang(), 2, (1 / 4, 1 / 8, 1 / 16), marks=pytest.mark.slow),
]


@eqx.filter_jit
def _constant_steps(model, x, solver, h):
    """u(T) by constant steps h (a traced argument: one program serves every step size;
    each h divides the layers, so the steps land on every boundary)."""
    return itde.solve(model, x, solver=solver, dt0=h, max_steps=LAYERS * 64,
                      stepsize_controller=diffrax.ConstantStepSize()).ys[-1]  # fmt: skip


@pytest.mark.parametrize("solver,order,steps", SOLVERS, ids=lambda s: type(s).__name__)
def test_fixed_step_order_on_per_layer_controls(encoder, reference, solver, order, steps):
    """The step sizes in one compiled program (constant steps, the step a traced value);
    the default grid (`StepTo`, one program per step size) is the same steps, solved in
    the tests of one step per layer here and in tests/test_flow_maps.py."""
    enc, x = encoder
    model = itde.from_torch(enc)
    assert model.n_layers == LAYERS
    errors = [
        float(np.max(np.abs(np.asarray(_constant_steps(model, jnp.asarray(x), solver,
                                                       jnp.asarray(h))) - reference)))
        for h in steps
    ]  # fmt: skip
    rates = np.log2(np.asarray(errors[:-1]) / np.asarray(errors[1:]))
    assert np.all(rates > order - 0.35), (errors, rates)


def test_adaptive_solve_matches_the_reference(encoder, reference):
    enc, x = encoder
    model = itde.from_torch(enc)
    sol = itde.solve(
        model, jnp.asarray(x), solver=diffrax.Tsit5(), dt0=0.1,
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
    )  # fmt: skip
    assert float(np.max(np.abs(np.asarray(sol.ys[-1]) - reference))) < 1e-8


def test_one_step_per_layer_is_still_the_network(encoder):
    enc, x = encoder
    model = itde.from_torch(enc)
    with torch.no_grad():
        y = enc(torch.as_tensor(x[None]))[0].numpy()
    assert float(np.max(np.abs(np.asarray(model(jnp.asarray(x))) - y))) < 1e-12


# ---------------------------------------------------------------- FrozenTime, generic
def _scalar_problem(rates):
    """y' = a_j y on [j, j + 1): exact solution exp(sum a_j)."""
    a = jnp.asarray(rates)

    def field(t, y, args):
        j = jnp.clip(jnp.floor(t), 0, len(rates) - 1).astype(int)
        return a[j] * y

    return diffrax.ODETerm(field), float(np.exp(np.sum(rates)))


@eqx.filter_jit
def _scalar_constant_steps(term, solver, h):
    """y(3) from y(0) = 1 by constant steps h (traced: one program for every h)."""
    sol = diffrax.diffeqsolve(
        term, solver, 0.0, 3.0, h, jnp.asarray(1.0),
        stepsize_controller=diffrax.ConstantStepSize(), max_steps=3 * 16,
    )  # fmt: skip
    return sol.ys[-1]


@pytest.mark.parametrize("frozen", [True, False])
def test_frozen_time_keeps_rk4_order_on_a_piecewise_constant_field(frozen):
    term, exact = _scalar_problem([1.0, -2.0, 0.5])
    errors = []
    for h in (1 / 4, 1 / 8, 1 / 16):  # binary fractions: the steps land on the jumps exactly
        solver = S.FrozenTime(S.RK4(), jump_ts=(1.0, 2.0)) if frozen else S.RK4()
        y = _scalar_constant_steps(term, solver, jnp.asarray(h))
        errors.append(abs(float(y) - exact))
    rates = np.log2(np.asarray(errors[:-1]) / np.asarray(errors[1:]))
    if frozen:
        assert np.all(rates > 3.7), (errors, rates)
    else:  # the bug it fixes: a stage on the next piece makes RK4 first order
        assert np.all(rates < 1.5), (errors, rates)


def test_frozen_time_is_told_of_a_jump_for_first_same_as_last():
    """Tsit5 reuses f at the end of a step as the next step's first stage; after a jump
    that value belongs to the old piece."""
    term, exact = _scalar_problem([1.0, -2.0, 0.5])
    ts = jnp.asarray(np.linspace(0.0, 3.0, 13))

    def error(jump_ts):
        sol = diffrax.diffeqsolve(
            term, S.FrozenTime(diffrax.Tsit5(), jump_ts=jump_ts), 0.0, 3.0, None,
            jnp.asarray(1.0), stepsize_controller=diffrax.StepTo(ts=ts), max_steps=len(ts),
        )  # fmt: skip
        return abs(float(sol.ys[-1]) - exact) / exact

    assert error((1.0, 2.0)) < 1e-4
    assert error(()) > 1e-3  # the old piece's field reused after the jump
