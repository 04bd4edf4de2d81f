"""Help text that costs nothing until it is shown: `itde --help` imports no JAX.

Choices and lists that come from a registry (`itde.SCHEMES`, `itde.train.TASKS`) are
read from it only when a command's help is printed or an option's value is checked.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import re
import sys
from collections.abc import Sequence


class Names(Sequence):
    """The names (keys) of the registry `attribute` of the public module `module`, loaded
    on first use; usable as argparse `choices` and in `%(choices)s`."""

    def __init__(self, module: str, attribute: str):
        self.module, self.attribute = module, attribute

    def _names(self) -> list[str]:
        return list(getattr(importlib.import_module(self.module), self.attribute))

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())

    def __str__(self) -> str:
        return ", ".join(self._names())

    def __repr__(self) -> str:
        return f"Names({self.module}.{self.attribute})"


def _nearest(word: str, names) -> str | None:
    """The name of `names` closest to `word` (difflib), or None if none is close."""
    near = difflib.get_close_matches(word, [str(n) for n in names], n=1)
    return near[0] if near else None


#: What argparse reads as a negative number (a value) rather than an option: any float
#: Python's `float` reads with a minus sign, exponent, infinity and NaN included.
NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$|^-(inf|infinity|nan)$", re.I)


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose `description` and `epilog` may be callables returning the
    text, called only when the help is formatted; paragraphs keep their line breaks.

    Its mistakes are those of the command they belong to: an argument a subcommand does not
    know is reported with that subcommand's usage and prefix (`itde train: error: ...`,
    not the top level's), with the nearest option it has; a value that is not one of the
    choices (a misspelt subcommand, `--scheme rk5`) names the nearest choice.

    Every negative number is a value, not an option (`--rtol -1e-6`, `--dt -inf`): argparse
    takes only `-1` and `-0.5` for numbers, so `-1e-6` ended in "expected one argument"
    before the command's own range check could name the flag and the range."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_NUMBER  # read by argparse's parser

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command_parser(namespace)
            message = f"unrecognized arguments: {' '.join(extras)}"
            options = [o for a in parser._actions for o in a.option_strings]
            for arg in extras:
                if arg.startswith("-"):
                    near = _nearest(arg.split("=")[0], options)
                    if near is not None:
                        message += f"; did you mean {near}?"
                        break
            parser.error(message)
        return namespace

    def _command_parser(self, namespace) -> argparse.ArgumentParser:
        """The parser of the subcommand chosen in `namespace` (this parser if none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, Parser):
                    return chosen._command_parser(namespace)
                if chosen is not None:
                    return chosen
        return self

    def _check_value(self, action, value):
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as e:
            near = _nearest(str(value), action.choices)
            if near is None or "did you mean" in str(e.message):
                raise
            raise argparse.ArgumentError(action, f"{e.message}; did you mean {near!r}?") from None

    def format_help(self) -> str:
        for attr in ("description", "epilog"):
            text = getattr(self, attr)
            if callable(text):
                setattr(self, attr, text())
        return super().format_help()


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option, kept one release: it stores into the new option's
    `dest` (its value checked against the same `choices`) after a one-line note on stderr
    naming the new spelling, and is left out of the help and the reference page.

    `p.add_argument("--solver", dest="scheme", action=DeprecatedAlias, new="--scheme",
    choices=...)` beside `p.add_argument("--scheme", choices=...)`."""

    def __init__(self, option_strings, dest, *, new: str, **kwargs):
        kwargs["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated and goes in the next "
              f"release; use {self.new}", file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def writes(*files: tuple[str, str]) -> str:
    """The "writes:" paragraph of a command's help: one line per (file, what it holds)."""
    width = max(len(f) for f, _ in files) + 2
    return "writes, into the output directory:\n" + "\n".join(
        f"  {f:<{width}}{what}" for f, what in files
    )


def add_set_option(parser: argparse.ArgumentParser, example: str) -> None:
    """Add `--set KEY=VALUE` to the parser of a command that reads a TOML config
    (`--config`): one key of the config overridden after the file, before the config is
    checked (`itde._config.override`); repeatable. `example`: a KEY=VALUE for the help."""
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help=f"override one key of the config, e.g. --set {example}: applied after the file "
        "(or the built-in values) and checked as the file's keys are; VALUE is a TOML value "
        "(150, 1e-3, true, '[1, 2]') or else plain text; repeatable, the last wins "
        "(default: none)",
    )  # fmt: skip


def add_compilation_cache_options(parser: argparse.ArgumentParser) -> None:
    """Add `--compilation-cache DIR` and `--no-compilation-cache` (one or the other): where
    JAX's persistent compilation cache is kept for this run (`itde._compilation_cache`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--compilation-cache", metavar="DIR",
        help="keep the compiled programs in DIR (created if missing), so that the next "
        "command that runs them loads them instead of compiling them again (default: the "
        "environment variable ITDE_COMPILATION_CACHE, a directory or `off`; else jax/ in "
        "the per-user cache directory, ~/.cache/itde unless XDG_CACHE_HOME or ITDE_CACHE_DIR "
        "moves it)",
    )  # fmt: skip
    group.add_argument(
        "--no-compilation-cache", action="store_true",
        help="compile every program afresh and write no compilation cache (as "
        "ITDE_COMPILATION_CACHE=off)",
    )  # fmt: skip
