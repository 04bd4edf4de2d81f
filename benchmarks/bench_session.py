"""A session of many shapes: greedy generation for prompts of different lengths, compile
included, itde (`HFCausalLM.generate`) against transformers' `generate` with its cache.

One `GPT2LMHeadModel` with random weights (float32, `GPT2Config()`: the GPT-2 124M
shape) is the source of both. `--prompts` prompts of distinct random lengths in
[`--min`, `--max`] (seed `--seed`), `--new` tokens each, greedy, one call per prompt, in
one process: itde's session first (every compilation it needs is inside its time), then
transformers' (its first call's allocations inside its time). The time of a session is
the sum of its calls; the ratio is itde / transformers (below 1: itde is faster). It
reports the programs itde compiled (`itde.programs`) and every XLA compilation of its
session (`itde.count_compilations`, eager operations included), the growth of the
process's memory mappings, and how many greedy tokens agree.

Each configuration runs in a fresh process (a session is a process), three of them:

- `cold`: JAX's persistent compilation cache off;
- `fill`: the persistent cache on, in an empty directory (it writes what it compiles);
- `warm`: the same directory again (a second process that loads instead of compiling).

    python benchmarks/bench_session.py [--prompts 8 --min 20 --max 300 --new 32 --seed 1
                                        --out runs/bench_session]
    python benchmarks/bench_session.py --survive 150   # 150 distinct prompt lengths, one
                                                        # process: its mappings and time
    python benchmarks/bench_session.py --tiny          # a 2-layer width-32 model, seconds
    python benchmarks/bench_session.py --single        # one in-process session, no cache
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def _maps() -> int:
    """The number of memory mappings of this process (Linux), or -1 where unknown."""
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return -1


def _config(tiny: bool):
    import transformers

    if tiny:
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=400,
                                       vocab_size=97, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return transformers.GPT2Config()  # GPT-2 124M: 12 layers, width 768, 12 heads


def _lengths(args) -> list[int]:
    rng = np.random.RandomState(args.seed)
    pool = np.arange(args.min, args.max + 1)
    if args.prompts > pool.size:
        raise SystemExit(f"--prompts {args.prompts}: only {pool.size} distinct lengths in "
                         f"[{args.min}, {args.max}]")  # fmt: skip
    return [int(n) for n in rng.choice(pool, args.prompts, replace=False)]


def session(args, cache_dir: str | None) -> dict:
    """One session in this process: itde's calls, then transformers'."""
    import torch
    import transformers

    import itde

    if cache_dir is not None:
        itde.enable_compilation_cache(cache_dir)
    config = _config(args.tiny)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    t = time.perf_counter()
    lm = itde.from_hf(model)
    convert = time.perf_counter() - t
    lengths = _lengths(args)
    rng = np.random.RandomState(args.seed + 1)
    prompts = [rng.randint(0, config.vocab_size, n).astype(np.int32) for n in lengths]

    maps0, compiled0 = _maps(), itde.programs.compiled
    calls, ours = [], []
    with itde.count_compilations() as xla:
        for p in prompts:
            t = time.perf_counter()
            ours.append(lm.generate(p, args.new)[len(p):])
            calls.append(time.perf_counter() - t)
    t_itde = sum(calls)
    maps1 = _maps()

    hf_calls, theirs = [], []
    for p in prompts:
        ids = torch.as_tensor(p[None]).long()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.new, min_new_tokens=args.new,
                                 use_cache=True, pad_token_id=config.eos_token_id)  # fmt: skip
        hf_calls.append(time.perf_counter() - t)
        theirs.append(out[0, len(p):].numpy())
    t_hf = sum(hf_calls)
    return {
        "shape": "tiny" if args.tiny else "gpt2-124m",
        "lengths": lengths,
        "new": args.new,
        "persistent_cache": cache_dir is not None,
        "itde_s": t_itde,
        "itde_calls_s": calls,
        "transformers_s": t_hf,
        "transformers_calls_s": hf_calls,
        "ratio": t_itde / t_hf,
        "itde_convert_s": convert,
        "itde_programs_compiled": itde.programs.compiled - compiled0,
        "itde_compile_s": itde.programs.compile_seconds,
        "xla_compilations": xla.count,
        "xla_loaded": xla.loaded,
        "maps_growth": maps1 - maps0,
        "tokens_agreeing": int(sum(np.sum(a == b) for a, b in zip(ours, theirs))),
        "tokens": int(sum(a.size for a in ours)),
        "torch_threads": torch.get_num_threads(),
    }


def survive(args) -> dict:
    """`--survive N` distinct prompt lengths in [1, context - new] in this process, two new
    tokens each: the time, the programs compiled and the growth of the mappings."""
    import torch
    import transformers

    import itde

    config = _config(args.tiny)
    torch.manual_seed(0)
    lm = itde.from_hf(transformers.GPT2LMHeadModel(config).eval())
    rng = np.random.RandomState(args.seed)
    top = config.n_positions - 2
    lengths = [int(n) for n in rng.choice(np.arange(1, top + 1), min(args.survive, top),
                                          replace=False)]  # fmt: skip
    maps0, t0 = _maps(), time.perf_counter()
    with itde.count_compilations() as xla:
        for n in lengths:
            lm.generate(rng.randint(0, config.vocab_size, n).astype(np.int32), 2)
    return {
        "shape": "tiny" if args.tiny else "gpt2-124m",
        "prompt_lengths": len(lengths),
        "seconds": time.perf_counter() - t0,
        "itde_programs_compiled": itde.programs.compiled,
        "xla_compilations": xla.count,
        "maps_growth": _maps() - maps0,
    }


def _child(argv: list[str], role: str, cache_dir: str | None) -> dict:
    cmd = [sys.executable, __file__, *argv, "--role", role]
    if cache_dir is not None:
        cmd += ["--cache-dir", cache_dir]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(name: str, r: dict) -> str:
    return (f"  {name:5s} itde {r['itde_s']:7.2f} s  transformers {r['transformers_s']:7.2f} s  "
            f"ratio {r['ratio']:.2f}  programs {r['itde_programs_compiled']}  XLA compilations "
            f"{r['xla_compilations']} (+{r['xla_loaded']} loaded)  mappings +{r['maps_growth']}  tokens "
            f"{r['tokens_agreeing']}/{r['tokens']}")  # fmt: skip


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model, seconds")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--min", type=int, default=20, help="shortest prompt")
    ap.add_argument("--max", type=int, default=300, help="longest prompt")
    ap.add_argument("--new", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--survive", type=int, default=0, metavar="N",
                    help="N distinct prompt lengths in one process: mappings and time")
    ap.add_argument("--single", action="store_true",
                    help="one session in this process, without the persistent cache")
    ap.add_argument("--out", type=Path, default=Path("runs/bench_session"))
    ap.add_argument("--role", choices=["session", "survive"], help=argparse.SUPPRESS)
    ap.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "session":
        print(json.dumps(session(args, args.cache_dir)))
        return {}
    if args.role == "survive":
        print(json.dumps(survive(args)))
        return {}
    argv = list(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.survive:
        r = {"survive": _child(argv, "survive", None)}
        s = r["survive"]
        print(f"{s['shape']}: {s['prompt_lengths']} distinct prompt lengths in one process: "
              f"{s['seconds']:.1f} s, {s['itde_programs_compiled']} programs, "
              f"{s['xla_compilations']} XLA compilations, mappings +{s['maps_growth']}")  # fmt: skip
    elif args.single:
        r = {"single": session(args, None)}
        print(_line("one", r["single"]))
    else:
        with tempfile.TemporaryDirectory(prefix="itde-bench-cache-") as cache:
            r = {"cold": _child(argv, "session", None),
                 "fill": _child(argv, "session", cache),
                 "warm": _child(argv, "session", cache)}  # fmt: skip
        head = r["cold"]
        print(f"{head['shape']}: {len(head['lengths'])} prompts of lengths {head['lengths']} "
              f"+ {head['new']} new tokens each, greedy, one process each, compile included")
        for name in ("cold", "fill", "warm"):
            print(_line(name, r[name]))
    (args.out / "bench_session.json").write_text(json.dumps(r, indent=2))
    return r


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
