"""A resolution sweep in one process: `itde.solve` at every token count N = 4..403.

A session that solves one model at many token counts (a resolution study, an evaluation
set of many lengths) used to compile a program per N and keep it: about 2 s and 150 memory
mappings per new N on a 2-core CPU, and Linux's `vm.max_map_count` (65530) ended the
process after about 400 counts. Eager solves now pad each N to its bucket (powers of two
by default) and run the program compiled for the bucket, held in the bounded
`itde.programs` cache; the result is the N-token solve's to round-off.

This script solves a 2-layer, width-16 model (2 heads, float32 unless `--dtype`) at
every N of the sweep, one eager `itde.solve` each, and reports:

- the sweep's wall time, the programs XLA compiled in it (`itde.count_compilations`, every
  program: the library's and any eager operation's) and `itde.programs`' counters;
- the process's memory mappings (lines of /proc/self/maps) before, at most and after, and
  its resident memory;
- the baseline, measured in the same run after the sweep: the exact (unpadded) solve,
  `buckets=None`, at the first `--baseline` counts, each a new program (time and
  mappings per new N), and the largest relative difference between the padded and the
  exact solution over those counts.

    python benchmarks/bench_solve_sweep.py [--n-max 403 --baseline 8 --out runs/solve_sweep]
    python benchmarks/bench_solve_sweep.py --tiny      # N = 4..12, for the tests
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

FULL = dict(n_min=4, n_max=403, baseline=8)
TINY = dict(n_min=4, n_max=12, baseline=2)


def mappings() -> int:
    """The number of memory mappings of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-min", type=int, help=f"first token count (default {FULL['n_min']})")
    ap.add_argument("--n-max", type=int, help=f"last token count (default {FULL['n_max']})")
    ap.add_argument("--baseline", type=int, help="counts solved exactly for the baseline")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--tiny", action="store_true", help=f"N = {TINY['n_min']}..{TINY['n_max']}")
    ap.add_argument("--out", type=Path, help="folder for result.json")
    a = ap.parse_args(argv)
    shape = {**(TINY if a.tiny else FULL)}
    for key in ("n_min", "n_max", "baseline"):
        if getattr(a, key) is not None:
            shape[key] = getattr(a, key)

    import jax

    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np

    import itde

    dtype = jnp.dtype(a.dtype)
    model = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=2, n_features=16, n_heads=2, dtype=dtype
    )
    ns = list(range(shape["n_min"], shape["n_max"] + 1))
    rng = np.random.default_rng(0)
    states = {n: rng.standard_normal((n, 16)).astype(dtype) for n in ns}
    itde.programs.clear()
    maps0, peak = mappings(), 0
    t0 = time.perf_counter()
    padded = {}
    with itde.count_compilations() as compiled:
        for n in ns:
            y = itde.solve(model, states[n]).ys
            if n in ns[: shape["baseline"]]:
                padded[n] = np.asarray(y)
            peak = max(peak, mappings())
        jax.block_until_ready(y)
    sweep_s = time.perf_counter() - t0
    maps1 = mappings()
    cache = itde.programs
    sweep = {
        "wall_s": sweep_s,
        "per_n_ms": 1e3 * sweep_s / len(ns),
        "programs_compiled": compiled.count,
        "cache": {
            "compiled": cache.compiled,
            "hits": cache.hits,
            "evicted": cache.evicted,
            "held": len(cache),
            "compile_s": cache.compile_seconds,
        },  # fmt: skip
        "mappings": {"before": maps0, "peak": peak, "after": maps1, "growth": maps1 - maps0},
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    # the baseline: the exact solve at new counts, each its own program
    base_ns = ns[: shape["baseline"]]
    b_maps0 = mappings()
    t0 = time.perf_counter()
    worst = 0.0
    with itde.count_compilations() as base_compiled:
        for n in base_ns:
            y = np.asarray(itde.solve(model, states[n], buckets=None).ys)
            worst = max(worst, float(np.max(np.abs(padded[n] - y)) / np.max(np.abs(y))))
    base_s = time.perf_counter() - t0
    baseline = {
        "ns": base_ns,
        "wall_s": base_s,
        "per_n_ms": 1e3 * base_s / len(base_ns),
        "programs_compiled": base_compiled.count,
        "mappings_per_n": (mappings() - b_maps0) / len(base_ns),
    }
    result = {
        "tiny": a.tiny,
        "model": {"layers": 2, "width": 16, "heads": 2, "dtype": a.dtype},
        "ns": [ns[0], ns[-1]],
        "distinct_n": len(ns),
        "sweep": sweep,
        "baseline_exact": baseline,
        "ratio_per_n_padded_over_exact": sweep["per_n_ms"] / baseline["per_n_ms"],
        "max_relative_difference_padded_vs_exact": worst,
        "machine": "CPU (a shared machine: times are noisy)",
    }
    print(
        f"solve sweep N = {ns[0]}..{ns[-1]} ({len(ns)} counts, {a.dtype}): "
        f"{sweep_s:.1f} s ({sweep['per_n_ms']:.1f} ms per N), {compiled.count} programs "
        f"compiled; mappings {maps0} -> peak {peak} -> {maps1}; max RSS "
        f"{sweep['max_rss_mb']:.0f} MB\n"
        f"baseline (exact, buckets=None) at {len(base_ns)} new counts: "
        f"{baseline['per_n_ms']:.0f} ms per N, {base_compiled.count} programs, "
        f"{baseline['mappings_per_n']:.0f} mappings per N; padded vs exact: "
        f"{worst:.1e} relative",
        file=sys.stderr,
    )
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "result.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
