"""Which commands the suite must run, and which it does (see `test_commands.py`).

A *command* is a code path of the `itde` command line, named by a key:

- `converge --axis AXIS` for every choice of `--axis`, `converge --checkpoint`,
  `converge --hf`;
- `analyze --config` (the built-in config included), `analyze --checkpoint`,
  `analyze --hf`, and `analyze --exponent NAME` for every token exponent but the default
  (`itde.analysis.TOKEN_EXPONENTS`);
- `train TASK` for every task of `itde.train.TASKS`, and `train --resume`;
- every other subcommand by its name (`solve`, `eval`, `sample`, and any added later);
- `COMMAND --set` for every subcommand that has `--set` (a config key overridden from
  the command line), besides the key of the command it runs;
- `README.md python blocks`, `README.md shell blocks`: the README's code blocks, run as
  written by `tests/test_readme.py`.

A test that runs commands says so with `@pytest.mark.runs("converge --axis tokens", ...)`.
The conftest records every command that `itde.cli.main` completes with status 0 in the
test process (`RAN`), and a marked test whose commands did not all run fails.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_KEYS = ("README.md python blocks", "README.md shell blocks")

#: every command key completed (status 0) by `itde.cli.main` in this process
RAN: set[str] = set()


def _subparsers(parser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def command_key(args: argparse.Namespace) -> str:
    """The key of a parsed command line (its config file read for the axis or the task)."""
    from itde._internal import _config
    from itde.studies._internal import ConvergeExperiment

    c = args.command
    if c == "converge":
        for source in ("checkpoint", "hf"):
            if getattr(args, source) is not None:
                return f"converge --{source}"
        cfg, _ = _config.experiment(ConvergeExperiment, args.config, args.set)
        return f"converge --axis {args.axis or cfg.study.axis}"
    if c == "analyze":
        if getattr(args, "exponent", "exact") != "exact":
            return f"analyze --exponent {args.exponent}"
        for source in ("checkpoint", "hf"):
            if getattr(args, source) is not None:
                return f"analyze --{source}"
        return "analyze --config"
    if c == "train":
        if args.resume is not None:
            return "train --resume"
        from itde.train import TrainExperiment, load_config

        cfg = load_config(TrainExperiment, args.config, args.set)
        return f"train {cfg.task.name}"
    return c


def expected_keys() -> set[str]:
    """Every command key of the parser and the registries, and the README's blocks."""
    import itde.train
    from itde.cli._internal import build_parser

    keys = set(README_KEYS)
    for name, p in _subparsers(build_parser()).items():
        if name == "converge":
            (axis,) = [a for a in p._actions if a.dest == "axis"]
            keys |= {f"converge --axis {a}" for a in axis.choices}
            keys |= {"converge --checkpoint", "converge --hf"}
        elif name == "analyze":
            from itde.analysis import TOKEN_EXPONENTS

            keys |= {"analyze --config", "analyze --checkpoint", "analyze --hf"}
            keys |= {f"analyze --exponent {e}" for e in TOKEN_EXPONENTS if e != "exact"}
        elif name == "train":
            keys |= {f"train {task}" for task in itde.train.TASKS} | {"train --resume"}
        else:
            keys.add(name)
        if any(a.dest == "set" for a in p._actions):
            keys.add(f"{name} --set")
    return keys


def declared_runs(tests: Path = ROOT / "tests") -> dict[str, list[tuple[str, bool]]]:
    """`{key: [(test id, slow), ...]}` from the `@pytest.mark.runs(...)` decorators of the
    test modules, read from their source (whatever `-k` or `-m` selected). A test counts
    as slow when any of its decorators, or its module's `pytestmark`, names `mark.slow`
    (a test partly parametrized slow counts as slow)."""
    found: dict[str, list[tuple[str, bool]]] = {}
    for path in sorted(tests.glob("test_*.py")):
        tree = ast.parse(path.read_text(), str(path))
        module_slow = any(
            isinstance(node, ast.Assign)
            and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
            and "mark.slow" in ast.unparse(node.value)
            for node in tree.body
        )
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            slow = module_slow or any("mark.slow" in d for d in decorators)
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and ast.unparse(d.func) == "pytest.mark.runs":
                    for arg in d.args:
                        found.setdefault(arg.value, []).append((f"{path.name}::{node.name}", slow))
    return found


def readme_commands(readme: Path = ROOT / "README.md") -> list[tuple[int, str]]:
    """`(line, command)` for every `itde ...` command of the README: in its `bash` blocks,
    and in inline code that is a whole command (it parses; `DIR` and `FILE` stand for a
    path; `--help` and fragments such as `itde eval --dt` are left out)."""
    from itde.cli._internal import build_parser

    text = readme.read_text()
    out = []
    for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S):
        first = text[: m.start()].count("\n") + 2
        for i, line in enumerate(m.group(1).splitlines()):
            for cmd in line.split(" #")[0].split("&&"):
                if cmd.strip().startswith("itde "):
                    out.append((first + i, cmd.strip()))
    for m in re.finditer(r"`(itde [^`]+)`", text):
        cmd = m.group(1)
        if "--help" in cmd or "/--" in cmd:
            continue
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                build_parser().parse_args(shlex.split(cmd)[1:])
        except SystemExit:
            continue
        out.append((text[: m.start()].count("\n") + 1, cmd))
    return out


def key_of_command(cmd: str) -> str:
    """The key of a command line as the README writes it (paths relative to the root)."""
    from itde.cli._internal import build_parser

    argv = shlex.split(cmd)[1:]
    args = build_parser().parse_args(argv)
    if getattr(args, "config", None):
        args.config = str(ROOT / args.config)
    return command_key(args)


def start_recording() -> None:
    """Record every command `itde.cli.main` completes with status 0 into `RAN` (once per
    process; `main` builds its parser through the module attribute patched here)."""
    from itde.cli._internal import _main as cli_main

    if getattr(cli_main.build_parser, "_records", False):
        return
    build = cli_main.build_parser

    def recording_build_parser():
        parser = build()
        parse = parser.parse_args

        def parse_args(argv=None, namespace=None):
            args = parse(argv, namespace)
            func = args.func

            def recorded(a):
                status = func(a)
                if status == 0:
                    RAN.add(command_key(a))
                    if getattr(a, "set", None):
                        RAN.add(f"{a.command} --set")
                return status

            args.func = recorded
            return args

        parser.parse_args = parse_args
        return parser

    recording_build_parser._records = True
    cli_main.build_parser = recording_build_parser
