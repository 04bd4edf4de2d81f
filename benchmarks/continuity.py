"""Models that stay continuous: the `[continuity]` options against none, side by side.

The `sort` task trained with a continuous-depth model (Legendre controls, projected RK4 at
`dt = 1`, the case where a model reached 0.990 accuracy with logits 1.09, relative, away from
its own equation at dt = 1/256) four times from the same seed and data stream: without
options, with the consistency term, with the transport cost, with both. For each: the
held-out accuracy, the relative distance of the held-out logits to those at dt/8
(`eval_continuum_distance`, what training logs) and to those at dt/256, the transport cost
of the trained flow, and the seconds per training step (the last third of the run, compiled)
as a ratio to the run without options (measured in the same process, one after the other).

    python benchmarks/continuity.py                 # 4 runs of --steps 600 (see README)
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


def config(steps: int, tiny: bool, continuity: dict) -> TrainExperiment:
    width = 8 if tiny else 32
    table = {
        "task": {"name": "sort", "length": 5 if tiny else 8, "vocab": 6 if tiny else 10,
                 "eval_size": 16 if tiny else 512},
        "model": {"n_layers": 2, "n_features": width, "n_heads": 2 if tiny else 4,
                  "n_hidden": 2 * width, "activation": "gelu", "scheme": "rk4", "dt": 1.0,
                  "n_modes": 3, "eps": 0.0},
        "optim": {"lr": 3e-3, "warmup": min(100, steps // 4), "steps": steps,
                  "batch_size": 8 if tiny else 64, "seed": 0},
        "run": {"log_every": max(1, steps // 3), "eval_every": steps, "checkpoint_every": steps,
                "progress": False},
        "continuity": {"refine": 8, **continuity},
    }  # fmt: skip
    return from_dict(TrainExperiment, table)


def measure(name: str, cfg: TrainExperiment, out: Path) -> dict:
    t0 = time.perf_counter()
    r = train(cfg, out=out / name, overwrite=True)
    wall = time.perf_counter() - t0
    run = Run(cfg)
    x = jnp.concatenate([c[0] for c in run.eval_chunks()])
    model = r.model
    fine = np.asarray(predict(with_depth(model, dt=model.dt / 256), x))
    coarse = np.asarray(predict(model, x))
    m = continuity_metrics(model, x, 8)
    return {
        "option": name,
        "continuity": {"consistency": cfg.continuity.consistency,
                       "transport": cfg.continuity.transport},  # fmt: skip
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
    base = rows[0]["s_per_step"]
    lines = [
        "| option | seq. accuracy | token accuracy | distance to dt/8 | distance to dt/256 "
        "| transport | time/step vs none |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['option']} | {r['eval_seq_acc']:.3f} | {r['eval_token_acc']:.3f} | "
            f"{r['distance_dt_over_8']:.3g} | {r['distance_dt_over_256']:.3g} | "
            f"{r['transport']:.3g} | {r['s_per_step'] / base:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="training steps per run (default 600)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long run of the same shape")
    p.add_argument("--out", default="runs/bench_continuity", help="output directory")
    args = p.parse_args(argv)
    steps = 4 if args.tiny else args.steps
    if steps < 1:
        p.error(f"argument --steps: must be a positive number of steps, got {steps}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, options in OPTIONS.items():
        rows.append(measure(name, config(steps, args.tiny, options), out))
        print(f"{name}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'continuity'})}")
        sys.stdout.flush()
    result = {"steps": steps, "tiny": args.tiny, "jax": jax.__version__, "rows": rows}
    (out / "continuity.json").write_text(json.dumps(result, indent=1))
    print(table(rows))
    if args.tiny:
        print("tiny run: a few steps of a small model; the numbers say nothing of the options.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
