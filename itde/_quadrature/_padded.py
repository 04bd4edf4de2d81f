r"""The token domain of $N$ tokens carried as data on $B \ge N$ nodes: one compiled program
serves every $N$ of a bucket.

A rule's nodes and weights depend on $N$; computed at trace time (NumPy, from the static
$N$), they make every new token count a new program. [`PaddedTokens`][itde.PaddedTokens]
holds the $N$-node rule's nodes, weights, log-weights and partial-interval (Volterra)
weights as arrays of length $B$ - the rule's own first, the padded nodes after them with
weight zero - so that the program sees only $B$. Padded tokens are also removed from
attention by the key mask ([`itde.solve`][itde.solve] adds them to it), so the real
tokens' result is the $N$-token one to round-off.

What stays static (part of the program): whether the weights are uniform (no log-bias)
and whether the rule is the unit grid (the discrete causal sum, no Volterra weights), each
decided by the rule from what it is; the kind of Volterra weights (a formula in the
indices, or a matrix).
"""

from __future__ import annotations

import equinox as eqx
import numpy as np
from jaxtyping import Array, Float

from .._host import to_device
from ._domain import AbstractTokenDomain, check_weights
from ._volterra import AbstractVolterraWeights


def check_padded(n_tokens: int, n_padded: int) -> int:
    """`n_padded` must be an integer >= `n_tokens`, the real token count."""
    if isinstance(n_padded, bool) or not isinstance(n_padded, (int, np.integer)):
        raise TypeError(f"`n_padded`={n_padded!r} must be an integer number of nodes.")
    if n_padded < n_tokens:
        raise ValueError(
            f"`n_padded`={n_padded} is below the token count {n_tokens}; pad to at least "
            f"{n_tokens} nodes."
        )
    return int(n_padded)


class PaddedTokens(AbstractTokenDomain):
    r"""A 1-D rule's $N$ nodes and weights, as arrays of length $B$ (`n_padded`): the
    rule's own first, then $B - N$ padded nodes of weight zero (each at the last real
    node, so that positions stay finite). Built by
    [`AbstractQuadrature.padded`][itde.AbstractQuadrature.padded]; a state of $B$ tokens
    on it, with the padded tokens masked (False in the key mask), computes the $N$-token
    result for its first $N$ rows to round-off.

    **Fields:**

    - `nodes`: `[B]`, the nodes $x_p$ ($p < N$), then the last one repeated.
    - `weights`: `[B]`, the weights $w_p$ ($p < N$), then zeros.
    - `log_weights`: `[B]`, $\log w_p$ ($p < N$), then zeros (those keys are masked, not
      weighted: a finite value keeps the softmax's arithmetic free of
      $-\infty - (-\infty)$); or None where the rule's $N$ weights are uniform by
      construction (a constant log-bias cancels in the softmax).
    - `volterra`: the rule's partial-interval weights at $N$ nodes on $B$ nodes (rows and
      columns past $N$ zero or unread), or None for the unit grid (the discrete causal
      sum) and for a non-causal model.
    - `n_padded`: $B$.
    """

    nodes: Float[Array, " padded"]
    weights: Float[Array, " padded"]
    log_weights: Float[Array, " padded"] | None
    volterra: AbstractVolterraWeights | None
    n_padded: int = eqx.field(static=True)

    @classmethod
    def from_rule(
        cls,
        nodes: np.ndarray,
        weights: np.ndarray,
        uniform: bool,
        volterra: AbstractVolterraWeights | None,
        n_padded: int,
    ) -> PaddedTokens:
        """Pad a rule's `nodes` and `weights` (float64 NumPy `[N]`, weights checked positive)
        to `n_padded`; `uniform`: the rule's weights are equal by construction."""
        x = np.asarray(nodes, np.float64)
        w = check_weights("token weights", weights)
        n = x.shape[0]
        n_padded = check_padded(n, n_padded)
        pad = n_padded - n
        xp = np.concatenate([x, np.full(pad, x[-1])])
        wp = np.concatenate([w, np.zeros(pad)])
        lw = None if uniform else to_device(np.concatenate([np.log(w), np.zeros(pad)]))
        return cls(to_device(xp), to_device(wp), lw, volterra, n_padded)

    def _check(self, n_tokens) -> None:
        if n_tokens is not None and n_tokens != self.n_padded:
            raise ValueError(
                f"this padded token domain has {self.n_padded} nodes, but the state has "
                f"{n_tokens} tokens; pad the state to {self.n_padded} tokens."
            )

    def nodes_weights(self, n_tokens: int | None) -> tuple[Array, Array]:  # type: ignore[override]
        """The `[B]` nodes and weights (JAX arrays: data of the program, not constants)."""
        self._check(n_tokens)
        return self.nodes, self.weights

    def token_weights(self, n_tokens: int | None = None) -> Array:  # type: ignore[override]
        """The `[B]` weights (checked positive on the real nodes when built)."""
        self._check(n_tokens)
        return self.weights

    def token_log_weights(self, n_tokens: int | None = None, dtype=None) -> Array | None:
        self._check(n_tokens)
        if self.log_weights is None:
            return None
        return self.log_weights.astype(dtype if dtype is not None else self.log_weights.dtype)

    def uniform_weights(self, n_tokens: int | None = None) -> bool:
        """Whether the rule's real weights are uniform (decided by the rule when built)."""
        self._check(n_tokens)
        return self.log_weights is None

    def causal_weights(self, n_tokens: int | None = None):
        self._check(n_tokens)
        return self.volterra

    def padded(self, n_tokens: int, n_padded: int, *, causal: bool = False) -> None:
        """None: a padded domain is not padded again."""
        return None
