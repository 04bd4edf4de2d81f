"""The plots read at a glance: their text (titles, axis labels, legend entries, tick labels,
colour-bar labels) is read from the matplotlib objects and checked: no "nan", no private
name, every panel titled and labelled, tick labels that do not collide, identical curves
said in the legend, guides drawn under the data."""

import math
import re

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from itde._internal import figure_trajectory  # noqa: E402
from itde.studies._internal import figure_study  # noqa: E402
from itde.train import TASKS  # noqa: E402
from itde.train._internal import figure_metrics  # noqa: E402

PRIVATE = re.compile(r"\bitde(?:_solvers)?(?:\.\w+)*\._[a-z]\w*")


def _texts(fig) -> list[str]:
    """Every piece of text a reader sees in `fig` (drawn first, so tick labels exist)."""
    fig.canvas.draw()
    out = [fig.get_suptitle()]
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
        if ax.get_legend():
            out += [t.get_text() for t in ax.get_legend().get_texts()]
    out += [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    return [t for t in out if t]


def _legend(fig) -> list[str]:
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend()] + list(fig.legends)
    return [t.get_text() for leg in legends for t in leg.get_texts()]


def _check_common(fig, n_panels):
    texts = _texts(fig)
    assert not [t for t in texts if re.search(r"\bnan\b", t, re.I)], texts
    assert not [t for t in texts if PRIVATE.search(t)], texts
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(panels) == n_panels
    for ax in panels:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel(), ax
        boxes = [t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()]
        assert len(boxes) >= 2
        for a, b in zip(boxes, boxes[1:], strict=False):
            assert not a.overlaps(b), "x tick labels collide"
    for ax in fig.axes:
        if ax.get_label() == "<colorbar>":
            assert ax.get_ylabel(), "colour bar without a label"
    return texts


def _row(name, order, x, errors, key="dt"):
    finite = [e for e in errors if e > 1e-12]
    obs = float("nan") if len(finite) < 2 else float(order or 0)
    return {"scheme": name, "expected_order": order, "observed_order": obs, key: list(x),
            "errors": list(errors)}  # fmt: skip


DTS = [1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64]
DEPTH = {
    "axis": "depth",
    "problem": {"t1": 1.0, "n_tokens": 8, "n_features": 12, "activation": "gelu"},
    "results": [
        _row("lie", 1.0, DTS, [0.1 * h for h in DTS]),
        _row("parallel", 1.0, DTS, [0.2 * h for h in DTS]),
        _row("euler", 1.0, DTS, [0.2 * h for h in DTS]),  # identical to parallel
        _row("tsit5", 5.0, DTS, [max(0.5 * h**5, 3e-13) for h in DTS]),
    ],
}


def test_depth_plot_reads_at_a_glance():
    fig = figure_study(DEPTH)
    texts = _check_common(fig, 1)
    legend = _legend(fig)
    assert any("euler" in t and "same errors as parallel" in t for t in legend), legend
    assert any("round-off" in t for t in legend) and any("expected order" in t for t in legend)
    ax = fig.axes[0]
    assert "Depth" in ax.get_title() and "Dopri8" in ax.get_title()
    assert [t for t in texts if t == "1/64"] and [t for t in texts if t == "1/4"]
    # the hidden curve is drawn (dashed, over the other), and each guide runs under its data
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    euler = [ln for lab, ln in lines.items() if lab.startswith("euler")][0]
    assert euler.get_linestyle() == "--"
    data = [ln for ln in ax.get_lines() if ln.get_linestyle() in ("-", "--") and
            not ln.get_label().startswith(("_", "round"))]  # fmt: skip
    guides = [ln for ln in ax.get_lines() if ln.get_linestyle() == ":" and len(ln.get_xdata())]
    assert guides
    for g in guides:
        owner = [d for d in data if d.get_color() == g.get_color()][0]
        assert g.get_zorder() < owner.get_zorder()
        assert np.all(np.asarray(g.get_ydata()) < np.asarray(owner.get_ydata()))
    fig.clf()


@pytest.mark.parametrize("axis", ["tokens", "features", "all"])
def test_grid_plots_say_what_was_refined(axis):
    ns = [16, 32, 64, 128]
    geometric = _row("periodic-trapezoid", None, ns, [2.5e-14, 2.3e-14, 2.7e-14, 1e-14], "n")
    geometric["n_reaching_1e-10"] = 16
    gauss = _row("gauss-legendre", None, ns, [8.5e-7, 8.3e-12, 2.3e-15, 8.3e-16], "n")
    gauss["n_reaching_1e-10"] = 32
    result = {
        "axis": axis,
        "problem": {"fixed_nodes": 32},
        "reference": {"nodes": 192, "solver": "Lie, dt=1"},
        "results": [
            _row("midpoint", 2.0, ns, [2.0 / n**2 for n in ns], "n"),
            _row("simpson", 4.0, [n + 1 for n in ns], [30.0 / n**4 for n in ns], "n"),
            gauss,
            geometric,
        ],
    }
    fig = figure_study(result)
    _check_common(fig, 1)
    fig.canvas.draw()  # the legend (below the axes) lies inside the figure
    (leg,) = fig.legends
    box, page = leg.get_window_extent(), fig.bbox
    assert box.x0 >= page.x0 and box.x1 <= page.x1 and box.y0 >= page.y0, (box, page)
    ax = fig.axes[0]
    legend = _legend(fig)
    assert any("periodic-trapezoid: geometric" in t and "N = 16" in t for t in legend), legend
    if axis == "all":
        assert "depth step, tokens and features" in ax.get_title()
        assert "depth steps N/4" in ax.get_xlabel()
    else:
        assert axis[:-1] in ax.get_title() and axis[:-1] in ax.get_xlabel()
    fig.clf()


def test_trajectory_plot_is_titled_and_its_colour_bar_labelled():
    change = np.linspace(0.2, 0.5, 12).reshape(3, 4)
    residuals = np.array([[2e-8, 2e-7], [0.0, 3e-7], [5e-8, 2e-7]])  # an exact zero too
    fig = figure_trajectory(change, residuals, np.arange(1, 4), dtype=np.float32)
    _check_common(fig, 2)
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1 and "u(t_n)" in bars[0].get_ylabel()
    legend = _legend(fig)
    assert any("0 drawn at" in t for t in legend) and "float32 epsilon" in legend
    fig.clf()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_loss_curve_has_one_quantity_per_axis_and_names_the_task(task):
    cls = TASKS[task]
    rows = [{"step": s, "loss": 2.0 / s} for s in range(10, 110, 10)]
    for r in rows[3::3]:  # steps 40, 70, 100
        r[cls.metric] = 0.5 + r["step"] / 1000
    fig = figure_metrics(rows, cls.__new__(cls))
    _check_common(fig, 2)
    a, b = fig.axes
    assert task in fig.get_suptitle() and cls.__name__ in fig.get_suptitle()
    assert a.get_yscale() == "log" and b.get_yscale() == ("log" if cls.metric_log else "linear")
    assert b.get_ylabel() == cls.metric_label and "loss" in a.get_ylabel()
    for ax in (a, b):  # one curve each (and a dashed level at its last value, in the title)
        curves = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 2]
        assert len(curves) == 1
    assert "0.02 at step 100" in a.get_title()
    assert b.get_title().endswith(f"{0.6:.4g} at step 100")
    assert not math.isnan(a.get_ylim()[0])
    fig.clf()


def test_a_dozen_series_never_share_a_look_and_short_log_axes_read_plainly():
    """The depth study draws up to a dozen schemes: matplotlib's ten-colour cycle gave two
    of them the same blue. Every (colour, marker) pair now differs; and an error axis that
    spans less than a decade is labelled 2.58, not 2.575x10^0."""
    dts = [1 / 4, 1 / 8, 1 / 16]
    rows = [_row(f"s{i}", 1.0, dts, [(1.1 + 0.05 * i) * h for h in dts]) for i in range(12)]
    fig = figure_study({**DEPTH, "results": rows})
    ax = fig.axes[0]
    data = [ln for ln in ax.get_lines() if ln.get_label().startswith("s")]
    looks = {(tuple(np.round(matplotlib.colors.to_rgba(ln.get_color()), 3)), ln.get_marker())
             for ln in data}  # fmt: skip
    assert len(data) == 12 and len(looks) == 12
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.yaxis.get_ticklabels(which="both") if t.get_text()]
    assert labels and not any("times" in t or "10^" in t for t in labels), labels
    fig.clf()
