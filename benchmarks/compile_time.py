"""Time to first result against the number of layers: itde against plain JAX's `lax.scan`.

What a person waits for first is tracing + compilation + the first call. For 4, 12 and 24
layers, the forward pass (`model.batch`, one depth solve over the batch) and a training
step (`jax.value_and_grad` of a mean-square loss, then an Adam update), itde against a
post-LN encoder written in plain JAX with `lax.scan` over the stacked layers (the
abstraction-free way to keep compile time flat in depth), and the same encoder with
`jax.checkpoint` on each layer ("plain JAX + remat": the memory policy of `itde.solve`'s
default adjoint, one saved state per layer, the layer recomputed on the way back, so the
training step's comparison holds the memory policy fixed). Each measurement runs in a fresh
process (no cache shared between them), in interleaved order, `--rounds` times; the table
gives the medians and the ratio itde / plain JAX per row, of wall time and of the process's
CPU time (steadier on a shared machine), and the compiled program's size in HLO lines (the
same for every depth when nothing is unrolled). `trace_s` is `jit(...).lower`,
`compile_s` is `.compile()`, `first_call_s` the first call of the compiled function;
`init_s` (not in the first result) is building the parameters, e.g. `TransformerIDE.init`.

    python benchmarks/compile_time.py [--layers 4 12 24 --rounds 3 --out runs/compile_time]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = dict(batch=8, tokens=32, width=64, heads=4, hidden=128)
IMPLS = ("plain_jax", "plain_jax_remat", "itde")


def measure(impl: str, kind: str, L: int) -> dict:
    """One measurement, in this (fresh) process."""
    t_import = time.perf_counter()
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from _plain import plain_encoder, random_params

    import itde

    s = SHAPE
    x = jax.random.normal(jax.random.key(1), (s["batch"], s["tokens"], s["width"]))
    t_init = time.perf_counter()
    if impl == "itde":
        model = itde.TransformerIDE.init(
            jax.random.key(0), n_layers=L, n_features=s["width"], n_heads=s["heads"],
            n_hidden=s["hidden"],
        )  # fmt: skip
        params, static = eqx.partition(model, eqx.is_array)

        def forward(p, x):
            return eqx.combine(p, static).batch(x)
    else:
        params = random_params(jax.random.key(0), L, s["width"], s["hidden"])

        def forward(p, x):
            return plain_encoder(p, x, s["heads"], remat=impl == "plain_jax_remat")

    opt = optax.adam(1e-3)
    if kind == "forward":
        fn, args = jax.jit(forward), (params, x)
    else:

        def step(p, o, x):
            loss, g = jax.value_and_grad(lambda p: jnp.mean((forward(p, x) - x) ** 2))(p)
            u, o = opt.update(g, o, p)
            return optax.apply_updates(p, u), o, loss

        fn, args = jax.jit(step), (params, opt.init(params), x)
    jax.block_until_ready(args)
    t_init = time.perf_counter() - t_init
    t_import = time.perf_counter() - t_import
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = fn.lower(*args)
    c1, t1 = time.process_time(), time.perf_counter()
    compiled = lowered.compile()
    c2, t2 = time.process_time(), time.perf_counter()
    jax.block_until_ready(compiled(*args))
    c3, t3 = time.process_time(), time.perf_counter()
    hlo_lines = len(compiled.as_text().splitlines())
    return {"trace_s": t1 - t0, "compile_s": t2 - t1, "first_call_s": t3 - t2,
            "first_result_s": t3 - t0, "trace_cpu_s": c1 - c0, "compile_cpu_s": c2 - c1,
            "first_result_cpu_s": c3 - c0, "hlo_lines": hlo_lines,
            "setup_s": t_import, "init_s": t_init}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 12, 24])
    ap.add_argument("--kinds", nargs="+", default=["forward", "train_step"],
                    choices=["forward", "train_step"])  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="runs/compile_time")
    ap.add_argument("--one", nargs=3, metavar=("IMPL", "KIND", "LAYERS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one[0], a.one[1], int(a.one[2]))))
        return
    results: dict[str, list[dict]] = {}
    for r in range(a.rounds):
        for kind in a.kinds:
            for L in a.layers:
                for impl in IMPLS:
                    out = subprocess.run(
                        [sys.executable, __file__, "--one", impl, kind, str(L)],
                        capture_output=True, text=True, check=True,
                    ).stdout  # fmt: skip
                    m = json.loads(out.strip().splitlines()[-1])
                    results.setdefault(f"{impl}/{kind}/{L}", []).append(m)
                    print(f"round {r} {impl:>9} {kind:>10} L={L:>2}: first result "
                          f"{m['first_result_s']:.2f} s", flush=True)  # fmt: skip
    med = {
        k: {q: statistics.median(m[q] for m in v) for q in v[0]} for k, v in results.items()
    }
    rows = []
    hdr = (f"{'kind':<11}{'layers':>7}{'plain first':>12}{'remat first':>12}{'itde trace':>11}"
           f"{'itde compile':>13}{'itde first':>11}{'itde/plain':>11}{'itde/remat':>11}"
           f"{'(CPU)':>7}{'itde init':>10}{'HLO lines p/r/i':>17}")  # fmt: skip
    print(hdr)

    def ratio(kind, L, base, q):
        return statistics.median(
            x[q] / y[q] for x, y in zip(results[f"itde/{kind}/{L}"], results[f"{base}/{kind}/{L}"])
        )

    for kind in a.kinds:
        for L in a.layers:
            p, r, i = (med[f"{n}/{kind}/{L}"] for n in IMPLS)
            row = {"kind": kind, "layers": L, "plain_jax": p, "plain_jax_remat": r, "itde": i}
            for base in ("plain_jax", "plain_jax_remat"):
                for q in ("first_result_s", "first_result_cpu_s"):
                    row[f"ratio_itde_over_{base}_{q}"] = ratio(kind, L, base, q)
            rows.append(row)
            print(f"{kind:<11}{L:>7}{p['first_result_s']:>12.2f}{r['first_result_s']:>12.2f}"
                  f"{i['trace_s']:>11.2f}{i['compile_s']:>13.2f}{i['first_result_s']:>11.2f}"
                  f"{row['ratio_itde_over_plain_jax_first_result_s']:>11.2f}"
                  f"{row['ratio_itde_over_plain_jax_remat_first_result_s']:>11.2f}"
                  f"{row['ratio_itde_over_plain_jax_remat_first_result_cpu_s']:>7.2f}"
                  f"{i['init_s']:>10.2f}{int(p['hlo_lines']):>7}/{int(r['hlo_lines'])}"
                  f"/{int(i['hlo_lines'])}")  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compile_time.json").write_text(
        json.dumps({"shape": SHAPE, "rounds": a.rounds, "rows": rows, "raw": results}, indent=2)
    )
    print(f"wrote {out / 'compile_time.json'}")


if __name__ == "__main__":
    main()
