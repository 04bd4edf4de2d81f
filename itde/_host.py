"""Host arrays onto the device without compiling anything.

`jnp.asarray` of a NumPy array compiles a small program per shape (a copy, or a dtype
conversion), which JAX keeps; code that runs eagerly at many shapes (the padding of
[`itde.solve`][itde.solve]) moves its host arrays with [`to_device`][] instead.
"""

from __future__ import annotations

import jax
import numpy as np


def to_device(x, like=None) -> jax.Array:
    """The host array `x` on the device of `like` (the default device without one, or when
    `like` spans several), converted on the host to JAX's canonical dtype (float64 becomes
    float32 unless `jax_enable_x64` is on), by `jax.device_put`."""
    x = np.asarray(x)
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype != dtype:
        x = x.astype(dtype)
    devices = getattr(like, "devices", None)
    held = devices() if callable(devices) else ()
    return jax.device_put(x, next(iter(held)) if len(held) == 1 else None)
