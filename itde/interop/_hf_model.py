r"""A converted Hugging Face model: its embeddings as the initial condition, its layers as
the equation's per-layer controls (solved with $\Delta t = 1$), its final norm as the
output map."""

from __future__ import annotations

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._buckets import PowerOfTwoBuckets
from .._continuum import refuse_not_smooth
from .._equation import TransformerIDE, _batch_output
from .._operators._affine import FeatureAffine
from .._operators._layernorm import LayerNormProjection
from .._operators._mask import key_mask
from .._roles import kernel
from .._token_padding import has_tracer, run_on_tokens, take_rows
from ._positions import AbsolutePositions, AbstractPositions


class HFTransformer(eqx.Module):
    r"""A Hugging Face Transformer as an equation: embeddings, then a `TransformerIDE`.

    The token embeddings (plus learned absolute positions and token type 0, then the
    embedding LayerNorm, where the model has them) are the initial condition $u(x, y, 0)$;
    `equation` carries the layers as piecewise-constant controls and the final norm.
    Built by [`from_hf`][itde.from_hf].

    `m(input_ids, attention_mask=mask)` acts on one sequence `[tokens]` and returns
    `[tokens, features]`, equal to the source model's
    `model(input_ids[None], attention_mask=mask[None]).last_hidden_state[0]` on the real
    tokens. Batch with `jax.vmap(m)(ids, mask)`.

    **Padding.** `attention_mask` (`[tokens]`, booleans or 0/1, 0 on padding) removes the
    padded tokens from every sequence's token domain: real tokens never see them. The rows of
    padded tokens are defined and finite but carry no meaning (Hugging Face's rows there
    differ, and differ between its attention implementations); a padded token before every
    real one in a causal model attends to nothing and gets attention output 0. Positions
    are those of the source model: `0, 1, ..., N-1` whatever the mask (BERT, DistilBERT,
    GPT-2, Llama: left padding shifts the real tokens' positions, as in Hugging Face),
    and for RoBERTa counted from `padding_idx + 1` over the tokens that are not
    `padding_idx`.

    **Arguments:**

    - `word_embeddings`: `[vocab, features]`.
    - `position_embeddings`: learned absolute positions `[max_positions, features]`, or None.
    - `token_type_embeddings`: `[types, features]`, or None.
    - `embedding_norm`: the embeddings' LayerNorm, or None.
    - `equation`: the layers and final norm.
    - `positions`: the position scheme: `AbsolutePositions()` (`0..N-1`),
      `RobertaPositions(padding_idx)` or `NoPositions()`.
    - `source`: the name of the converted class (`to_hf` builds it again).
    - `family`: the [`AbstractHFFamily`][itde.interop.AbstractHFFamily] that converted it
      (and writes it back with [`to_hf`][itde.interop.to_hf]).
    - `config`: the source model's config as JSON, for `to_hf`.
    - `embedding_scale`: a factor on the token embeddings, in their dtype (Gemma's
      $\sqrt{d}$), or None.
    """

    word_embeddings: Float[Array, "vocab features"] = kernel()
    position_embeddings: Float[Array, "positions features"] | None = kernel()
    token_type_embeddings: Float[Array, "types features"] | None = kernel()
    embedding_norm: LayerNormProjection | None
    equation: TransformerIDE
    positions: AbstractPositions = AbsolutePositions()
    source: str = eqx.field(static=True, default="")
    family: Any = None
    config: str = eqx.field(static=True, default="")
    embedding_scale: float | None = eqx.field(static=True, default=None)

    def __check_init__(self):
        if not isinstance(self.positions, AbstractPositions):
            raise TypeError(
                f"`positions`={self.positions!r} must be a position scheme: "
                "AbsolutePositions(), RobertaPositions(padding_idx) or NoPositions()."
            )
        self.positions.check(self.position_embeddings)
        if not isinstance(self.equation, TransformerIDE):
            raise TypeError(
                f"`equation` must be an itde.TransformerIDE, got {type(self.equation).__name__}."
            )

    def continuum_form(self) -> HFTransformer:
        """The same model with its equation in normalised coordinates
        ([`TransformerIDE.continuum_form`][itde.TransformerIDE.continuum_form]), whose
        depth any solver refines at any step.

        For a post-norm model (BERT, RoBERTa, DistilBERT) the embedding LayerNorm's gain and
        shift are folded into the first layer too, so the initial condition
        $P_0(e)$ lies on the constraint set; `m.continuum_form()(ids)` equals `m(ids)` (the
        source model) to round-off. A pre-norm model (GPT-2, Llama) is its own continuum
        form and is returned unchanged. A model whose feed-forward jumps in the state (a
        [`MixtureOfExperts`][itde.MixtureOfExperts]) is refused, naming it."""
        refuse_not_smooth(self.equation)
        if not self.equation.block.has_constraint:
            return self
        norm, affine = self.embedding_norm, None
        if norm is not None:
            norm, scale, shift = norm.unit_and_affine(self.equation.n_features)
            affine = FeatureAffine(scale, shift)
        return dataclasses.replace(
            self, embedding_norm=norm, equation=self.equation.continuum_form(affine)
        )

    @property
    def max_tokens(self) -> int | None:
        """The longest sequence the position table holds (None: no limit)."""
        return self.positions.max_tokens(self.position_embeddings)

    def embed(
        self,
        input_ids: Int[Array, " tokens"],
        token_type_ids: Int[Array, " tokens"] | None = None,
    ) -> Float[Array, "tokens features"]:
        """The initial condition $u(\\cdot, \\cdot, 0)$ for one sequence of token ids."""
        ids = _ids("input_ids", input_ids, self.word_embeddings.shape[0])
        n = ids.shape[0]
        if self.max_tokens is not None and n > self.max_tokens:
            rows = self.position_embeddings.shape[0]  # type: ignore[union-attr]
            reserved = (
                ""
                if rows == self.max_tokens
                else f", {rows - self.max_tokens} of whose rows are reserved: positions count "
                "from padding_idx + 1"
            )
            raise ValueError(
                f"`input_ids` has {n} tokens, more than the {self.max_tokens} this "
                f"{self.source or 'model'} takes (config.max_position_embeddings = {rows}"
                f"{reserved}); split the sequence."
            )
        return self._embed(ids, token_type_ids)

    def _embed(self, ids, token_type_ids=None) -> Float[Array, "tokens features"]:
        """[`embed`][itde.HFTransformer.embed] of ids known to be in range (no check of
        them, so no callback in the program: the generation engine's windows hold the
        checked prompt and tokens drawn from the head's vocabulary)."""
        u = self.word_embeddings[ids]
        if self.embedding_scale is not None:
            u = u * jnp.asarray(self.embedding_scale, u.dtype)
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                u = u + self.token_type_embeddings[0]
            else:
                tt = _ids("token_type_ids", token_type_ids, self.token_type_embeddings.shape[0])
                if tt.shape != ids.shape:
                    raise ValueError(
                        f"`token_type_ids` must have the shape of `input_ids` {ids.shape}, got "
                        f"{tt.shape}."
                    )
                u = u + self.token_type_embeddings[tt]
        elif token_type_ids is not None:
            raise ValueError(
                f"`token_type_ids` given, but this {self.source or 'model'} has no token type "
                "embeddings; leave it out."
            )
        u = self.positions.embed(u, ids, self.position_embeddings)
        if self.embedding_norm is not None:
            u = self.embedding_norm(u)
        return u

    def __call__(
        self,
        input_ids: Int[Array, " tokens"],
        attention_mask: Int[Array, " tokens"] | None = None,
        token_type_ids: Int[Array, " tokens"] | None = None,
    ) -> Float[Array, "tokens features"]:
        """The last hidden state of one sequence, `[tokens, features]`.

        **Arguments:**

        - `input_ids`: `[tokens]` integer token ids.
        - `attention_mask`: `[tokens]`, 1 (True) on real tokens and 0 (False) on padding;
          None: every token is real.
        - `token_type_ids`: `[tokens]` segment ids (BERT, RoBERTa); None: type 0.
        """
        n = np.shape(input_ids)[0] if np.ndim(input_ids) == 1 else None
        mask = None
        if attention_mask is not None and n is not None:
            mask = key_mask(attention_mask, n, "attention_mask")
            if mask.ndim != 1:
                raise ValueError(
                    f"`attention_mask` must be [tokens] for one sequence, got shape {mask.shape}; "
                    "for a batch use jax.vmap(m)(input_ids, attention_mask)."
                )
        return self.equation(self.embed(input_ids, token_type_ids), mask)

    def batch(
        self,
        input_ids: Int[Array, "batch tokens"],
        attention_mask: Int[Array, "batch tokens"] | None = None,
    ) -> Float[Array, "batch tokens features"]:
        """`jax.vmap(m)(input_ids, attention_mask)` computed as one solve over the batch
        ([`TransformerIDE.batch`][itde.TransformerIDE.batch]): the same numbers, and a
        training step about twice as fast as through `jax.vmap` of the solve
        (`benchmarks/bench_gpt2.py`)."""
        if type(input_ids).__module__.startswith("torch"):
            _ids("input_ids", input_ids, 0)  # names the conversion
        if np.ndim(input_ids) != 2:
            raise ValueError(
                f"`input_ids` must be a batch [batch, tokens], got shape {np.shape(input_ids)}; "
                "for one sequence call the model itself."
            )
        if _concrete(self, input_ids, attention_mask) and np.shape(input_ids)[0] > 0:
            ids = self._host_ids(input_ids)
            if ids is not None:  # the embedding inside the solve's bucketed program
                mask = None
                if attention_mask is not None:
                    mask = key_mask(attention_mask, ids.shape[1])
                    if mask.shape != ids.shape:
                        raise ValueError(
                            f"`attention_mask` must have shape [batch, tokens] = {ids.shape}, got "
                            f"{mask.shape}."
                        )
                return self._run_embedded(_embedded_batch, ids, mask)
        u0 = jax.vmap(self.embed)(jnp.asarray(input_ids))
        return self.equation.batch(u0, attention_mask)

    def _host_ids(self, ids):
        """Concrete ids `[batch, tokens]` on the host, checked as `embed` checks a row (a
        `ValueError` naming the fault); None where `embed` must see them (no token, not
        integers, or more tokens than the position table holds: it names each)."""
        host = np.asarray(ids)
        n = host.shape[-1]
        if n == 0 or not np.issubdtype(host.dtype, np.integer):
            return None
        if self.max_tokens is not None and n > self.max_tokens:
            return None
        return _in_range("input_ids", host, self.word_embeddings.shape[0])

    def _run_embedded(self, fn, ids, mask):
        """`fn(equation, ids, mask, self)` through `itde.programs`, padded to the token
        buckets where the equation allows it and the position table holds the bucket (the
        embedding and the solve in one program, so a new length in a bucket compiles
        nothing: `jax.vmap(self.embed)` ran eager operations at each new shape)."""
        n = ids.shape[1]
        buckets = PowerOfTwoBuckets()
        if self.max_tokens is not None and buckets.size(n) > self.max_tokens:
            buckets = None  # the padded rows would have no position: one program at n
        return run_on_tokens(
            fn, self.equation, ids, mask, self, axis=1, batch=ids.shape[0], buckets=buckets,
            cut=lambda out, k: take_rows(out, k, 1),
        )  # fmt: skip


def _concrete(*trees) -> bool:
    """No leaf is a tracer and no argument a torch tensor (those take `embed`'s path)."""
    torch = any(type(x).__module__.startswith("torch") for x in jax.tree.leaves(trees))
    return not torch and not has_tracer(*trees)


def _embedded_batch(equation: TransformerIDE, ids, mask, model: HFTransformer):
    """`model.batch(ids, mask)` as one program: the embedding (ids checked on the host) and
    the batched solve (`equation` may be `model.equation` on padded tokens)."""
    return _batch_output(equation, jax.vmap(model._embed)(ids), mask)


def _ids(name: str, ids, n_rows: int):
    """Token ids `[tokens]`, checked against the embedding table (with NumPy when the ids are
    concrete, with `eqx.error_if` under `jax.jit`)."""
    if type(ids).__module__.startswith("torch"):
        raise TypeError(
            f"`{name}` is a torch tensor; convert it first: `jnp.asarray({name}.numpy())`."
        )
    traced = isinstance(ids, jax.core.Tracer)
    ids = ids if traced else np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(
            f"`{name}` must be one sequence [tokens], got shape {ids.shape}; for a batch use "
            "jax.vmap(m)(input_ids, attention_mask)."
        )
    if ids.shape[0] == 0:
        raise ValueError(f"`{name}` is empty (shape {ids.shape}); give at least one token id.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"`{name}` must hold integer ids, got dtype {ids.dtype}.")
    if traced:
        bad = (ids < 0) | (ids >= n_rows)
        return eqx.error_if(ids, jnp.any(bad), f"`{name}` holds ids outside [0, {n_rows}).")
    return jnp.asarray(_in_range(name, ids, n_rows))


def _in_range(name: str, ids: np.ndarray, n_rows: int) -> np.ndarray:
    """Concrete ids (on the host) checked against the embedding table's `n_rows` rows."""
    bad = (ids < 0) | (ids >= n_rows)
    if bad.any():
        raise ValueError(
            f"`{name}` holds ids outside [0, {n_rows}) (the embedding table's rows), e.g. "
            f"{int(ids.flat[np.argmax(bad)])}."
        )
    return ids
