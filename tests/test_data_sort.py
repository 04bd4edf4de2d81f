"""The `sort` task: generator, targets, accuracy and argument checks."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from itde.data import SortTask


def test_sample_shapes_and_targets():
    task = SortTask(length=8, vocab=10)
    x, y = task.sample(jax.random.key(0), 256)
    assert x.shape == y.shape == (256, 8)
    assert x.dtype == y.dtype == jnp.int32
    x, y = np.asarray(x), np.asarray(y)
    assert x.min() >= 0 and x.max() < 10
    np.testing.assert_array_equal(y, np.sort(x, axis=1))  # a sorted permutation of the input
    assert np.all(np.diff(y, axis=1) >= 0)


def test_sample_is_deterministic_and_splittable():
    task = SortTask(length=5, vocab=7)
    key = jax.random.key(42)
    a = task.sample(key, 16)
    b = task.sample(key, 16)
    np.testing.assert_array_equal(a[0], b[0])
    k1, k2 = jax.random.split(key)
    c, d = task.sample(k1, 16), task.sample(k2, 16)
    assert not np.array_equal(c[0], d[0])
    # sample is the vmap of example over split keys
    one = task.example(jax.random.split(key, 16)[3])
    np.testing.assert_array_equal(one[0], a[0][3])
    np.testing.assert_array_equal(one[1], a[1][3])


def test_tokens_are_uniform():
    x, _ = SortTask(length=8, vocab=10).sample(jax.random.key(1), 4096)
    counts = np.bincount(np.asarray(x).ravel(), minlength=10)
    expected = x.size / 10
    chi2 = float(np.sum((counts - expected) ** 2 / expected))
    assert chi2 < 30.0  # 9 degrees of freedom; p ~ 4e-4


def test_task_is_a_pytree_for_jit():
    task = SortTask(length=4, vocab=3)
    x, y = eqx.filter_jit(lambda t, k: t.sample(k, 8))(task, jax.random.key(0))
    assert x.shape == (8, 4)


def test_accuracy_from_tokens_and_logits():
    task = SortTask(length=4, vocab=5)
    _, y = task.sample(jax.random.key(0), 10)
    assert tuple(map(float, task.accuracy(y, y))) == (1.0, 1.0)
    logits = jax.nn.one_hot(y, 5) * 3.0 - 1.0
    assert tuple(map(float, task.accuracy(logits, y))) == (1.0, 1.0)
    wrong = y.at[2, 1].set((y[2, 1] + 1) % 5).at[7, 0].set((y[7, 0] + 1) % 5)
    token, sequence = task.accuracy(wrong, y)
    assert float(token) == pytest.approx(1 - 2 / 40)
    assert float(sequence) == pytest.approx(1 - 2 / 10)
    token, sequence = task.accuracy(jax.nn.one_hot(wrong, 5), y)
    assert float(token) == pytest.approx(1 - 2 / 40)
    assert float(sequence) == pytest.approx(1 - 2 / 10)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(length=1), "length"),
        (dict(length=0), "length"),
        (dict(length=4.0), "length"),
        (dict(length=True), "length"),
        (dict(vocab=1), "vocab"),
        (dict(vocab="10"), "vocab"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=f"{name}=") as info:
        SortTask(**kwargs)
    assert repr(kwargs[name]) in str(info.value)


@pytest.mark.parametrize("batch", [0, -3, 2.5])
def test_bad_batch(batch):
    with pytest.raises(ValueError, match="batch=") as info:
        SortTask().sample(jax.random.key(0), batch)
    assert repr(batch) in str(info.value)


def test_bad_accuracy_shapes():
    task = SortTask(length=4, vocab=5)
    y = jnp.zeros((3, 4), jnp.int32)
    with pytest.raises(ValueError, match="`logits_or_pred`"):
        task.accuracy(jnp.zeros((3, 5)), y)
    with pytest.raises(ValueError, match="`logits_or_pred`.*vocab is 5"):
        task.accuracy(jnp.zeros((3, 4, 6)), y)
    with pytest.raises(ValueError, match="`targets`"):
        task.accuracy(y[0], y[0])
