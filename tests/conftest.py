"""Test configuration, the one place that sets the numeric mode of the suite.

- float64: `jax_enable_x64` is on for the whole session, set here before any test module
  is imported. Tests never toggle it; float32 and bfloat16 tests pass their dtypes
  explicitly (training runs in float32).
- torch is a test dependency (`pip install -e ".[test,torch]"`), the reference that
  several equivalence tests compare with. The session stops before collecting anything
  when it is missing: a missing reference fails loudly instead of turning tests into
  skips or into a scatter of import errors. Test modules import torch plainly.
"""

import importlib.util
import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)


def pytest_configure(config):
    if importlib.util.find_spec("torch") is None:
        raise pytest.UsageError(
            "torch is not installed, but it is a test dependency (the PyTorch reference of "
            'the equivalence tests): install it with `pip install -e ".[test,torch]"`.'
        )
