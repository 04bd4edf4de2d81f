"""Mixed precision: matrix products in the parameters' half precision, the rest wider.

A model whose parameters are bfloat16 (or float16) multiplies matrices in that dtype with
the products accumulated and returned in the state's dtype (float32 inside a solve: diffrax
promotes the state to the dtype of its times, which are never narrower than float32).
Parameters in float32 or float64 are cast to the state's dtype, as before: the float32 and
float64 paths are unchanged bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp

HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def contract(spec: str, x, w):
    """`jnp.einsum(spec, x, w)` in `w`'s dtype if that is a half precision (accumulated and
    returned in `x`'s dtype), else in `x`'s dtype."""
    if jnp.dtype(w.dtype) in HALF and jnp.dtype(x.dtype) not in HALF:
        return jnp.einsum(spec, x.astype(w.dtype), w, preferred_element_type=x.dtype)
    return jnp.einsum(spec, x, w.astype(x.dtype))


def wide(dtype):
    """The dtype statistics are taken in: float32 or wider."""
    return jnp.promote_types(dtype, jnp.float32)
