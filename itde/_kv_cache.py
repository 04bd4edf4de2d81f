r"""A key/value cache for causal generation: each new token runs its own trajectory only.

In a causal (Volterra) equation the state of token $x$ at every depth depends only on the
tokens $\tilde x \le x$: the attention integral reads their keys and values, and every
other operator (norms, feed-forward) acts on one token at a time. So once a prefix has
been solved, its keys and values at every evaluation of the attention field are fixed,
and the trajectory of a new token is the solve of one row attending to those stored rows
and to itself. This is exact (the same sums, to round-off), under three conditions this
module checks and refuses by name where they fail ([`check_cacheable`][itde.check_cacheable]):

- **the cache knows which evaluation of the attention it is in.** The discrete network
  (Lie splitting, $\Delta t$ = one layer: one evaluation per layer) and a fixed-step
  explicit Runge-Kutta method on smooth controls (`diffrax.AbstractERK`: Euler, Heun,
  `itde_solvers.RK4`; one evaluation per step and stage) are cached here, the stages run
  by this module from the method's Butcher tableau. Any other solver evaluates the field
  at stages diffrax does not name to it (it passes only the time, and RK4's stages 2 and
  3 share one), so stored keys cannot be indexed: refused.
- **the steps do not depend on the sequence.** An adaptive step-size controller chooses
  its steps from the error of the whole sequence: the prefix's steps change when a token
  is added. Refused.
- **earlier rows do not change with $N$.** On the unit grid (midpoint, unit weights) the
  causal sum of token $x$ reads the same weights whatever follows it; a Volterra rule of
  higher order (trapezoid, Simpson, Gauss–Legendre: [`volterra_weights`][itde.volterra_weights])
  has nodes and weights that move when a token is added. Refused.

The cache holds fixed-size buffers `[kv_heads, max_length, head_dim]` per layer and a
length counter; the prefill solves the whole window once (the prompt, then filler the
causal attention never lets earlier tokens read) and stores its keys and values; a decode
step writes its token's row at its position and masks every key after it (and outside a
sliding window). Everything is compiled once per model and `max_length`.

The per-layer operators are the model's own: the norms and the feed-forward are the
equation's fields evaluated on the new token's rows, and the attention is
[`Attention.project_qkv`][itde.Attention.project_qkv] then
[`Attention.attend`][itde.Attention.attend], the two halves of the operator every solve
calls; only the key axis differs (the cache instead of the sequence).

**Precision.** The state is carried in the dtype [`itde.solve`][itde.solve] carries it
in: float32 or wider (a bfloat16 or float16 model's state in float32, its matrix products
in the parameters' half precision, accumulated in float32), and the keys and values are
stored in it. So the prefill gives the solve's final states, and a decode step computes
the solve's operations in the solve's precision, its attention sums over the cache in
another order: its states equal the solve's to the round-off of float32 (measured on a
tiny bfloat16 Llama: within 1e-6; greedy tokens with and without the cache equal on 30
prompts of 20 tokens, where a cache carrying the state in bfloat16 was 0.2-0.3 apart and
changed the tokens of some prompts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._blocks import OutputNorm, Parallel, PreNorm, SandwichNorm
from ._controls import PiecewiseConstant
from ._equation import TransformerIDE
from ._operators._precision import wide
from ._programs import check
from ._quadrature._rules import AbstractQuadrature


class NotCacheableError(ValueError):
    """The model (or the way it is solved) cannot be cached exactly; the message says why
    and what to do."""


# ------------------------------------------------------------------ the block forms
def _pre_norm_step(eq, t, u, attention):
    """Lie with Euler sub-steps and $\\Delta t = 1$: $v = u + A(N_1 u)$, $v + F(N_2 v)$."""
    a, kv = attention(u)
    v = u + a
    return v + eq.feedforward_field(t, v), kv


def _parallel_step(eq, t, u, attention):
    """One Euler step of the summed field: $u + A(N_1 u) + F(N_2 u)$."""
    a, kv = attention(u)
    return u + a + eq.feedforward_field(t, u), kv


#: One layer of the discrete network (Lie, $\Delta t$ = one layer) by block form: how the
#: attention (which reads the cache) and the feed-forward compose in the block. A block
#: form not listed here is refused by `check_cacheable`.
LIE_STEPS: dict[type, Callable] = {
    PreNorm: _pre_norm_step,
    Parallel: _parallel_step,
    # a norm after each sublayer: the same composition (the norms sit inside the fields)
    SandwichNorm: _pre_norm_step,
    OutputNorm: _pre_norm_step,
}
"""One layer of the discrete network (Lie, one step per layer) by block form, for the cache:
`step(eq, t, u, attention)` composes the cached attention and the feed-forward as the block
does. A block form not listed is refused by [`check_cacheable`][itde.check_cacheable]."""


# ------------------------------------------------------------------ refusals
def check_cacheable(
    eq: TransformerIDE,
    max_length: int,
    *,
    solver: diffrax.AbstractSolver | None = None,
    stepsize_controller: diffrax.AbstractStepSizeController | None = None,
    dt0: float | None = None,
) -> None:
    """Raise [`NotCacheableError`][itde.NotCacheableError] naming why `eq`, solved with
    `solver`, `stepsize_controller` and `dt0` (None: the defaults of
    [`itde.solve`][itde.solve], the discrete network), cannot be cached exactly for
    windows of `max_length` tokens; return None when it can."""
    from itde_solvers import LieTrotter

    if not isinstance(eq, TransformerIDE):
        raise NotCacheableError(f"the cache needs an itde.TransformerIDE, got {type(eq).__name__}.")
    if not eq.causal:
        raise NotCacheableError(
            "the model is not causal: every token reads the tokens after it, so a new token "
            "changes the earlier ones; the cache needs causal=True."
        )
    if stepsize_controller is not None and not isinstance(
        stepsize_controller, diffrax.ConstantStepSize
    ):
        raise NotCacheableError(
            f"`stepsize_controller`={type(stepsize_controller).__name__}: an adaptive "
            "controller chooses the depth steps from the error of the whole sequence, so the "
            "earlier tokens' steps (and states) change when a token is added; solve with "
            "fixed steps (no controller) to cache, or generate with cache=False."
        )
    if _explicit_rk(solver) is not None:
        _check_explicit_rk(eq, solver, dt0)
        _check_common(eq, max_length)
        return
    if solver is not None and not isinstance(solver, LieTrotter):
        raise NotCacheableError(
            f"`solver`={type(solver).__name__}: the cache stores the keys and values of each "
            "evaluation of the attention field, by layer (itde_solvers.LieTrotter with dt0 "
            "= one layer) or by step and stage of an explicit Runge-Kutta method "
            "(diffrax.AbstractERK: Euler, Heun, itde_solvers.RK4, with a fixed dt0), whose "
            "stages it runs itself; a wrapped or implicit solver evaluates the field at "
            "stages it does not name to it (diffrax passes only the time, and RK4's "
            "stages 2 and 3 share one), so the keys cannot be indexed; generate with "
            "cache=False."
        )
    if not isinstance(eq.controls, PiecewiseConstant):
        raise NotCacheableError(
            f"controls of type {type(eq.controls).__name__} are smooth in depth and are "
            "solved by a diffrax solver at steps of its own; the cache covers the discrete "
            "network (PiecewiseConstant controls, one Lie step per layer); generate with "
            "cache=False."
        )
    if dt0 is not None and dt0 != eq.controls.layer_length:
        raise NotCacheableError(
            f"`dt0`={dt0!r}: the cache covers one Lie step per layer (dt0 = "
            f"{eq.controls.layer_length}); with several steps per layer use cache=False."
        )
    if type(eq.block) not in LIE_STEPS:
        raise NotCacheableError(
            f"`block`={eq.block!r}: the cache has a layer step for "
            f"{', '.join(c.__name__ + '()' for c in LIE_STEPS)} only (itde.LIE_STEPS); "
            "generate with cache=False."
        )
    _check_common(eq, max_length)


def _explicit_rk(solver):
    """The explicit Runge-Kutta method a solver runs (inside wrappers such as
    `itde_solvers.Projected`, the identity on an unconstrained equation), or None."""
    while isinstance(solver, diffrax.AbstractWrappedSolver):
        solver = solver.solver
    return solver if isinstance(solver, diffrax.AbstractERK) else None


def _check_explicit_rk(eq, solver, dt0):
    if dt0 is None:
        raise NotCacheableError(
            f"`solver`={type(solver).__name__} needs a fixed step `dt0` for the cache (the "
            "keys are stored per step and stage)."
        )
    if eq.block.has_constraint:
        raise NotCacheableError(
            f"`block`={eq.block!r}: a post-norm equation lives on a constraint set and its "
            "Runge-Kutta solve is projected; the cache runs explicit stages of an "
            "unconstrained field (PreNorm(), Parallel()) only; generate with cache=False."
        )
    if isinstance(eq.controls, PiecewiseConstant):
        raise NotCacheableError(
            f"`solver`={type(solver).__name__} on per-layer controls: the solve freezes "
            "each step's layer (FrozenTime), which the cache's stages do not; cache the "
            "discrete network (the default solver) or smooth controls "
            "(LegendreControls, SplineControls)."
        )
    steps = (eq.depth - eq.t0) / dt0
    if not (dt0 > 0 and abs(steps - round(steps)) < 1e-9):
        raise NotCacheableError(
            f"`dt0`={dt0!r} must divide the depth {eq.depth - eq.t0} for the cache."
        )


def _check_common(eq, max_length):
    tokens = eq.grid.tokens
    if not (isinstance(tokens, AbstractQuadrature) and tokens.is_unit(max_length)):
        raise NotCacheableError(
            f"the token rule {tokens!r} is not the unit grid: its nodes and Volterra "
            "weights for the earlier tokens change with the number of tokens N, so their "
            "states change when a token is added; only the unit grid (Midpoint(), unit "
            "weights) is cacheable; generate with cache=False."
        )
    if eq.score_bias is not None:
        raise NotCacheableError(
            f"`score_bias`={type(eq.score_bias).__name__}: the cache does not evaluate "
            "score biases yet; generate with cache=False."
        )
    if eq.controls.blocks.affine1 is not None or eq.controls.blocks.affine2 is not None:
        raise NotCacheableError(
            "the controls carry continuum-form affine fields (affine1/affine2); the cache "
            "covers the network itself; generate with cache=False."
        )


# ------------------------------------------------------------------ the cache
class KVCache(eqx.Module):
    """Keys and values of every layer for a window of `max_length` tokens, of which the
    first `length` are filled, in the solve's dtype (float32 for a half-precision model).

    - `keys`, `values`: one array per evaluation of the attention field (per layer, or
      per step and stage), `[kv_heads, max_length, head_dim]` and
      `[kv_heads, max_length, value_dim]` (rotated keys, before grouped-query repetition).
    - `length`: the number of filled positions (a scalar int32 array).
    """

    keys: tuple[Float[Array, "kv_heads max_length head_dim"], ...]
    values: tuple[Float[Array, "kv_heads max_length value_dim"], ...]
    length: Int[Array, ""]

    @property
    def max_length(self) -> int:
        return int(self.keys[0].shape[1])


def _on_host(a) -> bool:
    """A concrete array whose every shard lives in the host's memory (the CPU backend)."""
    return (
        isinstance(a, jax.Array)
        and not isinstance(a, jax.core.Tracer)
        and all(d.platform == "cpu" for d in a.devices())
    )


def _layer_slice(a, n: int):
    """`a[n : n + 1]`. On the CPU backend the slice is copied in NumPy (a view of the
    array's own buffer, then one copy into a new one): an eager `a[n : n + 1]` would compile
    a program for each `n` and shape, and one program for all the slices of a model takes
    longer to compile (about 1.3 s for GPT-2 124M) than the copy takes to run."""
    if _on_host(a):
        return jnp.asarray(np.asarray(a)[n : n + 1])
    return a[n : n + 1]


def split_layers(eq: TransformerIDE) -> tuple[TransformerIDE, ...] | None:
    """The equation as one single-layer equation per layer (its controls sliced once,
    outside any compiled loop: slicing stacked weights inside the decode loop copies them
    at every step on XLA:CPU); None for controls that are not per layer (smooth ones,
    evaluated at each stage's time)."""
    c = eq.controls
    if not isinstance(c, PiecewiseConstant):
        return None
    out = []
    for n, t in enumerate(c.layer_times()[:-1]):
        values = jax.tree.map(lambda a: _layer_slice(a, n), c.values)
        controls = dataclasses.replace(c, values=values, t0=t)
        out.append(dataclasses.replace(eq, controls=controls))
    return tuple(out)


class _DecodeCore(eqx.Module):
    r"""The dense core's own softmax for queries against the cached keys (the key axis is
    the cache's, longer than the queries'), with one row of key log-weights per query
    (`token_log_weights` `[queries, keys]`: 0 where the query reads the key, $-\infty$
    where not). It reads the cache's `n_kv_heads` keys and values as they are
    (`reads_grouped_heads`): the `h / h_kv` query heads of a group are stacked as extra
    query rows of their key/value head, so a decode step never copies the cache once per
    query head."""

    reads_grouped_heads: ClassVar[bool] = True

    def __call__(self, q, k, v, *, token_log_weights, score_cap=None):
        dtype = jnp.result_type(q.dtype, k.dtype, v.dtype)
        h, n, e = q.shape
        g = k.shape[0]  # key/value heads: query head m reads m // (h / g)
        qg = q.reshape(g, (h // g) * n, e)  # rows: (query head in the group, query)
        bias = jnp.tile(token_log_weights, (h // g, 1)).astype(dtype)
        s = jnp.einsum("gre,gpe->grp", qg.astype(dtype), k.astype(dtype))
        if score_cap is not None:  # the dense core's cap: on q . k, before the masks
            s = score_cap(s)
        s = s + bias[None]
        # the dense core's softmax (`dense_softmax_parts`): a row's shift is at least the
        # lowest finite number, so a row with no admissible key gives 0, never NaN
        lo = jnp.finfo(dtype).min
        m = jnp.maximum(jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)), lo)
        p = jnp.exp(s - m)
        ell = jnp.sum(p, axis=-1, keepdims=True) + jnp.exp(lo - m)
        o = jnp.einsum("grp,gpe->gre", p, v.astype(dtype)) / ell
        return o.reshape(h, n, o.shape[-1])


_decode_core = _DecodeCore()


def _attention(eq, t, u, keys, values, pos, n_max: int, full: bool, fused=None):
    """The attention field of the single-layer equation `eq` at `t` on the rows `u`
    (positions `pos, pos + 1, ...`), reading and updating the layer's cache. `fused`:
    the layer's `Attention.fused_qkv()`, computed once by a caller that loops."""
    att, head_weights = eq.controls(t, "right", "attention").discretise(eq.grid)
    v_in = eq.block.attention_input(eq, t, u)
    nodes = eq.grid.tokens.nodes_weights(n_max)[0]
    x = jnp.asarray(nodes)
    rotary = None
    rope = eq.rope if eq.controls.blocks.rope is None else eq.controls(t, "right", "rope")
    if rope is not None:
        rotary = rope.cos_sin(jax.lax.dynamic_slice_in_dim(x, pos, u.shape[0]), u.dtype)
    layer_window = None
    if eq.controls.blocks.window is not None:
        layer_window = eq.controls(t, "right", "window")
    q, k, v = att.project_qkv(
        v_in, feature_weights=eq.feature_weights(), rotary=rotary, fused=fused
    )
    window = None if eq.window is None else eq.window.on_nodes(nodes)
    if full:  # the prefill: the whole window at once, as the uncached solve computes it
        extra = {} if window is None else {"window": window}
        if layer_window is not None:
            extra["score_bias"] = layer_window.score_bias(x)
        out = att.attend(
            q, k, v, head_weights=head_weights, core=eq.attention_core, causal=True, **extra
        )
        return eq.block.attention_output(eq, t, out), (k, v)
    keys = jax.lax.dynamic_update_slice_in_dim(keys, k.astype(keys.dtype), pos, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(values, v.astype(values.dtype), pos, axis=1)
    rows = pos + jnp.arange(u.shape[0])  # the positions of the rows of `u`
    p = jnp.arange(n_max)
    ok = p[None, :] <= rows[:, None]  # causal: each row reads the keys up to its own
    if window is not None:
        ok = ok & window(rows, p)
    if layer_window is not None:
        ok = ok & layer_window.admits(x[rows], x)
    lw = jnp.where(ok, 0.0, -jnp.inf).astype(u.dtype)
    out = att.attend(
        q, keys, values, head_weights=head_weights, core=_decode_core, token_log_weights=lw
    )
    return eq.block.attention_output(eq, t, out), (keys, values)


def _run(eq, layers, u, cache_kv, pos, n_max, full):
    """The discrete network: one Lie step per layer, the layer's own cache."""
    step = LIE_STEPS[type(eq.block)]
    keys, values = [], []
    for n, layer in enumerate(layers):
        t = layer.controls.t0
        k0, v0 = cache_kv[0][n], cache_kv[1][n]
        u, (k, v) = step(layer, t, u, lambda w: _attention(layer, t, w, k0, v0, pos, n_max, full))
        keys.append(k)
        values.append(v)
    return u, tuple(keys), tuple(values)


def _stages(tableau):
    """The full Butcher matrix, the weights and nodes of an explicit tableau (diffrax's
    `ButcherTableau`), and the stages that reach the solution (a first-same-as-last
    stage, weight 0 and read by no later stage, is left out: it is the next step's
    first)."""
    s = len(tableau.b_sol)
    a = np.zeros((s, s))
    for i, row in enumerate(tableau.a_lower, start=1):
        a[i, : len(row)] = row
    b = np.asarray(tableau.b_sol, np.float64)
    c = np.concatenate([[0.0], np.asarray(tableau.c, np.float64)])
    needed: set[int] = set()
    for i in reversed(range(s)):
        if b[i] != 0 or any(a[j, i] != 0 for j in needed):
            needed.add(i)
    return a, b, c, sorted(needed)


def n_evaluations(eq: TransformerIDE, solver=None, dt0=None) -> int:
    """How many evaluations of the attention field the cache stores: one per layer (the
    discrete network) or one per step and stage of an explicit Runge-Kutta `solver`."""
    rk = _explicit_rk(solver)
    if rk is None:
        return eq.n_layers
    steps = int(round((eq.depth - eq.t0) / dt0))
    return steps * len(_stages(rk.tableau)[3])


def _run_erk(eq, solver, dt0, u, cache_kv, pos, n_max, full):
    """An explicit Runge-Kutta solve of the field $A(N_1 u) + F(N_2 u)$ with fixed steps,
    each stage's attention reading its own cache (indexed by step and stage)."""
    a, b, c, stages = _stages(_explicit_rk(solver).tableau)
    steps = int(round((eq.depth - eq.t0) / dt0))
    keys, values = [], []
    dt = jnp.asarray(dt0, u.dtype)
    for n in range(steps):
        t = eq.t0 + n * dt0
        ks = {}
        for i in stages:
            y = u
            for j in stages:
                if j < i and a[i, j] != 0:
                    y = y + (dt * a[i, j]) * ks[j]
            ti = t + c[i] * dt0
            m = len(keys)
            att, (k, v) = _attention(eq, ti, y, cache_kv[0][m], cache_kv[1][m], pos, n_max, full)
            ks[i] = att + eq.feedforward_field(ti, y)
            keys.append(k)
            values.append(v)
        u = u + sum((dt * b[i]) * ks[i] for i in stages if b[i] != 0)
    return u, tuple(keys), tuple(values)


def _solve(eq, layers, u, cache_kv, pos, n_max, full, solver, dt0):
    if _explicit_rk(solver) is not None:
        return _run_erk(eq, solver, dt0, u, cache_kv, pos, n_max, full)
    return _run(eq, layers, u, cache_kv, pos, n_max, full)


def prefill(
    eq: TransformerIDE, layers, u0: Float[Array, "max_length features"], length, *,
    solver=None, dt0=None,
) -> tuple[Float[Array, "max_length features"], KVCache]:  # fmt: skip
    """Solve the whole window `u0` (`[max_length, features]`: the prompt's `length` rows,
    then any filler) once and keep the keys and values of every evaluation of the
    attention. Returns the final states $u(T)$ (`solve(eq, u0).ys[-1]`, in its dtype:
    float32 for a bfloat16 or float16 `u0`; `eq.output` maps them to the model's output;
    rows past `length` are meaningless) and the cache, filled to `length`.

    **Arguments:** `layers`: [`split_layers(eq)`][itde.split_layers] for the discrete
    network (the default `solver=None`), unused (None) otherwise; `solver`, `dt0`: an
    explicit Runge-Kutta method (`diffrax.AbstractERK`, e.g. `itde_solvers.RK4()`) and its
    fixed step, for a model with smooth controls (see
    [`check_cacheable`][itde.check_cacheable])."""
    n_max = u0.shape[0]
    n = n_evaluations(eq, solver, dt0)
    u0 = _state(u0)
    u, keys, values = _solve(eq, layers, u0, ((None,) * n,) * 2, 0, n_max, True, solver, dt0)
    return u, KVCache(keys, values, jnp.asarray(length, jnp.int32))


def decode(
    eq: TransformerIDE, layers, u: Float[Array, "rows features"], cache: KVCache, *,
    solver=None, dt0=None,
) -> tuple[Float[Array, "rows features"], KVCache]:  # fmt: skip
    """The trajectories of new tokens (their initial states `u`, `[rows, features]`, at
    positions `cache.length, cache.length + 1, ...`; one row for a decode step, a chunk of
    the prompt for a prefill by chunks) attending to the cached keys and values and to
    each other causally. Returns their final states $u(T)$ `[rows, features]` (in the
    solve's dtype, as [`prefill`][itde.prefill]'s) and the cache with their rows written,
    `rows` longer. The rows must fit the cache
    (`cache.length + rows <= cache.max_length`): rows that do not are a `ValueError`
    (called eagerly) or an `equinox.EquinoxRuntimeError` (inside `jax.jit`), never a write
    past the end. Arguments as [`prefill`][itde.prefill]'s."""
    rows, n_max = u.shape[0], cache.max_length
    message = (f"`u` has {rows} rows, which do not fit the cache after its `cache.length` "
               f"filled positions (`cache.max_length`={n_max}): start from a longer cache "
               f"(`empty_cache(..., max_length=)`) or decode fewer rows")  # fmt: skip
    if isinstance(cache.length, jax.core.Tracer):
        u = check(u, cache.length + rows > n_max, message)
    elif int(cache.length) + rows > n_max:
        raise ValueError(f"{message} (`cache.length`={int(cache.length)})")
    return _decode(eq, layers, u, cache, solver=solver, dt0=dt0)


def _state(u):
    """The state in the dtype [`itde.solve`][itde.solve] carries it in: float32 or wider
    (diffrax promotes a bfloat16 or float16 state to its times' dtype; the matrix
    products still run in the parameters' half precision, accumulated in float32), so
    that the cache computes the solve's operations in the solve's precision."""
    return u.astype(wide(u.dtype))


def _decode(eq, layers, u, cache: KVCache, *, solver=None, dt0=None):
    """[`decode`][itde.decode] without its check that the rows fit (the generation engine
    and the prefill by chunks size the cache themselves)."""
    pos = cache.length
    h, keys, values = _solve(
        eq, layers, _state(u), (cache.keys, cache.values), pos, cache.max_length, False,
        solver, dt0,
    )  # fmt: skip
    return h, KVCache(keys, values, pos + u.shape[0])


def _kv_shapes(eq: TransformerIDE, t, dtype):
    """The shapes of one token's keys and values at an evaluation of the attention at
    `t`, `[kv_heads, 1, head_dim]` and `[kv_heads, 1, value_dim]` (traced abstractly)."""
    att = eq.controls(t, "right", "attention").discretise(eq.grid)[0]
    u = jax.ShapeDtypeStruct((1, eq.grid.n_features), wide(dtype))
    return jax.eval_shape(lambda u: att.project_qkv(u)[1:], u)


def empty_cache(
    eq: TransformerIDE, layers, max_length: int, dtype, *, solver=None, dt0=None
) -> KVCache:
    """A cache of `max_length` positions with none filled (zeros, `length` 0), shaped as
    the keys and values of `eq` solved with `solver` and `dt0` (see
    [`prefill`][itde.prefill]); [`decode`][itde.decode] fills it, one row or a chunk of
    rows at a time. (`layers` is unused; it keeps the signature of the other entry
    points.)"""
    del layers
    shapes = _kv_shapes(eq, eq.t0, dtype)

    def zeros(s):
        return jnp.zeros((s.shape[0], max_length, *s.shape[2:]), s.dtype)

    n = n_evaluations(eq, solver, dt0)
    keys, values = (tuple(zeros(s) for _ in range(n)) for s in shapes)
    return KVCache(keys, values, jnp.zeros((), jnp.int32))


def prefill_by_chunks(
    eq: TransformerIDE, layers, u0: Float[Array, "max_length features"], length, *,
    rows: int, solver=None, dt0=None,
) -> tuple[Float[Array, "max_length features"], KVCache]:  # fmt: skip
    """[`prefill`][itde.prefill] of the first `length` rows of `u0` (`length` traced;
    `max_length`, the rows of `u0`, a multiple of `rows`), solved in chunks of `rows`
    rows, each attending to the keys and values of the ones before it: the work is
    `length` rounded up to a chunk, not `max_length`, and one compiled program serves
    every `length`. Returns the final states (rows past the last chunk are `u0`'s) and
    the cache, filled to `length`.

    The discrete network is solved layer by layer: a `jax.lax.scan` over the layers
    (each layer's weights read once for all its chunks; compiled once, whatever the
    depth), and inside it a loop over the chunks. A Runge-Kutta solve (smooth controls)
    runs each chunk through every step and stage against an empty cache instead."""
    n_max = u0.shape[0]
    if n_max % rows:
        raise ValueError(f"the window's {n_max} rows must be a multiple of `rows`={rows}.")
    chunks = (length + rows - 1) // rows
    u0 = _state(u0)
    if _explicit_rk(solver) is not None:
        cache = empty_cache(eq, layers, n_max, u0.dtype, solver=solver, dt0=dt0)

        def rk_chunk(i, carry):
            u, cache = carry
            h, cache = _decode(eq, layers, jax.lax.dynamic_slice_in_dim(u, i * rows, rows),
                              cache, solver=solver, dt0=dt0)  # fmt: skip
            return jax.lax.dynamic_update_slice_in_dim(u, h, i * rows, axis=0), cache

        u, cache = jax.lax.fori_loop(0, chunks, rk_chunk, (u0, cache))
        return u, eqx.tree_at(lambda c: c.length, cache, jnp.asarray(length, jnp.int32))
    c = eq.controls
    step = LIE_STEPS[type(eq.block)]
    t = c.t0
    kshape, vshape = _kv_shapes(eq, t, u0.dtype)

    def layer(u, values):
        one = dataclasses.replace(c, values=jax.tree.map(lambda a: a[None], values))
        eq_l = dataclasses.replace(eq, controls=one)
        keys = jnp.zeros((kshape.shape[0], n_max, *kshape.shape[2:]), kshape.dtype)
        vals = jnp.zeros((vshape.shape[0], n_max, *vshape.shape[2:]), vshape.dtype)
        # the layer's projection weights side by side, once for all its chunks
        fused = eq_l.controls(t, "right", "attention").discretise(eq_l.grid)[0].fused_qkv()

        def chunk(i, carry):
            u, keys, vals = carry
            pos = i * rows
            w = jax.lax.dynamic_slice_in_dim(u, pos, rows)
            h, (keys, vals) = step(eq_l, t, w, lambda x: _attention(
                eq_l, t, x, keys, vals, pos, n_max, False, fused
            ))  # fmt: skip
            return jax.lax.dynamic_update_slice_in_dim(u, h, pos, axis=0), keys, vals

        u, keys, vals = jax.lax.fori_loop(0, chunks, chunk, (u, keys, vals))
        return u, (keys, vals)

    u, (keys, vals) = jax.lax.scan(layer, u0, c.values)
    n = c.n_layers
    cache = KVCache(tuple(keys[i] for i in range(n)), tuple(vals[i] for i in range(n)),
                    jnp.asarray(length, jnp.int32))  # fmt: skip
    return u, cache


__all__ = [
    "KVCache",
    "LIE_STEPS",
    "NotCacheableError",
    "check_cacheable",
    "decode",
    "empty_cache",
    "n_evaluations",
    "prefill",
    "prefill_by_chunks",
    "split_layers",
]
