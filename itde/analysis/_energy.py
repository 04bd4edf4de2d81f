r"""The interaction energy of the particle model of self-attention, and its monotonicity
along a computed trajectory.

Geshkovski, Letrouit, Polyanskiy and Rigollet, *A mathematical perspective on
Transformers* (arXiv:2312.10794), study tokens $x_1, \dots, x_n$ on the unit sphere
$S^{d-1}$ moved by self-attention with $Q = K = V = I$,
$\dot x_i = P^\perp_{x_i}\big(\frac{1}{Z_i}\sum_j e^{\beta\langle x_i, x_j\rangle} x_j\big)$,
$Z_i = \sum_j e^{\beta\langle x_i, x_j\rangle}$ ("(SA)"; `examples/particles.py` builds it as
an `itde.TransformerIDE`). Their interaction energy, for the empirical measure
$\mu = \frac1n \sum_i \delta_{x_i}$, is
$$E_\beta(x_1, \dots, x_n) = \frac{1}{2\beta}\iint e^{\beta\langle x, x'\rangle}\,d\mu(x)\,d\mu(x')
= \frac{1}{2\beta n^2}\sum_{i,j=1}^n e^{\beta\langle x_i, x_j\rangle}.$$
Its Riemannian gradient is $\nabla_{x_i} E_\beta = \frac{1}{n^2} P^\perp_{x_i}\sum_j
e^{\beta\langle x_i, x_j\rangle} x_j$, so the unnormalised dynamics ("(USA)", $Z_i$ replaced
by $n$) is the gradient ascent $\dot x_i = n \nabla_{x_i} E_\beta$, and along (SA)
$$\frac{d}{dt} E_\beta = \sum_i \langle \nabla_{x_i} E_\beta, \dot x_i\rangle
= \frac{1}{n^2}\sum_i Z_i\,|\dot x_i|^2 \;\ge\; 0:$$
the energy never decreases along the continuous flow, and is stationary exactly at the
flow's equilibria. A computed trajectory may break this by its discretisation error:
[`energy_along`][itde.analysis.energy_along] reports the largest decrease between
consecutive saved depths.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from ._common import _check_weights, _mask, _state


def _check_beta(beta):
    if not isinstance(beta, jax.core.Tracer):
        b = np.asarray(beta)
        if b.shape != () or not np.isfinite(b) or not b > 0:
            raise ValueError(
                f"`beta`={beta!r} must be a positive finite number: the inverse temperature "
                "of the particle model (its attention score is beta <x_i, x_j>)."
            )


def interaction_energy(
    u: Float[Array, "tokens features"],
    beta: float,
    mask: Bool[Array, " tokens"] | None = None,
    *,
    feature_weights: np.ndarray | None = None,
) -> Float[Array, ""]:
    r"""$E_\beta = \frac{1}{2\beta n^2}\sum_{i,j} e^{\beta\langle x_i, x_j\rangle}$ over the
    $n$ real tokens of the state, each projected onto the unit sphere,
    $x_i = u_i / \|u_i\|_w$ (the particle model's states are unit already; the inner product
    is the feature-weighted one, `None`: the dot product). It lies in
    $[\,e^{-\beta}/(2\beta),\; e^{\beta}/(2\beta)\,]$, the top for a single cluster.

    Computed in logarithms, $\log E_\beta = \beta + \log \sum_{ij}
    e^{\beta(\langle x_i, x_j\rangle - 1)} - \log(2\beta n^2)$ (every term of the sum is
    at most 1, the diagonal's are 1), and each token scaled by its largest entry before it
    is normalised: no intermediate overflows or underflows, so the energy is finite
    whenever it is representable in the state's dtype ($e^\beta/(2\beta)$ is, in float32,
    up to $\beta \approx 93$; in float64 up to $\beta \approx 716$).

    **Arguments:**

    - `u`: the state `[tokens, features]` (a nested list is converted with `jnp.asarray`).
      Every real token must be nonzero: a zero token has no direction on the sphere, and
      is refused (mask it out).
    - `beta`: the inverse temperature $\beta > 0$.
    - `mask`: `[tokens]`, False on padded tokens (left out; $n$ counts the real ones).
    - `feature_weights`: the feature quadrature weights (`None`: all 1).
    """
    _check_beta(beta)
    u = _state(u)
    m = _mask(mask, u.shape[0])
    _check_nonzero(u, m, "u")
    w = _check_weights(feature_weights, u.shape[1])
    return _energy(u, jnp.asarray(beta, u.dtype), m, None if w is None else jnp.asarray(w, u.dtype))


_ZERO_TOKEN = (
    "a real token of `{name}` is zero{where}: a token of zero norm has no direction on the "
    "unit sphere, so the interaction energy is undefined; set `mask` False there (padding) "
    "or drop the token."
)


def _check_nonzero(u, m, name: str) -> None:
    """Refuse a real token that is zero (`u`: `[..., tokens, features]`, `m`: `[tokens]`),
    and a mask with no real token. Concrete arrays are checked here, naming the tokens;
    traced ones at run time, by `equinox.error_if` in `_energy`."""
    if isinstance(u, jax.core.Tracer) or isinstance(m, jax.core.Tracer):
        return
    m = np.asarray(m)
    if not m.any():
        raise ValueError(
            "`mask` leaves no real token: the interaction energy is a mean over the real "
            "tokens; give at least one True."
        )
    zero = np.all(np.asarray(u) == 0, axis=-1) & m
    if np.any(zero):
        ix = [tuple(int(i) for i in t) for t in np.argwhere(zero)]
        shown = ", ".join(str(t[0]) if len(t) == 1 else str(t) for t in ix[:5])
        label = "token" if zero.ndim == 1 else "(depth, token)"
        more = ", ..." if len(ix) > 5 else ""
        raise ValueError(_ZERO_TOKEN.format(name=name, where=f" ({label} {shown}{more})"))


@jax.jit
def _energy(u, beta, m, w):
    # each token divided by its largest entry first: its norm can then neither overflow
    # nor underflow (u @ u.T would, for entries beyond sqrt(max) or below sqrt(tiny))
    a = jnp.max(jnp.abs(u), axis=-1)
    zero = m & (a == 0)
    a = jnp.where(m & ~zero, a, 1)
    x = u / a[:, None]
    xw = x if w is None else x * w
    norm = jnp.sqrt(jnp.sum(xw * x, axis=-1))
    norm = jnp.where(m & ~zero, norm, 1)
    z = x / norm[:, None]
    c = (z if w is None else z * w) @ z.T
    pairs = m[:, None] & m[None, :]
    # c <= 1 (Cauchy-Schwarz): the minimum removes round-off above it, so every term <= 1
    s = jnp.sum(jnp.where(pairs, jnp.exp(beta * (jnp.minimum(c, 1) - 1)), 0))
    n = jnp.sum(m).astype(u.dtype)
    e = jnp.exp(beta + jnp.log(s) - jnp.log(2 * beta * n * n))
    return eqx.error_if(e, jnp.any(zero), _ZERO_TOKEN.format(name="u", where=""))


class EnergyTrace(eqx.Module):
    r"""The interaction energy along a trajectory, from
    [`energy_along`][itde.analysis.energy_along].

    - `energies`: $E_\beta$ at every saved depth, `[depths]`.
    - `increments`: $E_\beta(t_{k+1}) - E_\beta(t_k)$, `[depths - 1]`.
    - `violation`: the largest decrease, $\max(0, \max_k (E_k - E_{k+1}))$: 0 for a
      non-decreasing energy, as along the exact flow.
    - `relative_violation`: `violation` divided by the energy's total rise
      $\max_k E_k - E_0$ (or by $E_0$ when it does not rise).
    """

    energies: Float[Array, " depths"]
    increments: Float[Array, " intervals"]
    violation: Float[Array, ""]
    relative_violation: Float[Array, ""]


def energy_along(
    us: Float[Array, "depths tokens features"],
    beta: float,
    mask: Bool[Array, " tokens"] | None = None,
    *,
    feature_weights: np.ndarray | None = None,
) -> EnergyTrace:
    r"""The interaction energy $E_\beta$ at every saved state of a trajectory and its largest
    violation of monotonicity: a diagnostic of the discretisation.

    Along the exact (SA) flow $E_\beta$ never decreases (see the module's note). Along a
    computed one, a step's change is the exact change plus the effect of the step's local
    error $\delta$. The exact change is at least $c\,h\,|v|^2$ ($v$ the velocity,
    $c = \min_i Z_i / n^2 \ge e^{-\beta}/n$), while $|\delta| = O(h^{p+1} |v|)$ for a method
    of order $p$ (every elementary differential carries one factor of the field) and
    $|\nabla E_\beta| = O(|v|)$: both are quadratic in the velocity, so every step below a
    threshold $h^*$ (set by $\beta$, not by the state) increases the energy, and a
    consistent scheme is exactly monotone there, whatever its order. Above $h^*$ the steps
    overshoot and the energy can fall. So `violation` is not an order diagnostic: it is 0
    (to round-off, a few ulps of $E_\beta$ once the increments fall below them near an
    equilibrium) for small steps, and measures how far a step is beyond the energy-stable
    range. Measured (8 tokens on $S^2$, $\beta = 1$, to the single cluster): projected
    Euler 0.110, 0.053, 0.018 at $h = 4, 3, 2.5$, and 0 at $h \le 2$; projected Heun and
    RK4 are monotone at $h \le 1.5$ and $h \le 1$.

    **Arguments:**

    - `us`: the states `[depths, tokens, features]` (e.g. `itde.solve(...,
      saveat=diffrax.SaveAt(ts=...)).ys`, or `steps=True` for every step).
    - `beta`, `mask`, `feature_weights`: as
      [`interaction_energy`][itde.analysis.interaction_energy].

    **Returns:** an [`EnergyTrace`][itde.analysis.EnergyTrace].
    """
    _check_beta(beta)
    us = jnp.asarray(us)
    if us.ndim != 3 or us.shape[0] < 2:
        raise ValueError(
            f"`us` must be at least two states [depths, tokens, features], got shape {us.shape}."
        )
    if not jnp.issubdtype(us.dtype, jnp.floating):
        us = us.astype(jnp.result_type(float))
    m = _mask(mask, us.shape[1])
    _check_nonzero(us, m, "us")
    w = _check_weights(feature_weights, us.shape[2])
    w = None if w is None else jnp.asarray(w, us.dtype)
    return _trace(us, jnp.asarray(beta, us.dtype), m, w)


@jax.jit
def _trace(us, beta, m, w):
    e = jax.vmap(lambda u: _energy(u, beta, m, w))(us)
    inc = e[1:] - e[:-1]
    violation = jnp.maximum(0.0, jnp.max(-inc))
    rise = jnp.max(e) - e[0]
    scale = jnp.where(rise > 0, rise, jnp.abs(e[0]))
    return EnergyTrace(e, inc, violation, violation / scale)
