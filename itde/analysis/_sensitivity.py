r"""Sensitivity of the depth flow: leading singular values of $\partial u(t)/\partial u(s)$
and finite-time Lyapunov exponents, for the whole state and per token.

One engine serves both: a block power (subspace) iteration on $J^\top J$ with a
Rayleigh–Ritz step, run on a batch of operators at once (one for the whole state, one per
token), every product with $J$ or $J^\top$ matrix-free (a JVP or a VJP through the solve).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from .._abstract import AbstractEquation
from .._checks import check_bool, check_float, check_int, check_key
from ._common import _one_at_a_time
from ._flow import FlowJacobian, FlowMap

#: The default tolerance of the iteration, by state dtype (see `lyapunov_spectrum`).
DEFAULT_RTOL = {"float64": 1e-6, "float32": 1e-3}
TARGETS = ("all", "self")  # the exact definition's string targets


class LyapunovSpectrum(eqx.Module):
    r"""The leading singular values of $J = \partial u(t)/\partial u(s)$ and the finite-time
    Lyapunov exponents $\lambda_i = \log \sigma_i / (t - s)$ (see
    [`lyapunov_spectrum`][itde.analysis.lyapunov_spectrum]).

    **Fields:**

    - `singular_values`: $\sigma_1 \ge \dots \ge \sigma_k$, `[k]`.
    - `exponents`: $\lambda_i = \log \sigma_i / (t - s)$, `[k]` ($-\infty$ for $\sigma_i = 0$).
    - `right_vectors`: unit perturbations $x_i$ of $u(s)$, `[k, tokens, features]`.
    - `left_vectors`: unit responses $y_i = J x_i / \sigma_i$ at depth $t$, same shape.
    - `residuals`: $\|J^\top J x_i - \sigma_i^2 x_i\| / (\sigma_1 \max(\sigma_i,
      \sqrt{\varepsilon}\,\sigma_1))$, `[k]`: what the tolerance bounds.
    - `n_iterations`: the iterations taken; `converged`: whether every residual met `rtol`.
    - `n_jvps`, `n_vjps`: the Jacobian products computed (`n_iterations * block_size` each).
    """

    singular_values: Float[Array, " k"]
    exponents: Float[Array, " k"]
    right_vectors: Float[Array, "k tokens features"]
    left_vectors: Float[Array, "k tokens features"]
    residuals: Float[Array, " k"]
    n_iterations: Int[Array, ""]
    converged: Bool[Array, ""]
    n_jvps: Int[Array, ""]
    n_vjps: Int[Array, ""]


class TokenExponents(eqx.Module):
    r"""Per-token singular values and finite-time Lyapunov exponents (see
    [`token_lyapunov_exponents`][itde.analysis.token_lyapunov_exponents]).

    **Fields:**

    - `singular_values`: `[tokens, k]`, the growth factors $\sigma = e^{\lambda (t - s)}$,
      descending: for the exact definition the leading singular values of token $i$'s
      block; for [`TongExponent`][itde.analysis.TongExponent] the products
      $\prod_k |(R_{i,k})_{aa}|$ of its QR iteration. NaN on padded tokens.
    - `exponents`: `[tokens, k]`, $\log \sigma / (t - s)$; NaN on padded tokens.
    - `residuals`: `[tokens, k]`, as in [`LyapunovSpectrum`][itde.analysis.LyapunovSpectrum]
      (0 where nothing is iterated: an integer `target`, or Tong's definition).
    - `n_iterations`, `converged`, `n_jvps`, `n_vjps`: as in `LyapunovSpectrum`, for the
      whole batch of blocks (for Tong's definition `n_vjps` counts VJPs of the vector
      field, `features` per step).
    """

    singular_values: Float[Array, "tokens k"]
    exponents: Float[Array, "tokens k"]
    residuals: Float[Array, "tokens k"]
    n_iterations: Int[Array, ""]
    converged: Bool[Array, ""]
    n_jvps: Int[Array, ""]
    n_vjps: Int[Array, ""]


def lyapunov_spectrum(
    flow: FlowMap | AbstractEquation,
    u: Float[Array, "tokens features"],
    k: int = 1,
    *,
    mask=None,
    block_size: int | None = None,
    rtol: float | None = None,
    max_iters: int = 100,
    key=None,
    throw: bool = True,
) -> LyapunovSpectrum:
    r"""The $k$ leading singular values of the flow's Jacobian for the whole state, and the
    finite-time Lyapunov exponents.

    **Definition.** With $J = \partial u(t)/\partial u(s)$ at $u(s) =$ `u` (an
    $n \times n$ matrix, $n$ = tokens × features), $\sigma_1 \ge \sigma_2 \ge \dots$ its
    singular values, the finite-time Lyapunov exponents are
    $\lambda_i = \log \sigma_i / (t - s)$: a perturbation along the right singular vector
    $x_i$ grows (or decays) by $\sigma_i = e^{\lambda_i (t - s)}$ over the depth.
    With a `mask`, $J$ is restricted to the real tokens ($P J P$, $P$ zeroing the padded
    ones): perturbations of real tokens, measured on real tokens.

    **Method.** Block power (subspace) iteration on $J^\top J$ with a Rayleigh–Ritz step:
    from $V$ (`block_size` $= p$ orthonormal vectors, random at first), $W = J V$ ($p$
    JVPs), the SVD $W = P \Sigma Q^\top$ gives the Ritz values $\Sigma$ and vectors
    $X = P^\top V$ ($J X = \Sigma Q^\top$), then $Z = J^\top W$ ($p$ VJPs) gives the
    residuals and the next block $V = \mathrm{orth}(P^\top Z)$.

    **Tolerance.** Stops when every one of the $k$ leading pairs has
    $\|J^\top J x_i - \sigma_i^2 x_i\| \le$ `rtol` $\cdot\, \sigma_1 \sigma_i$, i.e. the
    SVD residual $\|J^\top y_i - \sigma_i x_i\|$ ($y_i = J x_i/\sigma_i$, and
    $J x_i = \sigma_i y_i$ exactly) is at most `rtol` $\|J\|$. Then $J$ has a singular value
    within `rtol` $\sigma_1$ of $\sigma_i$, and within $\sim$ `rtol`$^2 \sigma_1^2 / \delta_i$
    when $\sigma_i$ is separated by $\delta_i$ from the rest of the spectrum (the values
    converge twice as fast as the vectors). Values below $\sqrt{\varepsilon}\,\sigma_1$
    ($\varepsilon$ the dtype's epsilon, e.g. the zero singular values of the normal
    directions of a post-norm continuum flow) are at the dtype's resolution and are
    measured against $\sqrt\varepsilon\,\sigma_1$ instead. If `max_iters` iterations do
    not meet `rtol`, raises (`throw=True`) or returns `converged=False`.

    **Convergence.** Linear: the residual of pair $i$ shrinks by
    $(\sigma_{p+1}/\sigma_i)^2$ per iteration, so a gap between $\sigma_k$ and
    $\sigma_{p+1}$ is what makes it fast; a larger `block_size` widens it. Clustered
    leading values converge slowly as pairs but their span, and so their values, still
    quickly.

    **Cost.** Per iteration $p$ JVPs (one forward solve carrying $p$ tangents, and the
    primal) and $p$ VJPs (one backward solve over $p$ cotangents, from the checkpoints of
    a single forward solve made before the loop). Memory: the block ($3p$ states), the
    solve's checkpoints (one state per step) and the $p$ tangents of one solve; never a
    dense $n \times n$ matrix. `n_jvps / k` is the cost per singular value.

    **Arguments:**

    - `flow`: a [`FlowMap`][itde.analysis.FlowMap] (the depths, solver, step and terms),
      or a model, read as `FlowMap(model)` (the discrete network over its whole depth).
    - `u`: the state at depth $s$, `[tokens, features]`, float32 or float64.
    - `k`: how many singular values, $1 \le k \le n$.
    - `mask`: the key mask (`[tokens]`, False on padding), or None.
    - `block_size`: $p$, with $k \le p \le n$ (default $\min(n, 2k + 2)$).
    - `rtol`: the tolerance above (default 1e-6 for float64, 1e-3 for float32).
    - `max_iters`: the iteration cap (default 100).
    - `key`: the PRNG key of the random start (default `jax.random.key(0)`).
    - `throw`: raise if `max_iters` iterations do not converge (as `itde.solve`'s `throw`).

    `rtol`, `max_iters` and `throw` may be traced scalars (arguments of a `jax.jit`ted
    function): one compilation then serves every tolerance, cap and choice.

    **Returns:** a [`LyapunovSpectrum`][itde.analysis.LyapunovSpectrum]. Works under
    `jax.jit` (the model or flow a closure, or an `eqx.filter_jit` argument) and in float32
    or float64.
    """
    flow = _as_flow(flow)
    jac = flow.jacobian(u, mask)
    n_tokens, d = u.shape
    n = n_tokens * d
    k = _check_k(k, n, "the state size tokens * features")
    p = _check_block(block_size, k, n)
    rtol = _check_rtol(rtol, u.dtype)
    max_iters = _check_max_iters(max_iters)
    key = _check_key(key)
    jac = _finite(jac)
    m = _mask_factor(jac)
    pull = jac.pullback()

    def apply(V):  # [1, p, n] -> J V, J^T J V (on the real tokens)
        T = V[0].reshape(p, n_tokens, d) * m
        W = jax.vmap(jac.mv)(T) * m
        Z = jax.vmap(pull)(W) * m
        return W.reshape(1, p, n), Z.reshape(1, p, n)

    V0 = (jax.random.normal(key, (p, n_tokens, d), u.dtype) * m).reshape(1, p, n)
    out = _subspace_iteration(apply, V0, n, k, rtol, max_iters, jnp.ones((1,), bool))
    sig, X, Y, res, iters, ok = out
    sig = _maybe_throw(sig, ok, throw, max_iters)
    return LyapunovSpectrum(
        singular_values=sig[0, :k],
        exponents=jnp.log(sig[0, :k]) / flow.duration,
        right_vectors=X[0, :k].reshape(k, n_tokens, d),
        left_vectors=Y[0, :k].reshape(k, n_tokens, d),
        residuals=res[0, :k],
        n_iterations=iters,
        converged=ok,
        n_jvps=iters * p,
        n_vjps=iters * p,
    )


def _flow_jacobian_exponents(
    flow: FlowMap,
    u: Float[Array, "tokens features"],
    target: str | int,
    k: int,
    mask,
    block_size: int | None,
    rtol: float | None,
    max_iters: int,
    key,
    throw: bool,
) -> TokenExponents:
    """The exact token exponents ([`FlowJacobianExponent`][itde.analysis.FlowJacobianExponent]):
    singular values of the blocks of the solved flow's Jacobian (see
    [`token_lyapunov_exponents`][itde.analysis.token_lyapunov_exponents])."""
    flow = _as_flow(flow)
    jac = flow.jacobian(u, mask)
    n_tokens, d = u.shape
    target = _check_target(target, n_tokens)
    k = _check_k(k, d, "the number of features (a token block has that many columns)")
    jac = _finite(jac)
    m = _mask_factor(jac)
    real = jnp.ones((n_tokens,), bool) if jac.mask is None else jac.mask
    if isinstance(target, int):  # a padded or missing token is refused before any solve
        target = _target_token(target, real, jac.mask is not None)
    pull = jac.pullback()
    if not isinstance(target, str):
        rows = jax.vmap(pull)(jnp.eye(d, dtype=u.dtype)[:, None, :] * _onehot(target, n_tokens, u))
        blocks = jnp.swapaxes(rows, 0, 1)  # [i, a, b] = d u_{j,a}(t) / d u_{i,b}(s)
        sig = _one_at_a_time(lambda b: jnp.linalg.svd(b, compute_uv=False), blocks)[:, :k]
        zero = jnp.zeros((), jnp.int32)
        return _token_result(
            flow, sig, jnp.zeros_like(sig), real, zero, jnp.ones((), bool), zero, zero + d
        )
    p = _check_block(block_size, k, d)
    rtol = _check_rtol(rtol, u.dtype)
    max_iters = _check_max_iters(max_iters)
    key = _check_key(key)
    eye = jnp.eye(n_tokens, dtype=u.dtype)

    def apply(V):  # [tokens, p, d]: token i's vectors, placed on token i
        T = (eye[:, None, :, None] * V[:, :, None, :]).reshape(n_tokens * p, n_tokens, d)
        out = jax.vmap(jac.mv)(T).reshape(n_tokens, p, n_tokens, d)
        if target == "self":
            W = jnp.einsum("ipjd,ij->ipd", out, eye)
            C = eye[:, None, :, None] * W[:, :, None, :]
        else:
            C = out * m
            W = C.reshape(n_tokens, p, n_tokens * d)
        g = jax.vmap(pull)(C.reshape(n_tokens * p, n_tokens, d))
        Z = jnp.einsum("ipjd,ij->ipd", g.reshape(n_tokens, p, n_tokens, d), eye)
        return W, Z

    V0 = jax.random.normal(key, (n_tokens, p, d), u.dtype)
    m_out = d if target == "self" else n_tokens * d
    sig, _, _, res, iters, ok = _subspace_iteration(apply, V0, m_out, k, rtol, max_iters, real)
    sig = _maybe_throw(sig, ok, throw, max_iters)
    count = iters * n_tokens * p
    return _token_result(flow, sig[:, :k], res[:, :k], real, iters, ok, count, count)


def _token_result(flow, sig, res, real, iters, ok, n_jvps, n_vjps) -> TokenExponents:
    nan = jnp.asarray(jnp.nan, sig.dtype)
    sig = jnp.where(real[:, None], sig, nan)
    return TokenExponents(
        singular_values=sig,
        exponents=jnp.log(sig) / flow.duration,
        residuals=jnp.where(real[:, None], res, nan),
        n_iterations=iters,
        converged=ok,
        n_jvps=n_jvps,
        n_vjps=n_vjps,
    )


# --------------------------------------------------------------------------- the engine
def _orthonormal_rows(B, JB, AB, ref):
    r"""Orthonormal rows spanning the rows of `B` `[batch, q, n]` (with their images `JB`,
    `AB` under $J$ and $J^\top J$ mapped alike), by two passes of an eigendecomposition of
    the Gram matrix; directions below $\sqrt{\varepsilon}$ times `ref` `[batch]` (the rows'
    scale) are dropped as zero rows (their images zero too)."""
    dtype = B.dtype
    cut = 10 * jnp.sqrt(jnp.finfo(dtype).eps).astype(dtype)
    for _ in range(2):
        G = jnp.einsum("bin,bjn->bij", B, B)
        e, U = _one_at_a_time(jnp.linalg.eigh, G)  # never a batched LAPACK call
        s = jnp.sqrt(jnp.maximum(e, 0))
        keep = s > cut * ref[:, None]
        C = jnp.where(keep[:, None, :], U / jnp.where(keep, s, 1)[:, None, :], 0)
        B, JB, AB = (jnp.einsum("bij,bin->bjn", C, x) for x in (B, JB, AB))
        ref = jnp.ones_like(ref)
    return B, JB, AB


def _subspace_iteration(apply, V0, m, k, rtol, max_iters, active):
    r"""Block Krylov iteration with Rayleigh–Ritz on a batch of operators $J_b$.

    `apply(V)` maps a block `[batch, p, n]` to `(J V [batch, p, m], J^T J V [batch, p, n])`.
    Each iteration applies $J$ and $J^\top$ to one new block $R$ (the Ritz residuals
    $J^\top J X - X \Sigma^2$, orthonormalised) and takes the Ritz pairs of $J$ on the
    span of the current Ritz vectors $X$, $R$ and the previous Ritz vectors (LOBPCG's three
    blocks, whose images are all known: no more products than a power step, but a
    Chebyshev-like rate instead of the power iteration's $(\sigma_{p+1}/\sigma_i)^2$).
    Returns `(sigma [batch, p], X [batch, p, n], Y [batch, p, m], residuals [batch, p],
    iterations, converged)`: Ritz values (descending), right and left vectors, relative
    residuals (see `lyapunov_spectrum`), for the last block whose pairs were checked.
    `active` `[batch]`: the operators that must converge."""
    batch, p, n = V0.shape
    dtype = V0.dtype
    floor = jnp.sqrt(jnp.finfo(dtype).eps).astype(dtype)
    tiny = jnp.finfo(dtype).tiny

    def ritz(B, JB, AB):
        """The `p` leading Ritz pairs of $J$ on the span of `B`'s orthonormal rows."""
        P, sig, L = _one_at_a_time(lambda x: jnp.linalg.svd(x, full_matrices=False), JB)
        P, sig, L = P[..., :p], sig[..., :p], L[..., :p, :]
        X = jnp.einsum("bij,bin->bjn", P, B)  # J X_j = sig_j L_j
        Y = jnp.einsum("bij,bin->bjn", P, AB)  # J^T J X_j
        top = sig[:, :1]
        r = jnp.linalg.norm(Y - (sig**2)[..., None] * X, axis=-1)
        res = r / jnp.maximum(top * jnp.maximum(sig, floor * top), tiny)
        done = jnp.all((res[:, :k] <= rtol) | ~active[:, None])
        return X, sig, L, Y, res, done

    def body(state):
        i, X, sig, L, Y, Xp, JXp, AXp, res, _ = state
        R = Y - (sig**2)[..., None] * X  # the residual block (zero at i = 0: X unset)
        R = jnp.where(i == 0, V0, R)
        R = R / jnp.maximum(jnp.linalg.norm(R, axis=-1, keepdims=True), tiny)
        JX = sig[..., None] * L
        R, _, _ = _orthonormal_rows(R, R, R, jnp.ones((batch,), dtype))
        # R against X (and again): then R's images come from one apply
        for _ in range(2):
            R = R - jnp.einsum("bij,bjn->bin", jnp.einsum("bin,bjn->bij", R, X), X)
        R, _, _ = _orthonormal_rows(R, R, R, jnp.ones((batch,), dtype))
        JR, AR = apply(R)
        B = jnp.concatenate([X, R, Xp], axis=1)
        JB = jnp.concatenate([JX, JR, JXp], axis=1)
        AB = jnp.concatenate([Y, AR, AXp], axis=1)
        B, JB, AB = _orthonormal_rows(B, JB, AB, jnp.ones((batch,), dtype))
        Xn, sig_n, L_n, Y_n, res_n, done = ritz(B, JB, AB)
        return i + 1, Xn, sig_n, L_n, Y_n, X, JX, Y, res_n, done

    def cond(state):
        return (state[0] < max_iters) & ~state[-1]

    zeros_n = jnp.zeros((batch, p, n), dtype)
    init = (
        jnp.zeros((), jnp.int32),
        zeros_n,
        jnp.zeros((batch, p), dtype),
        jnp.zeros((batch, p, m), dtype),
        zeros_n,
        zeros_n,
        jnp.zeros((batch, p, m), dtype),
        zeros_n,
        jnp.full((batch, p), jnp.inf, dtype),
        jnp.zeros((), bool),
    )
    i, X, sig, L, _, _, _, _, res, done = jax.lax.while_loop(cond, body, init)
    return sig, X, L, res, i, done


# --------------------------------------------------------------------------- checks
def _as_flow(flow) -> FlowMap:
    if isinstance(flow, FlowMap):
        return flow
    if isinstance(flow, AbstractEquation):
        return FlowMap(flow)
    raise TypeError(
        f"`flow` must be an itde.analysis.FlowMap (or a model, read as FlowMap(model)), got "
        f"{type(flow).__name__}."
    )


def _finite(jac: FlowJacobian) -> FlowJacobian:
    u = eqx.error_if(
        jac.u,
        ~jnp.all(jnp.isfinite(jac.u)),
        "itde.analysis: the state `u` has a NaN or infinite entry; the flow's Jacobian is "
        "undefined there. Check the state you pass (e.g. the embedding that produced it).",
    )
    return eqx.tree_at(lambda j: j.u, jac, u)


def _mask_factor(jac: FlowJacobian):
    """`[tokens, 1]` of 1 on real tokens and 0 on padded ones (1 without a mask)."""
    if jac.mask is None:
        return jnp.ones((jac.u.shape[0], 1), jac.u.dtype)
    return jac.mask.astype(jac.u.dtype)[:, None]


def _onehot(j, n_tokens: int, u):
    return (jnp.arange(n_tokens) == j).astype(u.dtype)[None, :, None]


def _check_k(k, n: int, what: str) -> int:
    k = check_int("k", k, minimum=1)
    if k > n:
        raise ValueError(
            f"`k`={k} singular values asked, but the operator has only {n} ({what}); give k <= {n}."
        )
    return k


def _check_block(block_size, k: int, n: int) -> int:
    if block_size is None:
        return min(n, 2 * k + 2)
    p = check_int("block_size", block_size, minimum=1)
    if not k <= p <= n:
        raise ValueError(
            f"`block_size`={p} must be between k={k} (the values asked) and {n} (the "
            f"operator's size); e.g. block_size={min(n, 2 * k + 2)}."
        )
    return p


def _check_max_iters(max_iters):
    if isinstance(max_iters, jax.core.Tracer):  # one compilation for every cap
        return max_iters
    return check_int("max_iters", max_iters, minimum=1)


def _check_rtol(rtol, dtype):
    if rtol is None:
        return DEFAULT_RTOL.get(jnp.dtype(dtype).name, 1e-3)
    if isinstance(rtol, jax.core.Tracer):  # one compilation for every tolerance
        return rtol
    rtol = check_float("rtol", rtol, positive=True)
    eps = float(jnp.finfo(dtype).eps)
    if not 10 * eps <= rtol < 1:
        raise ValueError(
            f"`rtol`={rtol} must be in [{10 * eps:.1e}, 1): below ten times {jnp.dtype(dtype)}'s "
            f"epsilon round-off cannot meet it; e.g. rtol={DEFAULT_RTOL['float64']:g} in "
            f"float64 or {DEFAULT_RTOL['float32']:g} in float32."
        )
    return rtol


def _check_key(key):
    if key is None:
        return jax.random.key(0)
    check_key("key", key)
    return key


def _check_target(target, n_tokens: int):
    if isinstance(target, str):
        if target not in TARGETS:
            raise ValueError(
                f"`target`={target!r} is not known; give 'all' (the whole output), 'self' (the "
                "token's own output) or an output token index, e.g. -1 (the last token)."
            )
        return target
    j = check_int("target", target)
    if not -n_tokens <= j < n_tokens:
        raise ValueError(
            f"`target`={j} is not a token of this sequence of {n_tokens}; give an index in "
            f"[{-n_tokens}, {n_tokens}) (e.g. the last real token), 'all' or 'self'."
        )
    return j


def _target_token(j: int, real, masked: bool):
    """The position of the output token `target`=`j` names, given the real tokens `real`
    (`[tokens]` booleans): position `j` for `j >= 0`, which must be real; for `j < 0` the
    `-j`-th real token from the end (so -1 is the last real token with padding on either
    side). A concrete mask is checked here; a traced one when the function runs."""
    n_tokens = real.shape[0]
    if not masked:
        return j % n_tokens
    if not isinstance(real, jax.core.Tracer):
        where = np.flatnonzero(np.asarray(real))
        if j >= 0 and not bool(np.asarray(real)[j]):
            raise ValueError(
                f"`target`={j} is a padded token (`mask` is False there); give a real token's "
                f"position, one of {where.tolist()[:8]}, or -1 for the last real token."
            )
        if j < 0 and -j > where.size:
            raise ValueError(
                f"`target`={j} counts back {-j} real tokens from the last one, but `mask` has "
                f"only {where.size}; give target >= {-where.size} (-1: the last real token)."
            )
        return int(where[j]) if j < 0 else j
    rank = jnp.cumsum(real.astype(jnp.int32))  # 1-based rank of each real token
    if j >= 0:
        index, bad = jnp.asarray(j, jnp.int32), ~real[j]
    else:
        want = rank[-1] + j + 1
        index, bad = jnp.argmax(real & (rank == want)).astype(jnp.int32), want < 1
    return eqx.error_if(
        index,
        bad,
        f"itde.analysis: `target`={j} is not a real token of the sequence: "
        + ("`mask` is False there; give a real token's position or -1 for the last real token."
           if j >= 0 else f"`mask` has fewer than {-j} real tokens; give -1 for the last real "
           "token."),
    )  # fmt: skip


def _maybe_throw(sig, ok, throw, max_iters):
    """`throw`: a bool, or a traced one (one compilation for both)."""
    if not isinstance(throw, jax.core.Tracer) and not check_bool("throw", throw):
        return sig
    cap = "max_iters" if isinstance(max_iters, jax.core.Tracer) else f"max_iters={max_iters}"
    return eqx.error_if(
        sig,
        ~ok & throw,
        f"itde.analysis: the block power iteration did not meet `rtol` in {cap} "
        "iterations (the leading singular values are close to the next ones). Raise "
        "`max_iters`, widen `block_size`, loosen `rtol`, or pass throw=False to get the "
        "current estimates with their residuals and converged=False.",
    )
