"""Random parameters drawn flat and reshaped: the same values, a fraction of the compile.

Eager `jax.random.uniform(key, shape)` compiles one XLA program per distinct shape, and
on CPU the threefry generator for a 3-D shape takes about four times as long to compile as
for the flat shape with the same number of entries (1.08 s against 0.24 s for `(6, 7, 8)`
on the project's 2-core machine). The values are the same either way: JAX draws the bits
of a shaped array over its flat index, so `uniform(key, (a, b)) ==
uniform(key, (a * b,)).reshape(a, b)` bit for bit (tested in `tests/test_operators.py`).
Initialisers therefore draw flat, and a model's first construction stops being dominated
by compiling random-number generators.
"""

from __future__ import annotations

import math

import jax


def uniform(key, shape: tuple[int, ...], dtype, low: float, high: float):
    """`jax.random.uniform(key, shape, dtype, low, high)`, drawn flat."""
    flat = jax.random.uniform(key, (math.prod(shape),), dtype, low, high)
    return flat.reshape(shape)


def normal(key, shape: tuple[int, ...], dtype):
    """`jax.random.normal(key, shape, dtype)`, drawn flat."""
    return jax.random.normal(key, (math.prod(shape),), dtype).reshape(shape)
