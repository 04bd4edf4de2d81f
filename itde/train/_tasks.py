"""The tasks of `itde train` — `sort`, `burgers`, `charlm`, `textlm` — and their registry
`TASKS`."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PRNGKeyArray

from .._config import ConfigError, positive
from ..data import BurgersTask, CharCorpus, SortTask, builtin_text_path, relative_l2
from ..data._sort import accuracy
from ._model import cross_entropy, init_field_model
from ._abstract_task import AbstractTask, AbstractTokenTask
from ._textlm import TextLM

_MAX_DAMPING = 11.5  # exp(-11.5) ~ 1e-5
_MAX_DATA_STEPS = 100_000


@typing.final
class Sort(AbstractTokenTask):
    """Sort `length` digits from `{0, ..., vocab - 1}` (`itde.data.SortTask`): a
    bidirectional [`TokenModel`][itde.train.TokenModel], per-position cross-entropy, held-out
    token and whole-sequence accuracy."""

    name = "sort"
    options = {"length": 8, "vocab": 10}
    metric = "eval_seq_acc"
    tokens_key = "length"
    causal = False
    metric_label = "held-out sequence accuracy"

    def __init__(self, config):
        super().__init__(config)
        self.data = SortTask(config.length, config.vocab)

    @classmethod
    def check_options(cls, config) -> None:
        for key in ("length", "vocab"):
            if getattr(config, key) < 2:
                raise ConfigError(f"`task.{key}` must be >= 2, got {getattr(config, key)}")

    @property
    def vocab(self) -> int:
        return self.config.vocab

    def train_batch(self, key, n):
        x, y = self.data.sample(key, n)
        return np.asarray(x), np.asarray(y)

    eval_batch = train_batch  # a fresh key stream (see `Run`) holds the set out

    def metric_sums(self, out, y):
        tok, seq = accuracy(out, y)
        n = y.shape[0]
        return {"eval_token_acc": tok * n, "eval_seq_acc": seq * n}


def _check_grid(n, name: str, n_modes: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 8 or n % 2:
        raise ValueError(f"`{name}`={n!r} must be an even integer >= 8 (grid points on [0, 2π)).")
    if 3 * n_modes >= n:
        raise ValueError(
            f"`{name}`={n} must exceed 3 * task.n_modes = {3 * n_modes} so the initial "
            "condition is resolved on the grid."
        )
    return int(n)


@typing.final
class Burgers(AbstractTask):
    r"""The solution operator $u_0 \mapsto u(t_f)$ of periodic viscous Burgers
    (`itde.data.BurgersTask`): a [`FieldModel`][itde.train.FieldModel] on the grid points,
    the mean squared error, held-out relative $L^2$ error."""

    name = "burgers"
    options = {
        "n_grid": 64,
        "nu": 0.05,
        "t_final": 1.0,
        "n_modes": 4,
        "decay": 1.0,
        "amplitude": 1.0,
        "oversample": 4,
    }
    metric = "eval_rel_l2"
    tokens_key = "n_grid"
    metric_label = "held-out relative L2"
    metric_log = True

    def __init__(self, config):
        super().__init__(config)
        self.data = BurgersTask(**config.options())

    @classmethod
    def check_options(cls, config) -> None:
        if config.n_grid < 8 or config.n_grid % 2:
            raise ConfigError(f"`task.n_grid` must be an even integer >= 8, got {config.n_grid}")
        for key in ("nu", "t_final", "n_modes", "amplitude", "oversample"):
            positive(f"task.{key}", getattr(config, key))
        if not (math.isfinite(config.decay) and config.decay >= 0):
            raise ConfigError(f"`task.decay` must be >= 0, got {config.decay!r}")
        if 3 * config.n_modes >= config.n_grid:
            raise ConfigError(
                f"`task.n_modes`={config.n_modes} must satisfy 3 * n_modes < n_grid="
                f"{config.n_grid}"
            )
        # the targets: every mode of u0 decays at least like exp(-nu t_final) (k >= 1)
        damping = config.nu * config.t_final
        if damping > _MAX_DAMPING:
            raise ConfigError(
                f"`task.nu`={config.nu:g} with `task.t_final`={config.t_final:g} damps every "
                f"mode of u0 by at least exp(-{damping:.3g}): the targets are ~0 and the "
                "relative L2 metric meaningless (it divides by their norm). Keep "
                f"nu * t_final <= {_MAX_DAMPING} (targets above ~1e-5 of the amplitude)."
            )
        # the data solver's work: its step count grows with amplitude * t_final * k_max
        k_max = (config.oversample * config.n_grid - 1) // 3
        steps = math.ceil(config.t_final * config.amplitude * k_max / 0.5)
        if steps > _MAX_DATA_STEPS:
            raise ConfigError(
                f"`task.amplitude`={config.amplitude:g} (with `task.t_final`="
                f"{config.t_final:g} and n_grid * oversample = "
                f"{config.n_grid * config.oversample}) makes the Burgers data solver take "
                f"{steps:.3g} time steps per example (advective limit), more than "
                f"{_MAX_DATA_STEPS:.0e}: generating the data would not end. Lower "
                "task.amplitude or task.t_final."
            )

    @property
    def grid_size(self) -> int:
        return self.config.n_grid

    def on_grid(self, n_grid: int, *, name: str = "n_grid"):
        n_grid = _check_grid(n_grid, name, self.config.n_modes)
        c = self.config
        k_max = (c.oversample * n_grid - 1) // 3
        steps = math.ceil(c.t_final * c.amplitude * k_max / 0.5)
        if steps > _MAX_DATA_STEPS:  # named by the argument that asked for the grid
            most = int(3 * _MAX_DATA_STEPS * 0.5 / (c.t_final * c.amplitude) / c.oversample)
            raise ValueError(
                f"`{name}`={n_grid} makes the Burgers data solver take {steps:.3g} time steps "
                f"per example on its {n_grid * c.oversample} points (advective limit, with "
                f"task.amplitude={c.amplitude:g}, task.t_final={c.t_final:g}), more than "
                f"{_MAX_DATA_STEPS:.0e}: generating the data would not end. Use `{name}` <= "
                f"{most - most % 2}."
            )
        return Burgers(dataclasses.replace(c, n_grid=n_grid))

    def train_batch(self, key, n):
        x, y = self.data.sample(key, n, dtype=jnp.float32)  # solved in float32, as trained
        return np.asarray(x), np.asarray(y)

    eval_batch = train_batch

    def init_model(self, model_config, key, *, dtype=jnp.float32):
        return init_field_model(key, model_config, dtype=dtype)

    def loss(self, out, y):
        return jnp.mean((out - y.astype(out.dtype)) ** 2)

    def metric_sums(self, out, y):
        return {"eval_rel_l2": relative_l2(out, y.astype(out.dtype)) * y.shape[0]}


@typing.final
class CharLM(AbstractTokenTask):
    """Next-character prediction on a local UTF-8 text (`itde.data.CharCorpus`): a causal
    (Volterra) [`TokenModel`][itde.train.TokenModel], next-token cross-entropy, held-out
    nats and bits per character. The checkpoint stores the vocabulary and the held-out
    text, so evaluation and sampling need no corpus file."""

    name = "charlm"
    options: dict[str, Any] = {"text_path": "", "context": 64, "val_fraction": 0.1}
    metric = "eval_nats_per_char"
    tokens_key = "context"
    causal = True
    metric_label = "validation nats/char"
    can_sample = True

    def __init__(self, config, corpus: CharCorpus | None = None):
        super().__init__(config)
        if corpus is None:
            path = config.text_path or builtin_text_path()
            corpus = CharCorpus.from_file(path, val_fraction=config.val_fraction)
            splits = ("train", "val")
        else:
            splits = ("val",)
        self.corpus = corpus
        for split in splits:
            n = getattr(corpus, split).shape[0]
            if n < config.context + 1:
                raise ValueError(
                    f"the {split!r} split of {corpus.source!r} has {n} characters, too short "
                    f"for `task.context`={config.context} (needs {config.context + 1}); use a "
                    "smaller context, a longer text, or another `task.val_fraction`."
                )

    @classmethod
    def check_options(cls, config) -> None:
        positive("task.context", config.context)
        if not (math.isfinite(config.val_fraction) and 0 < config.val_fraction < 1):
            raise ConfigError(f"`task.val_fraction` must be in (0, 1), got {config.val_fraction!r}")

    @classmethod
    def from_checkpoint(cls, config, meta: dict):
        itos = tuple(meta["itos"])
        stoi = {c: i for i, c in enumerate(itos)}
        val = np.fromiter((stoi[c] for c in meta["val_text"]), np.int32, len(meta["val_text"]))
        corpus = CharCorpus(itos, jnp.zeros((0,), jnp.int32), jnp.asarray(val), "<checkpoint>")
        task = cls(config, corpus)
        task._stored_meta = dict(meta)  # the fingerprint of the training text it came from
        return task

    def checkpoint_meta(self) -> dict:
        if getattr(self, "_stored_meta", None) is not None:
            return dict(self._stored_meta)
        digest = hashlib.sha256(np.asarray(self.corpus.train).tobytes())
        digest.update(np.asarray(self.corpus.val).tobytes())
        return {
            "itos": list(self.corpus.itos),
            "data_sha256": digest.hexdigest(),
            "val_text": self.corpus.decode(np.asarray(self.corpus.val)),
        }

    @property
    def vocab(self) -> int:
        return self.corpus.vocab_size

    @property
    def itos(self) -> tuple[str, ...]:
        """The vocabulary: token id -> character."""
        return self.corpus.itos

    def train_batch(self, key, n):
        if self.corpus.train.shape[0] == 0:
            raise ValueError(
                "this charlm task was restored from a checkpoint for evaluation; training "
                "needs its text file (`task.text_path`)"
            )
        x, y = self.corpus.batch(key, "train", n, self.config.context)
        return np.asarray(x), np.asarray(y)

    def eval_batch(self, key, n):
        x, y = self.corpus.batch(key, "val", n, self.config.context)
        return np.asarray(x), np.asarray(y)

    def metric_sums(self, out, y):
        return {"eval_nats_per_char": jnp.sum(jax.vmap(cross_entropy)(out, y))}

    def finish_metrics(self, means):
        out = dict(means)
        out["eval_bits_per_char"] = out["eval_nats_per_char"] / math.log(2.0)
        return out


#: The tasks of `itde train`: `task.name` -> task class.
TASKS: dict[str, type[AbstractTask]] = {c.name: c for c in (Sort, Burgers, CharLM, TextLM)}
"""The tasks of `itde train`: `task.name` -> task class."""


def build_model(cfg, key: PRNGKeyArray, *, task=None, dtype=jnp.float32):
    """The model of a [`TrainExperiment`][itde.train.TrainExperiment].

    **Arguments:**

    - `cfg`: the experiment config.
    - `key`: the initialisation key.
    - `task`: the task object (default `TASKS[cfg.task.name](cfg.task)`, which reads a
      charlm corpus to learn its vocabulary).
    - `dtype`: the parameter dtype (float32 for training; float64 for gradient checks).

    **Returns:** the task's model (`TokenModel` or `FieldModel`), untrained.
    """
    if task is None:
        task = TASKS[cfg.task.name](cfg.task)
    return task.init_model(cfg.model, key, dtype=dtype)
