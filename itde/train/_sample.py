"""Autoregressive sampling from a trained causal character model (task `charlm`)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np


@eqx.filter_jit
def _next(model, window, last, key, temperature):
    """The next token after position `last` of `window` (right-padded to the context).

    The model is causal (Volterra attention), so the padding after `last` does not reach
    position `last`: one compiled program serves every prefix length."""
    logits = model(window)[last].astype(jnp.float32)
    greedy = jnp.argmax(logits)
    drawn = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
    return jnp.where(temperature > 0, drawn, greedy)


def sample(model, itos, prompt: str, length: int, *, temperature: float = 1.0, seed: int = 0):
    """`prompt` followed by `length` characters drawn from the model.

    **Arguments:**

    - `model`: a causal [`TokenModel`][itde._train_model.TokenModel].
    - `itos`: the vocabulary (token id -> character).
    - `prompt`: the text to continue; characters outside the vocabulary raise
      `ValueError`. Empty: start from a newline (or the first character of the vocabulary).
    - `length`: number of characters to generate, >= 0.
    - `temperature`: softmax temperature; 0 = greedy.
    - `seed`: the sampling seed.
    """
    if not model.ide.causal:
        raise ValueError("sampling needs a causal model (trained on task 'charlm').")
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"`--length` must be a non-negative integer, got {length!r}.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"`--temperature` must be >= 0, got {temperature!r}.")
    stoi = {c: i for i, c in enumerate(itos)}
    missing = sorted(set(prompt) - stoi.keys())
    if missing:
        raise ValueError(
            f"the prompt has characters outside the model's vocabulary: {''.join(missing)!r}"
        )
    start = prompt or ("\n" if "\n" in stoi else itos[0])
    ids = [stoi[c] for c in start]
    context = model.position.shape[0]
    key = jax.random.key(seed)
    temp = jnp.asarray(temperature, jnp.float32)
    for i in range(length):
        window = ids[-context:]
        last = len(window) - 1
        padded = np.zeros((context,), np.int32)
        padded[: len(window)] = window
        nxt = _next(model, jnp.asarray(padded), jnp.asarray(last), jax.random.fold_in(key, i), temp)
        ids.append(int(nxt))
    text = "".join(itos[i] for i in ids)
    return text if prompt else text[len(start) :]
