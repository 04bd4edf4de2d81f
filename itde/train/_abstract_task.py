"""What a training task is: its data, its model, its loss and its metrics, as one object.

The loop, the model builder, the evaluation and the CLI ask the task; none of them
branches on the task's name. The tasks are listed once, in [`TASKS`][itde.train.TASKS].
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from ._model import cross_entropy, init_token_model


class AbstractTask(abc.ABC):
    """A task of `itde train`, built from its `[task]` table (a
    [`TaskConfig`][itde.train.TaskConfig]).

    **Class attributes** (what a subclass declares):

    - `name`: the `task.name` of the config (its key in [`TASKS`][itde.train.TASKS]).
    - `options`: the task's own `[task]` keys and their defaults.
    - `metric`, `metric_label`, `metric_log`: the headline held-out metric (a key of
      `evaluate`'s result), its label in the loss plot, and whether it is plotted on a log
      scale.
    - `can_sample`: whether `itde sample` can continue text with the task's model.

    **Methods** (what the loop, the model builder, the evaluation and the CLI call):

    - `train_batch(key, n)`, `eval_batch(key, n)`: `(x, y)` NumPy arrays, pure functions
      of the key (the training stream and the held-out set).
    - `init_model(model_config, key, dtype=...)`: the untrained model.
    - `loss(out, y)` and `metric_sums(out, y)`: the training loss of a batch, and the sums
      over a batch of the held-out metrics (traced under `jit`: they may use only the
      task's static configuration). `finish_metrics(means)` adds derived metrics.
    - `checkpoint_meta()`: what a checkpoint stores so that the run can be checked on
      resume and the model evaluated and sampled later; `from_checkpoint(config, meta)`
      rebuilds the task for evaluation from it without reading any data file.
    - `on_grid(n)`: the same task on another token grid, where that means something.

    Two tasks built from equal configs compare equal and hash alike, so compiled steps
    are shared between runs of one config.
    """

    name: ClassVar[str]
    options: ClassVar[dict[str, Any]]
    metric: ClassVar[str]
    metric_label: ClassVar[str]
    metric_log: ClassVar[bool] = False
    can_sample: ClassVar[bool] = False
    #: the task option that is the number of tokens of an example (`"length"`, ...)
    tokens_key: ClassVar[str]

    def __init__(self, config):
        self.config = config

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config == other.config

    def __hash__(self) -> int:
        return hash((type(self), self.config))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    # ------------------------------------------------------------------ configuration
    @classmethod
    def check_options(cls, config) -> None:
        """Raise `ConfigError` naming the key if an option of `config` is impossible."""

    @classmethod
    def from_checkpoint(cls, config, meta: dict):
        """The task of a checkpoint (`meta` = its `checkpoint_meta()`), for evaluation and
        sampling; reads no data file where the checkpoint holds what is needed."""
        return cls(config)

    def checkpoint_meta(self) -> dict:
        """JSON-ready data a checkpoint stores with the parameters."""
        return {}

    @property
    def vocab(self) -> int | None:
        """The vocabulary size (None for a task without tokens)."""
        return None

    @property
    def grid_size(self) -> int | None:
        """The number of token grid points, for a task on a physical grid (else None)."""
        return None

    def on_grid(self, n_grid: int, *, name: str = "n_grid"):
        """The same task on `n_grid` token grid points; `name` is the argument named in
        an error."""
        raise ValueError(
            f"`{name}` applies to a task on a physical grid (burgers); task {self.name!r} has "
            f"tokens, not grid points: omit `{name}`."
        )

    # ------------------------------------------------------------------ data
    @abc.abstractmethod
    def train_batch(self, key: PRNGKeyArray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` training examples `(x, y)`, a pure function of `key`."""

    @abc.abstractmethod
    def eval_batch(self, key: PRNGKeyArray, n: int) -> tuple[np.ndarray, np.ndarray]:
        """`n` held-out examples `(x, y)`, a pure function of `key`."""

    # ------------------------------------------------------------------ model and loss
    @abc.abstractmethod
    def init_model(self, model_config, key: PRNGKeyArray, *, dtype):
        """The untrained model of the `[model]` table `model_config`."""

    @abc.abstractmethod
    def loss(self, out, y) -> Float[Array, ""]:
        """The training loss of a batch: the model's batched output `out` against `y`."""

    @abc.abstractmethod
    def metric_sums(self, out, y) -> dict[str, Float[Array, ""]]:
        """Sums over the batch of the held-out metrics (divided by the count later)."""

    def finish_metrics(self, means: dict[str, float]) -> dict[str, float]:
        """The held-out metrics from the means of `metric_sums` (derived ones added)."""
        return means


class AbstractTokenTask(AbstractTask):
    """A task on token sequences (`sort`, `charlm`, `textlm`): a
    [`TokenModel`][itde.train.TokenModel] over the task's vocabulary and its
    `tokens_key` tokens, trained by next-token (or per-token) cross-entropy.

    **Class attribute:** `causal`, whether attention is causal (Volterra)."""

    causal: ClassVar[bool]

    def init_model(self, model_config, key: PRNGKeyArray, *, dtype=jnp.float32):
        context = getattr(self.config, self.tokens_key)
        return init_token_model(key, model_config, vocab=self.vocab, context=context,
                                causal=self.causal, dtype=dtype)  # fmt: skip

    def loss(self, out, y) -> Float[Array, ""]:
        return cross_entropy(out, y)
