"""`itde.analysis`: spectra over depth, token geometry, attention entropy, constraint residuals
and the particle model's interaction energy, each against an independent NumPy computation
or a constructed case whose answer is known.

- spectra: hand-built per-head weights (grouped-query attention, query size != value size,
  feature and head quadrature weights) against NumPy's full `d x d` eigenvalues and singular
  values; per-layer, Legendre and spline controls at depths between the layers against the
  controls evaluated there; function kernels give the same spectrum on two feature grids
  (Nystrom with an exact rule), which the unweighted matrices do not.
- geometry: states of known rank, constructed clusters (a tolerance exactly on the boundary,
  a chain), padding.
- attention: the weights applied to the values are `attention_field` for every option
  (RoPE, GQA, causal rules with positive and signed weights, window, ALiBi, pre-norm,
  function kernels, padding); entropies against a NumPy softmax of the scores, log n for
  uniform attention and 0 for one-hot.
- energy: the normalisation on configurations of known energy; monotone along a finely
  solved particle flow; its violation vanishing with the step.
"""

import dataclasses
import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde import analysis as A
from itde.interop._internal import NoPositions

RNG = np.random.default_rng(0)


def _arr(r, *shape, scale=1.0):
    return jnp.asarray(scale * r.normal(size=shape))


def _block(r, d, h, hkv, e, dff, *, gated=False, rms=False):
    """One layer's controls from NumPy draws (no random initialiser to compile)."""
    att = itde.Attention(
        wq=_arr(r, h, d, e), wk=_arr(r, hkv, d, e), wv=_arr(r, hkv, d, e),
        wo=_arr(r, h, e, d, scale=0.5), bq=_arr(r, h, e), bk=_arr(r, hkv, e),
        bv=_arr(r, hkv, e), bo=_arr(r, d),
    )  # fmt: skip
    if gated:
        ff = itde.GatedFeedForward(
            w_gate=_arr(r, d, dff), w1=_arr(r, d, dff), w2=_arr(r, dff, d), b_gate=None,
            b1=None, b2=None, activation="silu",
        )  # fmt: skip
    else:
        ff = itde.FeedForward(
            w1=_arr(r, d, dff), w2=_arr(r, dff, d), b1=_arr(r, dff), b2=_arr(r, d),
            activation="gelu",
        )  # fmt: skip
    gain = jnp.asarray(1 + 0.2 * r.normal(size=d))
    if rms:
        norm = itde.RMSNormProjection(1.0, gain, 1e-6)
    else:
        norm = itde.LayerNormProjection(0.0, 1.0, gain, _arr(r, d, scale=0.1), 1e-5)
    return itde.Block(att, norm, ff, norm)


def _stack(blocks):
    """Blocks stacked along a new leading axis in NumPy (no compiled stacking)."""
    return jax.tree.map(lambda *xs: jnp.asarray(np.stack([np.asarray(x) for x in xs])), *blocks)


def _model(blocks, grid=None, **kwargs):
    d = blocks[0].attention.n_features
    controls = itde.PiecewiseConstant(_stack(blocks))
    return itde.TransformerIDE(controls, grid or itde.Grid.unit(d), **kwargs)


def _attention(h, hkv, d, e, ev, seed=0, bias=True):
    r = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(r.normal(size=s))  # noqa: E731
    return itde.Attention(
        wq=f(h, d, e), wk=f(hkv, d, e), wv=f(hkv, d, ev), wo=f(h, ev, d),
        bq=f(h, e) if bias else None, bk=f(hkv, e) if bias else None,
        bv=f(hkv, ev) if bias else None, bo=f(d) if bias else None,
    )  # fmt: skip


def _match(ours, ref, atol):
    """Every value of `ours` is within `atol` of a distinct value of `ref` (a greedy
    matching; both are small sets of well-separated eigenvalues)."""
    ref = list(np.asarray(ref))
    for z in np.asarray(ours):
        i = int(np.argmin([abs(z - r) for r in ref]))
        assert abs(z - ref[i]) < atol, (z, ref[i])
        ref.pop(i)


def _numpy_head_spectra(att, fw=None, hw=None):
    """The full d x d products in NumPy, their k = min(d, e) eigenvalues of largest modulus
    and singular values, per head (query head m reads key head m // (h / h_kv))."""
    wq, wk, wv, wo = (np.asarray(a) for a in (att.wq, att.wk, att.wv, att.wo))
    h, d, e = wq.shape
    rep = h // wk.shape[0]
    sw = np.ones(d) if fw is None else np.sqrt(fw)
    hh = np.ones(e) if hw is None else np.asarray(hw)
    out = {"qk": [], "vo": []}
    for m in range(h):
        g = m // rep
        qk = sw[:, None] * (wq[m] * hh) @ wk[g].T * sw[None, :]
        vo = sw[:, None] * (wv[g] * (np.ones(wv.shape[2]) if hw is None else hh)) @ wo[m]
        vo = vo * sw[None, :]
        for name, mat, k in (("qk", qk, min(d, e)), ("vo", vo, min(d, wv.shape[2]))):
            lam = np.linalg.eigvals(mat)
            lam = lam[np.argsort(-np.abs(lam))][:k]
            sv = np.linalg.svd(mat, compute_uv=False)
            out[name].append((lam, sv))
    return out


def _check_heads(hs, att, fw=None, hw=None, tol=1e-9):
    ref = _numpy_head_spectra(att, fw, hw)
    for name, lam_all, sv_all in (
        ("qk", hs.qk_eigenvalues, hs.qk_singular_values),
        ("vo", hs.vo_eigenvalues, hs.vo_singular_values),
    ):
        for m, (lam, sv) in enumerate(ref[name]):
            k = lam_all.shape[-1]
            scale = sv[0]
            _match(lam_all[m], lam, tol * scale)
            np.testing.assert_allclose(sv_all[m], sv[:k], atol=tol * scale)
            assert np.all(sv[k:] < tol * scale)  # the rest of the d x d spectrum is 0
            # sorted: decreasing modulus, and singular values decreasing
            assert np.all(np.diff(np.abs(np.asarray(lam_all[m]))) <= 1e-12 * scale)


# ----------------------------------------------------------------------------- spectra
@pytest.mark.parametrize(
    "shape",
    [(4, 2, 6, 3, 2), (4, 1, 5, 7, 7), pytest.param((2, 2, 6, 4, 4), marks=pytest.mark.slow)],
    ids=["gqa", "mqa_e>d", "mha"],
)
def test_head_spectra_against_numpy(shape):
    h, hkv, d, e, ev = shape
    att = _attention(h, hkv, d, e, ev, seed=sum(shape))
    _check_heads(A.head_spectra(att), att)


@pytest.mark.slow
def test_head_spectra_with_feature_and_head_weights():
    att = _attention(4, 2, 6, 3, 3, seed=3)
    fw = RNG.uniform(0.2, 2.0, 6)
    hw = RNG.uniform(0.2, 2.0, 3)
    hs = A.head_spectra(att, feature_weights=fw, head_weights=hw)
    _check_heads(hs, att, fw, hw)
    # the weights matter: unweighted spectra differ
    plain = A.head_spectra(att)
    assert not np.allclose(plain.qk_singular_values, hs.qk_singular_values, rtol=1e-3)


def _ffn_reference(ff, fw=None, zw=None):
    w1, w2 = np.asarray(ff.w1), np.asarray(ff.w2)
    sw = np.ones(w1.shape[0]) if fw is None else np.sqrt(fw)
    sz = np.ones(w1.shape[1]) if zw is None else np.sqrt(np.asarray(zw))
    out = {
        "w1": np.linalg.svd(sw[:, None] * w1 * sz, compute_uv=False),
        "w2": np.linalg.svd(sz[:, None] * w2 * sw, compute_uv=False),
    }
    if getattr(ff, "w_gate", None) is not None:
        out["w_gate"] = np.linalg.svd(sw[:, None] * np.asarray(ff.w_gate) * sz, compute_uv=False)
    return out


def _float32(tree):
    """Every floating array in float32 (converted in NumPy: no compiled cast per leaf)."""

    def cast(a):
        return jnp.asarray(np.asarray(a, np.float32)) if eqx.is_inexact_array(a) else a

    return jax.tree.map(cast, tree)


def test_spectra_per_layer_model_gated_gauss_grid_float32():
    """Every layer of a per-layer model (GQA, gated feed-forward) on a Gauss-Legendre
    feature grid, in float32 (as trained): the spectra of the weighted operators, layer by
    layer, against NumPy's in float64 to float32 round-off."""
    d = 6
    grid = itde.Grid(itde.Midpoint(), itde.GaussLegendre(interval=(0.0, 1.0)), d)
    r = np.random.default_rng(1)
    blocks = [_block(r, d, 4, 2, 2, 5, gated=True, rms=True) for _ in range(3)]
    m = _float32(_model(blocks, grid, block="pre_norm"))
    s = A.spectra(m)
    assert s.qk_singular_values.dtype == jnp.float32 and s.qk_eigenvalues.dtype == jnp.complex64
    assert s.qk_eigenvalues.shape == (3, 4, 2) and s.w1_singular_values.shape == (3, 5)
    np.testing.assert_array_equal(s.ts, [0.0, 1.0, 2.0])
    fw = grid.feature_weights()
    for n in range(3):
        layer = jax.tree.map(lambda a: np.asarray(a, np.float64)[n], m.controls.values)
        _check_heads(
            jax.tree.map(lambda a: np.asarray(a)[n], _heads_of(s)), layer.attention, fw, tol=1e-5
        )
        ref = _ffn_reference(layer.feedforward, fw)
        np.testing.assert_allclose(s.w1_singular_values[n], ref["w1"][:5], rtol=1e-5)
        np.testing.assert_allclose(s.w2_singular_values[n], ref["w2"][:5], rtol=1e-5)
        np.testing.assert_allclose(s.w_gate_singular_values[n], ref["w_gate"][:5], rtol=1e-5)


def _heads_of(s):
    return A.HeadSpectra(
        s.qk_eigenvalues, s.qk_singular_values, s.vo_eigenvalues, s.vo_singular_values
    )


def test_spectra_smooth_controls_between_layers():
    """Legendre controls at depths that are no layer node: the spectra of the controls
    evaluated there."""
    r = np.random.default_rng(2)
    lc = itde.LegendreControls(_stack([_block(r, 6, 2, 1, 3, 8) for _ in range(3)]), 0.0, 2.0)
    m = itde.TransformerIDE(lc, itde.Grid.unit(6))
    ts = np.array([0.37, 1.61])
    s = A.spectra(m, ts)
    for i, t in enumerate(ts):
        att = _discrete(m, t, "attention")[0]
        _check_heads(jax.tree.map(lambda a: np.asarray(a)[i], _heads_of(s)), att)
        ref = _ffn_reference(_discrete(m, t, "feedforward")[0])
        np.testing.assert_allclose(s.w1_singular_values[i], ref["w1"][:6], rtol=1e-12)

    with pytest.raises(ValueError, match="`ts`"):
        A.spectra(m)


@pytest.mark.slow
def test_spectra_spline_controls_between_layers():
    """A cubic spline through three layers, at a depth between two of them: the spectra of
    the controls evaluated there, which are neither layer's."""
    r = np.random.default_rng(3)
    net = _model([_block(r, 6, 2, 1, 3, 8) for _ in range(3)])
    spline = itde.TransformerIDE(itde.SplineControls.from_layers(net), net.grid)
    s = A.spectra(spline, [1.5])
    att = _discrete(spline, 1.5, "attention")[0]
    _check_heads(jax.tree.map(lambda a: np.asarray(a)[0], _heads_of(s)), att)
    for n in (1, 2):  # between the layers, not either layer
        layer = _numpy_head_spectra(net.controls.layer(n).attention)["qk"][0][1][:3]
        assert not np.allclose(s.qk_singular_values[0, 0], layer, rtol=1e-3)
    with pytest.raises(ValueError, match="`ts`"):
        A.spectra(spline)
    np.testing.assert_array_equal(A.spectra(net).ts, [0.0, 1.0, 2.0])


@functools.cache
def _function_block():
    """One layer of kernel functions (Legendre degree 3 in every variable): the structure
    of `FunctionBlock.init` (traced, not compiled), coefficients drawn in NumPy."""
    b = itde.LegendreBasis(4, (0.0, 1.0))
    gl = itde.GaussLegendre(interval=(0.0, 1.0))
    shapes = jax.eval_shape(
        lambda k: itde.FunctionBlock.init(
            k, n_heads=2, feature_basis=b, head_basis=b, hidden_basis=b, head_rule=gl,
            n_head_nodes=6, hidden_rule=gl, n_hidden_nodes=7,
        ),
        jax.random.PRNGKey(0),
    )  # fmt: skip
    r = np.random.default_rng(0)
    block = jax.tree.map(lambda x: _arr(r, *x.shape, scale=0.5), shapes)
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, 0.0)
    block = eqx.tree_at(lambda b: (b.norm1, b.norm2), block, (norm, norm))
    return _stack([block])


def _function_model(n_features):
    """One layer of kernel functions (polynomials of degree 3), on a Gauss-Legendre feature
    grid of `n_features` nodes."""
    grid = itde.Grid(itde.Midpoint(), itde.GaussLegendre(interval=(0.0, 1.0)), n_features)
    return itde.TransformerIDE(itde.PiecewiseConstant(_function_block()), grid)


@eqx.filter_jit
def _discrete(eq, t, part):
    """The operator `part` the equation applies at `t`, on its grid, and its weights."""
    return eq.controls(t, "right", part).discretise(eq.grid)


def test_spectra_of_function_kernels_do_not_depend_on_the_grid():
    """Kernels that are polynomials of degree 3 in the features, sampled on 5 and on 9
    Gauss-Legendre nodes: the weighted (Nystrom) spectra are the continuous operators', the
    same on both grids; the plain matrices' are not."""
    coarse, fine = A.spectra(_function_model(5)), A.spectra(_function_model(9))
    for name in ("qk", "vo"):
        for kind in ("eigenvalues", "singular_values"):
            a = np.asarray(getattr(coarse, f"{name}_{kind}"))[..., :4]
            b = np.asarray(getattr(fine, f"{name}_{kind}"))[..., :4]
            np.testing.assert_allclose(a, b, atol=1e-10 * np.abs(b).max())
    for name in ("w1", "w2"):
        a = np.asarray(getattr(coarse, f"{name}_singular_values"))[..., :4]
        b = np.asarray(getattr(fine, f"{name}_singular_values"))[..., :4]
        np.testing.assert_allclose(a, b, atol=1e-10 * b.max())
    # and they are the NumPy spectra of the sampled kernels with the grid's weights
    eq = _function_model(5)
    att, hw = _discrete(eq, 0.0, "attention")
    _check_heads(
        jax.tree.map(lambda a: np.asarray(a)[0], _heads_of(coarse)), att, eq.feature_weights(), hw
    )
    ff, zw = _discrete(eq, 0.0, "feedforward")
    ref = _ffn_reference(ff, eq.feature_weights(), zw)
    np.testing.assert_allclose(coarse.w2_singular_values[0], ref["w2"][:5], atol=1e-12)
    plain = A.head_spectra(att)
    assert not np.allclose(plain.qk_singular_values[:, :4], coarse.qk_singular_values[0, :, :4])


def test_models_holding_an_equation_are_accepted():
    m = _model([_block(np.random.default_rng(4), 4, 2, 2, 2, 3)])
    wrapped = itde.HFTransformer(
        word_embeddings=jnp.asarray(np.zeros((3, 4))), position_embeddings=None,
        token_type_embeddings=None, embedding_norm=None, equation=m,
        positions=NoPositions(),
    )  # fmt: skip
    a, b = A.spectra(m), A.spectra(wrapped)
    np.testing.assert_array_equal(a.qk_singular_values, b.qk_singular_values)
    lm = itde.HFCausalLM(base=wrapped)  # a causal language model: its base's equation
    assert A.spectra(lm).qk_eigenvalues.shape == a.qk_eigenvalues.shape
    with pytest.raises(TypeError, match="`model`"):
        A.spectra(m.controls)


# ---------------------------------------------------------------------------- geometry
def _padded(x, n=8, d=7):
    """`x` in the top-left corner of an `[n, d]` state, zeros elsewhere, and the mask of its
    rows: every constructed point set has one shape (one compilation) and padding."""
    out = np.zeros((n, d))
    out[: x.shape[0], : x.shape[1]] = x
    out[x.shape[0] :] = np.random.default_rng(x.size).normal(size=(n - x.shape[0], d))
    return out, np.arange(n) < x.shape[0]


def test_rank_of_states_of_known_rank():
    r = np.random.default_rng(5)
    u = r.normal(size=(8, 3)) @ r.normal(size=(3, 7))  # rank 3
    assert int(A.numerical_rank(u)) == np.linalg.matrix_rank(u) == 3
    s = np.linalg.svd(u, compute_uv=False)
    p = s / s.sum()
    np.testing.assert_allclose(A.effective_rank(u), np.exp(-np.sum(p * np.log(p))), rtol=1e-12)
    # r orthogonal directions of equal energy: exactly r; one direction (any signs): 1; the
    # padded rows (random) are left out
    e = np.eye(7)
    for x, erank in (
        (np.stack([e[0], e[1], e[2], -e[0], e[1], e[2]]), 3.0),
        (np.outer([1, -2, 3, 0.5], e[4]), 1.0),
        (np.zeros((3, 7)), 0.0),
    ):
        y, mask = _padded(x)
        np.testing.assert_allclose(A.effective_rank(y, mask), erank, rtol=1e-12)
        assert int(A.numerical_rank(y, mask)) == int(np.ceil(erank))
        assert int(A.numerical_rank(y)) == np.linalg.matrix_rank(y)
    # feature weights: the singular values of U D_w^{1/2}
    w = r.uniform(0.5, 2.0, 7)
    np.testing.assert_allclose(
        A.singular_values(u, feature_weights=w),
        np.linalg.svd(u * np.sqrt(w), compute_uv=False)[:7],
        atol=1e-12 * s[0],
    )


def test_cosines_and_clusters_on_constructed_points():
    r = np.random.default_rng(6)
    dirs = np.linalg.qr(r.normal(size=(5, 3)))[0].T  # 3 orthonormal directions in R^5
    labels = np.array([0, 1, 0, 2, 1, 2, 0])
    x = dirs[labels] * r.uniform(0.5, 3.0, (7, 1))  # exact clusters, different norms
    u, mask = _padded(x)  # one padded token of another direction
    count = lambda y, m, tol: int(A.cluster_count(y, m, tol=tol))  # noqa: E731
    assert count(u, mask, 1e-9) == 3 and count(u, None, 1e-9) == 4
    np.testing.assert_array_equal(A.cluster_labels(u, mask, tol=1e-9), [0, 1, 0, 3, 1, 3, 0, -1])
    same = labels[:, None] == labels[None, :]
    off = ~np.eye(7, dtype=bool)
    np.testing.assert_allclose(A.mean_cosine(u, mask), same[off].mean(), atol=1e-14)
    np.testing.assert_allclose(A.min_cosine(u, mask), 0.0, atol=1e-14)
    c = np.asarray(A.cosines(u))
    unit = u / np.linalg.norm(u, axis=1, keepdims=True)
    np.testing.assert_allclose(c, unit @ unit.T, atol=1e-14)

    # the boundary: cos = 1/2 exactly; tol = 1/2 joins, anything smaller does not
    b, mb = _padded(np.array([[1.0, 1, 1, 1], [1, 1, 1, -1]]))
    assert float(A.cosines(b)[0, 1]) == 0.5
    assert count(b, mb, 0.5) == 1 and count(b, mb, 0.5 - 1e-12) == 2
    # single linkage: a chain of close neighbours is one cluster
    ang = np.arange(6) * 0.1
    chain, mc = _padded(np.stack([np.cos(ang), np.sin(ang)], axis=1)[r.permutation(6)])
    tol = 1 - math.cos(0.1) + 1e-12
    assert count(chain, mc, tol) == 1 and float(A.min_cosine(chain, mc)) < 1 - 10 * tol
    assert count(chain, mc, 1e-6) == 6
    # vmappable over states (a zero token is a cluster of its own)
    counts = jax.vmap(lambda y, m: A.cluster_count(y, m, tol=1e-9))(
        np.stack([u, chain, np.eye(8, 7)]), np.stack([mask, mc, np.ones(8, bool)])
    )
    np.testing.assert_array_equal(counts, [3, 6, 8])
    with pytest.raises(ValueError, match="`tol`"):
        A.cluster_count(u, tol=-1.0)


# --------------------------------------------------------------------------- attention
def _field_from_weights(eq, t, u, g, mask):
    """sum_m gamma_m V_m W^O_m + b_o (+ affine1), from the weights and NumPy products."""
    att, hw = _discrete(eq, t, "attention")
    fw = eq.feature_weights()
    v_in = np.asarray(eqx.filter_jit(eq.block.attention_input)(eq, t, u))
    if fw is not None:
        v_in = v_in * fw
    rep = att.n_heads // att.n_kv_heads
    out = np.zeros(u.shape)
    for m in range(att.n_heads):
        k = m // rep
        vals = v_in @ np.asarray(att.wv[k]) + (0 if att.bv is None else np.asarray(att.bv[k]))
        o = np.asarray(g[m]) @ vals
        if hw is not None:
            o = o * hw
        out += o @ np.asarray(att.wo[m])
    if att.bo is not None:
        out += np.asarray(att.bo)
    if eq.controls.blocks.affine1 is not None:
        out += np.asarray(
            eqx.filter_jit(lambda e, t, u: e.controls(t, "right", "affine1")(u))(eq, t, u)
        )
    return out


def _causal_on(rule):
    def build(r, d):
        grid = itde.Grid(rule(interval=(0.0, 1.0)), itde.GaussLegendre(interval=(0.0, 1.0)), d)
        return _model([_block(r, d, 2, 1, 4, 6) for _ in range(2)], grid, causal=True)

    return build


VARIANTS = {
    "gqa_rope_causal_prenorm": lambda r, d: _model(
        [_block(r, d, 4, 2, 2, 6, gated=True, rms=True) for _ in range(2)],
        block="pre_norm", causal=True, rope=itde.Rope.init(2, base=100.0),
    ),
    # non-uniform token weights (trapezoid: half weights at the ends) as a log-bias
    "window_alibi_trapezoid": lambda r, d: _model(
        [_block(r, d, 2, 2, 4, 6) for _ in range(2)],
        itde.Grid(itde.Trapezoid(interval=(0.0, 6.0)), itde.Midpoint(), d),
        window=itde.SlidingWindow(3.0), score_bias=itde.ALiBi.init(2),
    ),
    # positive and signed partial-interval (Volterra) weights
    "causal_trapezoid": _causal_on(itde.Trapezoid),
    "causal_simpson": _causal_on(itde.Simpson),
    "function_kernels": lambda r, d: _function_model(5),
    # per-feature gains folded into the next operators, the rest an extra affine field
    "continuum_form": lambda r, d: _model(
        [_block(r, d, 2, 2, 4, 6) for _ in range(2)]
    ).continuum_form(),
}  # fmt: skip
SLOW_VARIANTS = {"continuum_form", "causal_simpson"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_VARIANTS else k for k in VARIANTS],
)
def test_attention_weights_applied_to_values_are_the_field(name):
    """What `attention_weights` returns, applied to the values and the output kernel, is
    `TransformerIDE.attention_field`: the weights are those the equation applies."""
    eq = VARIANTS[name](np.random.default_rng(7), 8)
    n, d = 7, eq.n_features
    u = jnp.asarray(np.random.default_rng(8).normal(size=(n, d)))
    field = eqx.filter_jit(eq.attention_field)
    for t, msk in ((0.0, np.ones(n, bool)), (1.0, np.array([True] * 5 + [False] * 2))):
        t, msk = jnp.asarray(t), jnp.asarray(msk)
        g = np.asarray(A.attention_weights(eq, t, u, msk))
        ref = np.asarray(field(t, u, msk))
        np.testing.assert_allclose(_field_from_weights(eq, t, u, g, msk), ref, atol=1e-12)
        assert np.all(g[..., ~np.asarray(msk)] == 0)  # no padded key is read
        if name != "causal_simpson":
            np.testing.assert_allclose(g.sum(-1), 1.0, atol=1e-13)
            assert np.all(g >= 0)
    if name == "causal_simpson":
        assert np.any(g < 0)
        assert A.token_geometry(eq, 0.0, u).attention_entropy is None


def test_entropy_refuses_signed_weights():
    """Simpson's partial-interval weights are signed: no probability distribution, no
    entropy (refused before anything is computed)."""
    eq = VARIANTS["causal_simpson"](np.random.default_rng(7), 8)
    u = jnp.asarray(np.random.default_rng(8).normal(size=(7, 8)))
    with pytest.raises(ValueError, match="signed"):
        A.attention_entropy(eq, 0.0, u)


def test_attention_entropy_against_a_numpy_softmax():
    """A causal GQA model with padding: the entropies of a NumPy softmax of the scores
    $u W^Q_m (u W^K_{m//2})^T / \\sqrt{e}$ (plus biases), masked causally and on padding."""
    d, h, hkv, e, n = 6, 4, 2, 3, 6
    att = _attention(h, hkv, d, e, e, seed=9)
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, 0.0)
    r = np.random.default_rng(9)
    ff = itde.FeedForward(w1=_arr(r, d, 4), w2=_arr(r, 4, d), b1=None, b2=None)
    eq = itde.TransformerIDE(
        itde.PiecewiseConstant(_stack([itde.Block(att, norm, ff, norm)])),
        itde.Grid.unit(d),
        causal=True,
    )
    u = np.random.default_rng(10).normal(size=(n, d))
    mask = np.array([False, True, True, True, True, False])  # left and right padding
    H = np.asarray(A.attention_entropy(eq, 0.0, u, mask))
    for m in range(h):
        q = u @ np.asarray(att.wq[m]) + np.asarray(att.bq[m])
        k = u @ np.asarray(att.wk[m // 2]) + np.asarray(att.bk[m // 2])
        s = q @ k.T / math.sqrt(e)
        s = np.where(np.tril(np.ones((n, n), bool)) & mask[None, :], s, -np.inf)
        for i in range(n):
            if not mask[i]:
                assert H[m, i] == 0.0
                continue
            p = np.exp(s[i] - s[i].max())
            p = p / p.sum()
            ref = -np.sum(p[p > 0] * np.log(p[p > 0]))
            np.testing.assert_allclose(H[m, i], ref, atol=1e-13)
    # uniform attention (zero queries): log of the number of admissible keys
    flat = eqx.tree_at(
        lambda c: (c.controls.values.attention.wq, c.controls.values.attention.bq),
        eq,
        (jnp.asarray(np.zeros((1, h, d, e))), jnp.asarray(np.zeros((1, h, e)))),
    )
    Hu = np.asarray(A.attention_entropy(flat, 0.0, u, mask))
    admissible = np.cumsum(mask)
    np.testing.assert_allclose(
        Hu, np.where(mask, np.log(np.maximum(admissible, 1)), 0)[None] + 0 * Hu, atol=1e-13
    )
    nc = dataclasses.replace(flat, causal=False)
    np.testing.assert_allclose(
        A.attention_entropy(nc, 0.0, u, mask),
        np.broadcast_to(np.where(mask, np.log(4), 0), Hu.shape),
        atol=1e-13,
    )  # fmt: skip
    # one-hot: each token reads itself only
    one = jnp.asarray(np.eye(d)[None])
    hot_att = itde.Attention(wq=400 * one, wk=one, wv=one, wo=one, bq=None, bk=None, bv=None,
                             bo=None)  # fmt: skip
    hot = itde.TransformerIDE(
        itde.PiecewiseConstant(_stack([itde.Block(hot_att, norm, ff, norm)])),
        itde.Grid.unit(d),
    )
    x = np.eye(n, d)
    assert float(jnp.max(A.attention_entropy(hot, 0.0, x))) < 1e-12
    np.testing.assert_allclose(A.attention_weights(hot, 0.0, x)[0], np.eye(n), atol=1e-12)


# ------------------------------------------------------------------------- residuals
def _two_norms(m, eps=0.0):
    """The model with different exact-ish LayerNorms in its two layers (gain and shift)."""
    d = m.n_features
    norm = itde.LayerNormProjection(
        jnp.asarray([0.3, -0.5]), jnp.asarray([1.7, 0.6]),
        jnp.asarray(np.stack([np.full(d, 1.5), np.linspace(0.5, 2.0, d)])),
        jnp.asarray(np.full((2, d), -0.2)), eps,
    )  # fmt: skip
    return eqx.tree_at(lambda x: (x.controls.values.norm1, x.controls.values.norm2), m, (norm,) * 2)


def test_norm_residuals_vanish_on_projected_states_only():
    d, n = 6, 5
    r = np.random.default_rng(12)
    m = _two_norms(_model([_block(r, d, 2, 2, 3, 4) for _ in range(2)]))
    v = jnp.asarray(r.normal(size=(n, d)))
    project2 = eqx.filter_jit(m.project2)
    p = project2(jnp.asarray(1.0), v)  # layer 0's second projection, read at t = 1 from the left
    res = A.norm_residuals(m, 1.0, p)
    assert set(res) == {"norm1.mean", "norm1.var", "norm2.mean", "norm2.var"}
    assert max(float(x) for x in res.values()) < 1e-13
    assert float(A.norm_residuals(m, 1.0, v)["norm2.var"]) > 0.1
    # padded rows do not count, whatever they hold
    mask = np.array([True] * 4 + [False])
    mixed = np.asarray(p).copy()
    mixed[4] = 10 * np.asarray(v[4])
    assert max(float(x) for x in A.norm_residuals(m, 1.0, mixed, mask).values()) < 1e-13
    assert float(A.norm_residuals(m, 1.0, mixed)["norm2.var"]) > 0.1
    # states as a post-norm solve saves them: the input, then each layer's projection
    ts = np.array([0.0, 1.0, 2.0])
    states = np.stack([v, p, project2(jnp.asarray(2.0), v[::-1])])
    geo = A.geometry_along(m, ts, states, mask)
    assert np.all(np.asarray(geo.residuals["norm2.var"])[1:] < 1e-12)
    assert float(geo.residuals["norm2.var"][0]) > 0.1
    # each field is its function's value at that state (the entropy: the mean over real queries)
    x = np.asarray(states[2])[:4]
    s = np.linalg.svd(x, compute_uv=False)
    p_ = s / s.sum()
    np.testing.assert_allclose(geo.effective_rank[2], np.exp(-np.sum(p_ * np.log(p_))), rtol=1e-12)
    np.testing.assert_array_equal(geo.numerical_rank, [4, 4, 4])
    c = (x / np.linalg.norm(x, axis=1, keepdims=True)) @ (x / np.linalg.norm(x, axis=1)[:, None]).T
    np.testing.assert_allclose(geo.mean_cosine[2], c[~np.eye(4, dtype=bool)].mean(), rtol=1e-12)
    np.testing.assert_allclose(geo.min_cosine[2], c.min(), rtol=1e-12)
    ent = A.attention_entropy(m, ts[2], states[2], mask)
    np.testing.assert_allclose(geo.attention_entropy[2], ent.sum(-1) / 4, rtol=1e-12)


# ----------------------------------------------------------------------------- energy
def _particle_model(d, beta):
    """(SA) on S^{d-1} as `examples/particles.py` builds it: m = d + 1 features, one head with
    Q = beta sqrt(m) I, K = V = O = I, no feed-forward, the unit sphere of the mean-zero
    hyperplane as the constraint set, constant controls."""
    m = d + 1
    eye = np.eye(m)[None]
    att = itde.Attention(
        wq=beta * math.sqrt(m) * eye, wk=eye, wv=eye, wo=eye, bq=None, bk=None, bv=None, bo=None
    )
    ff = itde.FeedForward(w1=np.zeros((m, 1)), w2=np.zeros((1, m)), b1=None, b2=None)
    norm = itde.LayerNormProjection(0.0, 1.0 / math.sqrt(m), None, None, 0.0)
    controls = itde.LegendreControls(_stack([itde.Block(att, norm, ff, norm)]), 0.0, 1.0)
    return itde.TransformerIDE(controls, itde.Grid.unit(m))


def _initial_tokens(n, d, seed=0):
    x = np.random.default_rng(seed).normal(size=(n, d))
    x = x / np.linalg.norm(x, axis=1, keepdims=True)
    q = np.linalg.qr(np.eye(d + 1) - 1.0 / (d + 1))[0]  # a basis of the mean-zero hyperplane
    return jnp.asarray(x @ q[:, :d].T)


def test_interaction_energy_normalisation():
    beta = 1.7
    x = np.array([0.6, 0.8, 0.0])
    one = np.tile(x, (5, 1)) * np.arange(1, 6)[:, None]  # one cluster (norms do not matter)
    np.testing.assert_allclose(A.interaction_energy(one, beta), math.exp(beta) / (2 * beta))
    two = np.concatenate([np.tile(x, (3, 1)), np.tile(-x, (3, 1))])  # antipodal halves
    np.testing.assert_allclose(
        A.interaction_energy(two, beta), (math.exp(beta) + math.exp(-beta)) / (4 * beta)
    )
    r = np.random.default_rng(13)
    y = r.normal(size=(6, 4))
    mask = np.array([True, True, False, True, True, False])
    z = y[mask] / np.linalg.norm(y[mask], axis=1, keepdims=True)
    ref = np.exp(beta * z @ z.T).sum() / (2 * beta * 4**2)
    np.testing.assert_allclose(A.interaction_energy(y, beta, mask), ref, rtol=1e-14)
    np.testing.assert_allclose(A.interaction_energy(y * 3, 40.0), A.interaction_energy(y, 40.0))
    with pytest.raises(ValueError, match="`beta`"):
        A.interaction_energy(y, 0.0)


def _projected(model, u0, h, length, scheme):
    """Projected Euler or RK4 on the particle model's tangent field, as `itde.SCHEMES`
    builds them (a step of the scheme, then the projection), in one `lax.scan`: the states
    at every step, the start included."""

    def f(x):
        return model.tangent_field(0.0, x)

    def step(x, _):
        if scheme == "euler":
            y = x + h * f(x)
        else:
            k1 = f(x)
            k2 = f(x + h / 2 * k1)
            k3 = f(x + h / 2 * k2)
            k4 = f(x + h * k3)
            y = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        y = model.project(0.0, y)
        return y, y

    xs = jax.lax.scan(step, u0, None, length=length)[1]
    return jnp.concatenate([u0[None], xs])


def test_energy_monotone_along_the_particle_flow_and_its_violation_with_the_step():
    """(SA) on S^2, 8 tokens, beta = 1, projected Euler: finely solved (h = 0.05, to t = 30,
    the single cluster) the energy never decreases beyond round-off; with h = 4, 3, 2.5 it
    does, by less as the step shrinks, and not at all below h = 2 (the flow is a gradient
    flow in a weighted metric: the dissipation dominates the local error below a step)."""
    beta, n, d = 1.0, 8, 3
    model = _particle_model(d, beta)
    u0 = _initial_tokens(n, d)
    top = math.exp(beta) / (2 * beta)

    @jax.jit
    def run(h):  # one compile for every step
        us = _projected(model, u0, h, 600, "euler")
        counts = jax.vmap(lambda u: A.cluster_count(u, tol=1e-3))(us[::200])
        return A.energy_along(us[:61], beta), A.energy_along(us, beta), counts

    _, tr, counts = run(0.05)
    assert float(tr.violation) <= 1e-14 * top
    assert float(tr.energies[-1]) == pytest.approx(top, rel=1e-9)  # one cluster: the maximum
    assert float(tr.energies[0]) < 0.8 * top
    assert np.all(np.asarray(tr.increments) > -1e-14 * top)
    assert int(counts[0]) > 1 and int(counts[-1]) == 1
    # the first 60 steps of coarser solves
    v = [float(run(h)[0].violation) for h in (4.0, 3.0, 2.5, 1.5, 0.5)]
    assert v[0] > v[1] > v[2] > 1e-3, v
    assert max(v[3:]) <= 1e-14 * top, v


# ------------------------------------------------------------------ slow: the real thing
def _hf_model(family):
    import torch
    import transformers as tf
    from helpers import spread_hf_weights

    common = dict(vocab_size=50, pad_token_id=1, bos_token_id=2, eos_token_id=3)
    if family == "llama":  # grouped-query attention, RoPE, causal, pre-norm
        cls, config = tf.LlamaModel, tf.LlamaConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=6, intermediate_size=12, attention_bias=True, **common,
        )  # fmt: skip
    else:  # post-norm encoder, learned positions
        cls, config = tf.BertModel, tf.BertConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
            max_position_embeddings=16, **common,
        )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    kwargs = {"add_pooling_layer": False} if family == "bert" else {}
    return spread_hf_weights(cls(config, **kwargs)).to(torch.float64).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "bert"])
def test_attention_weights_and_spectra_of_a_converted_model(family):
    """`itde.from_hf`: at each layer's input state (Hugging Face's `hidden_states`), the
    attention weights are Hugging Face's `attentions` (eager, float64) on the real queries,
    with no, right and left padding; the spectra are NumPy's of `q_proj`/`k_proj` (query
    head m reading key head m // 2) or BERT's `query`/`key`."""
    import torch

    hf = _hf_model(family)
    m = itde.from_hf(hf)
    n = 7
    ids = np.random.default_rng(0).integers(4, 50, size=(3, n))
    masks = np.array([[1] * n, [1] * (n - 2) + [0, 0], [0, 0] + [1] * (n - 2)])
    with itde.interop.hf_float64(), torch.no_grad():
        out = hf(
            torch.as_tensor(ids), attention_mask=torch.as_tensor(masks),
            output_attentions=True, output_hidden_states=True,
        )  # fmt: skip
    worst = 0.0
    for layer in range(2):
        for b in range(3):
            u = jnp.asarray(out.hidden_states[layer][b].numpy())
            g = np.asarray(A.attention_weights(m, float(layer), u, masks[b]))
            ref = out.attentions[layer][b].numpy()
            real = masks[b] == 1
            worst = max(worst, np.max(np.abs(g[:, real] - ref[:, real])))
            H = np.asarray(A.attention_entropy(m, float(layer), u, masks[b]))
            p = ref[:, real]
            Href = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), axis=-1)
            np.testing.assert_allclose(H[:, real], Href, atol=1e-10)
    assert worst < 1e-12, worst
    s = A.spectra(m)
    for layer in range(2):
        if family == "llama":
            att = hf.layers[layer].self_attn
            wq, wk = att.q_proj.weight.detach().numpy(), att.k_proj.weight.detach().numpy()
            e, rep = 6, 2
        else:
            att = hf.encoder.layer[layer].attention.self
            wq, wk = att.query.weight.detach().numpy(), att.key.weight.detach().numpy()
            e, rep = 4, 1
        for h in range(s.qk_singular_values.shape[1]):
            g = h // rep
            B = wq[h * e : (h + 1) * e].T @ wk[g * e : (g + 1) * e]
            sv = np.linalg.svd(B, compute_uv=False)[: s.qk_singular_values.shape[2]]
            np.testing.assert_allclose(s.qk_singular_values[layer, h], sv, rtol=1e-10)
            lam = np.linalg.eigvals(B)
            _match(s.qk_eigenvalues[layer, h], lam[np.argsort(-np.abs(lam))], 1e-10 * sv[0])


@pytest.mark.slow
def test_energy_along_itde_solve_with_the_registered_schemes():
    """The particle flow solved by `itde.solve` with `SCHEMES["rk4"]` (fine: monotone to
    round-off) and `SCHEMES["euler"]` (the violation shrinks with the step and vanishes
    below h = 2); the geometry along the saved RK4 trajectory reaches one cluster."""
    import diffrax

    beta = 1.0
    model = _particle_model(3, beta)
    model = dataclasses.replace(
        model, controls=itde.LegendreControls(model.controls.coeffs, 0.0, 30.0)
    )
    u0 = _initial_tokens(8, 3)
    top = math.exp(beta) / (2 * beta)
    rk4 = itde.SCHEMES["rk4"]
    ts = jnp.linspace(0.0, 30.0, 301)
    sol = itde.solve(
        model, u0, solver=rk4.make(), terms=rk4.terms, dt0=0.1, saveat=diffrax.SaveAt(ts=ts)
    )
    tr = A.energy_along(sol.ys, beta)
    assert float(tr.violation) <= 1e-14 * top
    assert float(tr.energies[-1]) == pytest.approx(top, rel=1e-9)
    geo = A.geometry_along(model, sol.ts, sol.ys)
    assert int(geo.n_clusters[0]) > 1 and int(geo.n_clusters[-1]) == 1
    assert float(geo.min_cosine[-1]) > 1 - 1e-6 and float(geo.effective_rank[-1]) < 1 + 1e-3
    assert float(np.max(np.asarray(geo.residuals["norm2.var"]))) < 1e-14
    euler = itde.SCHEMES["euler"]
    v = []
    for h in (4.0, 3.0, 2.5, 1.5, 0.5):
        sol = itde.solve(
            model, u0, solver=euler.make(), terms=euler.terms, dt0=h,
            saveat=diffrax.SaveAt(t0=True, steps=True),
        )  # fmt: skip
        ys = sol.ys[np.isfinite(np.asarray(sol.ts))]
        v.append(float(A.energy_along(ys, beta).violation))
    assert v[0] > v[1] > v[2] > 1e-3, v
    assert max(v[3:]) <= 1e-14 * top, v


@pytest.mark.slow
def test_geometry_along_a_post_norm_trajectory():
    """`TransformerIDE.trajectory` of a post-norm model with exact norms: every state after
    a layer lies on that layer's second constraint set."""
    r = np.random.default_rng(14)
    m = _two_norms(_model([_block(r, 6, 2, 2, 3, 4) for _ in range(2)]))
    mask = np.array([True] * 4 + [False])
    traj = m.trajectory(jnp.asarray(r.normal(size=(5, 6))), mask)
    geo = A.geometry_along(m, jnp.asarray(m.controls.layer_times()), traj, mask)
    assert np.all(np.asarray(geo.residuals["norm2.var"])[1:] < 1e-12)
    assert np.all(np.asarray(geo.residuals["norm2.mean"])[1:] < 1e-12)
    assert float(geo.residuals["norm2.var"][0]) > 0.1


def test_geometry_and_energy_in_float32():
    """Training runs in float32: the geometry and the energy keep it and agree with NumPy's
    float64 values to float32 round-off."""
    r = np.random.default_rng(15)
    m = _float32(_two_norms(_model([_block(r, 6, 2, 1, 3, 4) for _ in range(2)])))
    u = r.normal(size=(5, 6)).astype(np.float32)
    mask = np.array([True, True, True, True, False])
    g = A.token_geometry(m, 1.0, jnp.asarray(u), mask)
    assert all(a.dtype in (jnp.float32, jnp.int32) for a in jax.tree.leaves(g))
    x = u[mask].astype(np.float64)
    sv = np.linalg.svd(x, compute_uv=False)
    p = sv / sv.sum()
    np.testing.assert_allclose(g.effective_rank, np.exp(-np.sum(p * np.log(p))), rtol=1e-5)
    xn = x / np.linalg.norm(x, axis=1)[:, None]
    c = xn @ xn.T
    np.testing.assert_allclose(g.mean_cosine, c[~np.eye(4, dtype=bool)].mean(), atol=1e-6)
    assert int(g.numerical_rank) == 4 and int(g.n_clusters) == 4
    assert np.all((g.attention_entropy > 0) & (g.attention_entropy < np.log(4)))
    e = A.interaction_energy(jnp.asarray(u), 2.0, mask)
    assert e.dtype == jnp.float32
    np.testing.assert_allclose(e, np.exp(2.0 * c).sum() / (2 * 2.0 * 16), rtol=1e-6)
