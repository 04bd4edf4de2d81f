"""The project's own door into `itde.studies`'s private modules, for its tests, its command
line (`itde.cli`) and its benchmarks: what they need of `itde.studies` that is not public is
reached here, and nowhere else (tests/test_private_boundary.py checks it).

No stability promise: a name here may change or go with any commit. Users import from
`itde.studies`. This module only re-exports: each name is read from the module that defines
it, on each use; a name that is a module is that module itself, for the tests that patch one
of its globals.
"""

import importlib as _importlib
from typing import Any as _Any

#: name -> the module (relative to `itde.studies`) that defines it; a name mapped to "" is the
#: module `itde.studies.<name>` itself.
_EXPORTS = {
    # modules, for the tests that patch one of their globals
    "_depth": "",
    "_grid": "",
    "_model_study": "",
    # the schema of `itde converge`
    "AXES": "._converge_config",
    "ConvergeExperiment": "._converge_config",
    "ProblemConfig": "._converge_config",
    "StudyConfig": "._converge_config",
    # the studies' pieces
    "GridProblem": "._grid",
    "build_problem": "._depth",
    "figure_study": "._depth",
    "order_check": "._model_study",
}


def __getattr__(name: str) -> _Any:  # a name or a module: typed as anything
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module:
        value = getattr(_importlib.import_module(module, "itde.studies"), name)
    else:
        value = _importlib.import_module(f".{name}", "itde.studies")
    return value  # looked up on every use: a test's patch of the module is seen here


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = list(_EXPORTS)
