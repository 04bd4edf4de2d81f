"""Tokenizers of a text corpus: characters, or byte-pair merges of characters (BPE).

Both map text to token ids and back exactly: every token is a string of whole characters,
and the text of a sequence of ids is the concatenation of its tokens' strings
(`decode(encode(text)) == text` for any text made of the vocabulary's characters).
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterable, Iterator

import numpy as np


def decode_ids(ids, itos) -> str:
    """The text of a 1-D sequence of token ids over the vocabulary `itos` (token `i` is
    `itos[i]`); raises `ValueError` on a shape, dtype or id outside `[0, len(itos))`."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise ValueError(f"`ids` must be one-dimensional, got shape {ids.shape}.")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"`ids` must be integers, got dtype {ids.dtype}.")
    if ids.size and (ids.min() < 0 or ids.max() >= len(itos)):
        raise ValueError(
            f"`ids` must lie in [0, vocab_size={len(itos)}), got values in "
            f"[{ids.min()}, {ids.max()}]."
        )
    return "".join(itos[i] for i in ids.tolist())


#: The tokenizers of `TokenCorpus` / the `textlm` task by name.
TOKENIZER_KINDS = ("char", "bpe")

# pieces for BPE: a run of letters, of digits or of other marks, each with at most one
# leading space, or a run of whitespace. Merges never cross a piece, so a token is a
# literal piece of text (no byte-level remapping, no subword prefix).
_PIECES = r" ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


class AbstractTokenizer(abc.ABC):
    """Text to token ids and back; `itos[i]` is the text of token `i`."""

    kind: str
    itos: tuple[str, ...]

    @property
    def vocab_size(self) -> int:
        """The number of tokens."""
        return len(self.itos)

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, an int64 array of shape `[tokens]`."""

    def decode(self, ids: Iterable[int] | np.ndarray) -> str:
        """The text of a 1-D sequence of token ids."""
        return decode_ids(ids, self.itos)

    @abc.abstractmethod
    def to_json(self) -> dict:
        """A JSON-ready description from which `tokenizer_from_json` rebuilds it."""


class CharTokenizer(AbstractTokenizer):
    """One token per character; the vocabulary is a sorted set of characters."""

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        self.itos = tuple(sorted(set(chars)))
        if not self.itos or any(len(c) != 1 for c in self.itos):
            raise ValueError("`chars` must be a non-empty collection of single characters.")
        self._codes = np.array([ord(c) for c in self.itos], np.uint32)

    def encode(self, text: str) -> np.ndarray:
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
        ids = np.searchsorted(self._codes, codes)
        bad = (ids >= len(self._codes)) | (self._codes[np.minimum(ids, len(self._codes) - 1)]
                                          != codes)  # fmt: skip
        if bad.any():
            missing = "".join(sorted({chr(c) for c in codes[bad]}))
            raise ValueError(f"`text` has characters outside the vocabulary: {missing!r}.")
        return ids.astype(np.int64)

    def to_json(self) -> dict:
        return {"kind": "char", "itos": list(self.itos)}


#: What needs Hugging Face `tokenizers`, by use (the start of the error when it is missing).
_NEEDS = {
    "bpe": '`tokenizer = "bpe"` trains a byte-pair tokenizer with',
    "hf": '`tokenizer = "hf:DIR"` reads the directory\'s tokenizer.json with',
    "json": "this checkpoint's byte-pair tokenizer is read with",
}


def _tokenizers(need: str = "bpe"):
    """The `tokenizers` module; a `ModuleNotFoundError` (`name` "tokenizers") saying what
    `need`s it and how to install it when it is not installed (`itde`'s command line
    prints that as its one line)."""
    try:
        import tokenizers
    except ImportError:
        fix = ', or use `tokenizer = "char"`' if need == "bpe" else ""
        raise ModuleNotFoundError(
            f"{_NEEDS[need]} Hugging Face `tokenizers`, which is not installed: "
            f"`pip install 'itde[text]'` (or `pip install tokenizers`){fix}.",
            name="tokenizers",
        ) from None
    return tokenizers


class BPETokenizer(AbstractTokenizer):
    """Byte-pair merges of characters, trained with Hugging Face `tokenizers` (BPE model,
    no normaliser, text split into pieces of letters, digits, marks or whitespace with at
    most one leading space; merges stay inside a piece). Every character of the corpus is
    a token of its own (the initial alphabet), so any text of those characters encodes."""

    kind = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        vocab = tokenizer.get_vocab()
        itos = [""] * len(vocab)
        for s, i in vocab.items():
            itos[i] = s
        self.itos = tuple(itos)
        self._lengths = np.array([len(t) for t in self.itos], np.int64)

    @classmethod
    def train(cls, texts: Iterator[str], *, vocab_size: int, alphabet: Iterable[str]):
        """Train on the strings of `texts` (e.g. chunks of the training split) up to
        `vocab_size` tokens, the characters of `alphabet` included."""
        tk = _tokenizers()
        alphabet = sorted(set(alphabet))
        if vocab_size < len(alphabet):
            raise ValueError(
                f"`vocab_size`={vocab_size} is smaller than the text's {len(alphabet)} distinct "
                f"characters (each is a token of its own); use vocab_size >= {len(alphabet)}."
            )
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.Split(tk.Regex(_PIECES), behavior="isolated")
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
            show_progress=False, special_tokens=[],
        )  # fmt: skip
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def encode(self, text: str) -> np.ndarray:
        if not text:
            return np.zeros((0,), np.int64)
        lines = text.splitlines(keepends=True)
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        out = np.concatenate([np.asarray(e.ids, np.int64) for e in batch(lines)])
        if int(self._lengths[out].sum()) != len(text):  # BPE drops an unknown character
            missing = "".join(sorted(set(text) - set("".join(t for t in self.itos if len(t) == 1))))
            raise ValueError(f"`text` has characters outside the vocabulary: {missing!r}.")
        return out

    def to_json(self) -> dict:
        return {"kind": "bpe", "tokenizer": json.loads(self._tok.to_str())}


#: The prefix of a tokenizer name that reads a Hugging Face directory's `tokenizer.json`.
HF_TOKENIZER = "hf:"


class HFTokenizer(AbstractTokenizer):
    """A Hugging Face tokenizer as saved in a model's directory (`tokenizer.json`, the
    `tokenizers` library's format; e.g. GPT-2's byte-level BPE), used as it is: the token
    ids are the model's. No special tokens are added. Text is encoded line by line (as
    the corpus is cut at line ends), so a merge never spans a line end; `decode` is the
    tokenizer's own (for a byte-level vocabulary `itos[i]`, the text of token `i` alone,
    may show a replacement character where a token holds part of a multi-byte
    character)."""

    kind = "hf"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._itos: tuple[str, ...] | None = None

    @staticmethod
    def file(path, name: str = "tokenizer"):
        """The `tokenizer.json` of the Hugging Face directory `path`, checked to exist
        without reading it (`name`: the argument named in an error)."""
        import pathlib

        path = pathlib.Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ValueError(
                f"`{name}`='{HF_TOKENIZER}{path}': {str(file)!r} does not exist, so the model's "
                "token ids cannot be reproduced. Save its fast tokenizer there (`AutoTokenizer."
                "from_pretrained(...).save_pretrained(DIR)` or `tokenizers.Tokenizer.save("
                "DIR + '/tokenizer.json')`), or point it at a directory that holds one."
            )
        return file

    @classmethod
    def from_dir(cls, path, name: str = "tokenizer") -> HFTokenizer:
        """The `tokenizer.json` of the Hugging Face directory `path` (`name`: the argument
        named in an error)."""
        return cls(_tokenizers("hf").Tokenizer.from_file(str(cls.file(path, name))))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def itos(self) -> tuple[str, ...]:  # type: ignore[override]
        if self._itos is None:
            self._itos = tuple(self._tok.decode([i], skip_special_tokens=False)
                               for i in range(self.vocab_size))  # fmt: skip
        return self._itos

    def encode(self, text: str) -> np.ndarray:
        if not text:
            return np.zeros((0,), np.int64)
        lines = text.splitlines(keepends=True)
        enc = self._tok.encode_batch(lines, add_special_tokens=False)
        return np.concatenate([np.asarray(e.ids, np.int64) for e in enc])

    def decode(self, ids) -> str:
        return self._tok.decode(np.asarray(ids).tolist(), skip_special_tokens=False)

    def to_json(self) -> dict:
        return {"kind": "hf", "tokenizer": json.loads(self._tok.to_str())}


def tokenizer_from_json(spec: dict) -> AbstractTokenizer:
    """The tokenizer of `AbstractTokenizer.to_json()`'s output."""
    kind = spec.get("kind") if isinstance(spec, dict) else None
    if kind == "char":
        return CharTokenizer(spec["itos"])
    if kind in ("bpe", "hf"):
        tk = _tokenizers("json")
        tok = tk.Tokenizer.from_str(json.dumps(spec["tokenizer"]))
        return BPETokenizer(tok) if kind == "bpe" else HFTokenizer(tok)
    raise ValueError(f"not a tokenizer description (kind {kind!r}; expected one of "
                     f"{(*TOKENIZER_KINDS, 'hf')}).")  # fmt: skip
