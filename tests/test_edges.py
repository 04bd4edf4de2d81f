"""Edges of the API named by the bad-input issue: each a clear error naming the argument
and the fix instead of a silent wrong answer or a message from deep inside diffrax."""

import subprocess
import sys

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import itde
import itde_solvers as S


def test_adaptive_controller_with_a_solver_without_an_error_estimate():
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=2, n_features=8, n_heads=2)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    pid = diffrax.PIDController(rtol=1e-4, atol=1e-4)
    for solver in (S.LieTrotter(), S.Strang(), S.Projected(diffrax.Euler())):
        with pytest.raises(ValueError, match=r"`stepsize_controller`=PIDController .* makes "
                           r"none.*HalfSolver"):  # fmt: skip
            itde.solve(m, x, solver=solver, stepsize_controller=pid)
    # an estimate, through a wrapper: accepted
    half = diffrax.HalfSolver(S.LieTrotter())
    itde.solve(m, x, solver=half, terms="paper", stepsize_controller=pid, dt0=0.5)


SCRIPT = """
import torch, transformers, itde
torch.manual_seed(0)
config = transformers.BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=8)
model = transformers.BertModel(config, add_pooling_layer=False).double().eval()
for convert in (lambda: itde.from_hf(model),
                lambda: itde.from_torch(torch.nn.TransformerEncoderLayer(
                    8, 2, 8, batch_first=True, dtype=torch.float64))):
    try:
        convert()
        print("converted")
    except ValueError as e:
        print("refused:", e)
"""


def test_float64_models_are_refused_without_jax_x64():
    """The suite runs with x64 on (conftest), so the check runs in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
        env={"JAX_ENABLE_X64": "0", "PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    lines = [line for line in out.stdout.splitlines() if line]
    assert len(lines) == 2, out.stdout + out.stderr
    for line, name in zip(lines, ("`model`", "`module`"), strict=True):
        assert line.startswith("refused:") and name in line and "jax_enable_x64" in line, line


def test_float64_models_convert_with_x64():
    import torch

    layer = torch.nn.TransformerEncoderLayer(8, 2, 8, batch_first=True, dtype=torch.float64)
    assert itde.from_torch(layer).controls.blocks.attention.wq.dtype == jnp.float64


def test_config_keys_that_do_not_fit_are_named(tmp_path):
    from itde import ConfigError
    from itde._internal import from_dict
    from itde.cli._internal import SolveExperiment
    from itde.studies._internal import ConvergeExperiment

    with pytest.raises(ConfigError, match=r"`model.n_features`=32 does not fit "
                       r"`grid.features`='simpson'.*n=33"):  # fmt: skip
        from_dict(SolveExperiment, {"model": {"n_features": 32}, "grid": {"features": "simpson"}})
    for bad in (float("nan"), float("inf"), -0.1):
        with pytest.raises(ConfigError, match=r"`problem.amplitude` must be a finite number"):
            from_dict(ConvergeExperiment, {"problem": {"amplitude": bad}})


def test_roberta_length_limit_names_the_right_numbers():
    import torch
    import transformers as tf

    torch.manual_seed(0)
    config = tf.RobertaConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=8,
                              max_position_embeddings=16, pad_token_id=1)  # fmt: skip
    m = itde.from_hf(tf.RobertaModel(config, add_pooling_layer=False).double().eval())
    assert m.max_tokens == 14
    m(jnp.full((14,), 5))  # the longest sequence it takes
    with pytest.raises(ValueError, match=r"15 tokens, more than the 14 this RobertaModel takes "
                       r"\(config.max_position_embeddings = 16, 2 of whose rows are reserved"):
        m(jnp.full((15,), 5))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_overflowing_state_is_named_not_nan(dtype):
    """Inputs of magnitude 1e20-1e30 in float32/bfloat16 used to give an all-NaN output with
    no error: the solve says the state overflowed and why; below the threshold it is
    finite."""
    import equinox as eqx

    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=2, n_features=8, n_heads=2)
    m = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, m)
    x = jax.random.normal(jax.random.key(1), (4, 8)).astype(dtype)
    for scale in (1e20, 1e30):
        with pytest.raises(eqx.EquinoxRuntimeError, match=rf"overflowed \({jnp.dtype(dtype)}\)"
                           r".*above 1.8e\+19.*Scale `u0` down"):  # fmt: skip
            jax.block_until_ready(itde.solve(m, x * jnp.asarray(scale, dtype)).ys)
    assert jnp.all(jnp.isfinite(itde.solve(m, x * jnp.asarray(1e3, dtype)).ys))


def test_state_that_diverges_from_a_finite_start_is_named():
    """Weights large enough to overflow inside the solve: the message says the dynamics
    overflowed (not the data) and names the learning rate as a likely cause."""
    import equinox as eqx

    m = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=2, n_features=8, n_heads=2, block=itde.PreNorm()
    )  # pre-norm: nothing projects the residual stream back
    m = jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, m)
    ff = m.controls.values.feedforward
    big = eqx.tree_at(lambda m: (m.controls.values.feedforward.w1,
                                 m.controls.values.feedforward.w2), m,
                      (ff.w1 * 1e20, ff.w2 * 1e20))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (4, 8), jnp.float32)
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"during the solve although `u0` is "
                       r"finite.*lower the learning rate"):  # fmt: skip
        jax.block_until_ready(itde.solve(big, x).ys)


def test_a_concrete_integer_mask_captured_inside_jit():
    """A NumPy 0/1 mask closed over by a jitted function raised TracerBoolConversionError
    (its 0/1 check was staged); it is checked on the host and works."""
    import numpy as np

    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=8, n_heads=2)
    x = jax.random.normal(jax.random.key(1), (3, 8))
    mask = np.array([1, 1, 0])
    got = jax.jit(lambda u: m(u, mask))(x)
    assert jnp.allclose(got[:2], m(x, jnp.array([True, True, False]))[:2])


def test_nan_input_under_jit_of_vmap_is_named_in_both_jits():
    """`jax.jit(jax.vmap(...))` of a batch with one NaN: JAX wraps the check's message in
    a `CpuCallback error`, but the message is in it, on a line of its own; under
    `eqx.filter_jit` (what the docstring recommends) it is the exception's message."""
    import equinox as eqx

    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=8, n_heads=2)
    x = jnp.ones((3, 5, 8)).at[1, 2, 3].set(jnp.nan)

    def f(u):
        return itde.solve(m, u).ys[-1]

    said = "itde.solve: the initial state `u0` has a NaN or infinite entry"
    with pytest.raises(Exception) as e:
        jax.block_until_ready(jax.jit(jax.vmap(f))(x))
    assert "CpuCallback" in str(e.value)
    assert any(line.split("Error: ", 1)[-1].startswith(said) for line in str(e.value).splitlines())
    with pytest.raises(eqx.EquinoxRuntimeError, match=said):
        jax.block_until_ready(eqx.filter_jit(jax.vmap(f))(x))
    assert "jax.jit" in itde.solve.__doc__ and "CpuCallback" in itde.solve.__doc__


def test_solve_returns_the_state_before_the_final_norm_as_documented():
    """`itde.solve` is the equation's state; the model's `final_norm` is applied by calling
    the model (GPT-2's `ln_f` was 3.09 away from `last_hidden_state` with no word of it):
    the docstring and the README say so, and it is so."""
    from pathlib import Path

    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=2, n_features=8, n_heads=2,
                                 block=itde.PreNorm(), final_norm=True)  # fmt: skip
    u = jax.random.normal(jax.random.key(1), (5, 8))
    state = itde.solve(m, u).ys[-1]
    assert jnp.max(jnp.abs(m(u) - m.final_norm(state))) < 1e-5
    assert jnp.max(jnp.abs(m(u) - state)) > 0.1  # the norm is not a no-op here
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    said = "model(u0) == model.final_norm(itde.solve(model, u0).ys[-1])"
    assert said in readme and "`final_norm`" in itde.solve.__doc__


@pytest.mark.slow
def test_adaptive_steps_on_float32_layers_with_float64_enabled():
    """A float32 per-layer model under an adaptive controller with float64 enabled (as in
    this suite): the layer boundaries go to diffrax in the solve's float32 time dtype (as
    float64 `jump_ts` they failed diffrax's dtype check) and the steps land on them."""
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=2, n_features=4, n_heads=1)
    m32 = jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, m)
    x = jax.random.normal(jax.random.key(1), (3, 4), jnp.float32)
    pid = diffrax.PIDController(rtol=1e-3, atol=1e-3)
    sol = itde.solve(m32, x, solver=S.Projected(diffrax.Heun()), terms="paper",
                     stepsize_controller=pid, dt0=1.0)  # fmt: skip
    assert sol.ys.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(sol.ys)))
    assert sol.ts.dtype == jnp.float32 and float(sol.ts[-1]) == 2.0


def test_adaptive_controller_gets_the_layer_boundaries_in_the_time_dtype():
    """The cheap half of the test above (no solve): the clip controller's `jump_ts` are in
    the solve's time dtype, float32 for a float32 state though float64 is enabled."""
    from itde._internal import _step_grid

    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=3, n_features=4, n_heads=1)
    pid = diffrax.PIDController(rtol=1e-3, atol=1e-3)
    for tdtype in (jnp.float32, jnp.float64):
        ctrl = _step_grid(m.controls, 0.0, 3.0, 1.0, pid, None, None, tdtype)[0]
        assert isinstance(ctrl, diffrax.ClipStepSizeController)
        assert ctrl.jump_ts.dtype == tdtype and list(ctrl.jump_ts) == [1.0, 2.0]
