"""The command line's habits (issue 36, item 4): a misspelt option or subcommand names the
nearest one, with the subcommand's own usage; every mistake has one prefix,
`itde COMMAND: error:`; `--set KEY=VALUE` overrides any key of a command's TOML config,
checked as the file is; progress in a log is a few whole lines, not one line of carriage
returns."""

import argparse
import io
import json
import os
import re
import select

import pytest

from itde._internal import _config
from itde.cli import main
from itde.cli._internal import SolveExperiment, build_parser
from itde.train import TrainExperiment, load_config

SORT = """
[task]
name = "sort"
length = 4
vocab = 5
eval_size = 4
[model]
n_layers = 1
n_features = 8
n_heads = 2
n_hidden = 8
[optim]
steps = 4
batch_size = 4
warmup = 0
lr = 0.01
[run]
log_every = 1
eval_every = 1
checkpoint_every = 10
"""

SOLVE = """
[model]
n_layers = 2
n_features = 8
n_heads = 2
n_hidden = 12
[solve]
n_tokens = 5
"""


def _exit(argv, capsys) -> str:
    """Run the parser on `argv`, expect argparse's exit status 2; its stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _subparsers():
    (action,) = [a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)]  # fmt: skip
    return action.choices


# ------------------------------------------------------------ misspelt options and commands
def test_misspelt_option_gets_the_subcommands_usage_and_the_nearest_option(capsys):
    for argv in (["train", "--confg", "x"], ["train", "--confg=x"]):
        err = _exit(argv, capsys)
        assert err.startswith("usage: itde train [-h] [--config FILE]"), err
        assert "usage: itde [-h] [--version] COMMAND" not in err  # not the top level's
        last = err.strip().splitlines()[-1]
        assert last.startswith("itde train: error: unrecognized arguments: --confg"), last
        assert last.endswith("; did you mean --config?"), last
    # an argument with no near option is named, with no guess
    err = _exit(["solve", "--frobnicate"], capsys)
    assert err.strip().splitlines()[-1] == "itde solve: error: unrecognized arguments: --frobnicate"


def test_every_option_of_every_command_misspelt_names_itself(capsys):
    """Each long option with a doubled letter (not a prefix of any option, so argparse's
    abbreviations do not take it) is answered with that option."""
    checked = 0
    for name, p in _subparsers().items():
        required = [a.option_strings[0] for a in p._actions if a.required]
        for a in p._actions:
            for opt in a.option_strings:
                if not opt.startswith("--") or opt == "--help":
                    continue
                i = len(opt) // 2 + 1
                typo = opt[:i] + opt[i] + opt[i:]
                argv = [name, *[x for r in required for x in (r, "x")], typo]
                err = _exit(argv, capsys)
                assert err.startswith(f"usage: itde {name} "), err
                assert err.rstrip().endswith(f"; did you mean {opt}?"), (typo, err)
                checked += 1
    assert checked > 30


def test_misspelt_subcommand_and_choice_name_the_nearest(capsys):
    err = _exit(["trian", "--config", "x"], capsys)
    assert err.strip().splitlines()[-1] == (
        "itde: error: argument COMMAND: invalid choice: 'trian' (choose from 'solve', "
        "'converge', 'analyze', 'train', 'eval', 'sample'); did you mean 'train'?"
    )
    assert "did you mean 'analyze'?" in _exit(["analyse"], capsys)
    err = _exit(["eval", "--checkpoint", "x", "--scheme", "rk5"], capsys)
    assert err.strip().splitlines()[-1].startswith("itde eval: error: argument --scheme: ")
    assert err.rstrip().endswith("did you mean 'rk4'?"), err
    assert "did you mean" not in _exit(["converge", "--axis", "zzz"], capsys)


# ----------------------------------------------------------------------- one error prefix
def test_every_kind_of_mistake_has_the_commands_prefix(tmp_path, capsys):
    """argparse's errors, a bad config (ConfigError), an argument the run refuses
    (ValueError), an output path the OS refuses (OSError): `itde COMMAND: error: ...`."""
    assert (
        _exit(["converge", "--axis", "x"], capsys)
        .splitlines()[-1]
        .startswith("itde converge: error: argument --axis: invalid choice: 'x'")
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nn_heads = 5\n")
    assert main(["solve", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"itde solve: error: {bad}: `model.n_heads`=5 does not divide"), line
    assert main(["train", "--config", str(tmp_path / "nope.toml")]) == 2
    assert _one_line(capsys).startswith("itde train: error: config file ")
    assert main(["converge", "--hf", "x", "--config", "y"]) == 2
    assert _one_line(capsys).startswith("itde converge: error: `--config`/`--axis`/`--set`")
    assert main(["analyze", "--out", "/proc/itde-out"]) == 2
    assert _one_line(capsys).startswith("itde analyze: error: `--out` '/proc/itde-out' cannot")
    for old in ("itde: config error:", "itde: error:"):
        assert old not in capsys.readouterr().err


# ------------------------------------------------------------------------------ --set
@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("optim.steps=150", "optim.steps", 150),
        ("optim.lr=1e-3", "optim.lr", 0.001),
        ("model.causal=true", "model.causal", True),
        ('task.name="sort"', "task.name", "sort"),
        ("task.name=sort", "task.name", "sort"),  # not TOML: the text itself
        ("study.steps=[4, 8]", "study.steps", [4, 8]),
        (" run.out = runs/x y ", "run.out", "runs/x y"),
        ("run.out=", "run.out", ""),
        ("model.init=hf:../my model", "model.init", "hf:../my model"),
        ("a.b=1\nc = 2", "a.b", "1\nc = 2"),  # a value and a stray key: text, not two keys
        ("x.y=-inf", "x.y", float("-inf")),
        ('x.y="a=b"', "x.y", "a=b"),
    ],
)
def test_a_set_value_is_read_as_toml_or_else_as_text(text, key, value):
    assert _config.parse_override(text) == (key, value)


def test_set_applies_after_the_file_and_the_last_wins(tmp_path):
    path = tmp_path / "sort.toml"
    path.write_text(SORT)
    cfg = load_config(TrainExperiment, path, ["optim.steps=7", "optim.lr=1e-3",
                                               "model.n_features=16", "optim.steps=9"])  # fmt: skip
    assert (cfg.optim.steps, cfg.optim.lr, cfg.model.n_features) == (9, 0.001, 16)
    assert (cfg.optim.batch_size, cfg.task.length) == (4, 4)  # the file's other keys
    # a string key takes the text of a value that reads as a number
    assert load_config(TrainExperiment, path, ["run.out=2024"]).run.out == "2024"
    # a file's relative paths are the file's folder's; those of --set the working directory's
    text = SORT.replace('name = "sort"\nlength = 4\nvocab = 5', 'name = "charlm"\ncontext = 4')
    path.write_text(text.replace("context = 4", 'context = 4\ntext_path = "a.txt"'))
    assert load_config(TrainExperiment, path).task.text_path == str(tmp_path / "a.txt")
    cfg = load_config(TrainExperiment, path, ["task.text_path=b.txt"])
    assert cfg.task.text_path == "b.txt"
    # the generic loader (solve, converge, analyze) too, and the built-in defaults
    sets = ["grid.tokens=simpson", "solve.n_tokens=17"]
    cfg, source = _config.experiment(SolveExperiment, None, sets)
    assert (cfg.grid.tokens, cfg.solve.n_tokens, cfg.model.n_layers) == ("simpson", 17, 6)
    assert source == "<built-in default> --set grid.tokens=simpson --set solve.n_tokens=17"
    assert _config.experiment(SolveExperiment, None, []) == (
        SolveExperiment(),
        "<built-in default>",
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "optim.stepz=10",
            "unknown key `optim.stepz`; did you mean `optim.steps`? (keys of [optim]: lr, warmup,",
        ),
        ("optm.steps=10", "unknown key `optm`; did you mean `optim.steps`? (tables: task, "),
        ("steps=10", "unknown key `steps`; did you mean `optim.steps`?"),
        ("model.n_featurs=64", "unknown key `model.n_featurs`; did you mean `model.n_features`?"),
        ("model.width=64", "`model.width` was renamed; set `model.n_features` instead"),
        ("optim.steps=abc", "`optim.steps` must be an integer, got 'abc'"),
        ("optim.steps=1.5", "`optim.steps` must be an integer, got 1.5"),
        ("model.final_norm=yes", "`model.final_norm` must be true or false, got 'yes'"),
        ("optim.lr=[1, 2]", "`optim.lr` must be a number, got [1, 2]"),
        ("optim=3", "`optim` is a table; set one of its keys, e.g. `optim.lr`"),
        ("optim.lr.x=3", "`optim.lr` is a value, not a table: it has no key `x`"),
    ],
)
def test_a_bad_set_names_the_key_and_the_fix(tmp_path, capsys, override, message):
    assert main(["train", "--set", override, "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"itde train: error: `--set` {override!r}: "), line
    assert message in line, line
    assert not (tmp_path / "o").exists()


def test_set_is_checked_with_the_whole_config_and_its_form(tmp_path, capsys):
    cfg = tmp_path / "sort.toml"
    cfg.write_text(SORT)
    # a value right alone but wrong with the file's others: the file and the --set named
    assert main(["train", "--config", str(cfg), "--set", "optim.warmup=4"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"itde train: error: {cfg} --set optim.warmup=4: `optim.warmup`=4 "
                           "must be >= 0 and less than `optim.steps`=4"), line  # fmt: skip
    assert main(["solve", "--set", "optim.steps"]) == 2
    assert "`--set` 'optim.steps' is not KEY=VALUE with a dotted KEY; write e.g." in (
        _one_line(capsys)
    )
    assert main(["solve", "--set", "model.n_heads=5"]) == 2
    assert (
        "<built-in default> --set model.n_heads=5: `model.n_heads`=5 does not divide "
        "`model.n_features`=32"
    ) in _one_line(capsys)
    for argv in (["converge", "--checkpoint", "x"], ["analyze", "--hf", "x"]):
        assert main([*argv, "--set", "model.n_layers=2"]) == 2
        line = _one_line(capsys)
        assert "--set" in line and line.startswith(f"itde {argv[0]}: error: "), line
    with pytest.raises(_config.ConfigError, match=r"a list of KEY=VALUE strings"):
        load_config(TrainExperiment, None, "optim.steps=3")


@pytest.mark.runs("train sort", "train --set")
def test_set_changes_the_run_and_the_saved_config_records_it(tmp_path, capsys):
    """The file says 4 steps, `--set` 2 and a learning rate: the run takes 2 steps at that
    rate, its checkpoint's config says so, and its progress in a log (stderr is not a
    terminal here) is whole lines. A resume may change a resumable key with --set, not
    another."""
    cfg = tmp_path / "sort.toml"
    cfg.write_text(SORT)
    out = tmp_path / "run"
    argv = [
        "train",
        "--config",
        str(cfg),
        "--out",
        str(out),
        "--set",
        "optim.steps=2",
        "--set",
        "optim.lr=0.02",
        "--set",
        "run.checkpoint_every=1",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["lr"] == 0.02  # no warm-up: step 0 at the peak rate
    saved = json.loads((out / "checkpoint.json").read_text())["config"]
    assert (saved["optim"]["steps"], saved["optim"]["lr"], saved["run"]["checkpoint_every"]) == (
        2,
        0.02,
        1,
    )
    assert saved["optim"]["batch_size"] == 4  # the file's
    assert f"itde train ({cfg} --set optim.steps=2 --set optim.lr=0.02" in captured.out
    # the progress bar in a log: one line per stage, none joined by carriage returns
    assert "\r" not in captured.err, repr(captured.err)
    bar = [line for line in captured.err.splitlines() if line.startswith("itde train:")]
    assert [re.search(r"(\d+)% (\d)/2", line).groups() for line in bar] == [
        ("50", "1"),
        ("100", "2"),
    ], bar
    # resuming with --set: a resumable key may change (the run is complete: nothing to do),
    # another is refused, the --set named
    assert main(["train", "--resume", str(out), "--set", "run.log_every=2"]) == 0
    assert "is already complete at step 2" in capsys.readouterr().out
    assert main(["train", "--resume", str(out), "--set", "optim.steps=3"]) == 2
    line = _one_line(capsys)
    assert line.startswith(f"itde train: error: the config of {out / 'checkpoint.json'} "
                           "--set optim.steps=3: cannot resume"), line  # fmt: skip
    assert "['optim.steps']" in line


@pytest.mark.runs("analyze --config", "analyze --set")
def test_set_on_analyze(tmp_path, capsys):
    """The file's 2 layers become 1, its 5 tokens 3 (solve and converge: `--set` runs in
    test_cli.py and test_commands.py)."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(SOLVE)
    out = tmp_path / "analyze"
    argv = [
        "analyze",
        "--config",
        str(cfg),
        "--set",
        "model.n_layers=1",
        "--set",
        "solve.n_tokens=3",
        "--inputs",
        "1",
        "--no-lyapunov",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    report = json.loads((out / "analysis.json").read_text())
    assert report["depths"] == [0.0, 1.0] and report["tokens"] == 3
    assert "lyapunov" not in report  # --no-lyapunov
    assert report["source"]["path"] == f"{cfg} --set model.n_layers=1 --set solve.n_tokens=3"
    assert "\r" not in capsys.readouterr().err


# ------------------------------------------------------------------- progress in a log
def _count(bar, n):
    for _ in range(n):
        bar.update()
    bar.close()


def test_progress_in_a_log_file_is_a_line_a_tenth(tmp_path):
    from itde._internal import LogLines, progress_bar

    path = tmp_path / "log"
    with open(path, "w") as f:
        bar = progress_bar(1000, "steps", file=f)
        assert isinstance(bar, LogLines)
        bar.set_postfix(loss="0.5")
        _count(bar, 1000)
    text = path.read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert [int(re.match(r"steps: +(\d+)% ", line).group(1)) for line in lines] == list(
        range(10, 101, 10)
    ), lines
    assert all(len(line) < 120 and "loss=0.5" in line for line in lines), lines
    # a resumed count starts at its own tenth; a run stopped early says where it stopped
    buf = io.StringIO()
    bar = progress_bar(100, "r", file=buf, initial=45)
    _count(bar, 20)
    assert re.findall(r"(\d+)/100", buf.getvalue()) == ["50", "60", "65"]
    # a stage count of 3: a line per stage
    buf = io.StringIO()
    _count(progress_bar(3, "rows", file=buf), 3)
    assert re.findall(r"(\d+)/3", buf.getvalue()) == ["1", "2", "3"]
    buf = io.StringIO()  # off: nothing
    _count(progress_bar(3, "rows", file=buf, enabled=False), 3)
    assert buf.getvalue() == ""


def test_progress_on_a_terminal_is_tqdms_bar():
    """The same count on a terminal (a pseudo-terminal) is tqdm's bar, redrawn in place."""
    import tqdm.std

    from itde._internal import LogLines, progress_bar

    leader, follower = os.openpty()
    with open(follower, "w") as tty:  # 20 redraws: within the pty's buffer, read after
        bar = progress_bar(20, "steps", file=tty, mininterval=0, miniters=1)
        assert type(bar) is tqdm.std.tqdm and not isinstance(bar, LogLines)
        _count(bar, 20)
        tty.flush()
        shown = b""
        while select.select([leader], [], [], 0.5)[0]:  # all the pty holds
            shown += os.read(leader, 1 << 16)
        shown = shown.decode()
    os.close(leader)
    assert shown.count("\r") >= 20 and "100%" in shown, shown


def test_training_clock_restart_writes_no_extra_line():
    """The train loop restarts the bar's clock after the first step (it compiled): in a log
    that is no second line for that step."""
    from itde._internal import progress_bar
    from itde.train._internal import restart_clock

    buf = io.StringIO()
    bar = progress_bar(4, "itde train", file=buf)
    for s in range(4):
        bar.update()
        if s == 0:
            restart_clock(bar)
    bar.close()
    assert re.findall(r"(\d)/4", buf.getvalue()) == ["1", "2", "3", "4"], buf.getvalue()
