"""The cost of a continuous depth step against its count of field evaluations.

At nanoGPT's CPU shape (`bench_nanogpt.py`'s GPT: 4 layers, 4 heads, width 128, context 64,
batch 12; its model construction imported), each depth scheme of `itde.SCHEMES` solves the
GPT's equation at Δt = 1 (one step per layer), on the controls `bench_nanogpt.py` trains
(`LegendreControls.from_layers`: one Legendre mode per layer, the same network under Lie
at Δt = 1). The baseline is the discrete GPT: Lie at Δt = 1 on per-layer controls.

For each scheme: the time of a training step (forward + backward + AdamW with clipping,
`itde.train.make_step`, jitted and warmed) and of a forward pass (`model.batched`), both
as the median over `--rounds` interleaved rounds (every round times every row, in a
rotated order, `--calls` calls each) of the ratio to the baseline measured in the same
round. The count of field evaluations per step is in units of one Lie step (one
attention evaluation A plus one feed-forward evaluation F); a splitting scheme evaluates
A and F unequal numbers of times, weighted here by their FLOPs at this shape
(A: 4d² + 2nd per token, F: 8d² per token, so A = 0.385 and F = 0.615 of a Lie step).
`overhead` = measured ratio / count.

Rows named `scheme:variant` are the same scheme before a change of the library (the
setting the library used to take), timed in the same rounds, so before/after figures come
from one run.

    python benchmarks/bench_step_cost.py [--rounds 7 --calls 5 --out runs/bench_step_cost]
    python benchmarks/bench_step_cost.py --tiny
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
from bench_nanogpt import GPT, NextToken, itde_from_gpt, optim_config

import itde
import itde_solvers as solvers
from itde import SCHEMES
from itde._internal import _solve
from itde.train import make_optimizer, make_step
from itde.train._internal import _output

FULL = dict(n_layers=4, n_heads=4, width=128, context=64, batch=12, vocab=84)
TINY = dict(n_layers=2, n_heads=2, width=16, context=8, batch=2, vocab=11)


def shares(s: dict) -> tuple[float, float]:
    """The FLOP shares of attention A and feed-forward F in one Lie step (per token:
    A = QKV and output projections 4d² plus scores and mixing 2nd, F = 8d²)."""
    d, n = s["width"], s["context"]
    a, f = 4 * d * d + 2 * n * d, 8 * d * d
    return a / (a + f), f / (a + f)


def measured_shares(ide, s: dict, calls: int = 30) -> dict[str, float]:
    """Attention's share of the time of one A + F evaluation, measured at the shape (best of
    `calls` warm calls, a batch of random states): `"forward"` the fields themselves,
    `"train"` the gradient of a sum of squares of each (parameters and state). The FLOP
    shares of `shares` leave out the softmax and the memory traffic; these do not."""
    u = jax.random.normal(jax.random.key(0), (s["batch"], s["context"], s["width"]))
    att = lambda e, x: jax.vmap(lambda y: e.attention_field(e.t0, y))(x)  # noqa: E731
    ff = lambda e, x: jax.vmap(lambda y: e.feedforward_field(e.t0, y))(x)  # noqa: E731

    def best(fn) -> float:
        f = eqx.filter_jit(fn)
        jax.block_until_ready(f(ide, u))
        out = np.inf
        for _ in range(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(f(ide, u))
            out = min(out, time.perf_counter() - t0)
        return out

    def grad(field):
        return eqx.filter_grad(lambda e, x: jnp.sum(field(e, x) ** 2))

    fa, ff_ = best(att), best(ff)
    ga, gf = best(grad(att)), best(grad(ff))
    return {"forward": fa / (fa + ff_), "train": ga / (ga + gf)}


def counts(s: dict) -> dict[str, tuple[int, int]]:
    """Per scheme, the (A, F) evaluations of one step, from the method's definition: a
    Lie / parallel step evaluates each once; Strang with Heun sub-steps evaluates A twice
    in each of its two half steps and F twice in its full step; a projected Runge–Kutta
    method evaluates the whole field A + F once per stage of its tableau, the
    first-same-as-last stage not counted (diffrax's Dopri8: 14 stages, 13 counted; a
    projected step never uses that stage's value but for an error estimate)."""
    stages = {"euler": 1, "heun": 2, "midpoint": 2, "rk4": 4, "tsit5": 6, "dopri5": 6,
              "dopri8": 13}  # fmt: skip
    out = {"lie": (1, 1), "parallel": (1, 1), "strang": (4, 2)}
    out.update({k: (v, v) for k, v in stages.items()})
    return out


class Net(eqx.Module):
    """`bench_nanogpt.ItdeGPT` with the solver given as a module (so that a row can be a
    scheme of `itde.SCHEMES` or a variant of one)."""

    embedding: jax.Array
    position: jax.Array
    equation: itde.TransformerIDE
    solver: object
    terms: str = eqx.field(static=True)
    before: bool = eqx.field(static=True, default=False)

    def batched(self, tokens):
        u0 = self.embedding[tokens] + self.position[: tokens.shape[-1]]
        kw = dict(solver=self.solver, dt0=1.0, terms=self.terms, batched=True)
        if self.before:  # the solve as it was: no stage dropped for fixed steps
            keep, _solve._for_fixed_steps = _solve._for_fixed_steps, lambda s: s
            try:
                u = itde.solve(self.equation, u0, **kw).ys[-1]
            finally:
                _solve._for_fixed_steps = keep
        else:
            u = itde.solve(self.equation, u0, **kw).ys[-1]
        return _output(self.equation, u) @ self.embedding.T


def build(s: dict, seed: int = 0):
    torch.manual_seed(seed)
    net = GPT(s["vocab"], s["context"], s["width"], s["n_layers"], s["n_heads"])
    m = itde_from_gpt(net)
    smooth = itde.LegendreControls.from_layers(m.equation.controls, block=m.equation.block)
    return m, dataclasses.replace(m.equation, controls=smooth)


def rows(s: dict, schemes) -> dict[str, tuple[Net, tuple[int, int]]]:
    """name -> (model, (A, F) evaluations per step)."""
    m, smooth_ide = build(s)
    cnt = counts(s)
    discrete = Net(m.embedding, m.position, m.equation, solvers.LieTrotter(), "paper")
    out = {"discrete GPT (lie, per-layer)": (discrete, (1, 1))}
    for name in schemes:
        sch = SCHEMES[name]
        out[name] = (Net(m.embedding, m.position, smooth_ide, sch.make(), sch.terms), cnt[name])
    for name, (solver, terms, c) in VARIANTS.items():
        if name.split(":")[0] in schemes:
            out[name] = (Net(m.embedding, m.position, smooth_ide, solver(), terms, True), c)
    return out


#: The settings the library took before this benchmark's changes, timed beside them.
VARIANTS: dict = {
    "rk4:before": (lambda: solvers.Projected(solvers.RK4()), "tangent", (4, 4)),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default="runs/bench_step_cost")
    a = ap.parse_args(argv)
    s = TINY if a.tiny else FULL
    if a.tiny:
        a.rounds, a.calls = min(a.rounds, 2), min(a.calls, 1)
    fa, ff = shares(s)
    table = rows(s, a.schemes)
    optimizer = make_optimizer(optim_config(1000, 10))
    step = make_step(optimizer, NextToken())
    key = jax.random.key(0)
    x = jax.random.randint(key, (s["batch"], s["context"] + 1), 0, s["vocab"])
    batch = (x[:, :-1], x[:, 1:])
    fwd = eqx.filter_jit(lambda m, t: m.batched(t))
    state = {}
    for name, (model, _) in table.items():
        st = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        t0 = time.perf_counter()
        out = step(model, st, batch)
        jax.block_until_ready(out)
        jax.block_until_ready(fwd(model, batch[0]))
        state[name] = (model, st, time.perf_counter() - t0)
        print(f"compiled {name}: {state[name][2]:.1f} s", flush=True)

    def time_it(fn) -> float:
        jax.block_until_ready(fn())
        t0 = time.perf_counter()
        for _ in range(a.calls):
            r = fn()
        jax.block_until_ready(r)
        return (time.perf_counter() - t0) / a.calls

    names = list(table)
    base = names[0]
    per = {n: {"train": [], "forward": []} for n in names}
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            model, st, _ = state[n]
            per[n]["train"].append(time_it(lambda: step(model, st, batch)))  # noqa: B023
            per[n]["forward"].append(time_it(lambda: fwd(model, batch[0])))  # noqa: B023
    result = {"shape": s, "rounds": a.rounds, "calls": a.calls, "shares": [fa, ff], "rows": []}
    print(f"{'scheme':<34}{'A,F':>6}{'count':>7}{'train':>8}{'fwd':>8}{'ovh tr':>8}{'ovh fw':>8}"
          f"{'base ms':>9}")  # fmt: skip
    for n in names:
        c = table[n][1]
        count = c[0] * fa + c[1] * ff
        ratio = {k: statistics.median(np.array(per[n][k]) / np.array(per[base][k]))
                 for k in ("train", "forward")}  # fmt: skip
        row = dict(name=n, evals=list(c), count=count, train_ratio=ratio["train"],
                   forward_ratio=ratio["forward"], train_overhead=ratio["train"] / count,
                   forward_overhead=ratio["forward"] / count,
                   train_ms=1e3 * statistics.median(per[n]["train"]),
                   forward_ms=1e3 * statistics.median(per[n]["forward"]),
                   compile_s=state[n][2])  # fmt: skip
        result["rows"].append(row)
        print(f"{n:<34}{f'{c[0]},{c[1]}':>6}{count:>7.2f}{ratio['train']:>8.2f}"
              f"{ratio['forward']:>8.2f}{row['train_overhead']:>8.2f}"
              f"{row['forward_overhead']:>8.2f}{row['train_ms']:>9.1f}")  # fmt: skip
    ms = measured_shares(table[base][0].equation, s, calls=3 if a.tiny else 30)
    result["measured_shares"] = ms
    print(f"attention's measured share of A + F: forward {ms['forward']:.3f}, training "
          f"{ms['train']:.3f} (FLOPs: {fa:.3f}); Strang's count with them: forward "
          f"{4 * ms['forward'] + 2 * (1 - ms['forward']):.2f}, training "
          f"{4 * ms['train'] + 2 * (1 - ms['train']):.2f}")  # fmt: skip
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step_cost.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'bench_step_cost.json'}")
    return result


if __name__ == "__main__":
    main()
