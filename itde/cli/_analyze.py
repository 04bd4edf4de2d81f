"""`itde analyze`: every quantity of `itde.analysis` against depth, for a training
checkpoint, a Hugging Face model directory or a random model of a solve config (see
`itde.analysis.analyze`)."""

from __future__ import annotations

import sys

from .._internal import _config, check_output_dir, write_json
from ._help import add_set_option, writes
from ._solve_config import SolveExperiment

#: Where `itde analyze` writes when `--out` is not given.
DEFAULT_OUT = "runs/analyze"


def _positive(value: int, flag: str, what: str) -> None:
    if value < 1:
        raise ValueError(f"`{flag}`={value} must be a positive {what}.")


def _config_problem(path: str | None, n: int, overrides=()):
    """A random model of a solve config (default: the built-in one, with `--set`
    `overrides`) and `n` random states."""
    import jax

    from ._build import _build_solve

    cfg, source = _config.experiment(SolveExperiment, path, overrides)
    try:
        model = _build_solve(cfg)
    except ValueError as e:
        raise _config.ConfigError(f"{source}: {e}") from None
    key = jax.random.key(cfg.solve.seed)
    u0 = jax.random.normal(key, (n, cfg.solve.n_tokens, model.n_features))
    m = cfg.model
    name = (f"random post-LN model of {source}: {m.n_layers} layers, {m.n_features} features, "
            f"{m.n_heads} heads")  # fmt: skip
    return model, u0, None, ("lie", cfg.solve.dt), name


def _solver(model, scheme: str, dt: float, dt_flag: str):
    """The depth integrator of a scheme name (checked against the model's controls)."""
    from .._internal import scheme as scheme_named
    from ..analysis._internal import equation_of

    return scheme_named(scheme).solve_options(dt, equation_of(model).controls, name=dt_flag)


def _check_iteration_flags(args) -> None:
    """`--max-iters`, `--rtol`, `--block-size`: checked before any model is read."""
    if args.max_iters < 1:
        raise ValueError(
            f"`--max-iters`={args.max_iters} must be a positive number of iterations, e.g. 100."
        )
    if args.rtol is not None and not 1e-15 <= args.rtol < 1:
        raise ValueError(
            f"`--rtol`={args.rtol:g} must be in [1e-15, 1) (a relative residual, in float64), "
            "e.g. 1e-6 (the default) or 1e-3 for a quicker, rougher estimate."
        )
    if args.block_size is not None and args.block_size < 1:
        raise ValueError(
            f"`--block-size`={args.block_size} must be a positive number of vectors (at most "
            "the model's features), e.g. 4."
        )


def cmd_analyze(args) -> int:
    import jax

    sources = [f for f in ("checkpoint", "hf", "config") if getattr(args, f) is not None]
    if len(sources) > 1:
        raise ValueError(
            f"give one model to analyze, got {' and '.join('--' + s for s in sources)}: "
            "`--checkpoint DIR`, `--hf DIR` or `--config FILE` (default: the built-in config)."
        )
    _positive(args.inputs, "--inputs", "number of inputs")
    if args.depths is not None:
        _positive(args.depths, "--depths", "number of depth intervals")
    if not args.tol > 0:
        raise ValueError(f"`--tol`={args.tol} must be a positive cluster tolerance, e.g. 1e-3.")
    if args.set and len(sources) == 1 and sources[0] != "config":
        raise ValueError(
            f"`--set` overrides keys of a solve config (`--config FILE` or the built-in one); "
            f"a --{sources[0]} model has none: drop `--set {args.set[0]}`."
        )
    if args.exponent != "exact" and args.no_lyapunov:
        raise ValueError(
            f"`--exponent {args.exponent}` chooses the token exponents, which --no-lyapunov "
            "skips; drop one of the two."
        )
    _check_iteration_flags(args)
    if args.text is not None and args.hf is None:
        raise ValueError("`--text` gives the inputs of a --hf model; add `--hf DIR` or drop it.")
    from ..analysis._internal import as_token_exponent

    exponent = as_token_exponent(args.exponent, "--exponent")
    out = check_output_dir(args.out if args.out is not None else DEFAULT_OUT, "--out")
    jax.config.update("jax_enable_x64", True)  # sensitivities and small eigenvalues: float64
    if args.checkpoint is not None:
        from ._model_study import _checkpoint_problem

        eq, u0, mask, _, network, name = _checkpoint_problem(args.checkpoint, args.inputs)
        model, source = eq, args.checkpoint
    elif args.hf is not None:
        from ._model_study import _hf_problem

        model, u0, mask, _, network, name = _hf_problem(
            args.hf, args.text, args.inputs, continuum=False
        )
        source = args.hf
    else:
        model, u0, mask, network, name = _config_problem(args.config, args.inputs, args.set)
        source = _config.described(args.config or "<built-in default>", args.set)
    scheme = network[0] if args.scheme is None else args.scheme
    dt = network[1] if args.dt is None else args.dt
    if dt is None:  # one step per layer, or per depth interval
        from ..analysis import report_depths

        ts = report_depths(model, args.depths)
        dt = float(ts[1] - ts[0])
    fixed = _solver(model, scheme, dt, "--dt")
    from ..analysis import analyze, plot_report

    report = analyze(model, u0, mask, depths=args.depths, tol=args.tol,
                     lyapunov=not args.no_lyapunov, token_exponent=exponent,
                     max_iters=args.max_iters, rtol=args.rtol, block_size=args.block_size,
                     progress=not args.no_progress, **fixed)  # fmt: skip
    report["source"] = {"path": str(source), "model": name, "scheme": scheme, "dt": dt}
    print(f"itde analyze ({source}): {name}; depth integrator {scheme}, dt={dt:g}; "
          f"{report['inputs']} inputs of {report['tokens']} tokens")  # fmt: skip
    print(format_report(report))
    js = write_json(out / "analysis.json", report)
    png = plot_report(report, out / "analysis.png", title=f"{name} ({scheme}, dt={dt:g})")
    print(f"wrote {js} and {png} ({report['wall_s']:.1f} s)")
    sys.stdout.flush()
    return 0


def _fmt(v, spec: str) -> str:
    """`v` formatted by `spec` (e.g. `"9.3f"`), or a dash right-aligned to its width."""
    width = int(spec.split(".")[0] or 0)
    return f"{'-':>{width}}" if v is None else format(v, spec)


def format_report(report: dict) -> str:
    """The report as a table: one row per saved depth (the geometry means over inputs and
    heads) and, on the row where an interval starts, its spectra and leading exponent."""
    import numpy as np

    g, sp = report["geometry"], report["spectra"]
    lyap = report.get("lyapunov")
    head = (f"{'t':>7} {'eff.rank':>9} {'mean cos':>9} {'min cos':>9} {'clusters':>8} "
            f"{'entropy':>8} {'max|eig QK|':>11} {'||VO||':>8} {'lambda_1':>9}")  # fmt: skip
    lines = [head]
    ent = g["attention_entropy"]
    for i, t in enumerate(report["depths"]):
        e = None if ent is None else float(np.nanmean(np.asarray(ent[i], dtype=float)))
        if i < len(sp["depths"]):
            qk = float(np.nanmean(np.asarray(sp["qk_max_abs_eigenvalue"][i], dtype=float)))
            vo = float(np.nanmean(np.asarray(sp["vo_spectral_norm"][i], dtype=float)))
        else:
            qk = vo = None
        lam = lyap["leading_exponent"][i] if lyap and i < len(lyap["leading_exponent"]) else None
        lines.append(
            f"{t:>7.3g} {_fmt(g['effective_rank'][i], '9.3f')} "
            f"{_fmt(g['mean_cosine'][i], '9.4f')} {_fmt(g['min_cosine'][i], '9.4f')} "
            f"{_fmt(g['n_clusters'][i], '8.1f')} {_fmt(e, '8.3f')} {_fmt(qk, '11.4g')} "
            f"{_fmt(vo, '8.4g')} {_fmt(lam, '9.4f')}"
        )
    if lyap and not lyap["all_converged"]:
        short = [f"[{s:g}, {t:g}] (residual {_fmt(r, '.2g')})" for (s, t), r, ok in
                 zip(lyap["intervals"], lyap["residual"], lyap["converged"], strict=True)
                 if not ok]  # fmt: skip
        w = lyap["whole_depth"]
        if not w["converged"]:
            short.append(f"whole depth (residual {_fmt(w['residual'], '.2g')})")
        if not lyap["token_converged"]:
            short.append("token exponents")
        lines.append(
            "not converged within --max-iters (estimates shown; converged: false in the "
            "JSON): " + ", ".join(short) + "; raise --max-iters or --block-size, or loosen --rtol"
        )
    if lyap:
        w = lyap["whole_depth"]
        tok = np.asarray([v for v in lyap["token_exponents"] if v is not None], dtype=float)
        lines.append(
            f"whole depth [{w['interval'][0]:g}, {w['interval'][1]:g}]: leading exponent "
            f"{_fmt(w['leading_exponent'], '.4f')}; token exponents ({lyap['token_exponent']}, "
            f"first input, towards {lyap['token_target']}) mean "
            f"{tok.mean():.4f}, min {tok.min():.4f}, max {tok.max():.4f}"
        )
    return "\n".join(lines)


def add_analyze(sub) -> None:
    """Add the `analyze` sub-command to the `itde` parser."""
    p = sub.add_parser(
        "analyze",
        help="every analysis quantity against depth: geometry, spectra, Lyapunov exponents",
        description=(
            "Solve a model in depth from a few inputs and measure, at every layer boundary\n"
            "(or depth interval of smooth controls): the token geometry (effective rank,\n"
            "mean and minimum cosine, clusters, attention entropy per head, the constraint\n"
            "residuals), the spectra of the attention's W^Q W^K^T and W^V W^O per head and\n"
            "of the feed-forward, and the leading finite-time Lyapunov exponent of the flow\n"
            "over each interval and the whole depth, with every token's exponent (the exact\n"
            "one, or Tong et al.'s with --exponent tong). In\n"
            "float64. The model: --checkpoint DIR (a training run, on its held-out inputs),\n"
            "--hf DIR (a Hugging Face model directory, read offline; the network itself, not\n"
            "its continuum form) or --config FILE (a random model of a solve config;\n"
            "default: the built-in one, on random states)."
        ),
        epilog=writes(
            ("analysis.json", "every quantity against depth (see itde.analysis.analyze)"),
            ("analysis.png", "one panel per quantity, depth on the x-axis, layers marked"),
        ),
    )
    p.add_argument("--checkpoint", metavar="DIR", help="analyze the model of this training "
                   "checkpoint (from `itde train`) (default: none)")  # fmt: skip
    p.add_argument("--hf", metavar="DIR", help="analyze the Hugging Face model in this "
                   "local directory (config.json, weights, tokenizer; nothing is "
                   "downloaded) (default: none)")  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="a TOML solve config ([model], [grid], "
                   "[solve]) whose random model to analyze (default: the built-in values, "
                   "those of configs/solve.toml)")  # fmt: skip
    add_set_option(p, "model.n_layers=2")
    p.add_argument("--text", metavar="FILE", help="--hf: the inputs, one a line (default: "
                   "sentences of the built-in text)")  # fmt: skip
    p.add_argument("--inputs", type=int, default=4, metavar="N", help="how many inputs "
                   "(default %(default)s; the exponents use the first)")  # fmt: skip
    p.add_argument("--depths", type=int, metavar="N", help="smooth controls: the number of "
                   "equal depth intervals (default 8; a network's are its layers)")  # fmt: skip
    p.add_argument("--scheme", metavar="NAME", help="the depth integrator, a name of "
                   "itde.SCHEMES (default: the model's own; 'lie' for a network)")  # fmt: skip
    p.add_argument("--dt", type=float, metavar="H", help="the depth step (default: the "
                   "model's own; one step per layer for a network)")  # fmt: skip
    p.add_argument("--tol", type=float, default=1e-3, metavar="TOL", help="the cluster "
                   "tolerance: tokens closer than this in 1 - cosine share a cluster "
                   "(default %(default)s)")  # fmt: skip
    p.add_argument("--exponent", default="exact", metavar="NAME", help="the definition of "
                   "the token exponents, a name of itde.analysis.TOKEN_EXPONENTS: 'exact' (the "
                   "blocks of the flow's Jacobian) or 'tong' (Tong et al.'s QR iteration over "
                   "I + dt J of each layer's vector field, the identity on every block) "
                   "(default %(default)s)")  # fmt: skip
    p.add_argument("--max-iters", type=int, default=100, metavar="N", help="the exponents' "
                   "block iterations stop after N iterations; an estimate short of --rtol is "
                   "reported with its residual and converged: false "
                   "(default %(default)s)")  # fmt: skip
    p.add_argument("--rtol", type=float, metavar="TOL", help="the exponents' relative "
                   "residual tolerance (default: 1e-6, in float64)")  # fmt: skip
    p.add_argument("--block-size", type=int, metavar="P", help="the exponents' block of "
                   "vectors, at most the features (default: 4)")  # fmt: skip
    p.add_argument("--no-lyapunov", action="store_true", help="skip the Lyapunov exponents "
                   "(the costly part: one power iteration per interval)")  # fmt: skip
    p.add_argument("--no-progress", action="store_true", help="write no progress lines (by "
                   "default a line per stage on stderr, and before the exponents' long work "
                   "the time the whole run is expected to take)")  # fmt: skip
    p.add_argument("--out", metavar="DIR", help="output directory, created if missing "
                   f"(default: {DEFAULT_OUT!r})")  # fmt: skip
    p.set_defaults(func=cmd_analyze)
