"""The continuous operators: attention as an integral operator, LayerNorm as a projection."""

import math

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import itde


def _attention(key, d=12, h=3, bias=True):
    att = itde.Attention.init(key, d, h, bias=bias)
    if bias:  # non-zero biases
        att = eqx.tree_at(
            lambda a: (a.bq, a.bk, a.bv, a.bo),
            att,
            tuple(
                0.3 * jax.random.normal(k, x.shape)
                for k, x in zip(
                    jax.random.split(key, 4), (att.bq, att.bk, att.bv, att.bo), strict=True
                )
            ),
        )
    return att


def _reference_attention(att, u, fw, tw, causal):
    """The integral operator written out directly with NumPy (independent of the code)."""
    u, fw, tw = (np.asarray(a, np.float64) for a in (u, fw, tw))
    H, d, dh = att.wq.shape
    out = np.zeros_like(u)
    for m in range(H):
        Q = (u * fw) @ np.asarray(att.wq[m]) + np.asarray(att.bq[m])
        K = (u * fw) @ np.asarray(att.wk[m]) + np.asarray(att.bk[m])
        V = (u * fw) @ np.asarray(att.wv[m]) + np.asarray(att.bv[m])
        s = Q @ K.T / math.sqrt(dh)
        for k in range(u.shape[0]):
            mask = np.arange(u.shape[0]) <= k if causal else np.ones(u.shape[0], bool)
            e = np.exp(s[k] - s[k].max()) * tw * mask
            out[k] += (e @ V) / e.sum() @ np.asarray(att.wo[m])
    return out + np.asarray(att.bo)


@pytest.mark.parametrize("spacing", [1e-3, 0.37, 5.0])
def test_uniform_token_spacing_cancels(spacing):
    att = _attention(jax.random.key(2))
    u = jax.random.normal(jax.random.key(3), (10, 12))
    base = att(u)
    scaled = att(u, token_log_weights=jnp.full((10,), math.log(spacing)))
    np.testing.assert_allclose(np.asarray(scaled), np.asarray(base), rtol=1e-13, atol=1e-13)


def test_multi_head_equals_sum_of_absorbed_value_kernels():
    """Each head's W^O block absorbed into its value kernel: A = sum_m gamma_m U (Wv_m Wo_m)."""
    att = _attention(jax.random.key(7), bias=False)
    u = jax.random.normal(jax.random.key(8), (6, 12))
    total = 0.0
    for m in range(att.n_heads):
        q, k = u @ att.wq[m], u @ att.wk[m]
        g = jax.nn.softmax(q @ k.T / math.sqrt(att.head_dim), axis=-1)
        total = total + g @ (u @ (att.wv[m] @ att.wo[m]))
    np.testing.assert_allclose(np.asarray(att(u)), np.asarray(total), atol=1e-12)


# ------------------------------------------------------------------ LayerNorm projection
def test_projection_is_the_closest_point_of_S1():
    ln = itde.LayerNormProjection(0.3, 1.4, eps=0.0)
    proj = jax.jit(lambda x: ln(x))  # one compile per shape instead of one per operation
    rng = np.random.default_rng(1)
    v = jnp.asarray(rng.standard_normal((1, 10)) * 2 + 0.5)
    p = proj(v)
    # first-order optimality (Lagrange): v - p lies in the normal space of S1 at p, spanned
    # by the constraint gradients 1 (mean) and p - sigma1 (variance) ...
    pn, vn = np.asarray(p[0]), np.asarray(v[0])
    normal = np.stack([np.ones(10), pn - 0.3], axis=1)
    coef, *_ = np.linalg.lstsq(normal, vn - pn, rcond=None)
    np.testing.assert_allclose(normal @ coef, vn - pn, rtol=0, atol=1e-12)
    # ... on the near side of the sphere (the far side, 2*sigma1 - p, is the farthest point)
    assert float((vn - vn.mean()) @ (pn - 0.3)) > 0
    d_star = float(jnp.linalg.norm(p - v))
    # random points of S1: project random vectors (the projection maps onto S1)
    others = proj(jnp.asarray(rng.standard_normal((1000, 10)) * 3))
    rm, rv = ln.residuals(others).values()
    assert float(rm) < 1e-12 and float(rv) < 1e-12  # they are on S1
    d_others = jnp.linalg.norm(others - v, axis=-1)
    assert d_star <= float(d_others.min()) + 1e-12
    # and nearby points on S1 (perturb p along the sphere and re-project) are no closer
    near = proj(p + 1e-2 * jnp.asarray(rng.standard_normal((500, 10))))
    assert d_star <= float(jnp.linalg.norm(near - v, axis=-1).min()) + 1e-12


def test_bad_eps_rejected():
    with pytest.raises(ValueError, match="eps"):
        itde.LayerNormProjection(eps=-1.0)


def test_feedforward_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation.*'tanh'"):
        itde.FeedForward.init(jax.random.key(0), 6, 10, activation="tanh")


# ------------------------------------------------------------------ traced and eager
class TestOperatorsUnderJitAndEager(chex.TestCase):
    """Each operator and projection, run eagerly and traced under `jax.jit`, against a
    reference written independently of the code (the state is the traced argument)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(False, True)
    def test_attention_is_the_quadrature_of_the_integral_operator(self, causal):
        att = _attention(jax.random.key(0))
        u = jax.random.normal(jax.random.key(1), (9, 12))
        fw = np.linspace(0.5, 1.5, 12)
        tw = np.linspace(0.2, 2.0, 9)

        @self.variant
        def apply(u, log_tw):
            return att(u, feature_weights=fw, token_log_weights=log_tw, causal=causal)

        got = apply(u, jnp.log(tw))
        ref = _reference_attention(att, u, fw, tw, causal)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-12, atol=1e-12)

    @chex.variants(with_jit=True, without_jit=True)
    def test_causal_output_does_not_see_the_future(self):
        att = _attention(jax.random.key(4))
        u = jax.random.normal(jax.random.key(5), (8, 12))
        v = u.at[5:].set(jax.random.normal(jax.random.key(6), (3, 12)))
        apply = self.variant(lambda u: att(u, causal=True))
        a, b = apply(u), apply(v)
        np.testing.assert_allclose(np.asarray(a[:5]), np.asarray(b[:5]), rtol=0, atol=1e-14)
        assert np.max(np.abs(np.asarray(a[5:] - b[5:]))) > 1e-3

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(None, "trapezoid")
    def test_projection_lands_on_S1(self, weights):
        fw = None if weights is None else itde.Trapezoid(interval=(0, 2)).nodes_weights(16)[1]
        ln = itde.LayerNormProjection(0.7, 1.9, eps=0.0)
        v = 3.0 * jax.random.normal(jax.random.key(0), (20, 16)) + 2.0
        p = self.variant(lambda v: ln(v, fw))(v)
        # the constraint written out: weighted feature mean 0.7 and variance 1.9**2
        w = np.ones(16) if fw is None else np.asarray(fw)
        w = w / w.sum()
        pn = np.asarray(p)
        mean = pn @ w
        var = ((pn - mean[:, None]) ** 2) @ w
        np.testing.assert_allclose(mean, 0.7, rtol=0, atol=1e-13)
        np.testing.assert_allclose(var, 1.9**2, rtol=1e-13, atol=0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_zero_variance_token_raises_with_eps_zero_and_maps_to_sigma1_with_eps(self):
        u = jnp.ones((3, 8)).at[1].set(jnp.arange(8.0))
        exact = self.variant(lambda u: itde.LayerNormProjection(0.0, 1.0, eps=0.0)(u))
        with pytest.raises(Exception, match="zero feature variance"):
            jax.block_until_ready(exact(u))
        out = self.variant(lambda u: itde.LayerNormProjection(0.25, 1.0, eps=1e-5)(u))(u)
        assert bool(jnp.all(jnp.isfinite(out)))
        np.testing.assert_allclose(np.asarray(out[0]), 0.25, rtol=0, atol=0)

    @chex.variants(with_jit=True, without_jit=True)
    def test_feedforward_relu_is_projection_onto_S2(self):
        ff = itde.FeedForward.init(jax.random.key(0), 6, 10, activation="relu")
        u = jax.random.normal(jax.random.key(1), (4, 6))
        w1, b1, w2, b2 = (np.asarray(a) for a in (ff.w1, ff.b1, ff.w2, ff.b2))
        expected = np.maximum(np.asarray(u) @ w1 + b1, 0) @ w2 + b2  # P_S2 = max(., 0)
        got = self.variant(lambda u: ff(u))(u)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-13, atol=1e-14)


def test_flat_random_draws_equal_shaped_ones():
    """Initialisers draw flat and reshape (one cheap compile per size instead of an
    expensive one per shape); the parameters must be exactly those of the shaped draw.
    (Few shapes: each shaped reference draw is itself a slow compile.)"""
    from itde._internal import normal, uniform

    key = jax.random.key(3)
    for shape, dtype in (((3, 4, 6), jnp.float32), ((4, 5), jnp.float64)):
        np.testing.assert_array_equal(
            uniform(key, shape, dtype, -0.3, 0.7), jax.random.uniform(key, shape, dtype, -0.3, 0.7)
        )
    np.testing.assert_array_equal(
        normal(key, (5, 6), jnp.float32), jax.random.normal(key, (5, 6), jnp.float32)
    )
