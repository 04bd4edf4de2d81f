"""The `charlm` task: character-level language modelling on a local UTF-8 text file."""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import pathlib
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray

from ._tokenizers import decode_ids

_SPLITS = ("train", "val")


def builtin_text_path() -> pathlib.Path:
    """Path of `tiny.txt`, a short English essay (~4 KB, written for this project and in the
    public domain) shipped inside the package, so tests and default configs need no file.

    **Returns:**

    A `pathlib.Path` to a UTF-8 file.
    """
    return pathlib.Path(str(importlib.resources.files("itde.data").joinpath("tiny.txt")))


def _decode_utf8(raw: bytes, path: pathlib.Path) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start : e.start + 1].hex()
        raise ValueError(
            f"{str(path)!r} is not valid UTF-8: byte 0x{bad} at byte offset {e.start} "
            f"({e.reason}). Re-encode the file as UTF-8, e.g. "
            f"`iconv -f latin1 -t utf-8 in.txt > out.txt`."
        ) from None
    return text.removeprefix("\ufeff")  # a byte-order mark is not text


@dataclasses.dataclass(frozen=True, eq=False)
class CharCorpus:
    """A text encoded character by character, split by position into train and validation.

    The vocabulary is the sorted set of characters of the whole text (so validation text is
    always encodable); token $i$ is `itos[i]`. The last `val_fraction` of the characters is
    the validation split, the rest the training split. Build one with
    [`CharCorpus.from_file`][] or [`CharCorpus.from_text`][].

    **Fields:**

    - `itos`: the characters, sorted; `vocab_size = len(itos)`.
    - `train`, `val`: the encoded splits, int32 arrays of shape `[chars]`.
    - `source`: where the text came from (a path, or `"<text>"`).
    """

    itos: tuple[str, ...]
    train: Int[Array, " train_chars"]
    val: Int[Array, " val_chars"]
    source: str = "<text>"

    @classmethod
    def from_text(cls, text: str, *, val_fraction: float = 0.1, source: str = "<text>"):
        """Encode `text` and split it; see [`CharCorpus.from_file`][].

        **Arguments:**

        - `text`: the corpus, a non-empty string.
        - `val_fraction`: the fraction in $[0, 1)$ of characters, taken from the end, kept
          for validation; the count is rounded down.
        - `source`: a name for error messages.

        **Returns:**

        A `CharCorpus`.
        """
        if not isinstance(text, str):
            raise TypeError(f"`text` must be a str, got {type(text).__name__}.")
        if not text:
            raise ValueError(f"{source!r} is empty: a character corpus needs some text.")
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)):
            raise ValueError(f"`val_fraction` must be a number in [0, 1), got {val_fraction!r}.")
        if not (math.isfinite(val_fraction) and 0 <= val_fraction < 1):
            raise ValueError(f"`val_fraction` must be in [0, 1), got {val_fraction!r}.")
        itos = tuple(sorted(set(text)))
        stoi = {c: i for i, c in enumerate(itos)}
        ids = np.fromiter((stoi[c] for c in text), dtype=np.int32, count=len(text))
        n_train = len(ids) - int(len(ids) * val_fraction)
        return cls(itos, jnp.asarray(ids[:n_train]), jnp.asarray(ids[n_train:]), source)

    @classmethod
    def from_file(cls, path: str | pathlib.Path, *, val_fraction: float = 0.1):
        """Read a UTF-8 text file, build its sorted character vocabulary and split it.

        A leading byte-order mark is dropped. Nothing is downloaded.

        **Arguments:**

        - `path`: a local UTF-8 text file; [`builtin_text_path`][] gives a shipped one.
        - `val_fraction`: the fraction in $[0, 1)$ of characters, taken from the end, kept
          for validation.

        **Returns:**

        A `CharCorpus`.

        **Raises:**

        `FileNotFoundError` if `path` is not a file; `ValueError` if it is empty, is not
        valid UTF-8 (the message gives the byte offset), or `val_fraction` is out of range.
        """
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"No text file at {str(path)!r} (resolved: {str(path.resolve())!r}). Give the "
                "path of a local UTF-8 file, or use `itde.data.builtin_text_path()`."
            )
        raw = path.read_bytes()
        if not raw:
            raise ValueError(
                f"{str(path)!r} is empty: a character corpus needs some text. Point `path` at a "
                "non-empty UTF-8 file, or use `itde.data.builtin_text_path()`."
            )
        text = _decode_utf8(raw, path)
        return cls.from_text(text, val_fraction=val_fraction, source=str(path))

    @property
    def vocab_size(self) -> int:
        """Number of distinct characters."""
        return len(self.itos)

    @property
    def stoi(self) -> dict[str, int]:
        """Character to token id."""
        return {c: i for i, c in enumerate(self.itos)}

    def encode(self, text: str) -> Int[Array, " chars"]:
        """Token ids of `text`, int32 of shape `[len(text)]`; raises `ValueError` on a
        character outside the vocabulary."""
        stoi = self.stoi
        missing = sorted(set(text) - stoi.keys())
        if missing:
            raise ValueError(
                f"`text` has characters outside the vocabulary of {self.source!r}: "
                f"{''.join(missing)!r}."
            )
        return jnp.asarray(np.fromiter((stoi[c] for c in text), np.int32, count=len(text)))

    def decode(self, ids: Iterable[int] | Int[Array, " chars"]) -> str:
        """The text of a 1-D sequence of token ids; raises `ValueError` on an id outside
        `[0, vocab_size)`."""
        return decode_ids(ids, self.itos)

    def batch(
        self, key: PRNGKeyArray, split: str, batch: int, context: int
    ) -> tuple[Int[Array, "batch context"], Int[Array, "batch context"]]:
        """Random windows of the chosen split, for next-character prediction.

        Each row starts at a uniformly random position $s$ with $s + \\text{context} <$
        `len(split)`; `x = data[s : s + context]` and `y = data[s + 1 : s + context + 1]`.
        Deterministic in `key`.

        **Arguments:**

        - `key`: a `jax.random` key.
        - `split`: `"train"` or `"val"`.
        - `batch`: number of windows, a positive integer.
        - `context`: window length, a positive integer at most `len(split) - 1`.

        **Returns:**

        `(x, y)`, int32 of shape `[batch, context]`, `y` being `x` shifted left by one.
        """
        if split not in _SPLITS:
            raise ValueError(f"`split` must be 'train' or 'val', got {split!r}.")
        for name, value in (("batch", batch), ("context", context)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}.")
        data = self.train if split == "train" else self.val
        if data.shape[0] < context + 1:
            raise ValueError(
                f"The {split!r} split of {self.source!r} has {data.shape[0]} characters, too "
                f"short for context={context} (needs at least context + 1 = {context + 1}). "
                "Use a smaller `context`, a longer text, or a different `val_fraction`."
            )
        return _windows(data, key, int(batch), int(context))


@jax.jit(static_argnames=("batch", "context"))
def _windows(data, key, batch: int, context: int):
    starts = jax.random.randint(key, (batch, 1), 0, data.shape[0] - context)
    w = data[starts + jnp.arange(context + 1)]
    return w[:, :-1], w[:, 1:]
