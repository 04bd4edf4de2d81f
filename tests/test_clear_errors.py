"""Failures that used to be raw tracebacks (or misleading) are clear errors that name the
argument, its value and the fix."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import itde
import itde.cli

KEY = jax.random.PRNGKey(0)


@pytest.fixture(scope="module")
def model():
    return itde.TransformerIDE.init(KEY, n_layers=2, n_features=8, n_heads=2, n_hidden=16,
                                    dtype=jnp.float64)  # fmt: skip


@pytest.fixture(scope="module")
def smooth():
    c = itde.LegendreControls.init(KEY, n_modes=2, n_features=8, n_heads=2, n_hidden=8,
                                   dtype=jnp.float64)  # fmt: skip
    return itde.TransformerIDE(c, itde.Grid.unit(8))


X = jax.random.normal(KEY, (5, 8), jnp.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_convert_both_ways(dtype):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, dtype=dtype)
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    m = itde.from_torch(enc)
    expected = {torch.float16: jnp.float16, torch.bfloat16: jnp.bfloat16}[dtype]
    assert m.controls.values.attention.wq.dtype == expected
    back = itde.to_torch(m)
    for (k, a), (kb, b) in zip(enc.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == kb and a.dtype == b.dtype and torch.equal(a, b), k


def test_to_torch_refuses_what_pytorch_cannot_hold(smooth):
    with pytest.raises(TypeError, match=r"needs per-layer \(PiecewiseConstant\) controls"):
        itde.to_torch(smooth)
    with pytest.raises(TypeError, match=r"needs an itde.TransformerIDE, got dict"):
        itde.to_torch({})


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(dt0="abc"), TypeError, r"`dt0`='abc' must be a number, not str"),
        (dict(dt0=-1.0), ValueError, r"`dt0`=-1.0 must be a positive depth step"),
        (dict(dt0=float("nan")), ValueError, r"`dt0`=nan must be finite"),
        (dict(dt0=1e-12), ValueError, r"`dt0`=1e-12 would take 2e\+12 steps"),
        (dict(t1="x"), TypeError, r"`t1`='x' must be a number"),
        (dict(terms="tangential"), ValueError, r"`terms`='tangential' is not known"),
        (dict(max_steps=0), ValueError, r"`max_steps`=0 must be an integer >= 1"),
    ],
)
def test_solve_arguments(model, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        itde.solve(model, X, **kwargs)


def test_layernorm_eps_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"`eps`='tiny' must be a number, not str"):
        itde.LayerNormProjection(eps="tiny")
    with pytest.raises(ValueError, match=r"`eps`=-1 must be >= 0"):
        itde.LayerNormProjection(eps=-1)


def test_state_of_the_wrong_kind(model):
    with pytest.raises(TypeError, match=r"`u0` is a torch tensor; convert it first"):
        model(torch.zeros(5, 8))
    with pytest.raises(TypeError, match=r"`u0` is a torch tensor"):
        model.batch(torch.zeros(2, 5, 8))
    with pytest.raises(ValueError, match=r"`u0` has 7 features but the model has 8"):
        model(jnp.zeros((5, 7)))


def test_trajectory_of_smooth_controls_says_what_to_use(smooth):
    with pytest.raises(TypeError, match=r"needs per-layer .*SaveAt\(ts=\.\.\.\)"):
        smooth.trajectory(X)
    with pytest.raises(TypeError, match=r"smooth in depth and have no layers"):
        smooth.n_layers
    ts = jnp.linspace(0.0, 1.0, 3)
    sol = itde.solve(smooth, X, dt0=0.25, saveat=diffrax.SaveAt(ts=ts))
    assert sol.ys.shape == (3, 5, 8)


def _cli(capsys, *argv):
    rc = itde.cli.main(list(argv))
    return rc, capsys.readouterr().err


def test_cli_simpson_with_even_token_count_names_key_and_file(tmp_path, capsys):
    cfg = tmp_path / "simpson.toml"
    cfg.write_text('[grid]\ntokens = "simpson"\n[solve]\nn_tokens = 16\n')
    rc, err = _cli(capsys, "solve", "--config", str(cfg), "--out", str(tmp_path / "o"))
    assert rc == 2
    assert "simpson.toml" in err and "`solve.n_tokens`=16" in err and "use n=17" in err


def test_cli_paths_of_the_wrong_kind(tmp_path, capsys):
    rc, err = _cli(capsys, "solve", "--config", str(tmp_path))
    assert rc == 2 and "is a directory; give --config PATH to a TOML file" in err
    f = tmp_path / "a_file"
    f.write_text("")
    for cmd in ("solve", "converge"):
        rc, err = _cli(capsys, cmd, "--out", str(f))
        assert rc == 2 and "is an existing file, not a directory" in err


@pytest.mark.slow  # the default-suite budget; same property at small size: see note
def test_converge_reference_out_of_steps_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "short.toml"
    cfg.write_text(
        "[problem]\nn_tokens = 4\nn_features = 4\nn_heads = 1\nn_hidden = 4\nn_modes = 2\n"
        "[reference]\nmax_steps = 3\n[study]\nschemes = ['lie']\nsteps = [2, 4]\n"
    )
    rc, err = _cli(capsys, "converge", "--config", str(cfg), "--out", str(tmp_path / "o"),
                   "--no-progress")  # fmt: skip
    assert rc == 2
    assert "`reference.max_steps`=3" in err and "raise `reference.max_steps`" in err
    assert not (tmp_path / "o" / "convergence.json").exists()


def test_outputs_are_plain_readable_files(tmp_path):
    from itde._internal import atomic_write, write_json

    p = write_json(tmp_path / "x.json", {"a": [1, 2]})
    assert p.read_text().startswith("{") and oct(p.stat().st_mode & 0o777) == "0o644"
    assert [q.name for q in tmp_path.iterdir()] == ["x.json"]  # no temporary left behind
    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "y.bin", lambda f: (f.write(b"half"), (_ for _ in ()).throw(
            RuntimeError("disk full"))))  # fmt: skip
    assert sorted(q.name for q in tmp_path.iterdir()) == ["x.json"]
    np.testing.assert_equal(len(list(tmp_path.iterdir())), 1)


def test_constructor_arguments_found_by_an_adversarial_run():
    with pytest.raises(ValueError, match=r"needs at least one block"):
        itde.stack([])
    with pytest.raises(TypeError, match=r"`dtype`=int32 must be a floating-point dtype"):
        itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, dtype=jnp.int32)
    with pytest.raises(TypeError, match=r"`key`=0 is not a PRNG key"):
        itde.TransformerIDE.init(0, n_layers=1, n_features=8, n_heads=2)
    with pytest.raises(TypeError, match=r"`values` must be a Block"):
        itde.PiecewiseConstant(None)
    a = itde.Block.init(KEY, n_features=8, n_heads=2, n_hidden=16)
    b = itde.Block.init(KEY, n_features=8, n_heads=2, n_hidden=8)
    with pytest.raises(ValueError, match=r"layer 1 differs from layer 0 at `feedforward.w1` "
                       r"\(shape \(8, 16\) vs \(8, 8\)\)"):
        itde.stack([a, b])
    c = itde.Block.init(KEY, n_features=8, n_heads=2, n_hidden=16, activation="gelu")
    with pytest.raises(ValueError, match=r"layer 2 .* `feedforward.activation` \('relu' vs "
                       r"'gelu'\)"):
        itde.stack([a, a, c])
    d = itde.Block.init(KEY, n_features=8, n_heads=2, n_hidden=16, bias=False)
    with pytest.raises(ValueError, match=r"`attention.bq` \(set vs None\)"):
        itde.stack([a, d])
    with pytest.raises(TypeError, match=r"needs a callable"):
        import itde_solvers

        itde_solvers.ProjectionTerm(None)


def test_diffrax_options_of_the_wrong_kind(model):
    for kw, name in ((dict(saveat="t1"), "saveat"), (dict(adjoint="direct"), "adjoint"),
                     (dict(stepsize_controller="pid"), "stepsize_controller")):  # fmt: skip
        with pytest.raises(TypeError, match=rf"`{name}`=.* must be a diffrax\."):
            itde.solve(model, X, **kw)


def test_empty_scheme_list_and_non_table_config():
    from itde._internal import _config
    from itde.studies._internal import ConvergeExperiment

    with pytest.raises(_config.ConfigError, match=r"`study.schemes` is empty"):
        _config.from_dict(ConvergeExperiment, {"study": {"schemes": []}})
    with pytest.raises(_config.ConfigError, match=r"must be a table"):
        _config.from_dict(ConvergeExperiment, None)
