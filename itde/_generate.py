r"""One generation engine for every causal language model: shape buckets, a key/value cache
by chunks, the sampler, and programs compiled once per bucket.

A model gives the engine what it needs through an [`AbstractDecoder`][itde.AbstractDecoder]
(its equation, its initial condition, its head); `HFCausalLM.generate`,
`HFCausalLM.generate_batch` and `itde sample` (`itde.train.sample`) all draw through
[`generate_rows`][itde.generate_rows].

**Buckets.** A session brings a new prompt length with almost every call. The engine
never compiles per length: the window (the prompt, the new tokens, filler after them) is
padded to a bucket, a power of two from 256 (capped at the model's positions), and the
batch of prompts to a power of two. The padding is exact: the model is causal (Volterra
attention), so no token reads the filler after it, and the window's length does not move
the earlier tokens' nodes or weights on the unit grid (midpoint, unit weights; decided
structurally by [`AbstractQuadrature.is_unit`][itde.AbstractQuadrature.is_unit]). On any
other token rule the window's length is part of the discretisation, and the engine uses
the length asked for, unpadded. A workload of any prompt lengths up to the model's
context compiles at most two programs per bucket (a prefill and a decode loop; a third,
the uncached draw, for models the cache refuses), $O(\log \text{context})$ in all, for
each model structure, dtype, batch bucket and sampler (greedy or sampled).

**The cache by chunks.** The prompt is solved in chunks of `PREFILL_ROWS` rows, each
attending to the cache of the ones before it ([`itde.decode`][itde.decode] with several
rows): the prefill's work is the prompt's length rounded up to a chunk, not the bucket's.
A `jax.lax.while_loop` runs as many chunks as the prompt needs, so one program serves
every prompt length of a bucket.

**Programs.** Every program runs through the library's bounded
[`ProgramCache`][itde.ProgramCache] (`itde.programs`), which frees an evicted program's
executable; the per-layer split of a model's controls ([`itde.split_layers`][itde.split_layers],
a copy of its weights) is kept with the model object and freed with it.
"""

from __future__ import annotations

import abc
import threading
import weakref
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._buckets import PowerOfTwoBuckets
from ._equation import TransformerIDE
from ._kv_cache import (
    NotCacheableError,
    _decode,
    _on_host,
    check_cacheable,
    prefill,
    prefill_by_chunks,
    split_layers,
)
from ._programs import programs
from ._quadrature._rules import AbstractQuadrature
from ._next_token import draw_token

#: The smallest window bucket (tokens); buckets are the powers of two from it.
MIN_BUCKET = 512
#: Rows of the prompt solved at once by the prefill (a chunk).
PREFILL_ROWS = 64


class AbstractDecoder(eqx.Module):
    """A causal language model as the generation engine reads it: a subclass wraps one
    kind of model (a Hugging Face causal LM, a trained `TokenModel`) and says how its
    tokens become the equation's initial condition and its final states become logits.

    - `equation`: the causal [`TransformerIDE`][itde.TransformerIDE].
    - `initial(window)`: the initial states `[n, features]` of a window of `n` token ids
      (positions 0..n-1).
    - `states(window)`: the final states $u(T)$ `[n, features]` of the whole window
      solved at once (the draw without a cache).
    - `logits(u)`: the logits `[rows, vocab]` of final states `[rows, features]` (the
      output map and the head), in the dtype the sampler draws in.
    - `solver`, `dt0`: how the cache solves the equation (None, None: the discrete
      network, one Lie step per layer).
    - `max_tokens`: the longest window the model takes (None: no limit).
    """

    @property
    @abc.abstractmethod
    def equation(self) -> TransformerIDE: ...

    @abc.abstractmethod
    def initial(self, window): ...

    @abc.abstractmethod
    def states(self, window): ...

    @abc.abstractmethod
    def logits(self, u): ...

    @property
    def solver(self):
        return None

    @property
    def dt0(self):
        return None

    @property
    @abc.abstractmethod
    def max_tokens(self) -> int | None: ...

    @property
    def model(self):
        """The model object the decoder wraps (the split layers are kept with it)."""
        return self


# ------------------------------------------------------------------ buckets
#: The window buckets: `MIN_BUCKET` and its doublings (the buckets of an eager solve's
#: tokens too, from another smallest one).
WINDOWS = PowerOfTwoBuckets(MIN_BUCKET)
#: The batch buckets: the powers of two.
ROWS = PowerOfTwoBuckets(1)


def bucket(n: int, limit: int | None = None) -> int:
    """The window bucket of `n` tokens ([`PowerOfTwoBuckets`][itde.PowerOfTwoBuckets] from
    `MIN_BUCKET`), at most `limit` (then `limit` itself, which holds `n`)."""
    b = WINDOWS.size(n)
    return b if limit is None or b <= limit else int(limit)


def row_bucket(rows: int) -> int:
    """The batch bucket of `rows` prompts: the smallest power of two >= `rows`."""
    return ROWS.size(rows)


def paddable(eq: TransformerIDE, *lengths: int) -> bool:
    """Whether a window may be padded to another length exactly: the token rule is the
    unit grid at every one of `lengths` (its nodes and weights do not move with $N$)."""
    tokens = eq.grid.tokens
    return isinstance(tokens, AbstractQuadrature) and all(tokens.is_unit(n) for n in lengths)


def window_length(dec: AbstractDecoder, need: int, limit: int | None, exact: int) -> int:
    """The window a generation runs in: the bucket of `need` tokens (capped at `limit`)
    where padding is exact, else `exact` (the length whose discretisation the model
    reads: the window asked for, or a `TokenModel`'s context)."""
    length = bucket(need, limit)
    return length if paddable(dec.equation, need, length, exact) else exact


def check_cache(cache) -> bool | None:
    """The `cache` argument of the generation entry points, checked: None (with the cache
    when the model is cacheable), True or False (a Python or NumPy bool; 0 and 1 are
    refused: `0 in (None, True, False)` holds, and 0 would have meant None)."""
    if cache is None or isinstance(cache, (bool, np.bool_)):
        return None if cache is None else bool(cache)
    raise ValueError(
        f"`cache`={cache!r} must be None (the cache when the model is cacheable), True (the "
        "cache, or an error saying why not) or False (no cache)."
    )


def cacheable(dec: AbstractDecoder, length: int) -> bool:
    """Whether the cache draws from `dec` exactly in a window of `length` tokens."""
    try:
        check_cacheable(dec.equation, length, solver=dec.solver, dt0=dec.dt0)
    except NotCacheableError:
        return False
    return True


# ------------------------------------------------------------------ the split layers
_layers: dict[int, tuple] = {}
_layers_lock = threading.Lock()


def layers_of(dec: AbstractDecoder):
    """[`split_layers`][itde.split_layers] of the decoder's equation, computed once per
    model object and freed with it (a copy of the per-layer weights)."""
    model = dec.model
    key = id(model)
    with _layers_lock:
        held = _layers.get(key)
        if held is not None and held[0]() is model:
            return held[1]
    eq = dec.equation
    if all(_on_host(a) for a in jax.tree.leaves(eqx.filter(eq, eqx.is_array))):
        layers = split_layers(eq)  # copied on the host: no program (see split_layers)
    else:
        layers = programs(split_layers, eq)  # one program, not an eager slice a leaf
    with _layers_lock:
        _layers[key] = (weakref.ref(model), layers)
    weakref.finalize(model, _forget, key)
    return layers


def _forget(key: int) -> None:
    with _layers_lock:
        held = _layers.get(key)
        if held is not None and held[0]() is None:
            del _layers[key]


# ------------------------------------------------------------------ traced pieces
def _draw(logits, key, sampling, greedy: bool):
    if greedy:
        return jnp.argmax(logits).astype(jnp.int32)
    temperature, top_k, floor = sampling
    return draw_token(logits, key, temperature, top_k, floor)


def _push(window, filled, tok):
    """`window` with `tok` after its `filled` tokens; a full window slides (drops its
    oldest)."""
    n = window.shape[0]
    slid = jnp.roll(window, -1).at[-1].set(tok)
    grown = window.at[jnp.minimum(filled, n - 1)].set(tok)
    return jnp.where(filled >= n, slid, grown)


def _padded_states(dec, window, total: int):
    """The window's initial states, `total` rows: after the window's own, copies of its
    last (finite states that no earlier token reads; zeros could divide by a zero
    variance in an exact norm)."""
    u0 = dec.initial(window)
    extra = total - u0.shape[0]
    return jnp.pad(u0, ((0, extra), (0, 0)), mode="edge") if extra else u0


def _prefill_one(dec, layers, window, filled, rows: int):
    """The prompt (the first `filled` tokens of `window`) solved in chunks of `rows`
    rows against the cache ([`prefill_by_chunks`][itde.prefill_by_chunks]): the cache
    (`filled` long) and the logits of the last prompt token."""
    u0 = _padded_states(dec, window, -(-window.shape[0] // rows) * rows)
    u, cache = prefill_by_chunks(dec.equation, layers, u0, filled, rows=rows,
                                 solver=dec.solver, dt0=dec.dt0)  # fmt: skip
    return cache, dec.logits(jax.lax.dynamic_slice_in_dim(u, filled - 1, 1))[0]


def _decode_one(dec, layers, window, filled, cache, logits, key, sampling, start, n,
                chunk: int, greedy: bool, slide: bool):  # fmt: skip
    """Draw `n <= chunk` tokens from the `logits` of the last filled position, each new
    token's trajectory solved against the cache. With `slide`, a full window slides by
    one (drops its oldest token) and is solved again in one prefill (every position
    moves); otherwise the window never fills (the caller sized it)."""
    eq = dec.equation
    length = window.shape[0]
    rows = cache.max_length

    def grow(window, filled, cache):
        u = jax.lax.dynamic_slice_in_dim(dec.initial(window), filled - 1, 1)
        h, cache = _decode(eq, layers, u, cache, solver=dec.solver, dt0=dec.dt0)
        return cache, dec.logits(h)[0].astype(logits.dtype)

    def full(window, filled, cache):
        u0 = _padded_states(dec, window, rows)
        u, cache = prefill(eq, layers, u0, length, solver=dec.solver, dt0=dec.dt0)
        return cache, dec.logits(u[length - 1 : length])[0].astype(logits.dtype)

    def body(j, carry):
        window, filled, cache, logits, out = carry
        tok = _draw(logits, jax.random.fold_in(key, start + j), sampling, greedy)
        if slide:
            was_full = filled >= length
            window = _push(window, filled, tok)
            filled = jnp.minimum(filled + 1, length)
            cache, logits = jax.lax.cond(was_full, full, grow, window, filled, cache)
        else:
            window = window.at[filled].set(tok)
            filled = filled + 1
            cache, logits = grow(window, filled, cache)
        return window, filled, cache, logits, out.at[j].set(tok)

    out = jnp.zeros((chunk,), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (window, filled, cache, logits, out))


def _uncached_one(dec, window, filled, key, sampling, start, n, chunk: int, greedy: bool,
                  slide: bool):  # fmt: skip
    """Draw `n <= chunk` tokens after the `filled` tokens of `window`, the whole window
    solved for each (the filler after position `filled - 1` does not reach it: causal).
    With `slide`, a full window slides by one."""
    length = window.shape[0]

    def body(j, carry):
        window, filled, out = carry
        u = dec.states(window)
        logits = dec.logits(jax.lax.dynamic_slice_in_dim(u, filled - 1, 1))[0]
        tok = _draw(logits, jax.random.fold_in(key, start + j), sampling, greedy)
        if slide:
            window, filled = _push(window, filled, tok), jnp.minimum(filled + 1, length)
        else:
            window, filled = window.at[filled].set(tok), filled + 1
        return window, filled, out.at[j].set(tok)

    out = jnp.zeros((chunk,), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (window, filled, out))


# the programs: each maps its piece over the rows of a batch (one row: no map, whose
# batched cache updates cost a decode step about a fifth more)
def _rows(one, batched_args, *args):
    if batched_args[0].shape[0] == 1:
        out = one(*jax.tree.map(lambda x: x[0], batched_args), *args)
        return jax.tree.map(lambda x: x[None], out)
    return jax.vmap(lambda *b: one(*b, *args))(*batched_args)


def _prefill_program(dec, layers, window, filled, rows: int):
    def one(window, filled):
        return _prefill_one(dec, layers, window, filled, rows)

    return _rows(one, (window, filled))


def _decode_program(dec, layers, window, filled, cache, logits, keys, sampling, start, n,
                    chunk: int, greedy: bool, slide: bool):  # fmt: skip
    def one(window, filled, cache, logits, key):
        return _decode_one(dec, layers, window, filled, cache, logits, key, sampling, start, n,
                           chunk, greedy, slide)  # fmt: skip

    return _rows(one, (window, filled, cache, logits, keys))


def _uncached_program(dec, window, filled, keys, sampling, start, n, chunk: int, greedy: bool,
                      slide: bool):  # fmt: skip
    def one(window, filled, key):
        return _uncached_one(dec, window, filled, key, sampling, start, n, chunk, greedy, slide)

    return _rows(one, (window, filled, keys))


# ------------------------------------------------------------------ the host loop
def _row_keys(key, rows, fold: bool):
    """One key per row: `fold_in(key, b)` for row `b` (a batch), or `key` itself."""
    if fold:
        return jax.vmap(lambda b: jax.random.fold_in(key, b))(rows)
    return jax.vmap(lambda b: key)(rows)


def _windows(prompts: list[np.ndarray], length: int):
    """The prompts as windows `[row bucket, length]` (padded rows repeat the first
    prompt; their tokens are dropped) and their lengths `[row bucket]`."""
    real = len(prompts)
    n_rows = row_bucket(real)
    window = np.zeros((n_rows, length), np.int32)
    filled = np.zeros((n_rows,), np.int32)
    for b in range(n_rows):
        row = prompts[b] if b < real else prompts[0]
        window[b, : len(row)] = row
        filled[b] = len(row)
    return jnp.asarray(window), jnp.asarray(filled)


def _prefill_rows(dec, window, filled):
    layers = layers_of(dec)
    rows = min(PREFILL_ROWS, window.shape[1])
    return layers, programs(_prefill_program, dec, layers, window, filled, rows)


def prefill_logits(dec: AbstractDecoder, prompts: list[np.ndarray], *, length: int) -> np.ndarray:
    """The logits of the token after each prompt, `[prompts, vocab]` (NumPy), from the
    engine's prefill in a window of `length` tokens (the cache must be exact there)."""
    window, filled = _windows(prompts, length)
    _, (_, logits) = _prefill_rows(dec, window, filled)
    return np.asarray(logits)[: len(prompts)]


def generate_rows(
    dec: AbstractDecoder,
    prompts: list[np.ndarray],
    n_new: int,
    *,
    length: int,
    key=None,
    fold: bool = False,
    sampling=None,
    eos_token_id: int | None = None,
    chunk: int = 16,
    cache: bool = True,
    slide: bool = False,
) -> Iterator[np.ndarray]:
    """Draw `n_new` tokens after each of `prompts` (checked `[prompt]` int32 arrays, each
    at most `length` long), yielding pieces `[prompts, <= chunk]` (NumPy) as they are
    drawn.

    **Arguments:**

    - `length`: the window (from `window_length`: a
      bucket, or the exact length on a non-unit token rule). Without `slide` it must hold
      every prompt and its new tokens.
    - `key`: a JAX key, with `sampling` = (temperature, top_k, floor) traced arrays;
      token $i$ of row $b$ uses `fold_in(key_b, i)`, where `key_b` is
      `fold_in(key, b)` with `fold` (a batch) and `key` itself without. None: greedy.
    - `eos_token_id`: a row that draws it ends there (the piece still holds the row's
      later tokens, which the caller drops); the loop stops when every row has ended.
    - `chunk`: tokens drawn per call of the compiled loop.
    - `cache`: draw with the key/value cache (the caller checked it is exact).
    - `slide`: when the window is full, slide it by one token (`itde sample` beyond the
      model's context).
    """
    if n_new == 0:
        return
    real = len(prompts)
    window, filled = _windows(prompts, length)
    greedy = key is None
    rows = jnp.arange(window.shape[0])
    keys = programs(_row_keys, jax.random.key(0) if greedy else key, rows, fold)
    if greedy:
        sampling = None
    chunk = max(1, min(chunk, n_new))
    first = (jnp.asarray(0, jnp.int32), jnp.asarray(min(chunk, n_new), jnp.int32), chunk,
             greedy, slide)  # fmt: skip
    if cache:
        layers = layers_of(dec)
        rows = min(PREFILL_ROWS, length)
        if not programs.holds(_prefill_program, dec, layers, window, filled, rows):
            # a new bucket: the decode loop (from the shapes of the prefill's results),
            # traced here first, compiles in the background while the prefill is traced,
            # compiles and runs here (the decode loop's compile is the longer)
            kv, logits = eqx.filter_eval_shape(_prefill_program, dec, layers, window, filled,
                                               rows)  # fmt: skip
            programs.prepare(_decode_program, dec, layers, window, filled, kv, logits, keys,
                             sampling, *first, trace_here=True)  # fmt: skip
        layers, (kv, logits) = _prefill_rows(dec, window, filled)
    ended = np.zeros((real,), bool)
    done = 0
    while done < n_new and not ended.all():
        n = min(chunk, n_new - done)
        steps = (jnp.asarray(done, jnp.int32), jnp.asarray(n, jnp.int32), chunk, greedy, slide)
        if cache:
            window, filled, kv, logits, out = programs(
                _decode_program, dec, layers, window, filled, kv, logits, keys, sampling,
                *steps,
            )  # fmt: skip
        else:
            window, filled, out = programs(
                _uncached_program, dec, window, filled, keys, sampling, *steps
            )
        piece = np.asarray(out)[:real, :n]  # sliced in NumPy: no program per shape
        if eos_token_id is not None:
            ended |= (piece == eos_token_id).any(axis=1)
        done += n
        yield piece


__all__ = [
    "MIN_BUCKET",
    "PREFILL_ROWS",
    "AbstractDecoder",
    "bucket",
    "cacheable",
    "check_cache",
    "generate_rows",
    "layers_of",
    "paddable",
    "prefill_logits",
    "row_bucket",
    "window_length",
]
