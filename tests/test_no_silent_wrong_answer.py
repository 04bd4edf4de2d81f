"""Inputs that used to give a wrong answer without a word now give the right answer or a
clear error (each test here failed before the fix)."""

import warnings

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import itde
import itde.cli
from itde._internal import _config
from itde.cli._internal import SolveExperiment
from itde.studies._internal import ConvergeExperiment

KEY = jax.random.PRNGKey(0)


def _model(n_layers=3, d=8, **kw):
    return itde.TransformerIDE.init(KEY, n_layers=n_layers, n_features=d, n_heads=2, n_hidden=16,
                                    dtype=jnp.float64, **kw)  # fmt: skip


def _x(n=5, d=8):
    return jax.random.normal(jax.random.PRNGKey(1), (n, d), jnp.float64)


def _one_layer(model, n):
    """Layer `n` of `model` as a one-layer model."""
    v = jax.tree.map(lambda a: a[n : n + 1], model.controls.values)
    return itde.TransformerIDE(itde.PiecewiseConstant(v), model.grid)


# ------------------------------------------------------------------ 1. steps vs layers
def test_depth_step_longer_than_a_layer_is_an_error():
    m, x = _model(), _x()
    for dt0 in (2, 1e6):
        with pytest.raises(ValueError, match=r"`dt0`=.* longer than one layer .*depth length 1"):
            itde.solve(m, x, dt0=dt0)


def test_every_layer_is_used_and_no_step_mixes_two_layers():
    """dt0 = 0.3 does not divide a layer: the grid restarts at each boundary, so the solve
    equals three one-layer solves in sequence (an independent composition), and zeroing
    the middle layer changes the answer (before: dt0 = 2 never evaluated it)."""
    m, x = _model(), _x()
    got = itde.solve(m, x, dt0=0.3).ys[-1]
    u = x
    for n in range(3):
        u = itde.solve(_one_layer(m, n), u, dt0=0.3).ys[-1]
    np.testing.assert_allclose(got, u, rtol=0, atol=1e-12)
    zeroed = eqx.tree_at(lambda mm: mm.controls.values.feedforward.w2,
                         m, m.controls.values.feedforward.w2.at[1].set(0.0))  # fmt: skip
    assert float(jnp.max(jnp.abs(itde.solve(zeroed, x, dt0=0.3).ys[-1] - got))) > 1e-3


def test_constant_steps_must_divide_the_layer():
    m, x = _model(), _x()
    with pytest.raises(ValueError, match=r"`dt0`=0.3 does not divide the layers' depth length"):
        itde.solve(m, x, dt0=0.3, stepsize_controller=diffrax.ConstantStepSize())
    a = itde.solve(m, x, dt0=0.5, stepsize_controller=diffrax.ConstantStepSize()).ys[-1]
    b = itde.solve(m, x, dt0=0.5).ys[-1]
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


def test_stepto_grid_must_hold_the_layer_boundaries():
    m, x = _model(), _x()
    with pytest.raises(ValueError, match=r"lacks the layer boundaries \[1.0"):
        itde.solve(m, x, stepsize_controller=diffrax.StepTo(ts=jnp.array([0.0, 1.5, 3.0])))


def test_cli_solve_refuses_a_step_longer_than_a_layer(tmp_path, capsys):
    cfg = tmp_path / "dt2.toml"
    cfg.write_text("[solve]\ndt = 2.0\n")
    assert itde.cli.main(["solve", "--config", str(cfg), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "`solve.dt`=2.0 is longer than one layer" in err and "dt2.toml" in err
    assert not (tmp_path / "o" / "summary.json").exists()


# ------------------------------------------------------------------ 2. t1 past the depth
def test_t1_past_the_depth_is_an_error_and_t1_inside_is_honoured():
    m, x = _model(n_layers=2), _x()
    with pytest.raises(ValueError, match=r"`t1`=10.0 is past the depth T=2.0"):
        itde.solve(m, x, t1=10)
    # t1 = 1 on a 2-layer model = the first layer alone
    np.testing.assert_allclose(itde.solve(m, x, t1=1).ys[-1], _one_layer(m, 0)(x), atol=1e-12)


# ------------------------------------------------------------------ 3. typed static options
def test_to_torch_refuses_a_window_by_name():
    """PyTorch's encoder layer attends to every token: a windowed model would be written
    as another network."""
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=8, n_heads=2,
                                 window=itde.SlidingWindow(2.0))  # fmt: skip
    with pytest.raises(ValueError, match=r"attends within SlidingWindow\(length=2.0\)"):
        itde.to_torch(m)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(causal="false"), r"`causal`='false' must be True or False"),
        (dict(causal=1), r"`causal`=1 must be True or False"),
        (dict(block="relax"), r"`block`='relax' must be an itde block form"),
        (dict(attention_core="flash"), r"`attention_core`='flash' must be an itde attention"),
        (dict(attention_core=itde.Dense), r"`attention_core`=.*must be an itde attention"),
        (dict(batch_axis=2), r"`batch_axis`=2 must be 0"),
    ],
)
def test_static_options_are_type_checked(kwargs, match):
    m = _model(n_layers=1)
    with pytest.raises((TypeError, ValueError), match=match):
        itde.TransformerIDE(m.controls, m.grid, **kwargs)


def test_init_and_from_torch_check_causal():
    with pytest.raises(TypeError, match=r"`causal`='false' must be True or False"):
        _model(n_layers=1, causal="false")
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    with pytest.raises(TypeError, match=r"`causal`='no' must be True or False"):
        itde.from_torch(layer, causal="no")


# ------------------------------------------------------------------ 4. zero variance
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("value", [0.7, 0.1, -3.3])
def test_constant_token_is_refused_with_eps_zero_whatever_its_value(value, dtype):
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, eps=0.0)
    u = jnp.full((2, 8), value, dtype).at[0].set(jnp.arange(8.0, dtype=dtype))
    with pytest.raises(Exception, match="zero feature variance up to round-off"):
        jax.block_until_ready(norm(u))


def test_small_but_real_variance_is_projected():
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, eps=0.0)
    u = 0.7 + 1e-6 * jax.random.normal(KEY, (3, 8), jnp.float64)
    p = norm(u)
    np.testing.assert_allclose(jnp.var(p, axis=-1), 1.0, atol=1e-9)


# ------------------------------------------------------------------ 5. seeds
@pytest.mark.parametrize("seed", [-1, 2**32, 2**63 - 1])
def test_seeds_outside_32_bits_are_config_errors(seed):
    with pytest.raises(_config.ConfigError, match=r"`model.seed`=.* must be an integer in \[0, "):
        _config.from_dict(SolveExperiment, {"model": {"seed": seed}})
    with pytest.raises(_config.ConfigError, match=r"`problem.seed`="):
        _config.from_dict(ConvergeExperiment, {"problem": {"seed": seed}})


# ------------------------------------------------------------------ 6. batch layout
@pytest.mark.parametrize("batch_first", [True, False])
def test_from_torch_records_the_batch_layout(batch_first):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first,
                                             dtype=torch.float64).eval()  # fmt: skip
    m = itde.from_torch(layer)
    assert m.batch_axis == (0 if batch_first else 1)
    x = torch.randn(3, 5, 8, dtype=torch.float64)  # [batch, tokens, d] or [tokens, batch, d]
    with torch.no_grad():
        ref = layer(x).numpy()
    got = np.asarray(m.batch(jnp.asarray(x.numpy())))
    np.testing.assert_allclose(got, ref, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right axes: no warning
        vm = jax.vmap(m, in_axes=m.batch_axis, out_axes=m.batch_axis)(jnp.asarray(x.numpy()))
    np.testing.assert_allclose(vm, ref, atol=1e-12)
    if not batch_first:  # the common slip: jax.vmap(m) of [tokens, batch, d] maps the tokens
        with pytest.warns(UserWarning, match=r"batch_first=False.*mapped axis 0.*m\.batch"):
            jax.vmap(m)(jnp.asarray(x.numpy()))


# ------------------------------------------------------------------ found by an adversarial run
def test_options_that_were_silently_misread():
    with pytest.raises(TypeError, match=r"`bias`='yes' must be True or False"):
        _model(n_layers=1, bias="yes")
    with pytest.raises(ValueError, match=r"`n`=5 is not a layer: the model has 3"):
        _model().controls.layer(5)  # JAX would clamp the index to the last layer
    with pytest.raises(TypeError, match=r"must be a pair of numbers"):
        itde.Midpoint(interval="01")
    assert itde.Midpoint(interval=[0, 2]).interval == (0.0, 2.0)


def test_no_constraint_set_without_a_positive_sigma2():
    with pytest.raises(ValueError, match=r"`sigma2`=-1.0 must be > 0"):
        itde.LayerNormProjection(sigma2=-1.0)
    with pytest.raises(ValueError, match=r"`sigma2`=\(0, 0\) must keep sigma2\(t\) > 0"):
        itde.LegendreControls.init(KEY, n_modes=2, n_features=8, n_heads=2, n_hidden=8,
                                   sigma2=(0, 0))  # fmt: skip


def test_token_ids_outside_the_vocabulary_are_refused():
    from itde import train

    cfg = train.from_dict(train.TrainExperiment, {
        "model": {"n_layers": 1, "n_features": 8, "n_heads": 2, "n_hidden": 8}})  # fmt: skip
    model = train.build_model(cfg, KEY)
    vocab = model.embedding.shape[0]
    with pytest.raises(ValueError, match=rf"ids must be in \[0, {vocab - 1}\]"):
        train.predict(model, jnp.full((1, 4), vocab, jnp.int32))  # a gather would clamp it
    with pytest.raises(TypeError, match=r"must be integers"):
        train.predict(model, jnp.zeros((1, 4), jnp.float32))


def test_learning_rate_cannot_end_above_its_peak():
    from itde import train

    with pytest.raises(_config.ConfigError, match=r"`optim.final_lr_ratio`=2.0 must be in"):
        train.from_dict(train.TrainExperiment, {"optim": {"final_lr_ratio": 2.0}})


def test_empty_out_flag_is_an_error_not_ignored(tmp_path, capsys):
    assert itde.cli.main(["solve", "--out", ""]) == 2
    assert "`--out` is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "bias",
    [
        lambda: itde.ALiBi.init(2),
        lambda: itde.T5RelativeBias.init(jax.random.key(0), 2),
        lambda: itde.DiscreteBias(jnp.ones((2, 4, 4))),
    ],
)
def test_to_torch_refuses_a_score_bias_by_name(bias):
    """nn.TransformerEncoderLayer adds no bias to its scores: a converted module would
    compute another network (0.14-0.70 away), so the conversion refuses it."""
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=8, n_heads=2)
    b = bias()
    with pytest.raises(ValueError, match=f"score bias \\({type(b).__name__}\\)"):
        itde.to_torch(eqx.tree_at(lambda x: x.score_bias, m, b, is_leaf=lambda x: x is None))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rope_base=0.0), r"`rope_base`=0.0 must be a positive finite number"),
        (dict(rope_base=float("inf")), r"`rope_base`=inf must be a positive finite number"),
        (dict(rope_base=10000.0, head_dim=5), r"`rope_base` needs an even head size.*is 5"),
    ],
)
def test_init_names_rope_base_not_the_internal_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=8, n_heads=2, **kwargs)


def test_save_times_outside_the_depth_interval_are_named_before_the_solve():
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=2, n_features=8, n_heads=2)
    u = jax.random.normal(jax.random.key(1), (3, 8))
    with pytest.raises(ValueError, match=r"depths \[2.5\] outside.*\[0.0, 2.0\]"):
        itde.solve(m, u, saveat=diffrax.SaveAt(ts=[0.0, 1.0, 2.5]))
    ys = itde.solve(m, u, saveat=diffrax.SaveAt(ts=[0.0, 1.0, 2.0])).ys
    np.testing.assert_allclose(ys[-1], m(u), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("layer", "said"),
    [
        ({"dim_feedforward": 64}, r"layer 1 differs from layer 0 at `feedforward.w1` \(shape"),
        ({"activation": "gelu"}, r"layer 1 differs from layer 0 at `feedforward.activation`"),
    ],
)
def test_from_torch_names_the_layer_and_field_of_a_mixed_encoder(layer, said):
    """An encoder whose layers differ (a later `dim_feedforward` or activation) used to list
    twenty shapes: `from_torch` names the layer and the field."""
    import torch

    args = {"d_model": 16, "nhead": 2, "dim_feedforward": 32, "batch_first": True}
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**args), 2)
    enc.layers[1] = torch.nn.TransformerEncoderLayer(**{**args, **layer})
    with pytest.raises(ValueError, match=said):
        itde.from_torch(enc)


def test_sample_filters_at_temperature_zero_are_refused(tmp_path, capsys):
    """`itde sample --temperature 0 --top-k 5` would draw greedily and ignore the filter:
    refused before the checkpoint is read (one line, exit 2), as `HFCausalLM.generate`
    refuses it."""
    for flags in (["--top-k", "5"], ["--top-p", "0.9"]):
        argv = ["sample", "--checkpoint", str(tmp_path / "none"), "--temperature", "0", *flags]
        assert itde.cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "at `--temperature`=0 would be ignored" in err and "holds no checkpoint" not in err
        assert len(err.strip().splitlines()) == 1, err


def test_sampling_a_model_refuses_filters_at_temperature_zero():
    """`itde.train.sample` (and `sample_stream`) at temperature 0 with a filter: refused,
    naming the CLI's flags, before any draw."""
    from itde.train import TASKS, TrainExperiment, from_dict, sample, sample_stream

    cfg = from_dict(TrainExperiment, {
        "task": {"name": "charlm", "context": 8},
        "model": {"n_layers": 1, "n_features": 8, "n_heads": 2, "n_hidden": 8},
    })  # fmt: skip
    task = TASKS["charlm"](cfg.task)
    model = task.init_model(cfg.model, jax.random.key(3), dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"`--top-k`=3, `--top-p`=1.0 at `--temperature`=0"):
        sample(model, task.itos, "ab", 4, temperature=0.0, top_k=3)
    with pytest.raises(ValueError, match=r"`--top-p`=0.5 at `--temperature`=0"):
        next(iter(sample_stream(model, task.itos, "ab", 4, temperature=0.0, top_p=0.5)))
