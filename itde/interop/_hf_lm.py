r"""Causal language models: a converted base model and its linear head onto the vocabulary.

A Hugging Face `...ForCausalLM` (`GPT2LMHeadModel`, `LlamaForCausalLM`) is a base model
(`transformer`, `model`) and a linear head (`lm_head`), tied to the word embeddings or not.
[`CausalLMFamily`][itde.interop.CausalLMFamily] converts one such class through the base
model's family; [`HFCausalLM`][itde.interop.HFCausalLM] holds the converted base (an
[`HFTransformer`][itde.HFTransformer], unchanged) and the head, and gives the logits, the
loss Hugging Face computes from `labels`, and generation (the library's one generation
engine, the one `itde sample` runs on, compiled once per window bucket:
[`AbstractDecoder`][itde.AbstractDecoder]).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._buckets import PowerOfTwoBuckets
from .._generate import (
    AbstractDecoder,
    check_cache,
    generate_rows,
    prefill_logits,
    window_length,
)
from .._kv_cache import NotCacheableError, check_cacheable
from .._next_token import _scalar, check_filters, check_filters_sample, is_real
from .._operators._precision import contract, wide
from .._operators._softcap import SoftCap, check_score_cap
from .._programs import programs
from .._roles import kernel
from .._solve import solve
from .._token_padding import has_tracer, pad_rows, take_rows
from . import _hf_glue as g
from ._hf_family import AbstractHFFamily, check_weights
from ._hf_model import HFTransformer

IGNORE = -100  # Hugging Face's `ignore_index` for labels

# Config fields that change the logits but not the hidden states, with the value that
# switches each off: a head family must not ignore them (Gemma 2's soft-capping, Cohere's
# logit scale, Granite's logit divisor).
_HEAD_OPTIONS = {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1.0}


class CausalLMFamily(AbstractHFFamily):
    """A `...ForCausalLM` class: the base model at attribute `base`, converted by
    `base_family`, and a linear head (`nn.Linear`, with or without bias, tied to the base
    model's input embeddings or not) at attribute `head`.

    A family's causal language model is one line of `itde.interop.HF_FAMILIES`' registry:

        CausalLMFamily("LlamaForCausalLM", LlamaFamily(), base="model", head="lm_head")

    **Arguments:**

    - `name`: the `transformers` class it converts.
    - `base_family`: the family of the base model (its config is the head model's).
    - `base`: the attribute of the head model holding the base model.
    - `head`: the attribute holding the head.
    - `logit_cap`: whether the class soft-caps its logits by `config.final_logit_softcapping`
      (Gemma 2: $c \tanh(z / c)$ on every logit), converted as the head's
      [`SoftCap`][itde.SoftCap]; otherwise that field is refused unless None.
    """

    name: str = eqx.field(static=True)
    base_family: AbstractHFFamily
    base: str = eqx.field(static=True, default="model")
    head: str = eqx.field(static=True, default="lm_head")
    logit_cap: bool = eqx.field(static=True, default=False)

    @property
    def classes(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.name,)

    @property
    def fields(self) -> frozenset[str]:  # type: ignore[override]
        return self.base_family.fields

    def check(self, model, name):
        self.check_class(name)
        check_weights(model)
        # the head model's fields, as the base family knows them (its name in the message)
        self.base_family.check_fields(model, name)
        base = getattr(model, self.base)
        self.base_family.check(base, type(base).__name__)
        for field, off in _HEAD_OPTIONS.items():
            if field == "final_logit_softcapping" and self.logit_cap:
                continue  # converted: the head's SoftCap
            g.refuse(
                model.config, field, lambda v, off=off: v is None or v == off,
                f"the head's logits would be changed by it, which {name} converts without; "
                f"it must be {off!r}.",
            )  # fmt: skip

    def convert(self, model, name) -> HFCausalLM:
        base = getattr(model, self.base)
        m = self.base_family.convert(base, type(base).__name__)
        if not m.equation.causal:
            raise ValueError(
                f"{name}'s base model is not causal (its config's `is_decoder` is off); a "
                "causal language model needs causal attention."
            )
        head = getattr(model, self.head)
        tied = head.weight is base.get_input_embeddings().weight
        return HFCausalLM(
            base=m,
            head=None if tied else g.a(head.weight),
            head_bias=g.a(head.bias),
            source=name,
            family=self,
            logit_cap=self._logit_cap(model.config),
        )

    def _logit_cap(self, config) -> SoftCap | None:
        v = getattr(config, "final_logit_softcapping", None) if self.logit_cap else None
        return None if v is None else SoftCap(float(v))

    def write(self, m, model):
        if not isinstance(m, HFCausalLM):
            raise TypeError(f"`m` must be an itde.interop.HFCausalLM, got {type(m).__name__}.")
        if m.logit_cap != self._logit_cap(model.config):
            raise ValueError(
                f"`to_hf`: the model's logit cap {m.logit_cap!r} is not the one its config's "
                f"final_logit_softcapping gives ({self._logit_cap(model.config)!r})."
            )
        base = getattr(model, self.base)
        self.base_family.write(m.base, base)
        head = getattr(model, self.head)
        if head.weight is base.get_input_embeddings().weight:  # tied in Hugging Face
            # exact: a head tied at conversion is the embedding table copied, not computed
            if m.head is not None and not np.array_equal(m.head, m.base.word_embeddings):
                raise ValueError(
                    "`to_hf`: the itde model's head differs from its word embeddings, but its "
                    "config ties them (`config.tie_word_embeddings`=True); set it to False "
                    "to write an untied head."
                )
        else:
            g.put(head.weight, m.base.word_embeddings if m.head is None else m.head)
        if (m.head_bias is None) != (head.bias is None):
            raise ValueError(
                f"`to_hf`: the itde head has {'no' if m.head_bias is None else 'a'} bias where "
                f"{m.source}'s `{self.head}` has {'one' if head.bias is not None else 'none'}."
            )
        if head.bias is not None:
            g.put(head.bias, m.head_bias)

    def window(self, config):
        """The base family's window: the head model attends as its base model does."""
        return self.base_family.window(config)

    def float64_patches(self):
        import transformers

        loss = (getattr(transformers, self.name), "loss_function", property(_loss_function64))
        return (*self.base_family.float64_patches(), loss)


def _loss_function64(self):
    """The head model's loss function, computing Hugging Face's causal-LM loss in float64
    for float64 logits (its `ForCausalLMLoss` casts them to float32 first)."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss, fixed_cross_entropy
    from transformers.modeling_utils import PreTrainedModel

    original = PreTrainedModel.loss_function.fget(self)  # type: ignore[union-attr]

    def loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE,
             shift_labels=None, **kwargs):  # fmt: skip
        if logits.dtype != torch.float64 or original is not ForCausalLMLoss:
            return original(
                logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index, shift_labels=shift_labels, **kwargs,
            )  # fmt: skip
        if shift_labels is None:
            labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = labels[..., 1:].contiguous()
        return fixed_cross_entropy(
            logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device),
            num_items_in_batch, ignore_index, **kwargs,
        )  # fmt: skip

    return loss


def _project(lm: HFCausalLM, h):
    """`lm.project(h)` in the caller's trace (a module-level function: the program's key)."""
    return lm._project(h)


class HFCausalLM(eqx.Module):
    r"""A Hugging Face causal language model as an equation and a head: the hidden states
    $u(T)$ of `base` (an [`HFTransformer`][itde.HFTransformer]) mapped to the logits
    $u(T)\,W^\top + b$ over the vocabulary. Built by [`from_hf`][itde.from_hf] from a
    `...ForCausalLM` (`GPT2LMHeadModel`, `LlamaForCausalLM`).

    - `logits(input_ids, attention_mask)` (one sequence): `[tokens, vocab]`, Hugging Face's
      `model(...).logits[0]` on the real tokens;
    - `loss(input_ids, attention_mask, labels)` (a batch) and `perplexity`: Hugging Face's
      `model(..., labels=labels).loss` and its exponential;
    - `generate` and `generate_stream`: greedy or sampled continuation of a prompt,
      compiled once per window bucket and streamed as it is drawn;
    - `to_hf()`: the Hugging Face model again (a tied head stays tied).

    **Arguments:**

    - `base`: the converted base model.
    - `head`: the head's weight `[vocab, features]` (Hugging Face's `lm_head.weight`), or
      None when it is tied to `base.word_embeddings` (then it is that same parameter, in
      training too).
    - `head_bias`: `[vocab]`, or None.
    - `source`: the converted class's name (`to_hf` builds it again).
    - `family`: the [`CausalLMFamily`][itde.interop.CausalLMFamily] that converted it.
    - `logit_cap`: None, or the [`SoftCap`][itde.SoftCap] $c \tanh(z / c)$ applied to every
      logit (Gemma 2's `final_logit_softcapping`); the loss and generation read the capped
      logits, as Hugging Face's.
    """

    base: HFTransformer
    head: Float[Array, "vocab features"] | None = kernel(default=None)
    head_bias: Float[Array, " vocab"] | None = None
    source: str = eqx.field(static=True, default="")
    family: Any = None
    logit_cap: SoftCap | None = None

    def __check_init__(self):
        if not isinstance(self.base, HFTransformer):
            raise TypeError(
                f"`base` must be an itde.HFTransformer, got {type(self.base).__name__}."
            )
        d = self.base.word_embeddings.shape[1]
        if self.head is not None and tuple(self.head.shape[1:]) != (d,):
            raise ValueError(
                f"`head` must have shape [vocab, {d}] (the base model's features), got "
                f"{tuple(self.head.shape)}."
            )
        check_score_cap("logit_cap", self.logit_cap)
        n = self.vocab_size
        if self.head_bias is not None and tuple(self.head_bias.shape) != (n,):
            raise ValueError(f"`head_bias` must have shape ({n},), got {self.head_bias.shape}.")

    @property
    def config(self) -> str:
        """The source model's config as JSON (the base model keeps it), for `to_hf`."""
        return self.base.config

    @property
    def tied(self) -> bool:
        """Whether the head is the word embeddings."""
        return self.head is None

    @property
    def vocab_size(self) -> int:
        w = self.base.word_embeddings if self.head is None else self.head
        return int(w.shape[0])

    # ------------------------------------------------------------------ logits
    def project(self, h: Float[Array, "*tokens features"]) -> Float[Array, "*tokens vocab"]:
        """The head applied to hidden states: $h\\,W^\\top + b$ (soft-capped by `logit_cap`
        when set), in `h`'s dtype. Concrete states of two or more axes are padded on the
        host to the power-of-two bucket of their token axis (`-2`) and projected by one
        program per bucket (the head acts token by token), so a new length compiles
        nothing; under a trace it is part of the caller's program."""
        if np.ndim(h) >= 2 and not has_tracer(self, h):
            n = int(np.shape(h)[-2])
            padded = pad_rows(h, PowerOfTwoBuckets().size(n), -2) if n else h
            return take_rows(programs(_project, self, padded), n, -2)
        return _project(self, h)

    def _project(self, h):
        w = self.base.word_embeddings if self.head is None else self.head
        out = contract("...d,vd->...v", h, w)
        out = out if self.head_bias is None else out + self.head_bias.astype(out.dtype)
        return out if self.logit_cap is None else self.logit_cap(out)

    def logits(
        self,
        input_ids: Int[Array, " tokens"],
        attention_mask: Int[Array, " tokens"] | None = None,
    ) -> Float[Array, "tokens vocab"]:
        """The logits of one sequence, `[tokens, vocab]`, equal to Hugging Face's
        `model(input_ids[None], attention_mask=mask[None]).logits[0]` on the real tokens
        (rows of padded tokens are defined but meaningless, as in `HFTransformer`).

        **Arguments:** those of calling an [`HFTransformer`][itde.HFTransformer]."""
        return self.project(self.base(input_ids, attention_mask))

    def __call__(self, input_ids, attention_mask=None):
        """The logits of one sequence (the same as [`logits`][itde.interop.HFCausalLM.logits])."""
        return self.logits(input_ids, attention_mask)

    # ------------------------------------------------------------------ loss
    def loss(
        self,
        input_ids: Int[Array, "batch tokens"],
        attention_mask: Int[Array, "batch tokens"] | None = None,
        labels: Int[Array, "batch tokens"] | None = None,
    ) -> Float[Array, ""]:
        """The mean next-token cross-entropy of a batch (or of one sequence `[tokens]`).

        As Hugging Face's `model(input_ids, attention_mask=mask, labels=labels).loss`: the
        logits of token $t$ predict the label of token $t+1$ (the labels are shifted inside),
        labels equal to -100 are ignored, and the mean is over every counted target of the
        batch. Computed in the logits' dtype, at least float32.

        **Arguments:**

        - `input_ids`: `[batch, tokens]` (or `[tokens]`).
        - `attention_mask`: 1 on real tokens, 0 on padding; None: all real.
        - `labels`: the targets, -100 where ignored; None: `input_ids`.

        A target counts only when the token that predicts it is real too: with
        `attention_mask`, the targets after a padded token are ignored (with left padding,
        Hugging Face would count the first real token, predicted from a padded row, whose
        logits carry no meaning; give it label -100 there for the same number). Labels
        outside `[0, vocab)` other than -100 raise `ValueError`.
        """
        ids = jnp.asarray(input_ids)
        one = ids.ndim == 1
        if one:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(
                f"`input_ids` must be [batch, tokens] or [tokens], got shape {ids.shape}."
            )
        mask = None if attention_mask is None else jnp.asarray(attention_mask)
        labels = None if labels is None else jnp.asarray(labels)
        for what, x in (("attention_mask", mask), ("labels", labels)):
            if x is not None and (x[None] if one else x).shape != ids.shape:
                raise ValueError(
                    f"`{what}` must have the shape of `input_ids` {tuple(np.shape(input_ids))}, "
                    f"got {tuple(x.shape)}."
                )
        if one:
            mask = None if mask is None else mask[None]
            labels = None if labels is None else labels[None]
        labels = ids if labels is None else labels  # the default: the input itself
        if not jnp.issubdtype(labels.dtype, jnp.integer):
            raise TypeError(f"`labels` must hold integer ids, got dtype {labels.dtype}.")
        vocab = self.vocab_size
        if not isinstance(labels, jax.core.Tracer):
            bad = (np.asarray(labels) != IGNORE) & (
                (np.asarray(labels) < 0) | (np.asarray(labels) >= vocab)
            )
            if bad.any():
                raise ValueError(
                    f"`labels` holds ids outside [0, {vocab}) other than -100 (ignored), e.g. "
                    f"{int(np.asarray(labels)[bad][0])}."
                )
        h = self.base.batch(ids, mask)
        logp = jax.nn.log_softmax(self.project(h[:, :-1]).astype(wide(h.dtype)), axis=-1)
        target = labels[:, 1:]
        count = target != IGNORE
        if mask is not None:
            real = mask.astype(bool)
            count = count & real[:, :-1] & real[:, 1:]
        picked = jnp.take_along_axis(logp, jnp.where(count, target, 0)[..., None], axis=-1)
        nll = -jnp.sum(jnp.where(count, picked[..., 0], 0.0))
        return nll / jnp.sum(count)

    def perplexity(self, input_ids, attention_mask=None, labels=None) -> Float[Array, ""]:
        """$e^{\\text{loss}}$: the exponential of [`loss`][itde.interop.HFCausalLM.loss]
        (same arguments)."""
        return jnp.exp(self.loss(input_ids, attention_mask, labels))

    # ------------------------------------------------------------------ generation
    def generate_stream(
        self,
        prompt_ids: Int[Array, " prompt"],
        max_new_tokens: int,
        *,
        key: PRNGKeyArray | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        max_length: int | None = None,
        chunk: int = 16,
        cache: bool | None = None,
    ) -> Iterator[np.ndarray]:
        """The tokens drawn after `prompt_ids`, yielded in pieces of at most `chunk` tokens
        as they are drawn (the prompt itself is not yielded).

        The generation runs in a window that holds the prompt, the new tokens and filler
        the causal attention never reads, padded to a bucket (a power of two from 256, at
        most the model's positions), so its programs (the prefill and
        the loop that draws a piece, a `jax.lax.fori_loop` over its tokens) are compiled
        once per model and bucket, whatever the prompt's length, the number of tokens, the
        key, the temperature, `top_k` or `top_p` (greedy and sampled draws are two
        programs), and never per token. They are held in `itde.programs`.

        **Arguments:**

        - `prompt_ids`: `[prompt]` token ids, at least one.
        - `max_new_tokens`: how many tokens to draw, >= 0.
        - `key`: a JAX random key: sample from $\\mathrm{softmax}(\\text{logits} / T)$,
          filtered by `top_k` and `top_p`; token $i$ uses `jax.random.fold_in(key, i)`.
          None: greedy (the most likely token, as Hugging Face's
          `generate(do_sample=False)`).
        - `temperature`: $T > 0$ when sampling; 0 is greedy.
        - `top_k`, `top_p`: keep the `top_k` most likely tokens (an integer >= 1; None: all),
          then those whose probabilities sum to `top_p` (in (0, 1]; 1: all), as
          `generate(do_sample=True, top_k=..., top_p=...)` filters
          ([`warp_logits`][itde.train.warp_logits]); with a `key` and a temperature
          above 0 only (a greedy draw would ignore them: refused).
        - `eos_token_id`: stop after drawing this token (it is yielded); None: draw
          `max_new_tokens`.
        - `max_length`: the window the generation needs (default: prompt plus
          `max_new_tokens`), at most the model's position limit; it is padded to its
          bucket (on a token rule other than the unit grid, where the window's length is
          part of the discretisation, it is used as given).
        - `chunk`: tokens drawn per call of the compiled program (part of what it is
          compiled for).
        - `cache`: keep every layer's keys and values ([`itde.KVCache`][itde.KVCache]):
          the prompt is solved once, in chunks of 64 rows against the cache, then each
          token runs its own trajectory against the cache instead of the whole window:
          the same operations in the same precision (a bfloat16 model's state in
          float32, as [`itde.solve`][itde.solve] carries it), the attention's sums in
          another order, so the logits are equal to round-off (float64: 1e-12) and the
          tokens the same unless two logits tie to it. None (default):
          with the cache when the model is cacheable
          ([`itde.check_cacheable`][itde.check_cacheable]), without otherwise; True:
          with it, or `itde.NotCacheableError` saying why not; False: without.
        """
        prompt, n_new, need = self._check_generate(
            prompt_ids, max_new_tokens, key, temperature, eos_token_id, max_length, chunk
        )
        keys, sampling = _sampling_args(key, temperature, top_k, top_p)
        dec = HFDecoder(self)
        length = window_length(dec, need, self.base.max_tokens, need)
        cached = self._use_cache(cache, length)
        for piece in generate_rows(
            dec, [prompt], n_new, length=length, key=keys, sampling=sampling,
            eos_token_id=eos_token_id, chunk=chunk, cache=cached,
        ):  # fmt: skip
            piece = piece[0]
            if eos_token_id is not None and (piece == eos_token_id).any():
                yield piece[: int(np.argmax(piece == eos_token_id)) + 1]
                return
            yield piece

    def _use_cache(self, cache, window_len: int) -> bool:
        """Whether to generate with the cache: `cache` checked, None resolved."""
        cache = check_cache(cache)
        if cache is False:
            return False
        try:
            check_cacheable(self.base.equation, window_len)
        except NotCacheableError:
            if cache:
                raise
            return False
        return True

    def generate_batch(
        self,
        prompts,
        max_new_tokens: int,
        *,
        key: PRNGKeyArray | None = None,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        eos_token_id: int | None = None,
        max_length: int | None = None,
        chunk: int = 16,
        cache: bool | None = None,
    ) -> list[np.ndarray]:
        """Several prompts of any lengths at once: a list with, for each prompt, the prompt
        followed by its drawn tokens, `[prompt_b + new_b]`.

        Row `b` is [`generate`][itde.interop.HFCausalLM.generate]`(prompts[b],
        key=jax.random.fold_in(key, b), ...)` (the same arguments otherwise): each prompt
        keeps its own positions and its own cache, with no padding in front of it (the
        rows are the single-prompt programs mapped with `jax.vmap`, so every weight is read
        once a token for all rows; the batched products may round differently in the
        last bits, so a float32 near-tie could flip; the tests compare the tokens in
        float64). Greedy (no `key`), every row is Hugging Face's
        `generate(prompt_b[None], do_sample=False)`. A row that draws `eos_token_id` ends
        there (the others go on); the program stops when every row has ended or drawn
        `max_new_tokens`.

        **Arguments:** `prompts`, a non-empty list of `[prompt]` id sequences (or a 2-D
        array, one row a prompt); the rest as
        [`generate_stream`][itde.interop.HFCausalLM.generate_stream], `max_length` the
        window of every row (default: the longest prompt plus `max_new_tokens`).
        """
        rows = _prompt_rows(prompts)
        n_new = _natural("max_new_tokens", max_new_tokens, 0)
        need = max(np.size(r) for r in rows) + n_new if max_length is None else max_length
        self._check_causal()
        checked = []
        for b, row in enumerate(rows):  # what is wrong with a row names the row
            try:
                checked.append(self._check_prompt(row))
            except (ValueError, TypeError) as e:
                raise type(e)(f"`prompts[{b}]`: {e}") from None
        self._check_options(n_new, key, temperature, eos_token_id, chunk)  # the same for all
        for b, row in enumerate(checked):
            try:
                self._check_window(row, n_new, need)
            except ValueError as e:
                raise ValueError(f"`prompts[{b}]`: {e}") from None
        keys, sampling = _sampling_args(key, temperature, top_k, top_p)
        dec = HFDecoder(self)
        length = window_length(dec, need, self.base.max_tokens, need)
        cached = self._use_cache(cache, length)
        pieces = list(generate_rows(
            dec, checked, n_new, length=length, key=keys, fold=True, sampling=sampling,
            eos_token_id=eos_token_id, chunk=chunk, cache=cached,
        ))  # fmt: skip
        drawn = np.concatenate(pieces, axis=1) if pieces else np.zeros((len(rows), 0), np.int32)
        out_rows = []
        for row, new in zip(checked, drawn, strict=True):
            if eos_token_id is not None and (new == eos_token_id).any():
                new = new[: int(np.argmax(new == eos_token_id)) + 1]
            out_rows.append(np.concatenate([row, new]).astype(np.int32))
        return out_rows

    def next_token_logits(self, prompts, *, max_length: int | None = None) -> np.ndarray:
        """The logits of the token after each prompt, `[prompts, vocab]` (NumPy, at least
        float32), computed as generation computes them: the prompts padded into a window
        bucket and solved by the key/value cache in chunks (one compiled program per
        bucket and batch size, whatever the prompts' lengths). Equal to the last row of
        [`logits`][itde.interop.HFCausalLM.logits] of each prompt alone, to round-off.

        **Arguments:** `prompts`: a non-empty list of `[prompt]` id sequences (or a 2-D
        array); `max_length`: the window (default: the longest prompt), padded to its
        bucket. The model must be cacheable ([`itde.check_cacheable`][itde.check_cacheable];
        otherwise `itde.NotCacheableError` says why)."""
        self._check_causal()
        checked = []
        for b, row in enumerate(_prompt_rows(prompts)):
            try:
                checked.append(self._check_prompt(row))
            except (ValueError, TypeError) as e:
                raise type(e)(f"`prompts[{b}]`: {e}") from None
        need = max(len(r) for r in checked) if max_length is None else max_length
        for b, row in enumerate(checked):
            try:
                self._check_window(row, 0, need)
            except ValueError as e:
                raise ValueError(f"`prompts[{b}]`: {e}") from None
        dec = HFDecoder(self)
        length = window_length(dec, need, self.base.max_tokens, need)
        self._use_cache(True, length)
        return prefill_logits(dec, checked, length=length)

    def generate(self, prompt_ids, max_new_tokens, **kwargs) -> np.ndarray:
        """The prompt followed by the drawn tokens, `[prompt + new]` (arguments as
        [`generate_stream`][itde.interop.HFCausalLM.generate_stream]); greedy equals Hugging
        Face's `generate(prompt_ids[None], do_sample=False, max_new_tokens=...)[0]`."""
        pieces = list(self.generate_stream(prompt_ids, max_new_tokens, **kwargs))
        return np.concatenate([np.asarray(prompt_ids, np.int32).reshape(-1), *pieces])

    def _check_generate(self, prompt_ids, max_new_tokens, key, temperature, eos, max_length,
                        chunk):  # fmt: skip
        self._check_causal()
        prompt = self._check_prompt(prompt_ids)
        self._check_options(max_new_tokens, key, temperature, eos, chunk)
        length = self._check_window(prompt, max_new_tokens, max_length)
        return prompt, max_new_tokens, length

    def _check_causal(self) -> None:
        if not self.base.equation.causal:
            raise ValueError("generation needs a causal model; this base model is not causal.")

    def _check_prompt(self, prompt_ids) -> np.ndarray:
        """One prompt's ids, checked: `[prompt]` int32."""
        if type(prompt_ids).__module__.startswith("torch"):
            raise TypeError(
                "`prompt_ids` is a torch tensor; convert it first: `np.asarray(prompt_ids)`."
            )
        prompt = np.asarray(prompt_ids)
        vocab = self.base.word_embeddings.shape[0]
        if prompt.ndim != 1 or prompt.shape[0] == 0 or not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(
                f"`prompt_ids` must be one non-empty sequence of integer ids [prompt], got "
                f"shape {prompt.shape} and dtype {prompt.dtype}."
            )
        if ((prompt < 0) | (prompt >= vocab)).any():
            raise ValueError(f"`prompt_ids` holds ids outside [0, {vocab}).")
        return prompt.astype(np.int32)

    def _check_options(self, max_new_tokens, key, temperature, eos, chunk) -> None:
        """The arguments of a generation that are not the prompt's."""
        _natural("max_new_tokens", max_new_tokens, 0)
        _natural("chunk", chunk, 1)
        if not (is_real(temperature) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(
                f"`temperature`={temperature!r} must be a finite number >= 0 (0 = greedy)."
            )
        if key is None and temperature not in (0, 1.0):
            raise ValueError(
                f"`temperature`={temperature!r} without a `key` would be ignored (no key: "
                "greedy); pass `key=jax.random.key(seed)` to sample."
            )
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, (int, np.integer))
                                or not 0 <= eos < self.vocab_size):  # fmt: skip
            raise ValueError(
                f"`eos_token_id`={eos!r} must be None or a token id in [0, {self.vocab_size})."
            )

    def _check_window(self, prompt, max_new_tokens, max_length) -> int:
        """The window length: the prompt plus the new tokens, or `max_length` (at least
        that), within the model's positions."""
        need = prompt.shape[0] + max_new_tokens
        length = need if max_length is None else _natural("max_length", max_length, 1)
        if length < need:
            raise ValueError(
                f"`max_length`={length} is shorter than the prompt ({prompt.shape[0]} tokens) "
                f"plus `max_new_tokens` ({max_new_tokens}); give at least {need}."
            )
        limit = self.base.max_tokens
        if limit is not None and length > limit:
            raise ValueError(
                f"the window of {length} tokens (prompt plus `max_new_tokens`, or "
                f"`max_length`) is longer than the {limit} positions this {self.source} takes; "
                "shorten the prompt or draw fewer tokens."
            )
        return length

    # ------------------------------------------------------------------ back to HF
    def to_hf(self) -> Any:
        """The Hugging Face head model (the class `source` names, built from the base
        model's config) with this model's weights written in, in its dtype, in eval mode,
        as [`itde.to_hf`][itde.interop.to_hf] writes a base model: `from_hf(model).to_hf()`
        has `model`'s state; a tied head stays tied."""
        from ._hf_export import to_hf

        return to_hf(self)


def _natural(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{name}`={value!r} must be an integer >= {minimum}.")
    return int(value)


def _sampling_args(key, temperature, top_k, top_p):
    """The sampler of a generation: `(None, None)` when greedy (no key, or temperature
    0), else the key and the traced `(temperature, top_k, floor)` of the compiled draws."""
    if key is None and (top_k is not None or top_p != 1):
        raise ValueError(
            f"`top_k`={top_k!r}, `top_p`={top_p!r} without a `key` would be ignored (no "
            "key: greedy); pass `key=jax.random.key(seed)` to sample."
        )
    check_filters_sample(temperature, top_k, top_p)
    top_k, floor = check_filters(top_k, top_p)
    if key is None or temperature == 0:
        return None, None
    return key, (_scalar(temperature), jnp.asarray(top_k, jnp.int32), _scalar(floor))


class HFDecoder(AbstractDecoder):
    """A Hugging Face causal language model as the generation engine reads it
    ([`AbstractDecoder`][itde.AbstractDecoder]): the base model's embedding and equation,
    the output map and the head; logits at least float32.

    `lm`: the [`HFCausalLM`][itde.interop.HFCausalLM]."""

    lm: HFCausalLM

    @property
    def equation(self):
        return self.lm.base.equation

    @property
    def model(self):
        return self.lm

    @property
    def max_tokens(self):
        return self.lm.base.max_tokens

    def __check_init__(self):
        rows = self.lm.base.word_embeddings.shape[0]
        if self.lm.vocab_size > rows:
            raise ValueError(
                f"the head draws from {self.lm.vocab_size} tokens but the embedding table "
                f"holds {rows}: a drawn token could not be read back; generation needs a "
                "head no wider than the embeddings."
            )

    def initial(self, window):
        return self.lm.base._embed(window)

    def states(self, window):
        ys = solve(self.equation, self.initial(window)).ys
        assert ys is not None
        return ys[-1]

    def logits(self, u):
        out = self.lm.project(self.equation.output(u).astype(u.dtype))
        return out.astype(wide(out.dtype))


def _prompt_rows(prompts) -> list:
    """The prompts of `generate_batch` as a list of sequences (a 2-D array's rows)."""
    if type(prompts).__module__.startswith("torch"):
        raise TypeError("`prompts` is a torch tensor; convert it first: `np.asarray(prompts)`.")
    if isinstance(prompts, (np.ndarray, jax.Array)):
        if prompts.ndim != 2:
            raise ValueError(
                f"`prompts` as an array must be 2-D [prompts, tokens], got shape "
                f"{prompts.shape}; give one sequence to `generate`, or a list of sequences."
            )
        prompts = list(np.asarray(prompts))
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError(
            f"`prompts` must be a non-empty list of id sequences (or a 2-D array), got "
            f"{type(prompts).__name__}{'' if not isinstance(prompts, (list, tuple)) else ' of 0'}."
        )
    return list(prompts)
