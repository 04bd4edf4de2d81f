"""The data of a training run: a task's batches as a pure function of a key, held-out
evaluation sets, and the per-task evaluation metrics."""

from __future__ import annotations

import hashlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..data import BurgersTask, CharCorpus, SortTask, builtin_text_path, relative_l2
from ..data._sort import accuracy


class TaskData:
    """Batches of one task (`sort`, `burgers`, `charlm`) from a `[task]` table.

    `train_batch(key, n)` and `eval_batch(key, n)` return `(x, y)` NumPy arrays, pure
    functions of the key. `vocab` is the vocabulary size (None for burgers), `meta` what a
    checkpoint must record to reproduce the data (the character vocabulary and the text's
    SHA-256 for charlm).
    """

    def __init__(self, task, *, n_grid: int | None = None):
        self.name = task.name
        self.meta: dict = {}
        self.vocab: int | None = None
        if task.name == "sort":
            self.task = SortTask(task.length, task.vocab)
            self.vocab = task.vocab
        elif task.name == "burgers":
            opts = task.options()
            if n_grid is not None:
                opts["n_grid"] = n_grid
            self.task = BurgersTask(**opts)
        else:
            path = task.text_path or builtin_text_path()
            self.corpus = CharCorpus.from_file(path, val_fraction=task.val_fraction)
            self.context = task.context
            for split in ("train", "val"):
                n = getattr(self.corpus, split).shape[0]
                if n < self.context + 1:
                    raise ValueError(
                        f"the {split!r} split of {str(path)!r} has {n} characters, too short "
                        f"for `task.context`={self.context} (needs {self.context + 1}); use a "
                        "smaller context, a longer text, or another `task.val_fraction`."
                    )
            self.vocab = self.corpus.vocab_size
            digest = hashlib.sha256(np.asarray(self.corpus.train).tobytes())
            digest.update(np.asarray(self.corpus.val).tobytes())
            self.meta = {"itos": list(self.corpus.itos), "data_sha256": digest.hexdigest()}

    def _sample(self, key, n: int, split: str):
        if self.name == "charlm":
            x, y = self.corpus.batch(key, split, n, self.context)
        else:
            x, y = self.task.sample(key, n)
        if self.name == "burgers":
            x, y = x.astype(jnp.float32), y.astype(jnp.float32)
        return np.asarray(x), np.asarray(y)

    def train_batch(self, key, n: int):
        return self._sample(key, n, "train")

    def eval_batch(self, key, n: int):
        return self._sample(key, n, "val")


# ------------------------------------------------------------------------- metrics
def _eval_sums(model, x, y, task: str, compute_dtype):
    """Per-batch sums of the evaluation statistics (divided by the count afterwards)."""
    from ._model import cross_entropy, predict

    out = predict(model, x, compute_dtype)
    n = x.shape[0]
    if task == "sort":
        tok, seq = accuracy(out, y)
        return {"eval_token_acc": tok * n, "eval_seq_acc": seq * n}
    if task == "burgers":
        return {"eval_rel_l2": relative_l2(out, y.astype(out.dtype)) * n}
    per_seq = jax.vmap(cross_entropy)(out, y)
    return {"eval_nats_per_char": jnp.sum(per_seq)}


eval_sums = eqx.filter_jit(_eval_sums)


def evaluate(model, chunks, task: str, compute_dtype=None) -> dict[str, float]:
    """Mean evaluation metrics over `chunks`, a list of (sharded) `(x, y)` batches."""
    totals: dict[str, float] = {}
    count = 0
    for x, y in chunks:
        sums = eval_sums(model, x, y, task, compute_dtype)
        for k, v in sums.items():
            if isinstance(v, jax.Array) and not v.is_fully_addressable:
                v = v.addressable_data(0)  # replicated across hosts
            totals[k] = totals.get(k, 0.0) + float(v)
        count += x.shape[0]
    out = {k: v / count for k, v in totals.items()}
    if "eval_nats_per_char" in out:
        out["eval_bits_per_char"] = out["eval_nats_per_char"] / float(np.log(2.0))
    return out
