"""Where the time goes: itde against plain JAX and PyTorch, per op class.

Two workloads: the forward pass of an `itde.from_torch` encoder (batch 16, 128 tokens,
width 128, 4 heads, 4 layers, post-LN, relu) and a training step at the charlm shapes
(configs/charlm.toml: batch 32, context 64, width 64, 4 heads, hidden 128, 2 layers, causal,
gelu; forward + backward + clipped AdamW). Programs on the same weights: itde (the
library's own jitted forward / `itde.train.make_step`), plain JAX (a post-LN encoder with
`lax.scan` over stacked layers, attention head-major), for the training step also plain JAX
+ remat (the same scan with `jax.checkpoint` on each layer: `itde.solve`'s memory policy),
and PyTorch (`nn.TransformerEncoder`, the faster of 1 thread and its default).

The JAX programs run under `jax.profiler.trace`; XLA:CPU records every executed HLO
instruction (thunk) with its duration, and each instruction is put in a class by what its
compiled HLO contains: GEMM (a `dot`), softmax (`exponential` + `reduce`), layernorm
(`rsqrt` + `reduce`), other reductions, copies/transposes (only data movement), loop state
(`dynamic-slice`/`dynamic-update-slice`: the controls of the current layer, the
checkpoints), loop control (`while`/`conditional` bodies' own time, nested instructions
subtracted), elementwise (the rest). PyTorch runs under `torch.profiler`, self CPU time per
ATen op, classified by name. `host/other` is wall time per call minus the classified time:
Python, dispatch, waits (negative when ops ran on both threads at once). The profilers add
overhead of their own, so the per-class times are shares; the ratio of unprofiled wall times
(interleaved medians) is the speed figure. XLA:CPU runs some matrix products (Eigen's, e.g.
a weight gradient `x^T g`) asynchronously: the trace records their dispatch, and the rest of
their time shows as idle time in a timeline and as host/other here.

    python benchmarks/profile_ops.py [--workload forward|train|both --calls 20 --out runs/profile]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import re
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from _plain import plain_encoder
from _timing import median_time

CLASSES = ("GEMM", "attention (fused)", "softmax", "layernorm", "reduce", "copy/transpose",
           "loop state", "loop control", "elementwise")  # fmt: skip
_MOVE = {"copy", "transpose", "bitcast", "reshape", "broadcast", "slice", "concatenate",
         "parameter", "tuple", "get-tuple-element", "constant", "pad", "iota"}  # fmt: skip
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")


def _hlo_classes(hlo: str) -> dict[str, str]:
    """Instruction name -> op class, from the compiled module's text."""
    comps: dict[str, list[tuple[str, str, str]]] = {}
    cur = None
    for line in hlo.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?.*\{\s*$", line)
        if m and "=" not in line.split("{")[0]:
            cur = m.group(1)
            comps[cur] = []
            continue
        m = _INSTR.match(line)
        if m and cur is not None:
            comps[cur].append((m.group(1), m.group(2), m.group(3)))

    def ops(comp, seen=()):
        out = set()
        for _, op, rest in comps.get(comp, []):
            out.add(op)
            for callee in re.findall(r"calls=%?([\w.\-]+)", rest):
                if callee not in seen:
                    out |= ops(callee, (*seen, comp))
        return out

    classes = {}
    for comp, instrs in comps.items():
        for name, op, rest in instrs:
            inner = {op}
            if op in ("fusion", "call", "custom-call"):
                for callee in re.findall(r"calls=%?([\w.\-]+)", rest):
                    inner |= ops(callee)
            classes[name] = _classify(op, inner, rest)
    return classes


def _classify(op: str, inner: set[str], rest: str) -> str:
    if op in ("while", "conditional"):
        return "loop control"
    if "dot" in inner or "convolution" in inner or "matmul" in rest.lower():
        return "GEMM"
    if "exponential" in inner and "reduce" in inner:
        return "softmax"
    if ("rsqrt" in inner or "sqrt" in inner) and "reduce" in inner:
        return "layernorm"
    if "reduce" in inner:
        return "reduce"
    if inner & {"dynamic-slice", "dynamic-update-slice"}:
        return "loop state"
    if inner <= _MOVE | {"fusion"}:
        return "copy/transpose"
    return "elementwise"


def profile_jax(fn, args, calls: int) -> dict[str, float]:
    """Seconds per call per op class of the jitted `fn(*args)` (already compiled)."""
    classes = _hlo_classes(fn.lower(*args).compile().as_text())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for _ in range(calls):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        path = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
        data = jax.profiler.ProfileData.from_file(path)
    total = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            evs = []
            for e in line.events:
                st = dict(e.stats)
                if "hlo_op" in st:
                    evs.append((e.start_ns, e.start_ns + e.duration_ns, st["hlo_op"]))
            evs.sort(key=lambda t: (t[0], -t[1]))
            stack: list[list] = []  # [end, name, child time]
            for start, end, name in evs:
                while stack and stack[-1][0] <= start:
                    e_end, e_name, child, e_start = stack.pop()
                    total[classes.get(e_name, "elementwise")] += (e_end - e_start) - child
                if stack:
                    stack[-1][2] += end - start
                stack.append([end, name, 0.0, start])
            for e_end, e_name, child, e_start in stack:
                total[classes.get(e_name, "elementwise")] += (e_end - e_start) - child
    return {k: v * 1e-9 / calls for k, v in total.items()}


def _torch_class(name: str) -> str:
    n = name.lower()
    if "scaled_dot_product" in n or "flash_attention" in n or "transformer_encoder_layer" in n:
        return "attention (fused)"
    if any(k in n for k in ("mm", "linear", "matmul", "addmm", "baddbmm")):
        return "GEMM"
    if "softmax" in n:
        return "softmax"
    if "layer_norm" in n:
        return "layernorm"
    if any(k in n for k in ("sum", "mean", "norm", "max", "min")):
        return "reduce"
    if n in ("t", "cat", "stack", "view", "index", "select", "slice", "split", "chunk") or any(
        k in n for k in ("copy", "clone", "contiguous", "transpose", "permute", "reshape",
                         "expand", "unsafe_", "as_strided", "empty", "zero_", "view")
    ):  # fmt: skip
        return "copy/transpose"
    return "elementwise"


def profile_torch(fn, calls: int) -> dict[str, float]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
    total = collections.Counter()
    for ev in prof.key_averages():
        if ev.key.startswith(("aten::", "cpu", "Optimizer", "autograd")) or "::" in ev.key:
            total[_torch_class(ev.key.split("::")[-1])] += ev.self_cpu_time_total * 1e-6
    return {k: v / calls for k, v in total.items()}


# ---------------------------------------------------------------- workloads
def stacked_params(enc) -> dict:
    names = {"w_in": "self_attn.in_proj_weight", "b_in": "self_attn.in_proj_bias",
             "w_out": "self_attn.out_proj.weight", "b_out": "self_attn.out_proj.bias",
             "w1": "linear1.weight", "b1": "linear1.bias", "w2": "linear2.weight",
             "b2": "linear2.bias", "g1": "norm1.weight", "b1n": "norm1.bias",
             "g2": "norm2.weight", "b2n": "norm2.bias"}  # fmt: skip
    out = {}
    for k, n in names.items():
        out[k] = jnp.stack([jnp.asarray(dict(layer.named_parameters())[n].detach().numpy())
                            for layer in enc.layers])  # fmt: skip
    return out


def forward_workload(repeats: int):
    import itde

    B, N, d, H, L = 16, 128, 128, 4, 4
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d, H, 4 * d, dropout=0.0, batch_first=True)
    enc = torch.nn.TransformerEncoder(layer, L, enable_nested_tensor=False).eval()
    x_np = np.random.default_rng(0).standard_normal((B, N, d)).astype(np.float32)
    xt, xj = torch.as_tensor(x_np), jnp.asarray(x_np)
    model = itde.from_torch(enc)
    itde_fn, itde_args = jax.jit(lambda m, x: m.batch(x)), (model, xj)
    p = stacked_params(enc)
    plain_fn, plain_args = jax.jit(lambda p, x: plain_encoder(p, x, H)), (p, xj)

    def torch_fn():
        with torch.no_grad():
            enc(xt)

    err = float(np.max(np.abs(np.asarray(itde_fn(*itde_args)) - np.asarray(plain_fn(*plain_args)))))
    return {"name": "forward", "shape": dict(batch=B, tokens=N, width=d, heads=H, layers=L),
            "itde": (itde_fn, itde_args), "plain_jax": (plain_fn, plain_args),
            "torch": torch_fn, "max_abs_diff_itde_plain": err}  # fmt: skip


def train_workload(repeats: int):
    from bench_train_vs_torch import TorchCharLM, torch_optimizer, torch_step

    from itde.train import Run, TrainExperiment, load, make_step

    cfg = load(TrainExperiment, "configs/charlm.toml")
    run = Run(cfg, devices=jax.devices()[:1])
    model, opt_state = run.init_state()
    step = make_step(run.optimizer, run.task)
    x, y = run.task.train_batch(jax.random.key(0), cfg.optim.batch_size)
    x, y = jnp.asarray(x), jnp.asarray(y)
    net = TorchCharLM(model)
    topt, tsched = torch_optimizer(net, cfg.optim)
    xt, yt = torch.as_tensor(np.array(x)).long(), torch.as_tensor(np.array(y)).long()
    m = cfg.model
    # plain JAX: the same weights, the same optimiser chain (clip + AdamW on the schedule)
    p = {"emb": model.embedding, "pos": model.position, "enc": stacked_params(net.encoder),
         "w": model.readout, "b": model.readout_bias}  # fmt: skip
    o = cfg.optim
    opt = optax.chain(optax.clip_by_global_norm(o.clip_norm),
                      optax.adamw(optax.warmup_cosine_decay_schedule(
                          0.0, o.lr, o.warmup, o.steps, o.lr * o.final_lr_ratio),
                          b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))  # fmt: skip
    def plain_step_fn(remat: bool):
        def plain_loss(p, x, y):
            u = p["emb"][x] + p["pos"][: x.shape[1]]
            h = plain_encoder(p["enc"], u, m.n_heads, causal=True, remat=remat,
                              act=lambda z: jax.nn.gelu(z, approximate=False))  # fmt: skip
            logp = jax.nn.log_softmax(h @ p["w"] + p["b"], -1)
            return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))

        @jax.jit
        def plain_step(p, s, x, y):
            loss, g = jax.value_and_grad(plain_loss)(p, x, y)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        return plain_step

    plain_step, remat_step = plain_step_fn(False), plain_step_fn(True)
    jstep = jax.jit(step)  # already an eqx.filter_jit; the outer jit gives `.lower`
    loss_itde = float(jstep(model, opt_state, (x, y))[2])
    loss_plain = float(plain_step(p, opt.init(p), x, y)[2])
    loss_remat = float(remat_step(p, opt.init(p), x, y)[2])
    return {"name": "train", "shape": dict(batch=o.batch_size, context=cfg.task.context,
                                           width=m.n_features, heads=m.n_heads,
                                           hidden=m.n_hidden, layers=m.n_layers),
            "itde": (jstep, (model, opt_state, (x, y))),
            "plain_jax": (plain_step, (p, opt.init(p), x, y)),
            "plain_jax_remat": (remat_step, (p, opt.init(p), x, y)),
            "torch": lambda: torch_step(net, topt, tsched, o.clip_norm, xt, yt),
            "first_loss": {"itde": loss_itde, "plain_jax": loss_plain,
                           "plain_jax_remat": loss_remat}}  # fmt: skip


JAX_PROGRAMS = ("itde", "plain_jax", "plain_jax_remat")


def run_workload(w: dict, calls: int, repeats: int, rounds: int) -> dict:
    threads = torch.get_num_threads()
    progs = [k for k in JAX_PROGRAMS if k in w]
    fns = {k: (lambda k: lambda: jax.block_until_ready(w[k][0](*w[k][1])))(k) for k in progs}
    for f in fns.values():
        f()
    w["torch"]()
    times = {k: [] for k in (*progs, "torch_1", f"torch_{threads}")}
    for _ in range(rounds):  # interleaved: noise hits every program alike
        for k in progs:
            times[k].append(median_time(fns[k], repeats))
        for n in sorted({1, threads}):
            torch.set_num_threads(n)
            times[f"torch_{n}"].append(median_time(w["torch"], repeats))
    med = {k: statistics.median(v) for k, v in times.items() if v}
    best = min((k for k in med if k.startswith("torch_")), key=med.get)
    torch.set_num_threads(int(best.split("_")[1]))
    prof = {k: profile_jax(*w[k], calls) for k in progs}
    prof["torch"] = profile_torch(w["torch"], calls)
    torch.set_num_threads(threads)
    wall = {**{k: med[k] for k in progs}, "torch": med[best]}
    for k, p in prof.items():
        p["host/other"] = wall[k] - sum(p.values())
    plain = [k for k in progs if k != "itde"]
    best_plain = min(plain, key=med.get)
    return {"workload": w["name"], "shape": w["shape"], "median_s": med, "torch_best": best,
            "ratio_itde_over_torch": med["itde"] / med[best],
            **{f"ratio_itde_over_{k}": med["itde"] / med[k] for k in plain},
            "best_plain_jax": best_plain,
            "ratio_itde_over_best_plain_jax": med["itde"] / med[best_plain],
            "rounds": times, "profile_s_per_call": prof,
            **{k: w[k] for k in ("max_abs_diff_itde_plain", "first_loss") if k in w}}  # fmt: skip


_NAMES = {"itde": "itde", "plain_jax": "plain JAX", "plain_jax_remat": "plain JAX + remat",
          "torch": "PyTorch"}  # fmt: skip


def _table(r: dict) -> str:
    progs = [k for k in (*JAX_PROGRAMS, "torch") if k in r["profile_s_per_call"]]
    ratios = ", ".join(f"itde/{_NAMES[k]} {r[f'ratio_itde_over_{k}']:.2f}"
                       for k in progs if k not in ("itde", "torch"))  # fmt: skip
    lines = [f"{r['workload']} {r['shape']}: itde/torch {r['ratio_itde_over_torch']:.2f}, "
             f"{ratios} (torch: {r['torch_best']})",
             "| op class | " + " | ".join(f"{_NAMES[k]} ms" for k in progs) + " |",
             "|---|" + "---|" * len(progs)]  # fmt: skip
    p = r["profile_s_per_call"]
    for c in (*CLASSES, "host/other"):
        row = [p[k].get(c, 0.0) * 1e3 for k in progs]
        if any(abs(v) >= 0.005 for v in row):
            lines.append(f"| {c} | " + " | ".join(f"{v:.2f}" for v in row) + " |")
    w = {**r["median_s"], "torch": r["median_s"][r["torch_best"]]}
    lines.append("| **wall (unprofiled median)** | "
                 + " | ".join(f"{w[k] * 1e3:.2f}" for k in progs) + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", choices=["forward", "train", "both"], default="both")
    ap.add_argument("--calls", type=int, default=20, help="profiled calls")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--out", default="runs/profile")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in ("forward", "train") if a.workload == "both" else (a.workload,):
        w = (forward_workload if name == "forward" else train_workload)(a.repeats)
        r = run_workload(w, a.calls, a.repeats, a.rounds)
        results.append(r)
        print(_table(r), flush=True)
    (out / "profile.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'profile.json'}")


if __name__ == "__main__":
    main()
