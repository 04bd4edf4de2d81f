"""What every function of `itde.analysis` checks first: the model (an equation, or a model
that holds one), one state and its padding mask, feature weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .._checks import as_array
from .._equation import TransformerIDE
from .._operators._mask import key_mask


def equation_of(model) -> TransformerIDE:
    """The `TransformerIDE` of a model: the model itself, its `equation` (a converted
    `HFTransformer`, a trained `TokenModel` or `FieldModel`), or its base model's (an
    `HFCausalLM`: `.base.equation`)."""
    for seen in (model, getattr(model, "base", None)):
        if isinstance(seen, TransformerIDE):
            return seen
        equation = getattr(seen, "equation", None)
        if isinstance(equation, TransformerIDE):
            return equation
    raise TypeError(
        f"`model` must be an itde.TransformerIDE or a model that holds one (an "
        f"itde.HFTransformer from itde.from_hf, an HFCausalLM, a trained model); got "
        f"{type(model).__name__}."
    )


def _state(u, name: str = "u"):
    u = as_array(name, u)
    if getattr(u, "ndim", None) != 2:
        raise ValueError(
            f"`{name}` must be one state [tokens, features], got shape "
            f"{getattr(u, 'shape', None)}; map over a trajectory or a batch with jax.vmap."
        )
    u = jnp.asarray(u)
    if not jnp.issubdtype(u.dtype, jnp.floating):
        u = u.astype(jnp.result_type(float))
    return u


def _mask(mask, n: int):
    """Booleans `[tokens]`, True on real tokens (all True for None)."""
    m = key_mask(mask, n)
    if m is None:
        return jnp.asarray(np.ones((n,), bool))
    if m.ndim != 1:
        raise ValueError(f"`mask` must be [tokens] for one state, got shape {m.shape}.")
    return m


def _check_weights(feature_weights, d: int):
    if feature_weights is None:
        return None
    w = np.asarray(feature_weights, dtype=np.float64)
    if w.shape != (d,) or not np.all(w > 0):
        raise ValueError(
            f"`feature_weights` must be {d} positive quadrature weights, got shape {w.shape}."
        )
    return w


def _one_at_a_time(f, *xs):
    """`f` mapped over the leading axes of `xs` (each `[..., m, n]`) one matrix at a time
    (`jax.lax.map`), never as one batched LAPACK call: jaxlib's batched CPU kernels
    (`ParallelBatchMap` in its QR, SVD and eigenvalue kernels) split a batch over XLA's
    thread pool and, two of them side by side on a two-thread CPU, wait on each other
    forever (observed at SmolLM2's size: 30 layers of 9 heads)."""
    lead = xs[0].shape[:-2]
    if not lead:
        return f(*xs)
    flat = tuple(x.reshape(-1, *x.shape[-2:]) for x in xs)
    out = jax.lax.map(lambda x: f(*x), flat)
    return jax.tree.map(lambda o: o.reshape(*lead, *o.shape[1:]), out)
