"""Peak memory of one attention layer's forward pass: dense against blocked (and fused).

Each configuration runs in a fresh subprocess (CPU, float32) that

1. builds the layer (`itde.Attention.init`, `d = 64`) and a state `u` of `N` tokens with
   non-uniform token log-weights, and compiles the forward pass ahead of time;
2. reads XLA's own buffer plan, `compiled.memory_analysis().temp_size_in_bytes`
   (scratch beyond arguments and outputs);
3. resets the kernel's resident-set high-water mark (`echo 5 > /proc/self/clear_refs`),
   reads the resident set as the baseline, runs the forward pass once, and reports
   `VmHWM - baseline` (the measured peak of that one call); it also reports the
   `ru_maxrss` difference, which cannot be reset and so reads 0 whenever compilation
   peaked higher than the call.

The projections are the same for every method; only the token-mixing core differs
(`dense_attention`, `blocked_attention`, `fused_attention` from `itde._operators._blocked`). The run
also times the compiled call (median of repeats) and, for `N <= 4096`, checks the
method against `itde.Attention.__call__`.

Usage: `python benchmarks/attention_memory.py [--tokens 1024 4096 16384] [--heads 1]
[--block-size 512] [--out runs/attention_memory]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

METHODS = ("dense", "blocked", "fused")


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(
    method: str, n: int, heads: int, d: int, block_size: int, repeats: int, backward: bool
) -> dict:
    import jax

    jax.config.update("jax_platforms", "cpu")
    import jax.numpy as jnp
    import numpy as np

    import itde
    from itde import blocked_attention, dense_attention, fused_attention

    core = {"dense": dense_attention, "blocked": blocked_attention, "fused": fused_attention}
    core = core[method]
    key_a, key_u = jax.random.split(jax.random.PRNGKey(0))
    att = itde.Attention.init(key_a, d, heads, dtype=jnp.float32)
    u = jax.random.normal(key_u, (n, d), jnp.float32)
    x, w = itde.Simpson(interval=(0.0, 1.0)).nodes_weights(n if n % 2 else n + 1)
    lw = jnp.asarray(np.log(w[:n]), jnp.float32)  # non-uniform token weights

    def layer(att, u, lw):
        proj = lambda w, b: jnp.einsum("nd,hde->hne", u, w) + b[:, None, :]  # noqa: E731
        q = proj(att.wq, att.bq) / jnp.sqrt(jnp.float32(att.head_dim))
        o = core(
            q,
            proj(att.wk, att.bk),
            proj(att.wv, att.bv),
            token_log_weights=lw,
            block_size=block_size,
        )
        return jnp.einsum("hne,hed->nd", o, att.wo) + att.bo

    jax.block_until_ready((att, u, lw))
    t0 = time.perf_counter()
    fn = layer
    if backward:  # forward + reverse pass: gradient of a scalar loss w.r.t. params and u

        def fn(att, u, lw):
            return jax.grad(lambda a, x: jnp.sum(layer(a, x, lw) ** 2), argnums=(0, 1))(att, u)

    compiled = jax.jit(fn).lower(att, u, lw).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    xla = {
        k: int(getattr(ma, k))
        for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
        if ma is not None and hasattr(ma, k)
    }

    import gc

    gc.collect()
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current resident set
    rss_before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    out = jax.block_until_ready(compiled(att, u, lw))
    first_s = time.perf_counter() - t0
    hwm = _status_kib("VmHWM")
    maxrss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(att, u, lw))
        times.append(time.perf_counter() - t0)
    check = None
    if n <= 4096 and not backward:
        ref = att(u, token_log_weights=lw)
        check = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
    return {
        "method": method,
        "pass": "forward+backward" if backward else "forward",
        "tokens": n,
        "heads": heads,
        "features": d,
        "block_size": block_size if method == "blocked" else None,
        "compile_s": compile_s,
        "first_call_s": first_s,
        "median_s": statistics.median(times) if times else first_s,
        "xla_temp_bytes": xla.get("temp_size_in_bytes"),
        "xla_argument_bytes": xla.get("argument_size_in_bytes"),
        "xla_output_bytes": xla.get("output_size_in_bytes"),
        "rss_peak_delta_bytes": (hwm - rss_before) * 1024,
        "maxrss_delta_bytes": (maxrss_after - maxrss_before) * 1024,
        "rel_diff_vs_Attention": check,
        "score_matrix_bytes": heads * n * n * 4,
    }


def _mib(b):
    return "-" if b is None else f"{b / 2**20:9.1f}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--backward", action="store_true", help="measure forward + reverse pass (jax.grad)"
    )
    p.add_argument("--out", type=Path, default=Path("runs/attention_memory"))
    p.add_argument("--worker", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        res = _worker(
            a.worker[0],
            int(a.worker[1]),
            a.heads,
            a.features,
            a.block_size,
            a.repeats,
            a.backward,
        )
        print("RESULT " + json.dumps(res))
        return
    dense_bytes = a.heads * max(a.tokens) ** 2 * 4
    if "dense" in a.methods and dense_bytes > 8 * 2**30:
        sys.exit(f"dense scores would need {dense_bytes / 2**30:.1f} GiB; lower --tokens/--heads.")

    rows = []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for n in a.tokens:
        for m in a.methods:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                m,
                str(n),
                "--heads",
                str(a.heads),
                "--features",
                str(a.features),
                "--block-size",
                str(a.block_size),
                "--repeats",
                str(a.repeats),
                *(["--backward"] if a.backward else []),
            ]
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if r.returncode or not line:
                print(f"[{m} N={n}] failed (rc={r.returncode}):\n{r.stderr[-2000:]}")
                continue
            rows.append(json.loads(line[-1][7:]))
            print(f"  done {m:8s} N={n}", flush=True)

    hdr = (
        f"{'method':8s} {'tokens':>7s} {'XLA temp MiB':>13s} {'RSS peak MiB':>13s} "
        f"{'maxrss MiB':>11s} {'h·N²·4B MiB':>11s} {'median s':>9s} {'compile s':>9s} "
        f"{'rel.diff':>8s}"
    )
    what = "forward + backward" if a.backward else "forward"
    print(
        f"\nattention layer {what}, CPU float32, heads={a.heads}, d={a.features}, "
        f"block={a.block_size}"
    )
    print(hdr)
    for r in rows:
        print(
            f"{r['method']:8s} {r['tokens']:7d} {_mib(r['xla_temp_bytes']):>13s} "
            f"{_mib(r['rss_peak_delta_bytes']):>13s} {_mib(r['maxrss_delta_bytes']):>11s} "
            f"{_mib(r['score_matrix_bytes']):>11s} {r['median_s']:9.4f} {r['compile_s']:9.2f} "
            + (
                "       -"
                if r["rel_diff_vs_Attention"] is None
                else f"{r['rel_diff_vs_Attention']:8.1e}"
            )
        )
    print(
        "XLA temp = compiled.memory_analysis().temp_size_in_bytes (XLA's buffer plan; on CPU "
        "it omits\nintermediates kept inside one fused kernel, e.g. dense scores once XLA fuses "
        "dot-softmax-dot).\nRSS peak = VmHWM - VmRSS around the one call after resetting the "
        "high-water mark (the measured peak).\nmaxrss = ru_maxrss difference (not resettable; 0 "
        "when compilation peaked higher). rel.diff = against itde.Attention."
    )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(
        json.dumps(
            {
                "args": {
                    k: (str(v) if isinstance(v, Path) else v)
                    for k, v in vars(a).items()
                    if k != "worker"
                },
                "rows": rows,
            },
            indent=2,
        )
    )
    _plot(rows, a.out / "memory.png")
    print(f"\nwrote {a.out / 'results.json'} and {a.out / 'memory.png'}")


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in METHODS:
        rs = [r for r in rows if r["method"] == m]
        if not rs:
            continue
        ns = [r["tokens"] for r in rs]
        ax.loglog(
            ns,
            [max(r["rss_peak_delta_bytes"], 1) / 2**20 for r in rs],
            "o-",
            label=f"{m} (RSS peak)",
        )
        if all(r["xla_temp_bytes"] for r in rs):
            ax.loglog(ns, [r["xla_temp_bytes"] / 2**20 for r in rs], "x--", label=f"{m} (XLA temp)")
    ax.set_xlabel("tokens N")
    ax.set_ylabel("peak memory of one forward (MiB)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
