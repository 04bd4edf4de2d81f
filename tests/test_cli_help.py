"""The command line explains itself: every command has a description and says what it
writes, every option has help with its default and choices (read from itde's registries),
and `itde --help` imports no JAX (`import itde` is lazy)."""

import argparse
import json
import subprocess
import sys

import pytest

import itde
from itde.cli._internal import build_parser

COMMANDS = ("solve", "converge", "analyze", "train", "eval", "sample")


def _subparsers(parser):
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_import_itde_and_top_level_help_import_no_jax():
    """A fresh interpreter: `import itde`, `itde.cli`'s `--help` and every command's parser
    load neither JAX nor NumPy (exports load their modules on first use: next test)."""
    code = """
import contextlib, io, json, sys
import itde, itde.cli
with contextlib.redirect_stdout(io.StringIO()) as buf:
    try:
        itde.cli.main(["--help"])
    except SystemExit:
        pass
def heavy():
    return sorted({m.split(".")[0] for m in sys.modules} & {"jax", "numpy", "diffrax",
                                                          "equinox", "matplotlib"})
before = heavy()
import numpy  # the check is not vacuous: it sees a heavy import
print(json.dumps({"heavy": before, "help": buf.getvalue(), "after": heavy()}))
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)  # fmt: skip
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["heavy"] == [], out["heavy"]
    assert "usage: itde" in out["help"] and all(c in out["help"] for c in COMMANDS)
    assert out["after"] == ["numpy"]


def test_lazy_exports_are_the_same_objects_and_dir_lists_them():
    import importlib

    for name, module in itde._EXPORTS.items():  # the object of the module that defines it
        assert getattr(itde, name) is getattr(importlib.import_module(module, "itde"), name)
    listing = dir(itde)
    assert set(itde.__all__) <= set(listing) and "train" in listing
    assert set(itde._EXPORTS) == set(itde.__all__)
    # the TYPE_CHECKING block (what type checkers and the API docs read) names the same
    # objects from the same modules as the lazy table
    import ast

    tree = ast.parse(open(itde.__file__).read())
    block = next(n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n))
    static = {(a.name, "." * imp.level + (imp.module or "")) for imp in block.body
              for a in imp.names}  # fmt: skip
    assert static == set(itde._EXPORTS.items())
    for name in itde.__all__:
        assert getattr(itde, name) is not None
    assert itde.train.TASKS  # subpackages load on use too
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        itde.Nope
    ns = {}
    exec("from itde import *", ns)
    assert set(itde.__all__) <= set(ns)


def test_every_command_has_a_description_and_says_what_it_writes():
    parser = build_parser()
    top = parser.format_help()
    assert "TOML files read at the edge" not in top  # the old jargon
    subs = _subparsers(parser)
    assert tuple(subs) == COMMANDS
    for name, p in subs.items():
        text = p.format_help()
        assert p.description and len(p.description) > 80, name
        assert "writes" in text, name
    assert "summary.json" in subs["solve"].format_help()
    assert "trajectory.png" in subs["solve"].format_help()
    assert "convergence_depth.png" in subs["converge"].format_help()
    train = subs["train"].format_help()
    for f in ("metrics.jsonl", "loss_curve.png", "checkpoint.json", "state-STEP.eqx"):
        assert f in train
    for task in itde.train.TASKS:  # the tasks, from the registry
        assert f"\n  {task} " in train, task


def test_every_option_has_help_with_its_default_and_choices():
    for name, p in _subparsers(build_parser()).items():
        for a in p._actions:
            if a.dest == "help" or a.help == argparse.SUPPRESS:  # help, deprecated aliases
                continue
            where = f"itde {name} {a.option_strings[0]}"
            assert a.help, f"{where} has no help"
            text = a.help % {**vars(a), "choices": ", ".join(a.choices or ())}
            if not (a.required or isinstance(a, argparse._StoreTrueAction)):
                assert "default" in text, f"{where}: no default in {text!r}"
            if a.choices is not None:
                for c in a.choices:
                    assert c in text, f"{where}: choice {c!r} not in {text!r}"


def test_choices_come_from_the_registries_and_are_checked():
    subs = _subparsers(build_parser())
    scheme = [a for a in subs["eval"]._actions if a.option_strings == ["--scheme"]][0]
    assert list(scheme.choices) == list(itde.SCHEMES)
    help_text = subs["eval"].format_help()
    assert "itde._registry" not in help_text and "rk4" in help_text
    axis = [a for a in subs["converge"]._actions if a.dest == "axis"][0]
    assert list(axis.choices) == ["depth", "tokens", "features", "all"]


@pytest.mark.parametrize("option", ["--scheme", "--solver"])
def test_unknown_scheme_is_refused_naming_the_choices(option, capsys):
    with pytest.raises(SystemExit) as e:
        itde.cli.main(["eval", "--checkpoint", "x", option, "rk5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and "'rk5'" in err and "'rk4'" in err


def test_eval_solver_is_a_deprecated_alias_of_scheme(capsys):
    """`itde eval --solver` (its name before `--scheme`, which every other command
    uses) still works for one release: the same value, a one-line note on stderr, and
    out of the help and the reference page."""
    from itde.cli._internal import reference_markdown

    eval_ = _subparsers(build_parser())["eval"]
    for scheme in itde.SCHEMES:
        new = eval_.parse_args(["--checkpoint", "x", "--scheme", scheme])
        assert capsys.readouterr().err == ""
        old = eval_.parse_args(["--checkpoint", "x", "--solver", scheme])
        assert vars(old) == vars(new) and new.scheme == scheme
        assert capsys.readouterr().err == (
            "itde eval: warning: --solver is deprecated and goes in the next release; "
            "use --scheme\n"
        )
    assert eval_.parse_args(["--checkpoint", "x"]).scheme is None
    assert "--solver" not in eval_.format_help() and "--scheme SCHEME" in eval_.format_help()
    page = reference_markdown(build_parser())
    assert "--solver" not in page and "| `--scheme` | `SCHEME` |" in page
