"""Conversion and forward at 0.5-1B parameters: `itde.from_hf` against transformers.

For each shape (a causal LM built from a public config with random weights: Qwen2.5-0.5B's
and Llama-3.2-1B's, `tests/fixtures/hf_scale/*.json`) and each dtype (float32, bfloat16:
`model.bfloat16()`), a fresh process builds the transformers model, then measures

- `convert_peak_bytes`: the peak resident memory of `itde.from_hf(model)` above the process's
  memory once the transformers model is built (`/proc/self/status` VmHWM after resetting it
  through `/proc/self/clear_refs`; NumPy's and XLA's buffers are outside Python's allocator, so
  `tracemalloc` would not see them), and `convert_ratio`, that peak over the model's own bytes
  (its parameters, a tied head counted once);
- `forward_s`: the median time of the last hidden state of one sequence of `--tokens`
  tokens, itde (`jax.jit` of the converted base model, compiled first, its compile time
  apart) and transformers (`model.model(...)` under `torch.no_grad()`), in interleaved
  rounds; `forward_peak_bytes`: each forward's peak memory above the memory before it;
- `max_abs_diff`: the two last hidden states' largest difference (float32: round-off;
  bfloat16: both round at bfloat16's 2**-8);
- `error_vs_float32` (bfloat16 rows): each side's largest error against the exact network
  (the same rounded weights run by transformers in float32), for the last hidden state, the
  logits and the hidden state after each layer but the last: which side a difference
  comes from.

    python benchmarks/bench_hf_scale.py                  # both shapes, both dtypes (~10 min)
    python benchmarks/bench_hf_scale.py --shapes qwen2.5-0.5b --dtypes bfloat16
    python benchmarks/bench_hf_scale.py --tiny           # tiny widths of both configs (tested)

Writes `runs/hf_scale/hf_scale.json` (`--out`). Linux only (reads `/proc`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "fixtures" / "hf_scale"
SHAPES = ("qwen2.5-0.5b", "llama-3.2-1b")
DTYPES = ("float32", "bfloat16")
# --tiny: the same configs (architecture, rope scaling, grouped-query ratio, tied head) at
# tiny widths
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset VmHWM to the current resident size; returns that size."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def config_dict(shape: str, tiny: bool) -> dict:
    cfg = json.loads((CONFIGS / f"{shape}.json").read_text())
    if tiny:
        cfg.update(TINY)
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = TINY["num_hidden_layers"]
    return cfg


def measure(shape: str, dtype: str, tokens: int, repeats: int, tiny: bool) -> dict:
    """One (shape, dtype) in this process: conversion memory, forward time and memory."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    import itde

    cfg = config_dict(shape, tiny)
    cls = getattr(transformers, cfg["architectures"][0])
    torch.manual_seed(0)
    t = time.perf_counter()
    model = cls(cls.config_class.from_dict(cfg)).to(getattr(torch, dtype)).eval()
    build_s = time.perf_counter() - t
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    model_bytes = sum(p.numel() * p.element_size() for p in params)
    jnp.zeros(1).block_until_ready()  # the backend's own memory is not the conversion's

    base = _reset_peak()
    t = time.perf_counter()
    m = jax.block_until_ready(itde.from_hf(model))
    convert_s = time.perf_counter() - t
    convert_peak = _status("VmHWM") - base

    ids = np.random.default_rng(0).integers(0, cfg["vocab_size"], tokens)
    forward = jax.jit(lambda base, x: base(x))
    t = time.perf_counter()
    ours = np.asarray(forward(m.base, jnp.asarray(ids)).astype(jnp.float32))
    compile_s = time.perf_counter() - t
    x = torch.as_tensor(ids)[None]
    with torch.no_grad():
        theirs = model.model(x).last_hidden_state[0].float().numpy()

    def run_itde():
        forward(m.base, jnp.asarray(ids)).block_until_ready()

    def run_torch():
        with torch.no_grad():
            model.model(x)

    times = {"itde": [], "transformers": []}
    peaks = {"itde": 0, "transformers": 0}
    for r in range(repeats):  # interleaved, the order alternating
        order = (("itde", run_itde), ("transformers", run_torch))
        for name, fn in order if r % 2 == 0 else order[::-1]:
            before = _reset_peak()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            peaks[name] = max(peaks[name], _status("VmHWM") - before)
    fwd = {k: statistics.median(v) for k, v in times.items()}
    record = {
        "shape": shape + (" (tiny)" if tiny else ""),
        "dtype": dtype,
        "parameters": sum(p.numel() for p in params),
        "model_bytes": model_bytes,
        "build_s": build_s,
        "convert_s": convert_s,
        "convert_peak_bytes": convert_peak,
        "convert_ratio": convert_peak / model_bytes,
        "tokens": tokens,
        "compile_s": compile_s,
        "forward_s": fwd,
        "forward_ratio_itde_over_transformers": fwd["itde"] / fwd["transformers"],
        "forward_peak_bytes": peaks,
        "max_abs_diff": float(np.max(np.abs(ours - theirs))),
        "output_scale": float(np.max(np.abs(theirs))),
    }
    if dtype != "float32":
        record["error_vs_float32"] = _errors_vs_float32(model, m, ids, ours, theirs)
    return record


def _errors_vs_float32(model, m, ids, ours, theirs) -> dict:
    """Each side's largest error against the exact network: the same (rounded) weights
    run by transformers in float32 (`model.float()`, after the timings), for the last
    hidden state, the logits, and the hidden state after each layer but the last (itde's
    `trajectory`, transformers' `output_hidden_states`; the last comes back normalised),
    with the exact values' largest magnitude (`scale`): which side a difference of the two
    comes from."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    ids_j = jnp.asarray(ids)
    ours_logits = np.asarray(jax.jit(lambda lm, x: lm(x))(m, ids_j).astype(jnp.float32))
    traj = jax.jit(lambda eq, u: eq.trajectory(u))(m.base.equation, m.base.embed(ids_j))
    ours_layers = np.asarray(traj.astype(jnp.float32))
    x = torch.as_tensor(ids)[None]
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
        theirs_logits = out.logits[0].float().numpy()
        theirs_layers = [h[0].float().numpy() for h in out.hidden_states]
        model.float()
        exact = model(x, output_hidden_states=True)
    # hidden_states: the embeddings, the input of each layer, then the final norm's output
    exact_layers = [h[0].numpy() for h in exact.hidden_states]
    exact_hidden, exact_logits = exact_layers[-1], exact.logits[0].numpy()

    def err(a, b):
        return float(np.max(np.abs(a - b)))

    inner = range(1, len(exact_layers) - 1)
    return {
        "hidden": {"itde": err(ours, exact_hidden), "transformers": err(theirs, exact_hidden),
                   "scale": float(np.max(np.abs(exact_hidden)))},
        "logits": {"itde": err(ours_logits, exact_logits),
                   "transformers": err(theirs_logits, exact_logits),
                   "itde_vs_transformers": err(ours_logits, theirs_logits),
                   "scale": float(np.max(np.abs(exact_logits)))},
        "after_layer": {"itde": [err(ours_layers[i], exact_layers[i]) for i in inner],
                        "transformers": [err(theirs_layers[i], exact_layers[i]) for i in inner],
                        "scale": [float(np.max(np.abs(exact_layers[i]))) for i in inner]},
    }  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    p.add_argument("--tokens", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    p.add_argument("--tiny", action="store_true", help="tiny widths of the same configs")
    p.add_argument("--out", type=Path, default=Path("runs/hf_scale/hf_scale.json"))
    p.add_argument("--child", nargs=2, metavar=("SHAPE", "DTYPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.tokens, args.repeats = min(args.tokens, 16), min(args.repeats, 2)
    if args.child:
        result = measure(*args.child, args.tokens, args.repeats, args.tiny)
        print("RESULT " + json.dumps(result))
        return 0
    records = []
    for shape in args.shapes:
        for dtype in args.dtypes:
            if args.tiny:  # in this process: a check that the script runs, not a measure
                records.append(measure(shape, dtype, args.tokens, args.repeats, True))
                _print(records[-1])
                continue
            cmd = [sys.executable, __file__, "--child", shape, dtype,
                   "--tokens", str(args.tokens), "--repeats", str(args.repeats)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            if proc.returncode != 0:
                sys.stderr.write(proc.stderr[-4000:])
                raise SystemExit(f"bench_hf_scale: {shape} {dtype} failed")
            (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            records.append(json.loads(line[len("RESULT ") :]))
            _print(records[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"records": records}, indent=2))
    print(f"wrote {args.out}")
    return 0


def _print(r: dict) -> None:
    print(
        f"{r['shape']:>20} {r['dtype']:>8}: convert peak {r['convert_peak_bytes'] / 1e9:.2f}"
        f" GB = {r['convert_ratio']:.2f} x the model's {r['model_bytes'] / 1e9:.2f} GB "
        f"({r['convert_s']:.1f} s); forward {r['tokens']} tokens itde "
        f"{r['forward_s']['itde']:.3f} s, transformers "
        f"{r['forward_s']['transformers']:.3f} s (ratio "
        f"{r['forward_ratio_itde_over_transformers']:.2f}; compile "
        f"{r['compile_s']:.1f} s); max |diff| {r['max_abs_diff']:.2g}",
        flush=True,
    )
    for what, e in r.get("error_vs_float32", {}).items():
        if what == "after_layer":
            for side in ("itde", "transformers"):
                errs = " ".join(f"{x:.2g}" for x in e[side])
                print(f"{'':>31}after each layer, {side} error: {errs}", flush=True)
            continue
        print(
            f"{'':>31}{what} error vs the float32 network (scale {e['scale']:.3g}): itde "
            f"{e['itde']:.2g}, transformers {e['transformers']:.2g}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
