"""Public names renamed for one meaning per name (issue 46) keep their old spelling for one
release: the same object, with a `DeprecationWarning` that names the new spelling."""

import importlib
import warnings

import pytest

RENAMED = [
    ("itde.train", "init_from_hf", "init_from_hf_dir"),
    ("itde.train", "export_hf", "export_hf_dir"),
]


@pytest.mark.parametrize(("module", "old", "new"), RENAMED, ids=[r[1] for r in RENAMED])
def test_an_old_name_is_the_new_object_and_warns_naming_it(module, old, new):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning) as said:
        value = getattr(mod, old)
    assert value is getattr(mod, new)
    assert str(said[0].message) == (
        f"{module}.{old} is deprecated and goes in the next release; use {module}.{new}"
    )
    assert said[0].filename == __file__  # it points at the caller's line
    with pytest.warns(DeprecationWarning, match=rf"use {module}\.{new}$"):
        exec(f"from {module} import {old}", {})
    assert old not in mod.__all__ and new in mod.__all__


def test_new_names_do_not_warn_and_unknown_names_still_fail():
    import itde.train

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module, _, new in RENAMED:
            getattr(importlib.import_module(module), new)
    with pytest.raises(AttributeError, match="has no attribute 'export_hf_directory'"):
        itde.train.export_hf_directory  # noqa: B018
