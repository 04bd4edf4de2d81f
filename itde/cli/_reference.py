"""The command line's reference page, generated from the parser itself (so it cannot fall
behind the options): every command, its options with their defaults, and the files it
writes. The docs build calls `reference_markdown()` (`docs/hooks.py`)."""

from __future__ import annotations

import argparse


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _option_rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| option | value | default | meaning |", "|---|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if action.help == argparse.SUPPRESS:  # a deprecated alias (DeprecatedAlias)
            continue
        names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}`"
        if action.nargs == 0:
            value = ""
        else:
            metavar = action.metavar or action.dest.upper()
            value = f"`{' '.join(metavar) if isinstance(metavar, tuple) else metavar}`"
            if action.nargs in ("*", "+"):
                value += " ..."
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) else f"`{default}`"
        help_text = (action.help or "") % {"default": default, "choices": action.choices,
                                           "prog": parser.prog} if action.help else ""  # fmt: skip
        rows.append(f"| {names} | {value} | {shown} | {_cell(help_text)} |")
    return rows


def reference_markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """Markdown for every command of `parser` (default: the `itde` parser): its
    description, usage, an options table, and its epilogue (tasks, the files it writes)."""
    if parser is None:
        from ._main import build_parser

        parser = build_parser()
    out = [parser.description or "", ""]
    for name, sub in _subcommands(parser).items():
        sub.format_help()  # resolves a description or epilogue given as a callable
        out += [f"## `{parser.prog} {name}`", ""]
        out += [" ".join((sub.description or "").split()), ""]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        out += _option_rows(sub) + [""]
        if sub.epilog:
            out += ["```text", sub.epilog.strip("\n"), "```", ""]
    return "\n".join(out)
