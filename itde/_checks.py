"""Argument checks for library constructors: each error names the argument, its value
and the fix. Configs have their own (`ConfigError`, naming the key and the file)."""

from __future__ import annotations

import math
import numbers
import os
import sys
import warnings


def check_bool(name: str, value) -> bool:
    """`value` must be a Python or NumPy bool (not a string such as "false")."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    raise TypeError(
        f"`{name}`={value!r} must be True or False (a bool, not {type(value).__name__})."
    )


def check_variant(name: str, value, base: type, registry: dict, what: str):
    """A variant module from an instance of `base`, or from a name of `registry` (the edge
    where a config's or the CLI's string becomes a module): `registry[value]()`. `what`
    says what was expected, with examples, in the error that names `name`."""
    if isinstance(value, base):
        return value
    if isinstance(value, str) and value in registry:
        return registry[value]()
    raise TypeError(f"`{name}`={value!r} must be {what} or one of the names {list(registry)}.")


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """`value` must be an integer (not a bool or a float), at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}`={value!r} must be an integer.")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}`={value!r} must be an integer >= {minimum}.")
    return int(value)


def check_float(
    name: str, value, *, positive: bool = False, nonnegative: bool = False
) -> float:
    """`value` must be a finite real number (positive or non-negative if asked)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}`={value!r} must be a number, not {type(value).__name__}.")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"`{name}`={value!r} must be finite.")
    if positive and not v > 0:
        raise ValueError(f"`{name}`={value!r} must be > 0.")
    if nonnegative and not v >= 0:
        raise ValueError(f"`{name}`={value!r} must be >= 0.")
    return v


def check_dtype(name: str, dtype):
    """`dtype` must be a floating-point dtype (None: JAX's default float)."""
    import jax.numpy as jnp

    if dtype is None:
        return jnp.zeros(()).dtype
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"`{name}`={dtype!r} is not a dtype; use e.g. jnp.float32 or jnp.bfloat16."
        ) from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(
            f"`{name}`={dt} must be a floating-point dtype (float64, float32, float16 or "
            "bfloat16): the parameters are real numbers."
        )
    return dt


def check_key(name: str, key) -> None:
    """`key` must be a JAX PRNG key (`jax.random.key(seed)` or `jax.random.PRNGKey(seed)`)."""
    import jax
    import jax.numpy as jnp

    ok = hasattr(key, "dtype") and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        or (key.dtype == jnp.uint32 and key.shape[-1:] == (2,))
    )
    if not ok:
        raise TypeError(
            f"`{name}`={key!r} is not a PRNG key; pass `jax.random.key(seed)` (or "
            "`jax.random.PRNGKey(seed)`)."
        )


def as_array(name: str, value):
    """`value` as an array: a nested Python list or tuple of numbers becomes
    `jnp.asarray(value)`; anything with a shape (a JAX or NumPy array, a tracer) and a
    torch tensor (which the state checks refuse by name) pass unchanged."""
    if not isinstance(value, list | tuple):
        return value
    import jax.numpy as jnp

    try:
        return jnp.asarray(value)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"`{name}` is a nested {type(value).__name__} that is not a rectangular array "
            f"of numbers ({e}); give `jnp.asarray({name})` of shape [tokens, features] "
            "(every token the same number of features)."
        ) from None


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path)) + os.sep


def _library_folders() -> tuple[str, ...]:
    """The library code between a user's call and a warning: itde itself and the packages
    that call back into it (equinox's method wrappers, jax's tracing, diffrax's solve)."""
    import diffrax
    import equinox as eqx
    import jax

    import itde_solvers

    return (_folder(__file__), *(_folder(m.__file__) for m in (itde_solvers, eqx, jax, diffrax)))


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """A warning located at the user's call: the first frame outside the library folders
    (itde, itde_solvers, equinox, jax, diffrax)."""
    folders = _library_folders()
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=folders)
        return
    # Python 3.11 lacks `skip_file_prefixes`: apply the same rule to find the stacklevel
    # (remove this branch once the floor is 3.12).
    frame, level = sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(folders):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def warn_if_vmapped_over_tokens(u0, batch_axis: int) -> None:
    """A model converted from PyTorch's `batch_first=False` takes `[tokens, batch, features]`;
    `jax.vmap(m)(x)` maps axis 0 of such an `x`, the tokens, and silently solves every token
    position as a sequence of the batch. Warn when the state arrives mapped over axis 0 of
    the caller's array (seen only where `jax.vmap` wraps the call directly)."""
    if batch_axis != 1:
        return
    try:
        from jax._src.interpreters.batching import BatchTracer
    except ImportError:  # pragma: no cover - a JAX without this private class: no check
        return
    if isinstance(u0, BatchTracer) and getattr(u0, "batch_dim", None) == 0:
        warn_at_caller(
            "this model was converted from a PyTorch module with batch_first=False, which "
            "takes [tokens, batch, features], and jax.vmap mapped axis 0 of its input: if "
            "that input is [tokens, batch, features], every token position is being solved "
            "as a sequence. Use m.batch(x), or jax.vmap(m, in_axes=1, out_axes=1); if the "
            "input is [batch, tokens, features], this warning does not apply."
        )
