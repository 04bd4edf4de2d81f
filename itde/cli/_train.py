"""The `itde train`, `itde eval` and `itde sample` commands.

`itde.cli.main` adds them with `add_train_commands(sub)` after the other sub-parsers.
Errors a user can fix (a bad config, a bad checkpoint, a bad data file, a batch size the
devices do not divide) are printed as one line and exit with status 2. Each says on stderr
what it is doing while the user waits: `itde train` with its progress bar, `itde eval` and
`itde sample` with a line before and after each stage (loading the checkpoint, compiling
and running), so the half minute or more of compilation is never silence.
"""

from __future__ import annotations

import json
import sys

from .. import ConfigError
from ._help import DeprecatedAlias, Names, add_set_option, writes


def _load_config(path, overrides=(), resume=None):
    """The config of `itde train` and its name: the file `path` (None: the built-in one, or
    with `resume` the checkpoint's) with the `--set` `overrides`; (None, name) for the
    checkpoint's own config unchanged."""
    from pathlib import Path

    from .._internal import described
    from ..train import TrainExperiment, from_dict, load_config

    if path is None and resume is not None:
        source = f"the config of {Path(resume) / 'checkpoint.json'}"
        if not overrides:
            return None, source
        from .._internal import override
        from ..train import read_checkpoint_meta as read_meta
        from ..train._internal import RENAMED

        source = described(source, overrides)
        table = override(TrainExperiment, read_meta(resume)["config"], overrides, RENAMED)
        return from_dict(TrainExperiment, table, source), source
    return load_config(TrainExperiment, path, overrides), described(
        str(path) if path is not None else "<built-in default>", overrides
    )


def cmd_train(args) -> int:
    from pathlib import Path

    from ..train import train

    if args.out is not None and not args.out.strip():
        raise ValueError(
            "`--out`='' names no directory (the run would be written into the working "
            "directory); give a directory, e.g. --out runs/sort"
        )
    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(
            f"`--out`={args.out!r} is an existing file, not a directory; give a directory "
            "(new, or an earlier run's with --resume/--overwrite) for the run's outputs"
        )
    if args.out is not None:  # under a file, or not writable: said now, before JAX starts
        from .._internal import check_output_location

        check_output_location(args.out, "--out")
    cfg, source = _load_config(args.config, args.set, args.resume)
    summary = train(cfg, out=args.out, resume=args.resume, source=source,
                    progress=False if args.no_progress else None,
                    overwrite=args.overwrite,
                    on_eval=_print_eval if args.no_progress else None)  # fmt: skip
    m = summary.metrics
    shown = {k: round(v, 6) for k, v in m.items() if isinstance(v, float) and k != "lr"}
    if summary.files == [] and summary.complete:
        print(f"itde train ({source}): {args.resume} is already complete at step "
              f"{summary.step} ([optim] steps); nothing to train, nothing written. "
              f"Its last logged row: {json.dumps(shown)}")  # fmt: skip
        return 0
    print(f"itde train ({source}): step {summary.step}, {json.dumps(shown)}")
    print(f"wrote {', '.join(summary.files)} ({summary.wall_s:.1f} s)")
    return 0


def _print_eval(row: dict) -> None:
    """One line per evaluation for `--no-progress` (a log file sees the run advance)."""
    shown = {k: round(v, 6) for k, v in row.items()
             if isinstance(v, float) and k not in ("lr", "wall_s", "examples_per_s")}  # fmt: skip
    print(f"step {row['step']}: {json.dumps(shown)} ({row['wall_s']:.1f} s)", flush=True)


def _restore(directory, spread: bool = False):
    """The run, model and sidecar of a checkpoint, for evaluation and sampling:
    `itde.train.load`, naming --checkpoint in errors (the task is rebuilt from the
    checkpoint, no data file is read), with the parameters replicated (`fsdp` 1). The model
    is on one device (sampling); `spread=True` (evaluation): on the devices of the run's
    mesh, the most whose number divides the batch size, where the held-out batches are
    split (the model and the batches on the same devices)."""
    from ..train import TASKS, Run
    from ..train._internal import batch_devices, read_run

    model, cfg, meta = read_run(directory, "--checkpoint", spread=spread)
    task = TASKS[cfg.task.name].from_checkpoint(cfg.task, meta.get("task", {}))
    devices = batch_devices(cfg) if spread else None
    return Run(cfg, devices=devices, task=task, fsdp=1), model, meta


def _stage(args, what: str):
    """A stage of `itde eval` / `itde sample`: `itde COMMAND: what ...` on stderr before it,
    `... took 12 s` after (none with --no-progress)."""
    from .._internal import stage_line

    return stage_line(f"itde {args.command}", what, enabled=not args.no_progress)


def cmd_eval(args) -> int:
    import warnings

    from .. import DepthStepWarning
    from ..train import evaluate, with_depth

    if args.size is not None and args.size < 1:
        raise ValueError(
            f"`--size`={args.size} must be a positive number of held-out examples (default: "
            "the checkpoint's [task] eval_size)"
        )
    with _stage(args, f"loading {args.checkpoint}"):
        run, model, meta = _restore(args.checkpoint, spread=True)
    trained = model
    layers = getattr(model.equation.controls, "layer_length", None)  # per-layer controls
    if layers is not None and args.dt is not None and args.dt > layers:
        # a coarser per-layer network: every r-th layer (the run's `[multilevel]
        # restriction`) at r times the step, as multilevel training runs its coarse levels
        from ..train import coarsen

        model = coarsen(with_depth(model, args.scheme), args.dt, run.cfg.multilevel.restriction,
                        name="--dt")
    else:
        model = with_depth(model, args.scheme, args.dt, name="--dt")
    if not run.cfg.model.continuous and model.dt < trained.dt:
        print(
            f"itde eval: warning: {args.checkpoint!r} holds a per-layer model (scheme "
            f"{trained.scheme!r}): it is the trained network only at its training step "
            f"dt={trained.dt:g}; at dt={model.dt:g} every layer's block is split into other "
            "steps, which makes a different network, not a finer solve of the same one, so "
            "expect other metrics (its LayerNorm gains are not projections). To refine its "
            "depth, study its continuum form: `itde converge --checkpoint "
            f"{args.checkpoint}`. Continuous-depth models ([model] scheme = a smooth scheme "
            "such as 'rk4') solve the same equation at every step.",
            file=sys.stderr,
        )
    task = run.task if args.grid is None else run.task.on_grid(args.grid, name="--grid")
    from ..train._internal import check_fits

    key = type(task).tokens_key
    check_fits(
        run.cfg, int(task.grid_size or getattr(run.cfg.task, key)), eval_size=args.size,
        tokens_name="--grid" if args.grid is not None else f"task.{key}",
        size_name="--size" if args.size is not None else "task.eval_size", train=False,
    )  # fmt: skip
    chunks = run.eval_chunks(args.size, task)
    examples = sum(c[0].shape[0] for c in chunks)
    with (
        _stage(args, f"compiling, then evaluating {examples} held-out examples"),
        warnings.catch_warnings(),  # said once above, in the command's own words
    ):
        warnings.simplefilter("ignore", DepthStepWarning)
        metrics = evaluate(model, chunks, task, run.compute_dtype)
    row = {"step": meta["step"], "scheme": model.scheme, "dt": model.dt,
           "examples": examples, **metrics}  # fmt: skip
    if task.grid_size is not None:
        row["grid"] = task.grid_size
    print(json.dumps(row))
    return 0


def cmd_sample(args) -> int:
    """Print the prompt, then the generated text chunk by chunk as it is drawn (flushed),
    so a long run shows progress and Ctrl-C keeps what was printed."""
    from .. import train as tr
    from .._internal import SEED_MAX

    if not 0 <= args.seed <= SEED_MAX:
        raise ValueError(f"`--seed`={args.seed} must be an integer in [0, {SEED_MAX}]")
    if args.length < 0:
        raise ValueError(f"`--length`={args.length} must be a non-negative number of tokens")
    import math

    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(  # said before the checkpoint is read, as the sampler would say it
            f"`--temperature`={args.temperature!r} must be a finite number >= 0 (0 = greedy, "
            "1 = the model's own distribution)."
        )
    from .._internal import check_filters, check_filters_sample
    from ..train._internal import FILTER_NAMES

    check_filters(args.top_k, args.top_p, FILTER_NAMES)  # said before the checkpoint is read
    check_filters_sample(args.temperature, args.top_k, args.top_p, (*FILTER_NAMES, "--temperature"))
    with _stage(args, f"loading {args.checkpoint}"):
        run, model, meta = _restore(args.checkpoint)
    if not run.task.can_sample:
        raise ValueError(
            f"`itde sample` needs a checkpoint of a text task ({', '.join(_sampled_tasks())}); "
            f"{args.checkpoint!r} "
            f"was trained on task {run.task.name!r}."
        )
    tokenizer = getattr(run.task, "tokenizer", None)  # textlm: BPE or byte-level text
    stream = tr.sample_stream(model, run.task.itos, args.prompt, args.length,
                              temperature=args.temperature, seed=args.seed,
                              encode=getattr(run.task, "encode", None),
                              decode=None if tokenizer is None else tokenizer.decode,
                              context=run.cfg.task.context, top_k=args.top_k,
                              top_p=args.top_p)  # fmt: skip
    written = 0
    try:
        with _stage(args, "compiling the sampler, then drawing the first token"):
            first = next(stream, "")  # checks the arguments before anything is printed
        sys.stdout.write(args.prompt + first)
        sys.stdout.flush()
        written += len(first)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
            written += len(piece)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        sys.stdout.flush()
        print(f"itde sample: error: interrupted after {written} characters", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    return 0


def _sampled_tasks() -> list[str]:
    """The tasks whose checkpoints `itde sample` continues (`can_sample`), by name."""
    from .. import train

    return [name for name, cls in train.TASKS.items() if cls.can_sample]


def _tasks_epilog() -> str:
    from .. import train

    lines = [f"  {name:<10}itde.train.{cls.__name__}, scored by {cls.metric_label}"
             for name, cls in train.TASKS.items()]  # fmt: skip
    return (
        "tasks ([task] name of the config; itde.train.TASKS):\n" + "\n".join(lines) + "\n\n"
        + writes(
            ("metrics.jsonl", "one JSON row per logged step: loss, lr, wall time, metrics"),
            ("loss_curve.png", "training loss and the held-out metric against step"),
            ("checkpoint.json", "the checkpoint's sidecar: config, step, data key, checksums"),
            ("state-STEP.eqx", "parameters and optimiser state (Equinox serialisation)"),
        )
    )


def add_train_commands(sub) -> None:
    """Add `train`, `eval` and `sample` to the `itde` sub-parsers `sub`."""
    p = sub.add_parser(
        "train",
        help="train a model on a built-in task through the depth solve",
        description=(
            "Train a model whose hidden layers are the equation solved in depth: AdamW with\n"
            "warm-up and cosine decay, gradients through the depth solve. The task, model,\n"
            "optimiser and schedule come from the config ([task], [model], [optim], [run]);\n"
            "every run is a pure function of [optim] seed, and --resume continues one\n"
            "bit for bit."
        ),
        epilog=_tasks_epilog,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file (default: the built-in sort task, the values of configs/sort.toml; "
        "with --resume: the checkpoint's)",
    )
    p.add_argument("--out", metavar="DIR", help="output directory (default: [run] out of the "
                   "config, else runs/TASK; with --resume: DIR of --resume)")  # fmt: skip
    p.add_argument("--resume", metavar="DIR", help="continue, bit for bit, the run whose "
                   "checkpoint is in DIR (default: start afresh)")  # fmt: skip
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in an --out that already holds a checkpoint")  # fmt: skip
    add_set_option(p, "optim.steps=150")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=_guard(cmd_train))

    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint, optionally at another depth step, scheme or grid",
        description=(
            "Evaluate a checkpoint of `itde train` on its held-out set (rebuilt from the\n"
            "checkpoint; no data file is read) and print one JSON line: step, scheme, dt,\n"
            "examples and the task's metrics. --dt / --scheme change the depth step and\n"
            "scheme: for a continuous-depth model (a smooth scheme such as rk4) that is a\n"
            "finer or coarser solve of the same equation; for a per-layer model ('lie',\n"
            "the default) another step is a different network, and the command says so."
        ),
        epilog="writes nothing; prints one JSON line.",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        metavar="DIR",
        help="a directory written by `itde train` (it holds checkpoint.json)",
    )
    p.add_argument("--dt", type=float, metavar="DT", help="depth step, 0 < DT <= the depth "
                   "(default: the trained step); a per-layer model at DT = r layers keeps "
                   "every r-th layer ([multilevel] restriction) at r times the step")  # fmt: skip
    p.add_argument("--scheme", choices=Names("itde", "SCHEMES"), metavar="SCHEME",
                   help="depth scheme, one of %(choices)s; 'lie' for per-layer models, the "
                   "others for continuous-depth ones (default: the trained scheme)")  # fmt: skip
    p.add_argument("--solver", dest="scheme", action=DeprecatedAlias, new="--scheme",
                   choices=Names("itde", "SCHEMES"), metavar="SCHEME")  # fmt: skip
    p.add_argument("--grid", type=int, metavar="N", help="burgers only: grid points of the "
                   "token domain (default: the trained grid)")  # fmt: skip
    p.add_argument("--size", type=int, metavar="N", help="held-out examples, > 0, rounded "
                   "up to whole batches (default: [task] eval_size of the checkpoint)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="write no stage lines on "
                   "stderr (loading, compiling, each with its time)")  # fmt: skip
    p.set_defaults(func=_guard(cmd_eval))

    p = sub.add_parser(
        "sample",
        help="generate text from a checkpoint of a text task (charlm, textlm)",
        description=lambda: (
            "Continue --prompt with tokens drawn from a checkpoint of a text task\n"
            f"({', '.join(_sampled_tasks())}: itde.train.TASKS whose can_sample is set), "
            "printed as they\nare drawn (Ctrl-C keeps what was printed); a character that "
            "a byte-level\ntokenizer spreads over several tokens is printed once whole. "
            "--temperature,\n--top-k and --top-p filter the model's distribution as "
            "Hugging Face's\ngenerate(do_sample=True) does, in that order."
        ),
        epilog="writes nothing; prints the prompt and the generated text.",
    )
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a directory written by `itde train` on a text task")  # fmt: skip
    p.add_argument("--prompt", default="", metavar="TEXT", help="text to continue, in "
                   "characters the model's vocabulary encodes (default: empty)")  # fmt: skip
    p.add_argument("--length", type=int, default=200, metavar="N",
                   help="tokens to generate (characters for charlm), >= 0 "
                   "(default: %(default)s)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="sampling "
                   "temperature, >= 0; 0 = greedy (default: %(default)s)")  # fmt: skip
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="draw among the K "
                   "most likely tokens only, K >= 1 (default: every token)")  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="draw among the "
                   "most likely tokens whose probabilities sum to P (nucleus), 0 < P <= 1 "
                   "(default: %(default)s, every token)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, metavar="SEED",
                   help="sampling seed in [0, 2**32 - 1] (default: %(default)s)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="write no stage lines on "
                   "stderr (loading, compiling, each with its time)")  # fmt: skip
    p.set_defaults(func=_guard(cmd_sample))


def _guard(fn):
    """Report user-fixable errors as one line on stderr with exit status 2."""

    def wrapped(args) -> int:
        from ..train import CheckpointError

        try:
            return fn(args)
        except ConfigError:
            raise  # `itde`'s main prints it ("config error: ...") and returns 2
        except (CheckpointError, FileNotFoundError, ValueError, FloatingPointError) as e:
            # FloatingPointError: a run that diverged (the message names `optim.lr`)
            print(f"itde {args.command}: error: {e}", file=sys.stderr)
            return 2

    return wrapped
