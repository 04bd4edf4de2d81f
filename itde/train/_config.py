"""Typed configuration of `itde train`: the `[task]`, `[model]`, `[optim]` and `[run]` tables.

Built on the generic TOML loader of `itde` (frozen dataclasses; an unknown key, a wrong
type or an impossible value is a `ConfigError` naming the key and the file). Names are
checked against the registries: `task.name` against [`TASKS`][itde.train.TASKS],
`model.activation`, `model.ffn_form` and `model.scheme` against `itde`'s registries of
activations, feed-forward forms and depth schemes. The `[model]` keys are those of
`itde solve`'s `[model]` table (`n_layers`, `n_features`, `n_heads`, `n_hidden`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _config
from .._blocks import BLOCK_FORMS
from .._config import ConfigError, choices, positive, seed
from .._registry import ACTIVATIONS, FFN_FORMS, SCHEMES
from .._solve import check_depth_step
from ._init import HF_PREFIX, HFInit, hf_directory

__all__ = [
    "ARCHITECTURE",
    "COMPUTE_DTYPES",
    "ConfigError",
    "ContinuityConfig",
    "ModelConfig",
    "MultilevelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "TaskConfig",
    "TrainExperiment",
    "from_dict",
    "load_config",
    "to_dict",
]

#: The compute dtypes of `[run] dtype`: the name and the dtype the forward and backward
#: passes run in (None = the parameters' own, float32).
COMPUTE_DTYPES: dict[str, Any] = {"float32": None, "bfloat16": "bfloat16"}
"""The compute dtypes of `[run] dtype`: the name and the dtype the forward and backward passes
run in (None = the parameters' own, float32)."""
CHECKPOINT_FORMATS = ("auto", "file", "shards")  # the writers: itde.train._formats.FORMATS

#: Keys of earlier versions of the `[model]` table and the key that replaced each.
RENAMED: dict[str, str] = {
    "model.layers": "model.n_layers",
    "model.width": "model.n_features",
    "model.heads": "model.n_heads",
    "model.hidden": "model.n_hidden",
}


def _set(obj, name: str, value) -> None:
    object.__setattr__(obj, name, value)  # fill a default in a frozen dataclass


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What is learnt (the `[task]` table).

    - `name`: a key of [`TASKS`][itde.train.TASKS]: `"sort"` (sort `length` digits from
      `{0..vocab-1}`, `vocab` the number of distinct digits), `"burgers"` (the solution
      operator $u_0 \\mapsto u(t_f)$ of periodic viscous Burgers on `n_grid` points;
      `nu`, `t_final`, `n_modes`, `decay`, `amplitude`, `oversample` as in
      `itde.data.BurgersTask`) or `"charlm"`
      (next-character prediction on `text_path`, empty = the built-in tiny text; a
      relative path in a config file is read from the file's folder; windows
      of `context` characters, the last `val_fraction` held out) or `"textlm"` (the same
      on a file or folder of any size, `text_glob`, `tokenizer` = `"char"`, `"bpe"` or
      `"hf:DIR"` (a Hugging Face directory's `tokenizer.json`, with `[model] init`),
      `vocab_size`, `cache_dir`: see [`TextLM`][itde.train.TextLM]).
    - `eval_size`: held-out examples per evaluation (rounded up to whole batches).

    Every task-specific key defaults to `None` and is filled with the task's default
    (`TASKS[name].options`); a key of another task is an error, not silently ignored.
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
    # charlm, textlm
    text_path: str | None = None
    context: int | None = None
    val_fraction: float | None = None
    # textlm
    text_glob: str | None = None
    tokenizer: str | None = None
    vocab_size: int | None = None
    cache_dir: str | None = None

    def __post_init__(self):
        from ._tasks import TASKS

        choices("task.name", self.name, TASKS)
        positive("task.eval_size", self.eval_size)
        task = TASKS[self.name]
        mine = task.options
        for other, cls in TASKS.items():
            for key in cls.options:
                if key not in mine and getattr(self, key) is not None:
                    raise ConfigError(
                        f"`task.{key}` is an option of task {other!r}, not of task "
                        f"{self.name!r}; remove it (options of {self.name!r}: {sorted(mine)})"
                    )
        for key, default in mine.items():
            if getattr(self, key) is None:
                _set(self, key, default)
        task.check_options(self)

    def options(self) -> dict[str, Any]:
        """The resolved options of the chosen task."""
        from ._tasks import TASKS

        return {k: getattr(self, k) for k in TASKS[self.name].options}


#: The `[model]` keys that describe the network's architecture, with their defaults for a
#: model trained from scratch; with `init` they come from the initial model instead.
ARCHITECTURE: dict[str, Any] = {
    "n_layers": 2,
    "n_features": 32,
    "n_heads": 4,
    "n_hidden": 64,
    "activation": "relu",
    "ffn_form": "residual",
    "block": "post_norm",
    "final_norm": False,
    "tie_embeddings": False,
}
"""The `[model]` keys that describe the network's architecture, with their defaults for a
model trained from scratch; with `init` they come from the initial model instead."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model (the `[model]` table): embedding, the Transformer IDE, a linear readout.

    - `n_layers`: the number of layers, i.e. the depth $T$ (with a continuous scheme the
      depth interval $[0, T]$ is integrated with step `dt`).
    - `n_features`, `n_heads`, `n_hidden`: model width $d$, attention heads, feed-forward
      width (the keys of `itde solve`'s `[model]` table).
    - `activation`, `ffn_form`: as in `itde.TransformerIDE.init` (`"relu"`, `"gelu"`,
      `"gelu_tanh"`; `"residual"`, `"relaxation"`).
    - `scheme`: `"lie"` — the Transformer regime: per-layer (piecewise-constant) controls
      and the paper's Lie splitting, one layer per step of `dt` (1 = one post-LN block per
      layer) — or another depth scheme of `itde converge` (`"rk4"`, `"strang"`,
      `"heun"`, ...) with controls smooth in depth (`itde.LegendreControls`, `n_modes`
      Legendre modes per parameter).
    - `dt`: the depth step; at most one layer (`"lie"`) or the depth $T$ (continuous).
    - `n_modes`: the Legendre modes of a continuous model (default 2; with `init`, the
      number of layers, which interpolates the initial network's layers).
    - `eps`: the LayerNorm $\\varepsilon$ (default 1e-5 for `"lie"`; a continuous scheme
      needs the exact projection, `eps = 0`, its default).
    - `block`: the block form, a name of `itde.BLOCK_FORMS`: `"post_norm"` (the paper's
      scheme, the default), `"pre_norm"` (GPT-2 / nanoGPT) or `"parallel"`. With a
      continuous scheme the equation of that form: the post-norm equation on its
      constraint set, or the unconstrained ODE $u' = A(N_1 u) + F(N_2 u)$ of pre-norm
      blocks (their norms act inside the operators).
    - `final_norm`: a final LayerNorm after the last layer (or at depth $T$), before the
      readout (GPT-2's `ln_f`; with `block = "pre_norm"` the usual choice); its
      $\\varepsilon$ is `eps` for `"lie"` and $10^{-5}$ for a continuous model (it maps the
      output, it is not a constraint of the equation).
    - `tie_embeddings`: the head is the token embedding, logits $= h E^\\top$ with no bias
      (nanoGPT's and GPT-2's `lm_head`; default false: a separate readout $W$ and bias
      $b$). One parameter with two uses: its gradient is the sum of both, it takes weight
      decay and is sharded as the embedding always was; the model has
      `vocab * (width + 1)` fewer parameters. Token tasks only (not `burgers`).
    - `init`: `"hf:DIR"`, start from the Hugging Face causal language model saved in the
      local directory `DIR` (`config.json` and its weights, e.g. by `save_pretrained`;
      relative to the config file's folder), converted by `itde.from_hf` (default `""`:
      a random initialisation). A key of the config, not a command-line flag, so that the
      run's sidecar records it and `--resume` rebuilds the same model. The architecture
      is the converted model's: `n_layers`, `n_features`, `n_heads`, `n_hidden`,
      `activation`, `ffn_form`, `block`, `final_norm`, `tie_embeddings` and `eps` must be
      left out. With `scheme = "lie"` the model is the converted network itself (exported
      back with `itde.train.export_hf_dir`, and written to `OUT/hf` when the run completes at
      `dt = 1`); with a continuous scheme its per-layer controls become
      `LegendreControls.from_layers(controls, n_modes)` (pre-norm and parallel models,
      whose norms act inside the operators; a post-norm model is refused). Task `textlm`
      only, with `[task] tokenizer` = the same `"hf:DIR"` (the directory's
      `tokenizer.json`). See [`init_from_hf_dir`][itde.train.init_from_hf_dir].
    """

    n_layers: int | None = None
    n_features: int | None = None
    n_heads: int | None = None
    n_hidden: int | None = None
    activation: str | None = None
    ffn_form: str | None = None
    scheme: str = "lie"
    dt: float = 1.0
    n_modes: int | None = None
    eps: float | None = None
    block: str | None = None
    final_norm: bool | None = None
    tie_embeddings: bool | None = None
    init: str = ""

    def __post_init__(self):
        init = HFInit.parse(self.init)  # None for "", else "hf:DIR" (anything else refused)
        choices("model.scheme", self.scheme, SCHEMES)
        positive("model.dt", self.dt)
        if init is not None:
            self._check_init()
            return
        for key, default in ARCHITECTURE.items():
            if getattr(self, key) is None:
                _set(self, key, default)
        choices("model.block", self.block, tuple(BLOCK_FORMS))
        for key in ("final_norm", "tie_embeddings"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"`model.{key}` must be true or false, got {getattr(self, key)!r}"
                )
        if FFN_FORMS.get(self.ffn_form) and self.block != "post_norm":
            raise ConfigError(
                f"`model.ffn_form`={self.ffn_form!r} is a form of the post-norm block; with "
                f"`model.block`={self.block!r} use ffn_form = 'residual'"
            )
        for name in ("n_layers", "n_features", "n_heads", "n_hidden"):
            positive(f"model.{name}", getattr(self, name))
        if self.n_features % self.n_heads:
            raise ConfigError(
                f"`model.n_heads`={self.n_heads} does not divide `model.n_features`="
                f"{self.n_features}"
            )
        choices("model.activation", self.activation, ACTIVATIONS)
        choices("model.ffn_form", self.ffn_form, tuple(FFN_FORMS))
        if not self.continuous:
            check_depth_step(self.dt, 1.0, name="model.dt", error=ConfigError)
        elif self.dt > self.n_layers:
            raise ConfigError(
                f"`model.dt`={self.dt} is longer than the depth T = n_layers = "
                f"{self.n_layers}; choose 0 < dt <= {self.n_layers}"
            )
        if self.continuous:
            if self.n_modes is None:
                _set(self, "n_modes", 2)
            positive("model.n_modes", self.n_modes)
            if self.eps is None:
                _set(self, "eps", 0.0)
            # exact: `eps` is the number the config gives (or the default 0 set above)
            if self.eps != 0.0:
                raise ConfigError(
                    f"`model.eps`={self.eps} must be 0 with the continuous scheme "
                    f"{self.scheme!r} (it integrates on the exact constraint set S1)"
                )
        else:
            self._refuse_modes()
            if self.eps is None:
                _set(self, "eps", 1e-5)
            if not (math.isfinite(self.eps) and self.eps >= 0):
                raise ConfigError(f"`model.eps` must be >= 0, got {self.eps!r}")

    def _refuse_modes(self) -> None:
        if self.n_modes is not None:
            raise ConfigError(
                "`model.n_modes` applies to continuous-depth schemes only; the 'lie' "
                "scheme has one set of controls per layer"
            )

    def _check_init(self) -> None:
        """`init = "hf:DIR"`: the architecture is the initial model's; only the depth
        scheme, step and modes are this table's."""
        given = [k for k in (*ARCHITECTURE, "eps") if getattr(self, k) is not None]
        if given:
            raise ConfigError(
                f"`model.{given[0]}`={getattr(self, given[0])!r} is set, but with `model.init`="
                f"{self.init!r} the architecture is the Hugging Face model's (its config.json): "
                f"remove {', '.join(f'`model.{k}`' for k in given)}"
            )
        if not self.continuous:
            self._refuse_modes()
        elif self.n_modes is not None:
            positive("model.n_modes", self.n_modes)
        if not self.continuous:
            check_depth_step(self.dt, 1.0, name="model.dt", error=ConfigError)

    @property
    def continuous(self) -> bool:
        """Whether the model has controls smooth in depth (any scheme but `"lie"`)."""
        return self.scheme != "lie"

    @property
    def hf_init(self) -> HFInit | None:
        """`init` read: the Hugging Face directory the model starts from, which opens it
        (None: a random initialisation)."""
        return HFInit.parse(self.init)

    @property
    def init_dir(self) -> Path | None:
        """The Hugging Face directory of `init` (None: a random initialisation)."""
        init = self.hf_init
        return None if init is None else init.directory


def _warmup_fix(warmup: int, steps: int) -> str:
    """How to mend a warm-up that is negative or not shorter than the run."""
    if warmup < 0:
        return "; set it to 0 for no warm-up, or to a number of steps"
    tenth = steps // 10
    example = f"{tenth} (a tenth of the run)" if tenth else "0 (no warm-up)"
    return (
        f": the warm-up must end before the run does. Set `optim.warmup` "
        f"below {steps}, e.g. `optim.warmup` = {example}; its default, "
        f"{OptimConfig.warmup}, needs a run of more than {OptimConfig.warmup} steps"
    )


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    r"""The optimiser (the `[optim]` table): `clip_by_global_norm(clip_norm)` then AdamW
    with a linear warm-up over `warmup` steps to `lr` and a cosine decay to
    `lr * final_lr_ratio` at `steps`; `batch_size` examples a step; `seed` (an integer in
    $[0, 2^{32} - 1]$) sets the initialisation and the data stream.

    - `final_lr_ratio`: the learning rate at the last step as a fraction of `lr`, in
      $[0, 1]$ (0: the cosine decays to zero).
    - `weight_decay`: AdamW's decoupled decay $\ge 0$, applied to the parameters whose
      role is a kernel (see `itde.parameter_roles`), not to biases, gains or positions.
    - `b1`, `b2`: Adam's moment decay rates, in $[0, 1)$.
    - `clip_norm`: the global gradient norm above which the gradient is rescaled to it.

    `accumulate` = $K$ splits each step's batch into $K$ micro-batches of
    `batch_size / K` examples, run one after the other (a `jax.lax.scan` in the compiled
    step): the step uses the mean of their gradients, which is the gradient of the whole
    batch (every task's loss is a mean over examples), so $K$ changes the memory a step
    needs, not the optimisation — the same examples, learning rate and number of steps,
    equal to round-off. (nanoGPT's `gradient_accumulation_steps` multiplies its batch
    instead: there `batch_size` is the micro-batch.) `batch_size` must be a multiple of
    $K$ times the device count; `accumulate` may change on resume."""

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
    accumulate: int = 1

    def __post_init__(self):
        for name in ("lr", "clip_norm", "batch_size", "steps", "accumulate"):
            positive(f"optim.{name}", getattr(self, name))
        if self.batch_size % self.accumulate:
            raise ConfigError(
                f"`optim.accumulate`={self.accumulate} micro-batches do not divide "
                f"`optim.batch_size`={self.batch_size} (the examples of one step); choose a "
                f"divisor of {self.batch_size}, or a batch size that is a multiple of "
                f"{self.accumulate}"
            )
        seed("optim.seed", self.seed)
        if not 0 <= self.warmup < self.steps:
            raise ConfigError(
                f"`optim.warmup`={self.warmup} must be >= 0 and less than `optim.steps`="
                f"{self.steps}" + _warmup_fix(self.warmup, self.steps)
            )
        for name in ("final_lr_ratio", "weight_decay"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"`optim.{name}` must be >= 0, got {v!r}")
        if self.final_lr_ratio > 1:
            raise ConfigError(
                f"`optim.final_lr_ratio`={self.final_lr_ratio} must be in [0, 1] (the learning "
                "rate decays from `optim.lr` to `lr * final_lr_ratio`)"
            )
        for name in ("b1", "b2"):
            v = getattr(self, name)
            if not 0 <= v < 1:
                raise ConfigError(f"`optim.{name}` must be in [0, 1), got {v!r}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Bookkeeping (the `[run]` table): log, evaluate and checkpoint every so many steps
    (and always at the last step), the compute `dtype` (`"float32"` or `"bfloat16"`:
    bfloat16 casts parameters and activations for the forward and backward passes and
    keeps float32 master parameters and optimiser state), the output directory (empty:
    `runs/<task name>`) and the progress bar. The defaults of every table are
    `configs/sort.toml`'s.

    - `log_every`, `eval_every`, `checkpoint_every`: steps between two rows of
      `metrics.jsonl` (training loss, rate), two held-out evaluations, two checkpoints.
    - `out`: the run's directory (`--out` overrides it).
    - `progress`: show a progress bar (`--no-progress` prints a line per evaluation).
    - `checkpoint_format`: `"auto"` (default: `"shards"` where the run is sharded,
      `parallel.fsdp` > 1 or several processes, else `"file"`), `"file"` (the state
      gathered into one file written by process 0) or `"shards"` (each process writes its
      own shards with Orbax; every process must see the directory). Any format resumes on
      any mesh."""

    log_every: int = 50
    eval_every: int = 250
    checkpoint_every: int = 500
    dtype: str = "float32"
    out: str = ""
    progress: bool = True
    checkpoint_format: str = "auto"

    def __post_init__(self):
        for name in ("log_every", "eval_every", "checkpoint_every"):
            positive(f"run.{name}", getattr(self, name))
        choices("run.dtype", self.dtype, COMPUTE_DTYPES)
        choices("run.checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)


@dataclasses.dataclass(frozen=True)
class ContinuityConfig:
    r"""Keeping a continuous-depth model a discretisation of its equation (the
    `[continuity]` table; see `itde.train.DepthRegularisation`): `consistency` $\mu \ge 0$
    weighs the squared relative distance between the outputs at the training step and at
    half of it; `transport` $\lambda \ge 0$ the transport cost $\int \|u_t\|^2 dt$ of the
    training solve; `refine` $r$ (an integer $\ge 2$, or 0 for none) sets the metric logged
    at every evaluation of a continuous model, the distance of its held-out outputs to
    those at $1/r$ of its step (`eval_continuum_distance`)."""

    consistency: float = 0.0
    transport: float = 0.0
    refine: int = 8

    def __post_init__(self):
        for name in ("consistency", "transport"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (math.isfinite(v) and v >= 0):
                raise ConfigError(
                    f"`continuity.{name}` must be a finite weight >= 0 (0: off), got {v!r}"
                )
        if isinstance(self.refine, bool) or not (self.refine == 0 or self.refine >= 2):
            raise ConfigError(
                f"`continuity.refine`={self.refine!r} must be an integer >= 2 (the refined "
                "step is dt / refine) or 0 to log no distance"
            )


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a step is laid out over the devices (the `[parallel]` table).

    - `fsdp`: the devices that share one copy of the parameters and optimiser state
      (fully sharded data parallelism). The devices form a 2-D mesh
      `("data", "fsdp")` of shape `(devices / fsdp, fsdp)`; every large parameter array
      and its Adam moments are split over the `"fsdp"` axis (see
      `itde.train.fsdp_spec` for the rule), the batch over both axes. 1 (the default):
      parameters replicated on every device, plain data parallelism. It must divide the
      device count, which the run checks when it starts.

    Its own table, not `[optim]`: it says where the numbers are computed, not which —
    a run with any `fsdp` takes the same steps, equal to round-off — so it may change on
    resume (a run moved to a machine with fewer devices), and further axes of the mesh
    (tensor parallelism) belong next to it.
    """

    fsdp: int = 1

    def __post_init__(self):
        positive("parallel.fsdp", self.fsdp)


@dataclasses.dataclass(frozen=True)
class MultilevelConfig:
    r"""Multilevel training in depth (the `[multilevel]` table; see
    `itde.train.LevelSchedule`): the run goes through phases, each at one depth step.

    - `dt`: the depth step of each phase, in order, e.g. `[2.0, 1.0]` (the last must be
      `model.dt`: the trained model is the configured one); or
    - `layers`: the same as layer counts, `[2, 4]` for a 4-layer model at `dt = 1`
      (phase `n` layers runs at `model.dt * n_layers / n`). Give one of the two.
    - `shares`: the fraction of `optim.steps` of each phase, summing to 1.
    - `restriction`: how a per-layer model's coarse layers are made (`"even"`, `"odd"`,
      `"mean"`: `itde.train.RESTRICTIONS`); `prolongation`: how fine layers come back
      (`"copy"`, `"linear"`: `itde.train.PROLONGATIONS`); `moments`: what happens to
      Adam's moments on a switch (`"transfer"`, `"reset"`: `itde.train.MOMENTS`).

    Empty `dt` and `layers` (the default): off."""

    dt: tuple[float, ...] = ()
    layers: tuple[int, ...] = ()
    shares: tuple[float, ...] = ()
    restriction: str = "even"
    prolongation: str = "copy"
    moments: str = "transfer"

    def __post_init__(self):
        from ._multilevel import MOMENTS, PROLONGATIONS, RESTRICTIONS

        choices("multilevel.restriction", self.restriction, RESTRICTIONS)
        choices("multilevel.prolongation", self.prolongation, PROLONGATIONS)
        choices("multilevel.moments", self.moments, MOMENTS)
        if self.dt and self.layers:
            raise ConfigError(
                f"`multilevel.dt`={list(self.dt)} and `multilevel.layers`="
                f"{list(self.layers)} both give the levels; keep one of them"
            )
        n = len(self.dt or self.layers)
        if len(self.shares) != n:
            raise ConfigError(
                f"`multilevel.shares`={list(self.shares)} has {len(self.shares)} entries for "
                f"{n} levels; give one share of `optim.steps` per level"
            )
        for v in (*self.dt, *self.layers, *self.shares):
            if isinstance(v, bool) or not (math.isfinite(v) and v > 0):
                raise ConfigError(
                    f"`multilevel`: {v!r} is not a positive level or share (levels: "
                    f"{list(self.dt or self.layers)}, shares: {list(self.shares)})"
                )
        if n and not math.isclose(sum(self.shares), 1.0, abs_tol=1e-9):
            raise ConfigError(
                f"`multilevel.shares`={list(self.shares)} sum to {sum(self.shares):g}; they "
                "are fractions of `optim.steps` and must sum to 1"
            )

    @property
    def active(self) -> bool:
        return bool(self.dt or self.layers)

    def levels(self, m) -> tuple[float, ...]:
        """The depth step of each phase for the `[model]` table `m` (checked: each level
        divides the depth, a per-layer level is whole layers, the last is `model.dt`)."""
        T = float(m.n_layers)
        if self.layers:
            for n in self.layers:
                if isinstance(n, bool) or not isinstance(n, int) or m.n_layers % n:
                    raise ConfigError(
                        f"`multilevel.layers`: {n!r} does not divide `model.n_layers`="
                        f"{m.n_layers}; a level keeps n_layers / r layers, e.g. "
                        f"{[d for d in range(1, m.n_layers + 1) if m.n_layers % d == 0]}"
                    )
            dts = tuple(m.dt * m.n_layers / n for n in self.layers)
        else:
            dts = tuple(float(d) for d in self.dt)
        for d in dts:
            steps = T / d
            if not math.isclose(steps, round(steps), rel_tol=1e-9):
                raise ConfigError(
                    f"`multilevel`: the level dt = {d:g} does not divide the depth T = "
                    f"`model.n_layers` = {m.n_layers} ({steps:g} steps); choose T / k"
                )
            if not m.continuous:
                r = d / m.dt
                if not math.isclose(r, round(r), rel_tol=1e-9) or m.n_layers % round(r):
                    raise ConfigError(
                        f"`multilevel`: the level dt = {d:g} of a per-layer model must be "
                        f"`model.dt`={m.dt:g} times a divisor r of `model.n_layers`="
                        f"{m.n_layers} (the coarse network keeps every r-th layer)"
                    )
        if dts and not math.isclose(dts[-1], m.dt, rel_tol=1e-9):
            raise ConfigError(
                f"`multilevel`: the last level (dt = {dts[-1]:g}) must be the model's own "
                f"`model.dt`={m.dt:g}, so that the trained model is the configured one"
            )
        # the model's own level is its `dt` exactly (the loop compares the two)
        return tuple(m.dt if math.isclose(d, m.dt, rel_tol=1e-9) else d for d in dts)


@dataclasses.dataclass(frozen=True)
class TrainExperiment:
    """The config of `itde train`: `task`, `model`, `optim`, `run`, `parallel` and
    `continuity` and `multilevel` tables."""

    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    continuity: ContinuityConfig = dataclasses.field(default_factory=ContinuityConfig)
    multilevel: MultilevelConfig = dataclasses.field(default_factory=MultilevelConfig)

    def __post_init__(self):
        m, t = self.model, self.task
        if self.multilevel.active:
            if m.hf_init is not None:
                raise ConfigError(
                    "`multilevel` with `model.init`: multilevel training starts from a "
                    "random initialisation; remove one of them"
                )
            self.multilevel.levels(m)
        if m.hf_init is not None and (t.name != "textlm" or t.tokenizer != m.init):
            key, value = ("name", t.name) if t.name != "textlm" else ("tokenizer", t.tokenizer)
            raise ConfigError(
                f"`task.{key}`={value!r}: `model.init`={m.init!r} fine-tunes a Hugging Face "
                "causal language model, which reads the token ids of its own tokenizer; set "
                f'`name = "textlm"` and `tokenizer = "{m.init}"` in [task] (the directory\'s '
                "tokenizer.json)"
            )
        if m.tie_embeddings and t.name == "burgers":
            raise ConfigError(
                "`model.tie_embeddings` = true ties the head to the token embedding; task "
                "'burgers' lifts fields, it has no embedding: leave it false"
            )
        c = self.continuity
        if not self.model.continuous and (c.consistency > 0 or c.transport > 0):
            key = "consistency" if c.consistency > 0 else "transport"
            raise ConfigError(
                f"`continuity.{key}` > 0 asks a per-layer network (`model.scheme` = 'lie') to "
                "stay close to an equation it does not discretise; train a continuous model "
                "(`model.scheme` = 'rk4', 'strang', ... with `model.n_modes`) or set it to 0"
            )


# Keys that may differ between a checkpoint and a resumed run: they do not change the
# numbers the run computes (beyond round-off), only when it reports them, where, and how
# the step is laid out in memory and over the devices.
RESUMABLE_KEYS = frozenset(
    {
        "run.log_every",
        "run.eval_every",
        "run.checkpoint_every",
        "run.out",
        "run.progress",
        "run.checkpoint_format",
        "optim.accumulate",
        "parallel.fsdp",
    }
)


def _check_renamed(table: dict, source: str) -> None:
    for old, new in RENAMED.items():
        section, key = old.split(".")
        sub = table.get(section)
        if isinstance(sub, dict) and key in sub:
            raise ConfigError(
                f"{source}: `{old}` was renamed; write `{new.split('.')[1]} = {sub[key]!r}` in "
                f"[{section}] (the `{new}` key, as in `itde solve`'s [model] table)"
            )


def from_dict(cls: type, table: dict, source: str = "<dict>"):
    """Build a config dataclass (e.g. `TrainExperiment`) from a nested dict, naming
    `source` in every error; a key of an earlier version names the key that replaced it."""
    if cls is TrainExperiment and isinstance(table, dict):
        _check_renamed(table, source)
    return _config.from_dict(cls, table, source)


def load_config(cls: type, path: str | Path | None, overrides: Sequence[str] = ()):
    """Read a TOML file into the config dataclass `cls` (e.g. `TrainExperiment`).

    - `path`: the TOML file; None for the built-in defaults of `cls` (then `overrides`
      alone change them).
    - `overrides`: `"KEY=VALUE"` strings, as `itde train --set` gives them (e.g.
      `["optim.steps=150", "model.n_features=64"]`), applied in order after the file and
      before validation: each KEY must be a key of `cls` (an unknown one names the nearest
      known key), each VALUE is read as a TOML value (`150`, `1e-3`, `true`, `"text"`,
      `[1, 2]`; a VALUE that is not TOML is the text itself) and checked as the file's
      value would be. Relative paths in the file are read from the file's folder; those
      of `overrides` from the working directory.

    (`itde.train.load(TrainExperiment, path)`, the earlier spelling, does the same.)"""
    import tomllib

    if path is None:
        source = _config.described("<built-in default>", overrides)
        table = _config.override(cls, {}, overrides, RENAMED if cls is TrainExperiment else None)
        return from_dict(cls, table, source)
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"config {str(path)!r} is a directory, not a TOML file; give --config PATH to a "
            "file such as configs/sort.toml"
        )
    if cls is not TrainExperiment:
        return _config.load(cls, path, overrides)
    if path.is_file():
        try:
            _check_renamed(tomllib.loads(path.read_text(encoding="utf-8")), str(path))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError):
            pass  # `itde`'s reader reports it
    table = _relative_to(_config.read_table(path), path.parent)
    table = _config.override(cls, table, overrides, RENAMED)
    return from_dict(cls, table, _config.described(str(path), overrides))


def _relative_to(table: dict, folder: Path) -> dict:
    """A config file's relative paths (`task.text_path`, `task.cache_dir`, the directory
    of `model.init` and of an `"hf:DIR"` `task.tokenizer`) read from the file's folder,
    not the working directory: the same file works from anywhere. A `"package:..."` path
    names a place in an installed package and is kept as it is. (On the file's table,
    before `--set` overrides, whose paths are the working directory's.)"""

    def moved(text: str) -> str:
        if text and not Path(text).is_absolute() and not text.startswith("package:"):
            return str(folder / text)
        return text

    def moved_hf(text: str) -> str:
        directory = hf_directory(text)
        return text if directory is None else HF_PREFIX + moved(directory)

    table = {k: dict(v) if isinstance(v, dict) else v for k, v in table.items()}
    places = [("task", "text_path", moved), ("task", "cache_dir", moved),
              ("task", "tokenizer", moved_hf), ("model", "init", moved_hf)]  # fmt: skip
    for section, key, move in places:
        values = table.get(section)
        if isinstance(values, dict) and isinstance(values.get(key), str):
            values[key] = move(values[key])
    return table


def to_dict(cfg) -> dict:
    """A JSON/TOML-ready nested dict of a config (tuples become lists), its relative paths
    (`task.text_path`, `task.cache_dir`, the directories of `model.init` and of an
    `"hf:DIR"` `task.tokenizer`) made absolute from the working directory: a run's
    sidecar holds this dict, so `itde.train.load`, `itde eval` and `--resume` read the
    run's paths alike from any folder."""

    def plain(v):
        if isinstance(v, tuple | list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return _relative_to(plain(dataclasses.asdict(cfg)), Path.cwd())


def stored_paths(table: dict, directory, init_sha256: str | None = None) -> dict:
    """The config `table` of the sidecar of the run in `directory`, its paths absolute.

    A sidecar written since issue 46 holds them absolute already (`to_dict`). An earlier
    one holds them as they were given, relative to the folder the run was trained in,
    which it does not record: they are read from the first of the working directory and
    the folders above `directory` where `model.init` names the directory the run started
    from (its files' SHA-256 is `init_sha256`, the sidecar's; any directory of that name
    when none is recorded), else from the working directory, as before."""
    if not isinstance(table, dict) or not isinstance(table.get("model", {}), dict):
        return table  # not a config: `from_dict` names what is wrong
    init = table.get("model", {}).get("init")
    relative = hf_directory(init) if isinstance(init, str) else None
    base = Path.cwd()
    if relative is not None and not Path(relative).is_absolute():
        for folder in (base, *Path(directory).absolute().parents):
            found = folder / relative
            if found.is_dir() and init_sha256 in (None, HFInit(found).sha256()):
                base = folder
                break
    return _relative_to(table, base)


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
