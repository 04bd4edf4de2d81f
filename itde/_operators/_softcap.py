r"""Soft-capping: a bound on the attention kernel's exponent (and on a head's logits).

$$\mathrm{cap}_c(s) = c\,\tanh(s / c),\qquad |\mathrm{cap}_c(s)| < c,$$

a smooth, odd, increasing map with $\mathrm{cap}_c(s) = s + O(s^3 / c^2)$. Gemma 2 applies it
to every attention score before the mask and the softmax (`attn_logit_softcapping`), so
the attention kernel $e^{s(x, \tilde x)}$ becomes $e^{\mathrm{cap}_c(s(x, \tilde x))}$,
bounded between $e^{-c}$ and $e^{c}$ whatever the state, and to the language-model head's
logits (`final_logit_softcapping`).

**As an operator.** [`Attention`][itde.Attention] takes it as `score_cap=`: the score
$q \cdot k$ (already scaled) is capped, then the token log-weights, score bias, causal
restriction and windows are added as before: so the cap acts on the kernel's exponent
only, never on the quadrature weights or the masks. The capped operator is as smooth in
the state as the uncapped one, so every depth solver and continuum form that accepts the
attention accepts it (splittings, wrapped diffrax solvers, smooth controls); it is
elementwise in the scores, so the dense and blocked cores and the key/value cache compute
it exactly (the blocked core caps each block of scores before its online softmax). The
fused core (`jax.nn.dot_product_attention`) has no cap and refuses it by name.
"""

from __future__ import annotations

import math
import numbers

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float


def _check_cap(cap) -> float:
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real):
        raise TypeError(
            f"`SoftCap(cap)`={cap!r} must be a number, the bound c of c * tanh(s / c) (e.g. "
            "SoftCap(50.0) for Gemma 2's attn_logit_softcapping = 50.0)."
        )
    v = float(cap)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(
            f"`SoftCap(cap)`={cap!r} must be positive and finite; for no cap pass None "
            "instead of a SoftCap."
        )
    return v


class SoftCap(eqx.Module):
    r"""$s \mapsto c\,\tanh(s / c)$: bounds a score (or a logit) in $(-c, c)$, smoothly.

    **Arguments:**

    - `cap`: $c > 0$ (Gemma 2: `attn_logit_softcapping = 50.0` on the attention scores,
      `final_logit_softcapping = 30.0` on the logits).
    """

    cap: float = eqx.field(static=True, converter=_check_cap)

    def __call__(self, s: Float[Array, "*dims"]) -> Float[Array, "*dims"]:
        c = jnp.asarray(self.cap, s.dtype)
        return c * jnp.tanh(s / c)


def check_score_cap(name: str, cap) -> None:
    """Raise `TypeError` unless `cap` is None or an [`itde.SoftCap`][itde.SoftCap]."""
    if cap is not None and not isinstance(cap, SoftCap):
        raise TypeError(
            f"`{name}`={cap!r} must be an itde.SoftCap(cap) or None; e.g. "
            "itde.SoftCap(50.0) for Gemma 2's attn_logit_softcapping = 50.0."
        )
