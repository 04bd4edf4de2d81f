"""The project's own door into `itde.train`'s private modules, for its tests, its command line
(`itde.cli`) and its benchmarks: what they need of `itde.train` that is not public is
reached here, and nowhere else (tests/test_private_boundary.py checks it).

No stability promise: a name here may change or go with any commit. Users import from
`itde.train`. This module only re-exports: each name is read from the module that defines
it, on each use; a name that is a module is that module itself, for the tests that patch one
of its globals.
"""

import importlib as _importlib
from typing import Any as _Any

#: name -> the module (relative to `itde.train`) that defines it; a name mapped to "" is the
#: module `itde.train.<name>` itself.
_EXPORTS = {
    # modules, for the tests that patch or read one of their globals
    "_checkpoint": "",
    "_sample": "",
    "_sharding": "",
    # memory budget
    "check_fits": "._budget",
    "eval_set_bytes": "._budget",
    "step_bytes": "._budget",
    # runs: configs, checkpoints, the loop
    "RENAMED": "._config",
    "SHARDED": "._checkpoint",
    "batch_devices": "._load",
    "config_for_resume": "._loop",
    "read_run": "._load",
    "restart_clock": "._loop",
    "_save": "._loop",
    # models and their optimisation
    "cross_entropy": "._model",
    "init_field_model": "._model",
    "init_token_model": "._model",
    "integrate": "._model",
    "_decay_mask": "._optim",
    "_labels": "._optim",
    "_output": "._model",
    # fine-tuning from a Hugging Face directory
    "HFInit": "._init",
    "export": "._finetune",
    "_converted": "._init",
    "_stamp": "._init",
    # sampling, plots, the layout over devices
    "FILTER_NAMES": "._sample",
    "_check": "._sample",
    "figure_metrics": "._loss_plot",
    "fsdp_sharding": "._sharding",
    "to_host": "._sharding",
}


def __getattr__(name: str) -> _Any:  # a name or a module: typed as anything
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module:
        value = getattr(_importlib.import_module(module, "itde.train"), name)
    else:
        value = _importlib.import_module(f".{name}", "itde.train")
    return value  # looked up on every use: a test's patch of the module is seen here


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = list(_EXPORTS)
