r"""Token-level finite-time Lyapunov exponents, by either of two definitions: the exact one
(the blocks of the solved flow's Jacobian) and Tong et al.'s (a QR iteration over the
per-step blocks $I + \Delta t\, J$ of the vector field's Jacobian).

**Which is which, and why they differ.** Both measure how an output token $j$ at depth
$t$ responds to an input token $i$ at depth $s$. The exact exponent takes the block
$B_i = \partial u_j(t) / \partial u_i(s)$ of the flow's Jacobian: over steps
$\tau_0 < \dots < \tau_K$ the flow's Jacobian is a product of whole-state matrices,
and its $(j, i)$ block is a sum over every path of tokens
$i \to i_1 \to \dots \to j$ through the layers; only the diagonal blocks of a step
carry the identity of the residual stream. Tong et al. (ICLR 2025, "Neural ODE
Transformers", `qkvflow/analysis/lyapunov.py`, `compute_lyapunov_exponent`) instead take,
at every step, the single block $J_k = \partial f_j(\tau_k, u(\tau_k)) / \partial u_i$
of the vector field, add the identity to it whatever $i$ is, and multiply
$\prod_k (I + \Delta\tau_k J_k)$, tracked by QR. For $i \ne j$ that product is not a
block of any Jacobian of the model: with $\Delta\tau\, J_k$ small it is close to $I$,
so theirs comes out $\gtrsim 0$ for every token, where the exact exponent of a token
the output barely reads is strongly negative (its block is small), and the two rank
tokens differently.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from itde_solvers import LieTrotter

from .._abstract import AbstractEquation
from .._checks import check_bool
from .._solve import terms_kind
from ._flow import FlowMap
from ._sensitivity import (
    TokenExponents,
    _as_flow,
    _check_k,
    _check_target,
    _flow_jacobian_exponents,
    _target_token,
)


class AbstractTokenExponent(eqx.Module):
    """A definition of the token-level finite-time Lyapunov exponent: how
    [`token_lyapunov_exponents`][itde.analysis.token_lyapunov_exponents] measures the
    sensitivity of an output at depth $t$ to each input token at depth $s$.

    `default_target`: the `target` a call that names none measures."""

    default_target: ClassVar[str | int]

    @abc.abstractmethod
    def __call__(
        self,
        flow: FlowMap,
        u: Float[Array, "tokens features"],
        *,
        target: str | int,
        k: int,
        mask,
        block_size: int | None,
        rtol: float | None,
        max_iters: int,
        key,
        throw: bool,
    ) -> TokenExponents:
        """The exponents of every token of `u` (see `token_lyapunov_exponents`)."""


class FlowJacobianExponent(AbstractTokenExponent):
    r"""The exact token exponent: the singular values of the blocks of the solved flow's
    Jacobian $\partial u(t) / \partial u(s)$, for any `target` (`"all"`, `"self"`, an
    output token), by any solver and step (see
    [`token_lyapunov_exponents`][itde.analysis.token_lyapunov_exponents])."""

    default_target: ClassVar[str | int] = "all"

    def __call__(self, flow, u, *, target, k, mask, block_size, rtol, max_iters, key, throw):
        return _flow_jacobian_exponents(
            flow, u, target, k, mask, block_size, rtol, max_iters, key, throw
        )


class TongExponent(AbstractTokenExponent):
    r"""Tong et al.'s token exponent (ICLR 2025, "Neural ODE Transformers";
    `qkvflow/analysis/lyapunov.py`, `compute_lyapunov_exponent`): a QR iteration over the
    per-step blocks of the vector field's Jacobian, with the identity on every block.

    **Definition.** On the flow's step grid $s = \tau_0 < \dots < \tau_K = t$
    ([`FlowMap.step_depths`][itde.analysis.FlowMap.step_depths]: one step per layer of the
    discrete network), with $u_k$ the state at $\tau_k$ along the flow's own solve, $f$
    the vector field the flow's solver integrates (the sum of its vector-field sub-flows,
    `SplitTerm.vf`, projections left out: $A(N_1 u) + F(N_2 u)$ for pre-norm and
    parallel blocks, Tong et al.'s own form; $A(u) + F(u)$ for the post-norm network; the
    tangent field on the constraint set for a post-norm continuum solved with `"split"`
    or `"tangent"` terms), output token $j$ and every input token $i$: $Q_{i,0} = I$ and

    $$
    J_{i,k} = \frac{\partial f_j(\tau_k, u_k)}{\partial u_i}, \qquad
    (I + \Delta\tau_k J_{i,k})\, Q_{i,k} = Q_{i,k+1} R_{i,k+1} \ \text{(QR)},
    $$

    and token $i$'s exponents are $\lambda_{i,a} = \sum_k \log |(R_{i,k})_{aa}| / (t - s)$
    ($a = 1, \dots,$ `features`), returned in decreasing order (Tong et al. colour each
    token by the largest). Their model has depth 1 ($\Delta\tau = 1/L$), so their sum of
    logarithms is this rate. `singular_values` holds the growth factors
    $e^{\lambda_{i,a}(t - s)} = \prod_k |(R_{i,k})_{aa}|$.

    The identity is added to every block, $i \ne j$ included, so this is not a block of
    the flow's Jacobian (that is [`FlowJacobianExponent`][itde.analysis.FlowJacobianExponent],
    whose $(j, i)$ block sums over every path through the tokens): every token comes out
    $\gtrsim 0$ here (see the module's note).

    **Fields:**

    - `at_step_end`: evaluate step $k$'s Jacobian at the state at the *end* of the step,
      $u_{k+1}$, instead of $u_k$. Their `compute_lyapunov_exponent_for_sentence` passes
      `compute_trajectory`'s states, the states after each layer, so `True` reproduces their
      numbers; `False` (default) takes each step's Jacobian where the step starts, the
      state the vector field acts on.

    Needs a fixed step grid (no adaptive `stepsize_controller`) and an integer `target`.
    **Cost:** `features` VJPs of the vector field per step, and a batched QR of `tokens`
    matrices `features` × `features` per step; one solve for the states.
    """

    at_step_end: bool = eqx.field(static=True, default=False)
    default_target: ClassVar[str | int] = -1

    def __check_init__(self):
        check_bool("at_step_end", self.at_step_end)

    def __call__(self, flow, u, *, target, k, mask, block_size, rtol, max_iters, key, throw):
        del block_size, rtol, max_iters, key, throw  # exact: no iteration to tune
        flow.check_state(u, "u")
        n_tokens, d = u.shape
        if isinstance(target, str):
            raise ValueError(
                f"`target`={target!r}: Tong et al.'s exponent follows one output token through "
                "the layers; give its index, e.g. target=-1 (the last real token, as they do), "
                "or method='exact' for 'all' and 'self'."
            )
        target = _check_target(target, n_tokens)
        k = _check_k(k, d, "the number of features (a token block has that many columns)")
        m = flow._key_mask(u, mask)
        real = jnp.ones((n_tokens,), bool) if m is None else m
        j = _target_token(target, real, m is not None)
        u = eqx.error_if(
            u,
            ~jnp.all(jnp.isfinite(u)),
            "itde.analysis: the state `u` has a NaN or infinite entry; the flow's Jacobian is "
            "undefined there. Check the state you pass (e.g. the embedding that produced it).",
        )
        taus = flow.step_depths()
        tdtype = jnp.promote_types(u.dtype, jnp.float32)
        ys = flow.states(u, taus[1:] if self.at_step_end else taus[:-1], m)
        field = _vector_field(flow)

        def step(Q, xs):
            tau, h, y = xs

            def out_j(v):
                return field.vf(tau, v, m)[j]

            J = jnp.swapaxes(jax.jacrev(out_j)(y), 0, 1)  # [i, a, b] = d f_{j,a} / d u_{i,b}
            Q, R = jnp.linalg.qr(Q + h.astype(u.dtype) * (J @ Q))
            return Q, jnp.log(jnp.abs(jnp.diagonal(R, axis1=-2, axis2=-1)))

        Q0 = jnp.broadcast_to(jnp.eye(d, dtype=u.dtype), (n_tokens, d, d))
        xs = (jnp.asarray(taus[:-1], tdtype), jnp.asarray(taus[1:] - taus[:-1], tdtype), ys)
        _, logs = jax.lax.scan(step, Q0, xs)  # [steps, tokens, features]
        lam = -jnp.sort(-jnp.sum(logs, axis=0), axis=-1)[:, :k] / flow.duration
        nan = jnp.asarray(jnp.nan, lam.dtype)
        lam = jnp.where(real[:, None], lam, nan)
        zero = jnp.zeros((), jnp.int32)
        return TokenExponents(
            singular_values=jnp.exp(lam * flow.duration),
            exponents=lam,
            residuals=jnp.where(real[:, None], jnp.zeros_like(lam), nan),
            n_iterations=zero,
            converged=jnp.ones((), bool),
            n_jvps=zero,
            n_vjps=zero + d * (len(taus) - 1),
        )


def _vector_field(flow: FlowMap):
    """The terms whose `vf` (the sum of the vector-field sub-flows, projections left out)
    is the field the flow's solver integrates: the flow's own `SplitTerm`, or the model's
    terms of the flow's kind (by default the solver's, `itde.solve`'s one rule)."""
    if flow.split is not None:
        return flow.split
    kind = flow.kind if flow.kind is not None else terms_kind(flow.solver or LieTrotter())
    return flow.model.terms(kind)


#: The definitions of the token exponent by name, for the CLI (`itde analyze --exponent`)
#: and `token_lyapunov_exponents(..., method="tong")`.
TOKEN_EXPONENTS: dict[str, type[AbstractTokenExponent]] = {
    "exact": FlowJacobianExponent,
    "tong": TongExponent,
}
"""The definitions of the token exponent by name: `"exact"` ->
[`FlowJacobianExponent`][itde.analysis.FlowJacobianExponent], `"tong"` ->
[`TongExponent`][itde.analysis.TongExponent]."""


def as_token_exponent(method, name: str = "method") -> AbstractTokenExponent:
    """`method` as a token-exponent module: a module is kept, a name of `TOKEN_EXPONENTS`
    is turned into its module (`name`: the argument, for the error)."""
    if isinstance(method, AbstractTokenExponent):
        return method
    if isinstance(method, str) and method in TOKEN_EXPONENTS:
        return TOKEN_EXPONENTS[method]()
    raise ValueError(
        f"`{name}`={method!r} is not a token exponent; give one of {list(TOKEN_EXPONENTS)} "
        "(or a module such as itde.analysis.TongExponent(at_step_end=True))."
    )


def token_exponent_name(method: AbstractTokenExponent) -> str:
    """The registry name of a token-exponent module (its class name if it has none)."""
    for name, cls in TOKEN_EXPONENTS.items():
        if type(method) is cls:
            return name
    return type(method).__name__


def token_lyapunov_exponents(
    flow: FlowMap | AbstractEquation,
    u: Float[Array, "tokens features"],
    *,
    target: str | int | None = None,
    k: int = 1,
    mask=None,
    method: AbstractTokenExponent | str = FlowJacobianExponent(),
    block_size: int | None = None,
    rtol: float | None = None,
    max_iters: int = 100,
    key=None,
    throw: bool = True,
) -> TokenExponents:
    r"""Finite-time Lyapunov exponents of each token: how an output at depth $t$ responds
    to token $i$'s input at depth $s$, by the definition `method` names.

    **The exact definition** (`method="exact"`,
    [`FlowJacobianExponent()`][itde.analysis.FlowJacobianExponent], the default): the
    leading singular values of the Jacobian block $B_i$ that token $i$'s input at depth
    $s$ has, and $\lambda_{i,r} = \log \sigma_r(B_i) / (t - s)$, with by `target`:

    - `"all"` (the default target): $B_i = \partial u(t) / \partial u_i(s)$,
      `[tokens * features, features]`: how much the whole state at depth $t$ moves per
      unit perturbation of token $i$ alone (with a `mask`, measured on the real tokens
      only). The exponent of token $i$ is its influence on the sequence.
    - an integer $j$ (e.g. the last real token, which predicts the next one):
      $B_i = \partial u_j(t) / \partial u_i(s)$, `[features, features]`: the sensitivity
      of the output token $j$ to the input token $i$, through the exact Jacobian of the
      solved flow. Computed exactly, with no iteration: `features` VJPs give every block
      $B_i$ at once, then a batched SVD.
    - `"self"`: $B_i = \partial u_i(t) / \partial u_i(s)$, `[features, features]`: the
      token's sensitivity to its own input.

    For `"all"` and `"self"`, the block power iteration of
    [`lyapunov_spectrum`][itde.analysis.lyapunov_spectrum] runs on every token's block at
    once (a batch of `tokens` operators on `features`-dimensional inputs): the same
    tolerance per token, the same convergence (per token, at the ratio
    $(\sigma_{p+1}(B_i)/\sigma_r(B_i))^2$ per iteration), until every real token meets
    `rtol` (padded tokens are skipped).

    **Tong et al.'s definition** (`method="tong"`,
    [`TongExponent()`][itde.analysis.TongExponent]; ICLR 2025, "Neural ODE Transformers"):
    an integer `target` $j$ only (default $-1$, the last real token, as they read it); a
    QR iteration over the per-step blocks $I + \Delta\tau\, \partial f_j / \partial u_i$
    of the vector field's Jacobian, with the identity on every block. That is not a block
    of the flow's Jacobian: it is $\gtrsim 0$ for every token, where the exact exponent
    of a token the output barely reads is negative, and the two rank tokens differently
    (see [`TongExponent`][itde.analysis.TongExponent]).

    **Cost.** Exact, `"all"` and `"self"`: per iteration `tokens` × $p$ JVPs and as many
    VJPs, batched in one forward and one backward solve (memory: `tokens` × $p$ tangent
    states of size tokens × features). Exact, an integer `target`: `features` VJPs in
    all. Tong's: `features` VJPs of the vector field per step.

    **Arguments:**

    - `flow`: a [`FlowMap`][itde.analysis.FlowMap], or a model (`FlowMap(model)`).
    - `u`: the state at depth $s$, `[tokens, features]`, float32 or float64.
    - `target`: `"all"`, `"self"` or an output token: a position $j \ge 0$ (a real
      token), or $j < 0$ counting back from the last *real* token (`-1`: the last real
      token, whichever side the padding is on). A padded position, or more real tokens
      counted back than `mask` has, is an error. None: the method's default (`"all"` for
      the exact one, `-1` for Tong's).
    - `k`: how many exponents per token (the largest), $1 \le k \le$ `features`.
    - `mask`: the key mask (`[tokens]`, False on padding): the solve uses it, and padded
      tokens get NaN.
    - `method`: the definition: an
      [`AbstractTokenExponent`][itde.analysis.AbstractTokenExponent] module or its name in
      [`TOKEN_EXPONENTS`][itde.analysis.TOKEN_EXPONENTS] (`"exact"`, `"tong"`).
    - `block_size`, `rtol`, `max_iters`, `key`, `throw`: the exact definition's power
      iteration (`"all"`, `"self"`), as in `lyapunov_spectrum`, per token block
      ($k \le p \le$ `features`, default $\min(\text{features}, 2k + 2)$).

    **Returns:** a [`TokenExponents`][itde.analysis.TokenExponents].
    """
    method = as_token_exponent(method)
    flow = _as_flow(flow)
    target = method.default_target if target is None else target
    return method(flow, u, target=target, k=k, mask=mask, block_size=block_size, rtol=rtol,
                  max_iters=max_iters, key=key, throw=throw)  # fmt: skip
