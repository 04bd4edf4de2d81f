"""Greedy generation with a key/value cache: itde (`HFCausalLM.generate`, cached) against
Hugging Face's `generate` with its own cache, on the same model.

One `GPT2LMHeadModel` with random weights (float32, `GPT2Config()`'s defaults: the GPT-2
124M shape) is the source of both. A prompt of `--prompt` random tokens, then `--new`
tokens drawn greedily; `--batch B`: B such prompts at once (itde's `generate_batch`, one
`[B, prompt]` tensor for transformers; tokens/s counts every row). itde's first call
compiles its two programs (the prefill and the decode loop, once per model and window
length); it is reported apart as the compile time
(first call minus a warm call). Then every round runs each contender once in turn
(interleaved, so each round gives a paired ratio under the same machine load); the table
gives the median over the rounds of each time, tokens/s = new tokens / time, and the
ratio itde / transformers (below 1: itde is faster). The greedy tokens of both are
compared and the agreement reported (float32 round-off may flip a near tie).

    python benchmarks/bench_generate.py [--prompt 256 --new 256 --rounds 3 --chunk 64
                                         --out runs/bench_generate]
    python benchmarks/bench_generate.py --batch 8   # 8 prompts at once
    python benchmarks/bench_generate.py --tiny      # a 2-layer width-32 model, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import itde


def _config(tiny: bool) -> transformers.GPT2Config:
    if tiny:
        return transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            vocab_size=97,
            bos_token_id=0,
            eos_token_id=0,
        )
    return transformers.GPT2Config()  # GPT-2 124M: 12 layers, width 768, 12 heads


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model and short sequences")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 256)")
    ap.add_argument("--new", type=int, default=None, help="new tokens (default 256)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64, help="tokens per compiled call (itde)")
    ap.add_argument("--batch", type=int, default=1, help="prompts at once (itde: "
                    "`generate_batch`; transformers: one [batch, prompt] tensor)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("runs/bench_generate"))
    args = ap.parse_args(argv)
    n_prompt = args.prompt or (8 if args.tiny else 256)
    n_new = args.new or (8 if args.tiny else 256)

    config = _config(args.tiny)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    lm = itde.from_hf(model)
    if args.batch < 1:
        ap.error(f"--batch {args.batch} must be at least 1")
    rng = np.random.RandomState(0)
    prompts = rng.randint(0, config.vocab_size, (args.batch, n_prompt)).astype(np.int32)
    prompt = prompts[0]
    prompt_t = torch.as_tensor(prompts).long()

    def run_itde():
        if args.batch == 1:
            return lm.generate(prompt, n_new, cache=True, chunk=args.chunk)[None, n_prompt:]
        out = lm.generate_batch(prompts, n_new, cache=True, chunk=args.chunk)
        return np.stack([row[n_prompt:] for row in out])

    def run_hf():
        with torch.no_grad():
            out = model.generate(
                prompt_t, attention_mask=torch.ones_like(prompt_t), do_sample=False,
                max_new_tokens=n_new, min_new_tokens=n_new, use_cache=True,
                pad_token_id=config.eos_token_id,
            )  # fmt: skip
        return out[:, n_prompt:].numpy()

    def timed(f):
        t = time.perf_counter()
        out = f()
        return time.perf_counter() - t, out

    first, _ = timed(run_itde)
    timed(run_hf)  # transformers' own warm-up (its first call allocates)
    t_itde, t_hf = [], []
    for _ in range(args.rounds):
        t, ours = timed(run_itde)
        t_itde.append(t)
        t, theirs = timed(run_hf)
        t_hf.append(t)
    mi, mh = statistics.median(t_itde), statistics.median(t_hf)
    agree = int(np.sum(np.asarray(ours) == np.asarray(theirs)))
    r = {
        "tiny": args.tiny,
        "shape": "tiny" if args.tiny else "gpt2-124m",
        "prompt": n_prompt,
        "new": n_new,
        "rounds": args.rounds,
        "chunk": args.chunk,
        "batch": args.batch,
        "itde_s": mi,
        "transformers_s": mh,
        "itde_tokens_per_s": args.batch * n_new / mi,
        "transformers_tokens_per_s": args.batch * n_new / mh,
        "ratio": statistics.median(a / b for a, b in zip(t_itde, t_hf)),
        "itde_first_call_s": first,
        "itde_compile_s": first - mi,
        "tokens_agreeing": agree,
        "torch_threads": torch.get_num_threads(),
    }
    print(
        f"{r['shape']}: {args.batch} x (prompt {n_prompt} + {n_new} new tokens), greedy, median of "
        f"{args.rounds} interleaved rounds\n"
        f"  itde (cache)          {mi:8.2f} s  {r['itde_tokens_per_s']:8.1f} tokens/s  "
        f"(first call {first:.2f} s: compile {r['itde_compile_s']:.2f} s)\n"
        f"  transformers (cache)  {mh:8.2f} s  {r['transformers_tokens_per_s']:8.1f} tokens/s\n"
        f"  ratio itde / transformers (time): {r['ratio']:.2f}; "
        f"greedy tokens agreeing: {agree}/{args.batch * n_new}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_generate.json").write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    main()
