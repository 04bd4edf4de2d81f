"""Autoregressive sampling from a trained causal character model (task `charlm`).

The generation loop is compiled once: each call of the compiled program draws a chunk of
up to `chunk` characters in a `jax.lax.fori_loop` (one dispatch per chunk, not per
character), and [`sample_stream`][itde.train.sample_stream] hands each chunk over as soon
as it is drawn, so a long generation shows progress and an interrupt keeps what was shown.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._config import SEED_MAX


@eqx.filter_jit
def _draw(model, window, filled, key, temperature, start, n, chunk: int):
    """Draw `n <= chunk` tokens after the `filled` tokens of `window` (right-padded to the
    context; when full, the window slides). Token `i` of the whole generation uses the key
    `fold_in(key, i)`, `i = start + j`.

    The model is causal (Volterra attention), so the padding after position `filled - 1`
    does not reach it: one compiled program serves every prefix length."""
    context = window.shape[0]

    def body(j, carry):
        window, filled, out = carry
        logits = model(window)[filled - 1].astype(jnp.float32)
        greedy = jnp.argmax(logits).astype(jnp.int32)
        k = jax.random.fold_in(key, start + j)
        drawn = jax.random.categorical(k, logits / jnp.maximum(temperature, 1e-6))
        tok = jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)
        slid = jnp.roll(window, -1).at[-1].set(tok)
        grown = window.at[jnp.minimum(filled, context - 1)].set(tok)
        window = jnp.where(filled >= context, slid, grown)
        return window, jnp.minimum(filled + 1, context), out.at[j].set(tok)

    out = jnp.zeros((chunk,), jnp.int32)
    return jax.lax.fori_loop(0, n, body, (window, filled, out))


def _check(model, itos, prompt, length, temperature, seed, encode=None) -> dict[str, int]:
    if not model.ide.causal:
        raise ValueError("sampling needs a causal model (trained on task 'charlm').")
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"`--length`={length!r} must be a non-negative integer.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(
            f"`--temperature`={temperature!r} must be a finite number >= 0 (0 = greedy, 1 = "
            "the model's own distribution)."
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= SEED_MAX:
        raise ValueError(f"`--seed`={seed!r} must be an integer in [0, {SEED_MAX}].")
    stoi = {c: i for i, c in enumerate(itos)}
    singles = stoi.keys() if encode is None else {t for t in itos if len(t) == 1}
    missing = sorted(set(prompt) - singles)
    if missing:
        raise ValueError(
            f"the prompt has characters outside the model's vocabulary: {''.join(missing)!r}"
        )
    return stoi


def sample_stream(
    model, itos, prompt: str, length: int, *, temperature: float = 1.0, seed: int = 0,
    chunk: int = 256, encode=None, context: int | None = None,
) -> Iterator[str]:  # fmt: skip
    """The `length` tokens drawn after `prompt`, yielded as text in pieces of at most
    `chunk` tokens as they are generated (the prompt itself is not yielded).

    Arguments as in [`sample`][itde.train.sample]; `chunk` is the number of tokens drawn by
    one call of the compiled generation loop; `encode`: text -> token ids, for a vocabulary
    of tokens longer than one character (e.g. `TextLM.encode` of a BPE task; default: one
    token per character of `itos`); `context`: the window the model reads (default: its
    position table's length, `model.max_tokens`)."""
    stoi = _check(model, itos, prompt, length, temperature, seed, encode)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"`chunk`={chunk!r} must be a positive integer.")
    start = prompt or ("\n" if "\n" in stoi else itos[0])
    ids = [stoi[c] for c in start] if encode is None else list(encode(start))
    context = _context(model, context)
    tail = ids[-context:]
    window = np.zeros((context,), np.int32)
    window[: len(tail)] = tail
    window, filled = jnp.asarray(window), jnp.asarray(len(tail), jnp.int32)
    key = jax.random.key(seed)
    temp = jnp.asarray(temperature, jnp.float32)
    chunk = min(chunk, max(length, 1))
    done = 0
    while done < length:
        n = min(chunk, length - done)
        window, filled, out = _draw(
            model, window, filled, key, temp, jnp.asarray(done, jnp.int32),
            jnp.asarray(n, jnp.int32), chunk,
        )  # fmt: skip
        yield "".join(itos[i] for i in np.asarray(out[:n]).tolist())
        done += n


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
    encode=None, context: int | None = None,
):  # fmt: skip
    """`prompt` followed by `length` characters drawn from the model.

    **Arguments:**

    - `model`: a causal [`TokenModel`][itde.train.TokenModel].
    - `itos`: the vocabulary (token id -> character).
    - `prompt`: the text to continue; characters outside the vocabulary raise
      `ValueError`. Empty: start from a newline (or the first character of the vocabulary),
      which is not returned.
    - `length`: number of characters to generate, >= 0.
    - `temperature`: softmax temperature; 0 = greedy.
    - `seed`: the sampling seed, an integer in $[0, 2^{32} - 1]$.
    - `encode`: text -> token ids where tokens are longer than one character (a BPE
      vocabulary: `TextLM.encode`); `length` then counts tokens.
    - `context`: the window the model reads (default: `model.max_tokens`).

    **Returns:** the text, `prompt + generated`.
    """
    stream = sample_stream(model, itos, prompt, length, temperature=temperature, seed=seed,
                           encode=encode, context=context)  # fmt: skip
    return prompt + "".join(stream)
