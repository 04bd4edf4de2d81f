"""The gallery (`examples/`): every script runs in its `--tiny` mode, writes its JSON and
its figure, and prints a claim-vs-measured verdict; where a tiny run can check mathematics
it does (tokens stay on the sphere and cluster, first-order convergence of the residual
Transformer with smooth weights, equal kernel parameters across depth schemes, exact
trigonometric interpolation).

The tiny runs of `resnet_ode.py`, `splitting_blocks.py`, `resolution_transfer.py`,
`pretrained_continuum.py` and `depth_spectra.py` are behind `-m slow` (each is a few diffrax
compiles or a training step, up to a minute on a 2-core CPU); their models or pieces are
built and run by default (in `test_gallery_smoke.py`, or here). The tiny runs of
`particles.py` and `rank_collapse.py` are default."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def gallery():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield lambda name: importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def _run(module, name: str, out: Path, capsys) -> dict:
    payload = module.main(["--tiny", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads((out / f"{name}.json").read_text())
    png = (out / f"{name}.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000  # a real, non-empty figure
    keys = {"claim", "measured", "criterion", "holds", "judged"}
    assert data["claims"] and all(set(c) == keys for c in data["claims"])
    for c in data["claims"]:
        # a tiny run prints the claim, what it measured and the criterion, and says that it
        # judges nothing (a verdict of a smoke run meant nothing: "holds" at L2 1.84)
        assert f"claim:     {c['claim']}" in printed
        assert f"criterion: {c['criterion']}" in printed and not c["judged"]
    assert "-> holds" not in printed and "-> does not hold" not in printed
    assert printed.count("-> not judged: a --tiny run is a smoke test") == len(data["claims"])
    assert data["claims"] == json.loads(json.dumps(payload["claims"]))
    return data


def test_particles_cluster_on_the_sphere(gallery, tmp_path, capsys):
    mod = gallery("particles")
    data = _run(mod, "particles", tmp_path, capsys)
    for case in data["cases"]:
        assert case["max_norm_drift"] < 1e-10  # the projection keeps every token unit-norm
        # tiny: beta <= 2 on S^2 clusters well before t = 40
        assert min(case["final_min_inner"]) > 1 - mod.DELTA
        assert all(0 < t < data["setup"]["t1"] for t in case["time_to_cluster"])
        # E_beta never decreases along the flow: at dt = 0.2 (below the energy-stable
        # threshold of RK4) every step's decrease is round-off
        rise = np.asarray(case["energy_final"]) - np.asarray(case["energy_initial"])
        assert np.all(rise > 0)
        assert max(case["energy_violation_over_max"]) <= data["setup"]["energy_round_off"]
        # single linkage at tol 1e-2 joins no later than every cosine >= 1 - 1e-3
        assert all(0 < m <= t for m, t in zip(case["last_merge_time"], case["time_to_cluster"]))
        assert case["clusters_median"][0] == data["setup"]["n_tokens"]  # random start
        assert case["clusters_median"][-1] == 1
    assert data["claims"][0]["holds"]
    study = {(r["dt"], r["beta"]): r for r in data["energy_step_study"]}
    assert {dt for dt, _ in study} == set(data["setup"]["step_study"]["steps"])
    # the study's dt = 0.2 is the runs' own solve, and far beyond the stable step the
    # energy falls (the diagnostic is not vacuous)
    for case in data["cases"]:
        row = study[(data["setup"]["dt"], case["beta"])]
        assert row["violation"] == max(case["energy_violation"])
    assert max(r["violation_over_max_energy"] for r in data["energy_step_study"]) > 1e-3


def test_particle_model_is_the_attention_dynamics(gallery):
    """The TransformerIDE built by the example has the vector field of (SA): the
    softmax-weighted mean of the tokens, scores beta <x_i, x_j> (numpy reference)."""
    import jax

    mod = gallery("particles")
    beta, d, n = 2.5, 3, 5
    model = mod.particle_model(d, beta, 1.0)
    x = np.asarray(mod.initial_tokens(jax.random.PRNGKey(3), n, d))
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(x.sum(axis=1), 0.0, atol=1e-12)
    s = beta * x @ x.T
    w = np.exp(s - s.max(axis=1, keepdims=True))
    expected = (w / w.sum(axis=1, keepdims=True)) @ x
    np.testing.assert_allclose(np.asarray(model.attention_field(0.0, x)), expected, atol=1e-12)


@pytest.mark.slow  # ~45 s: three diffrax compiles in float64 (2-core CPU)
def test_resnet_ode_smooth_weights_converge_at_first_order(gallery, tmp_path, capsys):
    data = _run(gallery("resnet_ode"), "resnet_ode", tmp_path, capsys)
    assert 0.8 <= data["rate_smooth"] <= 1.2
    errs = [r["smooth"] for r in data["rows"]]
    assert all(b < a for a, b in zip(errs[:-1], errs[1:], strict=True))


@pytest.mark.slow  # ~70 s: a training step compiled for each of the three depth schemes
def test_splitting_blocks_table(gallery, tmp_path, capsys):
    data = _run(gallery("splitting_blocks"), "splitting_blocks", tmp_path, capsys)
    rows = {r["scheme"]: r for r in data["rows"]}
    assert set(rows) == {"lie", "strang", "rk4"}
    assert all(math.isfinite(v) for r in rows.values() for v in r["values"])
    # equal kernel parameters: the Legendre models lack only LayerNorm's per-feature gain
    # and shift (2 norms x 2 vectors x width, per layer)
    m = data["configs"]["burgers"]["model"]
    gain_shift = m["n_layers"] * 2 * 2 * m["n_features"]
    assert rows["lie"]["params"] - rows["strang"]["params"] == gain_shift
    assert rows["strang"]["params"] == rows["rk4"]["params"]


@pytest.mark.slow  # the default-suite budget; same property at small size: see note
def test_resolution_transfer_table(gallery, tmp_path, capsys):
    mod = gallery("resolution_transfer")
    data = _run(mod, "resolution_transfer", tmp_path, capsys)
    grids = [r["grid"] for r in data["rows"]]
    assert grids == list(data["setup"]["grids"])
    train = data["rows"][0]
    assert train["grid"] == data["setup"]["train_grid"]
    assert train["interpolated_exact"] == 0.0  # the training grid itself
    assert train["interpolated_prediction"] == pytest.approx(train["model_on_grid"], rel=1e-5)


def test_fourier_interpolation_is_exact_for_band_limited_fields(gallery):
    mod = gallery("resolution_transfer")
    m, n = 16, 64

    def field(k):
        x = 2 * np.pi * np.arange(k) / k
        return 0.3 + np.sin(x) - 0.5 * np.cos(3 * x) + 0.2 * np.sin(7 * x) + 0.1 * np.cos(8 * x)

    # cos(8x) is the Nyquist mode of 16 points: its samples are exact, the interpolant
    # must be cos(8x) itself on the finer grid
    np.testing.assert_allclose(mod.fourier_interpolate(field(m), n), field(n), atol=1e-12)


# slow: the longest default test (a depth study of BERT); the conversion it checks first is
# tests/test_pretrained.py's and test_hf.py's
@pytest.mark.slow
def test_pretrained_continuum_tiny(gallery, tmp_path, capsys):
    """The pipeline of the pretrained study on a random 2-layer BertModel: the conversion is
    Hugging Face's (float64 to round-off, also through the study's network output and the
    sentence pooling over real tokens), the continuum form is the network at dt = 1, the
    depth study converges at the orders of Strang and RK4, the continuum form's sub-steps
    approach the limit, and the fits through the layers interpolate them."""
    data = _run(gallery("pretrained_continuum"), "pretrained_continuum", tmp_path, capsys)
    c64, c32 = data["conversion"]["float64"], data["conversion"]["float32"]
    assert c64["hidden_max_abs"] < 1e-10 and c64["embedding_max_abs"] < 1e-10
    assert c32["hidden_max_abs"] < 1e-4 * c32["hidden_max_abs_ref"]
    assert data["continuum_dt1_max_abs"] < 1e-10
    # the study's `network` output is the network's sentence embeddings (not the limit's)
    assert data["network_vs_hf_embedding_max_abs"] < 1e-10
    study = data["study"]
    assert study["reference"]["self_error"] < 1e-5
    rows = {r["scheme"]: r for r in study["results"]}
    assert rows["lie"]["dt"] == [1.0, 0.5, 0.25]
    # Lie at one step per layer is the network itself
    assert rows["lie"]["errors"][0] == pytest.approx(study["network"]["distance_to_limit"])
    for name, order in (("strang", 1.7), ("rk4", 3.5)):
        e = rows[name]["errors"]
        assert all(b < a for a, b in zip(e[:-1], e[1:], strict=False)), (name, e)
        assert rows[name]["observed_order"] > order, (name, rows[name]["observed_order"])
    task = {r["variant"]: r for r in data["task"]}
    net, lim = task["network"], task["limit"]
    assert net["cos_network_mean"] == pytest.approx(1.0) and net["nn_same_as_network"] == 1.0
    assert lim["cos_limit_mean"] == pytest.approx(1.0)
    assert lim["cos_network_mean"] == pytest.approx(net["cos_limit_mean"])
    assert net["spearman_vs_network"] == pytest.approx(1.0)
    # the continuum form's Lie sub-steps move towards the limit
    towards = [net, task["continuum form, Lie dt=1/2"], task["continuum form, Lie dt=1/4"]]
    cos = [r["cos_limit_mean"] for r in towards]
    assert cos[0] < cos[1] < cos[2] < 1, cos
    assert data["depth_step_warnings"] == {"1/2": ["DepthStepWarning"], "1/4": ["DepthStepWarning"]}
    # and the original network sub-stepped is another network, further away at 1/4
    away = [task[f"original network, Lie dt=1/{n}"]["cos_network_mean"] for n in (2, 4)]
    assert away[1] < away[0] < 0.999, away
    sander = data["sander"]
    n_layers = study["model"]["layers"]
    assert max(sander["fit_residuals"][f"legendre_{n_layers}"].values()) < 1e-10
    spline = sander["splines"]["degree_3"]
    assert spline["fit_residual_max"] < 1e-12 and spline["rk4_self_error"] < 1e-2
    assert all(len(v) == n_layers - 1 for v in sander["layer_differences"].values())


def test_pretrained_continuum_helpers(gallery):
    """Spearman's correlation, nearest neighbours and the layer-to-layer differences."""
    mod = gallery("pretrained_continuum")
    a = np.array([0.1, 0.5, 0.3, 0.9, 0.7])
    assert mod.spearman(a, np.exp(a)) == pytest.approx(1.0)
    assert mod.spearman(a, -a) == pytest.approx(-1.0)
    assert mod.spearman(a, [1.0, 2.0, 3.0, 5.0, 4.0]) == pytest.approx(1 - 6 * 2 / 120)
    e = np.array([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]])
    assert mod.neighbours(e).tolist() == [1, 2, 1]
    import jax

    import itde

    layers = [np.full((2, 2), v) for v in (1.0, 3.0, 3.0)]
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, 0.0)
    blocks = [
        itde.Block(
            itde.Attention.init(jax.random.key(i), n_features=2, n_heads=1, dtype=np.float64),
            norm,
            itde.FeedForward(w, w, None, None, "relu"),
            norm,
        )
        for i, w in enumerate(layers)
    ]
    diffs = mod.layer_differences(itde.PiecewiseConstant(itde.stack(blocks)))
    assert diffs["feedforward.w1"] == pytest.approx([2.0, 0.0])
    assert not any(k.startswith("norm") for k in diffs)  # constant in depth: left out


# --------------------------------------------------------------------- rank_collapse
def test_rank_collapse_tiny(gallery, tmp_path, capsys):
    """Pure attention contracts the residual from token uniformity cubically per layer and
    reaches round-off within the tiny depth; with a skip connection the layer keeps it
    (slope 1) and the tokens keep their rank."""
    mod = gallery("rank_collapse")
    data = _run(mod, "rank_collapse", tmp_path, capsys)
    setup, floor = data["setup"], data["setup"]["floor"]
    assert data["variants"] == list(mod.VARIANTS)
    for v in mod.VARIANTS:
        assert len(data["runs"][v]) == setup["seeds"] == len(data["contraction"][v])
        for run in data["runs"][v]:
            assert len(run["residual"]) == setup["n_layers"] + 1
            assert 0.5 < run["residual"][0] <= 1  # random tokens: far from uniform
        slopes = [row["slope"] for sweep in data["contraction"][v] for row in sweep]
        assert len(slopes) == setup["seeds"] * setup["n_layers"]
        # res(A(1x^T + eps R)) = O(eps^3) (the eps^2 score terms that vary with the query,
        # times R); with a skip the eps R survives
        expected = 1.0 if v in mod.SKIPPING else 3.0
        assert all(abs(s - expected) < 0.1 for s in slopes), (v, slopes)
    for att, skip in zip(data["runs"]["attention"], data["runs"]["attention + skip"]):
        assert att["layers_to_floor"] is not None and min(att["residual"]) < floor
        assert att["effective_rank"][-1] < 1 + 1e-6  # rank one
        assert min(skip["residual"]) > 0.1 * skip["residual"][0]
        assert skip["effective_rank"][-1] > 2
    assert data["claims"][0]["holds"] and data["claims"][1]["holds"]


def test_rank_collapse_fit_on_a_doubly_exponential_sequence(gallery):
    """r_l = exp(-3^l) for l >= 1 (r_0 = 1): log(-log r_l) = l log 3 exactly; the observed
    order is 3 once the first step (from r_0 = 1, which is not exp(-1)) is passed."""
    mod = gallery("rank_collapse")
    res = [1.0] + [math.exp(-(3.0**k)) for k in range(1, 5)]  # down to exp(-81)
    fit = mod.doubly_exponential_fit(res)
    assert fit["fit_layers"] == [1, 2, 3]  # exp(-81) is below the round-off floor
    assert fit["loglog_slope"] == pytest.approx(math.log(3))
    assert fit["orders"] == pytest.approx([(9 - 3) / 3, (27 - 9) / (9 - 3)])  # [2, 3]
    assert fit["layers_to_floor"] == 4
    single = mod.doubly_exponential_fit([0.5**k for k in range(8)])
    assert single["orders"] == pytest.approx([1.0] * 6)


def test_rank_collapse_cli_errors_name_the_flag(gallery, tmp_path, capsys):
    mod = gallery("rank_collapse")
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--layers", "0", "--out", str(tmp_path)])
    assert "argument --layers: must be a positive integer, got '0'" in capsys.readouterr().err
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--out", str(f)])
    assert "argument --out" in capsys.readouterr().err


# --------------------------------------------------------------------- depth_spectra
@pytest.mark.slow  # ~65 s on a loaded 2-core CPU: a compiled training step, BERT, VJP solves
def test_depth_spectra_tiny(gallery, tmp_path, capsys, monkeypatch):
    """The pipeline: a smooth-depth charlm model trained for a few steps, its spectra at
    every depth, a random BERT's per layer (as converted and with its gains folded), and
    Tong et al.'s token exponents of every real token."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # configs/ is read from here
    mod = gallery("depth_spectra")
    data = _run(mod, "depth_spectra", tmp_path, capsys)
    setup, cfg = data["setup"], data["setup"]["config"]
    heads = cfg["model"]["n_heads"]
    for key in ("trained", "init"):
        p = data["profiles"][key]
        assert p["ts"] == pytest.approx(setup["depths"])
        assert np.asarray(p["per_head"]).shape == (len(setup["depths"]), heads)
        np.testing.assert_allclose(np.mean(p["per_head"], axis=1), p["mean"], rtol=1e-6)  # float32
    for key in ("minilm", "minilm_folded"):
        assert data["profiles"][key]["ts"] == [0.0, 1.0]  # the random BERT's two layers
    assert [c["judged"] for c in data["claims"]] == [False] * 3
    lm, bert = data["lyapunov"]["charlm"], data["lyapunov"]["minilm"]
    assert lm["n"] == setup["windows"] * cfg["task"]["context"]  # every token of every window
    assert bert["n"] > setup["sentences"]  # the real tokens only (padding is NaN)
    for v in (lm, bert):
        assert len(v["values"]) == v["n"] and all(map(math.isfinite, v["values"]))
        assert v["min"] <= v["mean"] <= v["max"]


def test_depth_spectra_profile_reads_every_head(gallery):
    """`qk_profile` on a model whose forms are known: layer l, head h has
    W^Q = c_l (h + 1) R diag(1, 2), W^K = I with R a rotation by 0.7, so its eigenvalues are
    c_l (h + 1) times those of R diag(1, 2) and the largest modulus is known in closed form;
    the fitted line through a linear profile is exact."""
    import jax.numpy as jnp

    import itde

    mod = gallery("depth_spectra")
    c = (1.0, 2.0, 4.0)
    th = 0.7
    rot = np.array([[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]]) @ np.diag([1.0, 2.0])
    top = np.max(np.abs(np.linalg.eigvals(rot)))
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, 0.0)
    ff = itde.FeedForward(jnp.zeros((2, 1)), jnp.zeros((1, 2)), None, None)
    eye = jnp.eye(2)[None].repeat(2, 0)
    blocks = [
        itde.Block(
            itde.Attention(
                wq=jnp.asarray(np.stack([cl * rot, 2 * cl * rot])),
                wk=eye,
                wv=eye,
                wo=eye,
                bq=None,
                bk=None,
                bv=None,
                bo=None,
            ),
            norm,
            ff,
            norm,
        )
        for cl in c
    ]
    model = itde.TransformerIDE(itde.PiecewiseConstant(itde.stack(blocks)), itde.Grid.unit(2))
    p = mod.qk_profile(model)
    assert p["ts"] == [0.0, 1.0, 2.0]
    np.testing.assert_allclose(p["per_head"], np.outer(c, [top, 2 * top]), rtol=1e-6)
    np.testing.assert_allclose(p["mean"], 1.5 * top * np.asarray(c), rtol=1e-6)
    f = mod.trend([0.0, 1.0, 2.0, 3.0], [1.0, 1.5, 2.0, 2.5])
    assert f["slope"] == pytest.approx(1.5) and f["intercept"] == pytest.approx(1.0)
    assert f["r2"] == pytest.approx(1.0) and f["relative_change"] == pytest.approx(1.5 / 1.75)


def test_depth_spectra_config_is_smooth_in_depth(gallery, monkeypatch, capsys):
    """The configs are the shipped charlm config with controls smooth in depth (so that
    spectra exist at every depth); bad flags are named."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # configs/ is read from here
    mod = gallery("depth_spectra")
    for tiny in (True, False):
        cfg = mod.make_config(tiny)
        assert cfg.task.name == "charlm" and cfg.model.continuous and cfg.model.eps == 0.0
    assert mod.make_config(True, steps=7).optim.steps == 7
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--steps", "-1"])
    assert "argument --steps: must be a positive integer, got '-1'" in capsys.readouterr().err
