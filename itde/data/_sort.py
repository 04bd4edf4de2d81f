"""The `sort` task: map a sequence of digits to the same digits in ascending order."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray


def _check_int(value, name: str, minimum: int, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"`{owner}({name}=...)` must be an integer >= {minimum}, got {value!r}.")
    return int(value)


class SortTask(eqx.Module):
    """Sequences of `length` tokens drawn uniformly from `{0, ..., vocab - 1}`; the target
    is the same sequence sorted ascending (ties kept, so it is a permutation of the input).

    Generation is a pure function of the `jax.random` key: the same key gives the same
    batch, and `jax.random.split` gives independent ones.

    **Arguments:**

    - `length`: tokens per sequence, an integer $\\ge 2$.
    - `vocab`: number of distinct tokens, an integer $\\ge 2$.
    """

    length: int = eqx.field(static=True)
    vocab: int = eqx.field(static=True)

    def __init__(self, length: int = 8, vocab: int = 10):
        self.length = _check_int(length, "length", 2, "SortTask")
        self.vocab = _check_int(vocab, "vocab", 2, "SortTask")

    def example(self, key: PRNGKeyArray) -> tuple[Int[Array, " length"], Int[Array, " length"]]:
        """One pair `(input, target)`; [`SortTask.sample`][] is its vmap over split keys."""
        x = jax.random.randint(key, (self.length,), 0, self.vocab, dtype=jnp.int32)
        return x, jnp.sort(x)

    def sample(
        self, key: PRNGKeyArray, batch: int
    ) -> tuple[Int[Array, "batch length"], Int[Array, "batch length"]]:
        """A batch of pairs, deterministic in `key`.

        **Arguments:**

        - `key`: a `jax.random` key.
        - `batch`: number of sequences, a positive integer.

        **Returns:**

        `(inputs, targets)`, both int32 of shape `[batch, length]`, `targets` the rows of
        `inputs` sorted ascending.
        """
        batch = _check_int(batch, "batch", 1, "SortTask.sample")
        return _sample(self, key, batch)

    def accuracy(
        self,
        logits_or_pred: Float[Array, "batch length vocab"] | Int[Array, "batch length"],
        targets: Int[Array, "batch length"],
    ) -> tuple[Float[Array, ""], Float[Array, ""]]:
        """Token and whole-sequence accuracy of a prediction.

        **Arguments:**

        - `logits_or_pred`: either logits of shape `[batch, length, vocab]` (the prediction
          is their argmax) or predicted tokens of shape `[batch, length]`.
        - `targets`: the sorted sequences, shape `[batch, length]`.

        **Returns:**

        `(token_accuracy, sequence_accuracy)`: the fraction of positions predicted right,
        and the fraction of sequences predicted right at every position.
        """
        return accuracy(logits_or_pred, targets, vocab=self.vocab)


def accuracy(logits_or_pred, targets, *, vocab: int | None = None):
    """Token and whole-sequence accuracy; see [`SortTask.accuracy`][]."""
    p, t = jnp.asarray(logits_or_pred), jnp.asarray(targets)
    if t.ndim != 2:
        raise ValueError(f"`targets` must have shape [batch, length], got {t.shape}.")
    if p.shape == t.shape + p.shape[-1:] and p.ndim == 3:
        if vocab is not None and p.shape[-1] != vocab:
            raise ValueError(
                f"`logits_or_pred` has {p.shape[-1]} classes on its last axis but the task's "
                f"vocab is {vocab}; logits must have shape [batch, length, vocab]."
            )
        p = jnp.argmax(p, axis=-1)
    elif p.shape != t.shape:
        raise ValueError(
            f"`logits_or_pred` must have shape [batch, length, vocab] (logits) or "
            f"[batch, length] (tokens) with [batch, length] = {t.shape}, got {p.shape}."
        )
    hit = p == t
    return jnp.mean(hit.astype(jnp.float32)), jnp.mean(jnp.all(hit, axis=-1).astype(jnp.float32))


@eqx.filter_jit
def _sample(task: SortTask, key, batch: int):
    return jax.vmap(task.example)(jax.random.split(key, batch))
