"""Offline data for training: tasks generated here or read from a local file.

- `sort`: [`SortTask`][], sequences of digits to sort.
- `burgers`: [`BurgersTask`][], the solution operator of periodic viscous Burgers, with the
  pseudo-spectral solver [`burgers_solve`][] and the error [`relative_l2`][].
- `charlm`: [`CharCorpus`][], character-level language modelling on a UTF-8 file;
  [`builtin_text_path`][] is a small text shipped with the package.

Nothing here downloads anything.
"""

from ._burgers import BurgersTask, burgers_solve, relative_l2
from ._sort import SortTask
from ._text import CharCorpus, builtin_text_path

__all__ = [
    "BurgersTask",
    "CharCorpus",
    "SortTask",
    "builtin_text_path",
    "burgers_solve",
    "relative_l2",
]
