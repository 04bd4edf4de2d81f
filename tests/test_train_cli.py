"""End to end: `itde train`, then `itde eval` (another depth step, scheme or grid) and
`itde sample`, on tiny configs."""

import json

import pytest

import itde.train
from itde.cli import main
from itde.train import TrainExperiment

BURGERS = """
[task]
name = "burgers"
n_grid = 8
n_modes = 2
eval_size = 4
[model]
n_layers = 1
n_features = 8
n_heads = 2
n_hidden = 8
scheme = "heun"
activation = "gelu"
[optim]
steps = 2
batch_size = 4
warmup = 0
[run]
log_every = 1
eval_every = 2
checkpoint_every = 2
"""


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.runs("train burgers", "eval")
def test_burgers_train_then_eval_on_other_grid_step_and_scheme(tmp_path, capsys):
    cfg = tmp_path / "burgers.toml"
    cfg.write_text(BURGERS)
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 0
    trained = _rows(out / "metrics.jsonl")[-1]["eval_rel_l2"]
    # the "wrote" line names every file of the run, the state file too; all are 0644
    files = sorted(p.name for p in out.iterdir())
    assert files == ["checkpoint.json", "loss_curve.png", "metrics.jsonl", "state-00000002.eqx"]
    printed = capsys.readouterr().out.splitlines()
    wrote = printed[-1]
    # --no-progress prints one line per evaluation as the run goes (no bar, not silent)
    evals = [line for line in printed if line.startswith("step ") and "eval_rel_l2" in line]
    assert len(evals) == 1 and evals[0].startswith("step 2: "), printed
    assert wrote.startswith("wrote ") and all(str(out / f) in wrote for f in files), wrote
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    results = {}
    for extra in ([], ["--grid", "16", "--scheme", "rk4", "--dt", "0.5"]):
        assert main(["eval", "--checkpoint", str(out), *extra]) == 0
        results[" ".join(extra)] = json.loads(capsys.readouterr().out)
    assert results[""]["eval_rel_l2"] == pytest.approx(trained)
    other = results["--grid 16 --scheme rk4 --dt 0.5"]
    assert (other["grid"], other["scheme"], other["dt"]) == (16, "rk4", 0.5)
    assert other["eval_rel_l2"] != results[""]["eval_rel_l2"]
    _fail = main(["eval", "--checkpoint", str(out), "--grid", "9"])
    assert _fail == 2 and "`--grid`=9 must be an even integer" in capsys.readouterr().err
    # sizes that used to hang or be killed for memory: refused before any work, by name
    assert main(["eval", "--checkpoint", str(out), "--size", str(10**11)]) == 2
    assert "`--size`=100000000000 held-out examples" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(out), "--grid", "100000"]) == 2
    said = capsys.readouterr().err
    assert "`--grid`=100000 makes the Burgers data solver take" in said, said
    assert "on its 400000 points" in said and "Use `--grid` <=" in said, said
    for r in results.values():
        assert 0 < r["eval_rel_l2"] < 10
    assert main(["sample", "--checkpoint", str(out)]) == 2
    assert "needs a checkpoint of a text task (charlm, textlm)" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    for r in results.values():
        assert r["examples"] == 4


def test_train_without_config_is_the_sort_task(monkeypatch, capsys):
    seen = {}

    def fake_train(cfg, **kw):
        seen["cfg"] = cfg
        return itde.train.TrainResult(
            step=0, metrics={}, wall_s=0.0, out="runs/sort", files=[], complete=False,
            model=None, opt_state=None,
        )  # fmt: skip

    monkeypatch.setattr(itde.train, "train", fake_train)
    assert main(["train"]) == 0
    assert seen["cfg"] == TrainExperiment() and seen["cfg"].task.name == "sort"


@pytest.mark.slow
def test_default_sort_config_reaches_99_percent(tmp_path):
    """The acceptance bar of the built-in default: >= 99% held-out sequence accuracy."""
    from itde.train import train

    result = train(out=tmp_path / "sort", progress=False)
    assert result.step == 1500
    assert result.metrics["eval_seq_acc"] >= 0.99, result.metrics


def _eta_after_first_steps(monkeypatch, restart: bool) -> tuple[float, str]:
    """(ETA in seconds, the bar's text) after a 60 s compiling first step and 10 steps of
    0.01 s, on a fake clock."""
    import io

    import tqdm.std

    from itde.train._internal import restart_clock

    now = [0.0]
    monkeypatch.setattr(tqdm.std, "time", lambda: now[0])
    buf = io.StringIO()
    bar = tqdm.std.tqdm(total=1000, file=buf, mininterval=0, miniters=1)
    now[0] += 60.0
    bar.update(1)
    if restart:
        restart_clock(bar)
    for _ in range(10):
        now[0] += 0.01
        bar.update(1)
    d = bar.format_dict
    rate = d["rate"] or (d["n"] - d["initial"]) / d["elapsed"]
    text = bar.format_meter(**d)
    bar.close()
    return (d["total"] - d["n"]) / rate, text


def test_progress_eta_starts_after_the_compiling_step(monkeypatch):
    eta, text = _eta_after_first_steps(monkeypatch, restart=True)
    assert 5 < eta < 20, eta  # 989 steps of 0.01 s
    assert "11/1000" in text and "<00:09" in text, text
    stale, _ = _eta_after_first_steps(monkeypatch, restart=False)
    assert stale > 100  # what the bar showed before: the compile time in the ETA


def test_empty_out_is_refused_by_the_cli_and_the_library(tmp_path, monkeypatch, capsys):
    """`--out ""` would write the run into the working directory: refused, naming it."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", ""]) == 2
    assert "`--out`='' names no directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="`out`='' names no directory"):
        itde.train.train(out="", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_version_flag_prints_the_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"itde {itde.__version__}"


@pytest.mark.parametrize("t", [float("inf"), float("nan"), -1.0])
def test_sampling_temperature_must_be_finite_and_non_negative(t):
    from types import SimpleNamespace

    from itde.train._internal import _check

    causal = SimpleNamespace(equation=SimpleNamespace(causal=True))
    with pytest.raises(ValueError, match=r"`--temperature`=.* must be a finite number >= 0"):
        _check(causal, "ab", "a", 3, t, 0)


def test_sample_command_refuses_a_bad_temperature_before_reading(tmp_path, capsys):
    """`itde sample --temperature inf`: one line naming the flag, before the checkpoint
    (here none) is read."""
    for t in ("inf", "nan", "-1"):
        assert main(["sample", "--checkpoint", str(tmp_path / "none"), "--temperature", t]) == 2
        assert "`--temperature`=" in capsys.readouterr().err


def test_train_out_under_a_file_or_unwritable_is_named_before_any_work(tmp_path, capsys):
    """`--out` below an existing file, or in a directory that cannot be written, used to
    fail deep inside the run with the OS's message: it is named at once, exit status 2."""
    import os

    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main(["train", "--out", str(blocker / "run")]) == 2
    said = capsys.readouterr().err
    assert "`--out`" in said and "cannot be created as a directory" in said, said
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    try:
        if os.access(locked, os.W_OK):  # running as root: permissions do not bind
            return
        assert main(["train", "--out", str(locked)]) == 2
        assert "`--out`" in capsys.readouterr().err
    finally:
        os.chmod(locked, 0o700)
