r"""Rotary position embeddings (RoPE) as a rotation of queries and keys by the token position."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._checks import check_float, check_int


class Rope(eqx.Module):
    r"""Rotary position embedding: queries and keys rotated by angles proportional to the
    token position $x$.

    For frequencies $\omega_j$ ($j < r/2$, $r$ the rotary size) the query of head $m$ at
    position $x$ becomes $R(x) Q_m(x, \cdot)$, where $R(x)$ rotates each pair of
    features $(e_j, e_{j + r/2})$ by the angle $\omega_j\,(x - x_0)$ (the "rotate half"
    layout of GPT-NeoX and Llama); the key likewise. Since $R(x)^\top R(\tilde x) =
    R(\tilde x - x)$, the score $\langle R(x) Q, R(\tilde x) K\rangle$ depends on the
    positions only through $\tilde x - x$: the kernel of the attention integral becomes a
    function of $x$, $\tilde x$ and $\tilde x - x$, and it is evaluated at the token
    nodes of whatever grid the model is solved on. On the unit grid (nodes
    $x = \tfrac12, \tfrac32, \dots$) with the default origin $x_0 = \tfrac12$, the
    positions are $0, 1, \dots, N-1$: Hugging Face's RoPE. Features past the rotary size
    (partial rotary) are not rotated.

    The angles and their cosines and sines are computed in float32 or wider (the state's
    dtype if wider); the frequencies are constants (no gradient reaches them).

    **Arguments:**

    - `inv_freq`: the frequencies $\omega_j$, shape `[rotary_dim // 2]`.
    - `origin`: $x_0$, the position of angle 0.
    """

    inv_freq: Float[Array, " half"]
    origin: float = eqx.field(static=True, default=0.5)

    def __check_init__(self):
        if getattr(self.inv_freq, "ndim", None) != 1 or self.inv_freq.shape[0] < 1:
            raise ValueError(
                f"`Rope.inv_freq` must be a 1-D array of frequencies, got shape "
                f"{getattr(self.inv_freq, 'shape', None)}."
            )

    @classmethod
    def init(
        cls, head_dim: int, *, base: float = 10000.0, rotary_dim: int | None = None, dtype=None
    ) -> Rope:
        r"""$\omega_j = \mathrm{base}^{-2j/r}$ for $r$ = `rotary_dim` (default: `head_dim`),
        the frequencies of RoPE."""
        head_dim = check_int("head_dim", head_dim, minimum=2)
        r = head_dim if rotary_dim is None else check_int("rotary_dim", rotary_dim, minimum=2)
        if r % 2 or r > head_dim:
            raise ValueError(
                f"`rotary_dim`={r} must be even and at most `head_dim`={head_dim}."
            )
        base = check_float("base", base, positive=True)
        inv = 1.0 / (base ** (np.arange(0, r, 2, dtype=np.float64) / r))
        return cls(jnp.asarray(inv, dtype=dtype or jnp.float32))

    @property
    def rotary_dim(self) -> int:
        return 2 * self.inv_freq.shape[-1]

    def cos_sin(self, x, dtype) -> tuple[Array, Array]:
        """Cosines and sines of the angles at positions `x` (`[tokens]`), each
        `[tokens, rotary_dim // 2]`, in float32 or wider."""
        wide = jnp.promote_types(dtype, jnp.float32)
        inv = jax.lax.stop_gradient(self.inv_freq).astype(wide)
        pos = jnp.asarray(x, wide) - jnp.asarray(self.origin, wide)
        ang = pos[:, None] * inv[None, :]
        return jnp.cos(ang), jnp.sin(ang)


def rotate(q: Float[Array, "heads tokens head_dim"], cos_sin) -> Array:
    """Rotate queries or keys `[heads, tokens, head_dim]` by the angles of
    `cos_sin = Rope.cos_sin(x, dtype)` ("rotate half" layout; features past the rotary size
    are left as they are)."""
    cos, sin = cos_sin
    half = cos.shape[-1]
    r = 2 * half
    if q.shape[-1] < r:
        raise ValueError(f"RoPE with rotary size {r} needs a head size >= {r}, got {q.shape[-1]}.")
    # cast to the state's dtype first, as Hugging Face does
    cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)
    c = jnp.concatenate([cos, cos], axis=-1)[None]
    s = jnp.concatenate([sin, sin], axis=-1)[None]
    qr, rest = q[..., :r], q[..., r:]
    rot = jnp.concatenate([-qr[..., half:], qr[..., :half]], axis=-1)
    out = qr * c + rot * s
    return out if rest.shape[-1] == 0 else jnp.concatenate([out, rest], axis=-1)
