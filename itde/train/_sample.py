"""Autoregressive sampling from a trained causal language model (tasks `charlm`, `textlm`).

The generation loop is compiled once: each call of the compiled program draws a chunk of
up to `chunk` tokens in a `jax.lax.fori_loop` (one dispatch per chunk, not per token),
and [`sample_stream`][itde.train.sample_stream] hands each chunk's text over as soon as it
is drawn, so a long generation shows progress and an interrupt keeps what was shown. The
temperature, top-k and top-p of Hugging Face's `generate` are traced values of that
program ([`warp_logits`][itde.train.warp_logits]); the text is decoded incrementally
([`IncrementalDecoder`][itde.train.IncrementalDecoder]), so a byte-level tokenizer's
character drawn over two chunks is never shown in halves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._config import SEED_MAX
from .._kv_cache import NotCacheableError, check_cacheable, decode, prefill, split_layers
from .._registry import SCHEMES
from .._sampling import IncrementalDecoder, _scalar, check_filters, draw_token

#: how the sampler's errors name its filters (the flags of `itde sample`)
FILTER_NAMES = ("--top-k", "--top-p")


@eqx.filter_jit
def _draw(model, window, filled, key, temperature, top_k, floor, start, n, chunk: int):
    return _draw_traced(model, window, filled, key, temperature, top_k, floor, start, n, chunk)


def _push(window, filled, tok):
    """`window` with `tok` after its `filled` tokens; a full window slides (drops its oldest)."""
    context = window.shape[0]
    slid = jnp.roll(window, -1).at[-1].set(tok)
    grown = window.at[jnp.minimum(filled, context - 1)].set(tok)
    return jnp.where(filled >= context, slid, grown)


@eqx.debug.assert_max_traces(max_traces=None)  # counts compilations (`eqx.debug.get_num_traces`)
def _draw_traced(model, window, filled, key, temperature, top_k, floor, start, n, chunk):
    """Draw `n <= chunk` tokens after the `filled` tokens of `window` (right-padded to the
    context; when full, the window slides). Token `i` of the whole generation uses the key
    `fold_in(key, i)`, `i = start + j`; `top_k`, `floor`: the filters of
    `itde._sampling.check_filters`.

    The model is causal (Volterra attention), so the padding after position `filled - 1`
    does not reach it: one compiled program serves every prefix length."""
    context = window.shape[0]

    def body(j, carry):
        window, filled, out = carry
        logits = model(window)[filled - 1].astype(jnp.float32)
        k = jax.random.fold_in(key, start + j)
        tok = draw_token(logits, k, temperature, top_k, floor)
        return _push(window, filled, tok), jnp.minimum(filled + 1, context), out.at[j].set(tok)

    out = jnp.zeros((chunk,), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (window, filled, out))


@eqx.filter_jit
def _prefill(model, layers, window, filled):
    return _prefill_traced(model, layers, window, filled)


def _scheme(model) -> dict:
    """The model's depth scheme as the cache takes it."""
    return dict(solver=SCHEMES[model.scheme].make(), dt0=model.dt)


@eqx.debug.assert_max_traces(max_traces=None)
def _prefill_traced(model, layers, window, filled):
    """The window solved once: the cache, and the logits of position `filled - 1`."""
    u, cache = prefill(model.ide, layers, model.initial_state(window), filled, **_scheme(model))
    row = jax.lax.dynamic_slice_in_dim(u, filled - 1, 1)
    return cache, model.head(row)[0].astype(jnp.float32)


@eqx.filter_jit
def _draw_cached(model, layers, window, filled, cache, logits, key, temperature, top_k, floor,
                 start, n, chunk: int):  # fmt: skip
    return _draw_cached_traced(model, layers, window, filled, cache, logits, key, temperature,
                               top_k, floor, start, n, chunk)  # fmt: skip


@eqx.debug.assert_max_traces(max_traces=None)
def _draw_cached_traced(model, layers, window, filled, cache, logits, key, temperature, top_k,
                        floor, start, n, chunk):  # fmt: skip
    """`_draw_traced` with a key/value cache: while the window grows, each new token runs
    its own trajectory against the cache (`itde.decode`); once it is full and slides,
    every position moves, so the slid window is solved again in one prefill."""
    context = window.shape[0]
    eq = model.ide

    def grow(window, filled, cache):
        u = jax.lax.dynamic_slice_in_dim(model.initial_state(window), filled - 1, 1)
        h, cache = decode(eq, layers, u, cache, **_scheme(model))
        return cache, model.head(h)[0].astype(jnp.float32)

    def slide(window, filled, cache):
        u, cache = prefill(eq, layers, model.initial_state(window), context, **_scheme(model))
        return cache, model.head(u[-1:])[0].astype(jnp.float32)

    def body(j, carry):
        window, filled, cache, logits, out = carry
        tok = draw_token(logits, jax.random.fold_in(key, start + j), temperature, top_k, floor)
        full = filled >= context
        window = _push(window, filled, tok)
        filled = jnp.minimum(filled + 1, context)
        cache, logits = jax.lax.cond(full, slide, grow, window, filled, cache)
        return window, filled, cache, logits, out.at[j].set(tok)

    out = jnp.zeros((chunk,), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (window, filled, cache, logits, out))


def cacheable(model, context: int) -> bool:
    """Whether `itde sample` can draw from `model` with a key/value cache
    ([`itde.check_cacheable`][itde.check_cacheable] with the model's depth scheme and
    step); otherwise it solves the whole window for every token."""
    try:
        check_cacheable(model.ide, context, **_scheme(model))
    except NotCacheableError:
        return False
    return True


def _check(model, itos, prompt, length, temperature, seed, encode=None, *, top_k=None,
           top_p=1.0) -> tuple[int, float]:  # fmt: skip
    """Check the arguments of a sample; returns the traced filters `(k, floor)`."""
    if not model.ide.causal:
        raise ValueError("sampling needs a causal model (trained on task 'charlm' or 'textlm').")
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"`--length`={length!r} must be a non-negative integer.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"`--temperature`={temperature!r} must be a finite number >= 0 (0 = greedy, 1 = "
            "the model's own distribution)."
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"`--seed`={seed!r} must be an integer in [0, {SEED_MAX}].")
    return check_filters(top_k, top_p, FILTER_NAMES)


def _prompt_ids(itos, prompt, encode, decode) -> list[int]:
    """The token ids the model reads first: the prompt's, or (empty prompt) a newline's
    (or the first token's), checked to be text the vocabulary holds."""
    if encode is None:
        stoi = {c: i for i, c in enumerate(itos)}
        missing = sorted(set(prompt) - stoi.keys())
        if missing:
            raise ValueError(
                f"the prompt has characters outside the model's vocabulary: {''.join(missing)!r}"
            )
        start = prompt or ("\n" if "\n" in stoi else itos[0])
        return [stoi[c] for c in start]
    if not prompt:
        try:
            return list(encode("\n")) or [0]
        except ValueError:  # a vocabulary without a newline
            return [0]
    try:
        ids = [int(i) for i in encode(prompt)]
    except ValueError:  # a BPE of characters: every character it knows is a token
        singles = {t for t in itos if len(t) == 1}
        missing = "".join(sorted(set(prompt) - singles))
        raise ValueError(
            f"the prompt has characters outside the model's vocabulary: {missing!r}"
        ) from None
    if decode is not None and decode(ids) != prompt:
        back = decode(ids)
        missing = sorted(set(prompt) - set(back))
        raise ValueError(
            "the prompt has characters outside the model's vocabulary: "
            f"{''.join(missing) or prompt!r} (its tokens decode to {back!r})"
        )
    if not ids:
        raise ValueError(f"the prompt {prompt!r} encodes to no tokens; give some text.")
    return ids


def sample_stream(
    model, itos, prompt: str, length: int, *, temperature: float = 1.0, seed: int = 0,
    chunk: int = 256, encode=None, context: int | None = None, decode=None,
    top_k: int | None = None, top_p: float = 1.0, cache: bool | None = None,
) -> Iterator[str]:  # fmt: skip
    """The text of the `length` tokens drawn after `prompt`, yielded in pieces of at most
    `chunk` tokens as they are generated (the prompt itself is not yielded). The pieces
    join into the text of all the drawn tokens; a character whose bytes span two chunks
    (a byte-level tokenizer) comes whole with the later one, so a piece may be empty.

    Arguments as in [`sample`][itde.train.sample]; `chunk` is the number of tokens drawn by
    one call of the compiled generation loop; `encode`: text -> token ids, for a vocabulary
    of tokens longer than one character (e.g. `TextLM.encode` of a BPE task; default: one
    token per character of `itos`); `decode`: token ids -> text (the tokenizer's own, e.g.
    `TextLM.tokenizer.decode`; default: the tokens of `itos` joined); `context`: the window
    the model reads (default: its position table's length, `model.max_tokens`); `cache`:
    draw with a key/value cache (None: when the model is cacheable, see
    [`itde.check_cacheable`][itde.check_cacheable]; True/False: with or without; the same
    tokens either way, to round-off)."""
    if cache is True:
        check_cacheable(model.ide, _context(model, context), **_scheme(model))
    top_k, floor = _check(model, itos, prompt, length, temperature, seed, encode,
                          top_k=top_k, top_p=top_p)  # fmt: skip
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"`chunk`={chunk!r} must be a positive integer.")
    ids = _prompt_ids(itos, prompt, encode, decode)
    context = _context(model, context)
    tail = ids[-context:]
    window = np.zeros((context,), np.int32)
    window[: len(tail)] = tail
    window, filled = jnp.asarray(window), jnp.asarray(len(tail), jnp.int32)
    key = jax.random.key(seed)
    temp, k, floor = _scalar(temperature), jnp.asarray(top_k, jnp.int32), _scalar(floor)
    text = IncrementalDecoder(decode or (lambda ids: "".join(itos[i] for i in ids)), ids)
    chunk = min(chunk, max(length, 1))
    if cache is None:
        cache = cacheable(model, context)
    done = 0
    if cache:
        layers = split_layers(model.ide)
        kv, logits = _prefill(model, layers, window, filled)
        while done < length:
            n = min(chunk, length - done)
            window, filled, kv, logits, out = _draw_cached(
                model, layers, window, filled, kv, logits, key, temp, k, floor,
                jnp.asarray(done, jnp.int32), jnp.asarray(n, jnp.int32), chunk,
            )  # fmt: skip
            done += n
            piece = text.push(np.asarray(out[:n]))
            yield piece + text.flush() if done >= length else piece
        return
    while done < length:
        n = min(chunk, length - done)
        window, filled, out = _draw(
            model, window, filled, key, temp, k, floor, jnp.asarray(done, jnp.int32),
            jnp.asarray(n, jnp.int32), chunk,
        )  # fmt: skip
        done += n
        piece = text.push(np.asarray(out[:n]))
        yield piece + text.flush() if done >= length else piece


def _context(model, context):
    most = model.max_tokens
    if context is None:
        if most is None:
            raise ValueError(
                "`context` is needed: this model has no position table to take the window "
                "length from (its positions are inside the equation); pass e.g. the task's "
                "`context`."
            )
        return most
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"`context`={context!r} must be a positive number of tokens.")
    if most is not None and context > most:
        raise ValueError(
            f"`context`={context} is longer than the model's {most} positions; use at most {most}."
        )
    return context


def sample(
    model, itos, prompt: str, length: int, *, temperature: float = 1.0, seed: int = 0,
    encode=None, context: int | None = None, decode=None, top_k: int | None = None,
    top_p: float = 1.0,
):  # fmt: skip
    """`prompt` followed by the text of `length` tokens drawn from the model.

    **Arguments:**

    - `model`: a causal [`TokenModel`][itde.train.TokenModel].
    - `itos`: the vocabulary (token id -> its text).
    - `prompt`: the text to continue; text the vocabulary cannot encode raises
      `ValueError`. Empty: start from a newline (or the first token of the vocabulary),
      which is not returned.
    - `length`: number of tokens to generate (characters for a character vocabulary), >= 0.
    - `temperature`: softmax temperature; 0 = greedy.
    - `seed`: the sampling seed, an integer in $[0, 2^{32} - 1]$.
    - `encode`: text -> token ids where tokens are longer than one character (a BPE
      vocabulary: `TextLM.encode`); `length` then counts tokens.
    - `context`: the window the model reads (default: `model.max_tokens`).
    - `decode`: token ids -> text, the tokenizer's own (`TextLM.tokenizer.decode`; needed
      for a byte-level vocabulary, whose tokens may hold parts of a character); default:
      the tokens of `itos` joined.
    - `top_k`: draw only among the `top_k` most likely tokens (ties with the last one
      included), an integer >= 1; None: every token.
    - `top_p`: draw only among the most likely tokens whose probabilities sum to `top_p`
      (nucleus sampling), in (0, 1]; 1: every token. Temperature, then top-k, then top-p,
      as Hugging Face's `generate` ([`warp_logits`][itde.train.warp_logits]).

    **Returns:** the text, `prompt + generated`.
    """
    stream = sample_stream(model, itos, prompt, length, temperature=temperature, seed=seed,
                           encode=encode, context=context, decode=decode, top_k=top_k,
                           top_p=top_p)  # fmt: skip
    return prompt + "".join(stream)
