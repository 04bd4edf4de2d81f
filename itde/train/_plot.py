"""The training plot: loss against step, with the evaluation metric on a second axis."""

from __future__ import annotations

from pathlib import Path

from .._plot import _pyplot

_EVAL_LABELS = {
    "eval_seq_acc": "held-out sequence accuracy",
    "eval_rel_l2": "held-out relative L2",
    "eval_nats_per_char": "validation nats/char",
}


def plot_metrics(rows: list[dict], path: Path) -> Path:
    """Write `loss_curve.png`: training loss (log scale) and the held-out metric."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="C0", label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    if rows and min(r["loss"] for r in rows) > 0:
        ax.set_yscale("log")
    for key, label in _EVAL_LABELS.items():
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax2 = ax.twinx()
            ax2.plot(*zip(*pts, strict=True), "o-", color="C1", label=label)
            ax2.set_ylabel(label, color="C1")
            if key == "eval_rel_l2":
                ax2.set_yscale("log")
            break
    ax.set_title("itde train")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
