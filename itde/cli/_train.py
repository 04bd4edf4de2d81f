"""The `itde train`, `itde eval` and `itde sample` commands.

Hook into `itde/_cli.py`'s `main` with `add_train_commands(sub)` after the other
sub-parsers. Errors a user can fix (a bad config, a bad checkpoint, a bad data file, a
batch size the devices do not divide) are printed as one line and exit with status 2.
"""

from __future__ import annotations

import json
import sys

from ..train._config import ConfigError


def _load_config(path):
    from ..train._config import TrainExperiment, load

    if path is None:
        return None, "<built-in default>"
    return load(TrainExperiment, path), str(path)


def cmd_train(args) -> int:
    from ..train._config import TrainExperiment
    from ..train._loop import train

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
    from ..train._checkpoint import read_meta
    from ..train._config import TrainExperiment, from_dict
    from ..train._loop import Run

    meta = read_meta(directory)
    cfg = from_dict(TrainExperiment, meta["config"], f"{directory}/checkpoint.json")
    run = Run(cfg)
    model, _, meta = run.restore(directory, meta)
    return run, model, meta


def cmd_eval(args) -> int:
    from ..train._data import TaskData, evaluate
    from ..train._model import with_depth

    run, model, meta = _restore(args.checkpoint)
    cfg = run.cfg
    model = with_depth(model, args.solver, args.dt)
    data = run.data
    if args.grid is not None:
        if cfg.task.name != "burgers":
            raise ValueError("`--grid` applies to the burgers task (the token grid on [0, 2π)).")
        data = TaskData(cfg.task, n_grid=args.grid)
    chunks = run.eval_chunks(args.size, data)
    metrics = evaluate(model, chunks, cfg.task.name, run.compute_dtype)
    n_grid = args.grid or (cfg.task.n_grid if cfg.task.name == "burgers" else None)
    row = {"step": meta["step"], "scheme": model.scheme, "dt": model.dt,
           "examples": sum(c[0].shape[0] for c in chunks), **metrics}  # fmt: skip
    if n_grid is not None:
        row["grid"] = n_grid
    print(json.dumps(row))
    return 0


def cmd_sample(args) -> int:
    from ..train._sample import sample

    run, model, meta = _restore(args.checkpoint)
    if run.cfg.task.name != "charlm":
        raise ValueError(
            f"`itde sample` needs a charlm checkpoint; {args.checkpoint!r} was trained on "
            f"task {run.cfg.task.name!r}."
        )
    text = sample(model, meta["task"]["itos"], args.prompt, args.length,
                  temperature=args.temperature, seed=args.seed)  # fmt: skip
    print(text)
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
    p.add_argument("--dt", type=float, help="depth step (default: the training one)")
    p.add_argument("--solver", help="depth scheme: 'lie' or a name of itde._registry.SCHEMES")
    p.add_argument("--grid", type=int, help="burgers: grid points N of the token domain")
    p.add_argument("--size", type=int, help="held-out examples (default [task].eval_size)")
    p.set_defaults(func=_guard(cmd_eval))
    p = sub.add_parser("sample", help="generate text from a charlm checkpoint")
    p.add_argument("--checkpoint", required=True, metavar="DIR")
    p.add_argument("--prompt", default="", help="text to continue (characters of the corpus)")
    p.add_argument("--length", type=int, default=200, help="characters to generate")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_guard(cmd_sample))


def _guard(fn):
    """Report user-fixable errors as one line on stderr with exit status 2."""

    def wrapped(args) -> int:
        from ..train._checkpoint import CheckpointError

        try:
            return fn(args)
        except ConfigError:
            raise  # `itde`'s main prints it ("config error: ...") and returns 2
        except (CheckpointError, FileNotFoundError, ValueError) as e:
            print(f"itde {args.command}: error: {e}", file=sys.stderr)
            return 2

    return wrapped


def main(argv: list[str] | None = None) -> int:
    """A stand-alone entry point with only the training commands (for tests and scripts)."""
    import argparse

    parser = argparse.ArgumentParser(prog="itde")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_commands(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"itde: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
