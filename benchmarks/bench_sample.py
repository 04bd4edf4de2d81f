"""Characters per second of `itde sample`: the compiled, chunked generation loop
(`itde.train.sample_stream`, one dispatch per chunk of 256 characters) against the former
per-character loop (one jitted call and one host round trip per character), measured in
the same run on the same model (the charlm config's shape, random weights: speed does not
depend on the weights).

    python benchmarks/bench_sample.py [--config configs/charlm.toml --length 512 --repeats 3]

Prints compile time, characters/s of each and their ratio, and checks that both produce
the same text (greedy). Both compile once: the baseline's position is a traced int32, as
the compiled loop's is (a Python int there would be static under `eqx.filter_jit` and
recompile the baseline for every prefix length up to the context, inside its timing).
"""

from __future__ import annotations

import argparse
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from itde.train import TASKS, TrainExperiment, load, sample_stream


@eqx.filter_jit
def _next(model, window, last, key, temperature):
    logits = model(window)[last].astype(jnp.float32)
    drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits))


def per_character(model, itos, prompt, length, temperature=0.0, seed=0) -> str:
    """The baseline: the generator `itde sample` used before (one dispatch per character)."""
    stoi = {c: i for i, c in enumerate(itos)}
    ids = [stoi[c] for c in prompt]
    context = model.position.shape[0]
    key = jax.random.key(seed)
    temp = jnp.float32(temperature)
    for i in range(length):
        window = ids[-context:]
        padded = np.zeros((context,), np.int32)
        padded[: len(window)] = window
        # the position as a traced int32: a Python int is static under `eqx.filter_jit`, so
        # each new prefix length (1 .. context) would compile `_next` again inside the timing
        last = jnp.asarray(len(window) - 1, jnp.int32)
        nxt = _next(model, jnp.asarray(padded), last, jax.random.fold_in(key, i), temp)
        ids.append(int(nxt))
    return "".join(itos[i] for i in ids[len(prompt) :])


def compiled(model, itos, prompt, length, temperature=0.0, seed=0) -> str:
    return "".join(sample_stream(model, itos, prompt, length, temperature=temperature, seed=seed))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/charlm.toml")
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cfg = load(TrainExperiment, a.config)
    task = TASKS[cfg.task.name](cfg.task)
    model = task.init_model(cfg.model, jax.random.key(0), dtype=jnp.float32)
    itos, prompt = task.itos, "The "
    result = {}
    for name, fn in (("per-character", per_character), ("compiled", compiled)):
        t0 = time.perf_counter()
        fn(model, itos, prompt, 2)  # compile (and the chunk program, for `compiled`)
        compile_s = time.perf_counter() - t0
        if name == "compiled":
            fn(model, itos, prompt, a.length)  # the chunk program of this length
        times, text = [], ""
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            text = fn(model, itos, prompt, a.length)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        result[name] = (a.length / t, compile_s, text)
        print(f"{name:>14}: {a.length / t:9.1f} chars/s (median of {a.repeats}; "
              f"compile {compile_s:.2f} s)")  # fmt: skip
    same = result["compiled"][2] == result["per-character"][2]
    ratio = result["compiled"][0] / result["per-character"][0]
    print(f"compiled / per-character = {ratio:.1f}x; identical greedy text: {same}")
    print(f"({cfg.model.n_layers} layers, {cfg.model.n_features} features, context "
          f"{cfg.task.context}, {jax.devices()[0].platform})")  # fmt: skip


if __name__ == "__main__":
    main()
