r"""The depth study of a given model: how far is a trained or converted network from the
continuum limit of its own equation, and at which order do the depth integrators reach it?

The model's equation (its [continuum form][itde.TransformerIDE.continuum_form] where its
norms are not projections) is solved from the model's own initial states with every scheme
at steps $h_0/n$, against a fixed-step Dopri8 reference at a step finer than the finest
studied one, and compared in the model's own output (hidden states, pooled embeddings,
logits: whatever `readout` returns). The network itself (its own scheme and step) is
compared with the same reference: that relative distance says how well the trained
network discretises an ODE (Sander, Ablin and Peyré, "Do residual neural networks
discretize neural ordinary differential equations?", NeurIPS 2022).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._controls import PiecewiseConstant
from .._equation import TransformerIDE
from .._io import check_output_dir, write_json
from .._plot import save_figure
from .._registry import SCHEMES
from .._solve import solve
from ._depth import study_order


def _relative(q, ref) -> float:
    """$\\|q - q_\\mathrm{ref}\\| / \\|q_\\mathrm{ref}\\|$ over the whole batch (Frobenius)."""
    q, ref = np.asarray(q, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(q - ref) / max(np.linalg.norm(ref), 1e-300))


def _check(equation, u0, schemes, steps, network, refinement, asymptotic) -> None:
    if not isinstance(equation, TransformerIDE):
        raise TypeError(
            f"`equation` must be an itde.TransformerIDE, got {type(equation).__name__}."
        )
    if getattr(u0, "ndim", None) != 3 or u0.shape[-1] != equation.n_features:
        raise ValueError(
            f"`u0` must be a batch of initial states [batch, tokens, {equation.n_features}], "
            f"got shape {getattr(u0, 'shape', None)}."
        )
    for name in (*schemes, network[0]):
        if name not in SCHEMES:
            raise ValueError(f"scheme {name!r} is not known; choose from {sorted(SCHEMES)}.")
    if not steps or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in steps):
        raise ValueError(
            f"`steps`={tuple(steps)!r} must be positive integers (steps per unit of depth), "
            "e.g. (1, 2, 4, 8)."
        )
    if len(steps) < 2:
        raise ValueError(f"`steps`={tuple(steps)!r}: an order needs at least two steps.")
    if isinstance(refinement, bool) or not isinstance(refinement, int) or refinement < 2:
        raise ValueError(
            f"`reference_refinement`={refinement!r} must be an integer >= 2: the reference "
            "takes steps that many times finer than the finest studied one (e.g. 4)."
        )
    if asymptotic is not None and (
        isinstance(asymptotic, bool) or not isinstance(asymptotic, int)
        or not 2 <= asymptotic <= len(steps)
    ):  # fmt: skip
        raise ValueError(
            f"`asymptotic`={asymptotic!r} must be None (fit every step) or an integer from 2 "
            f"to the {len(steps)} steps: how many of the finest steps the order is fitted to."
        )


@eqx.filter_jit
def _final(model, u0, mask, dt, name: str, max_steps: int, progress_meter=None):
    """The model's output map of $u(T)$ for a batch, one compilation per scheme and model
    (the step is traced: constant steps, which divide every layer here); `progress_meter`
    as `itde.solve`'s (a `StageMeter` for the reference: a line each tenth of the solve)."""
    sol = solve(
        model, u0, **SCHEMES[name].solve_options(dt), batched=True, args=mask,
        stepsize_controller=diffrax.ConstantStepSize(), max_steps=max_steps,
        progress_meter=progress_meter,
    )  # fmt: skip
    return jax.vmap(model.output)(sol.ys[-1])


#: The observed order is called settled when the slope of its finest pair differs from that
#: of the pair before by at most this much; else it is reported as pre-asymptotic.
SETTLED_SLOPE_CHANGE = 0.2
#: Errors below this many times the reference's own estimated error are reference-limited.
REFERENCE_MARGIN = 10.0


def order_check(dts, errors, *, floor: float = 1e-12, reference_error: float = 0.0,
                tolerance: float = SETTLED_SLOPE_CHANGE) -> dict:  # fmt: skip
    """Whether an observed order (the slope of the finest pair) can be read as the order.

    From the points above the round-off `floor`: `slope` of the finest pair, `previous` of
    the pair before (None with fewer than three points), `change` = |slope - previous|,
    and `verdict`: `"settled"` (change <= `tolerance`), `"pre-asymptotic"` (the slope still
    moves: refine further), `"undetermined"` (fewer than three points, no second pair to
    compare with) or `"reference-limited"` (the finest error is within
    `REFERENCE_MARGIN` times `reference_error`, the reference's own estimated error).
    """
    pts = sorted(
        ((float(h), float(e)) for h, e in zip(dts, errors, strict=True)
         if math.isfinite(e) and e > floor),
        reverse=True,
    )  # fmt: skip
    slopes = [
        math.log(e0 / e1) / math.log(h0 / h1)
        for (h0, e0), (h1, e1) in zip(pts[:-1], pts[1:], strict=True)
    ]
    slope = slopes[-1] if slopes else float("nan")
    previous = slopes[-2] if len(slopes) >= 2 else None
    change = None if previous is None else abs(slope - previous)
    if pts and pts[-1][1] <= REFERENCE_MARGIN * reference_error:
        verdict = "reference-limited"
    elif change is None:
        verdict = "undetermined"
    else:
        verdict = "settled" if change <= tolerance else "pre-asymptotic"
    return {"slope": slope, "previous": previous, "change": change, "verdict": verdict}


def solve_cost(scheme: str, depth: float, dt: float) -> float:
    """The cost of a constant-step solve, for progress estimates: its steps times the
    stages of the scheme's Butcher tableau (1 for a splitting; compilation not counted)."""
    solver = SCHEMES[scheme].make()
    tableau = getattr(getattr(solver, "solver", solver), "tableau", None)
    stages = 1 if tableau is None else len(tableau.c) + 1
    return math.ceil(depth / dt - 1e-9) * stages


def _whole_estimate(t_start: float, costs, compiles, k: int):
    """The `postfix` of solve `k`'s bar: the whole study's estimated time, from the rate of
    this solve so far (time per unit of cost) and, for each solve still to compile, the
    time this one spent before its first step (its compilation)."""
    from .._progress import format_duration

    t_stage = time.perf_counter()

    def whole(fraction: float, run_s: float) -> str:
        now = time.perf_counter()
        rate = run_s / (fraction * costs[k])
        compile_s = max(0.0, now - t_stage - run_s)
        left = (1 - fraction) * costs[k] * rate + sum(costs[k + 1 :]) * rate
        left += compile_s * sum(compiles[k + 1 :])
        return f"the study: about {format_duration(now - t_start + left)} in all"

    return whole


def model_depth_study(
    equation: TransformerIDE,
    u0,
    *,
    mask=None,
    readout: Callable | None = None,
    schemes: Sequence[str] = ("lie", "strang", "rk4"),
    steps: Sequence[int] = (1, 2, 4, 8, 16),
    network: tuple[str, float | None] = ("lie", None),
    reference_refinement: int = 4,
    asymptotic: int | None = 2,
    keep_outputs: bool = False,
    progress: bool = True,
    advice: str = "refine further (smaller steps)",
) -> dict:
    """Refine the depth of a model's equation and measure its distance to its limit.

    **Arguments:**

    - `equation`: the model's `TransformerIDE` (from `itde.from_torch`, a trained model's
      `equation`, or `itde.from_hf(model).continuum_form().equation`). A post-norm model whose
      norms have gains is studied through its continuum form (exact at the network's step).
    - `u0`: the model's initial states, `[batch, tokens, features]` (its embeddings of real
      inputs). For a Hugging Face post-norm model take them from
      `m.continuum_form().embed`: its embedding LayerNorm's gain then goes into the first
      layer and the initial state lies on the constraint set. With `m.embed` the gain
      stays in the initial state, which the first refined step projects away: the network
      is the same, its limit another one (the real MiniLM of the gallery is 0.70 from
      that limit, 0.77 from the continuum form's).
    - `mask`: `[batch, tokens]` key mask (False on padding), or None.
    - `readout`: the model's output from the equation's output `[batch, tokens, features]`
      (after its readout and final norm) and `mask`: e.g. pooled sentence embeddings or
      logits. Default: the hidden states, padded rows zeroed.
    - `schemes`: names of `itde.SCHEMES` to refine.
    - `steps`: steps per unit of depth (per layer for a discrete model): $h = h_0 / n$.
    - `network`: the network's own `(scheme, dt)`; `dt` None: one layer (per-layer
      controls) or one unit of depth.
    - `reference_refinement`: the Dopri8 reference takes steps this many times finer than
      the finest studied one (its own error, against half as many steps, is reported).
    - `asymptotic`: the observed order is fitted to this many of the finest steps (None:
      all; default: the finest pair); coarse steps of a real network are far from the
      asymptotic range.
    - `keep_outputs`: add `"outputs"`, the readouts of the network and of the reference
      (NumPy arrays; not JSON).
    - `progress`: a line per solve on stderr with an estimate of the whole, and inside each
      reference solve a bar (tqdm on a terminal, a line each tenth in a log).
    - `advice`: what the printed verdict tells a user to do when an order is
      pre-asymptotic (the command line says `run --full`).

    **Returns:** a dict (JSON-ready without `"outputs"`): `"results"` (one row per scheme:
    `dt`, relative `errors` against the reference, `observed_order`, `expected_order`,
    and `order_check`: whether the slope has settled, see `order_check`),
    `"network"` (its scheme, step and relative distance to the limit), `"reference"`
    and `"model"`.
    """
    from .._progress import Stages
    from ._meter import StageMeter, solve_progress

    schemes, steps = tuple(schemes), tuple(steps)
    _check(equation, u0, schemes, steps, network, reference_refinement, asymptotic)
    t_start = time.perf_counter()
    form = equation.continuum_form()
    h0 = (
        float(equation.controls.layer_length)
        if isinstance(equation.controls, PiecewiseConstant)
        else 1.0
    )
    if readout is None:

        def readout(y, mask):
            return y if mask is None else jnp.where(jnp.asarray(mask)[..., None], y, 0.0)

    finest = h0 / max(steps)
    ref_dt = finest / reference_refinement
    max_steps = math.ceil(float(equation.depth) / ref_dt) + 2

    def run(model, name: str, dt: float, meter=None):
        y = _final(model, u0, mask, jnp.asarray(dt, jnp.float64), name, max_steps, meter)
        return np.asarray(readout(y, mask))

    net_scheme, net_dt = network[0], h0 if network[1] is None else float(network[1])
    depth = float(equation.depth)
    plan = [  # (what, model, scheme, dt): every solve of the study, in order
        ("reference", form, "dopri8", ref_dt),
        ("reference at 2 dt (its own error)", form, "dopri8", 2 * ref_dt),
        ("the network", equation, net_scheme, net_dt),
    ] + [(f"{name}, dt={h0 / n:.4g}", form, name, h0 / n) for name in schemes for n in steps]
    costs = [solve_cost(name, depth, dt) for _, _, name, dt in plan]
    # a solve compiles when its (model, scheme) is new (`_final` traces the step)
    seen, compiles = set(), []
    for _, model, name, _ in plan:
        compiles.append((id(model), name) not in seen)
        seen.add((id(model), name))
    stages = Stages("model depth study", len(plan), sum(costs), enabled=progress)
    stages.write(
        f"{len(plan)} solves of {int(u0.shape[0])} inputs x {int(u0.shape[1])} tokens "
        f"(schemes {', '.join(schemes)} at {', '.join(map(str, steps))} steps per "
        f"{'layer' if isinstance(equation.controls, PiecewiseConstant) else 'unit of depth'}"
        f"; Dopri8 reference at dt={ref_dt:.4g})"
    )
    outs, errors = [], []  # the reference, its check and the network; each scheme's errors
    for k, (what, model, name, dt) in enumerate(plan):
        label = what if k >= 3 else f"{what} ({SCHEMES[name].label}, dt={dt:.4g})"
        n = math.ceil(depth / dt - 1e-9)
        rest = list(zip(costs[k + 1 :], compiles[k + 1 :], strict=True))
        with stages.stage(f"{label}, {n} steps", costs[k], compiles[k], remaining=rest):
            if k < 2:  # the long solves: a bar inside them (compiled once for both)
                whole = _whole_estimate(t_start, costs, compiles, k)
                with solve_progress(f"model depth study: [{k + 1}/{len(plan)}] {what}",
                                    enabled=progress, postfix=whole):  # fmt: skip
                    y = run(model, name, dt, StageMeter())
            else:
                y = run(model, name, dt)
        if k < 3:
            outs.append(y)
        else:  # compared at once: a model's readouts (logits) are not all kept
            errors.append(_relative(y, outs[0]))
    ref, coarse, net = outs
    self_error = _relative(coarse, ref)
    # the reference's own error: its change against 2 dt over (2^8 - 1) for Dopri8's order 8
    ref_error = self_error / (2.0 ** SCHEMES["dopri8"].order - 1.0)
    rows = []
    for i, name in enumerate(schemes):
        dts = [h0 / n for n in steps]
        errs = errors[i * len(steps) : (i + 1) * len(steps)]
        rows.append(
            {
                "scheme": name,
                "label": SCHEMES[name].label,
                "expected_order": float(SCHEMES[name].order),
                "observed_order": study_order(dts, errs, asymptotic=asymptotic),
                "order_check": order_check(dts, errs, reference_error=ref_error),
                "dt": dts,
                "errors": errs,
            }
        )
    controls = equation.controls
    result = {
        "axis": "depth",
        "kind": "model",
        "model": {
            "controls": type(controls).__name__,
            "layers": getattr(controls, "n_layers", None)
            if isinstance(controls, PiecewiseConstant)
            else None,
            "depth": float(equation.depth),
            "block": type(equation.block).__name__,
            "norm": type(controls.blocks.norm2).__name__,
            "continuum_form": form is not equation,
            "batch": int(u0.shape[0]),
            "n_tokens": int(u0.shape[1]),
            "n_features": int(u0.shape[2]),
            "dtype": str(u0.dtype),
        },
        "network": {
            "scheme": net_scheme,
            "dt": net_dt,
            "distance_to_limit": _relative(net, ref),
        },
        "reference": {
            "scheme": "dopri8",
            "dt": ref_dt,
            "self_error": self_error,
            "estimated_error": ref_error,
        },
        "results": rows,
        "asymptotic": asymptotic,
        "advice": advice,
        "wall_s": time.perf_counter() - t_start,
    }
    if keep_outputs:
        result["outputs"] = {"network": net, "limit": ref}
    return result


def format_model_study(result: dict) -> str:
    """The study as plain text: the network's distance to its limit, then one row per
    scheme (relative errors in the model's output against the reference)."""
    from ._depth import format_table

    m, net, ref = result["model"], result["network"], result["reference"]
    form = ", in continuum form" if m["continuum_form"] else ""
    lines = [
        f"{m['block']} {m['controls']} model ({m['norm']}{form}), depth {m['depth']:g}; "
        f"{m['batch']} inputs x {m['n_tokens']} tokens x {m['n_features']} features, "
        f"{m['dtype']}",
        f"reference: Dopri8, dt={ref['dt']:.4g} (relative change against 2 dt: "
        f"{ref['self_error']:.1e})",
        f"the network ({net['scheme']}, dt={net['dt']:g}) is {net['distance_to_limit']:.3g} "
        "(relative) from the continuum limit of its equation",
        format_table(result),
    ]
    return "\n".join(lines + order_lines(result))


def order_lines(result: dict) -> list[str]:
    """What the observed orders may be read as: a line per scheme with the verdict of its
    `order_check` (rows without one, from an older result, are left out)."""
    rows = [r for r in result["results"] if "order_check" in r]
    if not rows:
        return []
    advice = result.get("advice", "refine further (smaller steps)")
    lines = [f"observed order = slope of the finest pair; it is an order only once settled "
             f"(the pair before within {SETTLED_SLOPE_CHANGE:g} of it):"]  # fmt: skip
    width = max(len(r["scheme"]) for r in rows)
    for r in rows:
        c = r["order_check"]
        head = f"  {r['scheme']:<{width}} {c['slope']:6.2f}  "
        if c["verdict"] == "settled":
            text = f"settled (the pair before: {c['previous']:.2f})"
        elif c["verdict"] == "pre-asymptotic":
            text = (f"PRE-ASYMPTOTIC: the slope still changes by {c['change']:.2f} between "
                    f"the last two pairs ({c['previous']:.2f} -> {c['slope']:.2f}); "
                    f"not an order: {advice}")  # fmt: skip
        elif c["verdict"] == "reference-limited":
            text = (
                "REFERENCE-LIMITED: the finest error is near the reference's own; "
                "not an order: refine the reference"
            )
        else:
            text = f"UNDETERMINED: one pair only, no second slope to compare; {advice}"
        lines.append(head + text)
    return lines


def figure_model_study(result: dict):
    """Relative error in the model's output against the depth step, one curve per scheme
    with its observed order, and the network's own distance to the limit as a marker."""
    from .._plot import ZERO_AT, _pyplot, readable_log_ticks, series_style

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5.4), layout="constrained")
    rows = result["results"]
    for i, r in enumerate(rows):
        q = r["observed_order"]
        order = f"order {q:.2f}" if math.isfinite(q) else "at round-off"
        verdict = r.get("order_check", {}).get("verdict", "settled")
        if math.isfinite(q) and verdict != "settled":
            order = f"slope {q:.2f}, {verdict}"
        ax.loglog(r["dt"], np.maximum(r["errors"], ZERO_AT), "-", **series_style(i, len(rows)),
                  label=f"{r['scheme']}: {order} (expected {r['expected_order']:g})")  # fmt: skip
    net = result["network"]
    ax.loglog([net["dt"]], [max(net["distance_to_limit"], ZERO_AT)], "k*", ms=14,
              label=f"the network ({net['scheme']}, dt={net['dt']:g}): "
              f"{net['distance_to_limit']:.2g} from its limit")  # fmt: skip
    ax.set_xlabel("depth step $h$")
    ax.set_ylabel("relative error of the model's output against the limit")
    readable_log_ticks(ax.yaxis)
    m = result["model"]
    ax.set_title(f"Depth refinement of a {m['block']} model ({m['norm']}), "
                 f"{m['batch']} inputs\nreference: Dopri8 at h={result['reference']['dt']:.3g}",
                 fontsize=11)  # fmt: skip
    fig.legend(loc="outside lower center", ncols=1, fontsize=8)
    return fig


def write_model_study(result: dict, out: Path) -> tuple[Path, Path]:
    """Write `convergence_model.json` (without `"outputs"`) and `convergence_model.png`
    into `out`, atomically; return their paths."""
    check_output_dir(out)
    data = {k: v for k, v in result.items() if k != "outputs"}
    js = write_json(out / "convergence_model.json", data)
    png = save_figure(figure_model_study(result), out / "convergence_model.png")
    return js, png
