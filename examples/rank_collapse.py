r"""Rank collapse: pure self-attention loses rank doubly exponentially with depth.

Dong, Cordonnier and Loukas, *Attention is not all you need: pure attention loses rank
doubly exponentially with depth* (ICML 2021, arXiv:2103.03404), measure how far the
tokens $X \in \mathbb R^{n \times d}$ are from "token uniformity", the rank-1 matrices
$\mathbf 1 x^\top$ (every token the same vector), by the residual
$\mathrm{res}(X) = X - \mathbf 1 x^\top$ with $x$ the best such vector.

**Claims.**

1. Quoted (abstract): "without skip connections or multi-layer perceptrons (MLPs), the
   output converges doubly exponentially to a rank-1 matrix". Paraphrased, not quoted:
   their bound (Theorem 2.2, a single-head self-attention network, the composite norm
   $\|\cdot\|_{1,\infty} = \sqrt{\|\cdot\|_1 \|\cdot\|_\infty}$) is a cubic contraction
   per layer, $\|\mathrm{res}(\mathrm{SA}(X))\| \le \frac{4\gamma\beta}{\sqrt{d_{qk}}}
   \|\mathrm{res}(X)\|^3$ ($\beta$ bounds the weights' norms, $\gamma$ depends on the
   attention entries), hence $\|\mathrm{res}\| \le C^{(3^L - 1)/2} \|\mathrm{res}(X)\|^{3^L}$
   after $L$ layers.
2. Quoted (abstract): "skip connections and MLPs stop the output from degeneration",
   judged here for skip connections ($X \mapsto X + \mathrm{SA}(X)$, and the whole block).
3. The same sentence, judged for MLPs without skip connections ($X \mapsto
   \mathrm{MLP}(\mathrm{SA}(X))$). Paraphrased, not quoted: in the paper's analysis an MLP
   enters the bound through its Lipschitz constant, which can slow the convergence.

**The experiment, in `itde` terms.** A random post-norm `itde.TransformerIDE` (PyTorch's
initialisation, `TransformerIDE.init`, float64) and the equation's sub-flows, layer by
layer: with $A_l$ the attention field of layer $l$ (`attention_field`, the integral
operator $A(u)$ with its output kernel, no residual), $F_l$ the feed-forward field
(`feedforward_field`) and $P_l$ the projection onto the first constraint set
(`project1`, LayerNorm), each variant maps the state $u_l$ to $u_{l+1}$:

| variant | $u_{l+1}$ |
|---|---|
| `attention` | $A_l(u_l)$ (pure self-attention, the paper's SAN) |
| `attention + feed-forward` | $F_l(A_l(u_l))$ (no skip) |
| `attention + LayerNorm` | $P_l(A_l(u_l))$ (no skip) |
| `attention + skip` | $u_l + A_l(u_l)$: the Euler step $\Delta t = 1$ of the attention sub-flow |
| `Transformer block` | the model's own layer (`trajectory`): the Lie step of the whole equation |

Measured on random tokens $u_0$ ($n$ tokens, i.i.d. normal), over seeds (a new model and
input each):

- the relative residual $r(u) = \|u - \mathbf 1 \bar u^\top\|_F / \|u\|_F$ with $\bar u$ the
  token mean (the best $x$ in the Frobenius norm; the JSON also has the paper's composite
  norm with the same $\bar u$, an upper bound of theirs), the effective rank
  (`itde.analysis.effective_rank`) and $\sigma_2/\sigma_1$ (`itde.analysis.singular_values`)
  at every depth;
- the *cubic contraction* of one layer: states $u = \mathbf 1 x^\top + \varepsilon R$ near
  token uniformity, $\varepsilon$ from $10^{-1.5}$ to $10^{-4}$, and the slope of
  $\log r(\text{layer}(u))$ against $\log r(u)$ (3 for the paper's cubic bound, 1 for a
  layer that keeps the residual);
- in depth, from $u_0$: the layers until $r < 10^{-13}$ (about round-off in float64), the fit of
  $\log(-\log(r_l / r_0))$ against $l$ (doubly exponential with base 3 makes it linear with
  slope $\log 3 \approx 1.10$ once the cubic regime is reached; a single exponential makes
  it $\log l$), and $r_L / r_0$.

    python examples/rank_collapse.py [--tiny] [--out DIR] [--layers L] [--seeds S]

Writes `rank_collapse.json` and `rank_collapse.png` in `--out` (default
`runs/examples/rank_collapse`).
"""

from __future__ import annotations

import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _gallery import check_out, log, parser, positive_int, save, slope, verdict, write_json

import itde
from itde._plot import readable_log_ticks, series_style
from itde.analysis import effective_rank, singular_values

jax.config.update("jax_enable_x64", True)

NAME = "rank_collapse"
FLOOR = 1e-13  # below this relative residual float64 round-off dominates: excluded from fits
EPSILONS = tuple(10.0 ** (-k / 2) for k in range(3, 9))  # 10^-1.5 ... 10^-4
VARIANTS = (
    "attention",
    "attention + feed-forward",
    "attention + LayerNorm",
    "attention + skip",
    "Transformer block",
)
COLLAPSING = VARIANTS[:3]  # no skip connection
SKIPPING = VARIANTS[3:]


# ----------------------------------------------------------------------------- the maps
def layer_model(eq: itde.TransformerIDE, layer: int) -> itde.TransformerIDE:
    """Layer `layer` of a per-layer model as a one-layer model on depth [0, 1] (the same
    structure for every layer: one compilation serves them all)."""
    values = jax.tree.map(lambda a: a[layer : layer + 1], eq.controls.values)
    return eqx.tree_at(lambda m: m.controls, eq, itde.PiecewiseConstant(values))


def apply(variant: str, one: itde.TransformerIDE, u):
    """The map $u_l \\mapsto u_{l+1}$ of a variant for the one-layer model `one`."""
    if variant == "Transformer block":
        return one.trajectory(u)[-1]
    a = one.attention_field(0.0, u)
    if variant == "attention":
        return a
    if variant == "attention + feed-forward":
        return one.feedforward_field(0.0, a)
    if variant == "attention + LayerNorm":
        return one.project1(1.0, a)  # the layer's first norm (read at the step's end)
    if variant == "attention + skip":
        return u + a
    raise ValueError(f"unknown variant {variant!r}")


_apply = eqx.filter_jit(apply)


def residual(u):
    """$\\|u - \\mathbf 1 \\bar u^\\top\\|_F / \\|u\\|_F$, the relative residual from the token
    mean."""
    r = u - jnp.mean(u, axis=0, keepdims=True)
    return jnp.linalg.norm(r) / jnp.linalg.norm(u)


def residual_1inf(u):
    """The same residual in Dong et al.'s composite norm $\\sqrt{\\|M\\|_1 \\|M\\|_\\infty}$
    (max column and max row absolute sums), relative to $u$'s."""

    def norm(m):
        return jnp.sqrt(jnp.max(jnp.sum(jnp.abs(m), 0)) * jnp.max(jnp.sum(jnp.abs(m), 1)))

    return norm(u - jnp.mean(u, axis=0, keepdims=True)) / norm(u)


@jax.jit
def measures(u):
    s = singular_values(u)
    return {
        "residual": residual(u),
        "residual_1inf": residual_1inf(u),
        "effective_rank": effective_rank(u),
        "sigma2_over_sigma1": s[1] / s[0],
    }


# ----------------------------------------------------------------------- experiments
def depth_run(eq, u0, variant: str) -> dict[str, list[float]]:
    """The measures at every depth $l = 0..L$ of a variant started at `u0`."""
    u, rows = u0, [measures(u0)]
    for layer in range(eq.n_layers):
        u = _apply(variant, layer_model(eq, layer), u)
        rows.append(measures(u))
    return {k: [float(r[k]) for r in rows] for k in rows[0]}


def contraction(eq, key, n: int, variant: str) -> list[dict]:
    r"""Per layer: $r(\text{layer}(u))$ against $r(u)$ for $u = \mathbf 1 x^\top + \varepsilon R$
    ($R$ centred over the tokens), and the slope of the log-log fit."""
    d = eq.n_features
    kx, kr = jax.random.split(key)
    x = jax.random.normal(kx, (1, d), jnp.float64)
    r = jax.random.normal(kr, (n, d), jnp.float64)
    r = r - r.mean(0, keepdims=True)
    r = r * (jnp.linalg.norm(jnp.ones((n, 1)) * x) / jnp.linalg.norm(r))
    rows = []
    for layer in range(eq.n_layers):
        one = layer_model(eq, layer)
        r_in, r_out = [], []
        for eps in EPSILONS:
            u = jnp.ones((n, 1)) * x + eps * r
            r_in.append(float(residual(u)))
            r_out.append(float(residual(_apply(variant, one, u))))
        rows.append({"layer": layer, "r_in": r_in, "r_out": r_out, "slope": slope(r_in, r_out)})
    return rows


def doubly_exponential_fit(res: list[float]) -> dict:
    """The slope of $\\log(-\\log(r_l / r_0))$ against $l$ over the layers $l \\ge 1$ with
    $r_l$ above round-off and below $r_0$, and the observed orders
    $q_l = \\log(r_{l+1}/r_l) / \\log(r_l/r_{l-1})$ (3 for a cubic contraction)."""
    r0 = res[0]
    ls = [i for i in range(1, len(res)) if FLOOR < res[i] < r0]
    ls = [i for i in ls if i == ls[0] + ls.index(i)]  # the first consecutive run
    ys = [math.log(-math.log(res[i] / r0)) for i in ls]
    fit = None
    if len(ls) >= 2:
        mx, my = sum(ls) / len(ls), sum(ys) / len(ys)
        fit = sum((a - mx) * (b - my) for a, b in zip(ls, ys)) / sum((a - mx) ** 2 for a in ls)
    orders = []
    for i in range(1, len(res) - 1):
        a, b, c = res[i - 1], res[i], res[i + 1]
        if c > FLOOR and c < b < a:
            orders.append(math.log(c / b) / math.log(b / a))
    below = [i for i in range(len(res)) if res[i] < FLOOR]
    return {
        "fit_layers": ls,
        "loglog_slope": fit,
        "orders": orders,
        "last_order": orders[-1] if orders else None,
        "layers_to_floor": below[0] if below else None,
    }


def setup(tiny: bool, layers: int | None, seeds: int | None) -> dict:
    if tiny:
        s = {"n_layers": 6, "n_features": 16, "n_heads": 2, "n_tokens": 8, "seeds": 2}
    else:
        s = {"n_layers": 12, "n_features": 64, "n_heads": 4, "n_tokens": 32, "seeds": 8}
    if layers is not None:
        s["n_layers"] = layers
    if seeds is not None:
        s["seeds"] = seeds
    return s


# ----------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    p = parser(__doc__, NAME)
    p.add_argument("--layers", type=positive_int, default=None,
                   help="depth L (default 12; --tiny 6)")  # fmt: skip
    p.add_argument("--seeds", type=positive_int, default=None,
                   help="random models and inputs (default 8; --tiny 2)")  # fmt: skip
    args = p.parse_args(argv)
    out = check_out(p, args)
    s = setup(args.tiny, args.layers, args.seeds)
    n, L = s["n_tokens"], s["n_layers"]
    log(f"{s['seeds']} random post-norm models (PyTorch init, float64): {L} layers, width "
        f"{s['n_features']}, {s['n_heads']} heads; {n} random tokens")  # fmt: skip

    runs = {v: [] for v in VARIANTS}
    sweeps = {v: [] for v in VARIANTS}
    for seed in range(s["seeds"]):
        km, ku, ks = jax.random.split(jax.random.key(seed), 3)
        eq = itde.TransformerIDE.init(
            km, n_layers=L, n_features=s["n_features"], n_heads=s["n_heads"], dtype=jnp.float64
        )
        u0 = jax.random.normal(ku, (n, s["n_features"]), jnp.float64)
        for v in VARIANTS:
            run = depth_run(eq, u0, v)
            run.update(doubly_exponential_fit(run["residual"]))
            runs[v].append(run)
            sweeps[v].append(contraction(eq, ks, n, v))
        log(f"seed {seed}: r_L / r_0 = " + ", ".join(
            f"{v}: {runs[v][-1]['residual'][-1] / runs[v][-1]['residual'][0]:.1e}"
            for v in VARIANTS))  # fmt: skip

    summary = {}
    for v in VARIANTS:
        slopes = [row["slope"] for sw in sweeps[v] for row in sw]
        final = [r["residual"][-1] / r["residual"][0] for r in runs[v]]
        floors = [r["layers_to_floor"] for r in runs[v]]
        loglog = [r["loglog_slope"] for r in runs[v] if r["loglog_slope"] is not None]
        last = [r["last_order"] for r in runs[v] if r["last_order"] is not None]
        summary[v] = {
            "contraction_slope_median": float(np.median(slopes)),
            "contraction_slope_min": float(np.min(slopes)),
            "contraction_slope_max": float(np.max(slopes)),
            "final_ratio_median": float(np.median(final)),
            "final_ratio_min": float(np.min(final)),
            "final_ratio_max": float(np.max(final)),
            "layers_to_floor": floors,
            "loglog_slope_median": float(np.median(loglog)) if loglog else None,
            "last_order_median": float(np.median(last)) if last else None,
            "effective_rank_final_median": float(
                np.median([r["effective_rank"][-1] for r in runs[v]])
            ),
        }
        m = summary[v]
        log(
            f"{v:26s} one-layer slope {m['contraction_slope_median']:.3f} "
            f"[{m['contraction_slope_min']:.3f}, {m['contraction_slope_max']:.3f}], "
            f"r_L/r_0 median {m['final_ratio_median']:.2e}, layers to r < {FLOOR:g}: {floors}, "
            f"log(-log) slope {m['loglog_slope_median']}, last order {m['last_order_median']}"
        )

    claims = claims_of(summary, L)
    verdict(claims, tiny=args.tiny)
    figure(out, runs, sweeps, summary, s)
    payload = {
        "experiment": NAME,
        "reference": "Dong, Cordonnier, Loukas, Attention is not all you need: pure attention "
        "loses rank doubly exponentially with depth, ICML 2021 (arXiv:2103.03404)",
        "setup": {
            **s,
            "floor": FLOOR,
            "epsilons": EPSILONS,
            "dtype": "float64",
            "init": "itde.TransformerIDE.init (PyTorch's initialisation)",
        },
        "variants": list(VARIANTS),
        "summary": summary,
        "runs": runs,
        "contraction": sweeps,
        "claims": claims,
    }
    write_json(out, NAME, payload)
    return payload


def claims_of(summary: dict, L: int) -> list[dict]:
    att, ff = summary["attention"], summary["attention + feed-forward"]
    skip = [summary[v] for v in SKIPPING]
    return [
        {
            "claim": "without skip connections or MLPs the output converges doubly "
            "exponentially to a rank-1 matrix (quoted); the bound contracts the residual "
            "cubically per layer, ||res(SA(X))|| <= C ||res(X)||^3 (paraphrased, Theorem 2.2)",
            "measured": f"attention alone, one-layer slope of log r(out) vs log r(in): median "
            f"{att['contraction_slope_median']:.3f} (range {att['contraction_slope_min']:.3f} to "
            f"{att['contraction_slope_max']:.3f}, every layer and seed); in depth from random "
            f"tokens r < {FLOOR:g} after {att['layers_to_floor']} layers (pre-asymptotic: last "
            f"observed order log(r_l+1/r_l)/log(r_l/r_l-1) median "
            f"{_fmt(att['last_order_median'])}, slope of log(-log(r_l/r_0)) vs l "
            f"{_fmt(att['loglog_slope_median'])}; log 3 = 1.099)",
            "criterion": "every one-layer slope within 3 +- 0.3 (cubic), and every seed reaches "
            f"r < {FLOOR:g} within the {L} layers",
            "holds": bool(
                2.7 <= att["contraction_slope_min"]
                and att["contraction_slope_max"] <= 3.3
                and all(f is not None for f in att["layers_to_floor"])
            ),
        },
        {
            "claim": "skip connections stop the output from degeneration (quoted)",
            "measured": "; ".join(
                f"{v}: one-layer slope {summary[v]['contraction_slope_median']:.3f}, r_L/r_0 in "
                f"[{summary[v]['final_ratio_min']:.3f}, {summary[v]['final_ratio_max']:.3f}]"
                for v in SKIPPING
            ),
            "criterion": "with a skip connection (attention + skip, the Transformer block) every "
            "one-layer slope is within 1 +- 0.1 (the residual is kept, not contracted) and "
            f"r_L / r_0 >= 0.1 for every seed after {L} layers",
            "holds": bool(
                all(
                    0.9 <= m["contraction_slope_min"] and m["contraction_slope_max"] <= 1.1
                    for m in skip
                )
                and all(m["final_ratio_min"] >= 0.1 for m in skip)
            ),
        },
        {
            "claim": "MLPs stop the output from degeneration (quoted), here without skip "
            "connections: X -> MLP(SA(X))",
            "measured": f"attention + feed-forward: one-layer slope "
            f"{ff['contraction_slope_median']:.3f} (range {ff['contraction_slope_min']:.3f} to "
            f"{ff['contraction_slope_max']:.3f}), r_L/r_0 in [{ff['final_ratio_min']:.1e}, "
            f"{ff['final_ratio_max']:.1e}], r < {FLOOR:g} after {ff['layers_to_floor']} layers "
            f"(attention alone: {att['layers_to_floor']})",
            "criterion": "the same as for skip connections: every one-layer slope within 1 +- "
            f"0.1 and r_L / r_0 >= 0.1 for every seed after {L} layers",
            "holds": bool(
                0.9 <= ff["contraction_slope_min"]
                and ff["contraction_slope_max"] <= 1.1
                and ff["final_ratio_min"] >= 0.1
            ),
        },
    ]


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def figure(out: Path, runs: dict, sweeps: dict, summary: dict, s: dict) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)
    depths = np.arange(s["n_layers"] + 1)
    for i, v in enumerate(VARIANTS):
        st = series_style(i, len(VARIANTS))
        res = np.array([r["residual"] for r in runs[v]])
        med = np.median(np.maximum(res, 1e-17), axis=0)
        axes[0].plot(depths, med, label=v, color=st["color"], marker=st["marker"], ms=4)
        for row in res:
            axes[0].plot(depths, np.maximum(row, 1e-17), color=st["color"], lw=0.5, alpha=0.3)
        er = np.median([r["effective_rank"] for r in runs[v]], axis=0)
        axes[1].plot(depths, er, label=v, color=st["color"], marker=st["marker"], ms=4)
    axes[0].axhline(FLOOR, color="k", ls=":", lw=1, label=f"round-off floor {FLOOR:g}")
    axes[0].set_yscale("log")
    axes[0].set_ylim(1e-17, 3)
    axes[0].set_xlabel("layer l")
    axes[0].set_ylabel(r"relative residual $\|u - 1\bar u^\top\|_F / \|u\|_F$")
    axes[0].set_title(f"Residual from token uniformity (median of {s['seeds']} seeds)")
    axes[0].legend(fontsize=7)
    axes[1].set_yscale("log")
    readable_log_ticks(axes[1].yaxis)
    axes[1].set_xlabel("layer l")
    axes[1].set_ylabel("effective rank (Roy-Vetterli)")
    axes[1].set_title("Effective rank of the state (1: rank one)")
    # one layer near token uniformity: r_out against r_in (first seed, layer 0)
    for i, v in enumerate(VARIANTS):
        st = series_style(i, len(VARIANTS))
        sw = sweeps[v][0][0]
        slope_v = summary[v]["contraction_slope_median"]
        axes[2].loglog(sw["r_in"], sw["r_out"], color=st["color"], marker=st["marker"],
                       label=f"{v}: slope {slope_v:.2f}")  # fmt: skip
    axes[2].set_xlabel(r"$r(u)$, $u = 1x^\top + \varepsilon R$")
    axes[2].set_ylabel(r"$r(\mathrm{layer}(u))$")
    axes[2].set_title("One layer near rank one (slope 3: cubic; 1: kept)")
    axes[2].legend(fontsize=7)
    save(fig, out, NAME)


if __name__ == "__main__":
    main()
