"""Every command runs in the default suite at a tiny size (issue 33, section 4).

`itde converge --axis tokens`, documented in the README with its table, stopped at its
causal-Simpson row while the suite stayed green: no default test ran the command. The rule
now: every code path of the command line (every subcommand; every `--axis` of `converge`
and its model sources; every task of `train`; see `cli_coverage.py` for the keys) and every
README code block is run to completion by a test of the default tier, through the same
code as the full run with small grids and few steps. A test says which commands it runs
with `@pytest.mark.runs(...)` (and fails if it did not run them); the first test here
fails when a command, a new `--axis`, a new task or a README block has no such test, or
only a slow one.

The tiny runs of the grid studies and of the `textlm` task (with the commands that read
its checkpoint) live here; the other commands run in the tests of their own features
(`test_cli.py`, `test_model_study.py`, `test_analysis_finishes.py`, `test_train_cli.py`,
`test_train_hardening.py`, `test_readme.py`).
"""

import json
import math

import cli_coverage
import equinox as eqx
import jax
import numpy as np
import pytest

import itde
from itde.cli import main


def test_every_command_and_readme_block_runs_at_tiny_size_in_the_default_tier(monkeypatch):
    expected = cli_coverage.expected_keys()
    declared = cli_coverage.declared_runs()
    unknown = sorted(set(declared) - expected)
    assert not unknown, f"@pytest.mark.runs names no command: {unknown}"
    missing = {k: declared.get(k, []) for k in sorted(expected)
               if not any(not slow for _, slow in declared.get(k, []))}  # fmt: skip
    assert not missing, (
        "commands not run by a default-tier test (key: the slow tests that run it): "
        f"{missing}; add a tiny run marked @pytest.mark.runs(KEY)"
    )
    # the README's commands, in its shell blocks and inline, are commands of that list
    monkeypatch.chdir(cli_coverage.ROOT)
    said = cli_coverage.readme_commands()
    keys = {cmd: cli_coverage.key_of_command(cmd) for _, cmd in said}
    assert {k for k in keys.values()} <= expected, keys
    # the documented command that broke is read as such (the check is not vacuous)
    assert keys["itde converge --axis tokens"] == "converge --axis tokens"
    assert keys["itde train --config configs/shakespeare.toml"] == "train textlm"
    assert {"converge --hf", "analyze --checkpoint", "train sort"} <= set(keys.values())


def test_enumeration_sees_new_commands_and_slow_only_runs(tmp_path, monkeypatch):
    """The check above fails for a subcommand no test runs, and for one run only by a slow
    test (on a copy of the tests with a fake subcommand and marks)."""
    import argparse

    from itde.cli._internal import _main as cli_main

    build = cli_main.build_parser

    def with_extra():
        parser = build()
        (subs,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        subs.add_parser("frobnicate")
        return parser

    monkeypatch.setattr(cli_main, "build_parser", with_extra)
    assert "frobnicate" in cli_coverage.expected_keys()
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.slow\n@pytest.mark.runs('frobnicate')\ndef test_x():\n    pass\n\n"
        "@pytest.mark.parametrize('a', [1, pytest.param(2, marks=pytest.mark.slow)])\n"
        "@pytest.mark.runs('solve', 'eval')\ndef test_y(a):\n    pass\n\n"
        "@pytest.mark.runs('sample')\ndef test_z():\n    pass\n"
    )
    (tmp_path / "test_b.py").write_text(
        "import pytest\npytestmark = pytest.mark.slow\n\n"
        "@pytest.mark.runs('train sort')\ndef test_w():\n    pass\n"
    )
    got = cli_coverage.declared_runs(tmp_path)
    assert got == {"frobnicate": [("test_a.py::test_x", True)],
                   "solve": [("test_a.py::test_y", True)], "eval": [("test_a.py::test_y", True)],
                   "sample": [("test_a.py::test_z", False)],
                   "train sort": [("test_b.py::test_w", True)]}  # fmt: skip


# ------------------------------------------------------------------ converge: the grid axes
# The rows' code paths at small grids: a non-causal row per rule kind, the causal rows with
# their two references (spectral; Gregory for Gauss-Legendre), periodic data, and for
# `all` the four scheme+rule rows against the projected Dopri8 reference. Three Legendre
# modes: with two the feature space is two-dimensional and the projection onto S1 leaves
# one point, so the output would not depend on the attention at all.
# The `tokens` grids (5 and 7 nodes) and their reference (8 Gauss-Legendre nodes) are one
# bucket of the padded token counts, so each row structure compiles once (the grid's own
# program count; 9 and 16 nodes were a second bucket: twice the programs). The feature
# axis keeps a 16-node reference: the periodic trapezoid rule's round-off check needs it.
TINY_GRID = """
[problem]
n_heads = 2
[study]
axis = "{axis}"
rules = ["simpson", "gauss-legendre", "periodic-trapezoid"]
nodes = {nodes}
reference_nodes = {reference}
layers = 1
modes = 3
"""


def _converge(axis, tmp_path, capsys, *extra, nodes=(5, 9), reference=16):
    cfg = tmp_path / "grid.toml"
    cfg.write_text(TINY_GRID.format(axis=axis, nodes=list(nodes), reference=reference))
    out = tmp_path / "out"
    # the documented spelling: `itde converge --axis AXIS` (here with a small config)
    argv = ["converge", "--axis", axis, "--config", str(cfg), "--out", str(out), "--no-progress",
            *extra]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    result = json.loads((out / f"convergence_{axis}.json").read_text())
    assert (out / f"convergence_{axis}.png").read_bytes()[:4] == b"\x89PNG"
    rows = {r["scheme"]: r for r in result["results"]}
    for name, r in rows.items():
        assert name in printed
        errs = np.asarray(r["errors"])
        assert errs.shape == (2,) and np.all(np.isfinite(errs)) and np.all(errs > 0), (name, errs)
    return result, rows


@pytest.mark.runs("converge --axis tokens")
def test_converge_tokens_axis_at_tiny_size(tmp_path, capsys):
    result, rows = _converge("tokens", tmp_path, capsys, nodes=(5, 7), reference=8)
    rules = ["simpson", "gauss-legendre", "periodic-trapezoid"]
    assert list(rows) == rules + [f"causal-{r}" for r in rules]
    # causal Simpson: Gregory's order-4 partial-interval weights on Simpson's (odd) nodes
    assert rows["causal-simpson"]["n"] == [5, 7] and rows["causal-simpson"]["expected_order"] == 4
    assert rows["causal-periodic-trapezoid"]["expected_order"] == 1  # J's left Riemann sum
    assert rows["simpson"]["expected_order"] == 4
    assert rows["gauss-legendre"]["expected_order"] is None  # geometric
    for r in rules:  # causal attention is another operator: another functional
        assert not np.allclose(rows[f"causal-{r}"]["errors"], rows[r]["errors"], rtol=1e-3)
    assert math.isfinite(result["causal_reference_gap"])


@pytest.mark.runs("converge --axis features", "converge --set")
def test_converge_features_axis_at_tiny_size(tmp_path, capsys):
    # `--set` over the file's three rules
    rules = "study.rules=['simpson', 'periodic-trapezoid']"
    _, rows = _converge("features", tmp_path, capsys, "--set", rules)
    assert list(rows) == ["simpson", "periodic-trapezoid"]
    # periodic data on the feature axis: the periodic trapezoid rule is exact to round-off
    assert max(rows["periodic-trapezoid"]["errors"]) < 1e-10 < min(rows["simpson"]["errors"])


@pytest.mark.runs("converge --axis all")
def test_converge_all_axes_at_tiny_size(tmp_path, capsys):
    result, rows = _converge("all", tmp_path, capsys)
    assert list(rows) == ["lie+midpoint", "strang+midpoint", "rk4+midpoint", "rk4+gauss-legendre"]
    assert [r["expected_order"] for r in rows.values()] == [1, 2, 2, 4]
    assert result["reference"]["solver"].startswith("projected Dopri8")


# ------------------------------------------------------------------------ the textlm task
@pytest.mark.runs("train textlm", "eval", "analyze --checkpoint", "converge --checkpoint")
def test_textlm_train_eval_analyze_and_study_at_tiny_size(tmp_path, capsys):
    """`itde train` on the textlm task (characters of the built-in text, encoded into a
    cache), `itde eval` of its checkpoint (the cached split re-read and checked),
    `itde analyze --checkpoint` of it and its depth study, `itde converge --checkpoint`
    (one training run for the four commands)."""
    cfg = tmp_path / "textlm.toml"
    cfg.write_text(
        f'[task]\nname = "textlm"\ncontext = 8\neval_size = 4\ncache_dir = "{tmp_path / "c"}"\n'
        "[model]\nn_layers = 1\nn_features = 8\nn_heads = 2\nn_hidden = 8\n"
        "[optim]\nsteps = 2\nbatch_size = 4\nwarmup = 0\n"
        "[run]\nlog_every = 1\neval_every = 2\ncheckpoint_every = 2\n"
    )
    run = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(run), "--no-progress"]) == 0
    trained = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()][-1]
    # the logged metric against its definition, recomputed here: the checkpoint's model
    # (`jax.vmap` of it, not the batched solve evaluation runs) on the run's held-out
    # windows, each position's -log softmax of its target in float64, averaged
    model, run_cfg, meta = itde.train.load(run)
    task = itde.train.TASKS["textlm"].from_checkpoint(run_cfg.task, meta["task"])
    ((x, y),) = itde.train.Run(run_cfg, task=task, fsdp=1).eval_chunks()
    logits = np.asarray(eqx.filter_jit(jax.vmap(model))(x), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nats = -np.take_along_axis(logp, np.asarray(y)[..., None], -1).mean()
    assert logits.shape == (4, 8, task.vocab) and x.shape == y.shape == (4, 8)
    assert trained["eval_nats_per_token"] == pytest.approx(nats, rel=1e-5)
    chars = meta["task"]["val_tokens"] / meta["task"]["val_chars"]
    assert trained["eval_bits_per_char"] == pytest.approx(nats * chars / math.log(2), rel=1e-5)
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["eval_nats_per_token"] == pytest.approx(trained["eval_nats_per_token"])
    out = tmp_path / "an"
    argv = ["analyze", "--checkpoint", str(run), "--inputs", "2", "--no-lyapunov",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads((out / "analysis.json").read_text())
    assert report["inputs"] == 2 and report["tokens"] == 8 and report["depths"] == [0.0, 1.0]
    assert "textlm model, step 2" in capsys.readouterr().out
    # the depth study of the trained model (the study itself: test_model_study.py)
    out = tmp_path / "study"
    argv = ["converge", "--checkpoint", str(run), "--inputs", "3", "--steps", "1", "2",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "from the continuum limit" in printed and "textlm model" in printed
    r = json.loads((out / "convergence_model.json").read_text())
    assert r["model"]["continuum_form"] and r["model"]["batch"] == 3
    assert [row["scheme"] for row in r["results"]] == ["lie", "strang", "rk4"]
    assert r["results"][0]["dt"] == [1.0, 0.5]
    # Lie at one step per layer is the trained network itself (in its continuum form)
    assert r["results"][0]["errors"][0] == pytest.approx(r["network"]["distance_to_limit"])
    assert (out / "convergence_model.png").stat().st_size > 0
    assert main(["converge", "--checkpoint", str(run), "--axis", "depth"]) == 2
    assert "--axis" in capsys.readouterr().err
    assert main(["converge", "--checkpoint", str(run), "--inputs", "0"]) == 2
    assert "`--inputs`=0 must be a positive number" in capsys.readouterr().err
