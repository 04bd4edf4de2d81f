r"""Legendre polynomials by their three-term recurrence: one implementation for the
depth controls and the Legendre basis."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from ._checks import check_int


def legendre(x: ArrayLike, n: int) -> Float[Array, " n *shape"]:
    r"""The first `n` Legendre polynomials $P_0, \dots, P_{n-1}$ at `x`.

    Computed by Bonnet's recurrence $(k+1)\,P_{k+1}(x) = (2k+1)\,x\,P_k(x) - k\,P_{k-1}(x)$,
    $P_0 = 1$, $P_1 = x$, which is stable on $[-1, 1]$ (where $|P_k| \le 1$).

    **Arguments:**

    - `x`: points, any shape (usually in $[-1, 1]$).
    - `n`: how many polynomials, at least 1.

    **Returns:** an array of shape `[n, *x.shape]` (degree first), in float32 or wider:
    the dtype of `x` promoted with float32, so half-precision inputs are evaluated in
    float32 (integer inputs in the default float dtype).
    """
    n = check_int("n", n, minimum=1)
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.zeros(()).dtype)
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    p = [jnp.ones_like(x), x]
    for k in range(1, n - 1):
        p.append(((2 * k + 1) * x * p[k] - k * p[k - 1]) / (k + 1))
    return jnp.stack(p[:n])
