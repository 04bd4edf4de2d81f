"""The depth convergence study: observed orders of every depth integrator.

A smooth test problem (controls that are Legendre series in depth, a moving
constraint set $S_1(\\sigma_1(t), \\sigma_2(t))$) is solved in float64 by each scheme at
a sequence of depth steps and compared with a projected Dopri8 reference at tight
tolerances. The observed order is the least-squares slope of log error on log step.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import itde_solvers as solvers

from .._blocks import PreNorm
from .._config import ConfigError
from .._controls import LegendreControls
from .._equation import TransformerIDE
from .._io import check_output_dir, write_json
from .._plot import save_figure
from .._quadrature._rules import Grid
from .._random import normal
from .._registry import SCHEMES
from .._solve import solve
from ._converge_config import ConvergeExperiment, ProblemConfig


def build_problem(p: ProblemConfig) -> tuple[TransformerIDE, jax.Array]:
    """The smooth test problem: model and initial state (on $S_1(0)$), float64."""
    controls = LegendreControls.init(
        jax.random.key(p.seed),
        n_modes=p.n_modes,
        t1=p.t1,
        amplitude=p.amplitude,
        n_features=p.n_features,
        n_heads=p.n_heads,
        n_hidden=p.n_hidden,
        activation=p.activation,
        eps=0.0,
        dtype=jnp.float64,
    )
    model = TransformerIDE(controls, Grid.unit(p.n_features))
    f = normal(jax.random.key(p.seed + 1), (p.n_tokens, p.n_features), jnp.float64)
    return model, _project_initial(model, f)


@eqx.filter_jit
def _project_initial(model, f):
    """$P_{S_1(0)}(f)$, compiled once per problem shape (at module level, so that a second
    study of the same shape in one process reuses the program)."""
    return model.project(0.0, f)


def _reference(model, u0, rtol, atol, max_steps):
    sol = solve(
        model,
        u0,
        solver=solvers.Projected(diffrax.Dopri8()),
        stepsize_controller=diffrax.PIDController(rtol=rtol, atol=atol),
        dt0=model.depth / 64,
        max_steps=max_steps,
        throw=False,
    )
    return sol.ys[-1], sol.stats["num_steps"], sol.result == diffrax.RESULTS.successful


def reference_solution(model, u0, rtol, atol, max_steps):
    """The reference $u(T)$ (projected Dopri8, adaptive) and its step count; a
    `ConfigError` naming `reference.max_steps` when it does not reach $T$."""
    ys, n, ok = jax.jit(_reference, static_argnums=(2, 3, 4))(model, u0, rtol, atol, max_steps)
    if not bool(ok) or not bool(jnp.all(jnp.isfinite(ys))):
        raise ConfigError(
            f"the reference solve (projected Dopri8, rtol={rtol}, atol={atol}) did not reach "
            f"T={model.depth} within `reference.max_steps`={max_steps} steps; raise "
            "`reference.max_steps` or loosen `reference.rtol`/`reference.atol`"
        )
    return ys, int(n)


def run_depth_study(cfg: ConvergeExperiment, progress: bool = True) -> dict:
    """Run the study and return the JSON-ready result (see `itde converge`)."""
    from .._progress import progress_bar, stage_line

    if not jax.config.jax_enable_x64:
        raise RuntimeError("the convergence study runs in float64: enable jax_enable_x64 first.")
    p, r, s = cfg.problem, cfg.reference, cfg.study
    model, u0 = build_problem(p)
    t_start = time.perf_counter()
    what = f"reference solve (projected Dopri8, adaptive, rtol={r.rtol:g}, to T={p.t1:g})"
    with stage_line("depth convergence", what, enabled=progress):
        ref, ref_steps = reference_solution(model, u0, r.rtol, r.atol, r.max_steps)
        ref.block_until_ready()
    reference = {
        "solver": "projected Dopri8 (PIDController)",
        "rtol": r.rtol,
        "atol": r.atol,
        "steps": int(ref_steps),
        "dtype": "float64",
        "wall_s": time.perf_counter() - t_start,
    }
    dts = [p.t1 / n for n in s.steps]
    n_rows = len(s.schemes) + len(s.pre_norm_schemes)
    bar = progress_bar(n_rows * len(dts), "depth convergence", enabled=progress)
    results = _scheme_rows(model, u0, ref, s.schemes, dts, max(s.steps), bar)
    if s.pre_norm_schemes:
        # the same controls, normalisation inside the operators: an ODE with no constraint
        pre = dataclasses.replace(model, block=PreNorm())
        with stage_line("depth convergence", "pre-norm " + what, enabled=progress):
            pre_ref, pre_steps = reference_solution(pre, u0, r.rtol, r.atol, r.max_steps)
        reference["pre_norm_steps"] = int(pre_steps)
        results += _scheme_rows(
            pre, u0, pre_ref, s.pre_norm_schemes, dts, max(s.steps), bar, prefix="pre_norm/"
        )
    bar.close()
    return {
        "axis": "depth",
        "problem": {k: getattr(p, k) for k in p.__dataclass_fields__},
        "reference": reference,
        "results": results,
        "wall_s": time.perf_counter() - t_start,
    }


def _scheme_rows(model, u0, ref, names, dts, max_n, bar, prefix: str = "") -> list[dict]:
    """One result row per scheme: errors against `ref` at each step and the observed order."""
    rows = []
    for name in names:
        scheme = SCHEMES[name]

        @jax.jit
        def final(dt, scheme=scheme):
            sol = solve(
                model, u0, **scheme.solve_options(dt),
                stepsize_controller=diffrax.ConstantStepSize(), max_steps=max_n + 2,
            )  # fmt: skip
            return sol.ys[-1]

        errors, on_set = [], []
        for dt in dts:
            u = final(jnp.asarray(dt))
            errors.append(float(jnp.max(jnp.abs(u - ref))))
            if model.has_constraint:
                on_set.append(float(model.constraint(model.depth).residual(u)))
            bar.set_postfix(scheme=prefix + name)
            bar.update()
        rows.append(
            {
                "scheme": prefix + name,
                "label": ("pre-norm equation, " if prefix else "") + scheme.label,
                "expected_order": float(scheme.order),
                "observed_order": study_order(dts, errors),
                "dt": dts,
                "errors": errors,
                # distance of the final state from the constraint set (none for pre-norm)
                "constraint_residual": max(on_set) if on_set else None,
            }
        )
    return rows


def study_order(steps, errors, *, floor: float = 1e-12, asymptotic: int | None = None) -> float:
    """Observed order of a study (`solvers.observed_order`), NaN when fewer than two points
    lie above the round-off `floor` (errors of the reference and of the projections sit
    below 1e-12 in float64)."""
    try:
        return float(solvers.observed_order(steps, errors, floor=floor, asymptotic=asymptotic))
    except ValueError:
        return float("nan")


def format_table(result: dict) -> str:
    """The study's result as the plain-text table `itde converge` prints: one row per
    scheme (or rule), its errors at each step (or node count) and the observed order."""
    rows = result["results"]
    key = "dt" if "dt" in rows[0] else "n"
    width = max(10, max(len(r["scheme"]) for r in rows) + 1)
    head = (
        f"{'scheme' if key == 'dt' else 'rule':<{width}}{'expected':>9}{'observed':>9}  "
        + "".join(f"{key + '=' + format(v, '.4g'):>11}" for v in rows[0][key])
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        errs = "".join(f"{e:>11.2e}" for e in r["errors"])
        exp = "geom." if r["expected_order"] is None else f"{r['expected_order']:.0f}"
        q = r["observed_order"]
        obs = f"{q:.2f}" if math.isfinite(q) and r["expected_order"] is not None else "-"
        lines.append(f"{r['scheme']:<{width}}{exp:>9}{obs:>9}  {errs}")
        if r.get("n") != rows[0].get("n") and key == "n":
            lines[-1] += f"   (n = {r['n']})"
    if any(r["expected_order"] is None for r in rows):
        lines.append("geom.: geometric (spectral) convergence, no algebraic order to fit")
    return "\n".join(lines)


#: Errors below this are round-off and left out of the fitted order (as in `study_order`).
FLOORS = {"depth": 1e-12, "grid": 1e-13}


def _same_as(rows: list[dict], i: int) -> str | None:
    """The scheme of an earlier row with the same errors as row `i` (its curve would hide
    under that row's), or None."""
    e = np.asarray(rows[i]["errors"])
    for r in rows[:i]:
        other = np.asarray(r["errors"])
        # a tolerance on purpose: this only merges two curves of a plot's legend
        if other.shape == e.shape and np.allclose(other, e, rtol=1e-9, atol=0):
            return r["scheme"]
    return None


def _legend_label(r: dict) -> str:
    p, q = r["expected_order"], r["observed_order"]
    if p is None:  # spectral accuracy: no algebraic order to fit
        n = r.get("n_reaching_1e-10")
        if n is None:
            return f"{r['scheme']}: geometric, not yet at round-off"
        tail = [e for m, e in zip(r["n"], r["errors"], strict=True) if m >= n]
        return f"{r['scheme']}: geometric, {max(tail):.0e} at N = {n}"
    if not math.isfinite(q):
        return f"{r['scheme']}: at round-off (expected order {p:g})"
    return f"{r['scheme']}: order {q:.2f} (expected {p:g})"


def figure_study(result: dict):
    """The log-log figure of a convergence study (`itde converge`): error against the
    depth step (`axis = "depth"`) or against the number of nodes, one curve per scheme or
    rule with its observed order in the legend, a dotted guide of the expected order
    below each curve, and the round-off floor excluded from the fits."""
    from .._plot import ZERO_AT, _pyplot, integer_ticks, readable_log_ticks, series_style

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 6.2), layout="constrained")
    axis, rows, prob = result["axis"], result["results"], result["problem"]
    depth = axis == "depth"
    guide_gap = 3.0  # guides run this factor below the data, parallel to the expected slope
    for i, r in enumerate(rows):
        look = series_style(i, len(rows))
        c = look["color"]
        x = np.asarray(r["dt"] if depth else r["n"], dtype=float)
        e = np.asarray(r["errors"], dtype=float)
        same = _same_as(rows, i)
        label = _legend_label(r) + (f"; same errors as {same}" if same else "")
        style = dict(ls="--", mfc="none", ms=9) if same else dict(ls="-")
        ax.loglog(x, np.maximum(e, ZERO_AT), label=label, zorder=3, **look, **style)
        p = r["expected_order"]
        anchor = int(np.argmin(x)) if depth else int(np.argmax(x))  # the finest point
        if p is not None and e[anchor] > 0 and math.isfinite(p) and not same:
            slope = p if depth else -p
            guide = e[anchor] / guide_gap * (x / x[anchor]) ** slope
            ax.loglog(x, guide, ":", color=c, alpha=0.8, lw=1.5, zorder=2)
    floor = FLOORS["depth" if depth else "grid"]
    ax.axhline(floor, color="0.5", lw=1, ls="-.", zorder=1,
               label=f"round-off floor {floor:.0e} (points below: not fitted)")  # fmt: skip
    ax.plot([], [], ":", color="0.3", label=f"dotted: expected order, drawn {guide_gap:g}x below")
    if depth:
        t1 = prob["t1"]
        steps = [round(t1 / dt) for dt in rows[0]["dt"]]
        integer_ticks(ax.xaxis, rows[0]["dt"])
        ax.set_xticklabels([f"{t1:g}/{n}" for n in steps])
        ax.set_xlabel(f"depth step $\\Delta t = T/n$ (T = {t1:g})")
        ax.set_ylabel("max error of $u(T)$ against the reference")
        ax.set_title(
            f"Depth convergence: {prob['n_tokens']} tokens x {prob['n_features']} features, "
            f"{prob['activation']}\nreference: projected Dopri8, float64", fontsize=11
        )
    else:
        integer_ticks(ax.xaxis, rows[0]["n"])
        fixed = f"{prob.get('fixed_nodes', '')} Gauss-Legendre nodes".strip()
        what = {
            "tokens": (f"token nodes N (features fixed: {fixed})", "the token grid"),
            "features": (f"feature nodes N (tokens fixed: {fixed})", "the feature grid"),
            "all": ("nodes N on tokens and on features; depth steps N/4",
                    "depth step, tokens and features together"),
        }[axis]  # fmt: skip
        ax.set_xlabel(what[0])
        ax.set_ylabel(r"$|J - J_{\mathrm{ref}}|$, $J = \int\int g\,u(T)$")
        ref = result["reference"]
        ax.set_title(f"Convergence in {what[1]}\nreference: {ref['nodes']} Gauss-Legendre "
                     f"nodes, {ref.get('solver', '')}, float64", fontsize=11)  # fmt: skip
    readable_log_ticks(ax.yaxis)
    fig.legend(loc="outside lower center", ncols=2, fontsize=8)
    return fig


def plot_study(result: dict, path: Path) -> Path:
    """Write [`figure_study`][] to `path` (`convergence_<axis>.png`)."""
    return save_figure(figure_study(result), path)


def write_outputs(result: dict, out: Path) -> tuple[Path, Path]:
    """Write `convergence[_axis].json` and the log-log plot into `out` (atomically);
    return their paths."""
    check_output_dir(out)
    axis = result["axis"]
    name = "convergence.json" if axis == "depth" else f"convergence_{axis}.json"
    js = write_json(out / name, result)
    png = plot_study(result, out / f"convergence_{result['axis']}.png")
    return js, png
