"""Attention with a non-unit quadrature on each head's domain, against the integral
operator written out in NumPy: both integrals over $\\Omega_h$ (the score's inner product
and the output kernel's) carry the head weights.

Elsewhere the head weights are only compared with the same `Attention` called with the
same weights (function kernels against their sampled modules), so dropping one of the
two integrals' weights passes there."""

import math

import jax.numpy as jnp
import numpy as np

import itde


def test_attention_head_quadrature_weights_both_head_integrals():
    h, d, e, n = 2, 5, 4, 6
    rng = np.random.default_rng(0)
    w = lambda *s: rng.normal(size=s) * 0.6  # noqa: E731
    wq, wk, wv, wo = w(h, d, e), w(h, d, e), w(h, d, e), w(h, e, d)
    bq, bk, bv, bo = w(h, e), w(h, e), w(h, e), w(d)
    att = itde.Attention(*(jnp.asarray(a) for a in (wq, wk, wv, wo, bq, bk, bv, bo)))
    u = rng.normal(size=(n, d))
    fw = np.linspace(0.5, 1.5, d)  # feature weights
    hw = np.array([0.1, 0.4, 0.3, 0.2])  # head weights, |Omega_h| = 1
    got = att(jnp.asarray(u), feature_weights=fw, head_weights=hw)
    out = np.zeros((n, d)) + bo
    for m in range(h):
        Q, K, V = ((u * fw) @ wt[m] + bt[m] for wt, bt in ((wq, bq), (wk, bk), (wv, bv)))
        s = (Q * hw) @ K.T / math.sqrt(hw.sum())  # <Q(x), K(x~)>_{Omega_h} / sqrt|Omega_h|
        g = np.exp(s - s.max(axis=1, keepdims=True))
        g /= g.sum(axis=1, keepdims=True)
        out += (g @ V * hw) @ wo[m]  # int_{Omega_h} W^O(eta, y) V(x~, eta) d eta
    np.testing.assert_allclose(np.asarray(got), out, rtol=0, atol=1e-12)


def test_rms_tangent_is_the_orthogonal_projection_onto_the_spheres_tangent_space():
    """At u on the sphere mean_y u^2 = sigma^2 (weighted feature mean), the tangent space is
    {w : mean_y(w u) = 0}; its orthogonal projection removes the component along u."""
    sigma, n, d = 1.7, 4, 7
    rng = np.random.default_rng(2)
    fw = np.linspace(0.2, 1.0, d)
    p = fw / fw.sum()  # the feature mean's weights: (1/|Omega_y|) int . dy
    v = rng.normal(size=(n, d))
    u = sigma * v / np.sqrt((v * v) @ p)[:, None]  # on the sphere
    w = rng.normal(size=(n, d))
    norm = itde.RMSNormProjection(sigma, eps=0.0)
    got = np.asarray(norm.tangent(jnp.asarray(u), jnp.asarray(w), fw))
    np.testing.assert_allclose((got * u) @ p, 0.0, rtol=0, atol=1e-13)  # tangent
    coef = ((w * u) @ p) / ((u * u) @ p)
    np.testing.assert_allclose(w - got, coef[:, None] * u, rtol=0, atol=1e-13)  # along u
