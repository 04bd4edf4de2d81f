r"""Position schemes of converted models: how token positions enter the initial condition.

A converted Hugging Face model ([`HFTransformer`][itde.HFTransformer]) holds one as
`positions`; a new scheme is a subclass of `AbstractPositions` (with its entry in the
family's converter), never a name compared in the model.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


class AbstractPositions(eqx.Module):
    """How learned position embeddings are added to the token embeddings."""

    @abc.abstractmethod
    def max_tokens(self, table: Float[Array, "positions features"] | None) -> int | None:
        """The longest sequence the position table `table` holds (None: no limit)."""

    @abc.abstractmethod
    def embed(
        self,
        u: Float[Array, "tokens features"],
        ids: Int[Array, " tokens"],
        table: Float[Array, "positions features"] | None,
    ) -> Float[Array, "tokens features"]:
        """The embeddings `u` of the token ids `ids` with their positions added."""

    def check(self, table) -> None:
        """Refuse a position table this scheme cannot use (at construction)."""
        if table is None:
            raise ValueError(f"`positions`={self!r} needs `position_embeddings`.")


class AbsolutePositions(AbstractPositions):
    """Learned absolute positions `0, 1, ..., N-1` whatever the padding (BERT, DistilBERT,
    GPT-2: left padding shifts the real tokens' positions, as in Hugging Face)."""

    def max_tokens(self, table):
        return table.shape[0]

    def embed(self, u, ids, table):
        return u + table[: ids.shape[0]]


class RobertaPositions(AbstractPositions):
    """RoBERTa's positions: counted from `padding_idx + 1` over the tokens that are not
    `padding_idx` (a padding token keeps position `padding_idx`)."""

    padding_idx: int = eqx.field(static=True)

    def max_tokens(self, table):
        return table.shape[0] - self.padding_idx - 1

    def embed(self, u, ids, table):
        real = (ids != self.padding_idx).astype(jnp.int32)
        return u + table[jnp.cumsum(real) * real + self.padding_idx]


class NoPositions(AbstractPositions):
    """No position embeddings (positions enter elsewhere, e.g. Llama's rotary embedding)."""

    def max_tokens(self, table):
        return None

    def embed(self, u, ids, table):
        return u

    def check(self, table) -> None:
        return None
