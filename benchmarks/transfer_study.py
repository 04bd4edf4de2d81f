"""Transfer study: train once at a coarse depth step and token grid, evaluate finer.

A model trained through a continuous-depth scheme (default projected Heun, controls
smooth in depth: `LegendreControls`) approximates one continuum map u0 -> u(T), so
evaluated with a smaller depth step `dt`, or (burgers) on a finer token grid of the
periodic domain [0, 2pi) (attention is a PeriodicTrapezoid quadrature of an integral),
its prediction should converge: the change between successive refinements shrinks at
the scheme's order in dt (2 for Heun) and spectrally in the grid. Whether the limit is
as accurate as the trained model depends on how accurate the training step was (the
weights can learn to compensate a coarse step's error; see benchmarks/README.md).
A discrete Lie model (the Transformer regime: per-layer controls, one post-LN block per
layer at dt = 1) trained on the same data and grid is evaluated the same way for
contrast: refining its grid works (same integral), refining its dt does not (dt = 1
*is* the trained map; a smaller dt is another network).

1. `burgers` (configs/burgers.toml: 3 layers, width 64, heads 4, hidden 128, gelu), the
   token grid coarsened to `--grid` points, `--steps` steps for both models (fewer than
   the shipped 3000). Eval on `--eval-size` held-out fields generated once on the
   finest grid and restricted to the coarser ones (every 2nd / 4th point), so a grid
   refinement changes only the quadrature, not the functions. Refinement factors
   1, 2, 4 (`--levels 3`): along dt (grid fixed), along the grid (dt fixed), jointly.
2. `sort` (configs/sort.toml, `--sort-steps` steps; skipped by `--no-sort`): tokens
   are discrete, so only dt is refined.

Columns: `error` (burgers: mean relative L2 of u(t_f); sort: 1 - whole-sequence
accuracy), `d_error` (error minus the previous level's), `change` (the prediction's own
change from the previous level, mean over examples of ||p_k - p_{k-1}|| / ||target||
(burgers, compared on the coarser grid's points) or / ||logits_{k-1}|| (sort)),
`order` = log2(change_{k-1} / change_k). The `itde eval --grid N` route (fresh data
generated on N points, as `itde.train.Burgers.on_grid`) is recorded too (`cli_grid`).

    python benchmarks/transfer_study.py [--scheme heun --dt 0.5 --grid 32 --steps 1500
                                         --levels 3 --sort-steps 1500 --no-sort
                                         --out runs/transfer_study]

Writes `<out>/transfer_study.json`, `<out>/transfer_study.png` and, per model, the
training run (`<out>/<task>_<model>/`: checkpoint, metrics.jsonl, loss_curve.png).
`--reuse` restores a finished checkpoint of the same config instead of retraining.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from itde.train import (
    Run,
    TrainExperiment,
    evaluate,
    from_dict,
    load,
    predict,
    to_dict,
    train,
    with_depth,
)
from itde.train import read_checkpoint_meta as read_meta

predict_jit = eqx.filter_jit(predict)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


# ----------------------------------------------------------------------------- training
def make_config(path, *, scheme, dt, n_modes, steps, task=None, out="") -> TrainExperiment:
    d = to_dict(load(TrainExperiment, path))
    if scheme == "lie":
        d["model"].update(scheme="lie", dt=dt, n_modes=None)
    else:
        d["model"].update(scheme=scheme, dt=dt, n_modes=n_modes, eps=None)
    d["task"].update(task or {})
    d["optim"]["steps"] = steps
    d["optim"]["warmup"] = min(d["optim"]["warmup"], steps // 5)
    d["run"].update(progress=False, out=out, checkpoint_every=steps)
    return from_dict(TrainExperiment, d, f"{path} (transfer study)")


def get_model(cfg: TrainExperiment, out: Path, reuse: bool):
    """Train (or, with `reuse`, restore a finished run of the same config)."""
    if reuse and (out / "checkpoint.json").is_file():
        meta = read_meta(out)
        if meta["config"] == to_dict(cfg) and meta["step"] == cfg.optim.steps:
            model, _, meta = Run(cfg).restore(out, meta)
            log(f"restored {out} (step {meta['step']})")
            return model, {"reused": True, "wall_s": meta.get("wall_s")}
    log(f"training {out.name}: {cfg.model.scheme} dt={cfg.model.dt}, {cfg.optim.steps} steps")
    s = train(cfg, out=out, overwrite=True, progress=False)
    m = {k: v for k, v in s.metrics.items() if k not in ("lr",)}
    log(f"trained {out.name} in {s['wall_s']:.1f} s: {json.dumps(m)}")
    return s.model, {"reused": False, "wall_s": s.wall_s, "final": m}


def check_steps(layers: int, dt: float) -> None:
    n = layers / dt
    if abs(n - round(n)) > 1e-9:
        raise SystemExit(f"dt={dt} does not divide the depth T={layers} into whole steps")


# ----------------------------------------------------------------------------- burgers
def burgers_eval_set(cfg: TrainExperiment, n_fine: int, size: int):
    """Held-out (u0, u(t_f)) on `n_fine` points, from the run's own eval keys."""
    run = Run(cfg)
    data = run.task.on_grid(n_fine)
    bs = cfg.optim.batch_size
    parts = [
        data.eval_batch(jax.random.fold_in(run.eval_key, i), bs)
        for i in range(math.ceil(size / bs))
    ]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def rel_l2(p, y) -> float:
    return float(np.mean(np.linalg.norm(p - y, axis=-1) / np.linalg.norm(y, axis=-1)))


def burgers_study(model, cfg, name, levels, x_fine, y_fine, n_fine):
    """Rows for the base point and the dt / grid / joint refinements of one model."""
    dt0, n0 = float(cfg.model.dt), cfg.task.n_grid
    cache: dict = {}

    def pred(dt, n):
        if (dt, n) not in cache:
            check_steps(cfg.model.n_layers, dt)
            r = n_fine // n
            out = predict_jit(with_depth(model, None, dt), x_fine[:, ::r])
            cache[dt, n] = np.asarray(out)
        return cache[dt, n]

    rows = []
    for axis in ("dt", "grid", "joint"):
        prev = None
        for k in range(levels):
            f = 2**k
            if k == 0 and axis != "dt":
                prev = (dt0, n0, pred(dt0, n0))
                continue
            dt = dt0 / f if axis in ("dt", "joint") else dt0
            n = n0 * f if axis in ("grid", "joint") else n0
            p = pred(dt, n)
            y = y_fine[:, :: n_fine // n]
            row = {"task": "burgers", "model": name, "axis": "base" if k == 0 else axis,
                   "factor": f, "dt": dt, "grid": n, "error": rel_l2(p, y)}  # fmt: skip
            if prev is not None:
                pdt, pn, pp = prev
                s = n // pn  # compare on the coarser (previous) grid's points
                yc = y_fine[:, :: n_fine // pn]
                row["change"] = float(
                    np.mean(np.linalg.norm(p[:, ::s] - pp, axis=-1) / np.linalg.norm(yc, axis=-1))
                )
            prev = (dt, n, p)
            rows.append(row)
            log(f"burgers {name}: {row['axis']} x{f} dt={dt:g} grid={n} "
                f"rel_l2={row['error']:.4g}")  # fmt: skip
    return rows


def cli_grid(model, cfg, grids, size):
    """`itde eval --checkpoint DIR --grid N --size SIZE` for each N, via the same code."""
    run = Run(cfg)
    out = {}
    for n in grids:
        task = run.task.on_grid(n)
        out[str(n)] = evaluate(model, run.eval_chunks(size, task), task, run.compute_dtype)[
            "eval_rel_l2"
        ]
    return out


# ----------------------------------------------------------------------------- sort
def sort_study(model, cfg, name, levels, size):
    run = Run(cfg)
    chunks = list(_sort_chunks(run, size))
    x, y = np.concatenate([c[0] for c in chunks]), np.concatenate([c[1] for c in chunks])
    dt0 = float(cfg.model.dt)
    rows, prev = [], None
    for k in range(levels):
        dt = dt0 / 2**k
        check_steps(cfg.model.n_layers, dt)
        logits = np.asarray(predict_jit(with_depth(model, None, dt), x))
        hit = logits.argmax(-1) == y
        row = {"task": "sort", "model": name, "axis": "base" if k == 0 else "dt",
               "factor": 2**k, "dt": dt, "grid": None, "error": 1.0 - float(hit.all(-1).mean()),
               "token_error": 1.0 - float(hit.mean())}  # fmt: skip
        if prev is not None:
            num = np.linalg.norm((logits - prev).reshape(len(x), -1), axis=-1)
            row["change"] = float(np.mean(num / np.linalg.norm(prev.reshape(len(x), -1), axis=-1)))
        prev = logits
        rows.append(row)
        log(f"sort {name}: dt={dt:g} seq_error={row['error']:.4g}")
    return rows


def _sort_chunks(run, size):
    bs = run.cfg.optim.batch_size
    for i in range(math.ceil(size / bs)):
        yield run.task.eval_batch(jax.random.fold_in(run.eval_key, i), bs)


# ----------------------------------------------------------------------------- output
def add_derived(rows):
    """d_error and order, per (task, model, axis) line (the base row starts each line)."""
    by = {}
    for r in rows:
        by.setdefault((r["task"], r["model"]), []).append(r)
    for group in by.values():
        base = next(r for r in group if r["axis"] == "base")
        for axis in {r["axis"] for r in group} - {"base"}:
            line = [base] + sorted((r for r in group if r["axis"] == axis),
                                   key=lambda r: r["factor"])  # fmt: skip
            for a, b in zip(line, line[1:]):
                b["d_error"] = b["error"] - a["error"]
                ca, cb = a.get("change"), b.get("change")
                if ca and cb and cb > 0:
                    b["order"] = math.log2(ca / cb)


def fmt(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None else format(v, spec)


def table(rows) -> str:
    head = (f"{'task':8} {'model':14} {'axis':5} {'factor':>6} {'dt':>7} {'grid':>5} "
            f"{'error':>9} {'d_error':>10} {'change':>9} {'order':>6}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['task']:8} {r['model']:14} {r['axis']:5} {r['factor']:>6} {r['dt']:>7.4g} "
            f"{fmt(r['grid'], '>5', 5)} {r['error']:>9.4g} {fmt(r.get('d_error'), '>+10.2e', 10)} "
            f"{fmt(r.get('change'), '>9.2e', 9)} {fmt(r.get('order'), '>6.2f', 6)}"
        )
    return "\n".join(lines)


def plot(rows, path: Path, levels: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in rows}, key=["burgers", "sort"].index)
    fig, axes = plt.subplots(1, 1 + len(tasks), figsize=(5.2 * (1 + len(tasks)), 4.2))
    style = {"dt": "-o", "grid": "--s", "joint": ":^"}
    for ax_i, task in enumerate(tasks):
        for kind, ax in (("error", axes[ax_i]), ("change", axes[-1])):
            if kind == "change" and task != "burgers":
                continue
            group = [r for r in rows if r["task"] == task]
            for model in dict.fromkeys(r["model"] for r in group):
                base = next(r for r in group if r["model"] == model and r["axis"] == "base")
                for axis in ("dt", "grid", "joint"):
                    line = [r for r in group if r["model"] == model and r["axis"] == axis]
                    if not line:
                        continue
                    pts = ([] if kind == "change" else [base]) + line
                    ax.plot([r["factor"] for r in pts], [r.get(kind, np.nan) for r in pts],
                            style[axis], label=f"{model}: {axis}")  # fmt: skip
    for i, task in enumerate(tasks):
        ax = axes[i]
        ax.set_title(f"{task}: error vs refinement (trained at 1)")
        ax.set_ylabel("relative L2 error" if task == "burgers" else "1 - sequence accuracy")
    axes[-1].set_title("burgers: change from the previous level")
    axes[-1].set_ylabel("mean ||p_k - p_{k-1}|| / ||u||")
    for i, ax in enumerate(axes):
        ax.set_xscale("log", base=2)
        if i < len(tasks) and tasks[i] == "sort":  # an error of 0 is possible
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
        else:
            ax.set_yscale("log")
        ax.set_xticks([2**k for k in range(levels)], [str(2**k) for k in range(levels)])
        ax.set_xlabel("refinement factor (dt / f, grid x f)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--burgers-config", default="configs/burgers.toml")
    p.add_argument("--sort-config", default="configs/sort.toml")
    p.add_argument("--scheme", default="heun", help="continuous-depth scheme (SCHEMES name)")
    p.add_argument("--dt", type=float, default=0.5, help="training dt of the continuous model")
    p.add_argument("--n-modes", type=int, default=2, help="Legendre modes in depth")
    p.add_argument("--grid", type=int, default=32, help="burgers training token grid")
    p.add_argument("--steps", type=int, default=1500, help="burgers training steps (each model)")
    p.add_argument("--sort-steps", type=int, default=1500)
    p.add_argument("--levels", type=int, default=3, help="refinement factors 1, 2, ..., 2^(L-1)")
    p.add_argument("--eval-size", type=int, default=256, help="burgers held-out fields")
    p.add_argument("--sort-eval-size", type=int, default=2048)
    p.add_argument("--no-sort", action="store_true")
    p.add_argument("--reuse", action="store_true", help="restore finished runs of equal config")
    p.add_argument("--out", default="runs/transfer_study")
    a = p.parse_args(argv)
    if a.scheme == "lie":
        raise SystemExit("--scheme is the continuous model's; the Lie model is always trained")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, runs = [], {}
    cont = f"{a.scheme} dt={a.dt:g}"

    # burgers
    n_fine = a.grid * 2 ** (a.levels - 1)
    x_fine = y_fine = None
    for name, scheme, dt in ((cont, a.scheme, a.dt), ("lie dt=1", "lie", 1.0)):
        cfg = make_config(a.burgers_config, scheme=scheme, dt=dt, n_modes=a.n_modes,
                          steps=a.steps, task={"n_grid": a.grid})  # fmt: skip
        check_steps(cfg.model.n_layers, dt)
        run_dir = out / f"burgers_{scheme}"
        model, info = get_model(cfg, run_dir, a.reuse)
        if x_fine is None:
            x_fine, y_fine = burgers_eval_set(cfg, n_fine, a.eval_size)
            log(f"burgers eval set: {x_fine.shape[0]} fields on {n_fine} points")
        rows += burgers_study(model, cfg, name, a.levels, x_fine, y_fine, n_fine)
        grids = [a.grid * 2**k for k in range(a.levels)]
        info["cli_grid"] = cli_grid(model, cfg, grids, a.eval_size)
        log(f"burgers {name}: itde eval --grid route {info['cli_grid']}")
        runs[f"burgers/{name}"] = {"dir": str(run_dir), "config": to_dict(cfg), **info}

    # sort
    if not a.no_sort:
        for name, scheme, dt in ((cont, a.scheme, a.dt), ("lie dt=1", "lie", 1.0)):
            cfg = make_config(a.sort_config, scheme=scheme, dt=dt, n_modes=a.n_modes,
                              steps=a.sort_steps)  # fmt: skip
            run_dir = out / f"sort_{scheme}"
            model, info = get_model(cfg, run_dir, a.reuse)
            rows += sort_study(model, cfg, name, a.levels, a.sort_eval_size)
            runs[f"sort/{name}"] = {"dir": str(run_dir), "config": to_dict(cfg), **info}

    add_derived(rows)
    text = table(rows)
    wall = time.perf_counter() - T0
    result = {
        "args": vars(a),
        "wall_s": wall,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "runs": runs,
        "rows": rows,
    }
    (out / "transfer_study.json").write_text(json.dumps(result, indent=2))
    plot(rows, out / "transfer_study.png", a.levels)
    print()
    print(text)
    print()
    for key, r in runs.items():
        if "cli_grid" in r:
            print(f"itde eval --grid route ({key}, training dt): "
                  + ", ".join(f"N={n}: {v:.4g}" for n, v in r["cli_grid"].items()))  # fmt: skip
    print(f"\nwrote {out}/transfer_study.json and {out}/transfer_study.png ({wall:.0f} s)")


if __name__ == "__main__":
    main()
