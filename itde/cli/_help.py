"""Help text that costs nothing until it is shown: `itde --help` imports no JAX.

Choices and lists that come from a registry (`itde.SCHEMES`, `itde.train.TASKS`) are
read from it only when a command's help is printed or an option's value is checked.
"""

from __future__ import annotations

import argparse
import importlib
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


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose `description` and `epilog` may be callables returning the
    text, called only when the help is formatted; paragraphs keep their line breaks."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def format_help(self) -> str:
        for attr in ("description", "epilog"):
            text = getattr(self, attr)
            if callable(text):
                setattr(self, attr, text())
        return super().format_help()


def writes(*files: tuple[str, str]) -> str:
    """The "writes:" paragraph of a command's help: one line per (file, what it holds)."""
    width = max(len(f) for f, _ in files) + 2
    return "writes, into the output directory:\n" + "\n".join(
        f"  {f:<{width}}{what}" for f, what in files
    )
