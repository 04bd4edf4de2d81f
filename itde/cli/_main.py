"""The `itde` command line: solve the Transformer read as an integro-differential equation
in depth, measure the convergence of its integrators, and train, evaluate and sample models.

Nothing here imports JAX until a command runs, so `itde --help` answers at once."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from .._internal import _config, check_output_dir, write_json
from ..studies._internal import AXES, ConvergeExperiment, StudyConfig
from ._build import _build_solve
from ._help import Parser, add_compilation_cache_options, add_set_option, writes
from ._solve_config import SolveConfig, SolveExperiment


def _out(flag, configured, key):
    """The output directory: `--out` if given (even empty: then an error), else the
    config's; created and checked before any work."""
    if flag is None:
        return check_output_dir(configured, key)
    return check_output_dir(flag, "--out")


def cmd_solve(args) -> int:
    import diffrax
    import jax
    import jax.numpy as jnp
    import numpy as np

    from itde_solvers import LieTrotter

    from .. import solve
    from .._internal import feature_mean, plot_trajectory

    cfg, source = _config.experiment(SolveExperiment, args.config, args.set)
    if args.dt is not None:  # the flag overrides [solve] dt, checked as the config checks it
        import dataclasses

        try:
            cfg = dataclasses.replace(cfg, solve=dataclasses.replace(cfg.solve, dt=args.dt))
        except _config.ConfigError as e:
            raise ValueError(str(e).replace("`solve.dt`", "`--dt`")) from None
    try:
        model = _build_solve(cfg)
    except ValueError as e:
        raise _config.ConfigError(f"{source}: {e}") from None
    out = _out(args.out, cfg.solve.out, "solve.out")
    u0 = jax.random.normal(jax.random.key(cfg.solve.seed), (cfg.solve.n_tokens, model.n_features))
    ts = np.asarray(model.controls.layer_times())
    run = jax.jit(
        lambda m, u: (
            solve(m, u, solver=LieTrotter(), dt0=cfg.solve.dt, saveat=diffrax.SaveAt(ts=ts)).ys
        )
    )
    ys = np.asarray(run(model, u0))
    fw = model.feature_weights()
    rms = lambda u: np.sqrt(np.asarray(feature_mean(jnp.asarray(u) ** 2, fw)))[..., 0]  # noqa: E731
    norms = rms(ys)  # [layers + 1, tokens]
    change = rms(ys[1:] - ys[:-1]) / norms[:-1]  # [layers, tokens]: what each layer moves
    rows = []
    print(
        f"itde solve: {model.n_layers} layers, {cfg.solve.n_tokens} tokens x "
        f"{model.n_features} features, dt={cfg.solve.dt} ({source})"
    )
    names = list(model.controls.layer(0).norm2.residuals(jnp.asarray(ys[1]), fw))
    print(f"{'layer':>5} {'t':>6} {'token-mean norm':>16} {'change':>9} "
          + " ".join(f"{k + ' resid':>11}" for k in names))  # fmt: skip
    for n in range(model.n_layers + 1):
        if n == 0:  # the input is on no constraint set and no layer has moved it yet
            res, dn = dict.fromkeys(names), None
            cells = f"{'-':>9} " + " ".join(f"{'-':>11}" for _ in names)
        else:
            norm = model.controls.layer(n - 1).norm2
            res = {k: float(r) for k, r in norm.residuals(jnp.asarray(ys[n]), fw).items()}
            dn = float(change[n - 1].mean())
            cells = f"{dn:>9.4f} " + " ".join(f"{r:>11.2e}" for r in res.values())
        rows.append(
            {
                "layer": n,
                "t": float(ts[n]),
                "token_mean_norm": float(norms[n].mean()),
                # null for layer 0 (NaN is not JSON)
                "token_mean_change": dn,
                **{f"{k}_residual": r for k, r in res.items()},
            }
        )
        print(f"{n:>5} {float(ts[n]):>6.2f} {norms[n].mean():>16.6f} {cells}")
    write_json(out / "summary.json", {"config": source, "dt": cfg.solve.dt, "layers": rows})
    residuals = np.asarray([[r["mean_residual"], r["var_residual"]] for r in rows[1:]])
    layers = np.arange(1, model.n_layers + 1)
    png = plot_trajectory(change, residuals, layers, out / "trajectory.png", dtype=ys.dtype)
    print(f"wrote {out / 'summary.json'}, {png}")
    return 0


def cmd_converge(args) -> int:
    import dataclasses

    if args.checkpoint is not None or args.hf is not None:
        if args.checkpoint is not None and args.hf is not None:
            raise ValueError("give one model to study: `--checkpoint DIR` or `--hf DIR`.")
        if args.config is not None or args.axis is not None or args.set:
            raise ValueError(
                "`--config`/`--axis`/`--set` set up the built-in test problem; a model study "
                "(`--checkpoint` / `--hf`) takes `--steps` (or `--full`), `--inputs` and "
                "`--text` instead."
            )
        from ._model_study import cmd_model_study

        return cmd_model_study(args)
    if args.steps is not None or args.text is not None or args.full:
        raise ValueError(
            "`--steps`/`--text`/`--full` are options of a model study; give `--checkpoint DIR` or "
            "`--hf DIR` (the built-in problem takes its steps from [study] steps)."
        )
    import jax

    jax.config.update("jax_enable_x64", True)
    from ..studies import format_table, run_depth_study, run_grid_study, write_outputs

    cfg, source = _config.experiment(ConvergeExperiment, args.config, args.set)
    if args.axis:
        cfg = dataclasses.replace(cfg, study=dataclasses.replace(cfg.study, axis=args.axis))
    out = _out(args.out, cfg.study.out, "study.out")
    axis = cfg.study.axis
    p = cfg.problem
    if axis == "depth":
        result = run_depth_study(cfg, progress=not args.no_progress)
        ref = result["reference"]
        print(
            f"itde converge ({source}): axis=depth, {p.n_tokens} tokens x {p.n_features} "
            f"features, {p.n_heads} heads, activation={p.activation}, T={p.t1}; reference: "
            f"{ref['solver']}, rtol={cfg.reference.rtol}, {ref['steps']} steps"
        )
    else:
        result = run_grid_study(cfg, axis, progress=not args.no_progress)
        print(
            f"itde converge ({source}): axis={axis}, function kernels ({cfg.study.modes} "
            f"modes), {p.n_heads} heads, activation={p.activation}; error of "
            f"J = int g u(T) against Gauss-Legendre with {cfg.study.reference_nodes} nodes"
        )
    print(format_table(result))
    if p.activation == "relu":
        print(
            "note: ReLU's kink makes the vector field only Lipschitz, so observed orders of "
            "higher-order schemes fall below their smooth-problem values (compare with "
            "activation = 'gelu')."
        )
    js, png = write_outputs(result, out)
    print(f"wrote {js} and {png} ({result['wall_s']:.1f} s)")
    return 0


def _default(cls, field: str):
    """The built-in default of a config field (read without building the config)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}[field]


DESCRIPTION = """\
Solve the Transformer read as an integro-differential equation in depth (layers are
depth-time, attention a quadrature in the tokens, LayerNorm a projection), measure how
its depth integrators converge, and train, evaluate and sample models of it.

Every command is configured by an optional TOML file (`--config`, the files in
configs/), whose keys `--set KEY=VALUE` overrides (e.g. --set optim.steps=150); a
mistake a user can fix is one line on stderr, `itde COMMAND: error: ...`, and exit
status 2.
Run `itde COMMAND --help` for a command's options and the files it writes."""


def _add_solve(sub) -> None:
    out = _default(SolveConfig, "out")
    p = sub.add_parser(
        "solve",
        help="solve the equation for a random model and state; per-layer summaries",
        description=(
            "Build a random post-LN Transformer read as the equation (from the [model] and\n"
            "[grid] tables), solve it in depth from a random state with the paper's Lie\n"
            "splitting (step [solve] dt), and print per layer the token-mean feature norm,\n"
            "how far the layer moved the tokens (relative change) and the distance of the\n"
            "state from the LayerNorm constraint set."
        ),
        epilog=writes(
            ("summary.json", "the per-layer rows printed, and the config's name"),
            ("trajectory.png", "each token's change per layer; distance from the set"),
        ),
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML file with [model], [grid] and [solve] tables (default: the built-in "
        "values, those of configs/solve.toml)",
    )
    p.add_argument("--out", metavar="DIR", help="output directory, created if missing "
                   f"(default: [solve] out of the config, {out!r})")  # fmt: skip
    p.add_argument("--dt", type=float, metavar="H",
                   help="the depth step, 0 < H <= 1 (default: [solve] dt of the config; "
                   "1 = one post-LN block per layer)")  # fmt: skip
    add_set_option(p, "model.n_layers=2")
    p.set_defaults(func=cmd_solve)


def _add_converge(sub) -> None:
    out = _default(StudyConfig, "out")
    axis = _default(StudyConfig, "axis")
    p = sub.add_parser(
        "converge",
        help="observed convergence orders of the depth integrators or quadrature rules",
        description=(
            "Measure observed orders of convergence (the slope of log error against log\n"
            "step) in float64. --axis depth: every depth integrator of [study] schemes at\n"
            "[study] steps against a projected Dopri8 reference, on a smooth problem.\n"
            "--axis tokens / features: a model whose kernels are functions on refining\n"
            "token / feature grids, one row per quadrature rule; --axis all refines the\n"
            "depth step, tokens and features together (steps = nodes / 4).\n"
            "--checkpoint DIR (a training run) or --hf DIR (a Hugging Face model directory,\n"
            "read offline): refine the depth of that model, in its continuum form, from its\n"
            "own inputs, and measure the network's distance to its continuum limit."
        ),
        epilog=writes(
            ("convergence.json", "--axis depth: errors, steps, observed orders, the problem"),
            ("convergence_depth.png", "--axis depth: error against depth step, log-log"),
            ("convergence_AXIS.json", "other axes: errors, node counts, observed orders"),
            ("convergence_AXIS.png", "other axes: error against the number of nodes"),
            ("convergence_model.json", "--checkpoint/--hf: errors, orders, the distance"),
            ("convergence_model.png", "--checkpoint/--hf: error against depth step"),
        ),
    )
    p.add_argument("--config", metavar="FILE", help="TOML file with [problem], [reference] "
                   "and [study] tables (default: the built-in values, those of "
                   "configs/convergence.toml)")  # fmt: skip
    p.add_argument("--out", metavar="DIR", help="output directory, created if missing "
                   f"(default: [study] out of the config, {out!r})")  # fmt: skip
    p.add_argument("--axis", choices=AXES, metavar="AXIS", help="what to refine: "
                   f"%(choices)s (default: [study] axis of the config, {axis!r})")  # fmt: skip
    p.add_argument("--checkpoint", metavar="DIR", help="study the depth of the model of this "
                   "training checkpoint (from `itde train`), on its held-out inputs (default: "
                   "none, the built-in problem)")
    p.add_argument("--hf", metavar="DIR", help="study the depth of the Hugging Face model in "
                   "this local directory (config.json, weights, tokenizer; nothing is "
                   "downloaded) (default: none, the built-in problem)")
    p.add_argument("--text", metavar="FILE", help="--hf: the inputs, one a line (default: "
                   "sentences of the built-in text)")
    p.add_argument("--inputs", type=int, metavar="N", help="--checkpoint/--hf: "
                   "how many inputs (default 4; 8 with --full)")
    p.add_argument("--steps", type=int, nargs="+", metavar="N", help="--checkpoint/--hf: "
                   "steps per layer (default 1 2 4 8 16, its Dopri8 reference at 32 steps per "
                   "layer: minutes on a CPU for MiniLM; the orders come with a verdict, "
                   "pre-asymptotic where the slope still moves)")
    p.add_argument("--full", action="store_true", help="--checkpoint/--hf: the full study, "
                   "--steps 1 2 4 8 16 32 on 8 inputs, its Dopri8 reference at 128 steps per "
                   "layer (about 7x the default's solver work)")
    add_set_option(p, "'study.steps=[4, 8, 16]'")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar and "
                   "the stage lines")
    p.set_defaults(func=cmd_converge)


def build_parser() -> argparse.ArgumentParser:
    """The `itde` argument parser (building it imports no JAX)."""
    parser = Parser(prog="itde", description=DESCRIPTION)
    from .. import __version__

    parser.add_argument("--version", action="version", version=f"itde {__version__}")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", title="commands",
        parser_class=Parser,
    )  # fmt: skip
    _add_solve(sub)
    _add_converge(sub)
    from ._analyze import add_analyze

    add_analyze(sub)
    from ._train import add_train_commands

    add_train_commands(sub)
    for command in sub.choices.values():  # every command compiles: each takes the cache's options
        add_compilation_cache_options(command)
    return parser


def _compilation_cache(args):
    """The directory of JAX's persistent compilation cache for this command, checked, or
    None (off): `--no-compilation-cache`, `--compilation-cache DIR`, the environment
    variable, else the per-user default. A default that cannot be used is a note on stderr
    and the command runs without the cache; a directory the user named is an error."""
    from .._internal import _compilation_cache as cc

    if args.no_compilation_cache:
        return None
    try:
        return cc.resolve(args.compilation_cache, "`--compilation-cache`")
    except ValueError as e:
        if args.compilation_cache is not None or cc.VARIABLE in os.environ:
            raise
        print(f"itde {args.command}: note: running without the compilation cache: {e}",
              file=sys.stderr)  # fmt: skip
        return None


def _missing_package(e: ModuleNotFoundError) -> str:
    """The line for a package that is not installed: itde's own message (it names the
    package and the install command), or Python's "No module named 'x'" with where to
    find the extra that brings it."""
    text = str(e)
    if text.startswith("No module named") or "halted; None in sys.modules" in text:
        text += (f" (`{e.name}` is not installed: the README's Install section lists the "
                 "extra of each feature, e.g. pip install 'itde[hf]')")  # fmt: skip
    return text


def main(argv: list[str] | None = None) -> int:
    """Run the `itde` command line on `argv` (default `sys.argv[1:]`); return the exit
    status: 0 on success, 2 for a mistake the user can fix (a missing optional package
    included), 130 when interrupted.

    Every mistake is one line with one prefix, `itde COMMAND: error: ...`, whether argparse
    finds it (then above the command's usage), the config (a `ConfigError`: a key of the
    file or of `--set`), the run (an argument the message names) or the environment (a
    package the command needs, e.g. `tokenizers` for `tokenizer = "bpe"`, not installed)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prefix = f"itde {args.command}: error:"
    try:
        from .._internal import session

        with session(_compilation_cache(args)):
            return args.func(args)
    except (ValueError, TypeError, OSError) as e:
        # a config key or an argument the user can fix (each message names it, a
        # ConfigError is a ValueError): one line, not a traceback
        print(f"{prefix} {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name is None or e.name.partition(".")[0] in ("itde", "itde_solvers"):
            raise  # a module of itde itself is missing: a broken install, the traceback says where
        print(f"{prefix} {_missing_package(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C anywhere (loading, compiling, a run): one line and the shell's status 130,
        # not a traceback through JAX's compiler
        print(f"\n{prefix} interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
