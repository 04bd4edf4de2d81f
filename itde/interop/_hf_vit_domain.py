r"""Images as a two-dimensional token domain: a class token beside a grid of patches, the
token weights of that domain, and the learned position table read as a function on it.

A ViT's patch tokens are the nodes of a tensor-product midpoint rule on the image domain
(cell centres of the patch grid, raster order: rows along $x_1$, columns along $x_2$
fastest, as `Conv2d(...).flatten(2)` orders them); its class token is one more token with
no place in the image, a point mass beside the domain. Attention integrates over both:
$$A(u)(x) = \frac{c\,e^{s(x, \mathrm{cls})} V(\mathrm{cls}) + \int_\Omega e^{s(x,\xi)} V(\xi)\,d\xi}
{c\,e^{s(x, \mathrm{cls})} + \int_\Omega e^{s(x,\xi)}\,d\xi},$$
discretised as $\sum_p w_p\,\cdot$ with $w_p$ the patch weights and $w_\mathrm{cls} = c$.

The learned position table's patch rows are samples $p(x_{ij})$ of a function on the
square at the centres of the native patch grid; an interpolant
([`AbstractPositionInterpolant`][itde.interop.AbstractPositionInterpolant]) extends them
to the whole square, and another patch grid samples it at its own centres.
"""

from __future__ import annotations

import abc
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from .._quadrature._domain import AbstractTokenDomain
from .._quadrature._grid2d import TensorGrid2D
from .._quadrature._rules import Midpoint


class ClassTokenGrid2D(AbstractTokenDomain):
    r"""A class token beside a 2-D patch grid: $1 + n_1 n_2$ tokens, the class token first.

    The class token's node is `nan` (it has no place in the image); its weight is
    `class_weight`. The patch tokens are the nodes and product weights of `patches`.

    **Arguments:**

    - `patches`: the patch grid ([`TensorGrid2D`][itde.TensorGrid2D]) on the image domain.
    - `class_weight`: the class token's quadrature weight $c > 0$.
    """

    patches: TensorGrid2D
    class_weight: float = eqx.field(static=True)

    def __check_init__(self):
        if not isinstance(self.patches, TensorGrid2D):
            raise TypeError(
                f"`patches` must be an itde.TensorGrid2D, got {type(self.patches).__name__}."
            )
        c = self.class_weight
        if (
            isinstance(c, bool)
            or not isinstance(c, (int, float))
            or not (math.isfinite(c) and c > 0)
        ):
            raise ValueError(f"`class_weight`={c!r} must be a finite positive number.")

    @property
    def n_tokens(self) -> int:
        return 1 + self.patches.n_tokens

    @property
    def shape(self) -> tuple[int, int]:
        """The patch grid $(n_1, n_2)$."""
        return self.patches.shape

    def nodes_weights(self, n_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Nodes `[1 + n1 n2, 2]` (the class token's `nan`) and weights `[1 + n1 n2]`."""
        if n_tokens is not None and n_tokens != self.n_tokens:
            n1, n2 = self.shape
            raise ValueError(
                f"the state has {n_tokens} tokens but the image domain holds 1 + {n1} x {n2} = "
                f"{self.n_tokens} (the class token and the patches); the image's patch grid "
                "and the domain's differ."
            )
        x, w = self.patches.nodes_weights()
        nodes = np.concatenate([np.full((1, 2), np.nan), x])
        return nodes, np.concatenate([[float(self.class_weight)], w])


# ------------------------------------------------------------------ token weights
class AbstractImageTokenWeights(eqx.Module):
    """How much each token of an image weighs in attention's quadrature, at any patch grid.

    At the native grid every choice gives every token the same weight (so the converted
    model is the network); they differ at another grid."""

    @abc.abstractmethod
    def domain(self, grid: tuple[int, int], native: tuple[int, int]) -> ClassTokenGrid2D:
        """The token domain of a `grid` $(n_1, n_2)$ of patches, for a model whose position
        table holds the `native` grid $(N_1, N_2)$."""


class UnitTokenWeights(AbstractImageTokenWeights):
    r"""Every token weighs 1, at every grid: Hugging Face's ViT (a sum over tokens).

    As a quadrature: the midpoint rule with unit spacing on $[0, n_1] \times [0, n_2]$,
    the image domain measured in patches, which grows with the grid: a larger image is
    read as showing more, every patch keeping its weight, the class token as much as one
    patch."""

    def domain(self, grid, native):
        n1, n2 = grid
        return ClassTokenGrid2D(TensorGrid2D(Midpoint(), Midpoint(), n1, n2), 1.0)


class AreaTokenWeights(AbstractImageTokenWeights):
    r"""Each patch weighs its area on the unit square, $1/(n_1 n_2)$; the class token a fixed
    mass: a quadrature of one image domain $\Omega = [0, 1]^2$ at every grid.

    A larger image is read as the same square sampled finer: $\sum_p w_p\,g(x_p) \to
    \int_\Omega g$ as the grid refines (midpoint rule, second order for smooth $g$), and the
    class token keeps its share of the attention mass instead of losing it to more and more
    patches.

    **Arguments:**

    - `class_weight`: the class token's mass $c$; `None` (default): the area of one native
      patch, $1/(N_1 N_2)$, so that at the native grid every token weighs the same (the
      network).
    """

    class_weight: float | None = eqx.field(static=True, default=None)

    def domain(self, grid, native):
        n1, n2 = grid
        unit = Midpoint(interval=(0.0, 1.0))
        c = self.class_weight
        if c is None:  # one native patch, computed as the grid computes its weights
            c = float(TensorGrid2D(unit, unit, *native).nodes_weights()[1][0])
        return ClassTokenGrid2D(TensorGrid2D(unit, unit, n1, n2), c)


# ------------------------------------------------------------------ position functions
def _inner(s, a):  # Keys' kernel on |s| <= 1, as a polynomial in s
    return ((a + 2.0) * s - (a + 3.0)) * s * s + 1.0


def _outer(s, a):  # Keys' kernel on 1 <= |s| <= 2, as a polynomial in s
    return ((a * s - 5.0 * a) * s + 8.0 * a) * s - 4.0 * a


def _stencil(t, a):
    """The four cubic-convolution weights of nodes i-1, i, i+1, i+2 at offset t from i."""
    return np.stack([_outer(t + 1.0, a), _inner(t, a), _inner(1.0 - t, a), _outer(2.0 - t, a)], -1)


class AbstractPositionInterpolant(eqx.Module):
    r"""How the position table's samples at the native patch centres extend to a function
    $p$ on the image domain, separable in the two axes: $p(x) = \sum_{ij} \phi_i(x_1)
    \psi_j(x_2)\,P_{ij}$.

    Coordinates are those of the unit square: the native grid's centres sit at
    $x_1 = (i + \tfrac12)/N_1$. A grid of $n$ patches samples $p$ at its own centres,
    $(k + \tfrac12)/n$; at the native grid every interpolant returns the table.
    """

    @abc.abstractmethod
    def weights(self, n: int, r: np.ndarray) -> np.ndarray:
        """`[len(r), n]`: the 1-D basis on `n` nodes at source coordinates `r` measured in
        node spacings from the first node (node `i` at `r = i`), float64."""

    def basis(self, n: int, x) -> np.ndarray:
        """`[len(x), n]`: the 1-D basis $\\phi_i(x)$ of `n` native nodes at points `x` of
        $[0, 1]$."""
        return self.weights(n, np.asarray(x, np.float64) * n - 0.5)

    def matrix(self, n_old: int, n_new: int) -> np.ndarray:
        """`[n_new, n_old]`: sampling at the `n_new` centres, computed as `torch`'s
        `interpolate(..., align_corners=False)` computes the source coordinate."""
        scale = n_old / n_new
        return self.weights(n_old, scale * (np.arange(n_new) + 0.5) - 0.5)

    def check(self, native: tuple[int, int], patch_size: tuple[int, int], grid) -> None:
        """Refuse a resampling this interpolant does not define (the default: none)."""


class HFBicubic(AbstractPositionInterpolant):
    r"""Hugging Face's `interpolate_pos_encoding`: PyTorch's bicubic interpolation
    (`align_corners=False`), exactly.

    It is a function on the square too: cubic convolution (Keys' kernel with $a = -0.75$)
    of the samples at the native centres, sampled at the new centres; beyond the outermost
    native centres (the border half patches) the indices are clamped to the edge, which
    repeats the edge samples. With $a \ne -\tfrac12$ the interpolant reproduces constants
    but not linear functions: first order in the native spacing (interior and border).

    Hugging Face's own limits are kept: it reads the table as a square $\sqrt{N}\times
    \sqrt{N}$ grid and divides the image by an integer `patch_size`, so a model with a
    non-square native grid or a pair `patch_size` is refused here (use
    [`KeysCubic`][itde.interop.KeysCubic], which resamples any grid).
    """

    def weights(self, n, r):
        r = np.asarray(r, np.float64)
        # torch: index = min(floor(r), n - 1), t = clamp(r - index, 0, 1), stencil clamped
        i = np.minimum(np.floor(r).astype(np.int64), n - 1)
        t = np.clip(r - i, 0.0, 1.0)
        w = np.zeros((r.shape[0], n))
        stencil = _stencil(t, -0.75)
        for j in range(4):
            np.add.at(w, (np.arange(r.shape[0]), np.clip(i - 1 + j, 0, n - 1)), stencil[:, j])
        return w

    def check(self, native, patch_size, grid):
        if native[0] != native[1]:
            raise ValueError(
                f"HFBicubic reproduces Hugging Face, which reads the position table as a "
                f"square grid; this model's native grid is {native[0]} x {native[1]} "
                "(config.image_size / config.patch_size). Use KeysCubic() to resample it."
            )
        if patch_size[0] != patch_size[1]:
            raise ValueError(
                f"HFBicubic reproduces Hugging Face, whose interpolation needs one integer "
                f"`config.patch_size`; this model's is {patch_size}. Use KeysCubic()."
            )


class KeysCubic(AbstractPositionInterpolant):
    r"""Keys' cubic convolution with $a = -\tfrac12$ and his third-order boundary rule: the
    function view of the position table.

    Interpolating (it returns the samples at the native centres), exact for quadratics and
    third order in the native spacing $h = 1/N$ for smooth $p$, up to the border: the
    ghost samples beyond each end are the quadratic extrapolation
    $P_{-1} = 3P_0 - 3P_1 + P_2$ (Keys 1981), and on the border half patches the edge
    interval's cubic is continued (not the samples repeated). Two native samples per axis
    give the linear interpolant (linear ghosts), one the constant.
    """

    def weights(self, n, r):
        r = np.asarray(r, np.float64)
        if n == 1:
            return np.ones((r.shape[0], 1))
        ghost = np.zeros((n + 2, n))  # the samples with one ghost node at each end
        ghost[1:-1] = np.eye(n)
        if n == 2:
            ghost[0, :2], ghost[-1, -2:] = [2.0, -1.0], [-1.0, 2.0]
        else:
            ghost[0, :3], ghost[-1, -3:] = [3.0, -3.0, 1.0], [1.0, -3.0, 3.0]
        i = np.clip(np.floor(r).astype(np.int64), 0, n - 2)  # the interval's cubic, continued
        stencil = _stencil(r - i, -0.5)
        w = np.zeros((r.shape[0], n + 2))
        for j in range(4):
            np.add.at(w, (np.arange(r.shape[0]), i + j), stencil[:, j])
        return w @ ghost


def resample(
    interpolant: AbstractPositionInterpolant,
    table: Float[Array, "n1 n2 features"],
    grid: tuple[int, int],
) -> Float[Array, "m1 m2 features"]:
    """The patch rows of a position table `[N1, N2, features]` sampled at the centres of a
    `grid` $(n_1, n_2)$, in the table's dtype."""
    (n1, n2), (m1, m2) = table.shape[:2], grid
    a = jnp.asarray(interpolant.matrix(n1, m1), table.dtype)
    b = jnp.asarray(interpolant.matrix(n2, m2), table.dtype)
    return jnp.einsum("ki,ijd,lj->kld", a, table, b)


def patch_overlaps(p_old: int, p_new: int) -> np.ndarray:
    """`[p_new, p_old]`: the share of each old pixel cell of a patch inside each new one
    (cells of the unit interval): a kernel constant on the old cells, integrated over the
    new ones."""
    a = np.arange(p_new + 1) / p_new
    b = np.arange(p_old + 1) / p_old
    lo = np.maximum(a[:-1, None], b[None, :-1])
    hi = np.minimum(a[1:, None], b[None, 1:])
    return np.clip(hi - lo, 0.0, None) * p_old


def check_pixels(x, n_channels: int, patch_size: tuple[int, int], dtype):
    """One image `[channels, height, width]` whose patches tile it, in `dtype`, or an error
    naming `pixel_values`."""
    if type(x).__module__.startswith("torch"):
        raise TypeError(
            "`pixel_values` is a torch tensor; convert it first: "
            "`jnp.asarray(pixel_values.numpy())`."
        )
    x = jnp.asarray(x)
    if x.ndim != 3:
        raise ValueError(
            f"`pixel_values` must be one image [channels, height, width], got shape "
            f"{x.shape}; for a batch use jax.vmap(m)(pixel_values)."
        )
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"`pixel_values` must hold numbers, got dtype {x.dtype}.")
    (c, h, w), (p1, p2) = x.shape, patch_size
    if c != n_channels:
        raise ValueError(
            f"`pixel_values` has {c} channels (shape {x.shape}), but the model takes "
            f"{n_channels} (config.num_channels); give [channels, height, width]."
        )
    if h < p1 or w < p2 or h % p1 or w % p2:
        raise ValueError(
            f"`pixel_values` is {h} x {w}, not a positive multiple of the patch "
            f"{p1} x {p2} (config.patch_size): the patches must tile the image. Crop or "
            f"resize it, e.g. to {max(p1, h - h % p1)} x {max(p2, w - w % p2)}."
        )
    return x.astype(dtype)
