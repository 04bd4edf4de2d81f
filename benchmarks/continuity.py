"""Models that stay continuous: the `[continuity]` options against none, side by side.

The `sort` task trained with a continuous-depth model (Legendre controls, projected RK4 at
`dt = 1`, the case where a model reached 0.990 accuracy with logits 1.09, relative, away from
its own equation at dt = 1/256) four times from the same seed and data stream: without
options, with the consistency term, with the transport cost, with both. For each: the
held-out accuracy, the relative distance of the held-out logits to those at dt/8
(`eval_continuum_distance`, what training logs) and to those at dt/256, the transport cost
of the trained flow, and the seconds per training step (the last third of the run, compiled)
as a ratio to the run without options (measured in the same process, one after the other).

    python benchmarks/continuity.py --steps 1500 --seeds 0 1 2   # the README's table
    python benchmarks/continuity.py --tiny          # seconds: the shape of the table

Writes `continuity.json` and prints a markdown table (`--out`, default
`runs/bench_continuity`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from itde.train import (
    Run,
    TrainExperiment,
    continuity_metrics,
    from_dict,
    predict,
    train,
    with_depth,
)

OPTIONS = {
    "none": {},
    "consistency": {"consistency": 1.0},
    "transport": {"transport": 0.01},
    "both": {"consistency": 1.0, "transport": 0.01},
}


def config(steps: int, tiny: bool, continuity: dict, seed: int = 0) -> TrainExperiment:
    width = 8 if tiny else 32
    table = {
        "task": {"name": "sort", "length": 5 if tiny else 8, "vocab": 6 if tiny else 10,
                 "eval_size": 16 if tiny else 512},
        "model": {"n_layers": 2, "n_features": width, "n_heads": 2 if tiny else 4,
                  "n_hidden": 2 * width, "activation": "gelu", "scheme": "rk4", "dt": 1.0,
                  "n_modes": 3, "eps": 0.0},
        "optim": {"lr": 3e-3, "warmup": min(100, steps // 4), "steps": steps,
                  "batch_size": 8 if tiny else 64, "seed": seed},
        "run": {"log_every": max(1, steps // 3), "eval_every": steps, "checkpoint_every": steps,
                "progress": False},
        "continuity": {"refine": 8, **continuity},
    }  # fmt: skip
    return from_dict(TrainExperiment, table)


def measure(name: str, cfg: TrainExperiment, out: Path) -> dict:
    t0 = time.perf_counter()
    r = train(cfg, out=out / f"{name}-seed{cfg.optim.seed}", overwrite=True)
    wall = time.perf_counter() - t0
    run = Run(cfg)
    x = jnp.concatenate([c[0] for c in run.eval_chunks()])
    model = r.model
    fine = np.asarray(predict(with_depth(model, dt=model.dt / 256), x))
    coarse = np.asarray(predict(model, x))
    m = continuity_metrics(model, x, 8)
    return {
        "option": name,
        "seed": cfg.optim.seed,
        "continuity": {
            "consistency": cfg.continuity.consistency,
            "transport": cfg.continuity.transport,
        },  # fmt: skip
        "eval_seq_acc": r.metrics["eval_seq_acc"],
        "eval_token_acc": r.metrics["eval_token_acc"],
        "distance_dt_over_8": m["eval_continuum_distance"],
        "distance_dt_over_256": float(np.linalg.norm(coarse - fine) / np.linalg.norm(fine)),
        "transport": m["eval_transport"],
        "train_wall_s": wall,
        # the last logged window's rate: compiled steps only (the first step compiles)
        "s_per_step": cfg.optim.batch_size / r.metrics["examples_per_s"],
    }


def table(rows: list[dict]) -> str:
    """Per option: the mean over seeds (and the range, with more than one seed)."""
    names = list(dict.fromkeys(r["option"] for r in rows))
    by = {n: [r for r in rows if r["option"] == n] for n in names}
    base = np.mean([r["s_per_step"] for r in by[names[0]]])

    def cell(rs, key, fmt):
        v = np.asarray([r[key] for r in rs], dtype=float)
        if len(v) == 1:
            return format(v[0], fmt)
        return f"{format(v.mean(), fmt)} [{format(v.min(), fmt)}, {format(v.max(), fmt)}]"

    lines = [
        "| option | seq. accuracy | distance to dt/8 | distance to dt/256 | transport "
        "| time/step vs none |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        rs = by[n]
        ratio = np.mean([r["s_per_step"] for r in rs]) / base
        lines.append(
            f"| {n} | {cell(rs, 'eval_seq_acc', '.3f')} | {cell(rs, 'distance_dt_over_8', '.3g')} "
            f"| {cell(rs, 'distance_dt_over_256', '.3g')} | {cell(rs, 'transport', '.3g')} "
            f"| {ratio:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="training steps per run (default 600)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (default 0)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run of the same shape")
    p.add_argument("--out", default="runs/bench_continuity", help="output directory")
    args = p.parse_args(argv)
    steps = 4 if args.tiny else args.steps
    if steps < 1:
        p.error(f"argument --steps: must be a positive number of steps, got {steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for name, options in OPTIONS.items():
            rows.append(measure(name, config(steps, args.tiny, options, seed), out))
            shown = {k: v for k, v in rows[-1].items() if k != "continuity"}
            print(f"{name}, seed {seed}: {json.dumps(shown)}")
            sys.stdout.flush()
    result = {"steps": steps, "seeds": args.seeds, "tiny": args.tiny, "jax": jax.__version__,
              "rows": rows}  # fmt: skip
    (out / "continuity.json").write_text(json.dumps(result, indent=1))
    print(table(rows))
    if args.tiny:
        print("tiny run: a few steps of a small model; the numbers say nothing of the options.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
