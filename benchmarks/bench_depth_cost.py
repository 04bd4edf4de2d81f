"""Cost of the fixed-step `diffeqsolve` path against a hand-written `lax.scan`.

Two ways to run a batch through `itde.solve`: `jax.vmap` of the solve (one solve per
example, vmapped) and `batched=True` (`model.batch`: one solve whose sub-flows are
vmapped over the batch). Both give the same numbers; the second avoids batching
diffrax's checkpointed loop, which is what makes the vmapped backward pass slower.

The same Lie substeps (attention, projection, feed-forward, projection) with the same
operator modules, once through `itde.solve` (diffrax `StepTo` grid, `LieTrotter`,
`RecursiveCheckpointAdjoint`) and once as a `jax.lax.scan` over the steps. Forward and
forward+backward (gradient of a scalar loss with respect to all parameters), jit,
warmed up, median of interleaved repeats; the ratio is the cost of diffrax's loop.

    python benchmarks/bench_depth_cost.py [--steps-per-layer 1 --layers 4 --batch 16
                                           --tokens 128 --d-model 128 --heads 4]

Run with `EQX_ON_ERROR=nan` to drop equinox's runtime checks (diffrax's guidance for
speed); the result records which mode was used.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_time

import itde


def scan_forward(model: itde.TransformerIDE, u0, dt: float, n_steps: int, remat=False):
    """The same Lie substeps as `LieTrotter` over `model.terms("paper")`, as a scan.

    `remat=True` wraps each step in `jax.checkpoint`: the memory policy of diffrax's
    `RecursiveCheckpointAdjoint` (store each step's state, recompute the step's
    forward in the backward pass)."""

    def step(u, t):
        t1 = t + dt
        u = model.project1(t1, u + dt * model.attention_field(t, u))
        u = model.project2(t1, u + dt * model.feedforward_field(t, u))
        return u, None

    ts = jnp.arange(n_steps, dtype=u0.dtype) * dt + model.t0
    u, _ = jax.lax.scan(jax.checkpoint(step) if remat else step, u0, ts)
    return u


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps-per-layer", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="runs/bench_depth_cost")
    a = ap.parse_args(argv)

    model = itde.TransformerIDE.init(
        jax.random.key(0),
        n_layers=a.layers,
        n_features=a.d_model,
        n_heads=a.heads,
        dtype=jnp.float32,
    )
    x = jax.random.normal(jax.random.key(1), (a.batch, a.tokens, a.d_model), jnp.float32)
    dt = 1.0 / a.steps_per_layer
    n_steps = a.layers * a.steps_per_layer

    def via_diffrax(m, x):
        return jax.vmap(lambda u: itde.solve(m, u, dt0=dt).ys[-1])(x)

    def via_diffrax_batched(m, x):
        return itde.solve(m, x, dt0=dt, batched=True).ys[-1]

    def via_scan(m, x):
        return jax.vmap(lambda u: scan_forward(m, u, dt, n_steps))(x)

    def via_scan_remat(m, x):
        return jax.vmap(lambda u: scan_forward(m, u, dt, n_steps, remat=True))(x)

    def loss(f):
        return lambda m, x: jnp.mean(f(m, x) ** 2)

    fns = {
        "diffrax_fwd": eqx.filter_jit(via_diffrax),
        "diffrax_batched_fwd": eqx.filter_jit(via_diffrax_batched),
        "scan_fwd": eqx.filter_jit(via_scan),
        "diffrax_fwd_bwd": eqx.filter_jit(eqx.filter_grad(loss(via_diffrax))),
        "diffrax_batched_fwd_bwd": eqx.filter_jit(eqx.filter_grad(loss(via_diffrax_batched))),
        "scan_fwd_bwd": eqx.filter_jit(eqx.filter_grad(loss(via_scan))),
        "scan_remat_fwd_bwd": eqx.filter_jit(eqx.filter_grad(loss(via_scan_remat))),
    }
    compile_s = {}
    for k, f in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(model, x))
        compile_s[k] = time.perf_counter() - t0
    diff = float(jnp.max(jnp.abs(fns["diffrax_fwd"](model, x) - fns["scan_fwd"](model, x))))
    times = {k: [] for k in fns}
    for _ in range(3):  # interleaved rounds
        for k, f in fns.items():
            times[k].append(median_time(lambda f=f: jax.block_until_ready(f(model, x)), a.repeats))
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "shape": vars(a),
        "n_steps": n_steps,
        "eqx_on_error": os.environ.get("EQX_ON_ERROR", "raise"),
        "device": jax.devices()[0].platform,
        "compile_s": compile_s,
        "median_s": med,
        "ratio_fwd_diffrax_over_scan": med["diffrax_fwd"] / med["scan_fwd"],
        "ratio_fwd_bwd_diffrax_over_scan": med["diffrax_fwd_bwd"] / med["scan_fwd_bwd"],
        "ratio_fwd_diffrax_batched_over_scan": med["diffrax_batched_fwd"] / med["scan_fwd"],
        "ratio_fwd_bwd_diffrax_batched_over_scan": (
            med["diffrax_batched_fwd_bwd"] / med["scan_fwd_bwd"]
        ),
        "ratio_fwd_bwd_diffrax_over_scan_remat": (
            med["diffrax_fwd_bwd"] / med["scan_remat_fwd_bwd"]
        ),
        "max_abs_diff": diff,
    }
    print(
        f"{n_steps} Lie steps (dt={dt}), batch {a.batch} x {a.tokens} tokens x {a.d_model}, "
        f"EQX_ON_ERROR={result['eqx_on_error']}"
    )
    for k in fns:
        print(f"  {k:<24}{1e3 * med[k]:>10.2f} ms   compile {compile_s[k]:.2f} s")
    print(f"ratio diffrax/scan forward          = {result['ratio_fwd_diffrax_over_scan']:.3f}")
    print(f"ratio diffrax/scan forward+backward = {result['ratio_fwd_bwd_diffrax_over_scan']:.3f}")
    print(
        "ratio diffrax/scan-with-per-step-checkpoint forward+backward = "
        f"{result['ratio_fwd_bwd_diffrax_over_scan_remat']:.3f}"
    )
    print(
        "batched solve (one diffeqsolve over the batch, model.batch): ratio to scan "
        f"forward = {result['ratio_fwd_diffrax_batched_over_scan']:.3f}, forward+backward = "
        f"{result['ratio_fwd_bwd_diffrax_batched_over_scan']:.3f}"
    )
    print(f"max |diffrax - scan| = {diff:.2e}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_depth_cost.json").write_text(json.dumps(result, indent=2, default=str))
    return result


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
