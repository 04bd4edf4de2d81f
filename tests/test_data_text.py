"""The `charlm` task: reading, encoding, splitting and batching a local UTF-8 text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from itde.data import CharCorpus, builtin_text_path

TEXT = "the quick brown fox jumps over the lazy dog. ÄÖÜ ß — ok!\n" * 3


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def test_from_file_vocabulary_and_split(text_file):
    corpus = CharCorpus.from_file(text_file, val_fraction=0.25)
    assert list(corpus.itos) == sorted(set(TEXT))
    assert corpus.vocab_size == len(set(TEXT))
    assert corpus.stoi == {c: i for i, c in enumerate(corpus.itos)}
    n_val = int(len(TEXT) * 0.25)
    assert corpus.val.shape == (n_val,)
    assert corpus.train.shape == (len(TEXT) - n_val,)
    assert corpus.train.dtype == corpus.val.dtype == jnp.int32
    # split by position: train then val is the whole text
    assert corpus.decode(corpus.train) + corpus.decode(corpus.val) == TEXT
    assert corpus.decode(corpus.val) == TEXT[-n_val:]
    assert corpus.source == str(text_file)


def test_encode_decode_round_trip(text_file):
    corpus = CharCorpus.from_file(text_file)
    ids = corpus.encode("fox — ß")
    assert ids.dtype == jnp.int32
    assert corpus.decode(ids) == "fox — ß"
    assert corpus.decode([]) == ""
    assert corpus.encode("").shape == (0,)


def test_byte_order_mark_is_dropped(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbfabc")
    corpus = CharCorpus.from_file(path, val_fraction=0.0)
    assert corpus.itos == ("a", "b", "c")
    assert corpus.val.shape == (0,)


def test_batch_windows(text_file):
    corpus = CharCorpus.from_file(text_file, val_fraction=0.3)
    key = jax.random.key(0)
    for split, data in (("train", corpus.train), ("val", corpus.val)):
        x, y = corpus.batch(key, split, 64, 10)
        assert x.shape == y.shape == (64, 10)
        assert x.dtype == y.dtype == jnp.int32
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
        whole = corpus.decode(data)
        for row_x, row_y in zip(np.asarray(x), np.asarray(y), strict=True):
            window = corpus.decode(row_x) + corpus.decode(row_y[-1:])
            assert window in whole
    a = corpus.batch(key, "train", 8, 5)
    b = corpus.batch(key, "train", 8, 5)
    np.testing.assert_array_equal(a[0], b[0])


def test_batch_covers_every_start(tmp_path):
    path = tmp_path / "digits.txt"
    path.write_text("0123456789", encoding="utf-8")
    corpus = CharCorpus.from_file(path, val_fraction=0.0)
    x, y = corpus.batch(jax.random.key(0), "train", 500, 3)
    starts = set(np.asarray(x[:, 0]).tolist())
    assert starts == set(range(7))  # 10 characters, windows of 3 + 1: starts 0..6
    # the longest context the split allows
    x, y = corpus.batch(jax.random.key(0), "train", 2, 9)
    assert corpus.decode(x[0]) == "012345678" and corpus.decode(y[0]) == "123456789"


def test_builtin_text():
    path = builtin_text_path()
    assert path.is_file()
    corpus = CharCorpus.from_file(path)
    assert corpus.train.shape[0] > 3000
    assert corpus.val.shape[0] > 300
    assert 30 <= corpus.vocab_size <= 100
    x, _ = corpus.batch(jax.random.key(0), "val", 4, 64)
    assert x.shape == (4, 64)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt") as info:
        CharCorpus.from_file(path)
    assert "builtin_text_path" in str(info.value)
    with pytest.raises(FileNotFoundError, match="No text file"):
        CharCorpus.from_file(tmp_path)  # a directory is not a text file


def test_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.txt.*is empty"):
        CharCorpus.from_file(path)


@pytest.mark.parametrize(("raw", "offset"), [(b"\xff\xfe bad", 0), (b"abc\xc3(def", 3)])
def test_not_utf8(tmp_path, raw, offset):
    path = tmp_path / "latin.txt"
    path.write_bytes(raw)
    with pytest.raises(ValueError, match=f"latin.txt.*not valid UTF-8.*byte offset {offset}"):
        CharCorpus.from_file(path)


def test_too_short_for_context(text_file):
    corpus = CharCorpus.from_file(text_file, val_fraction=0.1)
    n_val = corpus.val.shape[0]
    corpus.batch(jax.random.key(0), "val", 2, n_val - 1)
    with pytest.raises(ValueError, match=f"'val'.*{n_val} characters.*context={n_val}"):
        corpus.batch(jax.random.key(0), "val", 2, n_val)
    empty_val = CharCorpus.from_file(text_file, val_fraction=0.0)
    with pytest.raises(ValueError, match="'val'.*0 characters.*context=1"):
        empty_val.batch(jax.random.key(0), "val", 2, 1)


@pytest.mark.parametrize("val_fraction", [-0.1, 1.0, 2, float("nan"), "0.1", None])
def test_bad_val_fraction(text_file, val_fraction):
    with pytest.raises(ValueError, match="`val_fraction`") as info:
        CharCorpus.from_file(text_file, val_fraction=val_fraction)
    assert repr(val_fraction) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(split="test"), "split"),
        (dict(batch=0), "batch"),
        (dict(batch=2.0), "batch"),
        (dict(context=0), "context"),
        (dict(context=True), "context"),
    ],
)
def test_bad_batch_arguments(text_file, kwargs, name):
    corpus = CharCorpus.from_file(text_file)
    args = dict(split="train", batch=2, context=4) | kwargs
    with pytest.raises(ValueError, match=f"`{name}`") as info:
        corpus.batch(jax.random.key(0), **args)
    assert repr(kwargs[name]) in str(info.value)


def test_encode_decode_errors(text_file):
    corpus = CharCorpus.from_file(text_file)
    with pytest.raises(ValueError, match="`text`.*'Z'"):
        corpus.encode("Zebra")
    with pytest.raises(ValueError, match="`ids`.*vocab_size"):
        corpus.decode([0, corpus.vocab_size])
    with pytest.raises(ValueError, match="`ids`.*vocab_size"):
        corpus.decode([-1])
    with pytest.raises(ValueError, match="`ids`.*one-dimensional"):
        corpus.decode([[0]])
    with pytest.raises(ValueError, match="`ids`.*integers"):
        corpus.decode([0.5])


def test_from_text_checks():
    with pytest.raises(TypeError, match="`text`"):
        CharCorpus.from_text(b"bytes")
    with pytest.raises(ValueError, match="empty"):
        CharCorpus.from_text("")
