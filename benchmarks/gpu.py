"""Throughput of the charlm model on an accelerator: tokens/s, MFU and the ratio to PyTorch.

One command, at most about five minutes on a GPU, writing one JSON file. The model is the
charlm model of `itde train` (token + learned positional embedding, a causal post-LN
Transformer in the paper's regime — Lie–Trotter, one step per layer — and a linear readout)
at 6 layers x 6 heads x width 384, feed-forward 1536, context 256, vocabulary 96. For
float32 and bfloat16 (parameters kept in float32, the forward and backward passes cast to
bfloat16, as `itde train` does with `run.dtype = "bfloat16"`), and for each attention
implementation (`dense`, `blocked`, `fused`: `jax.nn.dot_product_attention` with JAX's
choice, and on a GPU `cudnn`: the same with `implementation="cudnn"`, cuDNN's fused flash
kernel, bfloat16 only), it times a forward+backward pass (`jax.value_and_grad` of the mean
cross-entropy) and the same model in PyTorch on the same device (`itde.to_torch`, the same
weights; `torch.autocast` for bfloat16; on a GPU the loss and its backward pass go through
`torch.compile`, whose first call is timed apart as `torch_compile_s`). Timings are medians
of interleaved rounds (itde's implementations and PyTorch in turn), so that machine noise
hits them alike; the figure to quote is the ratio.

    python benchmarks/gpu.py                      # the accelerator run, writes runs/gpu/gpu.json
    python benchmarks/gpu.py --tiny               # a tiny model on CPU: checks the script runs
    python benchmarks/gpu.py --shape nanogpt      # nanoGPT's CPU-run shape; also gpt2-124m
    python benchmarks/gpu.py --shape gpt2-124m --dtypes bfloat16   # issue 34's accelerator row

JSON: `device`, `shape`, `flops_per_step` (model FLOPs of one forward+backward: 3x the
forward's matrix products, attention counted as the full `[tokens, tokens]` matrix), and
one record per (dtype, implementation) with `compile_s`, `step_s`, `tokens_per_s`, `mfu`
(model FLOPs / step time / the device's peak for that dtype; null when the peak is not
known — give `--peak-tflops`), `ratio_itde_over_torch`, `loss` and `loss_torch` (the same
weights and batch: the two agree to round-off in float32), and `memory` (XLA's compiled
sizes; on a GPU also the device's peak bytes in use after that configuration). `peak_memory`
holds the process-wide peaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_time  # benchmarks/_timing.py, shared by the benchmark scripts

import itde
from itde.train import TokenModel

FULL = dict(layers=6, heads=6, width=384, hidden=1536, context=256, vocab=96, batch=64)
TINY = dict(layers=2, heads=2, width=16, hidden=32, context=16, vocab=12, batch=4)
#: The shapes `--shape` names: the charlm model above; nanoGPT's README CPU run (4 layers,
#: 4 heads, width 128, context 64, batch 12, character vocabulary of Shakespeare, 65); GPT-2
#: small's shape (12 x 12 x 768, context 1024, vocabulary 50257, 124M parameters with a tied
#: head: this model's head is untied, 163M), at batch 8.
SHAPES = {
    "charlm": FULL,
    "nanogpt": dict(layers=4, heads=4, width=128, hidden=512, context=64, vocab=65, batch=12),
    "gpt2-124m": dict(layers=12, heads=12, width=768, hidden=3072, context=1024, vocab=50257,
                      batch=8),
}  # fmt: skip
IMPLS = ("dense", "blocked", "fused", "cudnn")
#: What runs by default on a CPU: cuDNN's kernel exists on NVIDIA GPUs only.
CPU_IMPLS = ("dense", "blocked", "fused")
DTYPES = ("float32", "bfloat16")

# dense peak FLOP/s by device kind (vendor figures, no sparsity); float32 is the plain
# (non-tensor-core) rate, since neither JAX nor PyTorch is asked for TF32 here
PEAK_TFLOPS = {
    "H200": {"float32": 67.0, "bfloat16": 989.0},
    "H100": {"float32": 67.0, "bfloat16": 989.0},
    "A100": {"float32": 19.5, "bfloat16": 312.0},
}


def make_model(key, s: dict) -> TokenModel:
    """The charlm model at shape `s`, float32 parameters."""
    k_ide, k_e, k_p, k_r = jax.random.split(key, 4)
    d = s["width"]
    ide = itde.TransformerIDE.init(
        k_ide, n_layers=s["layers"], n_features=d, n_heads=s["heads"], n_hidden=s["hidden"],
        activation="gelu", causal=True,
    )  # fmt: skip
    return TokenModel(
        embedding=jax.random.normal(k_e, (s["vocab"], d)),
        position=jax.random.normal(k_p, (s["context"], d)),
        equation=ide,
        readout=jax.random.uniform(k_r, (d, s["vocab"]), minval=-1, maxval=1) / math.sqrt(d),
        readout_bias=jnp.zeros((s["vocab"],)),
    )


def with_impl(model: TokenModel, impl: str, block_size: int) -> TokenModel:
    if impl == "blocked":
        core = itde.Blocked(block_size)
    elif impl == "cudnn":
        core = itde.Fused(implementation="cudnn")
    else:
        core = itde.ATTENTION_CORES[impl]()
    ide = dataclasses.replace(model.equation, attention_core=core)
    return eqx.tree_at(lambda m: m.equation, model, ide)


def loss_fn(model: TokenModel, x, y, dtype):
    """Mean cross-entropy of next-token logits; the passes run in `dtype`."""
    m = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, model)
    logits = m.batched(x).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))


def flops_per_step(s: dict) -> float:
    """Model FLOPs of one forward+backward (3x forward; multiply-add = 2 FLOPs)."""
    B, n, d, f, L, V = (s[k] for k in ("batch", "context", "width", "hidden", "layers", "vocab"))
    per_token = L * (4 * d * d + 2 * d * f) + d * V  # q, k, v, o; two FFN matrices; readout
    attention = L * 2 * n * n * d  # q k^T and p v, full matrix
    return 3 * 2 * (B * n * per_token + B * attention)


class TorchCharLM:
    """The same model in PyTorch: embedding + positions + `itde.to_torch(ide)` + readout."""

    def __init__(self, model: TokenModel, device: str, compile: bool = False):
        import torch

        self.torch = torch
        self.device = device
        self.compiled = compile
        t = lambda a: torch.tensor(np.asarray(a), device=device, requires_grad=True)  # noqa: E731
        self.embedding, self.position = t(model.embedding), t(model.position)
        self.readout, self.readout_bias = t(model.readout), t(model.readout_bias)
        self.encoder = itde.to_torch(model.equation).to(device).train()
        n = model.position.shape[0]
        self.mask = torch.nn.Transformer.generate_square_subsequent_mask(n, device=device)
        # the whole loss (embedding, encoder, readout, cross-entropy) as one compiled graph;
        # one compilation per dtype (autocast is traced into it)
        self._loss = torch.compile(self.loss) if compile else self.loss

    def loss(self, x, y, dtype: str):
        torch = self.torch
        with torch.autocast(
            device_type=self.device.split(":")[0],
            dtype=torch.bfloat16,
            enabled=dtype == "bfloat16",
        ):
            u = self.embedding[x] + self.position[: x.shape[1]]
            h = self.encoder(u, mask=self.mask, is_causal=True)
            logits = (h @ self.readout + self.readout_bias).float()
        flat = logits.reshape(-1, logits.shape[-1])
        return torch.nn.functional.cross_entropy(flat, y.reshape(-1))

    def step(self, x, y, dtype: str):
        for p in self.parameters():
            p.grad = None
        loss = self._loss(x, y, dtype)
        loss.backward()
        return loss

    def parameters(self):
        return [self.embedding, self.position, self.readout, self.readout_bias,
                *self.encoder.parameters()]  # fmt: skip

    def sync(self):
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()


def _rss_peak_bytes() -> int:
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r) * (1 if platform.system() == "Darwin" else 1024)


def _device_peak(dev):
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return None if not stats else stats.get("peak_bytes_in_use")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny model (CPU check of the script)")
    ap.add_argument("--shape", choices=list(SHAPES), default="charlm",
                    help="the model's shape (default charlm; --tiny replaces it)")  # fmt: skip
    ap.add_argument("--batch", type=int, help="sequences per step (default 64; tiny 4)")
    ap.add_argument("--repeats", type=int, help="timed steps per round (default 10; tiny 2)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 3; tiny 1)")
    ap.add_argument("--impls", nargs="+", choices=IMPLS,
                    help="attention implementations (default: all; on a CPU all but cudnn)")  # fmt: skip
    ap.add_argument("--torch-compile", choices=("auto", "on", "off"), default="auto",
                    help="torch.compile the PyTorch baseline (auto: on a GPU only)")  # fmt: skip
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    ap.add_argument(
        "--torch-threads", type=int, default=1,
        help="PyTorch's CPU threads when it runs on CPU (default 1: OpenMP's spinning threads "
        "are erratic on a shared CPU; 0 = its default)",
    )  # fmt: skip
    ap.add_argument(
        "--peak-tflops", type=float, nargs=2, metavar=("FLOAT32", "BFLOAT16"),
        help="the device's peak TFLOP/s for the MFU (default: known GPUs only)",
    )  # fmt: skip
    ap.add_argument("--out", default="runs/gpu/gpu.json", help="the JSON file to write")
    a = ap.parse_args(argv)
    s = dict(TINY if a.tiny else SHAPES[a.shape])
    for name, default in (("batch", s["batch"]), ("repeats", 2 if a.tiny else 10),
                          ("rounds", 1 if a.tiny else 3)):  # fmt: skip
        v = getattr(a, name)
        v = default if v is None else v
        if v < 1:
            ap.error(f"--{name}={v} must be at least 1")
        setattr(a, name, v)
    s["batch"] = a.batch
    start = time.perf_counter()

    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    if a.impls is None:
        a.impls = list(IMPLS if dev.platform == "gpu" else CPU_IMPLS)
    elif "cudnn" in a.impls and dev.platform != "gpu":
        ap.error(f"--impls cudnn needs an NVIDIA GPU (this device: {dev.platform}); drop it")
    peaks = None
    if a.peak_tflops:
        peaks = dict(zip(DTYPES, a.peak_tflops))
    else:
        peaks = next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)
    block_size = max(1, s["context"] // 4)  # four token blocks: the blocked path really blocks
    model = make_model(jax.random.key(0), s)
    rng = np.random.default_rng(0)
    x_np = rng.integers(0, s["vocab"], (s["batch"], s["context"]), dtype=np.int32)
    y_np = np.roll(x_np, -1, axis=1)
    x, y = jax.device_put(x_np, dev), jax.device_put(y_np, dev)
    flops = flops_per_step(s)
    tokens = s["batch"] * s["context"]

    net = None
    if not a.no_torch:
        import torch

        torch_device = "cuda" if dev.platform == "gpu" and torch.cuda.is_available() else "cpu"
        if torch_device == "cpu" and a.torch_threads > 0:
            torch.set_num_threads(a.torch_threads)
        on = a.torch_compile == "on" or (a.torch_compile == "auto" and torch_device == "cuda")
        net = TorchCharLM(model, torch_device, compile=on)
        xt = torch.as_tensor(x_np, device=torch_device).long()
        yt = torch.as_tensor(y_np, device=torch_device).long()

    records = []
    for dtype in a.dtypes:
        jdt = jnp.dtype(dtype)
        steps, compile_s, losses, mem = {}, {}, {}, {}
        skipped = {}
        for impl in a.impls:
            if impl == "cudnn" and dtype != "bfloat16":
                skipped[impl] = "cuDNN's fused kernel takes float16/bfloat16 only"
                continue
            m = with_impl(model, impl, block_size)
            fn = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
            t0 = time.perf_counter()
            lowered = fn.lower(m, x, y, jdt)  # the same trace the first call makes
            compiled = lowered.compile()
            loss, grads = fn(m, x, y, jdt)
            jax.block_until_ready(grads)
            compile_s[impl] = time.perf_counter() - t0
            losses[impl] = float(loss)
            ma = _memory_analysis(getattr(compiled, "compiled", compiled))
            mem[impl] = {"xla": ma, "device_peak_bytes": _device_peak(dev)}
            steps[impl] = (lambda m=m: jax.block_until_ready(fn(m, x, y, jdt)), [])
        torch_times, loss_t, torch_compile_s = [], None, None
        if net is not None:
            t0 = time.perf_counter()
            loss_t = float(net.step(xt, yt, dtype).detach())  # warm-up (and the loss to compare)
            net.sync()
            torch_compile_s = time.perf_counter() - t0  # with torch.compile: its compilation
            if net.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()

        def torch_once():
            net.step(xt, yt, dtype)
            net.sync()

        for _ in range(a.rounds):
            for impl, (f, times) in steps.items():
                times.append(median_time(f, a.repeats))
            if net is not None:
                torch_times.append(median_time(torch_once, a.repeats))
        t_torch = statistics.median(torch_times) if torch_times else None
        torch_mem = None
        if net is not None and net.device.startswith("cuda"):
            torch_mem = int(torch.cuda.max_memory_allocated())
        for impl, (_, times) in steps.items():
            t = statistics.median(times)
            peak = None if peaks is None else peaks[dtype] * 1e12
            records.append({
                "dtype": dtype,
                "impl": impl,
                "compile_s": compile_s[impl],
                "step_s": t,
                "step_s_rounds": times,
                "tokens_per_s": tokens / t,
                "mfu": None if peak is None else flops / t / peak,
                "torch_step_s": t_torch,
                "torch_compile_s": torch_compile_s,
                "ratio_itde_over_torch": None if t_torch is None else t / t_torch,
                "loss": losses[impl],
                "loss_torch": loss_t,
                "memory": {**mem[impl], "torch_max_allocated_bytes": torch_mem},
            })  # fmt: skip
        for impl, why in skipped.items():
            records.append({"dtype": dtype, "impl": impl, "skipped": why})
    result = {
        "device": {"platform": dev.platform, "kind": kind, "count": jax.device_count()},
        "versions": {"python": sys.version.split()[0], "jax": jax.__version__},
        "tiny": a.tiny,
        "shape_name": "tiny" if a.tiny else a.shape,
        "shape": s,
        "block_size": block_size,
        "repeats": a.repeats,
        "rounds": a.rounds,
        "flops_per_step": flops,
        "peak_tflops": peaks,
        "records": records,
        "peak_memory": {"device_bytes": _device_peak(dev), "host_rss_bytes": _rss_peak_bytes()},
        "wall_s": time.perf_counter() - start,
    }
    if net is not None:
        result["versions"]["torch"] = net.torch.__version__
        result["torch_device"] = net.device
        result["torch_compiled"] = net.compiled
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    _print(result)
    print(f"wrote {out}")
    return result


def _memory_analysis(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None
    if m is None:
        return None
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "generated_code_size_in_bytes")  # fmt: skip
    return {k: int(getattr(m, k)) for k in keys if hasattr(m, k)}


def _print(r: dict) -> None:
    s = r["shape"]
    print(f"{r.get('shape_name', 'charlm')} {s['layers']}x{s['heads']}x{s['width']}, "
          f"context {s['context']}, batch {s['batch']} on {r['device']['kind']}; "
          f"{r['flops_per_step'] / 1e9:.2f} GFLOP/step")  # fmt: skip
    print(f"{'dtype':<10}{'impl':<9}{'compile s':>10}{'step ms':>10}{'tokens/s':>12}{'MFU':>8}"
          f"{'itde/torch':>12}{'loss - torch':>14}")  # fmt: skip
    for q in r["records"]:
        if "skipped" in q:
            print(f"{q['dtype']:<10}{q['impl']:<9}  skipped: {q['skipped']}")
            continue
        mfu = "-" if q["mfu"] is None else f"{q['mfu']:.3f}"
        ratio = "-" if q["ratio_itde_over_torch"] is None else f"{q['ratio_itde_over_torch']:.3f}"
        dl = "-" if q["loss_torch"] is None else f"{q['loss'] - q['loss_torch']:+.1e}"
        print(f"{q['dtype']:<10}{q['impl']:<9}{q['compile_s']:>10.2f}{1e3 * q['step_s']:>10.2f}"
              f"{q['tokens_per_s']:>12.0f}{mfu:>8}{ratio:>12}{dl:>14}")  # fmt: skip
    print(f"wall {r['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
