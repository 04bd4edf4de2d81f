r"""A sparse mixture of experts: a feed-forward operator that is a gated sum of expert
feed-forward operators, the gates chosen per token by a router.

$$
F(u)(x, y) = \sum_{e=1}^{E} g_e\big(u(x, \cdot)\big)\, F_e(u)(x, y)
  + \sigma\Big(\int_{\Omega_y} w_s(\xi)\, u(x, \xi)\, d\xi\Big)\, F_s(u)(x, y),
$$

each $F_e$ (and the shared expert $F_s$, where there is one) a
[`GatedFeedForward`][itde.GatedFeedForward], and the gates
$g(u(x,\cdot)) \in [0, 1]^E$ read from the router's logits
$r_e(x) = \int_{\Omega_y} W_r(\xi, e)\, u(x, \xi)\, d\xi$ by a routing module
(`ROUTERS`): the softmax over all $E$ experts, kept on the $k$ largest and zero elsewhere
([`SoftmaxTopK`][itde.SoftmaxTopK]), or those $k$ renormalised to sum to one
([`RenormalisedTopK`][itde.RenormalisedTopK], the softmax over the top-$k$ logits).

**As an operator.** Each token is mapped on its own (the operator is local in $x$, as
every feed-forward), and on each token it is piecewise smooth: smooth wherever the set of
the $k$ largest logits is locally constant, and discontinuous in the state across the
surfaces where two logits tie at the $k$-th place (there a gate jumps between 0 and a
positive value). With $k = E$ (every expert kept) it is smooth.

**Which solvers and continuum forms accept it.** The network's own scheme (Lie–Trotter
with one step per layer, the default of `itde.solve`) computes the converted model
exactly, and so does the KV cache. Fixed-step solvers at smaller steps run, but their
orders assume a field smooth along the trajectory, which a token crossing a switching
surface breaks. Adaptive step-size controllers (which estimate the local error from the
field's smoothness) and `continuum_form` (whose promise is "any solver, any step, the
solver's order") refuse a model whose feed-forward is discontinuous, naming this class
(`discontinuity`).

**Cost.** The sum is computed densely: every expert on every token, its output multiplied
by its gate (exactly zero off the top $k$, where the product is masked, so that an
unselected expert's value never enters). That is $E$ dense feed-forwards per token where
the routed computation does $k$: exact and simple, and affordable at test sizes and for the
analysis of small models; for a large $E$ it costs $E/k$ times the routed arithmetic.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._roles import kernel
from ._abstract import AbstractFeedForward
from ._feature_weights import check_width, weighted
from ._feedforward import GatedFeedForward
from ._precision import contract, wide


class AbstractRouting(eqx.Module):
    """How a router's logits over the experts become each token's gates: the top `top_k`
    experts by probability get a positive gate, every other expert the gate 0."""

    top_k: eqx.AbstractVar[int]

    def __check_init__(self):
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(
                f"`{type(self).__name__}.top_k`={k!r} must be an int >= 1: the number of "
                "experts each token is routed to (Hugging Face's num_experts_per_tok)."
            )

    def gates(self, logits: Float[Array, "tokens experts"]) -> Float[Array, "tokens experts"]:
        """The gates `[tokens, experts]`: the softmax of the logits over every expert, the
        `top_k` largest kept (`renormalise` them) and the others 0, in float32 or wider
        (as Hugging Face routes a half-precision model)."""
        probs = jax.nn.softmax(logits.astype(wide(logits.dtype)), axis=-1)
        top, index = jax.lax.top_k(probs, self.top_k)
        top = self.renormalise(top)
        return jnp.sum(jax.nn.one_hot(index, logits.shape[-1], dtype=top.dtype) * top[..., None],
                       axis=-2)  # fmt: skip

    @abc.abstractmethod
    def renormalise(self, top: Float[Array, "tokens k"]) -> Float[Array, "tokens k"]:
        """The gates of the kept experts from their probabilities (largest first)."""


class SoftmaxTopK(AbstractRouting):
    r"""The softmax over all experts, kept on the `top_k` largest: gates
    $g_e = p_e$ for the top $k$ (summing to less than one), 0 elsewhere. Qwen2-MoE (and
    OLMoE, Qwen3-MoE) with `norm_topk_prob=False`."""

    top_k: int = eqx.field(static=True)

    def renormalise(self, top):
        return top


class RenormalisedTopK(AbstractRouting):
    r"""The softmax over all experts, kept on the `top_k` largest and divided by their sum:
    $g_e = p_e / \sum_{e' \in \mathrm{top}_k} p_{e'}$, which is the softmax over the top
    $k$ logits. Mixtral; Qwen2-MoE, OLMoE and Qwen3-MoE with `norm_topk_prob=True`."""

    top_k: int = eqx.field(static=True)

    def renormalise(self, top):
        return top / jnp.sum(top, axis=-1, keepdims=True)


ROUTERS: dict[str, type[AbstractRouting]] = {
    "softmax_top_k": SoftmaxTopK,
    "renormalised_top_k": RenormalisedTopK,
}
"""The routings of a mixture of experts by name: name -> the routing class (its instance
takes `top_k`)."""


class MixtureOfExperts(AbstractFeedForward):
    r"""A sparse mixture of experts (see the module's text for the operator, its
    discontinuity, the solvers that accept it and its cost):
    $F(u) = \sum_e g_e(u)\, F_e(u) + \sigma(w_s \cdot u)\, F_s(u)$.

    **Fields** (one layer's shapes):

    - `router`: $W_r(\xi_i, e)$, `[features, experts]`: the router's kernel (Hugging Face's
      `mlp.gate.weight.T`).
    - `experts`: a [`GatedFeedForward`][itde.GatedFeedForward] whose every array has a
      leading expert axis (`w_gate`, `w1` `[experts, features, hidden]`, `w2`
      `[experts, hidden, features]`): the expert operators $F_e$.
    - `routing`: an `AbstractRouting` ([`SoftmaxTopK`][itde.SoftmaxTopK],
      [`RenormalisedTopK`][itde.RenormalisedTopK]): how the logits become the gates.
    - `shared`: the shared expert $F_s$, a `GatedFeedForward`, or None (Mixtral).
    - `shared_gate`: $w_s$, `[features]`, the kernel of the shared expert's sigmoid gate
      (Qwen2-MoE's `shared_expert_gate`), or None (the shared expert ungated, or none).
    """

    router: Float[Array, "features experts"] = kernel()
    experts: GatedFeedForward
    routing: AbstractRouting
    shared: GatedFeedForward | None = None
    shared_gate: Float[Array, " features"] | None = kernel(default=None)

    def __check_init__(self):
        if not isinstance(self.routing, AbstractRouting):
            raise TypeError(
                f"`MixtureOfExperts.routing` must be an AbstractRouting (itde.SoftmaxTopK or "
                f"itde.RenormalisedTopK), got {type(self.routing).__name__}."
            )
        if not isinstance(self.experts, GatedFeedForward):
            raise TypeError(
                "`MixtureOfExperts.experts` must be an itde.GatedFeedForward with a leading "
                f"expert axis, got {type(self.experts).__name__}."
            )
        d, n_experts = self.router.shape[-2:]
        w1 = self.experts.w1
        if w1.ndim < 3 or w1.shape[-3] != n_experts or w1.shape[-2] != d:
            raise ValueError(
                f"`MixtureOfExperts.experts.w1` has shape {w1.shape}, expected "
                f"[..., {n_experts}, {d}, hidden] to match `router` of shape "
                f"{self.router.shape} ([features, experts])."
            )
        if self.routing.top_k > n_experts:
            raise ValueError(
                f"`routing.top_k`={self.routing.top_k} exceeds the {n_experts} experts; give "
                f"top_k <= {n_experts}."
            )
        if self.shared is not None and self.shared.w1.shape[-2] != d:
            raise ValueError(
                f"`MixtureOfExperts.shared.w1` has shape {self.shared.w1.shape}, expected "
                f"[{d}, hidden] (the router's {d} features)."
            )
        if self.shared_gate is not None:
            if self.shared is None:
                raise ValueError(
                    "`MixtureOfExperts.shared_gate` is given without a `shared` expert to gate; "
                    "give both, or neither."
                )
            if self.shared_gate.shape[-1] != d:
                raise ValueError(
                    f"`MixtureOfExperts.shared_gate` has shape {self.shared_gate.shape}, "
                    f"expected [{d}] (the router's features)."
                )

    @property
    def n_experts(self) -> int:
        return self.router.shape[-1]

    @property
    def discontinuity(self) -> str | None:
        """Where the operator jumps in the state: where a token's top-k set of experts
        changes (None when every expert is kept, `top_k` = the number of experts)."""
        if self.routing.top_k == self.n_experts:
            return None
        return (
            f"where a token's top {self.routing.top_k} of its {self.n_experts} experts change "
            "(a gate jumps between 0 and a positive value)"
        )

    def discretise(self, grid) -> tuple[MixtureOfExperts, None]:
        """Already discrete: `(self, None)` (unit hidden weights), on a grid of its width."""
        check_width("MixtureOfExperts", self.router.shape[-2], grid)
        return self, None

    def gates(
        self, u: Float[Array, "tokens features"], feature_weights: np.ndarray | None = None
    ) -> Float[Array, "tokens experts"]:
        """The routed gates $g_e(u)$ of each token (zero off its top $k$)."""
        return self.routing.gates(contract("nd,de->ne", weighted(u, feature_weights), self.router))

    def __call__(
        self,
        u: Float[Array, "tokens features"],
        *,
        feature_weights: np.ndarray | None = None,
        hidden_weights: np.ndarray | None = None,
    ) -> Float[Array, "tokens features"]:
        g = self.gates(u, feature_weights).astype(u.dtype)
        each = jax.vmap(lambda e: e(u, feature_weights=feature_weights))(self.experts)
        out = jnp.sum(jnp.where(g.T[..., None] > 0, g.T[..., None] * each, 0), axis=0)
        if self.shared is not None:
            s = self.shared(u, feature_weights=feature_weights)
            if self.shared_gate is not None:
                uw = weighted(u, feature_weights)
                s = jax.nn.sigmoid(contract("nd,d->n", uw, self.shared_gate))[:, None] * s
            out = out + s
        return out
