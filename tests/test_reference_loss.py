"""The training losses and held-out metrics of `itde.train` against independent
computations: PyTorch's `F.cross_entropy` for the token tasks (sort, charlm), NumPy written
out here for the field task (burgers), on the same outputs and targets.

The gradient test of the training loss (`test_train_grad.py`) agrees with whatever the loss
computes; these tests say what it must compute. Shapes are distinct on every axis
(batch 3, length 5, vocabulary 7), so a softmax or a mean over the wrong axis is a
different number.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from itde.train import TASKS, TrainExperiment, from_dict, loss_fn

BATCH, LENGTH, VOCAB = 3, 5, 7
TOL = {np.float64: 1e-13, np.float32: 2e-6}  # relative, of a loss of order 1


def _task(name, **options):
    return TASKS[name](from_dict(TrainExperiment, {"task": {"name": name, **options}}).task)


def _logits(dtype, seed=0):
    rng = np.random.default_rng(seed)
    logits = (3.0 * rng.standard_normal((BATCH, LENGTH, VOCAB))).astype(dtype)
    targets = rng.integers(0, VOCAB, size=(BATCH, LENGTH))
    return logits, targets


def _torch_ce(logits, targets, reduction="mean"):
    """PyTorch's cross-entropy in float64, classes on the last axis."""
    lt = torch.tensor(np.asarray(logits, np.float64)).reshape(-1, logits.shape[-1])
    tt = torch.tensor(np.asarray(targets, np.int64)).reshape(-1)
    return F.cross_entropy(lt, tt, reduction=reduction)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("name", ["sort", "charlm"])
def test_token_task_loss_is_torch_cross_entropy(name, dtype):
    """The mean over batch and positions of $-\\log \\mathrm{softmax}(z)_{y}$."""
    task = _task(name, **({"length": LENGTH, "vocab": VOCAB} if name == "sort" else {}))
    logits, targets = _logits(dtype)
    ours = float(task.loss(jnp.asarray(logits), jnp.asarray(targets)))
    ref = float(_torch_ce(logits, targets))
    assert abs(ours - ref) <= TOL[dtype] * ref, (ours, ref)


def test_charlm_metrics_are_per_sequence_torch_cross_entropy():
    """Held-out nats per character: the sum over sequences of each one's mean cross-entropy
    (divided by the count later), and bits = nats / ln 2."""
    task = _task("charlm")
    logits, targets = _logits(np.float64, seed=1)
    sums = task.metric_sums(jnp.asarray(logits), jnp.asarray(targets))
    per_token = _torch_ce(logits, targets, reduction="none").numpy().reshape(BATCH, LENGTH)
    ref = per_token.mean(axis=1).sum()
    assert float(sums["eval_nats_per_char"]) == pytest.approx(ref, rel=1e-13)
    means = task.finish_metrics({"eval_nats_per_char": ref / BATCH})
    assert means["eval_bits_per_char"] == pytest.approx(ref / BATCH / math.log(2), rel=1e-15)


def test_sort_metrics_are_token_and_sequence_accuracy():
    task = _task("sort", length=LENGTH, vocab=VOCAB)
    logits, targets = _logits(np.float64, seed=2)
    pred = logits.argmax(-1)
    targets[0] = pred[0]  # one sequence entirely right
    targets[1, :2] = pred[1, :2]  # and a few more tokens
    sums = task.metric_sums(jnp.asarray(logits), jnp.asarray(targets))
    right = pred == targets
    assert 0 < right.mean() < 1  # neither all right nor all wrong
    # the accuracies are float32 whatever the logits' dtype
    assert float(sums["eval_token_acc"]) == pytest.approx(right.mean() * BATCH, rel=1e-6)
    assert float(sums["eval_seq_acc"]) == pytest.approx(right.all(axis=1).sum(), rel=1e-6)


def test_burgers_loss_and_metric_written_out():
    """Mean squared error over batch and grid points; relative L2 per field, summed."""
    task = _task("burgers", n_grid=8, n_modes=2)
    rng = np.random.default_rng(3)
    out, y = rng.standard_normal((2, BATCH, 8))
    mse = sum((out[b, j] - y[b, j]) ** 2 for b in range(BATCH) for j in range(8)) / (BATCH * 8)
    assert float(task.loss(jnp.asarray(out), jnp.asarray(y))) == pytest.approx(mse, rel=1e-13)
    rel = sum(
        math.sqrt(sum((out[b, j] - y[b, j]) ** 2 for j in range(8)))
        / math.sqrt(sum(y[b, j] ** 2 for j in range(8)))
        for b in range(BATCH)
    )
    sums = task.metric_sums(jnp.asarray(out), jnp.asarray(y))
    assert float(sums["eval_rel_l2"]) == pytest.approx(rel, rel=1e-13)


class _FixedLogits(eqx.Module):
    """A stand-in model whose batched prediction is given logits (no depth solve)."""

    logits: jax.Array
    readout: jax.Array

    def batched(self, x):
        return self.logits


@pytest.mark.parametrize("name", ["sort", "charlm"])
def test_loss_fn_is_the_task_loss_of_the_prediction(name):
    """`loss_fn(model, (x, y), task)`, the training loss, is PyTorch's cross-entropy of the
    model's batched prediction."""
    task = _task(name, **({"length": LENGTH, "vocab": VOCAB} if name == "sort" else {}))
    logits, targets = _logits(np.float64, seed=4)
    model = _FixedLogits(jnp.asarray(logits), jnp.zeros((VOCAB,), jnp.float64))
    x = jnp.zeros((BATCH, LENGTH), jnp.int32)
    ours = float(loss_fn(model, (x, jnp.asarray(targets)), task))
    ref = float(_torch_ce(logits, targets))
    assert abs(ours - ref) <= TOL[np.float64] * ref, (ours, ref)
