"""The `itde` command line and its TOML configs."""

import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

import itde
from itde._internal import _config
from itde.cli import main
from itde.cli._internal import SolveExperiment
from itde.studies._internal import ConvergeExperiment

ROOT = Path(__file__).resolve().parents[1]

TINY = """
[model]
n_layers = 2
n_features = 8
n_heads = 2
n_hidden = 12
[solve]
n_tokens = 5
"""


def _assert_png(path, width_in, height_in, dpi=110):
    """The file decodes as a PNG of figsize x dpi pixels (the CLI's plots) and is not blank."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (round(height_in * dpi), round(width_in * dpi)), img.shape
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 10  # drawn, not blank


def _table_rows(text, first):
    """The whitespace-separated rows of the printed table whose first cell is in `first`."""
    return {
        f[0]: f[1:] for f in (line.split() for line in text.splitlines()) if f and f[0] in first
    }


def _assert_solve_output(out, stdout, n_layers, tol):
    """summary.json has its schema, finite values on S1 up to `tol`, and agrees with the
    printed table; trajectory.png is the 10 x 3.8 in figure."""
    summary = json.loads((out / "summary.json").read_text())
    rows = summary["layers"]
    assert [r["layer"] for r in rows] == list(range(n_layers + 1))
    printed = _table_rows(stdout, {str(n) for n in range(n_layers + 1)})
    assert len(printed) == n_layers + 1, stdout
    for r in rows:
        assert set(r) == {"layer", "t", "token_mean_norm", "token_mean_change",
                          "mean_residual", "var_residual"}  # fmt: skip
        assert r["t"] == r["layer"] and math.isfinite(r["token_mean_norm"])
        t, norm, change, rm, rv = printed[str(r["layer"])]
        assert float(t) == r["t"] and float(norm) == pytest.approx(r["token_mean_norm"], abs=1e-6)
        if r["layer"] == 0:  # the initial state is not projected: no residual to report
            assert r["mean_residual"] is None and r["var_residual"] is None
            assert r["token_mean_change"] is None and change == rm == rv == "-"
            continue
        assert float(change) == pytest.approx(r["token_mean_change"], abs=1e-4)
        assert r["token_mean_change"] > 1e-3  # every layer moves the tokens
        # eps = 0: every layer's output lies on S1 up to round-off
        assert 0 <= r["mean_residual"] < tol and 0 <= r["var_residual"] < tol
        assert float(rm) == pytest.approx(r["mean_residual"], rel=6e-3, abs=1e-300)
        assert float(rv) == pytest.approx(r["var_residual"], rel=6e-3, abs=1e-300)
    _assert_png(out / "trajectory.png", 10, 3.8)


@pytest.mark.runs("solve")
def test_solve_writes_summary_and_plot(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    assert main(["solve", "--config", str(cfg), "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "token-mean norm" in text and "mean resid" in text
    # the test session runs in float64 (conftest), so the residuals are float64 round-off
    _assert_solve_output(tmp_path / "out", text, n_layers=2, tol=1e-12)


def test_shipped_configs_parse():
    for path in sorted((ROOT / "configs").glob("solve*.toml")):
        _config.load(SolveExperiment, path)


def test_default_config_file_equals_built_in_default():
    assert _config.load(SolveExperiment, ROOT / "configs" / "solve.toml") == (
        SolveExperiment()
    )


@pytest.mark.parametrize(
    "body,match",
    [
        ("[model]\nn_layer = 3\n", r"unknown key `model.n_layer`"),
        ("[modle]\nn_layers = 3\n", r"unknown key `modle`"),
        ("[model]\nn_layers = 2.5\n", r"`model.n_layers` must be an integer, got 2.5"),
        ("[model]\ncausal = 1\n", r"`model.causal` must be true or false"),
        ("[model]\nn_layers = 0\n", r"`model.n_layers` must be positive, got 0"),
        ("[model]\nn_heads = 5\n", r"`model.n_heads`=5 does not divide `model.n_features`=32"),
        ("[model]\nactivation = 'tanh'\n", r"`model.activation`='tanh' is not known"),
        ("[grid]\ntokens = 'simpsons'\n", r"`grid.tokens`='simpsons' is not a quadrature rule"),
        ("[solve]\ndt = -1.0\n", r"`solve.dt` must be positive, got -1.0"),
        ("[model\n", r"not valid TOML"),
    ],
)
def test_bad_config_names_key_and_file(tmp_path, body, match):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(body)
    with pytest.raises(_config.ConfigError, match=match) as e:
        _config.load(SolveExperiment, cfg)
    assert str(cfg) in str(e.value)


def test_impossible_grid_is_reported_with_the_file(tmp_path, capsys):
    cfg = tmp_path / "simpson.toml"
    cfg.write_text("[grid]\nfeatures = 'simpson'\nfeature_interval = [0.0, 1.0]\n")  # 32: even
    assert main(["solve", "--config", str(cfg), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(cfg) in err and "odd number of nodes" in err


def test_missing_config_file(tmp_path, capsys):
    assert main(["solve", "--config", str(tmp_path / "nope.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow  # the default-suite budget; same property at small size: see note
def test_installed_entry_point_runs(tmp_path):
    """The `itde` script in a fresh process: JAX's default float32, as users run it."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    exe = Path(sys.executable).with_name("itde")
    proc = subprocess.run(
        [str(exe), "solve", "--config", str(cfg), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    _assert_solve_output(tmp_path / "o", proc.stdout, n_layers=2, tol=1e-5)


CONVERGE_TINY = """
[problem]
n_tokens = 4
n_features = 6
n_heads = 2
n_hidden = 8
[reference]
rtol = 1e-10
atol = 1e-10
[study]
schemes = ["lie", "heun"]
pre_norm_schemes = ["heun"]
steps = [4, 8, 16]
"""


@pytest.mark.runs("converge --axis depth")
def test_converge_writes_json_schema_and_plot(tmp_path, capsys):
    cfg = tmp_path / "conv.toml"
    cfg.write_text(CONVERGE_TINY)
    out = tmp_path / "out"
    assert main(["converge", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    result = json.loads((out / "convergence.json").read_text())
    assert result["axis"] == "depth"
    assert set(result["reference"]) >= {"solver", "rtol", "atol", "steps", "dtype"}
    assert result["reference"]["rtol"] == 1e-10 and result["reference"]["steps"] > 0
    rows = {r["scheme"]: r for r in result["results"]}
    assert set(rows) == {"lie", "heun", "pre_norm/heun"}
    printed = _table_rows(text, set(rows))
    t1 = result["problem"]["t1"]
    # Lie-Trotter first order, projected Heun second, Heun on the pre-norm ODE second
    theory = {"lie": 1, "heun": 2, "pre_norm/heun": 2}
    for name, r in rows.items():
        assert set(r) >= {"scheme", "expected_order", "observed_order", "dt", "errors"}
        np.testing.assert_allclose(r["dt"], [t1 / 4, t1 / 8, t1 / 16], rtol=1e-15)
        errs = np.asarray(r["errors"])
        assert errs.shape == (3,) and np.all(np.isfinite(errs)) and np.all(errs > 0)
        assert np.all(np.diff(errs) < 0), errs  # refining the step reduces the error
        assert r["expected_order"] == theory[name]
        assert abs(r["observed_order"] - theory[name]) < 0.25, r
        if name.startswith("pre_norm/"):  # an ODE with no constraint set
            assert r["constraint_residual"] is None
        else:
            assert r["constraint_residual"] < 1e-12  # float64: on the constraint set
        # the printed row: expected order, observed order (2 decimals), errors (3 digits)
        exp, obs, *e = printed[name]
        assert int(exp) == theory[name] and float(obs) == pytest.approx(
            r["observed_order"], abs=5e-3
        )
        np.testing.assert_allclose([float(x) for x in e], errs, rtol=6e-3)
    _assert_png(out / "convergence_depth.png", 7, 6.2)


def test_converge_config_errors(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[study]\nschemes = ["lie", "rk5"]\n')
    with pytest.raises(_config.ConfigError, match=r"`study.schemes` holds 'rk5'"):
        _config.load(ConvergeExperiment, cfg)
    cfg.write_text("[study]\nsteps = [8, 4]\n")
    with pytest.raises(_config.ConfigError, match=r"strictly increasing"):
        _config.load(ConvergeExperiment, cfg)
    cfg.write_text('[study]\npre_norm_schemes = ["rk5"]\n')
    with pytest.raises(_config.ConfigError, match=r"`study.pre_norm_schemes` holds 'rk5'"):
        _config.load(ConvergeExperiment, cfg)


def test_config_loader_holds_no_schema():
    """`itde._config` is the TOML loader only; each command's schema is beside the command
    (`itde solve`'s in the CLI, `itde converge`'s beside the studies it runs)."""
    import dataclasses

    here = [n for n, o in vars(_config).items()
            if dataclasses.is_dataclass(o) and o.__module__ == _config.__name__]  # fmt: skip
    assert here == []
    assert SolveExperiment.__module__ == "itde.cli._solve_config"
    assert ConvergeExperiment.__module__ == "itde.studies._converge_config"


def test_studies_load_their_names_on_use():
    """`itde.studies` imports no JAX until a name is used (the CLI reads the converge
    config from it while building its parser): each name is its module's object."""
    import importlib

    import itde.studies as studies

    assert set(studies.__all__) <= set(dir(studies))
    for name in studies.__all__:
        module = importlib.import_module(studies._EXPORTS[name], "itde.studies")
        assert callable(getattr(module, name)) and getattr(studies, name) is getattr(module, name)


def test_shipped_convergence_config_is_the_default():
    assert _config.load(ConvergeExperiment, ROOT / "configs" / "convergence.toml") == (
        ConvergeExperiment()
    )


def test_ctrl_c_anywhere_is_one_line_and_status_130(monkeypatch, capsys):
    """SIGINT during `itde sample`'s compilation printed a traceback: any command interrupted
    outside its own handling exits 130 with one line."""
    from itde.cli._internal import _main as cli_main

    def compiling(args):  # Ctrl-C while the sampler compiles
        raise KeyboardInterrupt

    parser = cli_main.build_parser
    monkeypatch.setattr(cli_main, "build_parser", lambda: _with(parser(), compiling))
    assert cli_main.main(["sample", "--checkpoint", "nowhere"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == "itde sample: error: interrupted" and "Traceback" not in err


def _with(parser, func):
    """`parser` with the `sample` command's function replaced by `func`."""
    import argparse

    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    subs.choices["sample"].set_defaults(func=func)
    return parser


@pytest.mark.runs("solve", "solve --set")
def test_solve_dt_flag_overrides_the_config(tmp_path, capsys):
    """`itde solve --dt` (there was no flag: only [solve] dt of a config file); `--set`
    overrides the file's keys (2 layers, 5 tokens), and `--dt` a `--set solve.dt`."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    out = tmp_path / "out"
    sets = ["--set", "model.n_layers=1", "--set", "solve.n_tokens=7", "--set", "solve.dt=0.25"]
    with pytest.warns(itde.DepthStepWarning):  # the random model's norms carry gains
        argv = ["solve", "--config", str(cfg), "--out", str(out), *sets, "--dt", "0.5"]
        assert main(argv) == 0
    assert "1 layers, 7 tokens x 8 features, dt=0.5" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dt"] == 0.5 and [r["layer"] for r in summary["layers"]] == [0, 1]
    assert summary["config"] == (f"{cfg} --set model.n_layers=1 --set solve.n_tokens=7 "
                                 "--set solve.dt=0.25")  # fmt: skip
    assert main(["solve", "--config", str(cfg), "--out", str(out), "--dt", "2"]) == 2
    assert "`--dt`=2.0 is longer than one layer" in capsys.readouterr().err
