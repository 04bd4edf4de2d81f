"""`itde.analysis.analyze`: every quantity against depth, checked against references
computed another way (numpy on the states of `TransformerIDE.trajectory`, numpy
eigenvalues of the weights, dense `jax.jacrev` Jacobians and their SVDs), and the refusals
of `itde analyze`. The command runs to completion on a random model of a solve config in
test_analysis_finishes.py, on a trained checkpoint in test_commands.py and on a Hugging
Face directory in test_model_study.py."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_analysis_finishes import SOLVE, B, D, L, N, layer_jacobians

import itde
from itde.analysis import analyze, report_depths
from itde.cli import main
from itde.cli._internal import _config_problem, _solver


@pytest.fixture(scope="module")
def network(tmp_path_factory):
    """The random model of test_analysis_finishes.py's solve config with its inputs, and
    its report with the command's depth integrator (Lie, one step per layer): the same
    shapes, so this module reuses the programs that module's runs compiled when both run
    in one process (the library's default integrator, `analyze(model, u0)`, reports on
    random models in test_many_shapes_solve.py)."""
    cfg = tmp_path_factory.mktemp("solve") / "solve.toml"
    cfg.write_text(SOLVE)
    m, u0, _, _, _ = _config_problem(str(cfg), B)
    return m, u0, analyze(m, u0, **_solver(m, "lie", 1.0, "--dt"))


def _effective_rank(u):
    s = np.linalg.svd(np.asarray(u), compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-np.sum(p * np.log(p))))


def _cosines(u):
    u = np.asarray(u)
    x = u / np.linalg.norm(u, axis=1, keepdims=True)
    c = x @ x.T
    off = ~np.eye(len(u), dtype=bool)
    return c[off].mean(), c[off].min()


def test_geometry_is_that_of_the_trajectory_states(network):
    m, u0, r = network
    assert r["depths"] == [0.0, 1.0, 2.0] and r["layer_boundaries"] == [0.0, 1.0, 2.0]
    assert (r["inputs"], r["tokens"], r["features"], r["heads"]) == (B, N, D, 2)
    states = np.stack([np.asarray(m.trajectory(u)) for u in u0])  # [inputs, depths, N, D]
    g = r["geometry"]
    for k in range(L + 1):
        want = np.mean([_effective_rank(states[i, k]) for i in range(B)])
        assert g["effective_rank"][k] == pytest.approx(want, rel=1e-10)
        mean, low = np.mean([_cosines(states[i, k]) for i in range(B)], axis=0)
        assert g["mean_cosine"][k] == pytest.approx(mean, rel=1e-10)
        assert g["min_cosine"][k] == pytest.approx(low, rel=1e-10)
    assert len(g["attention_entropy"]) == L + 1 and len(g["attention_entropy"][0]) == 2
    # after a post-LN layer the state is on the constraint set: residuals at round-off
    assert max(g["residuals"]["norm2.mean"][1:]) < 1e-12
    assert g["residuals"]["norm2.mean"][0] > 1e-3  # the random input is not


def test_spectra_are_those_of_each_layers_weights(network):
    m, _, r = network
    sp = r["spectra"]
    assert sp["depths"] == [0.0, 1.0]
    for n in range(L):
        att = m.controls.layer(n).attention
        for h in range(2):
            qk = np.asarray(att.wq[h]) @ np.asarray(att.wk[h]).T
            assert sp["qk_max_abs_eigenvalue"][n][h] == pytest.approx(
                np.abs(np.linalg.eigvals(qk)).max(), rel=1e-9
            )
            assert sp["qk_spectral_norm"][n][h] == pytest.approx(np.linalg.norm(qk, 2), rel=1e-9)
            vo = np.asarray(att.wv[h]) @ np.asarray(att.wo[h])
            assert sp["vo_spectral_norm"][n][h] == pytest.approx(np.linalg.norm(vo, 2), rel=1e-9)
        ff = m.controls.layer(n).feedforward  # Tong et al.'s feed-forward spectrum
        w1w2 = np.asarray(ff.w1) @ np.asarray(ff.w2)
        assert sp["w1w2_max_abs_eigenvalue"][n] == pytest.approx(
            np.abs(np.linalg.eigvals(w1w2)).max(), rel=1e-9
        )


def test_exponents_against_dense_jacobians(network):
    """The exponents against the SVDs of dense Jacobians: each layer's (`jax.jacrev` of the
    layer alone), the whole depth's (their product), and its blocks towards the last token."""
    m, u0, r = network
    ly = r["lyapunov"]
    assert ly["intervals"] == [[0.0, 1.0], [1.0, 2.0]]
    layers, whole = layer_jacobians(m, u0[0])
    for n in range(L):  # layer n's map u(n) -> u(n+1)
        s1 = np.linalg.svd(layers[n], compute_uv=False)[0]
        assert ly["leading_singular_value"][n] == pytest.approx(s1, rel=1e-5)
        assert ly["leading_exponent"][n] == pytest.approx(np.log(s1), rel=1e-5)
    s1 = np.linalg.svd(whole, compute_uv=False)[0]
    assert ly["whole_depth"]["leading_exponent"] == pytest.approx(np.log(s1) / L, rel=1e-5)
    # token exponents towards the last token: blocks of the rows of u(T)[-1]
    j = whole.reshape(N, D, N, D)[-1]  # [D, N, D]
    want = [np.log(np.linalg.svd(j[:, i, :], compute_uv=False)[0]) / L for i in range(N)]
    assert ly["token_target"] == N - 1 and ly["token_exponent"] == "exact"
    np.testing.assert_allclose(ly["token_exponents"], want, rtol=1e-9)


def test_smooth_controls_are_reported_on_equal_intervals(network):
    m = network[0]
    c = itde.LegendreControls.init(jax.random.key(5), n_modes=3, n_features=D, n_heads=2,
                                   n_hidden=8, activation="gelu", t1=2.0)  # fmt: skip
    eq = itde.TransformerIDE(c, itde.Grid.unit(D))
    u0 = jax.random.normal(jax.random.key(6), (N, D), jnp.float64)
    r = analyze(eq, u0, depths=4, dt0=0.25, lyapunov=False)
    assert r["depths"] == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0]) and r["layer_boundaries"] == []
    assert r["inputs"] == 1 and "lyapunov" not in r
    sol = itde.solve(eq, u0, dt0=0.25, saveat=diffrax.SaveAt(ts=jnp.asarray(r["depths"])))
    want = [_effective_rank(y) for y in np.asarray(sol.ys)]
    np.testing.assert_allclose(r["geometry"]["effective_rank"], want, rtol=1e-10)
    with pytest.raises(ValueError, match="`depths`=0 must be a positive"):
        report_depths(eq, 0)
    with pytest.raises(ValueError, match="must lie in the model's depth interval"):
        report_depths(eq, [0.0, 3.0])
    with pytest.raises(ValueError, match="per-layer controls"):
        report_depths(m, 4)


def test_analyze_refuses_bad_inputs(network):
    m, u0, _ = network
    with pytest.raises(ValueError, match="`u0` must be one state"):
        analyze(m, u0[0, 0])
    with pytest.raises(ValueError, match=r"`mask` must be \[inputs, tokens\]"):
        analyze(m, u0, jnp.ones((B, N + 1), bool))
    with pytest.raises(ValueError, match=r"`u0` is an empty batch \(no input\), shape "
                       r"\(0, \d+, \d+\).*at least one input"):  # fmt: skip
        analyze(m, u0[:0])
    with pytest.raises(ValueError, match=r"`u0` has no token, shape \(\d+, 0, \d+\)"):
        analyze(m, u0[:, :0])


def test_figure_has_one_panel_per_quantity_with_the_layers_marked(network):
    from itde.analysis import figure_report

    fig = figure_report(network[2])
    shown = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.get_title() for ax in shown]
    assert len(titles) == 10 and len(set(titles)) == 10  # nine quantities, the histogram
    assert "effective rank" in titles
    assert f"token Lyapunov exponents, exact (towards {N - 1})" in titles
    for ax in shown[:-1]:  # depth panels: the data and a dotted line per layer boundary
        assert ax.get_xlabel() == "depth t"
        assert sum(line.get_linestyle() == ":" for line in ax.lines) == L + 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--inputs", "0"], "`--inputs`=0 must be a positive"),
        (["--tol", "0"], "`--tol`=0.0 must be a positive"),
        (["--text", "x.txt"], "`--text` gives the inputs of a --hf model"),
        (["--checkpoint", "a", "--hf", "b"], "--checkpoint and --hf"),
        (["--dt", "2"], "`--dt`=2.0 is longer than one layer"),
        (["--scheme", "rk4"], "`scheme`='rk4' integrates the continuum equation"),
        (["--depths", "3"], "`depths`=3: this model has per-layer controls"),
    ],
)
def test_cli_analyze_refuses_bad_arguments(tmp_path, capsys, argv, said):
    assert main(["analyze", "--out", str(tmp_path / "x"), "--no-lyapunov", *argv]) == 2
    assert said in capsys.readouterr().err
