"""Continuous token and feature domains: function kernels on any grid, blocked attention,
2-D token domains, and the resolution convergence study."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.studies import run_grid_study
from itde.studies._internal import ConvergeExperiment, GridProblem, StudyConfig, _grid

GL = itde.GaussLegendre


def _function_model(n_layers=2, modes=4, activation="gelu", seed=0):
    L = itde.LegendreBasis
    b = L(modes, (0.0, 1.0))
    keys = jax.random.split(jax.random.key(seed), n_layers)
    blocks = [
        itde.FunctionBlock.init(
            k,
            n_heads=2,
            feature_basis=b,
            head_basis=b,
            hidden_basis=b,
            head_rule=GL(interval=(0, 1)),
            n_head_nodes=12,
            hidden_rule=GL(interval=(0, 1)),
            n_hidden_nodes=12,
            activation=activation,
            scale=0.5,
            decay=0.5,
        )
        for k in keys
    ]
    return itde.PiecewiseConstant(itde.stack(blocks)), itde.FunctionField.init(
        jax.random.key(seed + 7), b, b, decay=0.5
    )


def test_on_grid_is_zero_shot_resolution_transfer():
    controls, f = _function_model()
    coarse = itde.TransformerIDE(controls, itde.Grid(GL(interval=(0, 1)), GL(interval=(0, 1)), 12))
    fine = coarse.on_grid(
        itde.Grid(GL(interval=(0, 1)), GL(interval=(0, 1)), 24), n_head_nodes=20, n_hidden_nodes=20
    )
    assert fine.grid.n_features == 24
    att = fine.controls.layer(0).attention
    assert att.n_head_nodes == 20

    # the same function evaluated on both grids: compare a smooth output functional
    def J(model, n):
        u = model(f.sample_grid(model.grid, n))
        x, w = model.grid.tokens.nodes_weights(n)
        y, v = model.grid.features.nodes_weights(model.grid.n_features)
        return float(jnp.sum(w[:, None] * v[None, :] * np.cos(2 * x)[:, None] * (1 + y) * u))

    jc, jf = J(coarse, 12), J(fine, 24)
    assert abs(jc - jf) < 1e-8 * max(1.0, abs(jf))  # Gauss-Legendre: both are resolved


def test_discrete_models_cannot_change_grid():
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=8, n_heads=2)
    with pytest.raises(TypeError, match="function"):
        m.on_grid(itde.Grid.unit(16))


# blocked == dense stays in the default run at operator level (test_blocked_attention) and
# for a whole masked model (test_family); the model-level study grid case is -m slow
@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_blocked_model_equals_dense_model(causal):
    import torch
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(
        16, 4, 24, dropout=0.0, batch_first=True, dtype=torch.float64
    )
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    dense = itde.from_torch(enc, causal=causal)
    blocked = dataclasses.replace(dense, attention_core=itde.Blocked(5))
    x = jax.random.normal(jax.random.key(1), (23, 16), jnp.float64)
    np.testing.assert_allclose(np.asarray(blocked(x)), np.asarray(dense(x)), atol=1e-12)
    # and with non-uniform token weights
    grid = itde.Grid(GL(interval=(0, 1)), itde.Midpoint(), 16)
    d2, b2 = (dataclasses.replace(m, grid=grid) for m in (dense, blocked))
    np.testing.assert_allclose(np.asarray(b2(x)), np.asarray(d2(x)), atol=1e-12)
    with pytest.raises(TypeError, match="attention_core"):
        dataclasses.replace(dense, attention_core="flash")
    with pytest.raises(ValueError, match="block_size"):
        itde.Blocked(0)
    with pytest.raises(TypeError, match="block_size"):
        itde.Blocked(2.5)


def test_two_dimensional_token_domain():
    g2 = itde.TensorGrid2D(GL(interval=(0, 1)), itde.Trapezoid(interval=(0, 2)), 3, 4)
    m = itde.TransformerIDE.init(
        jax.random.key(0),
        n_layers=2,
        n_features=8,
        n_heads=2,
        grid=itde.Grid(g2, itde.Midpoint(), 8),
    )
    x = jax.random.normal(jax.random.key(1), (12, 8))
    out = m(x)
    # attention with the product weights given explicitly as the log-bias
    att = m.controls.layer(0).attention
    lw = jnp.log(
        jnp.asarray(
            np.outer(
                GL(interval=(0, 1)).nodes_weights(3)[1],
                itde.Trapezoid(interval=(0, 2)).nodes_weights(4)[1],
            ).ravel()
        )
    )
    np.testing.assert_allclose(
        np.asarray(m.attention_field(0.0, x)), np.asarray(att(x, token_log_weights=lw)), atol=1e-12
    )
    assert out.shape == (12, 8)
    with pytest.raises(ValueError, match=r"12|TensorGrid2D"):
        m(jax.random.normal(jax.random.key(1), (10, 8)))


def test_two_dimensional_grid_given_to_a_one_dimensional_model():
    _, f = _function_model()
    g2 = itde.TensorGrid2D(GL(interval=(0, 1)), GL(interval=(0, 1)), 3, 4)
    with pytest.raises(ValueError, match="2-D token domain"):
        f.sample_grid(itde.Grid(g2, GL(interval=(0, 1)), 8), 12)


def test_too_few_nodes_for_the_modes_warns():
    controls, f = _function_model(modes=6)
    m = itde.TransformerIDE(controls, itde.Grid(GL(interval=(0, 1)), GL(interval=(0, 1)), 4))
    with pytest.warns(UserWarning, match="4"):
        m(f.sample_grid(m.grid, 8))


def test_grid_with_wrong_interval_for_function_kernels():
    controls, f = _function_model()
    m = itde.TransformerIDE(controls, itde.Grid.unit(8))
    with pytest.raises(ValueError, match="interval"):
        m(jnp.ones((5, 8)) + jnp.arange(8.0))


def _study(axis, rules, nodes, reference_nodes):
    cfg = ConvergeExperiment()
    study = dataclasses.replace(
        cfg.study, axis=axis, rules=rules, nodes=nodes, reference_nodes=reference_nodes, layers=1
    )
    return run_grid_study(dataclasses.replace(cfg, study=study), axis, progress=False)


@pytest.mark.slow  # the default-suite budget; same property at small size: see note
def test_token_axis_midpoint_order():
    """The default-run representative of the resolution studies: a few coarse grids."""
    res = _study("tokens", ("midpoint",), (8, 16, 32), 40)
    row, causal = res["results"]  # the tokens axis adds one causal row per rule
    assert row["scheme"] == "midpoint" and row["n"] == [8, 16, 32]
    assert row["observed_order"] == pytest.approx(2, abs=0.25), row["errors"]
    assert causal["scheme"] == "causal-midpoint" and causal["expected_order"] == 2.0
    assert causal["observed_order"] == pytest.approx(2, abs=0.3), causal["errors"]
    json.dumps(res)  # JSON-ready, "n" in place of "dt"
    assert "dt" not in row


@pytest.mark.slow
def test_token_axis_orders():
    res = _study("tokens", ("midpoint", "simpson", "gauss-legendre"), (16, 32, 64, 128), 160)
    rows = {r["scheme"]: r for r in res["results"]}
    assert rows["midpoint"]["observed_order"] == pytest.approx(2, abs=0.2)
    assert rows["simpson"]["observed_order"] == pytest.approx(4, abs=0.3)
    gl = rows["gauss-legendre"]
    assert gl["errors"][1] < 1e-10 and gl["n_reaching_1e-10"] <= 32
    json.dumps(res)  # JSON-ready, "n" in place of "dt"
    assert "n" in gl and "dt" not in gl


@pytest.mark.slow
def test_token_axis_causal_orders():
    """Causal (Volterra) rows against references by other methods: order 2, 4, geometric."""
    res = _study("tokens", ("trapezoid", "simpson", "gauss-legendre"), (16, 32, 64, 128), 192)
    rows = {r["scheme"]: r for r in res["results"]}
    assert rows["causal-trapezoid"]["observed_order"] == pytest.approx(2, abs=0.2)
    assert rows["causal-simpson"]["observed_order"] == pytest.approx(4, abs=0.3)
    assert rows["causal-gauss-legendre"]["n_reaching_1e-10"] <= 64
    assert res["causal_reference_gap"] < 1e-12  # spectral vs Gregory-Richardson references


@pytest.mark.slow
def test_feature_axis_orders_and_periodic_row():
    res = _study("features", ("trapezoid", "periodic-trapezoid"), (16, 32, 64), 96)
    rows = {r["scheme"]: r for r in res["results"]}
    assert rows["trapezoid"]["observed_order"] == pytest.approx(2, abs=0.2)
    assert max(rows["periodic-trapezoid"]["errors"][1:]) < 1e-10


def test_study_config_validation():
    from itde import ConfigError

    with pytest.raises(ConfigError, match="study.rules"):
        StudyConfig(rules=("gauss",))
    with pytest.raises(ConfigError, match="reference_nodes"):
        StudyConfig(nodes=(8, 16), reference_nodes=16)
    assert GridProblem  # the problem builder is importable for custom studies
    assert _grid._grid("features", GL(interval=(0, 1)), 8)[0].n_features == 8
