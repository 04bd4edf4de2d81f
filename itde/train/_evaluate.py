"""Held-out evaluation: the task's metrics, summed batch by batch under `jit`."""

from __future__ import annotations

import equinox as eqx
import jax

from ._model import predict


@eqx.filter_jit
def eval_sums(model, x, y, task, compute_dtype=None):
    """Per-batch sums of the task's held-out statistics (divided by the count afterwards)."""
    return task.metric_sums(predict(model, x, compute_dtype), y)


def evaluate(model, chunks, task, compute_dtype=None) -> dict[str, float]:
    """Mean held-out metrics of `task` over `chunks`, a list of (sharded) `(x, y)` batches.

    **Arguments:**

    - `model`: the trained model.
    - `chunks`: batches `(x, y)`, e.g. [`Run.eval_chunks`][itde.train.Run.eval_chunks].
    - `task`: the task (an element of [`TASKS`][itde.train.TASKS], instantiated).
    - `compute_dtype`: e.g. `jnp.bfloat16` to evaluate in bfloat16 (default: the model's).

    **Returns:** `{metric name: mean}`, e.g. `eval_seq_acc` for sort.
    """
    totals: dict[str, float] = {}
    count = 0
    for x, y in chunks:
        sums = eval_sums(model, x, y, task, compute_dtype)
        for k, v in sums.items():
            if isinstance(v, jax.Array) and not v.is_fully_addressable:
                v = v.addressable_data(0)  # replicated across hosts
            totals[k] = totals.get(k, 0.0) + float(v)
        count += x.shape[0]
    return task.finish_metrics({k: v / count for k, v in totals.items()})
