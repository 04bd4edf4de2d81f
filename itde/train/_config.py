"""Typed configuration of `itde train`: the `[task]`, `[model]`, `[optim]` and `[run]` tables.

Built on `itde._config` (frozen dataclasses, `load` / `from_dict`, `ConfigError` naming the
key and the file). Every task-specific key of `[task]` defaults to `None` and is filled
with the task's default; a key that belongs to another task is an error rather than being
silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

from .._config import ConfigError, from_dict, load, positive

__all__ = [
    "TASKS",
    "ConfigError",
    "ModelTable",
    "OptimTable",
    "RunTable",
    "TaskTable",
    "TrainExperiment",
    "from_dict",
    "load",
    "to_dict",
]

TASKS = ("sort", "burgers", "charlm")

# The options of each task and their defaults (None in the dataclass = "use the default").
TASK_OPTIONS: dict[str, dict[str, Any]] = {
    "sort": {"length": 8, "vocab": 10},
    "burgers": {
        "n_grid": 64,
        "nu": 0.05,
        "t_final": 1.0,
        "n_modes": 4,
        "decay": 1.0,
        "amplitude": 1.0,
        "oversample": 4,
    },
    "charlm": {"text_path": "", "context": 64, "val_fraction": 0.1},
}


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)  # fill a default in a frozen dataclass


@dataclasses.dataclass(frozen=True)
class TaskTable:
    """What is learnt (the `[task]` table).

    - `name`: `"sort"` (sort `length` digits from `{0..vocab-1}`), `"burgers"` (the
      solution operator $u_0 \\mapsto u(t_f)$ of periodic viscous Burgers on `n_grid`
      points; `nu`, `t_final`, `n_modes`, `decay`, `amplitude`, `oversample` as in
      `itde.data.BurgersTask`) or `"charlm"` (next-character prediction on `text_path`,
      empty = the built-in tiny text, windows of `context` characters, the last
      `val_fraction` held out).
    - `eval_size`: held-out examples per evaluation (rounded up to whole batches).
    """

    name: str = "sort"
    eval_size: int = 2048
    # sort
    length: int | None = None
    vocab: int | None = None
    # burgers
    n_grid: int | None = None
    nu: float | None = None
    t_final: float | None = None
    n_modes: int | None = None
    decay: float | None = None
    amplitude: float | None = None
    oversample: int | None = None
    # charlm
    text_path: str | None = None
    context: int | None = None
    val_fraction: float | None = None

    def __post_init__(self):
        if self.name not in TASKS:
            raise ConfigError(
                f"`task.name`={self.name!r} is not a task; choose one of {list(TASKS)}"
            )
        positive("task.eval_size", self.eval_size)
        mine = TASK_OPTIONS[self.name]
        for other, options in TASK_OPTIONS.items():
            for key in options:
                if key not in mine and getattr(self, key) is not None:
                    raise ConfigError(
                        f"`task.{key}` is an option of task {other!r}, not of task "
                        f"{self.name!r}; remove it (options of {self.name!r}: {sorted(mine)})"
                    )
        for key, default in mine.items():
            if getattr(self, key) is None:
                _set(self, key, default)
        if self.name == "sort":
            for key in ("length", "vocab"):
                if getattr(self, key) < 2:
                    raise ConfigError(f"`task.{key}` must be >= 2, got {getattr(self, key)}")
        elif self.name == "burgers":
            if self.n_grid < 8 or self.n_grid % 2:
                raise ConfigError(f"`task.n_grid` must be an even integer >= 8, got {self.n_grid}")
            for key in ("nu", "t_final", "n_modes", "amplitude", "oversample"):
                positive(f"task.{key}", getattr(self, key))
            if 3 * self.n_modes >= self.n_grid:
                raise ConfigError(
                    f"`task.n_modes`={self.n_modes} must satisfy 3 * n_modes < n_grid={self.n_grid}"
                )
        else:
            positive("task.context", self.context)
            if not (math.isfinite(self.val_fraction) and 0 < self.val_fraction < 1):
                raise ConfigError(
                    f"`task.val_fraction` must be in (0, 1), got {self.val_fraction!r}"
                )

    def options(self) -> dict[str, Any]:
        """The resolved options of the chosen task."""
        return {k: getattr(self, k) for k in TASK_OPTIONS[self.name]}


@dataclasses.dataclass(frozen=True)
class ModelTable:
    """The model (the `[model]` table): embedding, the Transformer IDE, a linear readout.

    - `layers`: the number of layers, i.e. the depth $T$ (with a continuous scheme, the
      depth interval $[0, T]$ is integrated with step `dt`).
    - `width`, `heads`, `hidden`: model width $d$, attention heads, feed-forward width.
    - `activation`, `ffn_form`: as in `itde.TransformerIDE.init`.
    - `scheme`: `"lie"` — the Transformer regime: per-layer (piecewise-constant) controls
      and the paper's Lie splitting, one layer per step of `dt` (1 = one post-LN block per
      layer) — or a continuous-depth scheme of `itde._registry.SCHEMES` (`"rk4"`,
      `"strang"`, `"heun"`, ...) with controls smooth in depth (`LegendreControls`,
      `n_modes` Legendre modes per parameter).
    - `eps`: the LayerNorm $\\varepsilon$ (default 1e-5 for `"lie"`; a continuous scheme
      needs the exact projection, `eps = 0`, its default).
    """

    layers: int = 2
    width: int = 32
    heads: int = 4
    hidden: int = 64
    activation: typing.Literal["relu", "gelu", "gelu_tanh"] = "relu"
    ffn_form: typing.Literal["residual", "relaxation"] = "residual"
    scheme: str = "lie"
    dt: float = 1.0
    n_modes: int | None = None
    eps: float | None = None

    def __post_init__(self):
        from .._registry import SCHEMES

        for name in ("layers", "width", "heads", "hidden", "dt"):
            positive(f"model.{name}", getattr(self, name))
        if self.width % self.heads:
            raise ConfigError(
                f"`model.heads`={self.heads} does not divide `model.width`={self.width}"
            )
        if self.scheme != "lie" and self.scheme not in SCHEMES:
            raise ConfigError(
                f"`model.scheme`={self.scheme!r} is not a depth scheme; choose 'lie' (the "
                f"Transformer regime) or a continuous scheme from {sorted(set(SCHEMES) - {'lie'})}"
            )
        if self.continuous:
            if self.n_modes is None:
                _set(self, "n_modes", 2)
            positive("model.n_modes", self.n_modes)
            if self.eps is None:
                _set(self, "eps", 0.0)
            if self.eps != 0.0:
                raise ConfigError(
                    f"`model.eps`={self.eps} must be 0 with the continuous scheme "
                    f"{self.scheme!r} (it integrates on the exact constraint set S1)"
                )
        else:
            if self.n_modes is not None:
                raise ConfigError(
                    "`model.n_modes` applies to continuous-depth schemes only; the 'lie' "
                    "scheme has one set of controls per layer"
                )
            if self.eps is None:
                _set(self, "eps", 1e-5)
            if not (math.isfinite(self.eps) and self.eps >= 0):
                raise ConfigError(f"`model.eps` must be >= 0, got {self.eps!r}")

    @property
    def continuous(self) -> bool:
        return self.scheme != "lie"


@dataclasses.dataclass(frozen=True)
class OptimTable:
    """The optimiser (the `[optim]` table): `clip_by_global_norm(clip_norm)` then AdamW
    with a linear warm-up over `warmup` steps to `lr` and a cosine decay to
    `lr * final_lr_ratio` at `steps`; `batch_size` examples a step; `seed` sets the
    initialisation and the data stream."""

    lr: float = 3e-3
    warmup: int = 100
    final_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.99
    clip_norm: float = 1.0
    batch_size: int = 64
    steps: int = 1500
    seed: int = 0

    def __post_init__(self):
        for name in ("lr", "clip_norm", "batch_size", "steps"):
            positive(f"optim.{name}", getattr(self, name))
        if not 0 <= self.warmup < self.steps:
            raise ConfigError(
                f"`optim.warmup`={self.warmup} must be >= 0 and less than `optim.steps`="
                f"{self.steps}"
            )
        for name in ("final_lr_ratio", "weight_decay"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"`optim.{name}` must be >= 0, got {v!r}")
        for name in ("b1", "b2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ConfigError(f"`optim.{name}` must be in [0, 1), got {v!r}")


@dataclasses.dataclass(frozen=True)
class RunTable:
    """Bookkeeping (the `[run]` table): log, evaluate and checkpoint every so many steps
    (and always at the last step), the compute dtype (`"bfloat16"` casts parameters and
    activations for the forward and backward passes and keeps float32 master parameters
    and optimiser state), the output directory (empty: `runs/<task name>`) and the
    progress bar. The defaults of every table are `configs/sort.toml`'s."""

    log_every: int = 50
    eval_every: int = 250
    checkpoint_every: int = 500
    dtype: typing.Literal["float32", "bfloat16"] = "float32"
    out: str = ""
    progress: bool = True

    def __post_init__(self):
        for name in ("log_every", "eval_every", "checkpoint_every"):
            positive(f"run.{name}", getattr(self, name))


@dataclasses.dataclass(frozen=True)
class TrainExperiment:
    """The config of `itde train`."""

    task: TaskTable = dataclasses.field(default_factory=TaskTable)
    model: ModelTable = dataclasses.field(default_factory=ModelTable)
    optim: OptimTable = dataclasses.field(default_factory=OptimTable)
    run: RunTable = dataclasses.field(default_factory=RunTable)


# Keys that may differ between a checkpoint and a resumed run: they do not change the
# numbers the run computes, only when it reports them and where.
RESUMABLE_KEYS = frozenset(
    {"run.log_every", "run.eval_every", "run.checkpoint_every", "run.out", "run.progress"}
)


def to_dict(cfg) -> dict:
    """A JSON/TOML-ready nested dict of a config (tuples become lists)."""

    def plain(v):
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested dicts."""
    out = []
    for key in sorted(set(a) | set(b)):
        name = f"{prefix}.{key}" if prefix else key
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += differences(va, vb, name)
        elif va != vb:
            out.append(name)
    return out
