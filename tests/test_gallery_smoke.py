"""Every gallery script (`examples/`) builds its models and runs them, in the default run.

The scripts' `--tiny` runs train or sweep (tens of seconds each) and are `-m slow` in
`test_examples.py`, except `particles.py` and `rank_collapse.py`, whose tiny runs are default
there (and `depth_spectra.py`'s pieces: its profile of a model with known spectra, its
configs);
`pretrained_continuum.py`'s tiny run is slow too, the pieces of its pipeline being default
elsewhere (the conversion in `test_pretrained.py` and `test_hf.py`, the continuum form in
`test_continuum_form.py`, the depth study in `test_model_study.py`). Here each other
script's own model is built from the script's own code and configuration and run once, at
its tiny size, so an interface change in the library that a script has not followed fails
the default run (as `resnet_ode.py`'s controls missed the `part` argument of
`AbstractControls.__call__`). Where a run can be checked against mathematics it is:
the depth-indexed ResNet of `resnet_ode.py` is the Lie-split Transformer with per-layer
controls, and the parameter counts of `splitting_blocks.py` differ by LayerNorm's gain
and shift exactly.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.train import TASKS, build_model, predict

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
# scripts whose tiny run is in test_examples.py (particles and rank_collapse default,
# pretrained_continuum and depth_spectra slow, depth_spectra's pieces default there)
TINY_RUN_ELSEWHERE = {"particles", "pretrained_continuum", "rank_collapse", "depth_spectra"}
SMOKED = {"resnet_ode", "splitting_blocks", "resolution_transfer"}


@pytest.fixture(scope="module")
def gallery():
    sys.path.insert(0, str(EXAMPLES))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the scripts read `configs/...` relative to the repository


def test_every_gallery_script_is_covered():
    scripts = {p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_")}
    assert scripts == SMOKED | TINY_RUN_ELSEWHERE, scripts


# ------------------------------------------------------------------------ resnet_ode
@pytest.fixture(scope="module")
def resnet_ode(gallery):
    """The script and three knots (blocks with the exact projection) of its width."""
    mod = gallery("resnet_ode")
    keys = jax.random.split(jax.random.key(0), 3)
    kw = dict(mod.WIDTH, dtype=jnp.float64)
    return mod, [mod.exact_norms(itde.Block.init(k, **kw)) for k in keys]


def test_resnet_ode_controls_serve_every_part(resnet_ode):
    """`DepthKnots(t, side, part)` is that operator of the whole block, piecewise constant
    on [k/N, (k+1)/N) and, in the linear form, the interpolation between knots."""
    mod, blocks = resnet_ode
    knots, n = itde.stack(blocks), jnp.asarray(2)
    for linear, t, side in ((False, 0.5, "left"), (True, 0.25, "right")):
        controls = mod.DepthKnots(knots, n, linear=linear)
        whole = controls(t, side)
        for part in ("attention", "norm1", "feedforward", "norm2"):
            assert bool(eqx.tree_equal(controls(t, side, part), getattr(whole, part)))
    wq = [np.asarray(b.attention.wq) for b in blocks]
    step = mod.DepthKnots(knots, n)
    np.testing.assert_array_equal(step(0.5, "left").attention.wq, wq[0])  # end of layer 0
    np.testing.assert_array_equal(step(0.5, "right").attention.wq, wq[1])  # start of layer 1
    line = mod.DepthKnots(knots, n, linear=True)
    np.testing.assert_allclose(line(0.25).attention.wq, (wq[0] + wq[1]) / 2, rtol=0, atol=1e-15)


def test_resnet_ode_resnet_is_the_per_layer_lie_transformer(resnet_ode):
    """The script's N-layer residual network (N = 2 here, depth steps 1/N, one compiled
    solve for every N) equals `TransformerIDE` with per-layer controls of depth length 1/N
    solved by its default scheme (Lie, one step a layer), in float64. (Of the N + 1 knots
    the last is never used by N layers.)"""
    mod, blocks = resnet_ode
    d = mod.WIDTH["n_features"]
    u0s = jax.vmap(mod.EXACT)(jax.random.normal(jax.random.key(1), (2, 4, d), jnp.float64))
    out = np.asarray(mod.resnet(itde.stack(blocks), jnp.asarray(2), u0s))
    layers = itde.PiecewiseConstant(itde.stack(blocks[:2]), layer_length=0.5)
    ref = np.asarray(jax.vmap(itde.TransformerIDE(layers, itde.Grid.unit(d)))(u0s))
    assert out.shape == u0s.shape
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-12)


# ------------------------------------------------------------------ splitting_blocks
def test_splitting_blocks_models_build_and_run(gallery, in_root):
    """Each depth scheme's model of the tiny table (Lie, Strang, RK4 at equal kernel
    parameters) is built from the script's config; the RK4 one runs a forward pass (the
    Lie model of the same burgers config runs in the resolution-transfer test, and the
    Strang solve's gradient in `test_gradients_schemes.py`)."""
    mod = gallery("splitting_blocks")
    training = gallery("_training")
    counts = {}
    for task, (path, task_kw, width, optim) in mod.task_configs(tiny=True).items():
        for scheme, (model_kw, _) in mod.SCHEMES.items():
            cfg = training.config(path, task=task_kw, model={**width, **model_kw}, optim=optim)
            t = TASKS[cfg.task.name](cfg.task)
            model = build_model(cfg, jax.random.key(0), task=t)
            assert model.scheme == scheme
            counts[scheme] = training.n_params(model)
            if scheme != "rk4":
                continue
            x, _ = t.train_batch(jax.random.key(1), 2)
            out = np.asarray(predict(model, jnp.asarray(x)))
            assert out.shape == (2, task_kw["n_grid"]) and np.all(np.isfinite(out)), scheme
        # the Legendre models lack only LayerNorm's per-feature gain and shift
        assert counts["lie"] - counts["strang"] == width["n_layers"] * 2 * 2 * width["n_features"]
        assert counts["strang"] == counts["rk4"]


def test_splitting_blocks_figure_starts_its_bars_at_zero_and_states_the_parameters(gallery):
    """The bar chart once started its y-axis at 1.1 under the title "equal parameters"
    over 2457 vs 2329 parameters: the bars start at zero and the title gives the range."""
    mod = gallery("splitting_blocks")
    rows = [
        {"task": "burgers", "scheme": s, "mean": m, "std": 0.01, "values": [m - 0.01, m + 0.01],
         "params": p, "attention_evals": 2, "feedforward_evals": 2, "metric": "eval_rel_l2"}
        for s, m, p in (("lie", 1.15, 2457), ("strang", 1.12, 2329), ("rk4", 1.18, 2329))
    ]  # fmt: skip
    fig = mod.figure(rows, ["burgers"])
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0.0
    assert "parameters 2329-2457 (within 5%)" in ax.get_title()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lie", "strang", "rk4"]


# -------------------------------------------------------------- resolution_transfer
def test_resolution_transfer_model_runs_on_a_finer_grid(gallery, in_root):
    """The script's model, built for its training grid, runs unchanged on the finest
    evaluation grid (twice the points at the tiny size)."""
    mod = gallery("resolution_transfer")
    setup = mod.setup(tiny=True)
    cfg = mod.make_config(tiny=True)
    task = TASKS[cfg.task.name](cfg.task)
    assert task.grid_size == setup["n_train"]
    model = build_model(cfg, jax.random.key(0), task=task)
    fine = setup["grids"][-1]
    assert fine > setup["n_train"]
    x, y = task.on_grid(fine).eval_batch(jax.random.key(1), 2)
    out = np.asarray(mod.predict_jit(model, jnp.asarray(x)))
    assert out.shape == y.shape == (2, fine) and np.all(np.isfinite(out))
