"""Plots written by the CLI (matplotlib, headless Agg backend).

Each plot is built by a `figure_*` function that returns the matplotlib figure (so that
tests can read its text) and written by a `plot_*` function."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ._io import atomic_write


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | Path, dpi: int = 110) -> Path:
    """Save a figure atomically as PNG and close it."""
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
    _pyplot().close(fig)
    return Path(path)


def integer_ticks(axis, values) -> None:
    """Put one labelled tick at each of `values` (layers, node counts) on `axis` (e.g.
    `ax.xaxis`) and no minor tick labels, so that labels neither collide nor go missing
    on a log scale."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    axis.set_major_locator(FixedLocator(list(values)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


#: Where an error or residual of exactly 0 is drawn on a log axis (and said in the legend).
ZERO_AT = 1e-17


def figure_trajectory(
    change: np.ndarray, residuals: np.ndarray, layers: np.ndarray, *, dtype=None
):
    """The figure of `itde solve`: how much each layer moves each token, and how close
    every layer's output lies to the constraint set $S_1$.

    **Arguments:**

    - `change`: `[layers, tokens]`, the relative change of each token's state over layer
      $n$, $\\|u(t_n) - u(t_{n-1})\\| / \\|u(t_{n-1})\\|$ (feature RMS norms).
    - `residuals`: `[layers, 2]`, the distance of the output of layer $n$ from $S_1$: its
      feature mean and variance residuals.
    - `layers`: the layer numbers $1, \\ldots, L$.
    - `dtype`: the state's dtype; its machine epsilon is drawn as the round-off level.
    """
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    layers = np.asarray(layers)
    im = a.imshow(
        change.T,
        aspect="auto",
        origin="lower",
        cmap="viridis",
        extent=(layers[0] - 0.5, layers[-1] + 0.5, -0.5, change.shape[1] - 0.5),
    )
    a.set_xlabel("layer n")
    a.set_ylabel("token")
    integer_ticks(a.xaxis, layers)
    a.set_title("how far each layer moves each token")
    bar = fig.colorbar(im, ax=a)
    bar.set_label(r"$\|u(t_n) - u(t_{n-1})\| \,/\, \|u(t_{n-1})\|$")
    for k, (name, marker) in enumerate((("mean", "o"), ("variance", "s"))):
        r = np.asarray(residuals[:, k], dtype=float)
        zero = f" (0 drawn at {ZERO_AT:g})" if np.any(r == 0) else ""
        b.semilogy(layers, np.maximum(r, ZERO_AT), marker + "-", label=f"{name} residual{zero}")
    if dtype is not None:
        eps = float(np.finfo(dtype).eps)
        b.axhline(eps, color="0.5", ls="--", lw=1, label=f"{np.dtype(dtype).name} epsilon")
    b.set_xlabel("layer n")
    integer_ticks(b.xaxis, layers)
    b.set_ylabel("distance from $S_1$")
    b.set_title(r"each layer's output on the constraint set $S_1$")
    b.legend()
    return fig


def plot_trajectory(change, residuals, layers, path: Path, *, dtype=None) -> Path:
    """Write [`figure_trajectory`][] to `path` (`trajectory.png` of `itde solve`)."""
    return save_figure(figure_trajectory(change, residuals, layers, dtype=dtype), path)


#: Markers cycled with the colours, so two series never share a look (a study draws up
#: to a dozen schemes; matplotlib's default cycle repeats its colours after ten).
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "<", ">", "h", "*", "p")


def series_style(i: int, n: int) -> dict:
    """The colour and marker of series `i` of `n`: `tab10` colours up to ten series,
    `tab20` beyond, each with its own marker."""
    plt = _pyplot()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return {"color": cmap(i % cmap.N), "marker": MARKERS[i % len(MARKERS)]}


def readable_log_ticks(axis) -> None:
    """Plain numbers (`2.58`, `0.013`) on a logarithmic axis instead of `2.575x10^0`
    (matplotlib labels minor ticks in that form when the data span less than a decade)."""
    from matplotlib.ticker import FuncFormatter

    def fmt(v, _):
        return f"{v:.3g}"

    axis.set_major_formatter(FuncFormatter(fmt))
    lo, hi = axis.get_view_interval()
    if lo > 0 and hi / lo < 100:  # few major ticks: label the minor ones too
        axis.set_minor_formatter(FuncFormatter(fmt))
