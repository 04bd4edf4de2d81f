"""The project's own door into `itde`'s private modules, for its tests, its command line
(`itde.cli`) and its benchmarks: what they need of the core that is not public is reached
here, and nowhere else (tests/test_private_boundary.py checks it).

No stability promise: a name here may change or go with any commit. Users import from
`itde`. This module only re-exports: each name is read from the module that defines it, on
each use (as `itde` does, so that `itde --help` imports no JAX); a name that is a module is
that module itself, for the tests that patch one of its globals.
"""

import importlib as _importlib
from typing import Any as _Any

#: name -> the module (relative to `itde`) that defines it; a name mapped to "" is the module
#: `itde.<name>` itself.
_EXPORTS = {
    # modules, for the tests and benchmarks that patch or read one of their globals
    "_compilation_cache": "",
    "_config": "",
    "_solve": "",
    # the compilation cache of a command's run
    "session": "._compilation_cache",
    # the configs' value checks and the files the commands write
    "SEED_MAX": "._config",
    "choices": "._config",
    "described": "._config",
    "from_dict": "._config",
    "override": "._config",
    "positive": "._config",
    "seed": "._config",
    "atomic_write": "._io",
    "check_output_dir": "._io",
    "check_output_location": "._io",
    "write_json": "._io",
    # progress lines
    "LogLines": "._progress",
    "Stages": "._progress",
    "estimate_line": "._progress",
    "format_duration": "._progress",
    "progress_bar": "._progress",
    "stage_line": "._progress",
    # the equation's pieces
    "BLOCK_PARTS": "._controls",
    "block_from_names": "._blocks",
    "check_depth_step": "._solve",
    "check_filters": "._next_token",
    "check_filters_sample": "._next_token",
    "check_weights": "._quadrature._domain",
    "feature_mean": "._operators._layernorm",
    "figure_trajectory": "._plot",
    "key_block_plan": "._operators._blocked",
    "kernel": "._roles",
    "legendre": "._polynomials",
    "normal": "._random",
    "plot_trajectory": "._plot",
    "rotate": "._operators._rope",
    "scheme": "._registry",
    "terms_kind": "._solve",
    "uniform": "._random",
    "_step_grid": "._solve",
}


def __getattr__(name: str) -> _Any:  # a name or a module: typed as anything
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module:
        value = getattr(_importlib.import_module(module, "itde"), name)
    else:
        value = _importlib.import_module(f".{name}", "itde")
    return value  # looked up on every use: a test's patch of the module is seen here


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = list(_EXPORTS)
