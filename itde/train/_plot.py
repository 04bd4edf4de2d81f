"""The training plot: loss against step, with the evaluation metric on a second axis."""

from __future__ import annotations

from pathlib import Path

from .._plot import _pyplot, save_figure


def plot_metrics(rows: list[dict], path: Path, task) -> Path:
    """Write `loss_curve.png`: training loss (log scale) and the task's held-out metric."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="C0", label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if rows and min(r["loss"] for r in rows) > 0:
        ax.set_yscale("log")
    pts = [(r["step"], r[task.metric]) for r in rows if task.metric in r]
    if pts:
        ax2 = ax.twinx()
        ax2.plot(*zip(*pts, strict=True), "o-", color="C1", label=task.metric_label)
        ax2.set_ylabel(task.metric_label, color="C1")
        if task.metric_log:
            ax2.set_yscale("log")
    ax.set_title(f"itde train: {task.name}")
    save_figure(fig, path)
    return path
