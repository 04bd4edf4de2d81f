r"""What the equation asks of an attention or a feed-forward operator: its discrete form
on a grid.

Discrete operators ([`Attention`][itde.Attention], [`FeedForward`][itde.FeedForward])
hold kernels sampled at a grid's nodes and are their own discrete form. Function-space
operators ([`FunctionAttention`][itde.FunctionAttention],
[`FunctionFeedForward`][itde.FunctionFeedForward]) hold kernel functions and sample them
on the grid they are given. The equation calls `discretise` and never asks which.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import equinox as eqx
import numpy as np

if TYPE_CHECKING:
    from .._quadrature._rules import Grid
    from ._attention import Attention
    from ._feedforward import FeedForward


class AbstractAttention(eqx.Module):
    r"""An attention operator $A(u)$ that has a discrete form on any admissible grid."""

    @abc.abstractmethod
    def discretise(self, grid: Grid) -> tuple[Attention, np.ndarray | None]:
        """The discrete attention on `grid`'s feature nodes, and the quadrature weights
        of its head domain $\\Omega_h$ to apply it with (`head_weights`), or `None` when
        every head weight is 1 (the discrete Transformer's heads).

        A discrete `Attention` returns `(self, None)`."""


class AbstractFeedForward(eqx.Module):
    r"""A feed-forward operator $F(u)$ that has a discrete form on any admissible grid."""

    @abc.abstractmethod
    def discretise(self, grid: Grid) -> tuple[FeedForward, np.ndarray | None]:
        """The discrete feed-forward on `grid`'s feature nodes, and the quadrature weights
        of its hidden domain $\\Omega_z$ to apply it with (`hidden_weights`), or `None`
        when every hidden weight is 1.

        A discrete `FeedForward` returns `(self, None)`."""
