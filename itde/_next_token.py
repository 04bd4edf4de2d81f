r"""The next token of a generation, drawn as Hugging Face's `generate(do_sample=True)` draws
it, and the text of the drawn tokens given out without half characters.

**Filters.** The logits $z$ are divided by the temperature $T$, then top-k keeps the tokens
whose score is at least the $k$-th largest (ties with it included), then top-p keeps the
smallest set of most likely tokens whose probability reaches $p$: the scores sorted in
ascending order, the tokens whose cumulative probability $\sum_{j \le i} \pi_j \le 1 - p$
are removed, the most likely one always kept. The others get $-\infty$. This is
`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` of
`transformers.generation.logits_process` with `min_tokens_to_keep=1`, in the order
`generate` applies them; a filter left at its neutral value (`top_k=None`, `top_p=1`) is
not applied, as `generate` leaves it out. Logits in bfloat16 or float16 are processed as
torch processes them: the division, the softmax and the cumulative sum in float32, each
result rounded to the logits' dtype (the running sum itself kept in float32). Ties in the
top-p sort are taken in index order (a stable sort; `torch.sort` leaves their order
unspecified, so where tied scores straddle the cut Hugging Face may remove another of the
equal tokens, never another number of them).

The filters are traced values of the compiled sampling loop (one compilation for every
$T$, $k$ and $p$); the sort runs only when a filter is on.

**Text.** [`IncrementalDecoder`][itde.train.IncrementalDecoder] gives out the text of a
growing sequence of token ids; a byte-level tokenizer's character split over several tokens
is held back until its last byte is drawn.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

_REPLACEMENT = "\ufffd"  # what a UTF-8 decoder shows for an incomplete character


def check_filters(top_k, top_p, names: tuple[str, str] = ("top_k", "top_p")) -> tuple[int, float]:
    """`(k, floor)`: the traced form of `top_k` and `top_p`, after checking them.

    `k` is 0 where `top_k` is None (off); `floor` is $1 - p$ in double precision (cast to
    the logits' dtype in the loop, as `torch` casts it), or -1 where `top_p == 1` (off).
    `names`: how the errors name the two arguments (`--top-k` on the command line)."""
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1
    ):
        raise ValueError(
            f"`{names[0]}`={top_k!r} must be an integer >= 1 (the number of most likely tokens "
            "kept, e.g. 50); leave it out to keep every token."
        )
    if (isinstance(top_p, bool) or not isinstance(top_p, (int, float, np.floating))
            or not (math.isfinite(top_p) and 0 < top_p <= 1)):  # fmt: skip
        raise ValueError(
            f"`{names[1]}`={top_p!r} must be a number in (0, 1] (the probability mass of the "
            "most likely tokens kept, e.g. 0.9); 1 keeps every token."
        )
    k = 0 if top_k is None else int(min(top_k, np.iinfo(np.int32).max))
    floor = -1.0 if top_p == 1 else 1.0 - float(top_p)
    return k, floor


def _opmath(dtype) -> jnp.dtype:
    """The dtype torch computes an elementwise op, a softmax or a cumsum of `dtype` in: float32
    for the half types (bfloat16, float16; `at::opmath_type`, `at::acc_type` on the CPU),
    the dtype itself otherwise."""
    return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else jnp.dtype(dtype)


def _filter(scores: Float[Array, " vocab"], top_k, floor) -> Float[Array, " vocab"]:
    """Top-k then top-p of scores already divided by the temperature (one stable sort)."""
    vocab = scores.shape[-1]
    order = jnp.argsort(scores, stable=True)  # ascending; ties in index order
    ranked = scores[order]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = ranked[vocab - k]  # the k-th largest score
    ranked = jnp.where(ranked < kth, -jnp.inf, ranked)
    # torch's softmax and cumsum of a half type compute in float32 and round each output
    # to the half type (the running sum itself stays in float32)
    wide = _opmath(scores.dtype)
    probs = jax.nn.softmax(ranked.astype(wide)).astype(scores.dtype)
    cumulative = jnp.cumsum(probs.astype(wide)).astype(scores.dtype)
    cut = (cumulative <= floor.astype(scores.dtype)).at[-1].set(False)
    removed = jnp.zeros((vocab,), bool).at[order].set(cut) | (scores < kth)
    return jnp.where(removed, -jnp.inf, scores)


def _warp(logits, temperature, top_k, floor):
    """Traced: the logits `[..., vocab]` divided by `temperature` (> 0) and filtered where
    a filter is on (`top_k > 0` or `floor >= 0`); the sort is skipped otherwise."""
    # a true division, as torch divides: XLA turns `z / broadcast(T)` into
    # `z * broadcast(1 / T)`, which rounds differently in a tenth of the entries, unless the
    # divisor, in the logits' own shape, is behind a barrier. A half type is divided in
    # float32 by float32(T) and rounded once, as torch divides by a Python scalar
    wide = _opmath(logits.dtype)
    divisor = jnp.broadcast_to(temperature.astype(wide), logits.shape)
    scores = (logits.astype(wide) / jax.lax.optimization_barrier(divisor)).astype(logits.dtype)
    rows = _filter
    for _ in range(logits.ndim - 1):
        rows = jax.vmap(rows, in_axes=(0, None, None))
    on = (top_k > 0) | (floor >= 0)
    return jax.lax.cond(on, lambda s: rows(s, top_k, floor), lambda s: s, scores)


def draw_token(logits: Float[Array, " vocab"], key: PRNGKeyArray, temperature, top_k, floor):
    """Traced: the next token, `argmax(logits)` where `temperature == 0`, else a draw from
    `categorical(key, ...)` of the warped logits (`top_k`, `floor` of
    [`check_filters`][itde._next_token.check_filters]). With the filters off a draw is
    `categorical(key, logits / T)`."""
    greedy = jnp.argmax(logits).astype(jnp.int32)
    positive = temperature > 0
    safe = jnp.where(positive, temperature, jnp.ones_like(temperature))
    drawn = jax.random.categorical(key, _warp(logits, safe, top_k, floor)).astype(jnp.int32)
    return jnp.where(positive, drawn, greedy)


_warp_jit = jax.jit(_warp)


def is_real(x) -> bool:
    """`x` is a real number as a user passes one: a Python or NumPy integer or float
    (`np.float32(0.5)` as much as `0.5`), not a bool."""
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(
        x, (bool, np.bool_)
    )


def check_filters_sample(temperature, top_k, top_p, names=("top_k", "top_p", "temperature")):
    """Refuse filters that a greedy draw would ignore: `top_k` or `top_p` (other than 1)
    at temperature 0 (transformers refuses temperature 0 when sampling). `names`: how the
    caller spells the three (the CLI's `--top-k`, ...)."""
    if temperature == 0 and (top_k is not None or top_p != 1):
        k, p, t = names
        raise ValueError(
            f"`{k}`={top_k!r}, `{p}`={top_p!r} at `{t}`=0 would be ignored (temperature 0: "
            "greedy, the most likely token); give a temperature > 0 to sample among the "
            "filtered tokens, or leave the filters out."
        )


def warp_logits(
    logits: Float[Array, "*batch vocab"], *, temperature: float = 1.0, top_k: int | None = None,
    top_p: float = 1.0,
) -> Float[Array, "*batch vocab"]:  # fmt: skip
    r"""The logits a sampler draws from: divided by `temperature`, then top-k, then top-p,
    every removed token at $-\infty$, exactly as Hugging Face's `generate(do_sample=True)`
    processes them (`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, one
    token kept at least). The sampling loops of [`sample`][itde.train.sample] and
    [`HFCausalLM.generate`][itde.interop.HFCausalLM.generate] apply this function.

    **Arguments:**

    - `logits`: `[..., vocab]` scores, filtered along the last axis.
    - `temperature`: $T > 0$; the scores are divided by it as torch divides by a Python
      float: in their own dtype, bfloat16 and float16 in float32 by `float32(T)` and
      rounded once.
    - `top_k`: keep the tokens whose score is at least the $k$-th largest (ties included),
      an integer >= 1; None keeps every token.
    - `top_p`: keep the most likely tokens up to probability mass `top_p` (the first one
      that reaches it included), in (0, 1]; 1 keeps every token. Tied scores across the
      cut are removed in index order (the lower index first).

    **Returns:** the processed logits, same shape and dtype.
    """
    if not (is_real(temperature) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"`temperature`={temperature!r} must be a finite number > 0 (1 = the model's own "
            "distribution)."
        )
    k, floor = check_filters(top_k, top_p)
    logits = jnp.asarray(logits)
    if logits.ndim < 1 or logits.shape[-1] < 1 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"`logits` must be floating scores [..., vocab] with vocab >= 1, got shape "
            f"{logits.shape} and dtype {logits.dtype}."
        )
    return _warp_jit(logits, _scalar(temperature), jnp.asarray(k, jnp.int32), _scalar(floor))


def _scalar(value: float) -> Array:
    """A Python float as an array of the widest enabled float dtype (float64 under x64):
    the loop casts it to the logits' dtype, as `torch` casts a Python scalar."""
    return jnp.asarray(value, jnp.result_type(float))


class IncrementalDecoder:
    """The text of a growing sequence of token ids, given out piece by piece: the pieces,
    joined, are `decode(all ids)`, and a piece never ends in part of a character.

    `decode(ids)` is the tokenizer's text of a sequence of ids. A byte-level tokenizer
    (GPT-2's BPE) shows a character whose bytes are not all drawn yet as the replacement
    character U+FFFD at the end of the text: such a tail is held back until a later push
    completes it (or [`flush`][itde.train.IncrementalDecoder.flush] gives it out as it
    is). Each push decodes a window that starts one earlier push back (so a decoder that
    treats the start of a text specially, such as SentencePiece's leading space, sees the
    context): the cost of a push is the length of its window, not of the whole text.

    The pieces join into the full text for any tokenizer whose text of a sequence starts
    with the text of each of its prefixes up to such a tail (characters, literal BPE,
    byte-level BPE).

    **Arguments:**

    - `decode`: token ids (a list of ints) -> text.
    - `context`: ids that come before the ones pushed (a prompt); their text is not given
      out, but the text after them is decoded in their context. A character the context
      ends inside (the first bytes of an emoji) is given out, whole, by the push that
      completes it: the pieces join into `decode(context + pushed)` minus the context's
      text up to that character.
    """

    def __init__(self, decode: Callable[[list[int]], str], context: Iterable[int] = ()):
        self._decode = decode
        self._ids = [int(i) for i in context]
        text = decode(self._ids) if self._ids else ""
        whole = len(text.rstrip(_REPLACEMENT))
        self._start = 0  # the window is ids[_start:]
        # ids[:_clean] ends on a whole character, all given out; a context that ends inside
        # a character has none known but the start
        self._clean = len(self._ids) if whole == len(text) else 0
        # characters of the window out: the context's whole ones (its incomplete tail is
        # given out with the push that completes it)
        self._said = whole

    def push(self, ids: Sequence[int] | np.ndarray) -> str:
        """The new text that `ids`, appended, make whole ("" while it is incomplete)."""
        self._ids.extend(int(i) for i in np.asarray(ids).reshape(-1).tolist())
        text = self._decode(self._ids[self._start :])
        whole = len(text.rstrip(_REPLACEMENT))
        piece = text[self._said : whole] if whole > self._said else ""
        self._said = max(self._said, whole)
        if whole == len(text):  # nothing held back: the next window starts one push back
            self._start, self._clean = self._clean, len(self._ids)
            self._said = len(self._decode(self._ids[self._start : self._clean]))
        return piece

    def flush(self) -> str:
        """The text held back, as the tokenizer shows it (with U+FFFD where a character is
        still incomplete); the decoder then starts a new window after it."""
        text = self._decode(self._ids[self._start :])
        piece = text[self._said :]
        self._start = self._clean = len(self._ids)
        self._said = 0
        return piece
