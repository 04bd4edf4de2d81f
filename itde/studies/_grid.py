r"""Resolution convergence: the same function-kernel model on refining token / feature grids.

The model's kernels and initial state are functions (Legendre series, or Fourier series
on a periodic axis); on each grid they are sampled at the rule's nodes and the encoder
is solved. The error measure is the output functional
$J = \int_{\Omega_x}\int_{\Omega_y} g(x, y)\,u(x, y, T)\,dy\,dx$ (computed with the same
grid's quadrature), against a Gauss–Legendre grid of `reference_nodes` nodes on the
refined axis. The other axis stays on a fixed fine Gauss–Legendre grid (the same in
the reference), so the error is that of the refined axis alone.

- `tokens` / `features`: one row per rule; depth is the Transformer regime (Lie,
  $\Delta t = 1$, piecewise-constant controls), which is exact in depth.
- `all`: $\Delta t$, tokens and features refined together (steps $= N/4$) with controls
  smooth in depth; the reference is projected Dopri8 at tight tolerances on the
  reference grid. Each row converges at the rate of its slowest component.

Periodic data (a Fourier series on the refined axis) is used for the periodic-trapezoid
row only: on periodic data the midpoint and trapezoid rules are spectrally accurate too,
which would hide their order 2 on ordinary data.

`tokens` also has one causal row per rule (`causal-<rule>`): causal (Volterra) attention
with the rule's partial-interval weights (`itde.volterra_weights`), on ordinary data (the
periodic-trapezoid row is then order 1: the functional's own sum is a left Riemann sum). Its
reference is computed by a different method: for every rule but Gauss–Legendre, spectral
integration on `reference_nodes` Gauss–Legendre nodes; for the Gauss–Legendre row, the
fourth-order Gregory rule on 1025 and 2049 equispaced nodes, Richardson-extrapolated. The
two references agree to the figure stored as `causal_reference_gap`.

**Compiled programs.** The `tokens` grids are solved by eager model calls: each count is
padded to its bucket (see [`itde.solve`][itde.solve]), so every count of a bucket, and
every rule of the same structure (the non-causal rules whose weights are not uniform, for
one), share a program. The `features` and `all` grids change the model's width, which is
its structure: one program per grid. Every program is held by `itde.programs` (bounded,
freed when evicted). The initial states are sampled by eager operations (a few small
programs per new count).
"""

from __future__ import annotations

import math
import time

import diffrax
import jax
import jax.numpy as jnp
import numpy as np

import itde_solvers as solvers

from .._controls import LegendreControls, PiecewiseConstant, stack
from .._equation import TransformerIDE
from .._programs import programs
from .._quadrature._rules import RULES, GaussLegendre, Grid, Simpson
from .._quadrature._volterra import volterra_weights
from .._registry import SCHEMES
from .._solve import solve
from ..function import FourierBasis, FunctionField, LegendreBasis
from ..function._block import FunctionBlock
from ._converge_config import ConvergeExperiment
from ._depth import study_order

FIXED_NODES = 32  # the fixed, fine Gauss-Legendre grid on the axis not being refined
GREGORY_REFERENCE_NODES = (1025, 2049)  # the causal Gauss-Legendre row's reference
INTERNAL_NODES = 24  # head and hidden domains (Gauss-Legendre)
ALL_ROWS = (
    ("lie", "midpoint"),
    ("strang", "midpoint"),
    ("rk4", "midpoint"),
    ("rk4", "gauss-legendre"),
)


def _gl():
    return GaussLegendre(interval=(0.0, 1.0))


def _nodes_for(rule: str, n: int) -> int:
    return n + 1 if rule == "simpson" and n % 2 == 0 else n


class GridProblem:
    """Function-kernel controls, an initial state $f(x,y)$ and the functional's $g(x,y)$."""

    def __init__(
        self,
        cfg: ConvergeExperiment,
        periodic: str | None,
        smooth_depth: bool,
        causal: bool = False,
    ):
        p, s = cfg.problem, cfg.study
        self.causal = causal
        m = s.modes
        unit = (0.0, 1.0)
        # periodic rows: one Fourier frequency (1, cos 2 pi x, sin 2 pi x) in that axis
        bx = FourierBasis(3, unit) if periodic == "tokens" else LegendreBasis(m, unit)
        by = FourierBasis(3, unit) if periodic == "features" else LegendreBasis(m, unit)
        kw = dict(
            n_heads=p.n_heads,
            feature_basis=by,
            head_basis=LegendreBasis(m, unit),
            hidden_basis=LegendreBasis(m, unit),
            head_rule=_gl(),
            n_head_nodes=INTERNAL_NODES,
            hidden_rule=_gl(),
            n_hidden_nodes=INTERNAL_NODES,
            activation=p.activation,
            scale=s.kernel_scale,
            decay=s.decay,
            dtype=jnp.float64,
        )
        key = jax.random.key(p.seed)
        if smooth_depth:
            self.controls = LegendreControls.init(
                key,
                n_modes=p.n_modes,
                t1=p.t1,
                amplitude=p.amplitude,
                block_init=FunctionBlock.init,
                **kw,
            )
        else:
            keys = jax.random.split(key, s.layers)
            self.controls = PiecewiseConstant(stack([FunctionBlock.init(k, **kw) for k in keys]))
        self.f = FunctionField.init(
            jax.random.key(p.seed + 1), bx, by, decay=s.decay, dtype=jnp.float64
        )
        self.periodic = periodic

    def g(self, x, y):
        """The functional's weight $g(x, y)$ on node arrays (NumPy: computed on the host)."""
        tx = np.cos(2 * np.pi * x) if self.periodic == "tokens" else np.cos(2 * x) + x
        ty = np.sin(2 * np.pi * y) if self.periodic == "features" else np.sin(3 * y) + y * y
        return tx[:, None] * ty[None, :] + 0.5 * ty[None, :]

    def functional(self, grid: Grid, n_tokens: int, solve_fn) -> float:
        """$J$ of the solution `solve_fn(model, u0)` on `grid`, summed on the host in float64
        (a sum on the device would compile a program per token count)."""
        model = TransformerIDE(self.controls, grid, causal=self.causal)
        u0 = self.f.sample_grid(grid, n_tokens)
        u = np.asarray(solve_fn(model, u0), np.float64)
        x, w = grid.tokens.nodes_weights(n_tokens)
        y, v = grid.features.nodes_weights(grid.n_features)
        return float(np.sum(w[:, None] * v[None, :] * self.g(x, y) * u))


def _grid(axis: str, rule, n: int) -> tuple[Grid, int]:
    """(grid, n_tokens) with `rule` at `n` nodes on `axis` and the fixed grid elsewhere."""
    if axis == "tokens":
        return Grid(rule, _gl(), FIXED_NODES), n
    if axis == "features":
        return Grid(_gl(), rule, n), FIXED_NODES
    return Grid(rule, rule, n), n  # "all"


def _lie_dt1(model, u0):
    return model(u0)


def _compiled(fn):
    """`fn(model, u0)` run by a program of `itde.programs` (bounded, freed when evicted; a
    `jax.jit` here would keep every program for the rest of the process)."""
    return lambda model, u0: programs(fn, model, u0)


def _row(name, label, ns, errors, expected, kind="n") -> dict:
    geometric = not math.isfinite(expected)
    row = {
        "scheme": name,
        "label": label,
        "expected_order": None if geometric else float(expected),
        "convergence": "geometric" if geometric else "algebraic",
        "observed_order": study_order([1.0 / n for n in ns], errors, floor=1e-13, asymptotic=3),
        kind: list(ns),
        "errors": errors,
    }
    if geometric:
        below = [n for n, e in zip(ns, errors) if e <= 1e-10]
        row["n_reaching_1e-10"] = below[0] if below else None
    return row


def run_grid_study(cfg: ConvergeExperiment, axis: str, progress: bool = True) -> dict:
    """Run the `tokens`, `features` or `all` study; JSON-ready result (`"n"` for `"dt"`)."""
    from .._progress import progress_bar, stage_line

    if not jax.config.jax_enable_x64:
        raise RuntimeError("the convergence study runs in float64: enable jax_enable_x64 first.")
    s = cfg.study
    t_start = time.perf_counter()
    results = []
    if axis in ("tokens", "features"):
        rows = [(r, r) for r in s.rules]
        if axis == "tokens":
            rows += [(f"causal-{r}", r) for r in s.rules]
    else:
        rows = [(f"{sch}+{r}", r) for sch, r in ALL_ROWS]
    desc = f"{axis} convergence"
    if progress:  # the plan first, before any compilation
        import sys

        print(f"{desc}: {len(rows)} rows ({', '.join(n for n, _ in rows)}) x "
              f"{len(s.nodes)} grids of {', '.join(map(str, s.nodes))} nodes, each against a "
              f"reference on {s.reference_nodes} Gauss-Legendre nodes (the references are "
              "said when they start; the bar counts rows' grids and references)",
              file=sys.stderr, flush=True)  # fmt: skip
    bar = progress_bar(len(rows) * (len(s.nodes) + 1), desc, enabled=progress)
    references = {}
    causal_refs = {}
    for name, rule_name in rows:
        causal = name.startswith("causal-")
        periodic = (
            axis if (rule_name == "periodic-trapezoid" and axis != "all" and not causal) else None
        )
        problem = GridProblem(cfg, periodic, smooth_depth=(axis == "all"), causal=causal)
        if axis == "all":
            scheme = SCHEMES[name.split("+")[0]]
            expected = min(scheme.order, RULES[rule_name].order)

            def solve_fn(model, u0, n=None, scheme=scheme):
                steps = max(1, n // 4)
                return solve(model, u0, **scheme.solve_options(model.depth / steps)).ys[-1]

            def ref_fn(model, u0):
                return solve(
                    model,
                    u0,
                    solver=solvers.Projected(diffrax.Dopri8()),
                    stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
                    dt0=model.depth / 16,
                ).ys[-1]
        else:
            expected = RULES[rule_name].order
            solve_fn = ref_fn = None
        if causal:
            expected = volterra_weights(RULES[rule_name](interval=(0.0, 1.0)), 8).order
            if rule_name == "periodic-trapezoid":  # J's own sum: a left Riemann sum here
                expected = 1.0
            method = "gregory" if rule_name == "gauss-legendre" else "spectral"
            if method not in causal_refs:
                what = ("causal reference: spectral, " f"{s.reference_nodes} Gauss-Legendre nodes"
                        if method == "spectral" else "causal reference: Gregory on "
                        f"{' and '.join(map(str, GREGORY_REFERENCE_NODES))} nodes")  # fmt: skip
                with stage_line(desc, what, enabled=progress):
                    causal_refs[method] = _causal_reference(problem, method, s.reference_nodes)
            ref = causal_refs[method]
        else:
            ref_key = (periodic, axis)
            if ref_key not in references:
                grid, nt = _grid(axis, _gl(), s.reference_nodes)
                what = (f"reference{' (periodic data)' if periodic else ''}: "
                        f"{s.reference_nodes} Gauss-Legendre nodes"
                        + (", projected Dopri8" if ref_fn else ""))  # fmt: skip
                with stage_line(desc, what, enabled=progress):
                    references[ref_key] = problem.functional(
                        grid, nt, _compiled(ref_fn if ref_fn else _lie_dt1)
                    )
            ref = references[ref_key]
        bar.update()
        ns, errors = [], []
        for n0 in s.nodes:
            n = _nodes_for(rule_name, n0)
            rule = RULES[rule_name](interval=(0.0, 1.0))
            grid, nt = _grid(axis, rule, n)
            if axis == "tokens":
                # an eager call: padded to its bucket, one program for every token count
                # of the bucket and every rule with the same structure (see itde.solve)
                fn = _lie_dt1
            elif solve_fn is not None:
                fn = _compiled(lambda m, u, n=n, f=solve_fn: f(m, u, n))
            else:  # the feature count is the model's structure: a program per count
                fn = _compiled(_lie_dt1)
            errors.append(abs(problem.functional(grid, nt, fn) - ref))
            ns.append(n)
            bar.set_postfix(row=name)
            bar.update()
        label = RULES[rule_name].name if axis != "all" else f"{name} (steps = N/4)"
        if causal:
            label = f"{label}, causal (Volterra weights)"
        results.append(_row(name, label, ns, errors, expected))
    bar.close()
    return {
        "axis": axis,
        "problem": {
            **{k: getattr(cfg.problem, k) for k in cfg.problem.__dataclass_fields__},
            "layers": s.layers,
            "modes": s.modes,
            "fixed_nodes": FIXED_NODES,
            "internal_nodes": INTERNAL_NODES,
        },
        "reference": {
            "rule": "gauss-legendre",
            "nodes": s.reference_nodes,
            "solver": "projected Dopri8 (rtol=atol=1e-12)" if axis == "all" else "Lie, dt=1",
            "dtype": "float64",
        },
        "functional": "J = int int g(x,y) u(x,y,T) dy dx with the grid's own quadrature",
        **(_causal_meta(causal_refs, s.reference_nodes) if causal_refs else {}),
        "results": results,
        "wall_s": time.perf_counter() - t_start,
    }


def _causal_reference(problem: GridProblem, method: str, reference_nodes: int) -> float:
    """$J$ of the causal problem by `method`: `"spectral"` (causal Gauss-Legendre on
    `reference_nodes` nodes) or `"gregory"` (Gregory's rule on the nodes of
    `GREGORY_REFERENCE_NODES`, Richardson-extrapolated for its order 4)."""
    fn = _compiled(_lie_dt1)
    if method == "spectral":
        return problem.functional(*_grid("tokens", _gl(), reference_nodes), fn)
    coarse, fine = (
        problem.functional(*_grid("tokens", Simpson(interval=(0.0, 1.0)), n), fn)
        for n in GREGORY_REFERENCE_NODES
    )
    return (16.0 * fine - coarse) / 15.0


def _causal_meta(refs: dict, reference_nodes: int) -> dict:
    meta = {
        "causal_reference": {
            "causal-gauss-legendre": "Gregory (order 4) on "
            f"{' and '.join(map(str, GREGORY_REFERENCE_NODES))} nodes, Richardson-extrapolated",
            "other causal rows": f"spectral integration on {reference_nodes} Gauss-Legendre nodes",
        }
    }
    if len(refs) == 2:
        meta["causal_reference_gap"] = abs(refs["spectral"] - refs["gregory"])
    return meta


__all__ = ["run_grid_study", "GridProblem"]
