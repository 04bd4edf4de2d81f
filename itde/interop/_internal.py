"""The project's own door into `itde.interop`'s private modules, for its tests and its command
line (`itde.cli`): what they need of `itde.interop` that is not public is reached here, and
nowhere else (tests/test_private_boundary.py checks it).

No stability promise: a name here may change or go with any commit. Users import from
`itde.interop`. This module only re-exports: each name is read from the module that defines
it, on each use; a name that is a module is that module itself, for the tests that patch one
of its globals.
"""

import importlib as _importlib
from typing import Any as _Any

#: name -> the module (relative to `itde.interop`) that defines it; a name mapped to "" is the
#: module `itde.interop.<name>` itself.
_EXPORTS = {
    # modules, for the tests that patch or read one of their globals
    "_hf_family": "",
    "_hf_glue": "",
    "_pretrained": "",
    # families and their pieces
    "LlamaFamily": "._hf_llama",
    "NEAREST": "._hf_missing",
    "NoPositions": "._positions",
    "ViTFamily": "._hf_vit",
    "check_safetensors": "._hf_files",
    "float64_patches": "._hf_llama",
    "transformers_fields": "._hf_family",
    "_BASE_FIELDS": "._hf_family",
}


def __getattr__(name: str) -> _Any:  # a name or a module: typed as anything
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if module:
        value = getattr(_importlib.import_module(module, "itde.interop"), name)
    else:
        value = _importlib.import_module(f".{name}", "itde.interop")
    return value  # looked up on every use: a test's patch of the module is seen here


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = list(_EXPORTS)
