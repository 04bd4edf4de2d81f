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


def pytest_sessionfinish(session, exitstatus):
    """At the end of a worker's session, drop JAX's garbage-collection callback.

    pytest-xdist ends a worker through execnet, which interrupts the worker's main thread
    (`_thread.interrupt_main`) if it is still busy. When that `KeyboardInterrupt` arrives
    while Python runs a gc callback, here JAX's `_xla_gc_callback` (it frees device buffers
    after each collection), Python reports it as an exception "ignored in" the callback and
    pytest prints a `PytestUnraisableExceptionWarning` traceback before the summary. With
    the callback gone the interrupt lands in ordinary code and the worker ends quietly; at
    this point nothing needs device buffers freed early."""
    import gc

    gc.callbacks[:] = [c for c in gc.callbacks if getattr(c, "__name__", "") != "_xla_gc_callback"]
