"""`itde.analysis.analyze` and `itde analyze` finish: an iteration short of its tolerance
is reported (its estimate, residual and `converged: false`), never raised; with enough
iterations the values are the dense Jacobian's (`jax.jacrev`, as the solve is a custom VJP;
`jnp.linalg.svd`). Also the command on a random model of a solve config (`itde analyze
--config`), with the exact token exponents and Tong et al.'s.

Compiled programs are shared: the library's model is the random model of the commands'
config (`_config_problem`, as `itde analyze --config` builds it) and the library calls
pass the command's depth integrator (Lie, one step per layer), so the commands and the
library calls of this module compile the solve, the geometry, the spectra and the
exponents' power iterations once (test_analysis_report.py reports on the same model, with
the same programs). `max_iters` and `rtol` are traced: one iteration and 300 share the
programs. The library's default integrator (`solver=None`) is what FlowMap and
`lyapunov_spectrum` default to (test_analysis_sensitivity.py); `analyze` runs with it in
test_analysis_estimate.py and, with the exponents, in the slow test below."""

import json
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.analysis import analyze, token_lyapunov_exponents
from itde.cli import main
from itde.cli._internal import _config_problem, _solver

N, D, L, B = 5, 6, 2, 2  # tokens, features, layers, inputs (the exponents: the first's)

SOLVE = f"""
[model]
n_layers = {L}
n_features = {D}
n_heads = 2
n_hidden = 8
[solve]
n_tokens = {N}
"""


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("solve") / "solve.toml"
    cfg.write_text(SOLVE)
    return cfg


@pytest.fixture(scope="module")
def model(config):
    """The random model and inputs of `itde analyze --config` (float64, as the command)."""
    m, u0, _, (scheme, dt), _ = _config_problem(str(config), B)
    assert u0.shape == (B, N, D) and u0.dtype == jnp.float64 and (scheme, dt) == ("lie", 1.0)
    return m, u0


@pytest.fixture(scope="module")
def fixed(model):
    """The command's depth integrator: Lie, one step per layer (the discrete network)."""
    return _solver(model[0], "lie", 1.0, "--dt")


@pytest.fixture(scope="module")
def short(model, fixed):
    """One iteration: far from the default tolerance."""
    m, u0 = model
    return analyze(m, u0, max_iters=1, block_size=2, token_target="all", **fixed)["lyapunov"]


@pytest.fixture(scope="module")
def full(model, fixed):
    m, u0 = model
    return analyze(m, u0, max_iters=300, block_size=2, token_target="all", **fixed)["lyapunov"]


@eqx.filter_jit
def _jacobian(network, u):
    """The dense Jacobian of a network's forward pass u(0) -> u(T) (`trajectory`), by
    `jax.jacrev`, `[u.size, u.size]`."""
    return jax.jacrev(lambda v: network.trajectory(v)[-1])(u).reshape(u.size, u.size)


def _layer(m, n):
    """Layer n of the network alone, a one-layer network (the same structure for every
    layer: one compilation serves all)."""
    values = jax.tree.map(lambda a: a[n : n + 1], m.controls.values)
    return eqx.tree_at(lambda e: e.controls, m, itde.PiecewiseConstant(values))


def layer_jacobians(m, u):
    """The dense Jacobian of each layer's map u(n) -> u(n+1) at the states of the forward
    pass from `u`, and of the whole depth by the chain rule (their product)."""
    states = m.trajectory(u)
    layers = [np.asarray(_jacobian(_layer(m, n), states[n])) for n in range(len(states) - 1)]
    whole = np.eye(u.size)
    for j in layers:
        whole = j @ whole
    return layers, whole


def test_one_iteration_reports_its_estimate_unconverged(short):
    assert short["converged"] == [False] * L and not short["whole_depth"]["converged"]
    assert not short["token_converged"] and not short["all_converged"]
    assert short["whole_depth"]["n_iterations"] == 1
    for r in [*short["residual"], short["whole_depth"]["residual"], *short["token_residuals"]]:
        assert math.isfinite(r) and r > 1e-6  # above the float64 default tolerance
    assert all(math.isfinite(v) for v in short["leading_exponent"])


def test_enough_iterations_converge_to_the_dense_values(model, full):
    m, u0 = model
    u = u0[0]
    assert full["converged"] == [True] * L and full["whole_depth"]["converged"]
    assert full["token_converged"] and full["all_converged"]
    assert max(full["residual"]) <= 1e-6 and max(full["token_residuals"]) <= 1e-6
    layers, whole = layer_jacobians(m, u)
    for n in range(L):  # layer n's map u(n) -> u(n+1)
        s1 = float(np.linalg.svd(layers[n], compute_uv=False)[0])
        assert full["leading_singular_value"][n] == pytest.approx(s1, rel=1e-9)
    s1 = float(np.linalg.svd(whole, compute_uv=False)[0])
    assert full["whole_depth"]["leading_singular_value"] == pytest.approx(s1, rel=1e-9)
    # the token exponents towards the whole output: token i's columns of the whole Jacobian
    cols = whole.reshape(N * D, N, D)
    want = [np.log(np.linalg.svd(cols[:, i], compute_uv=False)[0]) / L for i in range(N)]
    np.testing.assert_allclose(full["token_exponents"], want, rtol=1e-9)


def test_short_estimates_are_ritz_values_below_the_converged(short, full):
    for a, b in zip(short["leading_singular_value"], full["leading_singular_value"], strict=True):
        assert a <= b * (1 + 1e-12)
    assert short["whole_depth"]["leading_singular_value"] <= full["whole_depth"][
        "leading_singular_value"
    ] * (1 + 1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "said"),
    [
        (dict(max_iters=0), ValueError, "`max_iters`=0"),
        (dict(max_iters=2.5), TypeError, "`max_iters`=2.5 must be an integer"),
        (dict(rtol=2.0), ValueError, "`rtol`=2.0 must be in"),
        (dict(block_size=0), ValueError, "`block_size`=0"),
        (dict(block_size=D + 1), ValueError, f"`block_size`={D + 1} exceeds the {D} features"),
    ],
)
def test_analyze_refuses_bad_iteration_options(model, kwargs, error, said):
    m, u0 = model
    with pytest.raises(error, match=said.replace("[", r"\[")):
        analyze(m, u0, **kwargs)


@pytest.mark.runs("analyze --config")
def test_cli_reports_unconverged_exponents_and_writes_the_json_and_figure(config, model, tmp_path,
                                                                        capsys):  # fmt: skip
    """The command on the random model of a solve config: one iteration, so every exponent
    is reported unconverged (never raised); the table, the JSON and the figure."""
    out = tmp_path / "an"
    argv = ["analyze", "--config", str(config), "--inputs", str(B), "--max-iters", "1",
            "--block-size", "2", "--rtol", "1e-8", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "not converged within --max-iters" in printed and "whole depth (residual" in printed
    assert "eff.rank" in printed and "random post-LN model" in printed
    r = json.loads((out / "analysis.json").read_text())
    assert r["inputs"] == B and r["tokens"] == N and r["source"]["scheme"] == "lie"
    assert r["depths"] == [0.0, 1.0, 2.0]
    ly = r["lyapunov"]
    assert ly["converged"] == [False, False] and ly["whole_depth"]["n_iterations"] == 1
    assert all(r > 1e-8 for r in ly["residual"]) and not ly["all_converged"]
    assert ly["token_exponent"] == "exact" and ly["token_target"] == N - 1
    assert (out / "analysis.png").stat().st_size > 10_000


@pytest.mark.runs("analyze --exponent tong")
def test_cli_analyze_with_tongs_exponent(config, model, tmp_path, capsys):
    """`--exponent tong`: the report's token exponents are Tong et al.'s, equal to the
    library's on the same model and state (the library's against a port of their code:
    test_analysis_peers.py)."""
    out = tmp_path / "an"
    argv = ["analyze", "--config", str(config), "--inputs", str(B), "--exponent", "tong",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert f"token exponents (tong, first input, towards {N - 1})" in capsys.readouterr().out
    r = json.loads((out / "analysis.json").read_text())
    assert r["lyapunov"]["token_exponent"] == "tong" and r["lyapunov"]["token_target"] == N - 1
    m, u0 = model
    want = jax.jit(lambda u: token_lyapunov_exponents(m, u, method="tong"))(u0[0])
    np.testing.assert_allclose(r["lyapunov"]["token_exponents"], want.exponents[:, 0], rtol=1e-9)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--max-iters", "0"], "`--max-iters`=0 must be a positive number of iterations"),
        (["--rtol", "1.5"], "`--rtol`=1.5 must be in [1e-15, 1)"),
        (["--rtol", "0"], "`--rtol`=0 must be in [1e-15, 1)"),
        (["--block-size", "0"], "`--block-size`=0 must be a positive number of vectors"),
    ],
)
def test_cli_refuses_bad_iteration_flags(tmp_path, capsys, argv, said):
    assert main(["analyze", "--out", str(tmp_path / "x"), *argv]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("head_dim", [None, 11])
def test_leading_spectra_are_numpys_leading_values_gated_gqa(head_dim):
    """The report's spectra (small symmetric eigenproblems, no full SVD) against NumPy's
    dense values on a gated feed-forward with grouped-query attention (query head m reads
    key head m // 2); heads narrower than the features (2 of 8) and wider (11)."""
    from itde.analysis._internal import leading_spectra

    m = itde.TransformerIDE.init(jax.random.key(13), n_layers=2, n_features=8, n_heads=4,
                                 n_hidden=12, gated=True, n_kv_heads=2,
                                 head_dim=head_dim)  # fmt: skip
    m = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx_float(a) else a, m)
    sp = leading_spectra(m)
    for n in range(2):
        layer = m.controls.layer(n)
        att, ff = layer.attention, layer.feedforward
        for h in range(4):
            qk = np.asarray(att.wq[h]) @ np.asarray(att.wk[h // 2]).T
            vo = np.asarray(att.wv[h // 2]) @ np.asarray(att.wo[h])
            want = np.abs(np.linalg.eigvals(qk)).max()
            assert float(sp.qk_max_abs_eigenvalue[n, h]) == pytest.approx(want, rel=1e-9)
            assert float(sp.qk_spectral_norm[n, h]) == pytest.approx(
                np.linalg.norm(qk, 2), rel=1e-9
            )
            assert float(sp.vo_spectral_norm[n, h]) == pytest.approx(
                np.linalg.norm(vo, 2), rel=1e-9
            )
        w1, w2 = np.asarray(ff.w1), np.asarray(ff.w2)
        assert float(sp.w1_spectral_norm[n]) == pytest.approx(np.linalg.norm(w1, 2), rel=1e-9)
        assert float(sp.w2_spectral_norm[n]) == pytest.approx(np.linalg.norm(w2, 2), rel=1e-9)
        want = np.abs(np.linalg.eigvals(w1 @ w2)).max()
        assert float(sp.w1w2_max_abs_eigenvalue[n]) == pytest.approx(want, rel=1e-9)


def eqx_float(a):
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def test_progress_says_the_expected_time_before_the_long_work(model, fixed, monkeypatch):
    """`analyze(progress=...)`: the plan first and the expected time of the whole run
    ("expects about ...", priced from the shape) before any work; then a line per stage,
    the estimate measured again from the first warm interval (the second) on, before the
    exponents' long work (the whole depth and the token exponents), every later stage
    line but the last with an updated estimate."""
    import io

    from itde.analysis._internal import _report

    m, u0 = model
    buf = io.StringIO()
    calls = []
    leading, tokens = _report._leading, _report._tokens

    def spy(name, f):
        def g(*a, **k):
            calls.append((name, buf.getvalue().count("\n")))
            return f(*a, **k)

        return g

    monkeypatch.setattr(_report, "_leading", spy("leading", leading))
    monkeypatch.setattr(_report, "_tokens", spy("tokens", tokens))
    analyze(m, u0, block_size=2, max_iters=50, token_target="all", progress=buf, **fixed)
    lines = buf.getvalue().splitlines()
    assert all(line.startswith("itde analyze: ") for line in lines)
    assert f"{L} intervals" in lines[0] and "up to 50 iterations" in lines[0]
    expects = [i for i, line in enumerate(lines) if " expects about " in line]
    assert expects == [1], lines  # said once, before the first stage starts
    assert lines[2].startswith("itde analyze: solve ")
    assert "10 iterations an exponent; at most " in lines[1] and "max_iters=50" in lines[1]
    # measured again when the second interval ends, before the whole depth and the token
    # exponents are computed (calls 3 and 4)
    assert [c[0] for c in calls] == ["leading"] * (L + 1) + ["tokens"]
    again = [i for i, line in enumerate(lines) if " in all, " in line]
    assert "exponent over [1, 2] took" in lines[again[0]]
    assert all(again[0] < before for _, before in calls[L:])
    later = [line for line in lines[again[0] + 1 :] if " took " in line]
    assert len(later) == 2 and "in all" in later[0] and "iterations)" in later[0]


def test_progress_refuses_what_is_not_a_stream(model):
    m, u0 = model
    with pytest.raises(TypeError, match="`progress` must be True"):
        analyze(m, u0, progress="yes")


@pytest.mark.slow  # ~15 s: a dense Jacobian of the real tokens
def test_padding_at_the_end_is_dropped_from_the_exponents_exactly(model):
    """The first input padded at the end: its exponents are those of its real tokens alone
    (the padding is left out of every JVP and VJP; the dense Jacobian of the 3 real tokens'
    flow is the reference), None on the padded tokens."""
    m, u0 = model
    mask = jnp.asarray([[True, True, True, False, False]])
    ly = analyze(m, u0[:1], mask, block_size=2, max_iters=300, rtol=1e-10)["lyapunov"]
    assert ly["token_exponents"][3:] == [None, None] and ly["token_target"] == 2
    layers, whole = layer_jacobians(m, u0[0, :3])
    s1 = float(np.linalg.svd(layers[0], compute_uv=False)[0])
    assert ly["leading_singular_value"][0] == pytest.approx(s1, rel=1e-9)
    whole = whole.reshape(3, D, 3, D)
    want = [np.log(np.linalg.svd(whole[2, :, i], compute_uv=False)[0]) / L for i in range(3)]
    np.testing.assert_allclose(ly["token_exponents"][:3], want, rtol=1e-9)


@pytest.mark.slow
def test_gpt2_124m_shape_finishes_and_reports():
    """`analyze` at GPT-2 124M's shape (12 layers, 768 features, 12 heads; random weights of
    `transformers.GPT2Config()`) with the exponents: it finishes (the spectra and the token
    blocks take LAPACK one matrix at a time) and reports every interval. 16 tokens and 10
    iterations keep it a few minutes on CI's 2 cores; 64 tokens with `max_iters=30` took
    21 min on a loaded 2-core machine (746 s of CPU), layers 7-12 unconverged."""
    tf = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import torch

    torch.manual_seed(0)
    hf = tf.GPT2Model(tf.GPT2Config()).eval().double()
    m = itde.from_hf(hf)
    ids = jax.random.randint(jax.random.key(0), (1, 16), 0, 50257)
    u0 = jax.vmap(m.embed)(ids)
    report = analyze(m.equation, u0, max_iters=10)
    ly = report["lyapunov"]
    assert report["tokens"] == 16 and report["features"] == 768 and report["heads"] == 12
    assert len(ly["leading_exponent"]) == 12 and len(ly["token_exponents"]) == 16
    assert all(v is not None and math.isfinite(v) for v in ly["leading_exponent"])
    assert all(v is not None and math.isfinite(v) for v in ly["token_exponents"])
    assert all(math.isfinite(r) for r in ly["residual"])
    print(f"GPT-2 124M shape, 16 tokens: {report['wall_s']:.0f} s; converged {ly['converged']}")
