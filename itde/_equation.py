r"""The Transformer integro-differential equation and its solution through diffrax.

$$u_t = A(u) + \partial I_{S_1(\sigma_1,\sigma_2)}(u) + F(u) + \partial I_{S_1}(u),
\qquad u(x, y, 0) = f(x, y).$$
"""

from __future__ import annotations

from typing import Literal

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from solvers import ProjectionTerm, SplitTerm

from ._attention import check_heads
from ._controls import Block, PiecewiseConstant, stack
from ._feedforward import check_activation
from ._layernorm import LayerNormProjection
from ._quadrature import Grid

FFNForm = Literal["residual", "relaxation"]
FFN_FORMS = ("residual", "relaxation")


def _unit_or(weights: np.ndarray) -> np.ndarray | None:
    """None when every weight is 1 (the multiplication would be a no-op)."""
    return None if np.all(weights == 1.0) else weights


class TransformerIDE(eqx.Module):
    r"""The equation of the paper, with its controls, grid and options: one object for
    the Transformer regime ($\Delta t = 1$, piecewise-constant controls) and the
    continuum regime ($\Delta t \to 0$).

    Calling the model on one sequence `u0` of shape `[tokens, features]` solves the
    equation to depth $T$ with the paper's scheme — Lie–Trotter splitting with
    $\Delta t = 1$ over the sub-flows (attention, projection onto $S_1$, feed-forward,
    projection onto $S_1$) — and applies the optional final projection. That is exactly
    a post-LN Transformer encoder (`nn.TransformerEncoderLayer(norm_first=False)`).
    Batch with `jax.vmap(model)`.

    **Arguments:**

    - `controls`: the per-depth parameters (`PiecewiseConstant` over layer blocks).
    - `grid`: token and feature quadrature ([`Grid`][itde.Grid]); `Grid.unit(d)` is the
      standard Transformer.
    - `causal`: Volterra (decoder) attention, integrating over $\tilde x \le x$.
    - `ffn_form`: `"residual"` — the feed-forward sub-flow is an Euler step of $F$,
      $u_5 = u_2 + F(u_2)$ (PyTorch's block for any $\varepsilon$) — or `"relaxation"`,
      the paper's $u_5 = \tfrac12(u_4 + u_2)$ with $u_4 = F(u_2)$ (the same block when
      $\varepsilon = 0$, slightly different when $\varepsilon > 0$).
    - `final_norm`: an optional projection applied after the solve
      (`nn.TransformerEncoder(norm=...)`).
    """

    controls: PiecewiseConstant
    grid: Grid
    causal: bool = eqx.field(static=True, default=False)
    ffn_form: str = eqx.field(static=True, default="residual")
    final_norm: LayerNormProjection | None = None

    def __check_init__(self):
        if self.ffn_form not in FFN_FORMS:
            raise ValueError(
                f"`ffn_form`={self.ffn_form!r} is not known; choose one of {FFN_FORMS}."
            )
        d = self.controls.values.attention.n_features
        if self.grid.n_features != d:
            raise ValueError(
                f"`grid.n_features`={self.grid.n_features} does not match the kernels' "
                f"feature count {d}; build the grid with n_features={d}."
            )

    # ----------------------------------------------------------------- construction
    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        *,
        n_layers: int,
        n_features: int,
        n_heads: int,
        n_hidden: int | None = None,
        activation: str = "relu",
        eps: float = 1e-5,
        bias: bool = True,
        causal: bool = False,
        ffn_form: str = "residual",
        grid: Grid | None = None,
        dtype=None,
    ) -> TransformerIDE:
        """A model with random discrete per-layer controls (PyTorch's initialisation).

        `n_hidden` defaults to `4 * n_features`; `grid` to the unit grid.
        """
        check_heads(n_features, n_heads)
        check_activation(activation)
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"`n_layers` must be a positive int, got {n_layers!r}.")
        n_hidden = 4 * n_features if n_hidden is None else n_hidden
        if isinstance(n_hidden, bool) or not isinstance(n_hidden, int) or n_hidden < 1:
            raise ValueError(f"`n_hidden` must be a positive int, got {n_hidden!r}.")
        keys = jax.random.split(key, n_layers)
        blocks = [
            Block.init(
                k,
                n_features=n_features,
                n_heads=n_heads,
                n_hidden=n_hidden,
                activation=activation,
                eps=eps,
                bias=bias,
                dtype=dtype,
            )
            for k in keys
        ]
        return cls(
            PiecewiseConstant(stack(blocks)),
            grid if grid is not None else Grid.unit(n_features),
            causal=causal,
            ffn_form=ffn_form,
        )

    # ----------------------------------------------------------------- properties
    @property
    def n_layers(self) -> int:
        return self.controls.n_layers

    @property
    def n_features(self) -> int:
        return self.grid.n_features

    @property
    def depth(self) -> float:
        """The final time $T$ (the number of layers for the standard Transformer)."""
        return self.controls.t1

    # ----------------------------------------------------------------- the operators
    def _feature_weights(self):
        return _unit_or(self.grid.feature_weights())

    def _token_log_weights(self, n_tokens: int, dtype):
        w = self.grid.token_weights(n_tokens)
        if np.all(w == w[0]):
            return None  # a constant log-bias cancels in the softmax
        return jnp.asarray(np.log(w), dtype=dtype)

    def attention_field(self, t, u, args=None):
        """The vector field $A(u)$ at depth `t`."""
        theta = self.controls(t, "right")
        return theta.attention(
            u,
            feature_weights=self._feature_weights(),
            token_log_weights=self._token_log_weights(u.shape[0], u.dtype),
            causal=self.causal,
        )

    def feedforward_field(self, t, u, args=None):
        """The vector field $F(u)$ at depth `t` (or $\\tfrac12(F(u) - u)$, relaxation form)."""
        theta = self.controls(t, "right")
        f = theta.feedforward(u, feature_weights=self._feature_weights())
        if self.ffn_form == "relaxation":
            return 0.5 * (f - u)
        return f

    def project1(self, t, u):
        """Projection onto the first constraint set of the layer acting at `t`."""
        return self.controls(t, "left").norm1(u, self._feature_weights())

    def project2(self, t, u):
        """Projection onto the second constraint set of the layer acting at `t`."""
        return self.controls(t, "left").norm2(u, self._feature_weights())

    def terms(self) -> SplitTerm:
        """The four sub-flows of the paper's splitting, in order: attention, $P_{S_1}$,
        feed-forward (substeps 3–5), $P_{S_1}$."""
        return SplitTerm(
            (
                diffrax.ODETerm(self.attention_field),
                ProjectionTerm(self.project1),
                diffrax.ODETerm(self.feedforward_field),
                ProjectionTerm(self.project2),
            )
        )

    # ----------------------------------------------------------------- solving
    def check_state(self, u0, name: str = "u0"):
        """Trace-time shape check of one sequence, naming the argument and the fix."""
        shape = getattr(u0, "shape", None)
        if shape is None or len(shape) != 2:
            raise ValueError(
                f"`{name}` must be one sequence of shape [tokens, {self.n_features}], got "
                f"shape {shape}; for a batch use `jax.vmap(model)`."
            )
        if shape[1] != self.n_features:
            raise ValueError(
                f"`{name}` has {shape[1]} features but the model has {self.n_features}; "
                f"give a state of shape [tokens, {self.n_features}]."
            )
        if shape[0] < 1:
            raise ValueError(f"`{name}` has no tokens (shape {shape}).")
        if not jnp.issubdtype(u0.dtype, jnp.floating):
            raise TypeError(f"`{name}` must be a floating-point array, got dtype {u0.dtype}.")

    def __call__(self, u0: Float[Array, "tokens features"]) -> Float[Array, "tokens features"]:
        """The encoder's output for one sequence: $u(T)$ from the paper's scheme."""
        from ._solve import solve

        sol = solve(self, u0)
        assert sol.ys is not None
        u = sol.ys[-1]
        if self.final_norm is not None:
            u = self.final_norm(u, self._feature_weights())
        return u

    def trajectory(
        self, u0: Float[Array, "tokens features"]
    ) -> Float[Array, "layers1 tokens features"]:
        """The state after every layer: `[n_layers + 1, tokens, features]`, $u(t_n)$."""
        from ._solve import solve

        ts = jnp.arange(self.n_layers + 1, dtype=u0.dtype) * self.controls.width + self.controls.t0
        sol = solve(self, u0, saveat=diffrax.SaveAt(ts=ts))
        assert sol.ys is not None
        return sol.ys
