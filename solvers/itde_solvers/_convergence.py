"""Convergence helpers: error norms and the observed order of a step-size study."""

from __future__ import annotations

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np


def error_norm(a, b, kind: str = "max"):
    r"""The distance between a computed PyTree `a` and a reference PyTree `b`.

    - `kind="max"`: the max-abs error $\max_j |a_j - b_j|$ over every leaf.
    - `kind="rel_l2"`: the relative $\ell^2$ error $\|a - b\|_2 / \|b\|_2$ over all leaves
      together (the reference `b` sets the scale; a zero reference gives inf or nan).

    **Arguments:**

    - `a`, `b`: PyTrees of arrays with the same structure and shapes.
    - `kind`: `"max"` or `"rel_l2"`.

    **Returns:** a scalar JAX array.
    """
    diffs = jtu.tree_leaves(jtu.tree_map(lambda x, y: jnp.ravel(x - y), a, b))
    refs = jtu.tree_leaves(jtu.tree_map(jnp.ravel, b))
    if not diffs:
        raise ValueError("`error_norm` got empty PyTrees; there is nothing to compare.")
    diff = jnp.concatenate(diffs)
    if kind == "max":
        return jnp.max(jnp.abs(diff))
    if kind == "rel_l2":
        return jnp.linalg.norm(diff) / jnp.linalg.norm(jnp.concatenate(refs))
    raise ValueError(f"`error_norm(kind=...)` must be 'max' or 'rel_l2', got {kind!r}.")


def observed_order(steps, errors, *, asymptotic: int | None = None, floor: float | None = None):
    r"""The observed order of convergence: the least-squares slope of $\log e$ on $\log h$.

    For a method of order $p$, $e(h) \approx C h^p$ in the asymptotic range, so the slope
    of $\log e$ against $\log h$ is $p$. Points outside that range are dropped by two
    rules, applied in this order:

    1. **Round-off:** errors below `floor` (or not finite, or not positive) are dropped.
       The default floor is $100\,\varepsilon$ of the errors' dtype (about $2\cdot10^{-14}$
       in float64); pass a larger one when the solution is large or the step count high.
    2. **Asymptotic range:** of the remaining points, only the `asymptotic` smallest
       steps are kept (default: all). Use it to leave out coarse, pre-asymptotic steps.

    **Arguments:**

    - `steps`: the step sizes $h$ (positive; any order).
    - `errors`: the errors at those step sizes, same length.
    - `asymptotic`: how many of the smallest retained steps to fit (at least 2), or None.
    - `floor`: the round-off floor; None for $100\,\varepsilon$.

    **Returns:** the slope, a Python float. Raises `ValueError` when fewer than two
    points are left.
    """
    h = np.asarray(steps, dtype=np.float64).ravel()
    e_in = np.asarray(errors)
    e = e_in.astype(np.float64).ravel()
    if h.shape != e.shape:
        raise ValueError(
            f"`observed_order`: `steps` has {h.size} entries but `errors` has {e.size}."
        )
    if np.any(~(h > 0)):
        raise ValueError(f"`observed_order`: every step must be positive, got {h}.")
    if floor is None:
        dtype = e_in.dtype if np.issubdtype(e_in.dtype, np.floating) else np.float64
        floor = 100 * float(np.finfo(dtype).eps)
    keep = np.isfinite(e) & (e > floor)
    h, e = h[keep], e[keep]
    order = np.argsort(h)
    h, e = h[order], e[order]
    if asymptotic is not None:
        if asymptotic < 2:
            raise ValueError(f"`observed_order(asymptotic=...)` must be >= 2, got {asymptotic}.")
        h, e = h[:asymptotic], e[:asymptotic]
    if h.size < 2:
        raise ValueError(
            "`observed_order` needs at least two points above the round-off floor "
            f"{floor:.3g}; {h.size} left. Use coarser steps or a lower `floor`."
        )
    slope, _ = np.polyfit(np.log(h), np.log(e), 1)
    return float(slope)


__all__ = ["error_norm", "observed_order"]
