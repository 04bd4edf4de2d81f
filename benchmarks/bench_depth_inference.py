"""Depth chosen at inference: the models of `bench_multilevel.py` evaluated at other steps.

A network trained through the levels of a multilevel schedule (coarse networks of every
other layer at twice the step, then the fine one) has seen its parameters used at several
depth steps; the plainly trained discrete GPT has not. This benchmark measures how each
holds up when the depth step is chosen at inference, on `bench_multilevel.py`'s saved final
models (`--runs`: its output folder, `models/L{layers}_seed{seed}_{method}.eqx`) and its
own validation windows (`bench_nanogpt.stream` of each seed, `bench_nanogpt.itde_val`,
nats per character).

1. **Fixed steps.** Each model under the paper's Lie splitting at $\\Delta t$ = 4, 2, 1,
   1/2 (where the depth allows: `bench_multilevel.at_dt`, i.e. `itde.train.coarsen` to
   every `r`-th layer for `r` = 2, 4, and each layer in two steps for 1/2). The compute of
   a step is its count of field evaluations (one attention + one feed-forward) over the
   $\\Delta t$ = 1 network's $L$: $1 / \\Delta t$. $\\Delta t = 1$ is the network as trained,
   so its loss is `bench_multilevel`'s `final_val` for the same model, bit for bit.
2. **Adaptive steps.** The same per-layer controls solved by an embedded Runge–Kutta
   method (`--solvers`: diffrax's Heun (2 stages, order 2 with Euler's estimate), Bosh3
   (4, order 3), Tsit5 (7, order 5)) under `diffrax.PIDController(rtol, atol)` at each of
   `--tols` (rtol = atol), its steps clipped onto every layer boundary by `itde.solve`
   (`diffrax.ClipStepSizeController(jump_ts=...)`, the boundaries in the solve's time
   dtype), which evaluates each step's stages in the step's own
   layer (`itde_solvers.FrozenTime`); first step one layer (`dt0` = 1, so that no
   evaluation goes to choosing it). Each validation sequence is solved on its own
   (`jax.vmap` of the solve: each takes its own steps). Cost per input: diffrax's
   `num_steps` (accepted + rejected) times the stages, over $L$. For the
   first-same-as-last methods (Bosh3, Tsit5) this counts the last stage of every step,
   which the next step reuses unless it starts on a layer boundary: an upper bound by at
   most one evaluation per step; the lower bound counts it only on the $L$ first steps of
   the layers. The table gives both bounds; the verdict uses the lower one. Every step
   stays inside one layer, so any such solve costs at least $L$ steps of at least 2
   evaluations: twice the Lie network's.

   **A different discretisation.** The models are trained as Lie splitting at
   $\\Delta t = 1$ (the pre-norm block: $u + A(N_1 u)$, then $+ F(N_2 \\cdot)$); a
   Runge–Kutta solve of the same controls integrates the unsplit equation
   $u' = A(N_1 u) + F(N_2 u)$, whose solution the trained network approximates only to
   first order in the step. Its loss is reported as measured, next to the fixed-step
   Runge–Kutta solve at one step per layer (`rk@1`) of the same solver.

**Reported** (`bench_depth_inference.json`, `bench_depth_inference.png`, two markdown
tables printed): per shape, method and $\\Delta t$, the validation loss's mean over the
seeds and its spread (min, max); per solver and tolerance the mean evaluations per input
(as a fraction of $L$) and the loss; and whether any tolerance reaches the $\\Delta t = 1$
loss (at most its mean plus the seeds' standard deviation; with one seed, the loss itself)
for fewer evaluations than $L$.

    python benchmarks/bench_depth_inference.py --runs runs/bench_multilevel
    python benchmarks/bench_depth_inference.py --tiny --runs runs/ml_tiny  # a tiny run first
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_multilevel import at_dt  # noqa: E402
from bench_nanogpt import FULL, GPT, TINY, _nats, itde_from_gpt, itde_val, stream  # noqa: E402

import itde  # noqa: E402
from itde.data import TokenCorpus  # noqa: E402

#: The fixed depth steps, coarse to fine.
DTS = (4.0, 2.0, 1.0, 0.5)
#: The embedded Runge–Kutta methods of the adaptive solves.
SOLVERS = {"heun": diffrax.Heun, "bosh3": diffrax.Bosh3, "tsit5": diffrax.Tsit5}
TOLS = (1e-1, 3e-2, 1e-2, 3e-3, 1e-3)
TINY_TOLS = (1e-1, 1e-3)


def stages(solver: diffrax.AbstractRungeKutta) -> int:
    """Field evaluations of one step of `solver`, its first-same-as-last stage counted."""
    return len(solver.tableau.c) + 1


def reused(solver: diffrax.AbstractRungeKutta) -> int:
    """Evaluations a step of `solver` may take from the step before (its first stage, for
    a first-same-as-last method, unless the step starts on a layer boundary): 1 or 0."""
    return int(solver.tableau.fsal)


def load_models(runs: Path, result: dict, vocab: int):
    """`(n_layers, seed, row, model)` for every model `bench_multilevel` saved (`row`: its
    method's row of the run)."""
    s = result["shape"]
    for run in result["runs"]:
        L, seed = run["n_layers"], run["seed"]
        skeleton = itde_from_gpt(GPT(vocab, s["context"], s["width"], L, s["n_heads"]))
        for row in run["methods"]:
            path = runs / "models" / f"L{L}_seed{seed}_{row['method']}.eqx"
            if not path.exists():
                raise FileNotFoundError(
                    f"{path} is missing: `--runs` must be a bench_multilevel output folder "
                    "written with its models (bench_multilevel.py saves them since it "
                    "writes `models/`); rerun bench_multilevel.py with `--out` there."
                )
            yield L, seed, row, eqx.tree_deserialise_leaves(path, skeleton)


@eqx.filter_jit
def _adaptive(model, x, solver, rtol, atol, terms=None):
    """Logits of each sequence of `x` solved on its own by `solver` under a PID
    controller, and its step counts."""
    u0 = model.initial_state(x)

    def one(u):
        # itde.solve clips the steps onto the layer boundaries (ClipStepSizeController with
        # jump_ts in the solve's time dtype)
        pid = diffrax.PIDController(rtol=rtol, atol=atol)
        sol = itde.solve(model.equation, u, solver=solver, dt0=1.0, terms=terms, throw=False,
                         stepsize_controller=pid)  # fmt: skip
        st = sol.stats
        return (sol.ys[-1], st["num_steps"], st["num_accepted_steps"],
                st["num_rejected_steps"], diffrax.is_successful(sol.result))  # fmt: skip

    u, n, acc, rej, ok = jax.vmap(one)(u0)
    return model.head(u), n, acc, rej, ok


def adaptive_val(model, chunks, solver, tol: float, terms=None) -> dict:
    """The validation loss of `model` solved adaptively (rtol = atol = `tol`) and the
    steps and field evaluations per input."""
    if not (isinstance(tol, float | int) and 0 < tol < 1):
        raise ValueError(f"`tol`={tol!r} must be a tolerance in (0, 1), e.g. 1e-2")
    L = model.equation.controls.n_layers
    total, count, steps, acc, rej, failed = 0.0, 0, [], [], [], 0
    for x, y in chunks:
        r = jnp.asarray(tol, jnp.float32)
        logits, n, a, j, ok = _adaptive(model, jnp.asarray(x), solver, r, r, terms)
        failed += int(np.sum(~np.asarray(ok)))
        total += _nats(np.asarray(logits), y) * len(x)
        count += len(x)
        steps += np.asarray(n).tolist()
        acc += np.asarray(a).tolist()
        rej += np.asarray(j).tolist()
    evals = [k * stages(solver) for k in steps]
    # a step that starts on a layer boundary (at least one per layer) reuses nothing
    fewest = statistics.mean(steps) * (stages(solver) - reused(solver)) + reused(solver) * L
    return {"tol": tol, "val": total / count if failed == 0 else float("nan"),
            "failed": failed, "steps": steps, "accepted": acc, "rejected": rej,
            "mean_steps": statistics.mean(steps), "mean_evals": statistics.mean(evals),
            "compute": statistics.mean(evals) / L,
            "compute_min": fewest / L}  # fmt: skip


def rk_fixed_val(model, chunks, solver) -> float:
    """The loss of `solver` at fixed steps of one layer on the unsplit equation."""

    @eqx.filter_jit
    def logits(model, x):
        u0 = model.initial_state(x)
        u = jax.vmap(lambda v: itde.solve(model.equation, v, solver=solver, dt0=1.0).ys[-1])(u0)
        return model.head(u)

    return sum(_nats(np.asarray(logits(model, jnp.asarray(x))), y) * len(x)
               for x, y in chunks) / sum(len(x) for x, _ in chunks)  # fmt: skip


def fixed_vals(model, chunks) -> dict[str, float]:
    """Lie at each of `DTS` the depth allows: loss by step."""
    L = model.equation.controls.n_layers
    return {str(dt): itde_val(model if dt == 1.0 else at_dt(model, dt), chunks)
            for dt in DTS if dt < 1 or L % round(dt) == 0}  # fmt: skip


def _spread(xs):
    return {"mean": statistics.mean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}  # fmt: skip


def summarise(rows: list[dict]) -> dict:
    """Means and spreads over the seeds, per shape and method."""
    out = {}
    for key in sorted({(r["n_layers"], r["method"]) for r in rows}):
        mine = [r for r in rows if (r["n_layers"], r["method"]) == key]
        fixed = {dt: _spread([r["fixed"][dt] for r in mine]) for dt in mine[0]["fixed"]}
        adaptive = {}
        for name in mine[0]["adaptive"]:
            adaptive[name] = {
                "rk@1": _spread([r["rk_fixed"][name] for r in mine]),
                "tols": [{"tol": a["tol"],
                          "val": _spread([r["adaptive"][name][i]["val"] for r in mine]),
                          "compute": _spread([r["adaptive"][name][i]["compute"] for r in mine]),
                          "compute_min": _spread([r["adaptive"][name][i]["compute_min"]
                                                  for r in mine]),
                          "failed": sum(r["adaptive"][name][i]["failed"] for r in mine)}
                         for i, a in enumerate(mine[0]["adaptive"][name])],
            }  # fmt: skip
        fine = fixed["1.0"]
        bar = fine["mean"] + fine["std"]
        wins = [(n, t["tol"]) for n, a in adaptive.items() for t in a["tols"]
                if t["val"]["mean"] <= bar and t["compute_min"]["mean"] < 1.0]  # fmt: skip
        out[f"{key[0]}/{key[1]}"] = {"n_layers": key[0], "method": key[1], "fixed": fixed,
                                     "adaptive": adaptive, "fine_bar": bar,
                                     "adaptive_reaches_fine_cheaper": wins}  # fmt: skip
    return out


def _range(t: dict) -> str:
    """Evaluations per input over L: the count, or its bounds for a first-same-as-last
    method (each step's reusable stage not counted, counted)."""
    lo, hi = t["compute_min"]["mean"], t["compute"]["mean"]
    return f"{hi:.2f}" if lo == hi else f"{lo:.2f}-{hi:.2f}"


def tables(summary: dict) -> str:
    """The two markdown tables and the verdicts."""
    dts = [str(d) for d in DTS]
    lines = ["| L / method | " + " | ".join(f"Δt = {float(d):g} ({1 / float(d):g}x)" for d in dts)
             + " |", "|---|" + "---|" * len(dts)]  # fmt: skip
    for key, v in summary.items():
        cells = []
        for d in dts:
            f = v["fixed"].get(d)
            span = f" [{f['min']:.4f}, {f['max']:.4f}]" if f and f["n"] > 1 else ""
            cells.append("-" if f is None else f"{f['mean']:.4f}{span}")
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| L / method | solver | tol | evals / L | loss | failed |",
        "|---|---|---|---|---|---|",
    ]
    for key, v in summary.items():
        lines.append(f"| {key} | lie | fixed Δt = 1 | 1.00 | {v['fixed']['1.0']['mean']:.4f} | 0 |")
        for name, a in v["adaptive"].items():
            st = stages(SOLVERS[name]())
            lines.append(
                f"| {key} | {name} | fixed Δt = 1 | {st:.2f} | {a['rk@1']['mean']:.4f} | 0 |"
            )
            for t in a["tols"]:
                lines.append(f"| {key} | {name} | {t['tol']:g} | {_range(t)} | "
                             f"{t['val']['mean']:.4f} | {t['failed']} |")  # fmt: skip
    lines.append("")
    for key, v in summary.items():
        w = v["adaptive_reaches_fine_cheaper"]
        lines.append(f"- {key}: " + (f"an adaptive solve reaches the Δt = 1 loss "
                     f"({v['fine_bar']:.4f}) for fewer evaluations: {w}" if w else
                     f"no adaptive solve reaches the Δt = 1 loss ({v['fine_bar']:.4f}) for "
                     "fewer evaluations than the Δt = 1 network"))  # fmt: skip
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({v["n_layers"] for v in summary.values()})
    fig, axes = plt.subplots(2, len(shapes), figsize=(6 * len(shapes), 8.5), squeeze=False)
    for j, L in enumerate(shapes):
        ax, bx = axes[0][j], axes[1][j]
        for v in (v for v in summary.values() if v["n_layers"] == L):
            dts = sorted(v["fixed"], key=float, reverse=True)
            x = [1 / float(d) for d in dts]
            y = [v["fixed"][d]["mean"] for d in dts]
            err = [[y[i] - v["fixed"][d]["min"] for i, d in enumerate(dts)],
                   [v["fixed"][d]["max"] - y[i] for i, d in enumerate(dts)]]  # fmt: skip
            lw = 2.5 if v["method"] == "discrete" else 1.2
            ax.errorbar(x, y, yerr=err, marker="o", lw=lw, capsize=3, label=v["method"])
            bx.plot(x, y, marker="o", lw=lw, label=f"{v['method']} lie")
            for name, a in v["adaptive"].items():
                bx.plot([t["compute"]["mean"] for t in a["tols"]],
                        [t["val"]["mean"] for t in a["tols"]], marker="x", ls="--", lw=0.8,
                        label=f"{v['method']} {name} adaptive")  # fmt: skip
                bx.plot([stages(SOLVERS[name]())], [a["rk@1"]["mean"]], marker="s", ls="",
                        color=bx.lines[-1].get_color())  # fmt: skip
        titles = ("Lie at Δt = 4, 2, 1, 1/2 (mean over seeds, min-max)",
                  "adaptive RK (x: tolerances; square: RK at Δt = 1)")  # fmt: skip
        for a_, title in zip((ax, bx), titles, strict=True):
            a_.set(xscale="log", title=f"{L} layers: {title}",
                   xlabel="field evaluations / the Δt = 1 network's",
                   ylabel="validation loss (nats/char)")  # fmt: skip
            lo, hi = a_.get_xlim()
            ticks = [t for t in (0.25, 0.5, 1, 2, 4, 8, 16, 32) if lo <= t <= hi]
            a_.set_xticks(ticks, [f"{t:g}" for t in ticks])
            a_.minorticks_off()
            a_.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", default="runs/bench_multilevel", help="bench_multilevel's --out")
    ap.add_argument("--out", help="where to write (default: --runs)")
    ap.add_argument("--solvers", nargs="+", choices=list(SOLVERS), default=list(SOLVERS))
    ap.add_argument("--tols", type=float, nargs="+", help=f"default {TOLS} (tiny {TINY_TOLS})")
    ap.add_argument("--glob", default="*_gut.txt", help="as given to bench_multilevel")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument(
        "--tiny",
        action="store_true",
        help="fewer tolerances; runs bench_multilevel --tiny first if --runs has no run",
    )
    a = ap.parse_args(argv)
    for t in a.tols or ():
        if not 0 < t < 1:
            raise SystemExit(f"--tols {t}: each tolerance must lie in (0, 1), e.g. 1e-2")
    runs = Path(a.runs)
    found = runs / "bench_multilevel.json"
    if not found.exists() and a.tiny:
        import bench_multilevel

        bench_multilevel.main(["--tiny", "--layers", "4", "--steps", "4", "--eval-every",
                               "2", "--methods", "discrete", "ml-2x-50", "--out",
                               str(runs)])  # fmt: skip
    if not found.exists():
        raise SystemExit(
            f"--runs {runs}: no bench_multilevel.json there; give the --out of a finished "
            "bench_multilevel.py run (or --tiny to make a tiny one)"
        )
    result = json.loads(found.read_text())
    corpus = TokenCorpus.from_path(result["corpus"]["source"], glob=a.glob,
                                   cache_dir=a.cache_dir, progress=False)  # fmt: skip
    if corpus.sha256 != result["corpus"]["sha256"]:
        raise SystemExit(f"the corpus {result['corpus']['source']} (--glob {a.glob!r}) is not "
                         "the run's (sha256 differs): pass the run's --glob")  # fmt: skip
    s = {**(TINY if result["tiny"] else FULL), **result["shape"], "steps": result["steps"]}
    tols = a.tols or (TINY_TOLS if a.tiny else TOLS)
    rows = []
    for L, seed, row, model in load_models(runs, result, corpus.vocab_size):
        _, chunks = stream(corpus, {**s, "n_layers": L}, seed)
        mine = {"n_layers": L, "seed": seed, "method": row["method"],
                "final_val": row["final_val"], "fixed": fixed_vals(model, chunks),
                "rk_fixed": {}, "adaptive": {}}  # fmt: skip
        for name in a.solvers:
            solver = SOLVERS[name]()
            mine["rk_fixed"][name] = rk_fixed_val(model, chunks, solver)
            mine["adaptive"][name] = [adaptive_val(model, chunks, solver, t) for t in tols]
        rows.append(mine)
        print(f"  L={L} seed {seed} {row['method']:<16} lie "
              + "  ".join(f"dt {float(d):g}: {v:.4f}" for d, v in mine["fixed"].items())
              + "".join(f"  | {n} rk@1 {mine['rk_fixed'][n]:.4f} "
                        + " ".join(f"{t['tol']:g}: {t['val']:.4f}@{t['compute']:.2f}"
                                   for t in mine["adaptive"][n]) for n in a.solvers),
              flush=True)  # fmt: skip
    summary = summarise(rows)
    text = tables(summary)
    print(text)
    out = Path(a.out) if a.out else runs
    out.mkdir(parents=True, exist_ok=True)
    res = {"runs": str(runs), "tiny": result["tiny"], "dts": DTS, "tols": list(tols),
           "solvers": {n: stages(SOLVERS[n]()) for n in a.solvers}, "summary": summary,
           "rows": rows, "table": text}  # fmt: skip
    (out / "bench_depth_inference.json").write_text(json.dumps(res, indent=2))
    plot(summary, out / "bench_depth_inference.png")
    print(f"wrote {out / 'bench_depth_inference.json'} and {out / 'bench_depth_inference.png'}")
    return res


if __name__ == "__main__":
    main()
