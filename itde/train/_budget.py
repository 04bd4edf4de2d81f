"""What a run will hold in memory, estimated from its config before any work starts, so a
config that cannot fit is refused with the key to change instead of being killed by the
kernel (or failing deep inside XLA) minutes later.

The estimates are deliberately coarse (within a small factor): they count the arrays that
dominate — the held-out set, materialised whole, and a training step's activations kept
for the backward pass (every depth step's state) plus its attention scores — in float32.
"""

from __future__ import annotations

import os

from .._config import ConfigError

_FLOAT = 4  # bytes: the state, scores and data are float32 (or int32 ids)


def available_bytes() -> int | None:
    """The memory a run may use: the accelerator's limit where JAX reports one, else the
    machine's physical memory (None when neither is known)."""
    try:
        import jax

        stats = jax.devices()[0].memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    except Exception:  # noqa: BLE001 - a backend without memory stats: fall back
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def step_bytes(cfg, tokens: int, train: bool = True) -> int:
    """A training step: the states of every depth step (kept for the backward pass) with
    their attention and feed-forward intermediates, and one step's attention scores, for
    one micro-batch (`batch_size / accumulate` examples); an evaluation step
    (`train=False`) keeps two states of a whole batch."""
    m, b = _dims(cfg.model), cfg.optim.batch_size
    if train:
        b //= cfg.optim.accumulate
    depth_steps = max(1, round(m["n_layers"] / cfg.model.dt)) if train else 2
    states = b * tokens * (4 * m["n_features"] + 2 * m["n_hidden"]) * depth_steps
    scores = 3 * b * m["n_heads"] * tokens * tokens
    return _FLOAT * (states + scores)


def _dims(m) -> dict[str, int]:
    """The sizes of the `[model]` table `m`, or of its `init` model (its config.json)."""
    init = m.hf_init
    if init is not None:
        return init.dims()
    return {k: getattr(m, k) for k in ("n_layers", "n_features", "n_heads", "n_hidden")}


def eval_set_bytes(size: int, batch_size: int, tokens: int) -> int:
    """The held-out set, materialised whole (inputs and targets), in whole batches."""
    rounded = -(-size // batch_size) * batch_size
    return _FLOAT * 2 * rounded * tokens


def check_fits(
    cfg,
    tokens: int,
    *,
    eval_size: int | None = None,
    tokens_name: str,
    size_name: str = "task.eval_size",
    train: bool = True,
    limit: int | None = None,
) -> None:
    """Refuse a run whose training (or, `train=False`, evaluation) step or held-out set
    cannot fit in memory, naming the config key (or CLI flag) to change, the estimate and
    the limit (default: `available_bytes()`)."""
    limit = available_bytes() if limit is None else limit
    if limit is None:
        return
    budget = 0.8 * limit
    k = cfg.optim.accumulate
    need = step_bytes(cfg, tokens, train)
    if need > budget:
        d = _dims(cfg.model)
        raise ConfigError(
            f"one {'training' if train else 'evaluation'} step needs about {_gib(need)} "
            f"(`optim.batch_size`={cfg.optim.batch_size}"
            + (f" in `optim.accumulate`={k} micro-batches" if train and k > 1 else "")
            + f", `{tokens_name}`={tokens} tokens, `model.n_features`="
            f"{d['n_features']}, {max(1, round(d['n_layers'] / cfg.model.dt))} "
            f"depth steps), more than the {_gib(limit)} this machine has; lower "
            f"optim.batch_size or {tokens_name}"
            + (", or raise optim.accumulate (micro-batches a step)" if train else "")
        )
    size = cfg.task.eval_size if eval_size is None else eval_size
    need = eval_set_bytes(size, cfg.optim.batch_size, tokens)
    if need > budget:
        raise ConfigError(
            f"`{size_name}`={size} held-out examples of {tokens} tokens are materialised "
            f"whole: about {_gib(need)}, more than the {_gib(limit)} this machine has; "
            f"lower {size_name}"
        )
