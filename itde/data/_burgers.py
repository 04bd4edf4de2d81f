r"""The `burgers` task: learn the solution operator $u_0 \mapsto u(t_f)$ of viscous Burgers.

$$u_t + \left(\tfrac12 u^2\right)_x = \nu\, u_{xx}, \qquad x \in [0, 2\pi)\ \text{periodic}.$$

The data are generated here, offline, by a Fourier pseudo-spectral solver with an
integrating factor for the stiff viscous term and classical RK4 for the nonlinear term.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

_CFL = 0.5  # default steps: h * max|u0| * k_max <= _CFL (RK4 is stable up to ~2.8)


def _check_grid(n: int, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 8 or n % 2:
        raise ValueError(
            f"`{name}` must be an even integer >= 8 (grid points on [0, 2π)), got {n!r}."
        )
    return int(n)


def _check_positive(x, name: str, *, allow_zero: bool = False) -> float:
    try:
        if isinstance(x, (str, bytes, bool)):
            raise TypeError
        value = float(x)
    except (TypeError, ValueError, jax.errors.ConcretizationTypeError) as e:
        raise ValueError(
            f"`{name}` must be a concrete Python number (it sets up the solver), got {x!r}."
        ) from e
    ok = value >= 0 if allow_zero else value > 0
    if not math.isfinite(value) or not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"`{name}` must be finite and {bound}, got {x!r}.")
    return value


def _check_count(n, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"`{name}` must be a positive integer, got {n!r}.")
    return int(n)


def wavenumbers(n: int) -> np.ndarray:
    """Non-negative wavenumbers $0, 1, \\dots, n/2$ of `jnp.fft.rfft` on $[0, 2\\pi)$."""
    return np.arange(n // 2 + 1, dtype=np.float64)


def dealias_mask(n: int) -> np.ndarray:
    r"""Orszag's 2/3 rule: keep the modes with $3|k| < n$.

    A product of two fields limited to $|k| \le K$ has modes up to $2K$; those above $n/2$
    alias to $2K - n$, which falls outside the kept band exactly when $3K < n$.
    """
    return (3 * wavenumbers(n) < n).astype(np.float64)


@jax.jit(static_argnames=("n_steps",))
def _solve(u0, nu, t_final, n_steps: int):
    n = u0.shape[-1]
    real = u0.dtype
    k = jnp.asarray(wavenumbers(n), real)
    mask = jnp.asarray(dealias_mask(n), real)
    h = t_final / n_steps
    decay = nu * k * k
    e_half = jnp.exp(-0.5 * h * decay)
    e_full = e_half * e_half
    ik_half = (-0.5j * k * mask).astype(jnp.result_type(real, jnp.complex64))

    def nonlinear(v_hat):
        # N(u_hat) = -(ik/2) P F[(F^{-1} P u_hat)^2], P the 2/3-rule mask
        u = jnp.fft.irfft(mask * v_hat, n=n)
        return ik_half * jnp.fft.rfft(u * u)

    def step(_, u_hat):
        # Lawson (integrating-factor) RK4 in $v = e^{\nu k^2 t}\hat u$, written back in $\hat u$.
        a = nonlinear(u_hat)
        b = nonlinear(e_half * (u_hat + 0.5 * h * a))
        c = nonlinear(e_half * u_hat + 0.5 * h * b)
        d = nonlinear(e_full * u_hat + h * e_half * c)
        return e_full * u_hat + (h / 6) * (e_full * a + 2 * e_half * (b + c) + d)

    u_hat = jax.lax.fori_loop(0, n_steps, step, jnp.fft.rfft(u0))
    return jnp.fft.irfft(u_hat, n=n).astype(real)


def burgers_solve(
    u0: Float[Array, " n"], *, nu: float, t_final: float, n_steps: int
) -> Float[Array, " n"]:
    r"""Solve periodic viscous Burgers from $u_0$ to $t_f$ by integrating-factor RK4.

    $\hat u_t = -\nu k^2 \hat u + \widehat N(\hat u)$ with
    $\widehat N = -\tfrac{ik}{2}\widehat{u^2}$. The viscous term is integrated exactly by the
    factor $e^{-\nu k^2 t}$ and the nonlinear term by classical RK4 in
    $v = e^{\nu k^2 t}\hat u$ (Lawson's IF-RK4), with `n_steps` equal steps.

    **Order and assumptions.** Spectral in space (the grid is $x_j = 2\pi j/n$) and fourth
    order in time for smooth solutions; the linear (heat) part is exact, so for small data
    the scheme reduces to $e^{-\nu k^2 t}\hat u_0$ to round-off. The nonlinear term is
    dealiased by the 2/3 rule (modes with $3|k| \ge n$ are removed from both factors and
    from the product), so modes above $n/3$ only decay. Stability of the explicit part
    needs roughly $h \max|u_0|\, k_{\max} \lesssim 2.8$ with $k_{\max} \approx n/3$
    ($|u| \le \max|u_0|$ for all time by the maximum principle). The mean of $u$ (mass) is
    conserved exactly, since the $k = 0$ mode of the nonlinear term vanishes.
    Works in the dtype of `u0` (float32 or, with `jax_enable_x64`, float64); jit-compiled,
    one compilation per `(n, dtype, n_steps)`; batch with `jax.vmap`.

    **Arguments:**

    - `u0`: initial condition on the uniform grid, shape `[n]`, `n` even and $\ge 8$.
    - `nu`: viscosity $\nu > 0$ (a concrete number).
    - `t_final`: final time $t_f \ge 0$.
    - `n_steps`: number of equal time steps, a positive integer.

    **Returns:**

    $u(t_f)$ on the same grid, shape `[n]`, dtype of `u0`.
    """
    u0 = jnp.asarray(u0)
    if u0.ndim != 1:
        raise ValueError(
            f"`u0` must have shape [n] (one initial condition); got shape {u0.shape}. "
            "Batch with `jax.vmap(functools.partial(burgers_solve, nu=..., ...))`."
        )
    _check_grid(u0.shape[0], "u0.shape[0]")
    if not jnp.issubdtype(u0.dtype, jnp.floating):
        raise ValueError(f"`u0` must be a real floating array, got dtype {u0.dtype}.")
    nu = _check_positive(nu, "nu")
    t_final = _check_positive(t_final, "t_final", allow_zero=True)
    n_steps = _check_count(n_steps, "n_steps")
    return _solve(u0, jnp.asarray(nu, u0.dtype), jnp.asarray(t_final, u0.dtype), n_steps)


def relative_l2(pred: Float[Array, "batch n"], target: Float[Array, "batch n"]) -> Float[Array, ""]:
    r"""Mean over the batch of $\|p_i - t_i\|_2 / \|t_i\|_2$ (norms over the last axis).

    **Arguments:**

    - `pred`, `target`: arrays of equal shape `[batch, n]` (or `[n]`, a batch of one).

    **Returns:**

    A scalar. A target that is identically zero gives `inf` or `nan`.
    """
    pred, target = jnp.asarray(pred), jnp.asarray(target)
    if pred.shape != target.shape:
        raise ValueError(
            f"`pred` and `target` must have equal shapes, got {pred.shape} and {target.shape}."
        )
    if pred.ndim not in (1, 2):
        raise ValueError(f"`pred` must have shape [batch, n] or [n], got {pred.shape}.")
    err = jnp.linalg.norm(pred - target, axis=-1)
    return jnp.mean(err / jnp.linalg.norm(target, axis=-1))


class BurgersTask(eqx.Module):
    r"""Pairs $(u_0, u(t_f))$ of periodic viscous Burgers with random smooth initial data.

    $u_0(x) = A \, s(x) / \max_x |s(x)|$ with
    $s(x) = \sum_{k=1}^{m} k^{-\alpha}(a_k \cos kx + b_k \sin kx)$,
    $a_k, b_k \sim \mathcal N(0, 1)$: a random trigonometric polynomial with decaying
    amplitudes, zero mean, and maximum $A$ (`amplitude`). Each pair is solved by
    [`burgers_solve`][] on a grid `oversample` times finer than `n_grid` and then
    restricted to the `n_grid` points $x_j = 2\pi j / n_{\text{grid}}$, so that the fronts
    that form (width $\sim \nu / A$) are resolved even where `n_grid` alone would not
    resolve them.

    **Arguments:**

    - `n_grid`: points of the returned grid, even and $\ge 8$.
    - `nu`: viscosity $\nu > 0$.
    - `t_final`: final time $t_f > 0$.
    - `n_steps`: time steps; default from the advective limit
      $h\,A\,k_{\max} \le 0.5$ on the solve grid.
    - `n_modes`: number $m \ge 1$ of Fourier modes in $u_0$; at most $n_{\text{grid}}/3$ so
      that $u_0$ is exactly represented and dealiased on the returned grid.
    - `decay`: the exponent $\alpha \ge 0$ of the amplitude decay $k^{-\alpha}$.
    - `amplitude`: $A = \max|u_0| > 0$.
    - `oversample`: integer refinement $\ge 1$ of the solve grid.
    """

    n_grid: int = eqx.field(static=True)
    nu: float = eqx.field(static=True)
    t_final: float = eqx.field(static=True)
    n_steps: int = eqx.field(static=True)
    n_modes: int = eqx.field(static=True)
    decay: float = eqx.field(static=True)
    amplitude: float = eqx.field(static=True)
    oversample: int = eqx.field(static=True)

    def __init__(
        self,
        n_grid: int = 64,
        nu: float = 0.05,
        t_final: float = 1.0,
        n_steps: int | None = None,
        n_modes: int = 4,
        decay: float = 1.0,
        amplitude: float = 1.0,
        oversample: int = 4,
    ):
        self.n_grid = _check_grid(n_grid, "n_grid")
        self.nu = _check_positive(nu, "nu")
        self.t_final = _check_positive(t_final, "t_final")
        self.n_modes = _check_count(n_modes, "n_modes")
        if 3 * self.n_modes >= self.n_grid:
            raise ValueError(
                f"`n_modes` must satisfy 3 * n_modes < n_grid (= {self.n_grid}) so the initial "
                f"condition is resolved on the returned grid, got n_modes={n_modes!r}; "
                "lower `n_modes` or raise `n_grid`."
            )
        self.decay = _check_positive(decay, "decay", allow_zero=True)
        self.amplitude = _check_positive(amplitude, "amplitude")
        self.oversample = _check_count(oversample, "oversample")
        if n_steps is None:
            k_max = (self.n_solve - 1) // 3
            n_steps = max(1, math.ceil(self.t_final * self.amplitude * k_max / _CFL))
        self.n_steps = _check_count(n_steps, "n_steps")

    @property
    def n_solve(self) -> int:
        """Points of the grid the solver runs on, `oversample * n_grid`."""
        return self.oversample * self.n_grid

    @property
    def grid(self) -> np.ndarray:
        """The returned grid points $x_j = 2\\pi j / n_{\\text{grid}}$."""
        return 2 * np.pi * np.arange(self.n_grid) / self.n_grid

    def initial_condition(self, key: PRNGKeyArray, dtype=None) -> Float[Array, " n_solve"]:
        """One random initial condition on the solve grid (`n_solve` points), scaled so that
        its maximum over the returned grid (every `oversample`-th point) is `amplitude`.
        Its dtype is `dtype`, by default the default float (float64 under
        `jax_enable_x64`)."""
        dtype = jnp.asarray(0.0).dtype if dtype is None else jnp.dtype(dtype)
        ab = jax.random.normal(key, (2, self.n_modes), dtype)
        k = jnp.arange(1, self.n_modes + 1, dtype=dtype)
        x = 2 * jnp.pi * jnp.arange(self.n_solve, dtype=dtype) / self.n_solve
        phase = k[:, None] * x[None, :]
        weight = k[:, None] ** (-self.decay)
        s = jnp.sum(weight * (ab[0, :, None] * jnp.cos(phase) + ab[1, :, None] * jnp.sin(phase)), 0)
        return self.amplitude * s / jnp.max(jnp.abs(s[:: self.oversample]))

    def example(
        self, key: PRNGKeyArray, dtype=None
    ) -> tuple[Float[Array, " n_grid"], Float[Array, " n_grid"]]:
        """One pair `(u0, uT)` on the returned grid; [`BurgersTask.sample`][] is its vmap."""
        u0 = self.initial_condition(key, dtype)
        uT = _solve(
            u0, jnp.asarray(self.nu, u0.dtype), jnp.asarray(self.t_final, u0.dtype), self.n_steps
        )
        return u0[:: self.oversample], uT[:: self.oversample]

    def sample(
        self, key: PRNGKeyArray, batch: int, dtype=None
    ) -> tuple[Float[Array, "batch n_grid"], Float[Array, "batch n_grid"]]:
        """A batch of pairs `(u0, uT)`, deterministic in `key`.

        **Arguments:**

        - `key`: a `jax.random` key; split it for independent batches.
        - `batch`: number of pairs, a positive integer.
        - `dtype`: the floating dtype of the data and of the solve, e.g. `jnp.float32`
          (default: the default float, float64 under `jax_enable_x64`).

        **Returns:**

        `(u0, uT)`, each of shape `[batch, n_grid]`.
        """
        batch = _check_count(batch, "batch")
        if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"`dtype`={dtype!r} must be a floating dtype, e.g. jnp.float32.")
        return _sample(self, key, batch, None if dtype is None else jnp.dtype(dtype).name)


@eqx.filter_jit
def _sample(task: BurgersTask, key, batch: int, dtype: str | None):
    return jax.vmap(lambda k: task.example(k, dtype))(jax.random.split(key, batch))
