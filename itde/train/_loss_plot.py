"""The training plot: training loss and the task's held-out metric against step."""

from __future__ import annotations

from pathlib import Path

from .._plot import _pyplot, save_figure


def _final(ax, steps, values, fmt: str, title: str) -> None:
    """Title the panel with the curve's last value and mark it with a dashed level, so that
    it can be read off whatever the scale."""
    ax.axhline(values[-1], color="0.5", lw=0.8, ls="--", zorder=1)
    ax.set_title(f"{title}: {values[-1]:{fmt}} at step {steps[-1]}")


def figure_metrics(rows: list[dict], task):
    """The figure of `loss_curve.png`: the training loss (left, log scale) and the task's
    held-out metric (right, its own scale), each one quantity on one axis, titled with the
    task."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4), layout="constrained")
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    a.plot(steps, loss, color="C0")
    if loss and min(loss) > 0:
        a.set_yscale("log")
    a.set_title("training loss")
    if loss:
        _final(a, steps, loss, ".3g", "training loss")
    a.set_xlabel("step")
    a.set_ylabel("training loss (batch)")
    pts = [(r["step"], r[task.metric]) for r in rows if task.metric in r]
    if pts:
        s, v = zip(*pts, strict=True)
        b.plot(s, v, "o-", color="C1")
        if task.metric_log and min(v) > 0:
            b.set_yscale("log")
    b.set_title(task.metric_label)
    if pts:
        _final(b, s, v, ".4g", task.metric_label)
    b.set_xlabel("step")
    b.set_ylabel(task.metric_label)
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.25)
    fig.suptitle(f"itde train: task '{task.name}' (itde.train.{type(task).__name__})")
    return fig


def plot_metrics(rows: list[dict], path: Path, task) -> Path:
    """Write `loss_curve.png` ([`figure_metrics`][])."""
    return save_figure(figure_metrics(rows, task), path)
