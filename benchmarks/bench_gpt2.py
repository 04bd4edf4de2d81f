"""A GPT-2-shaped model: itde (converted by `itde.from_hf`) against the same model written
directly in plain JAX, and against PyTorch (Hugging Face's `GPT2Model` itself).

One Hugging Face `GPT2Model` with random weights (float32) is the source of all three:

- **itde**: `m = itde.from_hf(model)`, batched with `jax.vmap(m)` ("itde") and as one solve
  over the batch, `m.batch(ids)` ("itde_batch");
- **plain JAX**: GPT-2's forward written out with `jnp` on the same weights, its layers in
  a Python loop (unrolled by tracing) and, as a second baseline, in a `jax.lax.scan` over
  stacked layer weights (the structure of itde's depth solve);
- **torch**: the `GPT2Model` (sdpa attention, eval mode for the forward, train mode with
  dropout 0 for the step).

Two measurements, each after a warm-up (compilation, reported separately): the forward
pass (the last hidden state) and a training step (next-token cross-entropy through the
tied embedding readout, its gradient with respect to every parameter, one Adam update).
Every round runs each contender once (`--repeats` calls, the median) in turn, so each
round gives paired ratios under the same machine load; the table reports the median over
the rounds of each ratio. All outputs are checked to agree first.

    python benchmarks/bench_gpt2.py [--layers 4 --features 256 --heads 4 --tokens 128
                                     --batch 4 --rounds 7 --repeats 3 --out runs/bench_gpt2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers
from _timing import median_time

import itde


# ------------------------------------------------------------------ plain JAX GPT-2
def params_from_hf(model) -> dict:
    """The GPT2Model's weights as a dict of arrays (layers stacked on a leading axis)."""
    a = lambda t: jnp.asarray(t.detach().numpy())  # noqa: E731
    layers = [
        {
            "ln1_g": a(b.ln_1.weight), "ln1_b": a(b.ln_1.bias),
            "w_attn": a(b.attn.c_attn.weight), "b_attn": a(b.attn.c_attn.bias),
            "w_proj": a(b.attn.c_proj.weight), "b_proj": a(b.attn.c_proj.bias),
            "ln2_g": a(b.ln_2.weight), "ln2_b": a(b.ln_2.bias),
            "w_fc": a(b.mlp.c_fc.weight), "b_fc": a(b.mlp.c_fc.bias),
            "w_out": a(b.mlp.c_proj.weight), "b_out": a(b.mlp.c_proj.bias),
        }
        for b in model.h
    ]  # fmt: skip
    return {
        "wte": a(model.wte.weight),
        "wpe": a(model.wpe.weight),
        "layers": jax.tree.map(lambda *x: jnp.stack(x), *layers),
        "lnf_g": a(model.ln_f.weight),
        "lnf_b": a(model.ln_f.bias),
    }


def layer_norm(x, g, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def gpt2_layer(x, p, heads, eps):
    n, d = x.shape
    h = layer_norm(x, p["ln1_g"], p["ln1_b"], eps)
    q, k, v = jnp.split(h @ p["w_attn"] + p["b_attn"], 3, axis=-1)
    q, k, v = (t.reshape(n, heads, d // heads).transpose(1, 0, 2) for t in (q, k, v))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    o = (jax.nn.softmax(s, axis=-1) @ v).transpose(1, 0, 2).reshape(n, d)
    x = x + o @ p["w_proj"] + p["b_proj"]
    h = layer_norm(x, p["ln2_g"], p["ln2_b"], eps)
    h = jax.nn.gelu(h @ p["w_fc"] + p["b_fc"], approximate=True)
    return x + h @ p["w_out"] + p["b_out"]


def gpt2_plain(params, ids, *, heads, eps, scan):
    """GPT-2's last hidden state for one sequence, written directly in JAX."""
    x = params["wte"][ids] + params["wpe"][: ids.shape[0]]
    if scan:
        x, _ = jax.lax.scan(lambda x, p: (gpt2_layer(x, p, heads, eps), None), x, params["layers"])
    else:
        n_layers = params["layers"]["w_attn"].shape[0]
        for i in range(n_layers):
            x = gpt2_layer(x, jax.tree.map(lambda t: t[i], params["layers"]), heads, eps)
    return layer_norm(x, params["lnf_g"], params["lnf_b"], eps)


# ------------------------------------------------------------------ losses and steps
def lm_loss(hidden, wte, ids):
    """Next-token cross-entropy through the tied embedding readout."""
    logits = hidden[:, :-1] @ wte.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def jax_step(forward, wte_of, opt):
    """A jitted training step `(params, state, ids) -> (params, state, loss)`."""

    def loss(params, ids):
        return lm_loss(forward(params, ids), wte_of(params), ids)

    @eqx.filter_jit
    def step(params, state, ids):
        value, grads = eqx.filter_value_and_grad(loss)(params, ids)
        updates, state = opt.update(grads, state, params)
        return eqx.apply_updates(params, updates), state, value

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--features", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("runs/bench_gpt2"))
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=1024, n_positions=max(args.tokens, 16), n_embd=args.features,
        n_layer=args.layers, n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2Model(config).float()
    eps, heads = config.layer_norm_epsilon, config.n_head
    ids = np.random.RandomState(0).randint(0, config.vocab_size, (args.batch, args.tokens))
    ids_j, ids_t = jnp.asarray(ids), torch.as_tensor(ids)

    m = itde.from_hf(model)
    params = params_from_hf(model)
    def plain(scan):
        return lambda p, i: jax.vmap(lambda s: gpt2_plain(p, s, heads=heads, eps=eps, scan=scan))(i)

    fwd = {
        "itde": jax.jit(lambda m, i: jax.vmap(m)(i)),
        "itde_batch": jax.jit(lambda m, i: m.batch(i)),
        "jax_loop": jax.jit(plain(False)),
        "jax_scan": jax.jit(plain(True)),
    }
    first = {"itde": m, "itde_batch": m, "jax_loop": params, "jax_scan": params}

    # every contender computes the same hidden states
    model.eval()
    with torch.no_grad():
        ref = model(ids_t).last_hidden_state.numpy()
    compile_s = {}
    for name, f in fwd.items():
        t0 = time.perf_counter()
        out = np.asarray(f(first[name], ids_j))
        compile_s[f"forward/{name}"] = time.perf_counter() - t0
        err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
        assert err < 1e-4, (name, err)

    opt = optax.adam(1e-4)
    steps = {
        "itde": jax_step(lambda m, i: jax.vmap(m)(i), lambda m: m.word_embeddings, opt),
        "itde_batch": jax_step(lambda m, i: m.batch(i), lambda m: m.word_embeddings, opt),
        "jax_loop": jax_step(plain(False), lambda p: p["wte"], opt),
        "jax_scan": jax_step(plain(True), lambda p: p["wte"], opt),
    }
    state = {k: (first[k], opt.init(eqx.filter(first[k], eqx.is_inexact_array))) for k in steps}
    losses = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        p, s, loss = step(*state[name], ids_j)
        jax.block_until_ready(loss)
        compile_s[f"step/{name}"] = time.perf_counter() - t0
        losses[name] = float(loss)
    torch_opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def torch_step():
        torch_opt.zero_grad()
        loss = lm_loss_torch(model(ids_t).last_hidden_state, model.wte.weight, ids_t)
        loss.backward()
        torch_opt.step()
        return float(loss.detach())

    def torch_forward():
        with torch.no_grad():
            model(ids_t).last_hidden_state.numpy()

    model.train()
    losses["torch"] = torch_step()
    spread = max(losses.values()) - min(losses.values())
    assert spread < 1e-4 * max(abs(v) for v in losses.values()), losses

    runs = {
        "forward": {
            **{k: (lambda f=f, k=k: jax.block_until_ready(f(first[k], ids_j)))
               for k, f in fwd.items()},
            "torch": torch_forward,
        },
        "step": {
            **{k: (lambda s=s, k=k: jax.block_until_ready(s(*state[k], ids_j)))
               for k, s in steps.items()},
            "torch": torch_step,
        },
    }  # fmt: skip
    times = {phase: {k: [] for k in fns} for phase, fns in runs.items()}
    for _ in range(args.rounds):
        for phase, fns in runs.items():
            model.train(phase == "step")
            for name, fn in fns.items():
                times[phase][name].append(median_time(fn, args.repeats))
    ratios = {}
    for phase, t in times.items():
        for mine in ("itde", "itde_batch"):
            for other in ("jax_loop", "jax_scan", "torch"):
                ratios[f"{phase}: {mine} / {other}"] = statistics.median(
                    a / b for a, b in zip(t[mine], t[other])
                )
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "median_seconds": {
            p: {k: statistics.median(v) for k, v in t.items()} for p, t in times.items()
        },
        "ratios": ratios,
        "compile_seconds": compile_s,
        "first_step_losses": losses,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print("| ratio (median of paired rounds) | value |\n|---|---|")
    for k, v in ratios.items():
        print(f"| {k} | {v:.3f} |")
    print("median seconds:", json.dumps(result["median_seconds"], indent=1))
    print("compile seconds:", {k: round(v, 1) for k, v in compile_s.items()})


def lm_loss_torch(hidden, wte, ids):
    logits = hidden[:, :-1] @ wte.T
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )


if __name__ == "__main__":
    main()
