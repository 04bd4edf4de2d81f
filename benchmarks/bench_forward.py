"""Forward-pass cost of `itde.from_torch` models against PyTorch and a plain JAX encoder.

Measured in one run on the same input (CPU by default): the itde model (jit + vmap,
warmed up), PyTorch's own `nn.TransformerEncoder` in eval mode under `no_grad`, and a
post-LN encoder written directly in JAX with the same weights (the baseline for the
cost of itde's abstractions: modules, diffrax's loop, quadrature hooks). Reports
compile time, the median of repeats, and the two ratios; writes JSON.

    python benchmarks/bench_forward.py [--batch 16 --tokens 128 --d-model 128 --heads 4
                                        --layers 4 --repeats 30 --out runs/bench_forward]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
from _timing import median_time

import itde


def plain_jax_encoder(params, x, n_heads, eps):
    """Post-LN encoder written directly (batch-first), the abstraction-free baseline."""
    B, N, d = x.shape
    dh = d // n_heads
    for p in params:
        qkv = x @ p["w_in"].T + p["b_in"]
        q, k, v = jnp.split(qkv, 3, axis=-1)
        q, k, v = (a.reshape(B, N, n_heads, dh).transpose(0, 2, 1, 3) for a in (q, k, v))
        s = (q / math.sqrt(dh)) @ k.transpose(0, 1, 3, 2)
        o = (jax.nn.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, N, d)
        x = x + o @ p["w_out"].T + p["b_out"]
        x = _ln(x, p["g1"], p["b1n"], eps)
        h = jax.nn.relu(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
        x = _ln(x + h, p["g2"], p["b2n"], eps)
    return x


def _ln(x, g, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + eps) * g + b


def _params(enc):
    out = []
    for layer in enc.layers:
        a = layer.self_attn
        t = {
            "w_in": a.in_proj_weight,
            "b_in": a.in_proj_bias,
            "w_out": a.out_proj.weight,
            "b_out": a.out_proj.bias,
            "w1": layer.linear1.weight,
            "b1": layer.linear1.bias,
            "w2": layer.linear2.weight,
            "b2": layer.linear2.bias,
            "g1": layer.norm1.weight,
            "b1n": layer.norm1.bias,
            "g2": layer.norm2.weight,
            "b2n": layer.norm2.bias,
        }
        out.append({k: jnp.asarray(v.detach().numpy()) for k, v in t.items()})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="runs/bench_forward")
    a = ap.parse_args(argv)

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        a.d_model, a.heads, 4 * a.d_model, dropout=0.0, batch_first=True
    )
    enc = torch.nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False).eval()
    x_np = np.random.default_rng(0).standard_normal((a.batch, a.tokens, a.d_model))
    x_np = x_np.astype(np.float32)
    x_t, x_j = torch.as_tensor(x_np), jnp.asarray(x_np)

    model = itde.from_torch(enc)
    itde_fwd = jax.jit(jax.vmap(model))
    itde_batch = eqx.filter_jit(lambda m, x: m.batch(x))
    params = _params(enc)
    plain_fwd = jax.jit(lambda p, x: plain_jax_encoder(p, x, a.heads, 1e-5))

    t0 = time.perf_counter()
    y_itde = itde_fwd(x_j).block_until_ready()
    compile_itde = time.perf_counter() - t0
    t0 = time.perf_counter()
    y_plain = plain_fwd(params, x_j).block_until_ready()
    compile_plain = time.perf_counter() - t0
    with torch.no_grad():
        y_torch = enc(x_t).numpy()
    err_torch = float(np.max(np.abs(np.asarray(y_itde) - y_torch)))
    err_plain = float(np.max(np.abs(np.asarray(y_itde) - np.asarray(y_plain))))

    def run_torch():
        with torch.no_grad():
            enc(x_t)

    # interleave the runs in rounds so that machine noise hits all of them alike; PyTorch
    # is timed with its default thread count and with one thread, and the faster of the
    # two is the baseline (its multi-thread timing is erratic on a loaded machine)
    threads = torch.get_num_threads()
    itde_batch(model, x_j).block_until_ready()
    t_itde, t_batch, t_plain, t_torch, t_torch1 = [], [], [], [], []
    for _ in range(3):
        t_itde.append(median_time(lambda: itde_fwd(x_j).block_until_ready(), a.repeats))
        t_batch.append(median_time(lambda: itde_batch(model, x_j).block_until_ready(), a.repeats))
        t_plain.append(median_time(lambda: plain_fwd(params, x_j).block_until_ready(), a.repeats))
        t_torch.append(median_time(run_torch, a.repeats))
        torch.set_num_threads(1)
        t_torch1.append(median_time(run_torch, a.repeats))
        torch.set_num_threads(threads)
    runs = (
        ("itde", t_itde),
        ("itde_batch", t_batch),
        ("plain_jax", t_plain),
        ("torch_default_threads", t_torch),
        ("torch_1_thread", t_torch1),
    )
    med = {k: statistics.median(v) for k, v in runs}
    med["torch"] = min(med["torch_default_threads"], med["torch_1_thread"])
    # the backends' own GEMM on the FFN's shape: how much of the gap is the matmul library
    ga = np.random.default_rng(1).standard_normal((a.batch * a.tokens, a.d_model), np.float32)
    gb = np.random.default_rng(2).standard_normal((a.d_model, 4 * a.d_model), np.float32)
    jmm = jax.jit(jnp.matmul)
    jga, jgb, tga, tgb = jnp.asarray(ga), jnp.asarray(gb), torch.as_tensor(ga), torch.as_tensor(gb)
    jmm(jga, jgb).block_until_ready()
    gemm_jax = median_time(lambda: jmm(jga, jgb).block_until_ready(), 5 * a.repeats)
    gemm_torch = median_time(lambda: tga @ tgb, 5 * a.repeats)
    result = {
        "shape": {
            "batch": a.batch,
            "tokens": a.tokens,
            "d_model": a.d_model,
            "heads": a.heads,
            "layers": a.layers,
        },
        "device": jax.devices()[0].platform,
        "torch_threads": torch.get_num_threads(),
        "compile_s": {"itde": compile_itde, "plain_jax": compile_plain},
        "median_forward_s": med,
        "ratio_itde_over_torch": med["itde"] / med["torch"],
        "ratio_itde_over_plain_jax": med["itde"] / med["plain_jax"],
        "gemm_ratio_jax_over_torch": gemm_jax / gemm_torch,
        "max_abs_diff": {"itde_vs_torch": err_torch, "itde_vs_plain_jax": err_plain},
    }
    print(f"{'':<22}{'median forward (ms)':>20}{'compile (s)':>14}")
    for k in ("itde", "itde_batch", "plain_jax", "torch_default_threads", "torch_1_thread"):
        c = result["compile_s"].get(k)
        print(f"{k:<22}{1e3 * med[k]:>20.2f}{'' if c is None else f'{c:>14.2f}'}")
    print(f"ratio itde/torch     = {result['ratio_itde_over_torch']:.3f}")
    print(f"ratio itde/plain_jax = {result['ratio_itde_over_plain_jax']:.3f}")
    print(
        f"ratio jax/torch on one GEMM [{a.batch * a.tokens}x{a.d_model}]@"
        f"[{a.d_model}x{4 * a.d_model}] = {gemm_jax / gemm_torch:.3f}"
    )
    print(f"max |itde - torch| = {err_torch:.2e}, max |itde - plain| = {err_plain:.2e}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_forward.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'bench_forward.json'}")


if __name__ == "__main__":
    main()
