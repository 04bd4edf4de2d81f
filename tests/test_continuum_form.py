"""The continuum form of converted networks: exact at one step per layer against the source
framework, and integrable at any step at the solvers' orders.

References: Hugging Face `transformers` and PyTorch themselves at Δt = 1; for the
refinements, the same equation solved by `Projected(Tsit5)` at a step 64 times finer (an
independent method of order 5) and the observed orders of the others against it.
"""

import warnings

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_hf import MASKS, _ids, _model

import itde
import itde_solvers as S


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The torch references here compute on tiny tensors: one torch thread (on a loaded
    2-core machine two threads synchronise on every small op, many times slower), the
    thread count restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _rates(errors):
    e = np.asarray(errors)
    return np.log2(e[:-1] / e[1:])


def _errors(model, u0, solver, steps, ref):
    """Max errors of the final state against `ref` at each depth step."""
    return [
        float(jnp.max(jnp.abs(itde.solve(model, u0, solver=solver, dt0=h).ys[-1] - ref)))
        for h in steps
    ]


@eqx.filter_jit
def _constant_steps(model, u0, solver, h):
    """u(T) by constant steps h, a traced value: one program serves every step size (each
    h a binary fraction of the layers, so the steps land on every boundary)."""
    return itde.solve(model, u0, solver=solver, dt0=h, max_steps=4 * 64,
                      stepsize_controller=diffrax.ConstantStepSize()).ys[-1]  # fmt: skip


def _constant_step_errors(model, u0, solver, steps, ref):
    """`_errors` with the step sizes in one compiled program."""
    return [float(jnp.max(jnp.abs(_constant_steps(model, u0, solver, jnp.asarray(h)) - ref)))
            for h in steps]  # fmt: skip


def _encoder(eps, seed=0, layers=3, norm_first=False):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        12, 3, 20, dropout=0.0, activation="gelu", batch_first=True, layer_norm_eps=eps,
        norm_first=norm_first, dtype=torch.float64,
    )  # fmt: skip
    enc = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    with torch.no_grad():  # distinct layers, gains far from 1, shifts far from 0
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = np.random.default_rng(seed).standard_normal((5, 12))
    with torch.no_grad():
        y = enc(torch.as_tensor(x[None]))[0].numpy()
    return enc, x, y


# ------------------------------------------------------------------ exact at Δt = 1
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_hugging_face_post_norm_models_are_exact_in_continuum_form(family):
    model = _model(family, torch.float64)
    m = itde.from_hf(model)
    cf = m.continuum_form()
    assert cf.embedding_norm.gain is None and cf.equation.readout is not None
    ids = _ids(family)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(MASKS))
    ref = ref.last_hidden_state.numpy()
    for i, k, r in zip(ids, MASKS, ref, strict=True):
        out = np.asarray(cf(jnp.asarray(i), attention_mask=jnp.asarray(k)))
        real = k == 1
        assert np.max(np.abs(out[real] - r[real])) / np.max(np.abs(r[real])) < 1e-10
    # the initial condition lies on the unit set: the embedding LayerNorm lost its affine map
    u0 = cf.embed(jnp.asarray(ids[0]))
    assert float(cf.equation.controls.layer(0).norm2.residual(u0)) < 1e-4  # eps = 1e-12


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pre_norm_models_are_their_own_continuum_form(family):
    m = itde.from_hf(_model(family, torch.float64))
    assert m.continuum_form() is m
    assert itde.continuum_form(m.equation) is m.equation


@pytest.mark.parametrize("eps,relaxation", [(0.0, False), (1e-5, False), (0.0, True)])
def test_torch_post_norm_encoder_is_exact_in_continuum_form(eps, relaxation):
    enc, x, y = _encoder(eps)
    cf = itde.continuum_form(itde.from_torch(enc, relaxation=relaxation))
    assert float(np.max(np.abs(np.asarray(cf(jnp.asarray(x))) - y))) < 1e-12
    batch = np.asarray(cf.batch(jnp.asarray(np.stack([x, 2 * x]))))
    assert float(np.max(np.abs(batch[0] - y))) < 1e-12
    # the states are normalised: every norm of the form is a unit projection
    blocks = cf.controls.blocks
    for norm in (blocks.norm1, blocks.norm2):
        assert norm.gain is None and norm.shift is None
        assert np.all(np.asarray(norm.sigma1) == 0) and np.all(np.asarray(norm.sigma2) == 1)


def test_post_norm_rms_model_is_exact_in_continuum_form():
    m = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=3, n_features=8, n_heads=2, norm="rms", bias=False,
        activation="gelu", dtype=jnp.float64,
    )  # fmt: skip
    gains = jax.random.uniform(jax.random.key(1), (2, 3, 8), jnp.float64, 0.5, 1.5)
    m = jax.tree_util.tree_map(lambda a: a, m)
    m = eqx_set_gains(m, gains)
    x = jax.random.normal(jax.random.key(2), (6, 8), jnp.float64)
    cf = m.continuum_form()
    assert cf.readout.shift is None and cf.controls.blocks.affine1.shift is None
    assert float(jnp.max(jnp.abs(cf(x) - m(x)))) < 1e-12
    ref = itde.solve(cf, x, solver=S.Projected(diffrax.Tsit5()), dt0=1 / 64).ys[-1]
    errors = _constant_step_errors(cf, x, S.Projected(S.RK4()), (1 / 4, 1 / 8, 1 / 16), ref)
    assert np.all(_rates(errors) > 3.6), errors


def eqx_set_gains(m, gains):
    import equinox as eqx

    return eqx.tree_at(
        lambda m: (m.controls.values.norm1.gain, m.controls.values.norm2.gain),
        m,
        (gains[0], gains[1]),
    )


# ------------------------------------------------------------------ refinement
# slow: by default the orders of a converted network's continuum form are measured in
# test_model_study.py::test_study_of_a_converted_network (Lie 1, Strang 2, RK4 4)
@pytest.mark.slow
@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_continuum_form_converges_at_the_solvers_orders(eps):
    enc, x, _ = _encoder(eps)
    cf = itde.from_torch(enc).continuum_form()
    u0 = jnp.asarray(x)
    ref = itde.solve(cf, u0, solver=S.Projected(diffrax.Tsit5()), dt0=1 / 64).ys[-1]

    strang = _errors(cf, u0, S.Strang(), (1 / 8, 1 / 16, 1 / 32), ref)
    rk4 = _errors(cf, u0, S.Projected(S.RK4()), (1 / 4, 1 / 8, 1 / 16), ref)
    lie = _errors(cf, u0, S.LieTrotter(), (1 / 8, 1 / 16, 1 / 32), ref)
    assert np.all(_rates(strang) > 1.8), strang
    assert np.all(_rates(rk4) > 3.6), rk4
    # the network's own scheme refined (regularised projections, from the raw input)
    # converges to the same limit, at order 1
    assert np.all((_rates(lie) > 0.85) & (_rates(lie) < 1.2)), lie
    # every state of a continuum solve lies on the fixed set of the regularised projection
    z = itde.solve(cf, u0, solver=S.Strang(), dt0=1 / 8).ys[-1]
    var = jnp.var(z, axis=-1)
    assert float(jnp.max(jnp.abs(var - (1 - eps)))) < 1e-12
    assert float(jnp.max(jnp.abs(jnp.mean(z, axis=-1)))) < 1e-12


def test_the_network_refined_is_another_network_and_says_so():
    enc, x, y = _encoder(1e-5)
    m = itde.from_torch(enc)
    u0 = jnp.asarray(x)
    with pytest.warns(itde.DepthStepWarning, match="continuum_form"):
        half = itde.solve(m, u0, dt0=0.5).ys[-1]
    assert float(jnp.max(jnp.abs(half - y))) > 0.1  # what the warning is about
    # the warning is given before the solve runs: as an error it stops the solve (no
    # compile), and the solves that must not warn are traced only (`jax.eval_shape`)
    with warnings.catch_warnings():
        warnings.simplefilter("error", itde.DepthStepWarning)
        for kwargs in (
            dict(stepsize_controller=diffrax.StepTo(ts=jnp.linspace(0.0, 3.0, 13))),
            dict(dt0=0.5, stepsize_controller=diffrax.ConstantStepSize()),
        ):
            with pytest.raises(itde.DepthStepWarning, match="continuum_form"):
                itde.solve(m, u0, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        itde.solve(m, u0)  # one step per layer: the network itself
        itde.solve(m, u0, stepsize_controller=diffrax.StepTo(ts=jnp.arange(4.0)))
        cf, pre = m.continuum_form(), itde.from_torch(_encoder(1e-5, norm_first=True)[0])
        jax.eval_shape(lambda u: itde.solve(cf, u, dt0=0.5).ys, u0)  # a refinement
        jax.eval_shape(lambda u: itde.solve(pre, u, dt0=0.5).ys, u0)  # pre-norm: norms inside
    with pytest.raises(ValueError, match="continuum_form"):
        itde.solve(m, u0, solver=S.Strang(), dt0=0.5)


# ------------------------------------------------------------------ the pieces
def test_fixed_points_of_a_regularised_projection():
    ln = itde.LayerNormProjection.scalar(0.3, 2.0, eps=0.5)
    fixed = ln.fixed_points()
    assert fixed.eps == 0.0 and float(fixed.sigma2) == pytest.approx(np.sqrt(3.5))
    v = jax.random.normal(jax.random.key(0), (4, 9), jnp.float64)
    p = fixed(v)
    assert float(jnp.max(jnp.abs(ln(p) - p))) < 1e-12  # its points are the map's fixed points
    rms = itde.RMSNormProjection(2.0, None, eps=0.5).fixed_points()
    assert float(rms.sigma) == pytest.approx(np.sqrt(3.5))
    with pytest.raises(ValueError, match="continuum_form"):
        itde.LayerNormProjection(0.0, 1.0, jnp.ones(9), None, 1e-5).fixed_points()
    with pytest.raises(ValueError, match="no fixed points"):
        itde.LayerNormProjection.scalar(0.0, 0.1, eps=0.5).fixed_points()


@pytest.mark.parametrize("norm", [itde.LayerNormProjection, itde.RMSNormProjection])
def test_unit_and_affine_recomposes_the_norm(norm):
    key = jax.random.key(3)
    n = norm.identity(7, eps=1e-3, dtype=jnp.float64)
    n = jax.tree_util.tree_map(
        lambda a: a + 0.5 * jax.random.normal(key, a.shape, a.dtype), n
    )
    unit, scale, shift = n.unit_and_affine(7)
    v = jax.random.normal(jax.random.key(4), (3, 7), jnp.float64)
    w = np.array([0.5, 1, 1, 2, 1, 1, 0.5])
    for fw in (None, w):
        again = scale * unit(v, fw) + (0 if shift is None else shift)
        assert float(jnp.max(jnp.abs(again - n(v, fw)))) < 1e-12


@pytest.mark.parametrize("op", ["attention_gqa", "feedforward", "gated"])
def test_folding_an_input_affine_map_is_exact_on_any_feature_grid(op):
    k = jax.random.key(0)
    d = 6
    if op == "attention_gqa":
        o = itde.Attention.init(k, d, 4, n_kv_heads=2, head_dim=3, bias=False)
    elif op == "feedforward":
        o = itde.FeedForward.init(k, d, 10)
    else:
        o = itde.GatedFeedForward.init(k, d, 10, activation="silu", bias=False)
    o = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), o)
    a = jax.random.normal(jax.random.key(1), (d,), jnp.float64)
    b = jax.random.normal(jax.random.key(2), (d,), jnp.float64)
    z = jax.random.normal(jax.random.key(3), (5, d), jnp.float64)
    fw = np.linspace(0.5, 1.5, d)
    folded = o.with_input_affine(a, b, fw)
    assert float(jnp.max(jnp.abs(folded(z, feature_weights=fw)
                                 - o(a * z + b, feature_weights=fw)))) < 1e-12  # fmt: skip


def test_bad_inputs_are_named():
    enc, x, _ = _encoder(0.0, layers=2)
    m = itde.from_torch(enc)
    with pytest.raises(TypeError, match="continuum_form takes"):
        itde.continuum_form(object())
    smooth = itde.TransformerIDE(
        itde.LegendreControls.init(jax.random.key(0), n_modes=2, n_features=12, n_heads=3,
                                   n_hidden=8),
        m.grid,
    )  # fmt: skip
    with pytest.raises(TypeError, match="PiecewiseConstant|LegendreControls"):
        smooth.continuum_form(itde.FeatureAffine(jnp.ones(12)))
    pre = itde.from_torch(_encoder(0.0, layers=2, norm_first=True)[0])
    with pytest.raises(ValueError, match="input_affine"):
        pre.continuum_form(itde.FeatureAffine(jnp.ones(12)))
    cf = m.continuum_form()
    assert cf.continuum_form() is cf
    with pytest.raises(ValueError, match="shape"):
        itde.FeatureAffine(jnp.ones((2, 3, 4)))


def test_batched_solve_with_user_split_terms():
    enc, x, _ = _encoder(0.0, layers=2)
    m = itde.from_torch(enc)
    xb = jnp.asarray(np.stack([x, -x]))
    with pytest.raises(ValueError, match="batched=True.*sub-flow 0"):
        itde.solve(m, xb, batched=True, terms=m.terms("paper"))
    # a user's SplitTerm is solved at its own token count (it cannot be padded): compare with
    # the model's own terms solved the same way (buckets=None); the padded default agrees to
    # rounding, since its sums run over a longer, zero-weighted axis
    ok = itde.solve(m, xb, batched=True, terms=m.terms("paper", batched=True)).ys[-1]
    exact = itde.solve(m, xb, batched=True, buckets=None).ys[-1]
    assert float(jnp.max(jnp.abs(ok - exact))) == 0.0
    padded = itde.solve(m, xb, batched=True).ys[-1]
    np.testing.assert_allclose(np.asarray(padded), np.asarray(exact), rtol=0, atol=1e-12)


def test_to_torch_refuses_a_continuum_form():
    enc, _, _ = _encoder(0.0, layers=2)
    with pytest.raises(ValueError, match="continuum form"):
        itde.to_torch(itde.from_torch(enc).continuum_form())


# slow: a convergence study (three refinements of projected RK4); the fixed-point set it
# relies on is checked by the other tests here
@pytest.mark.slow
def test_regularised_projections_converge_to_the_flow_on_their_moving_fixed_set():
    """Smooth controls, eps > 0 and a moving set: the network's Lie steps (the regularised
    maps) and projected RK4 on the fixed-point set (whose radius moves as
    sqrt(sigma2(t)^2 - eps): the drift) reach the same limit."""
    eps = 0.05
    import equinox as eqx

    controls = itde.LegendreControls.init(
        jax.random.key(4), n_modes=3, t1=1.0, n_features=8, n_heads=2, n_hidden=12,
        activation="gelu", sigma1=(0.0, 0.3), sigma2=(1.0, 0.4), dtype=jnp.float64,
    )  # fmt: skip
    n = controls.coeffs.norm2
    regularised = itde.LayerNormProjection.scalar(n.sigma1, n.sigma2, eps=eps)
    controls = eqx.tree_at(lambda c: (c.coeffs.norm1, c.coeffs.norm2), controls,
                           (regularised, regularised))  # fmt: skip
    m = itde.TransformerIDE(controls, itde.Grid.unit(8))
    u0 = m.project(0.0, jax.random.normal(jax.random.key(5), (5, 8), jnp.float64))
    ref = itde.solve(m, u0, solver=S.Projected(S.RK4()), dt0=1 / 64).ys[-1]
    lie = _errors(m, u0, S.LieTrotter(), (1 / 16, 1 / 32, 1 / 64), ref)
    assert np.all((_rates(lie) > 0.8) & (_rates(lie) < 1.3)), lie
    # and projected RK4 keeps its order: the drift of the set is the fixed set's
    rk4 = _errors(m, u0, S.Projected(S.RK4()), (1 / 4, 1 / 8, 1 / 16), ref)
    assert np.all(_rates(rk4) > 3.4), rk4
