r"""Trainable models: an embedding into the initial condition $f$, the Transformer IDE solved
in depth, and a linear readout of $u(T)$.

- [`TokenModel`][] (tasks `sort`, `charlm`): token embedding plus a learned positional
  embedding, so positional information enters through the initial condition
  $f(x, \cdot)$; logits over the vocabulary at every token.
- [`FieldModel`][] (task `burgers`): the tokens are the grid points $x_j = 2\pi j/N$ of
  the periodic domain; the features $[u_0(x), \sin x, \cos x]$ are lifted linearly to the
  width $d$, and the readout maps $u(x, \cdot, T)$ back to one value, the prediction of
  the Burgers solution $u(x, t_f)$. The token grid is the periodic trapezoid rule on
  $[0, 2\pi)$, so attention is a quadrature of an integral and the model can be
  evaluated on any number of grid points $N$.

Both hold the depth integrator as static fields `scheme` and `dt`: `"lie"` is the paper's
scheme (Lie splitting over the sub-flows attention, $P_{S_1}$, feed-forward, $P_{S_1}$;
with $\Delta t = 1$ and per-layer controls a post-LN Transformer), any other name is a
continuous-depth scheme (`"rk4"`, `"strang"`, `"heun"`, ... as in `itde converge`) applied
to controls smooth in depth
(`itde.solve` starts it from the projection of the initial condition onto $S_1(t_0)$,
on which the continuum equation lives). `with_depth(model, scheme, dt)` re-targets a trained model.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._blocks import block_from_names
from .._controls import LegendreControls
from .._equation import TransformerIDE
from .._operators._layernorm import LayerNormProjection
from .._quadrature._rules import Grid, Midpoint, PeriodicTrapezoid
from .._random import normal, uniform
from .._registry import scheme as scheme_named
from .._roles import kernel
from .._solve import solve

__all__ = [
    "FieldModel",
    "TokenModel",
    "init_field_model",
    "init_token_model",
    "integrate",
    "loss_fn",
    "predict",
    "with_depth",
]


def check_depth(ide: TransformerIDE, scheme: str, dt: float, *, name: str = "dt") -> None:
    """Trace-time check that the depth `scheme` and step `dt` fit the model's controls
    (`itde.Scheme.check`: per-layer controls take the paper's scheme `"lie"` with
    $0 < \\Delta t \\le$ one layer, controls smooth in depth any scheme with
    $0 < \\Delta t \\le T$). `name` is the argument named in the error (`"--dt"` for the CLI).
    """
    scheme_named(scheme).check(ide.controls, dt, name=name)


def integrate(
    ide: TransformerIDE, u0, scheme: str, dt: float, batched: bool = False, *, path: bool = False
):
    """$u(T)$ from $u(0) =$ `u0` with the named depth scheme and fixed step `dt` (with
    `path`: the states at the start and after every step, `[steps + 1, ...]`).

    Reverse mode differentiates the discrete scheme exactly (discretise-then-optimise)
    through `itde.solve`'s default adjoint, `diffrax.RecursiveCheckpointAdjoint` (with one
    checkpoint per step for these fixed-step solves)."""
    options = scheme_named(scheme).solve_options(dt, ide.controls)
    saveat = diffrax.SaveAt(t0=True, steps=True) if path else None
    # `solve` starts the continuum equation from P_{S1(t0)}(u0)
    ys = solve(ide, u0, **options, batched=batched, saveat=saveat).ys
    assert ys is not None
    return ys if path else ys[-1]


def _output(ide: TransformerIDE, u):
    """`ide.output` (the final norm, for one sequence) over any leading axes of `u`."""
    if ide.final_norm is None and ide.readout is None:
        return u
    flat = u.reshape(-1, *u.shape[-2:])
    return jax.vmap(ide.output)(flat).reshape(u.shape)


def _uniform(key, shape, scale, dtype):
    return uniform(key, shape, dtype, -scale, scale)


def _deprecated_ide(model) -> TransformerIDE:
    """The model's `equation`, under its name before issue 46 (one release, with a
    `DeprecationWarning`)."""
    name = type(model).__name__
    warnings.warn(
        f"`{name}.ide` is deprecated and will be removed in the next release; use "
        f"`{name}.equation` (the same TransformerIDE).",
        DeprecationWarning,
        stacklevel=3,
    )
    return model.equation


class TokenModel(eqx.Module):
    r"""Tokens $\to$ logits: $f(x_k) = E[\text{token}_k] + P[k]$, the IDE to depth $T$,
    then `logits = u(T) W + b`. Call on one sequence of int tokens `[n]`, $n \le$ `context`;
    batch with `jax.vmap`.

    - `embedding`: $E$, `[vocab, width]`; `position`: $P$, `[positions, width]` (learned;
      at least the task's context), or None where the equation carries the positions
      itself (a converted Llama: RoPE inside its attention).
    - `equation`: the equation, a [`TransformerIDE`][itde.TransformerIDE] of depth $T$
      (`ide` before issue 46: a deprecated alias for one release).
    - `readout`: $W$, `[width, vocab]`, or None for a head tied to the embedding
      ($W = E^\top$, as nanoGPT and GPT-2: one parameter with two uses, whose gradient is
      the sum of both; `[model] tie_embeddings`). `readout_bias`: $b$, `[vocab]`, or None
      (no bias: a tied head has none, as nanoGPT's and GPT-2's `lm_head`).
    - `scheme`, `dt`: the depth integrator (a name of `itde.SCHEMES`) and its step."""

    embedding: Float[Array, "vocab width"] = kernel()
    position: Float[Array, "positions width"] | None = kernel()
    equation: TransformerIDE
    readout: Float[Array, "width vocab"] | None = kernel()
    readout_bias: Float[Array, " vocab"] | None
    scheme: str = eqx.field(static=True, default="lie")
    dt: float = eqx.field(static=True, default=1.0)

    def __check_init__(self):
        if self.readout is not None and self.readout.shape[0] != self.embedding.shape[1]:
            raise ValueError(
                f"`readout` must be [width, vocab] with width {self.embedding.shape[1]} (the "
                f"embedding's), got shape {self.readout.shape}."
            )

    ide = property(_deprecated_ide, doc="Deprecated: the `equation` (its name before issue 46).")

    @property
    def tied(self) -> bool:
        """Whether the head is the token embedding ($W = E^\\top$)."""
        return self.readout is None

    @property
    def dtype(self):
        """The parameters' dtype (the embedding's)."""
        return self.embedding.dtype

    @property
    def max_tokens(self) -> int | None:
        """The longest sequence the position table holds (None: no table, no limit)."""
        return None if self.position is None else self.position.shape[0]

    def _check_length(self, tokens, ndim: int, what: str) -> None:
        n, most = tokens.shape[-1], self.max_tokens
        if tokens.ndim != ndim or (most is not None and n > most):
            raise ValueError(
                f"`tokens` must be {what} of at most {most} tokens (the context), got shape "
                f"{tokens.shape}" + ("; batch with jax.vmap." if ndim == 1 else ".")
            )

    def __call__(self, tokens: Int[Array, " n"]) -> Float[Array, "n vocab"]:
        self._check_length(tokens, 1, "one sequence")
        return self._forward(tokens, batched=False)

    def batched(self, tokens: Int[Array, "batch n"]) -> Float[Array, "batch n vocab"]:
        """`jax.vmap(self)(tokens)` as one depth solve over the batch (cheaper backward)."""
        self._check_length(tokens, 2, "a batch [batch, n] with n")
        return self._forward(tokens, batched=True)

    def initial_state(self, tokens: Int[Array, "... n"]) -> Float[Array, "... n width"]:
        """The initial condition $f$ of the equation for tokens (any leading axes)."""
        u = self.embedding[tokens]
        return u if self.position is None else u + self.position[: tokens.shape[-1]]

    def head(self, u: Float[Array, "... n width"]) -> Float[Array, "... n vocab"]:
        """The logits from the solution $u(T)$ (any leading axes): the equation's output map
        (its `final_norm`, if any) then the readout ($E^\\top$ when tied)."""
        h = _output(self.equation, u)
        logits = h @ self.embedding.T if self.readout is None else h @ self.readout
        return logits if self.readout_bias is None else logits + self.readout_bias

    def _forward(self, tokens, batched: bool):
        """Embed (any leading axes), solve in depth, read out."""
        u0 = self.initial_state(tokens)
        return self.head(integrate(self.equation, u0, self.scheme, self.dt, batched=batched))


class FieldModel(eqx.Module):
    r"""$u_0$ on $N$ periodic grid points $\to$ $u(t_f)$ on the same points: features
    $[u_0(x), \sin x, \cos x]$ lifted linearly to the width, the IDE on the periodic token
    domain $[0, 2\pi)$, a linear readout to one value per token. Any even $N$ works.

    - `lift`: `[3, width]` and `lift_bias`: `[width]`, the lift of $[u_0, \sin x, \cos x]$.
    - `equation`: the equation, a [`TransformerIDE`][itde.TransformerIDE] on the periodic
      grid (`ide` before issue 46: a deprecated alias for one release).
    - `readout`: `[width]` and `readout_bias`: a scalar, the value read from $u(t_f)$.
    - `scheme`, `dt`: the depth integrator (a name of `itde.SCHEMES`) and its step."""

    lift: Float[Array, "3 width"] = kernel()
    lift_bias: Float[Array, " width"]
    equation: TransformerIDE
    readout: Float[Array, " width"] = kernel()
    readout_bias: Float[Array, ""]
    scheme: str = eqx.field(static=True, default="lie")
    dt: float = eqx.field(static=True, default=1.0)

    ide = property(_deprecated_ide, doc="Deprecated: the `equation` (its name before issue 46).")

    @property
    def dtype(self):
        """The parameters' dtype (the lift's)."""
        return self.lift.dtype

    def __call__(self, u0: Float[Array, " n"]) -> Float[Array, " n"]:
        if u0.ndim != 1:
            raise ValueError(f"`u0` must be one field of shape [n], got {u0.shape}.")
        return self._forward(u0, batched=False)

    def batched(self, u0: Float[Array, "batch n"]) -> Float[Array, "batch n"]:
        """`jax.vmap(self)(u0)` as one depth solve over the batch (cheaper backward)."""
        if u0.ndim != 2:
            raise ValueError(f"`u0` must be a batch of fields [batch, n], got {u0.shape}.")
        return self._forward(u0, batched=True)

    def initial_state(self, u0: Float[Array, "... n"]) -> Float[Array, "... n width"]:
        """The initial condition $f$: $[u_0, \\sin x, \\cos x]$ lifted to the width (any
        leading axes)."""
        n = u0.shape[-1]
        x = jnp.arange(n, dtype=u0.dtype) * jnp.asarray(2 * math.pi / n, u0.dtype)
        waves = jnp.broadcast_to(jnp.stack([jnp.sin(x), jnp.cos(x)], axis=-1), (*u0.shape, 2))
        feats = jnp.concatenate([u0[..., None], waves], axis=-1)
        return feats @ self.lift + self.lift_bias

    def head(self, u: Float[Array, "... n width"]) -> Float[Array, "... n"]:
        """The predicted field from the solution $u(T)$ (any leading axes): the equation's
        output map (its `final_norm`, if any) then the readout."""
        return _output(self.equation, u) @ self.readout + self.readout_bias

    def _forward(self, u0, batched: bool):
        """Lift (any leading axes), solve in depth, read out."""
        f = self.initial_state(u0)
        return self.head(integrate(self.equation, f, self.scheme, self.dt, batched=batched))


def with_depth(model, scheme: str | None = None, dt: float | None = None, *, name: str = "dt"):
    """The same model evaluated with another depth scheme and/or step (`name`: the argument
    named in an error, e.g. `"--dt"`)."""
    scheme = model.scheme if scheme is None else scheme
    dt = model.dt if dt is None else dt
    check_depth(model.equation, scheme, dt, name=name)
    dt = float(dt)
    return dataclasses.replace(model, scheme=scheme, dt=dt)


#: The $\varepsilon$ of a continuous model's final LayerNorm (an output map, not a
#: constraint of the equation): GPT-2's and nanoGPT's.
FINAL_NORM_EPS = 1e-5


def build_ide(key: PRNGKeyArray, m, *, causal: bool, grid: Grid, dtype) -> TransformerIDE:
    """The Transformer IDE of a `[model]` table: per-layer controls for `"lie"`, Legendre
    controls (constraint set $S_1(0, 1)$ at initialisation, moving once trained) otherwise,
    with the table's block form and optional final norm (identity-initialised)."""
    block = dict(
        n_features=m.n_features, n_heads=m.n_heads, n_hidden=m.n_hidden, activation=m.activation
    )
    if not m.continuous:
        return TransformerIDE.init(
            key, n_layers=m.n_layers, eps=m.eps, causal=causal,
            block=block_from_names(m.block, m.ffn_form), final_norm=m.final_norm, grid=grid,
            dtype=dtype, **block,
        )  # fmt: skip
    controls = LegendreControls.init(
        key, n_modes=m.n_modes, t1=float(m.n_layers), amplitude=0.1, sigma1=(0.0,),
        sigma2=(1.0,), eps=0.0, dtype=dtype, **block,
    )  # fmt: skip
    final = None
    if m.final_norm:  # a LayerNorm with a unit gain and zero shift, as ln_f starts
        final = LayerNormProjection.identity(m.n_features, eps=FINAL_NORM_EPS, dtype=dtype)
    return TransformerIDE(
        controls, grid, causal=causal, block=block_from_names(m.block, m.ffn_form),
        final_norm=final,
    )  # fmt: skip


def init_token_model(
    key: PRNGKeyArray, m, *, vocab: int, context: int, causal: bool, dtype=jnp.float32
) -> TokenModel:
    """A [`TokenModel`][itde.train.TokenModel] for the `[model]` table `m`: `vocab` tokens,
    sequences of at most `context`, causal (Volterra) attention or not, unit token grid.
    With `m.tie_embeddings` the head is the embedding (no readout, no bias) and the token
    and position embeddings are drawn with standard deviation $1/\\sqrt{d}$ (else 1)."""
    k_ide, k_a, k_b, k_c = jax.random.split(key, 4)
    d = m.n_features
    ide = build_ide(k_ide, m, causal=causal, grid=Grid.unit(d), dtype=dtype)
    tied = bool(getattr(m, "tie_embeddings", False))
    # tied: E is also the head, so E and P start at GPT-2's scale (std 0.02 ~ 0.55/sqrt(d)
    # at d = 768) instead of 1, which would make the first logits O(sqrt(d))
    scale = 1 / math.sqrt(d) if tied else 1.0
    return TokenModel(
        embedding=normal(k_a, (vocab, d), dtype) * jnp.asarray(scale, dtype),
        position=normal(k_b, (context, d), dtype) * jnp.asarray(scale, dtype),
        equation=ide,
        readout=None if tied else _uniform(k_c, (d, vocab), 1 / math.sqrt(d), dtype),
        readout_bias=None if tied else jnp.zeros((vocab,), dtype),
        scheme=m.scheme,
        dt=float(m.dt),
    )


def init_field_model(key: PRNGKeyArray, m, *, dtype=jnp.float32) -> FieldModel:
    """A [`FieldModel`][itde.train.FieldModel] for the `[model]` table `m` on the periodic
    token domain $[0, 2\\pi)$ (periodic trapezoid rule)."""
    k_ide, k_a, k_b, _ = jax.random.split(key, 4)
    d = m.n_features
    grid = Grid(PeriodicTrapezoid(interval=(0.0, 2 * math.pi)), Midpoint(), d)
    return FieldModel(
        lift=_uniform(k_a, (3, d), 1.0, dtype),
        lift_bias=jnp.zeros((d,), dtype),
        equation=build_ide(k_ide, m, causal=False, grid=grid, dtype=dtype),
        readout=_uniform(k_b, (d,), 1 / math.sqrt(d), dtype),
        readout_bias=jnp.zeros((), dtype),
        scheme=m.scheme,
        dt=float(m.dt),
    )


def cast(tree, dtype):
    """Cast every floating-point array leaf of `tree` to `dtype` (differentiable)."""
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


# ----------------------------------------------------------------------------- losses
def cross_entropy(logits, targets):
    """Mean next-token / per-position cross-entropy in nats (computed in float32 or wider)."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def check_inputs(model, x) -> None:
    """Token ids must be integers below the vocabulary size (a gather would clamp them
    silently); checked when `x` is concrete."""
    if not hasattr(x, "dtype"):
        raise TypeError(f"`x` must be an array of inputs, got {type(x).__name__}.")
    embedding = getattr(model, "embedding", None)
    if embedding is None:  # a field model: real-valued inputs
        return
    vocab = embedding.shape[0]
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`x` holds token ids and must be integers, got dtype {x.dtype}.")
    if isinstance(x, jax.core.Tracer) or not x.size:
        return
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return  # another process holds part of it; each process checks its own shard
    xn = np.asarray(x)
    lo, hi = int(xn.min()), int(xn.max())
    if lo < 0 or hi >= vocab:
        raise ValueError(
            f"`x` holds token ids in [{lo}, {hi}] but the model's vocabulary has {vocab} "
            f"tokens: ids must be in [0, {vocab - 1}]."
        )


def param_dtype(model):
    """The dtype of a model's parameters: its `dtype` (`TokenModel`, `FieldModel`), else
    that of its first floating-point array (any model with a `batched` method)."""
    dtype = getattr(model, "dtype", None)
    if dtype is None:
        dtype = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))[0].dtype
    return dtype


def predict(model, x, compute_dtype=None):
    """The batched forward pass (one depth solve over the leading axis, equal to `jax.vmap`
    of the model), optionally in `compute_dtype`
    (parameters and inputs cast; the output cast back to the parameters' dtype)."""
    out_dtype = param_dtype(model)
    model, x = in_compute_dtype(model, x, compute_dtype)
    return model.batched(x).astype(out_dtype)


def in_compute_dtype(model, x, compute_dtype=None):
    """`(model, x)` checked and cast for a pass in `compute_dtype` (None, or the
    parameters' own dtype: unchanged); integer token ids stay integers."""
    check_inputs(model, x)
    if compute_dtype is not None and compute_dtype != param_dtype(model):
        model = cast(model, compute_dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            x = x.astype(compute_dtype)
    return model, x


def loss_fn(model, batch, task, compute_dtype=None):
    """The training loss of a batch `(x, y)`: `task.loss` of the batched prediction
    (cross-entropy for sort and charlm, the mean squared error for burgers)."""
    x, y = batch
    return task.loss(predict(model, x, compute_dtype), y)
