"""Training continuous-depth Transformers with Optax: `itde train`, `itde eval` and
`itde sample` as a library.

- Configs: [`TrainExperiment`][] with its tables [`TaskConfig`][], [`ModelConfig`][],
  [`OptimConfig`][], [`RunConfig`][], [`ParallelConfig`][], [`ContinuityConfig`][];
  [`load_config`][] (TOML) and [`from_dict`][], `to_dict`; errors are [`ConfigError`][].
- Tasks: [`TASKS`][] (`"sort"`, `"burgers"`, `"charlm"`, `"textlm"`) of
  [`AbstractTask`][]s — the data, model, loss and metrics of each.
- Models: [`TokenModel`][], [`FieldModel`][], [`build_model`][], [`with_depth`][],
  [`predict`][], [`loss_fn`][].
- Training: [`train`][] (a [`TrainResult`][]), [`Run`][], [`make_step`][], [`make_optimizer`][],
  [`evaluate`][]; the layout over devices [`make_mesh`][], [`fsdp_spec`][], [`place`][],
  [`shard`][] (a model on a mesh, e.g. a converted model too large for one device);
  checkpoints [`save_checkpoint`][], [`load_checkpoint`][], [`read_checkpoint_meta`][],
  [`CheckpointError`][]; continuity terms [`DepthRegularisation`][].
- A trained run: [`load`][]`(directory)` -> `(model, cfg, meta)`.
- Sampling: [`sample`][] and [`sample_stream`][] (causal text models: charlm, textlm),
  filtered as Hugging Face's `generate` filters ([`warp_logits`][]: temperature, top-k,
  top-p), the text decoded whole ([`IncrementalDecoder`][]).
- Fine-tuning a Hugging Face causal language model (`[model] init = "hf:DIR"`):
  [`init_from_hf_dir`][] (the initial model, from a Hugging Face model directory),
  [`token_model_from_lm`][], [`lm_from_token_model`][] and [`export_hf_dir`][] (the
  fine-tuned model written back as a Hugging Face model directory). `init_from_hf` and
  `export_hf`, their names before, still work for one release and warn.
"""

from .._next_token import IncrementalDecoder, warp_logits
from ._checkpoint import CheckpointError
from ._checkpoint import load as load_checkpoint
from ._checkpoint import read_meta as read_checkpoint_meta
from ._checkpoint import save as save_checkpoint
from ._config import (
    COMPUTE_DTYPES,
    ConfigError,
    ContinuityConfig,
    ModelConfig,
    MultilevelConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TaskConfig,
    TrainExperiment,
    from_dict,
    load_config,
    to_dict,
)
from ._continuity import DepthRegularisation, continuity_metrics, regularised_loss, transport_cost
from ._evaluate import evaluate
from ._export import export_hf_dir
from ._finetune import init_from_hf_dir, lm_from_token_model, token_model_from_lm
from ._load import load
from ._loop import TrainResult, train
from ._model import FieldModel, TokenModel, loss_fn, predict, with_depth
from ._multilevel import MOMENTS, PROLONGATIONS, RESTRICTIONS, LevelSchedule, Transfer, coarsen
from ._optim import make_optimizer, make_schedule, make_step
from ._run import Run, place
from ._sample import TokenDecoder, sample, sample_stream
from ._sharding import MIN_SHARD_SIZE, fsdp_spec, make_mesh, shard
from ._abstract_task import AbstractTask, AbstractTokenTask
from ._tasks import TASKS, Burgers, CharLM, Sort, TextLM, build_model

__all__ = [
    "COMPUTE_DTYPES",
    "MIN_SHARD_SIZE",
    "TASKS",
    "AbstractTask",
    "AbstractTokenTask",
    "Burgers",
    "CharLM",
    "CheckpointError",
    "ConfigError",
    "ContinuityConfig",
    "MultilevelConfig",
    "LevelSchedule",
    "Transfer",
    "RESTRICTIONS",
    "PROLONGATIONS",
    "MOMENTS",
    "coarsen",
    "DepthRegularisation",
    "FieldModel",
    "IncrementalDecoder",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "Run",
    "RunConfig",
    "Sort",
    "TaskConfig",
    "TextLM",
    "TokenModel",
    "TrainExperiment",
    "build_model",
    "continuity_metrics",
    "evaluate",
    "export_hf_dir",
    "from_dict",
    "fsdp_spec",
    "init_from_hf_dir",
    "load",
    "load_checkpoint",
    "load_config",
    "lm_from_token_model",
    "loss_fn",
    "make_mesh",
    "make_optimizer",
    "make_schedule",
    "make_step",
    "place",
    "predict",
    "read_checkpoint_meta",
    "regularised_loss",
    "sample",
    "sample_stream",
    "TokenDecoder",
    "save_checkpoint",
    "shard",
    "to_dict",
    "token_model_from_lm",
    "train",
    "transport_cost",
    "warp_logits",
    "TrainResult",
    "with_depth",
]

#: Names renamed, kept one release: old name -> new name (each warns on use).
_RENAMED = {"export_hf": "export_hf_dir", "init_from_hf": "init_from_hf_dir"}


def __getattr__(name: str):
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    warnings.warn(f"itde.train.{name} is deprecated and goes in the next release; use "
                  f"itde.train.{new}", DeprecationWarning, stacklevel=2)  # fmt: skip
    return globals()[new]
