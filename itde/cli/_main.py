"""The `itde` command line: experiments configured by TOML files read at the edge."""

from __future__ import annotations

import argparse
import sys

from .. import _config
from .._io import check_output_dir, write_json


def _out(flag, configured, key):
    """The output directory: `--out` if given (even empty: then an error), else the
    config's; created and checked before any work."""
    if flag is None:
        return check_output_dir(configured, key)
    return check_output_dir(flag, "--out")


def _build_solve(cfg: _config.SolveExperiment):
    import jax

    from .._equation import TransformerIDE
    from .._quadrature._rules import RULES, Grid

    g = cfg.grid
    grid = Grid(
        RULES[g.tokens](interval=g.token_interval),
        RULES[g.features](interval=g.feature_interval),
        cfg.model.n_features,
    )
    m = cfg.model
    return TransformerIDE.init(
        jax.random.key(m.seed),
        n_layers=m.n_layers,
        n_features=m.n_features,
        n_heads=m.n_heads,
        n_hidden=m.n_hidden,
        activation=m.activation,
        eps=m.eps,
        bias=m.bias,
        causal=m.causal,
        ffn_form=m.ffn_form,
        grid=grid,
    )


def cmd_solve(args) -> int:
    import diffrax
    import jax
    import jax.numpy as jnp
    import numpy as np

    from itde_solvers import LieTrotter

    from .._operators._layernorm import feature_mean
    from .._plot import plot_trajectory
    from .._solve import solve

    cfg = (
        _config.load(_config.SolveExperiment, args.config)
        if args.config
        else _config.SolveExperiment()
    )
    source = args.config or "<built-in default>"
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
    fw = model._feature_weights()
    norms = np.sqrt(np.asarray(feature_mean(jnp.asarray(ys) ** 2, fw)))[
        ..., 0
    ]  # [layers+1, tokens]
    rows = []
    print(
        f"itde solve: {model.n_layers} layers, {cfg.solve.n_tokens} tokens x "
        f"{model.n_features} features, dt={cfg.solve.dt} ({source})"
    )
    print(f"{'layer':>5} {'t':>6} {'token-mean norm':>16} {'mean resid':>11} {'var resid':>11}")
    for n in range(model.n_layers + 1):
        if n == 0:
            rm = rv = float("nan")
        else:
            norm = model.controls.layer(n - 1).norm2
            rm, rv = (float(r) for r in norm.residuals(jnp.asarray(ys[n]), fw))
        rows.append(
            {
                "layer": n,
                "t": float(ts[n]),
                "token_mean_norm": float(norms[n].mean()),
                # null for layer 0: the input is on no constraint set (and NaN is not JSON)
                "mean_residual": None if n == 0 else rm,
                "var_residual": None if n == 0 else rv,
            }
        )
        print(f"{n:>5} {float(ts[n]):>6.2f} {norms[n].mean():>16.6f} {rm:>11.2e} {rv:>11.2e}")
    write_json(out / "summary.json", {"config": source, "layers": rows})
    png = plot_trajectory(norms, np.asarray(ts), out / "trajectory.png")
    print(f"wrote {out / 'summary.json'} and {png}")
    return 0


def cmd_converge(args) -> int:
    import dataclasses

    import jax

    jax.config.update("jax_enable_x64", True)
    from ..studies._depth import format_table, run_depth_study, write_outputs
    from ..studies._grid import run_grid_study

    source = args.config or "<built-in default>"
    cfg = (
        _config.load(_config.ConvergeExperiment, args.config)
        if args.config
        else _config.ConvergeExperiment()
    )
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


def main(argv: list[str] | None = None) -> int:
    """Run the `itde` command line on `argv` (default `sys.argv[1:]`); return the exit
    status: 0 on success, 2 for a mistake the user can fix (printed as one line)."""
    parser = argparse.ArgumentParser(prog="itde", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("solve", help="solve the Transformer IDE for a random model and state")
    p.add_argument("--config", help="TOML file (default: the built-in default config)")
    p.add_argument("--out", help="output directory (default: [solve].out of the config)")
    p.set_defaults(func=cmd_solve)
    p = sub.add_parser("converge", help="observed convergence orders of the depth integrators")
    p.add_argument("--config", help="TOML file (default: configs/convergence.toml's values)")
    p.add_argument("--out", help="output directory (default: [study].out of the config)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument(
        "--axis",
        choices=_config.AXES,
        help="what to refine (default: [study].axis of the config, 'depth')",
    )
    p.set_defaults(func=cmd_converge)
    from ._train import add_train_commands

    add_train_commands(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except _config.ConfigError as e:
        print(f"itde: config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as e:
        # an argument the user can fix (each message names it): one line, not a traceback
        print(f"itde: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
