"""The one validator of key masks (padding), for every entry point that takes one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def key_mask(mask, n_tokens: int, name: str = "mask"):
    """A key mask as booleans `[n_tokens]` (or `[batch, n_tokens]`): True on real tokens.

    Accepts booleans and integer 0/1 masks (Hugging Face's `attention_mask`); names the
    argument, the shape and the dtype it got otherwise."""
    if mask is None:
        return None
    if type(mask).__module__.startswith("torch"):
        raise TypeError(
            f"`{name}` is a torch tensor; convert it first: "
            f"`jnp.asarray({name}.detach().cpu().numpy())`."
        )
    if not hasattr(mask, "shape"):
        mask = np.asarray(mask)  # a list of 0/1 or booleans
    if mask.shape[-1:] != (n_tokens,):
        raise ValueError(
            f"`{name}` must have one entry per token, shape [..., {n_tokens}] for a sequence of "
            f"{n_tokens} tokens, got shape {mask.shape}."
        )
    if mask.dtype == jnp.bool_:
        return _on_device(mask)
    if not jnp.issubdtype(mask.dtype, jnp.integer):
        raise TypeError(
            f"`{name}` must be boolean (True on real tokens, False on padding) or integer "
            f"0/1, got dtype {mask.dtype}."
        )
    if not isinstance(mask, jax.core.Tracer):
        # checked on the host: inside `jax.jit` a concrete mask's jnp comparison would be
        # staged (a tracer), which `bool` cannot read
        host = np.asarray(mask)  # an integer array (checked above): == is exact
        if not bool(np.all((host == 0) | (host == 1))):
            raise ValueError(
                f"`{name}` must hold only 0 and 1 (1 on real tokens), got other values."
            )
        return _on_device(host != 0)
    return mask != 0


def _on_device(mask):
    """A concrete mask as a JAX array, moved from the host by `jax.device_put` (a
    conversion with `jnp` compiles a small program per shape); a JAX array or a tracer as
    it is."""
    if isinstance(mask, jax.Array | jax.core.Tracer):
        return mask
    return jax.device_put(np.asarray(mask))
