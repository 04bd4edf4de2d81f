r"""Every quantity of `itde.analysis` against depth for one model and a batch of inputs, as
plain numbers: what `itde analyze` writes (a JSON) and draws (one panel per quantity).

[`analyze`][itde.analysis.analyze] solves the model from each input with the depth
integrator given (default: the discrete network, the paper's Lie scheme at one step per
layer), saves the state at every depth of the report, and evaluates

- the token geometry at each saved depth ([`geometry_along`][itde.analysis.geometry_along]),
  averaged over the inputs;
- the spectra of the operators the equation applies there ([`spectra`][itde.analysis.spectra]);
- the leading finite-time Lyapunov exponent of the flow over each interval between two
  consecutive depths (per layer, for a network), and of the whole depth, with the
  token-level exponents ([`lyapunov_spectrum`][itde.analysis.lyapunov_spectrum],
  [`token_lyapunov_exponents`][itde.analysis.token_lyapunov_exponents], by the exact
  definition or Tong et al.'s) of the first input.
"""

from __future__ import annotations

import math
import time

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._buckets import PowerOfTwoBuckets
from .._checks import check_int
from .._controls import PiecewiseConstant
from .._operators._mask import key_mask
from .._solve import solve
from .._token_padding import has_tracer, run_on_tokens, take_rows
from ._common import equation_of
from ._flow import FlowMap
from ._geometry import geometry_along
from ._sensitivity import lyapunov_spectrum
from ._spectra import leading_spectra
from ._token_exponents import (
    AbstractTokenExponent,
    as_token_exponent,
    token_exponent_name,
    token_lyapunov_exponents,
)

#: The number of depth intervals of a report on a model whose controls are smooth in depth
#: (a network's are its layers).
DEFAULT_INTERVALS = 8


def _floats(x):
    """A JSON-able float or nested list of floats (NaN and infinities become None: JSON
    has neither)."""
    return _clean(np.asarray(x, dtype=np.float64).tolist())


def _clean(v):
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v if math.isfinite(v) else None


def report_depths(model, depths=None) -> np.ndarray:
    r"""The depths of a report: a network's layer boundaries $t_0, \dots, t_L$, or for
    smooth controls `depths` equal intervals of $[t_0, T]$ (an int, default
    `DEFAULT_INTERVALS`) or the given increasing depths (an array) within $[t_0, T]$."""
    eq = equation_of(model)
    t0, t1 = float(eq.t0), float(eq.depth)
    if isinstance(eq.controls, PiecewiseConstant) and depths is None:
        return np.asarray(eq.controls.layer_times(), dtype=np.float64)
    if depths is None:
        depths = DEFAULT_INTERVALS
    if isinstance(depths, (int, np.integer)) and not isinstance(depths, bool):
        if depths < 1:
            raise ValueError(f"`depths`={depths} must be a positive number of intervals.")
        if isinstance(eq.controls, PiecewiseConstant):
            raise ValueError(
                f"`depths`={depths}: this model has per-layer controls, whose depths are its "
                f"{eq.controls.n_layers} layers; leave `depths` unset (or give depths on "
                "layer boundaries as an array)."
            )
        return np.linspace(t0, t1, int(depths) + 1)
    ts = np.asarray(depths, dtype=np.float64)
    if ts.ndim != 1 or ts.shape[0] < 2 or not np.all(np.diff(ts) > 0):
        raise ValueError(
            f"`depths` must be at least two increasing depths, got {np.round(ts, 6).tolist()}."
        )
    tol = 1e-9 * max(1.0, abs(t1))
    if ts[0] < t0 - tol or ts[-1] > t1 + tol:
        raise ValueError(
            f"`depths` must lie in the model's depth interval [{t0}, {t1}], got "
            f"[{ts[0]}, {ts[-1]}]."
        )
    return ts


def _batch(u0, mask):
    u0 = jnp.asarray(u0)
    given = tuple(u0.shape)
    if u0.ndim == 2:
        u0 = u0[None]
        mask = None if mask is None else jnp.asarray(mask)[None]
    if u0.ndim != 3:
        raise ValueError(
            f"`u0` must be one state [tokens, features] or a batch [inputs, tokens, features], "
            f"got shape {u0.shape}."
        )
    if not jnp.issubdtype(u0.dtype, jnp.floating):
        raise TypeError(f"`u0` must be a floating state, got dtype {u0.dtype}.")
    if u0.shape[0] == 0 or u0.shape[1] == 0:
        what = "is an empty batch (no input)" if u0.shape[0] == 0 else "has no token"
        raise ValueError(
            f"`u0` {what}, shape {given}: `analyze` reports on the inputs' states and the "
            "first input's flow; give at least one input of at least one token, "
            "[inputs, tokens, features] (or one state [tokens, features])."
        )
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.shape != u0.shape[:2]:
            raise ValueError(
                f"`mask` must be [inputs, tokens] = {tuple(u0.shape[:2])} (False on padding), "
                f"got shape {mask.shape}."
            )
        mask = jax.vmap(lambda m: key_mask(m, u0.shape[1]))(mask)
    return u0, mask


def _mean_over(x, axis=0):
    """The mean over inputs, ignoring NaN (a padded or undefined entry)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        return np.nanmean(x, axis=axis) if x.size else x


def analyze(
    model,
    u0,
    mask=None,
    *,
    depths=None,
    solver: diffrax.AbstractSolver | None = None,
    dt0: float | None = None,
    terms=None,
    tol: float = 1e-3,
    lyapunov: bool = True,
    token_target: str | int = "last",
    token_exponent: AbstractTokenExponent | str = "exact",
    key=None,
    max_iters: int = 100,
    rtol: float | None = None,
    block_size: int | None = None,
    progress=False,
) -> dict:
    r"""Every quantity of `itde.analysis` against depth, as a JSON-able dict.

    **Arguments:**

    - `model`: an `itde.TransformerIDE` or a model holding one (converted, trained).
    - `u0`: the inputs' initial states, `[inputs, tokens, features]` (or one state).
    - `mask`: `[inputs, tokens]` key masks (False on padding), or None.
    - `depths`: see [`report_depths`][itde.analysis.report_depths] (default: every layer
      boundary of a network; 8 intervals for smooth controls).
    - `solver`, `dt0`, `terms`: the depth integrator, as in [`itde.solve`][itde.solve]
      (default: the paper's Lie scheme, one step per layer: the discrete network). With
      smooth controls give a step `dt0` that divides the intervals.
    - `tol`: the cluster tolerance of [`cluster_count`][itde.analysis.cluster_count].
    - `lyapunov`: also compute the exponents (the costly part: one power iteration per
      interval, see below).
    - `token_target`: the output the token exponents measure, as `target` of
      [`token_lyapunov_exponents`][itde.analysis.token_lyapunov_exponents]: `"last"`
      (default: the first input's last real token, the output Tong et al. read; cheap:
      `features` VJPs), an output token index, `"all"` or `"self"` (exact definition
      only: power iterations over every token's block, tens of times dearer).
    - `token_exponent`: the definition of the token exponents, `method` of
      `token_lyapunov_exponents`: `"exact"` (default, the blocks of the flow's Jacobian,
      [`FlowJacobianExponent`][itde.analysis.FlowJacobianExponent]) or `"tong"` (Tong et
      al.'s QR iteration over $I + \Delta t\, J$ of the per-layer vector field,
      [`TongExponent`][itde.analysis.TongExponent]), or such a module.
    - `key`: the PRNG key of the power iterations' random starts.
    - `max_iters`, `rtol`, `block_size`: the iterations' cap, tolerance and block size, as
      in [`lyapunov_spectrum`][itde.analysis.lyapunov_spectrum] (`block_size` at most
      `features`: the token exponents iterate on blocks of that many columns). An iteration
      that has not met `rtol` within `max_iters` never raises: its estimate is reported with
      its residual and `converged: false`.
    - `progress`: write what it does as it goes, a line per stage, on `sys.stderr`
      (`True`) or on the given text stream; before the exponents' long work, once the
      first intervals have been timed, the time the whole run is expected to take (and
      after each stage an updated estimate). `False` (default): silent.

    **Returns:** a dict with `"depths"` (the saved depths $t_0 < \dots < t_K$),
    `"layer_boundaries"` (a network's, else `[]`), `"inputs"`, `"tokens"`, `"features"`,
    `"heads"`, and

    - `"geometry"`: each of `effective_rank`, `numerical_rank`, `mean_cosine`, `min_cosine`,
      `n_clusters` as a list over depths (the mean over inputs), `attention_entropy`
      `[depths][heads]` (None for signed partial-interval weights), and `residuals`
      `{name: [depths]}` (the constraint residuals of the norm at each depth).
    - `"spectra"`: at each depth where an interval starts, `qk_max_abs_eigenvalue` and
      `qk_spectral_norm` ($W^Q {W^K}^\top$), `vo_spectral_norm` ($W^V W^O$), each
      `[depths][heads]`, `w1_spectral_norm`, `w2_spectral_norm` and
      `w1w2_max_abs_eigenvalue` (the largest modulus of an eigenvalue of $W_1 W_2$, Tong et
      al.'s feed-forward spectrum) `[depths]`.
    - `"lyapunov"` (if `lyapunov`): `intervals` `[[s, t], ...]`, `leading_exponent` and
      `leading_singular_value` per interval (of the first input's flow map
      $u(s) \mapsto u(t)$ on the whole state), `whole_depth` (the same over $[t_0, t_K]$),
      `token_exponents` (each input token's leading exponent over $[t_0, t_K]$ towards
      `token_target`; None on padding), `token_target` (the index, or the name) and
      `token_exponent` (the definition's name in
      [`TOKEN_EXPONENTS`][itde.analysis.TOKEN_EXPONENTS]).
      Each estimate carries its convergence: `residual` and `converged` per interval (the
      relative residual of the leading pair, see `lyapunov_spectrum`), the same in
      `whole_depth` with its `n_iterations`, `token_residuals` and `token_converged` (the
      token exponents' batch), and `all_converged` (all of them).
    - `"wall_s"`: the wall-clock seconds spent.

    **Cost:** one batched solve saving the states; a geometry evaluation per saved depth
    and input (about two field evaluations, see `geometry_along`); the spectra (small
    dense eigenproblems per head); and, with `lyapunov`, per interval a power iteration of
    JVPs and VJPs through that interval's solve (each interval compiles once), then the
    whole-depth spectrum and the token exponents (tokens × a few tangents per iteration;
    towards one token, `features` VJPs through the whole depth). The exponents' JVPs and
    VJPs leave out the first input's padding when it is at the end (exact: no real token
    attends to a padded one). Measured on SmolLM2-135M (`itde analyze --hf`: 30 layers,
    4 inputs of 42 tokens, the first of 22 real tokens, float64, an idle 2-core CPU):
    74-80 s in all, of which the token exponents 33-35 s (576 VJPs through 30 layers),
    the 30 intervals 13-19 s, the spectra 9-12 s (a $576 \times 576$ nonsymmetric
    eigenproblem of $W_1 W_2$ per layer), the whole depth 8 s. With `progress`, the
    first lines say how long the run is expected to take, before any work: each stage's
    operations counted from the model's shape and priced at the machine's speed,
    measured on the spot in about a second (84 s expected there, 76 s taken); then the
    estimate is measured again from the second interval on.
    """
    start = time.perf_counter()
    token_exponent = as_token_exponent(token_exponent, "token_exponent")
    eq = equation_of(model)
    ts = report_depths(eq, depths)
    u0, mask = _batch(u0, mask)
    iteration = _check_iteration(max_iters, rtol, block_size, u0)
    fixed = dict(solver=solver, dt0=dt0, terms=terms)
    save = diffrax.SaveAt(ts=jnp.asarray(ts, dtype=jnp.result_type(float)))

    n_real = u0.shape[1] if mask is None else int(np.asarray(mask[0]).sum())
    target_int = not (isinstance(token_target, str) and token_target in ("all", "self"))
    prog = _Progress(
        _stream(progress), n_intervals=len(ts) - 1, length=float(ts[-1] - ts[0]),
        block=iteration["block_size"] or min(n_real * u0.shape[2], 4),
        features=int(u0.shape[2]), tokens=n_real,
        token_vjps=target_int and token_exponent_name(token_exponent) == "exact",
        max_iters=iteration["max_iters"],
    )  # fmt: skip
    prior = None
    if prog.file is not None:  # the expected time, before any work (a probe of ~1 s)
        from ._estimate import expected

        jax.block_until_ready((eq, u0))  # the caller's pending work is not the probe's
        prior = expected(
            eq, ts, inputs=int(u0.shape[0]), tokens=int(u0.shape[1]), n_real=n_real,
            features=int(u0.shape[2]), dtype=u0.dtype, solver=solver, dt0=dt0,
            lyapunov=lyapunov, token_vjps=prog.token_vjps, block=prog.p,
            max_iters=iteration["max_iters"],
        )  # fmt: skip
    prog.plan(ts, lyapunov, prior)
    with prog.stage(f"solve {u0.shape[0]} inputs of {u0.shape[1]} tokens x {u0.shape[2]} "
                    "features"):  # fmt: skip
        ys = jax.block_until_ready(_solve_all(eq, u0, mask, save, fixed))
    ts_arr = jnp.asarray(ts, dtype=ys.dtype)
    with prog.stage(f"geometry at {len(ts)} depths"):
        per_input = [
            geometry_along(eq, ts_arr, ys[i], None if mask is None else mask[i], tol=tol)
            for i in range(ys.shape[0])
        ]
        jax.block_until_ready(per_input)
    geometry = {
        name: _floats(_mean_over([getattr(g, name) for g in per_input]))
        for name in ("effective_rank", "numerical_rank", "mean_cosine", "min_cosine", "n_clusters")
    }
    entropy = per_input[0].attention_entropy
    geometry["attention_entropy"] = (
        None if entropy is None else _floats(_mean_over([g.attention_entropy for g in per_input]))
    )
    geometry["residuals"] = {
        k: _floats(_mean_over([g.residuals[k] for g in per_input])) for k in per_input[0].residuals
    }
    network = isinstance(eq.controls, PiecewiseConstant)
    starts = ts[:-1]
    with prog.stage(f"spectra at {len(starts)} depths"):
        sp = jax.block_until_ready(leading_spectra(eq, starts))  # the leading values only
    spec = {
        "depths": _floats(starts),
        "qk_max_abs_eigenvalue": _floats(sp.qk_max_abs_eigenvalue),
        "qk_spectral_norm": _floats(sp.qk_spectral_norm),
        "vo_spectral_norm": _floats(sp.vo_spectral_norm),
        "w1_spectral_norm": _floats(sp.w1_spectral_norm),
        "w2_spectral_norm": _floats(sp.w2_spectral_norm),
        "w1w2_max_abs_eigenvalue": _floats(sp.w1w2_max_abs_eigenvalue),
    }
    out = {
        "depths": _floats(ts),
        "layer_boundaries": _floats(eq.controls.layer_times()) if network else [],
        "inputs": int(ys.shape[0]),
        "tokens": int(ys.shape[2]),
        "features": int(ys.shape[3]),
        "heads": int(sp.qk_spectral_norm.shape[1]),
        "dtype": str(ys.dtype),
        "geometry": geometry,
        "spectra": spec,
    }
    if lyapunov:
        out["lyapunov"] = _lyapunov(
            eq, ts, ys, mask, fixed, key, token_target, token_exponent, iteration, prog
        )
    out["wall_s"] = time.perf_counter() - start
    return out


def _stream(progress):
    """The text stream of `analyze(progress=...)`: None (silent), stderr, or the one given."""
    import sys

    if progress is False or progress is None:
        return None
    if progress is True:
        return sys.stderr
    if not callable(getattr(progress, "write", None)):
        raise TypeError(
            f"`progress` must be True (lines on stderr), False, or a text stream with a "
            f"`write` method, got {type(progress).__name__}."
        )
    return progress


def _solve_all(eq, u0, mask, save, fixed):
    """The states at the report's depths, `[inputs, depths, tokens, features]`: one program
    of `itde.programs` per model structure and bucket of token counts (padded as an eager
    `itde.solve` is, where the model and `terms` allow it), shared by every report."""
    if has_tracer(eq, u0, mask, save, fixed):
        return _solve_all_program(eq, u0, mask, save, fixed)
    terms = fixed["terms"]
    return run_on_tokens(
        _solve_all_program, eq, u0, mask, save, fixed, axis=-2, batch=int(u0.shape[0]),
        buckets=PowerOfTwoBuckets(), cut=lambda ys, n: take_rows(ys, n, -2),
        pad=terms is None or isinstance(terms, str),
    )  # fmt: skip


def _solve_all_program(eq, u0, mask, save, fixed):
    def one(u, m):
        ys = solve(eq, u, saveat=save, args=m, **fixed).ys
        assert ys is not None
        return ys.astype(u.dtype)

    if mask is None:
        return jax.vmap(lambda u: one(u, None))(u0)
    return jax.vmap(one)(u0, mask)


@eqx.filter_jit
def _leading(flow, u, key, mask, max_iters, rtol, block_size):
    """The leading singular value of one flow map's Jacobian; `max_iters` and `rtol` traced
    (one compilation per flow structure serves every report and every interval)."""
    return lyapunov_spectrum(flow, u, 1, mask=mask, key=key, throw=False, max_iters=max_iters,
                             rtol=rtol, block_size=block_size)  # fmt: skip


@eqx.filter_jit
def _tokens(flow, u, key, mask, max_iters, rtol, block_size, target, method):
    return token_lyapunov_exponents(flow, u, target=target, mask=mask, key=key, method=method,
                                    throw=False, max_iters=max_iters, rtol=rtol,
                                    block_size=block_size)  # fmt: skip


def _check_iteration(max_iters, rtol, block_size, u0) -> dict:
    """The iterations' options, checked before any solve (clear errors naming each)."""
    from ._sensitivity import _check_block, _check_max_iters, _check_rtol

    d = int(u0.shape[-1])
    if block_size is not None:
        block_size = check_int("block_size", block_size, minimum=1)
        if block_size > d:
            raise ValueError(
                f"`block_size`={block_size} exceeds the {d} features: the token exponents "
                f"iterate on blocks of `features` columns; give block_size <= {d}."
            )
        _check_block(block_size, 1, d)
    return {
        "max_iters": _check_max_iters(max_iters),
        "rtol": _check_rtol(rtol, u0.dtype),
        "block_size": block_size,
    }


def _layer_equations(eq, ts):
    """For per-layer controls reported at their layer boundaries: each layer as a one-layer
    model starting at the first boundary (the same structure for every layer, so one
    compilation serves all); else None."""
    c = eq.controls
    if not isinstance(c, PiecewiseConstant) or len(ts) != c.n_layers + 1:
        return None
    # a tolerance on purpose: `ts` may be computed (linspace); the state is continuous in
    # depth, so maps from depths 1e-9 apart agree to that order
    if not np.allclose(ts, c.layer_times(), rtol=0, atol=1e-9 * max(1.0, float(c.t1))):
        return None
    return [
        eqx.tree_at(
            lambda e: e.controls,
            eq,
            PiecewiseConstant(
                jax.tree.map(lambda a: a[n : n + 1], c.values), t0=c.t0, layer_length=c.layer_length
            ),
        )  # fmt: skip
        for n in range(c.n_layers)
    ]


def _lyapunov(eq, ts, ys, mask, fixed, key, token_target, token_exponent, iteration,
              progress) -> dict:  # fmt: skip
    """The leading exponent over each interval and the whole depth, and the token
    exponents, for the first input; never raising on an iteration short of its tolerance
    (each estimate reports its residual and whether it converged)."""
    key = jax.random.key(0) if key is None else key
    m = None if mask is None else mask[0]
    n_tokens = int(ys.shape[2])
    u_all = ys[0]  # [depths, tokens, features]: the first input's states
    if m is not None:
        real = np.asarray(m, dtype=bool)
        n_real = int(real.sum())
        if n_real > 0 and real[:n_real].all():  # padding at the end only: drop it (exact)
            # a padded key is masked out of every real token's attention and each token's
            # feed-forward and norms are its own, so the real tokens' flow, and so P J P,
            # is the flow of the real tokens alone: the same exponents at n_real / n_tokens
            # of the cost of every JVP and VJP
            u_all, m = u_all[:, :n_real], None
    opts = dict(solver=fixed["solver"], dt0=fixed["dt0"], terms=fixed["terms"])
    it = (
        jnp.asarray(iteration["max_iters"], jnp.int32),
        jnp.asarray(iteration["rtol"], ys.dtype),
        iteration["block_size"],
    )

    def leading(flow, u, k):
        return _leading(flow, u, k, m, *it)


    layers = _layer_equations(eq, ts)
    lead, sig, intervals, res, conv = [], [], [], [], []
    for i, (s, t) in enumerate(zip(ts[:-1], ts[1:], strict=True)):
        if layers is not None:  # layer i alone, at the same depths as layer 0: one compile
            flow = FlowMap(layers[i], float(ts[0]), float(ts[1]), **opts)
        else:
            flow = FlowMap(eq, float(s), float(t), **opts)
        # the state reached at s along the report's own solve (the continuum kinds of terms
        # project on entry: a state on the constraint set is left where it is)
        with progress.stage(f"exponent over [{s:g}, {t:g}]", float(t - s)) as done:
            r = leading(flow, u_all[i], jax.random.fold_in(key, i))
            done(int(r.n_iterations))
        lead.append(float(r.exponents[0]))
        sig.append(float(r.singular_values[0]))
        res.append(float(r.residuals[0]))
        conv.append(bool(r.converged))
        intervals.append([float(s), float(t)])
    whole = FlowMap(eq, float(ts[0]), float(ts[-1]), **opts)
    length = float(ts[-1] - ts[0])
    with progress.stage("exponent over the whole depth", length, compiles=True) as done:
        r = leading(whole, u_all[0], key)  # compiled: op by op, the solves dispatch slowly
        done(int(r.n_iterations))
    if isinstance(token_target, str) and token_target == "last":
        token_target = int(u_all.shape[1] - 1 if m is None else int(np.flatnonzero(m)[-1]))
    with progress.stage("token exponents", length, compiles=True, tokens=True) as done:
        tok = _tokens(whole, u_all[0], key, m, *it, token_target, token_exponent)
        done(int(tok.n_iterations))
    pad = [None] * (n_tokens - int(u_all.shape[1]))  # the padding dropped above
    return {
        "intervals": intervals,
        "leading_exponent": _floats(lead),
        "leading_singular_value": _floats(sig),
        "residual": _floats(res),
        "converged": conv,
        "whole_depth": {
            "interval": [float(ts[0]), float(ts[-1])],
            "leading_exponent": _floats(r.exponents[0]),
            "leading_singular_value": _floats(r.singular_values[0]),
            "residual": _floats(r.residuals[0]),
            "converged": bool(r.converged),
            "n_iterations": int(r.n_iterations),
        },
        "token_exponents": _floats(tok.exponents[:, 0]) + pad,
        "token_residuals": _floats(tok.residuals[:, 0]) + pad,
        "token_converged": bool(tok.converged),
        "all_converged": all(conv) and bool(r.converged) and bool(tok.converged),
        "token_target": token_target,
        "token_exponent": token_exponent_name(token_exponent),
    }


class _Progress:
    r"""The lines `analyze(progress=...)` writes: the plan before any work, a line when
    each stage starts and ends, and, from the first interval whose exponent compiled
    nothing (the second; the first when there is one), the estimate of the whole run.

    The exponents' cost is counted in tangent-depths: an iteration of a block of $p$
    tangents over a depth length $\ell$ costs $p\,\ell$ (one JVP and one VJP of each
    tangent through the steps of $\ell$). The seconds per tangent-depth are measured on
    the warm intervals; the stages still to come are priced at the mean iterations seen
    so far (the whole depth) or at their product count (the token exponents towards one
    token: `features` VJPs through the whole depth in one batch, 0.15 tangent-depth each,
    as measured at SmolLM2's size), plus the
    first interval's compilation time for each stage that compiles."""

    def __init__(self, file, *, n_intervals, length, block, features, tokens, token_vjps,
                 max_iters):  # fmt: skip
        self.file = file
        self.n_intervals, self.length, self.p = n_intervals, length, block
        self.token_vjps, self.tokens, self.max_iters = token_vjps, tokens, max_iters
        self.features = features
        self.t0 = time.perf_counter()
        self.warm = [0.0, 0.0]  # seconds and tangent-depths of the warm intervals
        self.iters: list[int] = []
        self.compile_s = 0.0
        self.left: list[tuple[str, float]] = []  # the exponents' stages still to run
        self.estimated = False

    def write(self, text: str) -> None:
        if self.file is not None:
            self.file.write(f"itde analyze: {text}\n")
            self.file.flush()

    def plan(self, ts, lyapunov: bool, prior: tuple[float, float] | None = None) -> None:
        """The plan's line, then with `prior` (the expected seconds: at the typical
        iterations, at `max_iters`) the expected time's."""
        self.left = [("interval", float(t - s)) for s, t in zip(ts[:-1], ts[1:], strict=True)]
        self.left += [("whole", self.length), ("tokens", self.length)] if lyapunov else []
        self.left = self.left if lyapunov else []
        what = (f"then the exponents: {self.n_intervals} intervals, the whole depth and the "
                f"token exponents, each up to {self.max_iters} iterations of {self.p} JVPs "
                f"and VJPs; the time it will take is measured again after the first "
                f"{min(2, self.n_intervals)} interval(s)") if lyapunov else "no exponents"
        self.write(f"solve, geometry and spectra at {len(ts)} depths; {what}")  # fmt: skip
        if prior is not None:
            from .._progress import format_duration
            from ._estimate import TYPICAL_ITERS

            typical, bound = prior
            iters = min(TYPICAL_ITERS, self.max_iters)
            line = (f"expects about {format_duration(typical)} in all (priced from the model's "
                    f"shape at this machine's measured speed")  # fmt: skip
            if lyapunov and self.max_iters > iters:
                line += (f", {iters} iterations an exponent; at most {format_duration(bound)} "
                         f"if every exponent runs max_iters={self.max_iters}")  # fmt: skip
            self.write(line + ")")
            self.estimated = True  # the later estimates are updates of this one

    def _cost(self, kind: str, length: float) -> float:
        mean = sum(self.iters) / len(self.iters) if self.iters else self.max_iters
        if kind == "tokens" and self.token_vjps:  # batched VJPs: measured on SmolLM2, 2
            return 0.15 * self.features * length  # CPUs, 0.14 tangent-depths per VJP-depth
        if kind == "tokens":
            return mean * self.tokens * self.p * length
        return mean * self.p * length

    def estimate(self) -> float:
        rate = self.warm[0] / self.warm[1]
        rest = sum(self._cost(kind, n) * rate for kind, n in self.left)
        rest += self.compile_s * sum(kind != "interval" for kind, _ in self.left)
        return time.perf_counter() - self.t0 + rest

    def stage(self, what: str, length: float | None = None, *, compiles: bool = False,
              tokens: bool = False):  # fmt: skip
        """A context manager around one stage; an exponent's (`length` given) yields a
        function to call with its iteration count."""
        import contextlib

        from .._progress import estimate_line, format_duration

        @contextlib.contextmanager
        def run():
            self.write(f"{what} ...")
            start = time.perf_counter()
            count = []
            yield count.append
            took = time.perf_counter() - start
            line = f"{what} took {format_duration(took)}"
            if length is not None:
                kind = "tokens" if tokens else ("whole" if compiles else "interval")
                self.left.pop(0)
                n = count[0] if count else 1
                line += f" ({n} iterations)" if not (tokens and self.token_vjps) else ""
                if kind == "interval":
                    self.iters.append(n)
                    if len(self.iters) == 1 and self.n_intervals > 1:
                        self.compile_s = took  # less its work, once the rate is known
                    else:
                        self.warm[0] += took
                        self.warm[1] += n * self.p * length
                        if len(self.iters) == 2:
                            first = self.iters[0] * self.p * self.left_first
                            self.compile_s = max(0.0, self.compile_s - first * self.rate)
                if self.warm[1] > 0 and self.left:
                    total = self.estimate()
                    elapsed = time.perf_counter() - self.t0
                    tag = "expects" if not self.estimated else ""
                    self.estimated = True
                    said = estimate_line(elapsed, max(elapsed, total))
                    line += f"; {tag + ' ' if tag else ''}{said}"
            self.write(line)

        if length is not None and not self.iters:
            self.left_first = length
        return run()

    @property
    def rate(self) -> float:
        return self.warm[0] / self.warm[1]


def figure_report(report: dict, title: str = ""):
    """The figure of a report: one panel per quantity, depth on the x-axis, the layer
    boundaries marked (dotted lines), heads as separate lines; the token exponents as a
    histogram. Returns the matplotlib figure."""
    from .._plot import _pyplot, readable_log_ticks, series_style

    plt = _pyplot()
    ts = np.asarray(report["depths"], dtype=float)
    g, sp = report["geometry"], report["spectra"]
    starts = np.asarray(sp["depths"], dtype=float)
    panels: list[tuple[str, np.ndarray, object, str]] = [
        ("effective rank", ts, g["effective_rank"], "linear"),
        ("mean / min cosine", ts, {"mean": g["mean_cosine"], "min": g["min_cosine"]}, "linear"),
        ("clusters (tol)", ts, g["n_clusters"], "linear"),
    ]
    if g["attention_entropy"] is not None:
        panels.append(("attention entropy per head", ts, _heads(g["attention_entropy"]), "linear"))
    if g["residuals"]:
        panels.append(("constraint residuals", ts, g["residuals"], "log"))
    panels += [
        ("max |eig| of W^Q W^K^T per head", starts, _heads(sp["qk_max_abs_eigenvalue"]), "log"),
        ("||W^V W^O|| per head", starts, _heads(sp["vo_spectral_norm"]), "log"),
        ("feed-forward: ||W1||, ||W2||, max |eig W1 W2|", starts,
         {"W1": sp["w1_spectral_norm"], "W2": sp["w2_spectral_norm"],
          "eig W1 W2": sp["w1w2_max_abs_eigenvalue"]}, "log"),
    ]  # fmt: skip
    lyap = report.get("lyapunov")
    if lyap is not None:
        mids = np.asarray([(s + t) / 2 for s, t in lyap["intervals"]])
        panels.append(("leading Lyapunov exponent per interval", mids,
                       lyap["leading_exponent"], "linear"))  # fmt: skip
    n = len(panels) + (lyap is not None)
    cols = 3
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False)
    flat = axes.ravel()
    bounds = report.get("layer_boundaries") or []
    for ax, (name, x, ys, scale) in zip(flat, panels, strict=False):
        series = ys if isinstance(ys, dict) else {"": ys}
        for i, (label, y) in enumerate(series.items()):
            y = np.asarray([np.nan if v is None else v for v in y], dtype=float)
            style = series_style(i, len(series))
            if scale == "log":
                y = np.where(y > 0, y, np.nan)
            ax.plot(x, y, label=label or None, markersize=4, **style)
        if scale == "log" and np.any(np.isfinite(ax.get_ylim())):
            ax.set_yscale("log")
            readable_log_ticks(ax.yaxis)
        for b in bounds:
            ax.axvline(b, color="0.8", lw=0.6, ls=":", zorder=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("depth t", fontsize=8)
        if len(series) > 1 and len(series) <= 8:
            ax.legend(fontsize=7)
    if lyap is not None:
        ax = flat[len(panels)]
        tok = np.asarray([v for v in lyap["token_exponents"] if v is not None], dtype=float)
        ax.hist(tok, bins=max(5, min(30, tok.size // 2)), color="C0")
        w = lyap["whole_depth"]["leading_exponent"]
        if w is not None:
            ax.axvline(w, color="C3", lw=1, label="whole state")
            ax.legend(fontsize=7)
        ax.set_title(f"token Lyapunov exponents, {lyap['token_exponent']} (towards "
                     f"{lyap['token_target']})", fontsize=9)  # fmt: skip
        ax.set_xlabel("exponent", fontsize=8)
    for ax in flat[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _heads(rows) -> dict:
    """`[depths][heads]` as one series per head (at most 8 labelled)."""
    a = np.asarray([[np.nan if v is None else v for v in r] for r in rows], dtype=float)
    return {f"head {h}": a[:, h].tolist() for h in range(a.shape[1])}


def plot_report(report: dict, path, title: str = ""):
    """Write [`figure_report`][itde.analysis.figure_report] as a PNG to `path`."""
    from .._plot import save_figure

    return save_figure(figure_report(report, title), path)
