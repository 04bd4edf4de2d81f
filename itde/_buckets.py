r"""Token buckets: the padded lengths that eager solves at many token counts share.

An eager [`itde.solve`][itde.solve] at $N$ tokens pads the state to the bucket $B(N) \ge N$
and runs the one program compiled for $B$ (see [`itde.programs`][itde.programs]): a session
over $N = 1, \dots, N_\max$ compiles one program per bucket, not one per $N$. A bucket
policy is a module, passed as `solve(..., buckets=...)`.

- [`PowerOfTwoBuckets(smallest)`][itde.PowerOfTwoBuckets] (the default, `smallest=8`):
  `smallest` and its doublings; $\log_2(N_\max/\text{smallest}) + 1$ programs up to
  $N_\max$; a padded solve does less than twice the real tokens' work (four times
  attention's).
- [`BlockBuckets(block)`][itde.BlockBuckets]: the multiples of `block`;
  $N_\max / \text{block}$ programs; fewer than `block` extra tokens.
"""

from __future__ import annotations

import abc

import equinox as eqx

from ._checks import check_int


class AbstractTokenBuckets(eqx.Module):
    """A bucket policy: the padded length `size(n)` >= `n` of a solve at `n` tokens."""

    @abc.abstractmethod
    def size(self, n_tokens: int) -> int:
        """The bucket of `n_tokens` tokens: a length >= `n_tokens`."""


class PowerOfTwoBuckets(AbstractTokenBuckets):
    r"""Buckets at `smallest` and its doublings: $B(N) = \text{smallest} \cdot
    2^{\lceil \log_2(N / \text{smallest}) \rceil}$ (at least `smallest`). A session up
    to $N_\max$ tokens compiles $O(\log N_\max)$ programs; a padded solve does less than
    twice the real tokens' work (four times attention's, quadratic in the tokens).

    **Arguments:** `smallest`: the first bucket (default 8), an integer >= 1."""

    smallest: int = eqx.field(static=True, default=8)

    def __check_init__(self):
        check_int("smallest", self.smallest, minimum=1)

    def size(self, n_tokens: int) -> int:
        b = self.smallest
        while b < n_tokens:  # integers: exact
            b *= 2
        return b


class BlockBuckets(AbstractTokenBuckets):
    r"""Buckets at the multiples of `block`: $B(N) = \text{block} \cdot \lceil N /
    \text{block} \rceil$. Less padded work than powers of two for long sequences, more
    programs ($N_\max / \text{block}$).

    **Arguments:** `block`: the bucket width, an integer >= 1."""

    block: int = eqx.field(static=True, default=64)

    def __check_init__(self):
        check_int("block", self.block, minimum=1)

    def size(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block) * self.block


def check_buckets(buckets) -> AbstractTokenBuckets | None:
    """`buckets` must be a bucket policy or None (no padding)."""
    if buckets is None or isinstance(buckets, AbstractTokenBuckets):
        return buckets
    raise TypeError(
        f"`buckets`={buckets!r} must be an itde bucket policy, e.g. "
        "itde.PowerOfTwoBuckets() (the default) or itde.BlockBuckets(64), or None to solve "
        "at the exact token count (one compiled program per count)."
    )


__all__ = ["AbstractTokenBuckets", "BlockBuckets", "PowerOfTwoBuckets", "check_buckets"]
