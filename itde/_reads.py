r"""Where the paper's scheme reads each part of a layer's controls: the knots of a fit
through a network's layers.

With one Lie step per layer ($\Delta t = h$), the step of layer $n$ from $t_n$ to
$t_{n+1}$ reads the vector-field parts (attention, feed-forward, every part that is not
a projection) at its start $t_n$, as `controls(t_n, "right", part)`, and the block
form's projections (`projected_parts`: post-norm's `norm1`, `norm2`) at its end
$t_{n+1}$, as `controls(t_{n+1}, "left", part)`. A smooth fit that takes each part's
layer values at those depths is read by the scheme exactly as the network is.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ._blocks import AbstractBlockForm


def part_names(blocks) -> tuple[str, ...]:
    """The parts of a block (its dataclass fields that hold operators, not static options
    and not an absent optional part)."""
    return tuple(
        f.name
        for f in dataclasses.fields(blocks)
        if not f.metadata.get("static", False) and getattr(blocks, f.name) is not None
    )


def map_parts(blocks, fn):
    """The block with every part `p` replaced by `fn(name, p)`."""
    return dataclasses.replace(blocks, **{n: fn(n, getattr(blocks, n)) for n in part_names(blocks)})


def reads_at_end(block: AbstractBlockForm, part: str) -> bool:
    """Whether the scheme reads `part` at the end of a step (a projection) rather than at
    its start."""
    return part in block.projected_parts


def read_side(block: AbstractBlockForm, part: str) -> str:
    """The side of `controls(t, side, part)` at which the scheme reads `part`."""
    return "left" if reads_at_end(block, part) else "right"


def read_times(t0: float, layer_length: float, n_layers: int, at_end: bool) -> np.ndarray:
    r"""The depths at which layers $0, \dots, L-1$ of a part are read (float64): the
    starts $t_n$ or, for a projection (`at_end`), the ends $t_{n+1}$."""
    return t0 + layer_length * (np.arange(n_layers, dtype=np.float64) + float(at_end))
