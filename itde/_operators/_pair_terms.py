"""Pair terms of the attention kernel: arrays `[..., queries, keys]` or functions of
`(query_index, key_index)`, read one block of query and key indices at a time. The
blocked, dense and fused cores (`_blocked.py`) and the windows (`_window.py`) both read
them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_function(x) -> bool:
    """Whether a pair term is a function of `(query_index, key_index)` (not an array)."""
    return callable(x) and not isinstance(x, (jax.Array, np.ndarray))


def pair_block(x, iq, ik, dtype):
    """The block of a pair term for query indices `iq` and key indices `ik` (or None)."""
    if x is None:
        return None
    if is_function(x):
        return jnp.asarray(x(iq, ik)).astype(dtype)
    return jnp.asarray(x).astype(dtype)[..., iq[:, None], ik[None, :]]
