r"""How long [`analyze`][itde.analysis.analyze] will take, said before it starts: each
stage's floating-point work counted from the model's shape, priced at this machine's
speed (a matrix product and a small compilation timed on the spot, about a second), plus
each stage's compilation.

**The count.** One field evaluation on $n$ tokens (one layer of the discrete network, one
stage of a step of a continuous one) costs $c(n) = 2nP + 2n^2 h (e + e_v)$ operations, $P$
the kernels' entries of one attention and one feed-forward, $h$ heads of sizes $e$ (query
and key) and $e_v$ (value). With $E$ evaluations over the whole depth ($E_i$ over interval
$i$), $B$ inputs of $N$ tokens ($n$ real tokens in the first input, the one the exponents
follow), $K + 1$ depths, block $p$ and $k$ iterations an exponent:

| stage | operations |
|---|---|
| solve | $B\,E\,c(N)$ |
| geometry | $2 B (K + 1)\, c(N)$ |
| spectra | $K (10 d^3 + 6 d^2 d_\mathrm{ff})$ (the eigenvalues of $W_1 W_2$, the Gram matrices) |
| interval $i$ | $3 k p E_i\, c(n)$ (a JVP and a VJP of each tangent) |
| whole depth | $3 k p E\, c(n)$ |
| token exponents (towards one token) | $d\, E\, c(n)$ (`features` VJPs) |
| token exponents (`"all"`, `"self"`) | $3 k p\, n\, E\, c(n)$ |

**The price.** Each stage's operations divided by the measured rate of a matrix product in
the model's dtype, times the efficiency measured for that stage (`_EFFICIENCY`: how far
below a large product's rate its own operations run), plus its compilation, in units of
the small reference compilation timed on the spot (`_COMPILE`). Both tables were fitted on
SmolLM2-135M (30 layers, 576 features, 4 inputs of 42 tokens, float64) on an idle 2-core
CPU (84 s expected, 76 s taken) and not refitted on other shapes: on the tests' 3-layer
model of 8 features, where compilation is all the time, `analyze` without exponents was
expected to take 3.4 s and took 7.6 s (49 s and 20 s on a loaded 2-core CPU).
`tests/test_analysis_estimate.py` checks the counts against a count by hand and the
pricing's arithmetic, not the fit. The iterations are not known in advance: the estimate
prices them at `typical` (10 a exponent, SmolLM2's mean) and says the bound at `max_iters`
too.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

#: Iterations an exponent is priced at before any has run (SmolLM2-135M's intervals took
#: 3 to 16, mean 9.5; the whole depth 5).
TYPICAL_ITERS = 10

#: Each stage's operations run at this fraction of the probe's matrix-product rate
#: (fitted on SmolLM2-135M, idle 2-core CPU, float64: see the module's note).
_EFFICIENCY = {
    "solve": 0.6,
    "geometry": 0.8,
    "spectra": 0.16,  # LAPACK's nonsymmetric eigensolver, one thread
    "interval": 0.45,  # one layer: small products
    "whole": 0.7,
    "tokens": 0.72,
}

#: Each stage's compilation, in units of the reference compilation `_probe` times
#: (fitted as `_EFFICIENCY`: a stage's first run less its warm run).
_COMPILE = {
    "solve": 3.4,
    "geometry": 2.9,
    "spectra": 2.5,
    "interval": 9.5,
    "whole": 12.5,
    "tokens": 2.5,
}


def _probe(dtype) -> tuple[float, float]:
    """This machine's rate of a matrix product in `dtype` (operations a second, the best
    of a few warm calls) and the seconds of the reference compilation (a small program of
    a few dozen operations, compiled fresh)."""
    n, d, f = 256, 512, 1024
    a = jnp.ones((n, d), dtype)
    b = jnp.ones((d, f), dtype)
    mm = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(mm(a, b))
    best = np.inf
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        best = min(best, time.perf_counter() - start)
    rate = 2.0 * n * d * f / max(best, 1e-9)

    def program(x, scale):  # an unrolled chain, compiled anew each time (a new closure)
        for i in range(24):
            x = jnp.tanh(x @ x.T * (scale + i)) + jnp.sin(x)
        return x.sum()

    x = jnp.ones((8, 8), dtype)
    compile_s = np.inf
    for scale in (1.0, 2.0):  # the faster of two: the first may pay for a cold start
        start = time.perf_counter()
        jax.jit(lambda x, s=scale: program(x, s)).lower(x).compile()
        compile_s = min(compile_s, time.perf_counter() - start)
    return rate, compile_s


def _layer_shape(eq) -> dict:
    """The entries of one layer's kernels and the attention's heads and sizes."""
    att, _ = eq.controls(eq.t0, "right", "attention").discretise(eq.grid)
    ff, _ = eq.controls(eq.t0, "right", "feedforward").discretise(eq.grid)
    kernels = sum(  # the kernels are the fields named w... (the biases b...)
        int(np.prod(a.shape))
        for op in (att, ff)
        for name, a in vars(op).items()
        if name.startswith("w") and getattr(a, "ndim", 0) >= 2
    )
    wq, wv = getattr(att, "wq", None), getattr(att, "wv", None)
    heads = 0 if wq is None else int(wq.shape[0])
    e = 0 if wq is None else int(wq.shape[-1])
    ev = e if wv is None else int(wv.shape[-1])
    w1 = getattr(ff, "w1", None)
    return {"kernels": kernels, "heads": heads, "e": e, "ev": ev,
            "hidden": None if w1 is None else int(w1.shape[-1])}  # fmt: skip


def evaluations(eq, s: float, t: float, solver, dt0) -> int:
    """Field evaluations of a solve over `[s, t]`: one per layer without a step `dt0`
    (the default, the discrete network), else one per step and stage of an explicit
    Runge-Kutta solver, one per step of another (the default scheme included)."""
    from .._kv_cache import _explicit_rk, _stages

    length = float(t - s)
    if dt0 is None:  # one step a layer (of unit length for smooth controls)
        layer = float(eq.controls.layer_length) if hasattr(eq.controls, "layer_length") else 1.0
        return max(1, int(round(length / layer)))
    steps = max(1, int(round(length / float(dt0))))
    rk = None if solver is None else _explicit_rk(solver)
    return steps * (1 if rk is None else len(_stages(rk.tableau)[3]))


def operations(eq, ts, *, inputs, tokens, n_real, features, solver, dt0, lyapunov,
               token_vjps, block, iters) -> dict:  # fmt: skip
    """Each stage's operations (see the module's note), `iters` iterations an exponent."""
    sh = _layer_shape(eq)

    def c(n):
        return 2.0 * n * sh["kernels"] + 2.0 * n * n * sh["heads"] * (sh["e"] + sh["ev"])

    d = features
    hidden = sh["hidden"] or 4 * d
    k = len(ts) - 1
    whole = evaluations(eq, ts[0], ts[-1], solver, dt0)
    ops = {
        "solve": inputs * whole * c(tokens),
        "geometry": 2.0 * inputs * len(ts) * c(tokens),
        "spectra": k * (10.0 * d**3 + 6.0 * d * d * hidden),
    }
    if lyapunov:
        ops["interval"] = sum(
            3.0 * iters * block * evaluations(eq, s, t, solver, dt0) * c(n_real)
            for s, t in zip(ts[:-1], ts[1:], strict=True)
        )
        ops["whole"] = 3.0 * iters * block * whole * c(n_real)
        ops["tokens"] = (d * whole * c(n_real) if token_vjps
                         else 3.0 * iters * block * n_real * whole * c(n_real))  # fmt: skip
    return ops


def seconds(ops: dict, rate: float, compile_s: float) -> dict:
    """Each stage's expected seconds from its operations, the probe's rate and its
    reference compilation."""
    return {
        name: n / (rate * _EFFICIENCY[name]) + _COMPILE[name] * compile_s for name, n in ops.items()
    }


def expected(eq, ts, *, inputs, tokens, n_real, features, dtype, solver, dt0, lyapunov,
             token_vjps, block, max_iters) -> tuple[float, float]:  # fmt: skip
    """The seconds `analyze` is expected to take, before it starts: at `TYPICAL_ITERS`
    iterations an exponent (at most `max_iters`), and at `max_iters` (the bound), each
    with the probe's own second. The caller waits for its pending work first (`analyze`
    does), so that the probe times this machine and not that work."""
    start = time.perf_counter()
    rate, compile_s = _probe(dtype)
    probe_s = time.perf_counter() - start
    shape = dict(inputs=inputs, tokens=tokens, n_real=n_real, features=features,
                 solver=solver, dt0=dt0, lyapunov=lyapunov, token_vjps=token_vjps,
                 block=block)  # fmt: skip
    typical = seconds(operations(eq, ts, iters=min(TYPICAL_ITERS, max_iters), **shape), rate,
                      compile_s)  # fmt: skip
    bound = seconds(operations(eq, ts, iters=max_iters, **shape), rate, compile_s)
    return probe_s + sum(typical.values()), probe_s + sum(bound.values())
