"""Test configuration: float64 is enabled for the whole suite; float32 tests pass
float32 arrays explicitly (training runs in float32)."""

import os

os.environ.setdefault("MPLBACKEND", "Agg")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
