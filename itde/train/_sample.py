"""Autoregressive sampling from a trained causal language model (tasks `charlm`, `textlm`).

The draws run on the library's one generation engine (a
[`TokenDecoder`][itde.train.TokenDecoder], an [`AbstractDecoder`][itde.AbstractDecoder];
`HFCausalLM.generate` runs on it too): a window bucket compiled once (the prompt and the
new tokens within the context; a full context slides), and each call of the compiled
program draws a chunk of up to `chunk` tokens in a `jax.lax.fori_loop` (one dispatch per
chunk, not per token), and [`sample_stream`][itde.train.sample_stream] hands each chunk's
text over as soon as it is drawn, so a long generation shows progress and an interrupt
keeps what was shown. The temperature, top-k and top-p of Hugging Face's `generate` are
traced values of that program ([`warp_logits`][itde.train.warp_logits]); the text is
decoded incrementally ([`IncrementalDecoder`][itde.train.IncrementalDecoder]), so a
byte-level tokenizer's character drawn over two chunks is never shown in halves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from .._config import SEED_MAX
from .._generate import AbstractDecoder, check_cache, generate_rows, window_length
from .._generate import cacheable as engine_cacheable
from .._kv_cache import check_cacheable
from .._registry import scheme as scheme_named
from .._next_token import IncrementalDecoder, _scalar, check_filters, check_filters_sample
from ._model import TokenModel, integrate

#: how the sampler's errors name its filters (the flags of `itde sample`)
FILTER_NAMES = ("--top-k", "--top-p")


class TokenDecoder(AbstractDecoder):
    """A trained causal [`TokenModel`][itde.train.TokenModel] as the generation engine
    reads it ([`AbstractDecoder`][itde.AbstractDecoder]): its initial condition, its depth
    scheme and step, its head; logits in float32 (the sampler's dtype for every model).

    `token_model`: the model."""

    token_model: TokenModel

    @property
    def equation(self):
        return self.token_model.equation

    @property
    def model(self):
        return self.token_model

    @property
    def max_tokens(self):
        return self.token_model.max_tokens

    @property
    def solver(self):
        return scheme_named(self.token_model.scheme).make()

    @property
    def dt0(self):
        return self.token_model.dt

    def initial(self, window):
        return self.token_model.initial_state(window)

    def states(self, window):
        m = self.token_model
        return integrate(m.equation, m.initial_state(window), m.scheme, m.dt)

    def logits(self, u):
        return self.token_model.head(u).astype(jnp.float32)


def cacheable(model, context: int) -> bool:
    """Whether `itde sample` can draw from `model` with a key/value cache
    ([`itde.check_cacheable`][itde.check_cacheable] with the model's depth scheme and
    step) in a window of `context` tokens; otherwise it solves the whole window for
    every token."""
    return engine_cacheable(TokenDecoder(model), context)


def _check(model, itos, prompt, length, temperature, seed, encode=None, *, top_k=None,
           top_p=1.0) -> tuple[int, float]:  # fmt: skip
    """Check the arguments of a sample; returns the traced filters `(k, floor)`."""
    if not model.equation.causal:
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
    check_filters_sample(temperature, top_k, top_p, (*FILTER_NAMES, "--temperature"))
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
    cache = check_cache(cache)
    top_k, floor = _check(model, itos, prompt, length, temperature, seed, encode,
                          top_k=top_k, top_p=top_p)  # fmt: skip
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"`chunk`={chunk!r} must be a positive integer.")
    ids = _prompt_ids(itos, prompt, encode, decode)
    context = _context(model, context)
    tail = np.asarray(ids[-context:], np.int32)
    dec = TokenDecoder(model)
    # within the context: a window bucket (exact, causal), else the context, sliding
    slide = len(tail) + length > context
    window = context if slide else window_length(dec, len(tail) + length, context, context)
    if cache is True:
        check_cacheable(model.equation, window, solver=dec.solver, dt0=dec.dt0)
    elif cache is None:
        cache = engine_cacheable(dec, window)
    key, sampling = None, None  # temperature 0: the greedy program
    if temperature != 0:
        key = jax.random.key(seed)
        sampling = (_scalar(temperature), jnp.asarray(top_k, jnp.int32), _scalar(floor))
    text = IncrementalDecoder(decode or (lambda ids: "".join(itos[i] for i in ids)), ids)
    pieces = generate_rows(
        dec, [tail], length, length=window, key=key, sampling=sampling,
        chunk=chunk, cache=cache, slide=slide,
    )  # fmt: skip
    done = 0
    for piece in pieces:
        done += piece.shape[1]
        out = text.push(piece[0])
        yield out + text.flush() if done >= length else out


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
