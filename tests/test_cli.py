"""The `itde` command line and its TOML configs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from itde import _config
from itde.cli._main import main

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


def test_solve_writes_summary_and_plot(tmp_path, capsys):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    assert main(["solve", "--config", str(cfg), "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "token-mean norm" in text and "mean resid" in text
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [r["layer"] for r in summary["layers"]] == [0, 1, 2]
    for row in summary["layers"][1:]:  # eps = 0: exactly on S1 (float32 round-off)
        assert row["mean_residual"] < 1e-5 and row["var_residual"] < 1e-5
    png = (tmp_path / "out" / "trajectory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_shipped_configs_parse():
    for path in sorted((ROOT / "configs").glob("solve*.toml")):
        _config.load(_config.SolveExperiment, path)


def test_default_config_file_equals_built_in_default():
    assert _config.load(_config.SolveExperiment, ROOT / "configs" / "solve.toml") == (
        _config.SolveExperiment()
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
        ("[model]\nactivation = 'tanh'\n", r"`model.activation` must be one of"),
        ("[grid]\ntokens = 'simpsons'\n", r"`grid.tokens`='simpsons' is not a quadrature rule"),
        ("[solve]\ndt = -1.0\n", r"`solve.dt` must be positive, got -1.0"),
        ("[model\n", r"not valid TOML"),
    ],
)
def test_bad_config_names_key_and_file(tmp_path, body, match):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(body)
    with pytest.raises(_config.ConfigError, match=match) as e:
        _config.load(_config.SolveExperiment, cfg)
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


def test_installed_entry_point_runs(tmp_path):
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
    assert (tmp_path / "o" / "trajectory.png").exists()


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
steps = [4, 8, 16]
"""


def test_converge_writes_json_schema_and_plot(tmp_path, capsys):
    cfg = tmp_path / "conv.toml"
    cfg.write_text(CONVERGE_TINY)
    out = tmp_path / "out"
    assert main(["converge", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "observed" in text and "lie" in text and "heun" in text
    result = json.loads((out / "convergence.json").read_text())
    assert result["axis"] == "depth" and "reference" in result
    rows = {r["scheme"]: r for r in result["results"]}
    assert set(rows) == {"lie", "heun"}
    for r in rows.values():
        assert set(r) >= {"scheme", "expected_order", "observed_order", "dt", "errors"}
        assert len(r["dt"]) == len(r["errors"]) == 3
    assert abs(rows["lie"]["observed_order"] - 1) < 0.25
    assert abs(rows["heun"]["observed_order"] - 2) < 0.25
    assert (out / "convergence_depth.png").read_bytes()[:4] == b"\x89PNG"


def test_converge_config_errors(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[study]\nschemes = ["lie", "rk5"]\n')
    with pytest.raises(_config.ConfigError, match=r"`study.schemes` holds 'rk5'"):
        _config.load(_config.ConvergeExperiment, cfg)
    cfg.write_text("[study]\nsteps = [8, 4]\n")
    with pytest.raises(_config.ConfigError, match=r"strictly increasing"):
        _config.load(_config.ConvergeExperiment, cfg)


def test_shipped_convergence_config_is_the_default():
    assert _config.load(_config.ConvergeExperiment, ROOT / "configs" / "convergence.toml") == (
        _config.ConvergeExperiment()
    )
