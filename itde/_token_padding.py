r"""Eager entry points at many token counts: pad to a bucket, run one program, cut back.

An eager call at $N$ tokens ([`itde.solve`][itde.solve], a
[`TransformerIDE`][itde.TransformerIDE]'s `__call__`, `batch` and `trajectory`) runs
through [`itde.programs`][itde.programs] in one of two ways:

- **padded** (where the discretisation allows it): the state is padded to the bucket
  $B \ge N$ of the bucket policy ([`PowerOfTwoBuckets`][itde.PowerOfTwoBuckets] by
  default) with copies of its last token, the key mask gets `False` on the padded tokens,
  and the model's token domain becomes its $N$-node rule as data on $B$ nodes
  ([`PaddedTokens`][itde.PaddedTokens]: padded nodes of weight zero). No real token reads
  a padded one (masked keys, zero weights; a causal rule reads no later node), and every
  other operator acts token by token, so the first $N$ rows are the $N$-token solve to
  round-off. One program serves every $N$ of a bucket.
- **exact** (everywhere else): the solve at $N$ itself, one program per $N$, held in the
  same bounded cache (so a long session's memory stays bounded either way).

The state is padded and the result cut on the host (NumPy), so no operation on an
$N$-shaped array compiles a program of its own; on an accelerator that moves the state and
the saved solution through host memory once per call (jit the caller to keep them on the
device: under a trace nothing is padded, and the solve is part of the caller's program).

What decides it, structurally (by what the objects are, never by comparing numbers):

- a traced argument (inside `jax.jit`, `grad`, `vmap`): the caller's program fixes the
  shapes; the solve is inlined there, unpadded.
- `buckets=None`: asked for (exact).
- a token domain without a padded form ([`padded`][itde.AbstractQuadrature.padded] is
  None: `TensorGrid2D`, ViT's patch domain): a fixed token count (exact).
- a sliding window: its band is static token indices, planned per $N$ (exact).
- a `DiscreteBias`: one token count only (exact).
- causal `Simpson` below 4 nodes: Gregory's row 1 is another rule there (exact).
- `terms=` a `SplitTerm`: the user's sub-flows may not know the mask (exact).
- an adaptive step-size controller: its error norm would count the padded tokens (exact).
- `SaveAt(dense=True)`, `solver_state`, `controller_state` or an `fn`: they would hold or
  reduce the padded tokens (exact).
- `args` that is not a key mask (`[tokens]` or `[batch, tokens]`, boolean or 0/1): not a
  mask to extend (exact; the solve's own checks say what is wrong).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from ._buckets import AbstractTokenBuckets
from ._host import to_device
from ._programs import programs


def has_tracer(*trees) -> bool:
    """Whether any leaf of `trees` is a tracer (the call is part of a caller's trace)."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees))


def pad_rows(u, n_padded: int, axis: int):
    """`u` padded along `axis` to `n_padded` with copies of its last entry there (on the
    host): padded tokens that are copies of a real one stay finite wherever it does."""
    x = np.asarray(u)
    axis = axis % x.ndim
    n = x.shape[axis]
    last = np.take(x, [n - 1], axis=axis)
    reps = [1] * x.ndim
    reps[axis] = n_padded - n
    return to_device(np.concatenate([x, np.tile(last, reps)], axis=axis), like=u)


def take_rows(x, n: int, axis: int):
    """The first `n` entries of `x` along `axis` (on the host)."""
    index = [slice(None)] * np.ndim(x)
    index[axis] = slice(0, n)
    return to_device(np.asarray(x)[tuple(index)], like=x)


def host_mask(mask, shape: tuple[int, ...]) -> np.ndarray | None:
    """A concrete key mask as host booleans of `shape` (`[tokens]` or `[batch, tokens]`),
    or None where `mask` is not one: a wrong shape or dtype, or integers other than 0/1
    (left to the exact path, whose checks say what is wrong)."""
    if type(mask).__module__.startswith("torch") or not hasattr(mask, "shape"):
        return None
    host = np.asarray(mask)
    if host.shape != shape:
        return None
    if host.dtype == np.bool_:
        return host
    if not np.issubdtype(host.dtype, np.integer) or not np.all((host == 0) | (host == 1)):
        return None
    return host != 0


def run_on_tokens(
    fn: Callable,
    model,
    u,
    mask,
    *rest,
    axis: int,
    batch: int | None,
    buckets: AbstractTokenBuckets | None,
    cut: Callable,
    pad: bool = True,
):
    """`fn(model, u, mask, *rest)` through [`itde.programs`][itde.programs], padded to
    `buckets` where the model allows it (see the module's notes).

    **Arguments:**

    - `fn`: a function of the model, the state, the key mask (or None) and `rest`; it is
      the program's key, so a module-level function (a fresh closure per call compiles per
      call).
    - `model`: the equation; `model.padded_tokens(n, n_padded)` gives the padded one.
    - `u`: the concrete state, `N` tokens along `axis`.
    - `mask`: a key mask `[N]` (`[batch, N]` with `batch`), or None.
    - `batch`: the batch size of a batched state (the mask then has a batch axis).
    - `buckets`: the bucket policy, or None for the exact path.
    - `cut`: `cut(out, n)`: `fn`'s output with its token axes cut to the first `n` entries
      (use [`take_rows`][]).
    - `pad`: False where the caller's own options rule padding out (the exact path).

    **Returns:** `fn`'s output at the `N` real tokens.
    """
    n = int(np.shape(u)[axis])
    padded = None
    if pad and buckets is not None:
        shape = (n,) if batch is None else (batch, n)
        host = np.ones(shape, bool) if mask is None else host_mask(mask, shape)
        if host is not None:
            n_padded = buckets.size(n)
            padded = model.padded_tokens(n, n_padded)
    if padded is None:
        return programs(fn, model, u, mask, *rest)
    pad_width = [(0, 0)] * (host.ndim - 1) + [(0, n_padded - n)]
    mask_p = to_device(np.pad(host, pad_width, constant_values=False))
    out = programs(fn, padded, pad_rows(u, n_padded, axis), mask_p, *rest)
    return cut(out, n)


def cut_leaves(out, n: int, axis: int):
    """Every array leaf of `out` cut to its first `n` entries along `axis`."""
    return jax.tree.map(lambda x: take_rows(x, n, axis) if isinstance(x, jax.Array) else x, out)


__all__ = ["cut_leaves", "has_tracer", "host_mask", "pad_rows", "run_on_tokens", "take_rows"]
