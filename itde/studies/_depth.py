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
import jax
import jax.numpy as jnp
import numpy as np

import itde_solvers as solvers

from .._config import ConfigError, ConvergeExperiment, ProblemConfig
from .._controls import LegendreControls
from .._equation import TransformerIDE
from .._io import check_output_dir, write_json
from .._plot import save_figure
from .._quadrature._rules import Grid
from .._registry import SCHEMES
from .._solve import solve


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
    f = jax.random.normal(jax.random.key(p.seed + 1), (p.n_tokens, p.n_features), jnp.float64)
    return model, model.project(0.0, f)


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
    from tqdm.auto import tqdm

    if not jax.config.jax_enable_x64:
        raise RuntimeError("the convergence study runs in float64: enable jax_enable_x64 first.")
    p, r, s = cfg.problem, cfg.reference, cfg.study
    model, u0 = build_problem(p)
    t_start = time.perf_counter()
    ref, ref_steps = reference_solution(
        model, u0, r.rtol, r.atol, r.max_steps
    )
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
    bar = tqdm(total=n_rows * len(dts), desc="depth convergence", disable=not progress)
    results = _scheme_rows(model, u0, ref, s.schemes, dts, max(s.steps), bar)
    if s.pre_norm_schemes:
        # the same controls, normalisation inside the operators: an ODE with no constraint
        pre = dataclasses.replace(model, block="pre_norm")
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
        solver = scheme.make()

        @jax.jit
        def final(dt, solver=solver, kind=scheme.terms):
            sol = solve(
                model,
                u0,
                solver=solver,
                terms=kind,
                dt0=dt,
                stepsize_controller=diffrax.ConstantStepSize(),
                max_steps=max_n + 2,
            )
            return sol.ys[-1]

        errors, on_set = [], []
        for dt in dts:
            u = final(jnp.asarray(dt))
            errors.append(float(jnp.max(jnp.abs(u - ref))))
            if model.block == "post_norm":
                rm, rv = model.constraint(model.depth).residuals(u)
                on_set.append(max(float(rm), float(rv)))
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
        exp = "geom" if r["expected_order"] is None else f"{r['expected_order']:.0f}"
        lines.append(f"{r['scheme']:<{width}}{exp:>9}{r['observed_order']:>9.2f}  {errs}")
        if r.get("n") != rows[0].get("n") and key == "n":
            lines[-1] += f"   (n = {r['n']})"
    return "\n".join(lines)


def plot_study(result: dict, path: Path) -> Path:
    from .._plot import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
    for i, r in enumerate(result["results"]):
        c = f"C{i % 10}"
        dt = np.asarray(r["dt"]) if "dt" in r else 1.0 / np.asarray(r["n"], dtype=float)
        e = np.maximum(np.asarray(r["errors"]), 1e-17)
        ax.loglog(dt, e, "o-", color=c, label=f"{r['scheme']} ({r['observed_order']:.2f})")
        p = r["expected_order"]
        anchor = np.argmin(dt)
        if p is not None and e[anchor] > 0 and math.isfinite(p):
            ax.loglog(dt, e[anchor] * (dt / dt[anchor]) ** p, ":", color=c, alpha=0.6)
    axis = result["axis"]
    ax.set_xlabel("depth step $\\Delta t$" if axis == "depth" else "1 / number of nodes")
    ax.set_ylabel("max error against the reference")
    ax.set_title(f"convergence in {axis} (dotted: expected slopes)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_outputs(result: dict, out: Path) -> tuple[Path, Path]:
    """Write `convergence[_axis].json` and the log-log plot into `out` (atomically);
    return their paths."""
    check_output_dir(out)
    axis = result["axis"]
    name = "convergence.json" if axis == "depth" else f"convergence_{axis}.json"
    js = write_json(out / name, result)
    png = plot_study(result, out / f"convergence_{result['axis']}.png")
    return js, png
