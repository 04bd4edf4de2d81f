"""`itde.analysis.spectra` and `leading_spectra` never hand LAPACK a batch of matrices.

jaxlib's batched CPU kernels (`ParallelBatchMap` in its QR, SVD and eigenvalue kernels)
split a batch over XLA's thread pool; two of them side by side on a two-thread CPU waited on
each other forever at SmolLM2's size (30 layers, 9 heads), so `spectra()` hung there. Every
decomposition now takes one matrix at a time (`jax.lax.map`). Checked on the traced program
of a model whose depths and heads would have been one batch each (the primitive's operand
is a single matrix, rank 2), and the values against NumPy's at that size.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.analysis._internal import _spectra as S

#: The primitives that become LAPACK calls on the CPU.
LAPACK = {"svd", "eig", "eigh", "qr", "geqrf", "geqp3", "householder_product", "lu",
          "cholesky", "schur", "hessenberg", "tridiagonal"}  # fmt: skip


def _lapack_operands(jaxpr, found):
    """(primitive, operand shape) of every LAPACK primitive in `jaxpr` and its sub-jaxprs."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in LAPACK:
            found.append((eqn.primitive.name, tuple(eqn.invars[0].aval.shape)))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _lapack_operands(sub, found)
    return found


@pytest.fixture(scope="module")
def model():
    m = itde.TransformerIDE.init(jax.random.key(3), n_layers=5, n_features=12, n_heads=6,
                                 n_hidden=20, gated=True, n_kv_heads=3)  # fmt: skip
    return jax.tree.map(lambda a: a.astype(jnp.float64) if _floating(a) else a, m)


def _floating(a):
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


@pytest.mark.parametrize("which", ["spectra", "leading"])
def test_no_batched_lapack_call(model, which):
    ts = jnp.asarray(model.controls.layer_times()[:-1])
    fn = S._spectra_at if which == "spectra" else S._leading_at
    closed = jax.make_jaxpr(lambda t: fn(model, t))(ts)
    found = _lapack_operands(closed.jaxpr, [])
    assert found, "no LAPACK primitive found: the walk over the program is broken"
    batched = [(name, shape) for name, shape in found if len(shape) != 2]
    assert not batched, f"batched LAPACK calls (deadlock on two threads): {batched}"


def test_spectra_values_one_matrix_at_a_time(model):
    s = itde.analysis.spectra(model)
    for n in range(model.controls.n_layers):
        layer = model.controls.layer(n)
        att, ff = layer.attention, layer.feedforward
        for h in range(6):
            qk = np.asarray(att.wq[h]) @ np.asarray(att.wk[h // 2]).T
            vo = np.asarray(att.wv[h // 2]) @ np.asarray(att.wo[h])
            for got, mat in ((s.qk_singular_values, qk), (s.vo_singular_values, vo)):
                want = np.linalg.svd(mat, compute_uv=False)[: got.shape[-1]]
                np.testing.assert_allclose(got[n, h], want, rtol=1e-9, atol=1e-12)
            lam = np.linalg.eigvals(qk)
            want = np.sort(np.abs(lam))[::-1][: s.qk_eigenvalues.shape[-1]]
            np.testing.assert_allclose(np.abs(s.qk_eigenvalues[n, h]), want, rtol=1e-8,
                                       atol=1e-10)  # fmt: skip
        w1, w2 = np.asarray(ff.w1), np.asarray(ff.w2)
        np.testing.assert_allclose(s.w1_singular_values[n], np.linalg.svd(w1, compute_uv=False),
                                   rtol=1e-9)  # fmt: skip
        np.testing.assert_allclose(s.w2_singular_values[n], np.linalg.svd(w2, compute_uv=False),
                                   rtol=1e-9)  # fmt: skip
        np.testing.assert_allclose(
            s.w_gate_singular_values[n], np.linalg.svd(np.asarray(ff.w_gate), compute_uv=False),
            rtol=1e-9,
        )
