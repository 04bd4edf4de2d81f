"""Sliding-window attention in the blocked core: time and peak memory against the number
of tokens, with a fixed window and without one, measured in the same run.

Each configuration runs in a fresh subprocess (CPU, float32) that builds queries, keys and
values `[heads, N, head_dim]` with non-uniform token log-weights, compiles
`itde.blocked_attention` ahead of time (causal by default, `block_size` B) with the window
`itde.SlidingWindow(L)` bound to the unit grid's nodes or with none, then

1. resets the resident-set high-water mark (`echo 5 > /proc/self/clear_refs`), runs the
   call once and reports `VmHWM - VmRSS before` (the call's measured peak), and
2. times the compiled call (median of `--repeats`, after that first call).

With a window the blocked core visits about L/B + 2 key blocks per query block (2L/B + 2
without causality) whatever N, so time and memory should grow like N; without one it
visits every block at or before the query block, like N^2. The table gives the ratios
(without / with window) and the growth exponents fitted by least squares to
log(time) and log(memory) against log(N). For N <= 4096 the windowed call is checked
against `itde.dense_attention` with the same window.

Usage: `python benchmarks/window.py [--tokens 1024 2048 4096 8192 16384] [--window 512]
[--block-size 256] [--heads 4] [--head-dim 64] [--bidirectional] [--out runs/window]`.
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

import numpy as np


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(a, n: int, windowed: bool) -> dict:
    import jax

    jax.config.update("jax_platforms", "cpu")
    import gc

    import jax.numpy as jnp

    import itde

    causal = not a.bidirectional
    kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(0), 4)
    shape = (a.heads, n, a.head_dim)
    q = jax.random.normal(kq, shape, jnp.float32) / np.sqrt(a.head_dim)
    k = jax.random.normal(kk, shape, jnp.float32)
    v = jax.random.normal(kv, shape, jnp.float32)
    lw = jnp.log(jax.random.uniform(kw, (n,), jnp.float32, 0.5, 2.0))
    band = itde.SlidingWindow(a.window).on_nodes(np.arange(n) + 0.5) if windowed else None

    def call(q, k, v, lw):
        return itde.blocked_attention(
            q, k, v, token_log_weights=lw, causal=causal, window=band, block_size=a.block_size
        )

    jax.block_until_ready((q, k, v, lw))
    t0 = time.perf_counter()
    compiled = jax.jit(call).lower(q, k, v, lw).compile()
    compile_s = time.perf_counter() - t0
    gc.collect()
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current resident set
    rss_before = _status_kib("VmRSS")
    out = jax.block_until_ready(compiled(q, k, v, lw))
    peak = (_status_kib("VmHWM") - rss_before) * 1024
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(q, k, v, lw))
        times.append(time.perf_counter() - t0)
    check = None
    if windowed and n <= 4096:
        ref = itde.dense_attention(q, k, v, token_log_weights=lw, causal=causal, window=band)
        check = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    return {
        "windowed": windowed,
        "tokens": n,
        "compile_s": compile_s,
        "median_s": statistics.median(times),
        "rss_peak_bytes": peak,
        "rel_diff_vs_dense": check,
    }


def _slope(ns, ys) -> float:
    """Least-squares slope of log y against log N (the growth exponent)."""
    ys = np.maximum(np.asarray(ys, float), 1e-12)
    return float(np.polyfit(np.log(ns), np.log(ys), 1)[0])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--window", type=float, default=512.0, help="L (tokens on the unit grid)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--bidirectional", action="store_true", help="|x - x~| < L, not causal")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("runs/window"))
    p.add_argument("--worker", nargs=2, metavar=("WINDOWED", "TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        res = _worker(a, int(a.worker[1]), a.worker[0] == "1")
        print("RESULT " + json.dumps(res))
        return

    rows = []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    common = [
        "--window", str(a.window), "--block-size", str(a.block_size), "--heads",
        str(a.heads), "--head-dim", str(a.head_dim), "--repeats", str(a.repeats),
        *(["--bidirectional"] if a.bidirectional else []),
    ]  # fmt: skip
    for n in a.tokens:
        for windowed in (True, False):
            cmd = [sys.executable, __file__, "--worker", str(int(windowed)), str(n), *common]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                print(
                    f"[windowed={windowed} N={n}] failed (rc={r.returncode}):\n{r.stderr[-2000:]}"
                )
                continue
            rows.append(json.loads(line[-1][7:]))
            print(f"  done N={n:6d} {'window' if windowed else 'none':6s}", flush=True)

    by = {(r["tokens"], r["windowed"]): r for r in rows}
    ns = [n for n in a.tokens if (n, True) in by and (n, False) in by]
    kind = "bidirectional" if a.bidirectional else "causal"
    print(
        f"\nblocked_attention forward, CPU float32, {kind}, heads={a.heads}, "
        f"head_dim={a.head_dim}, block={a.block_size}, window L={a.window:g}"
    )
    print(
        "| tokens | time, window (s) | time, none (s) | none / window | peak, window (MiB) "
        "| peak, none (MiB) | rel. diff vs dense |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in ns:
        w, o = by[n, True], by[n, False]
        check = "-" if w["rel_diff_vs_dense"] is None else f"{w['rel_diff_vs_dense']:.1e}"
        print(
            f"| {n:,} | {w['median_s']:.4f} | {o['median_s']:.4f} | "
            f"{o['median_s'] / w['median_s']:.1f} | {w['rss_peak_bytes'] / 2**20:.1f} | "
            f"{o['rss_peak_bytes'] / 2**20:.1f} | {check} |"
        )
    fit = {}
    if len(ns) >= 2:
        for windowed, name in ((True, "window"), (False, "none")):
            fit[name] = {
                "time": _slope(ns, [by[n, windowed]["median_s"] for n in ns]),
                "memory": _slope(ns, [by[n, windowed]["rss_peak_bytes"] for n in ns]),
            }
        print(
            f"growth exponents (log-log least squares over N = {ns[0]}..{ns[-1]}): "
            f"time {fit['window']['time']:.2f} with the window, {fit['none']['time']:.2f} "
            f"without; peak memory {fit['window']['memory']:.2f} and "
            f"{fit['none']['memory']:.2f}."
        )
    a.out.mkdir(parents=True, exist_ok=True)
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    (a.out / "results.json").write_text(
        json.dumps({"args": args, "rows": rows, "exponents": fit}, indent=2)
    )
    _plot(by, ns, a.out / "window.png")
    print(f"\nwrote {a.out / 'results.json'} and {a.out / 'window.png'}")


def _plot(by, ns, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.6))
    for windowed, label in ((True, "window"), (False, "no window")):
        ax_t.loglog(ns, [by[n, windowed]["median_s"] for n in ns], "o-", label=label)
        ax_m.loglog(
            ns, [max(by[n, windowed]["rss_peak_bytes"], 1) / 2**20 for n in ns], "o-", label=label
        )
    ax_t.set_ylabel("forward time (s)")
    ax_m.set_ylabel("peak memory of one call (MiB)")
    for ax in (ax_t, ax_m):
        ax.set_xlabel("tokens N")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
