"""The `itde` command line: `solve`, `converge`, `train`, `eval`, `sample`."""

from ._main import main

__all__ = ["main"]
