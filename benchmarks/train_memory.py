"""Peak memory of a training step against the number of layers, with `itde.solve`'s default
adjoint (`diffrax.RecursiveCheckpointAdjoint` with one checkpoint per depth step).

For each depth, in a fresh process: a causal post-LN model (charlm-like shape, float32) and
one training step (`jax.value_and_grad` of a mean-square loss over a batch, then Adam). Two
figures per row: XLA's buffer assignment for the compiled step (`memory_analysis()`:
temporaries, and arguments + outputs) and the measured peak resident memory of one call
(`VmHWM - VmRSS` around the call after resetting the high-water mark with
`/proc/self/clear_refs`; Linux only). The same for a plain-JAX post-LN encoder scanned over
stacked layers (`lax.scan`, JAX's own reverse mode), the baseline. The growth rate is the
least-squares slope in bytes per layer, and the same divided by one layer's state
(`batch x tokens x width` floats).

The baseline is measured twice: `plain_jax` (JAX's reverse mode keeps every residual of
every layer) and `plain_jax_remat` (each layer under `jax.checkpoint`, `_plain.py`'s
`remat=True`: one state kept per layer, the layer recomputed on the way back — the memory
policy of `itde.solve`). itde against `plain_jax_remat` compares the libraries; against
`plain_jax` it compares the memory policies.

    python benchmarks/train_memory.py [--layers 2 4 8 16 --out runs/train_memory]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

SHAPE = dict(batch=32, tokens=64, width=64, heads=4, hidden=256)
#: the measured programs: plain JAX without and with remat (the baselines), then itde
IMPLS = ("plain_jax", "plain_jax_remat", "itde")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(impl: str, L: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from _plain import plain_encoder, random_params

    import itde

    s = SHAPE
    x = jax.random.normal(jax.random.key(1), (s["batch"], s["tokens"], s["width"]))
    if impl == "itde":
        model = itde.TransformerIDE.init(
            jax.random.key(0), n_layers=L, n_features=s["width"], n_heads=s["heads"],
            n_hidden=s["hidden"],
        )  # fmt: skip
        params, static = eqx.partition(model, eqx.is_array)

        def forward(p, x):
            return eqx.combine(p, static).batch(x)
    elif impl in IMPLS:
        params = random_params(jax.random.key(0), L, s["width"], s["hidden"])
        remat = impl == "plain_jax_remat"

        def forward(p, x):
            return plain_encoder(p, x, s["heads"], remat=remat)
    else:
        raise ValueError(f"impl={impl!r} is not one of {IMPLS}")

    opt = optax.adam(1e-3)

    def step(p, o, x):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((forward(p, x) - x) ** 2))(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    args = (params, opt.init(params), x)
    compiled = jax.jit(step).lower(*args).compile()
    jax.block_until_ready(compiled(*args))  # first call: allocations settle
    ma = compiled.memory_analysis()
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    jax.block_until_ready(compiled(*args))
    peak = _status_kib("VmHWM") - base
    return {"xla_temp_bytes": int(ma.temp_size_in_bytes),
            "xla_args_out_bytes": int(ma.argument_size_in_bytes + ma.output_size_in_bytes),
            "rss_peak_bytes": 1024 * peak}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--out", default="runs/train_memory")
    ap.add_argument("--one", nargs=2, metavar=("IMPL", "LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one[0], int(a.one[1]))))
        return
    rows = []
    for L in a.layers:
        row = {"layers": L}
        for impl in IMPLS:
            out = subprocess.run([sys.executable, __file__, "--one", impl, str(L)],
                                 capture_output=True, text=True, check=True).stdout  # fmt: skip
            row[impl] = json.loads(out.strip().splitlines()[-1])
        rows.append(row)
        print(json.dumps(row), flush=True)
    state = 4 * SHAPE["batch"] * SHAPE["tokens"] * SHAPE["width"]
    Ls = np.array(a.layers, float)
    growth = {}
    for impl in IMPLS:
        for q in ("xla_temp_bytes", "rss_peak_bytes"):
            slope = float(np.polyfit(Ls, [r[impl][q] for r in rows], 1)[0])
            growth[f"{impl}/{q}"] = {"bytes_per_layer": slope, "states_per_layer": slope / state}
    mib = 2.0**20
    names = {"plain_jax": "plain", "plain_jax_remat": "plain+remat", "itde": "itde"}
    print(f"{'layers':>6}" + "".join(f"{names[k] + ' temp MiB':>22}{names[k] + ' RSS MiB':>21}"
                                     for k in IMPLS))  # fmt: skip
    for r in rows:
        print(f"{r['layers']:>6}" + "".join(
            f"{r[k]['xla_temp_bytes'] / mib:>22.1f}{r[k]['rss_peak_bytes'] / mib:>21.1f}"
            for k in IMPLS))  # fmt: skip
    for k, g in growth.items():
        print(f"growth {k}: {g['bytes_per_layer'] / mib:.2f} MiB/layer = "
              f"{g['states_per_layer']:.1f} states of [batch, tokens, width]")  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_memory.json").write_text(
        json.dumps({"shape": SHAPE, "state_bytes": state, "rows": rows, "growth": growth},
                   indent=2)  # fmt: skip
    )
    print(f"wrote {out / 'train_memory.json'}")


if __name__ == "__main__":
    main()
