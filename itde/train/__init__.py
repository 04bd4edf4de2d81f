"""Training continuous-depth Transformers with Optax: `itde train`, `itde eval` and
`itde sample` as a library.

- Configs: [`TrainExperiment`][] with its tables [`TaskConfig`][], [`ModelConfig`][],
  [`OptimConfig`][], [`RunConfig`][]; [`load`][] (TOML) and [`from_dict`][], `to_dict`;
  errors are [`ConfigError`][].
- Tasks: [`TASKS`][] (`"sort"`, `"burgers"`, `"charlm"`, `"textlm"`) of
  [`AbstractTask`][]s — the data, model, loss and metrics of each.
- Models: [`TokenModel`][], [`FieldModel`][], [`build_model`][], [`with_depth`][],
  [`predict`][], [`loss_fn`][].
- Training: [`train`][] (a [`TrainResult`][]), [`Run`][], [`make_step`][], [`make_optimizer`][],
  [`evaluate`][]; checkpoints [`save_checkpoint`][], [`load_checkpoint`][],
  [`read_checkpoint_meta`][], [`CheckpointError`][].
- Sampling: [`sample`][] and [`sample_stream`][] (causal text models: charlm, textlm).
"""

from ._checkpoint import CheckpointError
from ._checkpoint import load as load_checkpoint
from ._checkpoint import read_meta as read_checkpoint_meta
from ._checkpoint import save as save_checkpoint
from ._config import (
    COMPUTE_DTYPES,
    ConfigError,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TaskConfig,
    TrainExperiment,
    from_dict,
    load,
    to_dict,
)
from ._evaluate import evaluate
from ._loop import (
    Run,
    TrainResult,
    make_mesh,
    make_optimizer,
    make_schedule,
    make_step,
    place,
    train,
)
from ._model import FieldModel, TokenModel, loss_fn, predict, with_depth
from ._sample import sample, sample_stream
from ._task import AbstractTask
from ._tasks import TASKS, Burgers, CharLM, Sort, TextLM, build_model

__all__ = [
    "COMPUTE_DTYPES",
    "TASKS",
    "AbstractTask",
    "Burgers",
    "CharLM",
    "CheckpointError",
    "ConfigError",
    "FieldModel",
    "ModelConfig",
    "OptimConfig",
    "Run",
    "RunConfig",
    "Sort",
    "TaskConfig",
    "TextLM",
    "TokenModel",
    "TrainExperiment",
    "build_model",
    "evaluate",
    "from_dict",
    "load",
    "load_checkpoint",
    "loss_fn",
    "make_mesh",
    "make_optimizer",
    "make_schedule",
    "make_step",
    "place",
    "predict",
    "read_checkpoint_meta",
    "sample",
    "sample_stream",
    "save_checkpoint",
    "to_dict",
    "train",
    "TrainResult",
    "with_depth",
]
