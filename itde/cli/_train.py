"""The `itde train`, `itde eval` and `itde sample` commands.

`itde.cli.main` adds them with `add_train_commands(sub)` after the other sub-parsers.
Errors a user can fix (a bad config, a bad checkpoint, a bad data file, a batch size the
devices do not divide) are printed as one line and exit with status 2.
"""

from __future__ import annotations

import json
import sys

from ..train._config import ConfigError


def _load_config(path):
    from ..train import TrainExperiment, load

    if path is None:
        return None, "<built-in default>"
    return load(TrainExperiment, path), str(path)


def cmd_train(args) -> int:
    from pathlib import Path

    from ..train import TrainExperiment, train

    if args.out is not None and Path(args.out).exists() and not Path(args.out).is_dir():
        raise ValueError(
            f"`--out`={args.out!r} is an existing file, not a directory; give a directory "
            "(new, or an earlier run's with --resume/--overwrite) for the run's outputs"
        )
    cfg, source = _load_config(args.config)
    if cfg is None and args.resume is None:
        cfg = TrainExperiment()
    summary = train(cfg, out=args.out, resume=args.resume, source=source,
                    progress=False if args.no_progress else None,
                    overwrite=args.overwrite)  # fmt: skip
    m = summary["metrics"]
    shown = {k: round(v, 6) for k, v in m.items() if isinstance(v, float) and k != "lr"}
    print(f"itde train ({source}): step {summary['step']}, {json.dumps(shown)}")
    print(f"wrote {summary['out']}/metrics.jsonl, loss_curve.png and checkpoint.json "
          f"({summary['wall_s']:.1f} s)")  # fmt: skip
    return 0


def _restore(directory):
    """The run, model and sidecar of a checkpoint, for evaluation and sampling: the task is
    rebuilt from the checkpoint (no data file is read)."""
    from ..train import TASKS, Run, TrainExperiment, from_dict, read_checkpoint_meta

    meta = read_checkpoint_meta(directory)
    cfg = from_dict(TrainExperiment, meta["config"], f"{directory}/checkpoint.json")
    task = TASKS[cfg.task.name].from_checkpoint(cfg.task, meta.get("task", {}))
    run = Run(cfg, task=task)
    model, _, meta = run.restore(directory, meta)
    return run, model, meta


def cmd_eval(args) -> int:
    from ..train import evaluate, with_depth

    if args.size is not None and args.size < 1:
        raise ValueError(
            f"`--size`={args.size} must be a positive number of held-out examples (default: "
            "the checkpoint's [task] eval_size)"
        )
    run, model, meta = _restore(args.checkpoint)
    model = with_depth(model, args.solver, args.dt, name="--dt")
    task = run.task if args.grid is None else run.task.on_grid(args.grid, name="--grid")
    chunks = run.eval_chunks(args.size, task)
    metrics = evaluate(model, chunks, task, run.compute_dtype)
    row = {"step": meta["step"], "scheme": model.scheme, "dt": model.dt,
           "examples": sum(c[0].shape[0] for c in chunks), **metrics}  # fmt: skip
    if task.grid_size is not None:
        row["grid"] = task.grid_size
    print(json.dumps(row))
    return 0


def cmd_sample(args) -> int:
    """Print the prompt, then the generated characters chunk by chunk as they are drawn
    (flushed), so a long run shows progress and Ctrl-C keeps what was printed."""
    from .. import train as tr
    from .._config import SEED_MAX

    if not 0 <= args.seed <= SEED_MAX:
        raise ValueError(f"`--seed`={args.seed} must be an integer in [0, {SEED_MAX}]")
    if args.length < 0:
        raise ValueError(f"`--length`={args.length} must be a non-negative number of characters")
    run, model, meta = _restore(args.checkpoint)
    if not run.task.can_sample:
        raise ValueError(
            f"`itde sample` needs a checkpoint of a text task (charlm); {args.checkpoint!r} "
            f"was trained on task {run.task.name!r}."
        )
    stream = tr.sample_stream(model, run.task.itos, args.prompt, args.length,
                              temperature=args.temperature, seed=args.seed)  # fmt: skip
    written = 0
    try:
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
        print(f"itde sample: interrupted after {written} characters", file=sys.stderr)
        return 130
    sys.stdout.write("\n")
    return 0


def add_train_commands(sub) -> None:
    """Add `train`, `eval` and `sample` to the `itde` sub-parsers `sub`."""
    p = sub.add_parser(
        "train", help="train a model (sort, burgers, charlm) through the depth solve"
    )
    p.add_argument(
        "--config", help="TOML file (default: the built-in sort task = configs/sort.toml)"
    )
    p.add_argument("--out", help="output directory (default: [run].out, or --resume's)")
    p.add_argument("--resume", metavar="DIR", help="continue exactly from the checkpoint in DIR")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--overwrite", action="store_true", help="start afresh in an --out that has a checkpoint"
    )
    p.set_defaults(func=_guard(cmd_train))
    p = sub.add_parser("eval", help="evaluate a checkpoint, optionally with another depth "
                       "scheme / step or (burgers) token grid")  # fmt: skip
    p.add_argument("--checkpoint", required=True, metavar="DIR")
    p.add_argument("--dt", type=float, help="depth step, 0 < dt <= one layer ('lie') or the "
                   "depth (default: the training one)")  # fmt: skip
    p.add_argument("--solver", help="depth scheme: 'lie' (per-layer models) or a continuous "
                   "one, e.g. rk4, heun, strang (the schemes of `itde converge`)")  # fmt: skip
    p.add_argument("--grid", type=int, help="burgers: grid points N of the token domain")
    p.add_argument("--size", type=int, help="held-out examples, > 0, rounded up to whole "
                   "batches (default [task].eval_size)")  # fmt: skip
    p.set_defaults(func=_guard(cmd_eval))
    p = sub.add_parser("sample", help="generate text from a charlm checkpoint")
    p.add_argument("--checkpoint", required=True, metavar="DIR")
    p.add_argument("--prompt", default="", help="text to continue (characters of the corpus)")
    p.add_argument("--length", type=int, default=200, help="characters to generate (printed "
                   "as they are drawn)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=1.0, help=">= 0; 0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed in [0, 2**32 - 1]")
    p.set_defaults(func=_guard(cmd_sample))


def _guard(fn):
    """Report user-fixable errors as one line on stderr with exit status 2."""

    def wrapped(args) -> int:
        from ..train import CheckpointError

        try:
            return fn(args)
        except ConfigError:
            raise  # `itde`'s main prints it ("config error: ...") and returns 2
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            print(f"itde {args.command}: error: {e}", file=sys.stderr)
            return 2

    return wrapped
