r"""Tokens as interacting particles on the sphere: they cluster.

Geshkovski, Letrouit, Polyanskiy and Rigollet, *A mathematical perspective on
Transformers* (arXiv:2312.10794; Bull. AMS 2025), study self-attention with
$Q = K = V = I$ and layer normalisation as the projection onto the unit sphere: the
tokens $x_1, \dots, x_n \in S^{d-1}$ move by

$$\dot x_i = P^\perp_{x_i}\Big(\frac{1}{Z_i}\sum_j e^{\beta\langle x_i, x_j\rangle} x_j\Big),
\qquad P^\perp_x v = v - \langle x, v\rangle x,$$

with $\beta$ the inverse temperature ("(SA)" in the paper).

**Claims.**

1. Quoted (abstract of arXiv v1): "We develop a mathematical framework for analyzing
   Transformers based on their interpretation as interacting particle systems, which
   reveals that clusters emerge in long time."
2. Paraphrased, not quoted: for $d \ge 3$ and almost every initial configuration the
   tokens converge to a single cluster, i.e. every pairwise inner product
   $\langle x_i(t), x_j(t)\rangle \to 1$ (the paper proves it for small $\beta$ and for
   large $\beta$, Sections 4 and 5).
3. Paraphrased, not quoted: the larger $\beta$, the longer the dynamics linger near
   configurations of several clusters (metastability) before they merge, so the time to a
   single cluster grows with $\beta$.

**The experiment, in `itde` terms.** One attention head with $W^Q = \beta\sqrt{m}\,I$,
$W^K = W^V = W^O = I$ (the $1/\sqrt{m}$ of scaled dot-product attention cancelled, so the
score is $\beta\langle x_i, x_j\rangle$), no feed-forward ($W_1 = W_2 = 0$), and the
constraint set $S_1(\sigma_1 = 0, \sigma_2 = 1/\sqrt{m})$ of
`itde.LayerNormProjection` with $\varepsilon = 0$: for $m$ features that is the unit
sphere of the hyperplane $\{\mathrm{mean}_y u = 0\}$, i.e. $S^{d-1}$ with $d = m - 1$.
Tokens start uniform on that sphere. The controls are constant in depth
(`itde.LegendreControls` with one mode) and the continuum equation
$u_t = P_T(z) A(u)$ — which is (SA) — is integrated by projected RK4 (`itde.SCHEMES["rk4"]`)
through `itde.solve`. Measured: the smallest pairwise inner product over time, and the
first time it exceeds $1 - \delta$ ("time to cluster"), for each $\beta$, over seeds.

    python examples/particles.py [--tiny] [--out DIR]

Writes `particles.json` and `particles.png` in `--out` (default `runs/examples/particles`).
"""

from __future__ import annotations

import math
from pathlib import Path

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _gallery import log, parser, save, verdict, write_json

import itde

jax.config.update("jax_enable_x64", True)

DELTA = 1e-3  # clustered: every pairwise inner product >= 1 - DELTA


def particle_model(d: int, beta: float, t1: float) -> itde.TransformerIDE:
    """(SA) on S^{d-1} as a TransformerIDE: m = d + 1 features, Q = K = V = I."""
    m = d + 1
    eye = jnp.eye(m)[None]  # one head of width m: [heads, features, head_dim]
    att = itde.Attention(
        wq=beta * math.sqrt(m) * eye, wk=eye, wv=eye, wo=eye, bq=None, bk=None, bv=None, bo=None
    )
    ff = itde.FeedForward(w1=jnp.zeros((m, 1)), w2=jnp.zeros((1, m)), b1=None, b2=None)
    norm = itde.LayerNormProjection(0.0, 1.0 / math.sqrt(m), None, None, 0.0)
    block = itde.Block(att, norm, ff, norm)
    controls = itde.LegendreControls(itde.stack([block]), 0.0, t1)  # constant in depth
    return itde.TransformerIDE(controls, itde.Grid.unit(m))


def initial_tokens(key, n: int, d: int) -> jnp.ndarray:
    """n tokens uniform on S^{d-1}, embedded in the mean-zero hyperplane of R^{d+1}."""
    x = jax.random.normal(key, (n, d))
    x = x / jnp.linalg.norm(x, axis=1, keepdims=True)
    # an orthonormal basis of {v in R^{d+1}: sum v = 0}
    q, _ = jnp.linalg.qr(jnp.eye(d + 1) - 1.0 / (d + 1))
    return x @ q[:, :d].T


def min_inner(u: jnp.ndarray) -> jnp.ndarray:
    """Smallest pairwise inner product <x_i, x_j> of the (unit) tokens, [..., n, m] -> [...]."""
    g = jnp.einsum("...im,...jm->...ij", u, u)
    return jnp.min(g, axis=(-2, -1))


def run_case(d: int, beta: float, seeds: int, n: int, t1: float, dt: float, n_save: int):
    """Min pairwise inner product over time for `seeds` random starts (one compile per d:
    beta only changes the values in the model's arrays)."""
    ts = np.linspace(0.0, t1, n_save)
    keys = jax.random.split(jax.random.PRNGKey(1000 * d + int(10 * beta)), seeds)
    inner, drift = _solve_many(particle_model(d, beta, t1), keys, n, d, dt, tuple(ts))
    inner = np.asarray(inner)
    times = []
    for row in inner:
        hit = np.nonzero(row >= 1 - DELTA)[0]
        times.append(float(ts[hit[0]]) if hit.size else math.inf)
    return ts, inner, times, float(drift)


@eqx.filter_jit
def _solve_many(model, keys, n, d, dt, ts):
    rk4 = itde.SCHEMES["rk4"]

    def one(key):
        u0 = initial_tokens(key, n, d)
        sol = itde.solve(
            model, u0, solver=rk4.make(), terms=rk4.terms, dt0=dt,
            saveat=diffrax.SaveAt(ts=jnp.asarray(ts)),
        )  # fmt: skip
        us = sol.ys
        return min_inner(us), jnp.max(jnp.abs(jnp.linalg.norm(us, axis=-1) - 1.0))

    inner, drift = jax.vmap(one)(keys)
    return inner, jnp.max(drift)


def main(argv=None) -> dict:
    args = parser(__doc__, "particles").parse_args(argv)
    out = Path(args.out)
    if args.tiny:
        dims, betas, seeds, n, t1, dt, n_save, b_max = (3,), (1.0, 2.0), 2, 8, 40.0, 0.2, 201, 2.0
    else:
        dims, betas, seeds, n, t1, dt = (3, 8), (0.5, 1.0, 2.0, 4.0, 6.0), 6, 32, 3000.0, 0.2
        n_save, b_max = 3001, 4.0
    log(
        f"n = {n} tokens, d in {dims}, beta in {betas}, {seeds} seeds, t in [0, {t1}], "
        f"projected RK4 dt = {dt}"
    )
    cases = []
    for d in dims:
        for beta in betas:
            ts, inner, times, drift = run_case(d, beta, seeds, n, t1, dt, n_save)
            finite = [t for t in times if math.isfinite(t)]
            cases.append(
                {
                    "d": d,
                    "beta": beta,
                    "final_min_inner": inner[:, -1].tolist(),
                    "time_to_cluster": times,
                    "median_time": float(np.median(times)),
                    "clustered_fraction": len(finite) / len(times),
                    "max_norm_drift": drift,
                    "curve_median": np.median(inner, axis=0).tolist(),
                }
            )
            log(
                f"d={d} beta={beta:5.1f}: min <xi,xj> at t={t1:g}: "
                f"{np.min(inner[:, -1]):.6f} (worst seed), clustered {len(finite)}/{seeds}, "
                f"median time to cluster {np.median(times):.1f}"
            )

    # -------------------------------------------------------------- the comparison
    # claim 1 is judged where the horizon T suffices (beta <= b_max); above it the runs
    # that have not merged yet are the metastable states of claim 3, reported as such
    judged = [c for c in cases if c["beta"] <= b_max]
    others = [c for c in cases if c["beta"] > b_max]
    worst = min(min(c["final_min_inner"]) for c in judged)
    n_hit = sum(round(c["clustered_fraction"] * seeds) for c in judged)
    measured = (
        f"beta <= {b_max:g}: min over d, beta, seeds of min_ij <x_i, x_j>(T={t1:g}) = "
        f"{worst:.6f}; {n_hit}/{seeds * len(judged)} runs reached 1 - {DELTA:g}"
    )
    if others:
        measured += "; beta > {:g}: {} (clustered by T / runs)".format(
            b_max,
            ", ".join(
                f"d={c['d']} beta={c['beta']:g}: {round(c['clustered_fraction'] * seeds)}/{seeds}"
                for c in others
            ),
        )
    claims = [
        {
            "claim": "clusters emerge in long time (quoted); for d >= 3 every pairwise inner "
            "product tends to 1 (paraphrased)",
            "measured": measured,
            "criterion": f"every run with d >= 3 ends in one cluster (all pairwise inner products "
            f">= 1 - {DELTA:g})",
            "holds": bool(n_hit == seeds * len(judged) and worst >= 1 - DELTA),
        }
    ]
    for d in dims:
        rows = [c for c in cases if c["d"] == d]
        med = [c["median_time"] for c in rows]
        # non-decreasing up to seed noise (10%), and a real growth from end to end
        increasing = all(b >= 0.9 * a for a, b in zip(med, med[1:]))
        claims.append(
            {
                "claim": f"d={d}: the time to a single cluster grows with beta (paraphrased)",
                "measured": "median time to cluster "
                + ", ".join(f"beta={c['beta']:g}: {c['median_time']:.1f}" for c in rows),
                "criterion": "the median time to one cluster increases with beta, and the largest "
                "beta takes more than twice the smallest's",
                "holds": bool(increasing and med[-1] > 2 * med[0]),
            }
        )
    verdict(claims, tiny=args.tiny)

    # -------------------------------------------------------------- the figure
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    rows = [c for c in cases if c["d"] == dims[0]]
    for i, c in enumerate(rows):
        axes[0].plot(
            ts[1:],
            1 - np.asarray(c["curve_median"][1:]) + 1e-16,
            color=cmap(i / max(1, len(rows) - 1)),
            label=f"beta = {c['beta']:g}",
        )
    axes[0].axhline(DELTA, color="k", ls=":", lw=1, label=f"clustered: 1 - min = {DELTA:g}")
    axes[0].set_yscale("log")
    axes[0].set_xscale("log")
    axes[0].set_ylim(1e-8, 3)
    axes[0].set_xlabel("depth-time t (dimensionless)")
    axes[0].set_ylabel(r"$1 - \min_{i,j}\langle x_i, x_j\rangle$ (median over seeds)")
    axes[0].set_title(f"Tokens cluster on $S^{{{dims[0] - 1}}}$ (d = {dims[0]}, n = {n})")
    axes[0].legend(fontsize=8)
    for j, d in enumerate(dims):
        rows = [c for c in cases if c["d"] == d]
        b = [c["beta"] for c in rows]
        med = [c["median_time"] for c in rows]
        axes[1].plot(b, med, "o-", label=f"d = {d} (median of {seeds} seeds)", color=f"C{j}")
        marked = False
        for c in rows:
            tt = np.asarray(c["time_to_cluster"])
            ok = np.isfinite(tt)
            axes[1].scatter([c["beta"]] * int(ok.sum()), tt[ok], s=10, alpha=0.4, color=f"C{j}")
            if (~ok).any():
                axes[1].scatter(
                    [c["beta"] * (1 + 0.04 * j)] * int((~ok).sum()),
                    [t1] * int((~ok).sum()),
                    marker="^",
                    s=30,
                    color=f"C{j}",
                    label=None if marked else f"d = {d}: not clustered by T",
                )
                marked = True
    axes[1].set_xscale("log")
    axes[1].set_xticks(betas, [f"{b:g}" for b in betas])
    axes[1].minorticks_off()
    axes[1].set_yscale("log")
    axes[1].set_xlabel(r"inverse temperature $\beta$")
    axes[1].set_ylabel(f"time to cluster (1 - min <x_i,x_j> < {DELTA:g})")
    axes[1].set_title("Time to a single cluster vs beta (dots: seeds)")
    axes[1].legend(fontsize=8)
    save(fig, out, "particles")
    payload = {
        "experiment": "particles",
        "reference": "Geshkovski, Letrouit, Polyanskiy, Rigollet, A mathematical perspective "
        "on Transformers, arXiv:2312.10794",
        "setup": {
            "n_tokens": n,
            "dims": dims,
            "betas": betas,
            "seeds": seeds,
            "t1": t1,
            "dt": dt,
            "scheme": "rk4 (projected)",
            "delta": DELTA,
        },
        "times": ts.tolist(),
        "cases": cases,
        "claims": claims,
    }
    write_json(out, "particles", payload)
    return payload


if __name__ == "__main__":
    main()
