r"""Controls fitted through a network's layers: piecewise-polynomial splines in depth, and
the residual of any fit at the depths the scheme reads it.

Each part is interpolated at its own knots, the depths where one Lie step per layer reads
it (see `AbstractBlockForm.projected_parts`): the operators at the layer starts
$t_0, \dots, t_{L-1}$, the projections at the layer ends $t_1, \dots, t_L$.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._checks import check_int
from ._controls import (
    AbstractBlock,
    AbstractControls,
    _check_blocks,
    _part,
    check_layering,
    layers_and_form,
)
from ._reads import map_parts, part_names, read_side, read_times, reads_at_end

#: The spline degrees by what they are: piecewise linear, natural cubic.
SPLINE_DEGREES = (1, 3)


def _spline_pieces(n_knots: int, degree: int) -> np.ndarray:
    r"""The linear map from the values $y_0, \dots, y_{K-1}$ at $K$ equispaced knots to the
    local coefficients of the $K - 1$ pieces, `[K - 1, degree + 1, K]` (float64).

    Piece $j$ is $\sum_k c_{jk} s^k$ in the local variable $s = (t - \tau_j)/h \in [0, 1]$.
    Degree 1: $c_{j0} = y_j$, $c_{j1} = y_{j+1} - y_j$. Degree 3, the natural cubic spline:
    with $m_j$ the second derivatives in $s$, $m_0 = m_{K-1} = 0$ and
    $m_{j-1} + 4 m_j + m_{j+1} = 6 (y_{j+1} - 2 y_j + y_{j-1})$ (continuity of the first
    derivative), $c_{j0} = y_j$, $c_{j1} = y_{j+1} - y_j - (2 m_j + m_{j+1})/6$,
    $c_{j2} = m_j / 2$, $c_{j3} = (m_{j+1} - m_j)/6$.
    """
    y = np.eye(n_knots)  # column k: the data that is 1 at knot k
    dy = y[1:] - y[:-1]
    if degree == 1:
        return np.stack([y[:-1], dy], axis=1)
    m = np.zeros((n_knots, n_knots))
    if n_knots > 2:
        tri = 4 * np.eye(n_knots - 2) + np.eye(n_knots - 2, k=1) + np.eye(n_knots - 2, k=-1)
        m[1:-1] = np.linalg.solve(tri, 6 * (y[2:] - 2 * y[1:-1] + y[:-2]))
    c1 = dy - (2 * m[:-1] + m[1:]) / 6
    return np.stack([y[:-1], c1, m[:-1] / 2, (m[1:] - m[:-1]) / 6], axis=1)


def _layer_pieces(n_layers: int, degree: int, at_end: bool) -> np.ndarray:
    """The map from one part's L layer values to its coefficients on the L layer intervals
    `[L, degree + 1, L]`: the spline through its knots, constant on the one interval
    beyond them (the first for a projection, read at the ends; the last otherwise)."""
    const = np.zeros((1, degree + 1, n_layers))
    const[0, 0, 0 if at_end else n_layers - 1] = 1.0
    spline = _spline_pieces(n_layers, degree)
    return np.concatenate([const, spline] if at_end else [spline, const], axis=0)


class SplineControls(AbstractControls):
    r"""Controls through a network's layers, a spline in depth: piecewise linear
    (`degree=1`) or the natural cubic spline (`degree=3`, $C^2$, zero second derivative
    at the end knots).

    Each part interpolates its layer values at the depths the scheme reads them (built by
    [`SplineControls.from_layers`][itde.SplineControls.from_layers]): operators at the
    layer starts $t_0, \dots, t_{L-1}$, projections at the ends $t_1, \dots, t_L$, and is
    constant beyond its knots. So one Lie step per layer (the default step) is the
    network, and smaller steps solve a continuum model through it. The controls are
    continuous but kink at the knots: `jump_times` reports the interior knots, so a
    fixed-step solve restarts its grid there and adaptive steps land on them, and a
    high-order solver keeps its order (a step across a kink would fall to order 2 for
    the linear spline, 4 for the cubic).

    **Arguments:**

    - `pieces`: a [`Block`][itde.Block] whose array leaves have shape
      `[L, degree + 1, ...]`: on layer interval $[t_n, t_{n+1}]$ the coefficients $c_k$
      of $\theta(t) = \sum_k c_k s^k$, $s = (t - t_n)/h$.
    - `t0`: the depth at which the first layer starts.
    - `layer_length`: the knot spacing $h$ (the layers' depth length).
    - `degree`: 1 or 3.
    """

    pieces: AbstractBlock
    t0: float = eqx.field(static=True, default=0.0)
    layer_length: float = eqx.field(static=True, default=1.0)
    degree: int = eqx.field(static=True, default=3)

    def __check_init__(self):
        _check_blocks("pieces", self.pieces)
        if self.degree not in SPLINE_DEGREES or isinstance(self.degree, bool):
            raise ValueError(
                f"`degree`={self.degree!r} is not a spline degree here; choose 1 (piecewise "
                "linear) or 3 (natural cubic)."
            )
        bad = [a.shape for a in jax.tree.leaves(self.pieces) if a.shape[1:2] != (self.degree + 1,)]
        if bad:
            raise ValueError(
                f"`pieces`: every array needs shape [layers, degree + 1 = {self.degree + 1}, "
                f"...], got {bad[0]}; build them with `SplineControls.from_layers`."
            )
        check_layering(self.t0, self.layer_length)

    @property
    def blocks(self) -> AbstractBlock:
        """The per-interval coefficients (leading axis: layers, then the power of $s$)."""
        return self.pieces

    @property
    def n_intervals(self) -> int:
        """The number of layer intervals $L$."""
        return int(jax.tree.leaves(self.pieces)[0].shape[0])

    @property
    def t1(self) -> float:
        return self.t0 + self.n_intervals * self.layer_length

    @property
    def default_step(self) -> float:
        """One layer per step: the network the spline was fitted through."""
        return self.layer_length

    def jump_times(self) -> tuple[float, ...]:
        r"""The interior knots $t_1, \dots, t_{L-1}$, where the derivatives jump (the
        controls themselves are continuous)."""
        return tuple(self.t0 + n * self.layer_length for n in range(1, self.n_intervals))

    def __call__(self, t, side: str = "right", part: str | None = None) -> AbstractBlock:
        del side  # continuous in t: both one-sided limits agree
        # the local variable in float32 or wider (as LegendreControls: bfloat16 depths
        # would carry a relative error of 4e-3)
        t = jnp.asarray(t)
        wide = jnp.promote_types(t.dtype, jnp.float32)
        s = jnp.clip((t.astype(wide) - self.t0) / self.layer_length, 0, self.n_intervals)
        i = jnp.clip(jnp.floor(s), 0, self.n_intervals - 1)
        x = s - i

        def horner(c):
            w = jnp.promote_types(c.dtype, wide)
            ci = jax.lax.dynamic_index_in_dim(c, i.astype(jnp.int32), axis=0, keepdims=False)
            ci, xw = ci.astype(w), x.astype(w)
            v = ci[self.degree]
            for k in range(self.degree - 1, -1, -1):
                v = v * xw + ci[k]
            return v.astype(c.dtype)

        return jax.tree.map(horner, _part(self.pieces, part))

    @classmethod
    def from_layers(cls, layers, degree: int = 3, *, block=None) -> SplineControls:
        r"""The spline through a network's layers, each part at the depths the scheme
        reads it: operators at the layer starts, the block form's projections
        (`projected_parts`: post-norm's `norm1`, `norm2`) at the layer ends; pre-norm and
        parallel blocks read every part at the starts. Then
        `TransformerIDE(SplineControls.from_layers(m), m.grid, block=m.block)` solved by
        Lie at its default step (one layer) is the network `m`.

        **Arguments:**

        - `layers`: the network, a [`TransformerIDE`][itde.TransformerIDE] with
          per-layer controls (its block form is used), or its
          [`PiecewiseConstant`][itde.PiecewiseConstant] controls (then `block` is
          required: controls do not know the block form, and there is no default).
        - `degree`: 1 (piecewise linear) or 3 (natural cubic spline, the default).
        - `block`: with controls, the block form the model will be solved with (an
          instance or a name of `itde.BLOCK_FORMS`, e.g. `m.block`); with a model, omit it.

        **Returns:** `SplineControls` on the layers' interval $[t_0, t_L]$, knot spacing
        the layer length.
        """
        controls, form = layers_and_form("layers", layers, block, "SplineControls.from_layers")
        degree = check_int("degree", degree, minimum=1)
        if degree not in SPLINE_DEGREES:
            raise ValueError(
                f"`degree`={degree} is not a spline degree here; choose 1 (piecewise linear) "
                "or 3 (natural cubic)."
            )
        L = controls.n_layers

        def fit_part(name, part):
            P = _layer_pieces(L, degree, reads_at_end(form, name))

            def fit(a):
                w = jnp.promote_types(a.dtype, jnp.float32)
                return jnp.tensordot(jnp.asarray(P, w), a.astype(w), axes=1).astype(a.dtype)

            return jax.tree.map(fit, part)

        pieces = map_parts(controls.values, fit_part)
        return cls(pieces, controls.t0, controls.layer_length, degree)


def fit_residuals(smooth: AbstractControls, per_layer, *, block=None) -> dict[str, float]:
    r"""How far smooth controls are from a network's layers where the scheme reads them:
    for every parameter, $\max_n |\theta_{\mathrm{fit}}(\tau_n) - \theta_n| /
    \max_n |\theta_n|$ (the largest entry of each), with $\tau_n = t_n$ for operators and
    $t_{n+1}$ for the block form's projections.

    Zero (to round-off) for an interpolating fit (`LegendreControls.from_layers` with one
    mode per layer, `SplineControls.from_layers`), positive for a smoothing one; a
    parameter that is zero in every layer reports the absolute deviation.

    **Arguments:**

    - `smooth`: the fitted controls (any `itde.AbstractControls`, e.g.
      [`LegendreControls`][itde.LegendreControls] or [`SplineControls`][itde.SplineControls]).
    - `per_layer`: the network, a [`TransformerIDE`][itde.TransformerIDE] with per-layer
      controls (its block form is used), or its
      [`PiecewiseConstant`][itde.PiecewiseConstant] controls (then `block` is required).
    - `block`: with controls, the block form (an instance or a name of
      `itde.BLOCK_FORMS`, e.g. `m.block`), which says which parts are read at the layer
      ends; with a model, omit it.

    **Returns:** a dict from each parameter's path (`"attention.wq"`, `"norm2.gain"`, ...)
    to its relative deviation, a float.
    """
    per_layer, form = layers_and_form("per_layer", per_layer, block, "fit_residuals")
    if not isinstance(smooth, AbstractControls):
        raise TypeError(
            f"`fit_residuals(smooth=...)` needs itde controls (e.g. LegendreControls or "
            f"SplineControls), got {type(smooth).__name__}."
        )
    L, out = per_layer.n_layers, {}
    for name in part_names(per_layer.values):
        ts = read_times(per_layer.t0, per_layer.layer_length, L, reads_at_end(form, name))
        side = read_side(form, name)
        fitted = jax.vmap(lambda t, name=name, side=side: smooth(t, side, name))(jnp.asarray(ts))
        layers = getattr(per_layer.values, name)
        got = jax.tree_util.tree_flatten_with_path(eqx.filter(fitted, eqx.is_array))[0]
        want = jax.tree_util.tree_flatten_with_path(eqx.filter(layers, eqx.is_array))[0]
        if [p for p, _ in got] != [p for p, _ in want]:
            raise ValueError(
                f"`smooth` and `per_layer` have different parameters in `{name}`: "
                f"{[jax.tree_util.keystr(p) for p, _ in got]} against "
                f"{[jax.tree_util.keystr(p) for p, _ in want]}; fit `smooth` through "
                "`per_layer` (e.g. `SplineControls.from_layers(m)`)."
            )
        for (path, f), (_, a) in zip(got, want):
            f, a = np.asarray(f, np.float64), np.asarray(a, np.float64)
            if f.shape != a.shape:
                raise ValueError(
                    f"`{name}{jax.tree_util.keystr(path)}` has shape {f.shape[1:]} in "
                    f"`smooth` but {a.shape[1:]} in `per_layer`; fit `smooth` through "
                    "`per_layer`."
                )
            scale = float(np.max(np.abs(a))) if a.size else 0.0
            err = float(np.max(np.abs(f - a))) if a.size else 0.0
            out[name + jax.tree_util.keystr(path)] = err / scale if scale > 0 else err
    return out
