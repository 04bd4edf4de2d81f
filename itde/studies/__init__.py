"""Convergence studies: observed orders in the depth step and in the resolution.

Its names load their modules on first use, so that `import itde.studies` imports no JAX
and the command line reads the config of `itde converge` while it builds its parser."""

import importlib as _importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names, imported eagerly for type checkers and the API docs
    from ._depth import format_table, run_depth_study, write_outputs  # noqa: F401
    from ._grid import run_grid_study  # noqa: F401
    from ._model_study import format_model_study, model_depth_study, write_model_study  # noqa: F401

#: The public names, each with the module that defines it.
_EXPORTS = {
    "format_model_study": "._model_study",
    "format_table": "._depth",
    "model_depth_study": "._model_study",
    "run_depth_study": "._depth",
    "run_grid_study": "._grid",
    "write_model_study": "._model_study",
    "write_outputs": "._depth",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
