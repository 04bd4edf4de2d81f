"""Plots written by the CLI (matplotlib, headless Agg backend)."""

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


def plot_trajectory(norms: np.ndarray, ts: np.ndarray, path: Path) -> Path:
    """Per-token feature norm $\\|u(x,\\cdot,t)\\|$ over depth: heat map and token mean."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    im = a.imshow(
        norms.T,
        aspect="auto",
        origin="lower",
        cmap="viridis",
        extent=(ts[0] - 0.5, ts[-1] + 0.5, -0.5, norms.shape[1] - 0.5),
    )
    a.set_xlabel("depth t (layer)")
    a.set_ylabel("token")
    a.set_title("feature norm of each token")
    fig.colorbar(im, ax=a)
    b.plot(ts, norms.mean(axis=1), "o-", label="mean over tokens")
    b.fill_between(ts, norms.min(axis=1), norms.max(axis=1), alpha=0.25, label="min-max")
    b.set_xlabel("depth t (layer)")
    b.set_ylabel(r"$\|u(x,\cdot,t)\|_{\Omega_y}$ (RMS)")
    b.legend()
    return save_figure(fig, path)
