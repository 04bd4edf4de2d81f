"""The attention cores with pair terms: per-query weights (positive and signed), score
biases, and rows with no admissible key, against a direct NumPy sum."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from itde import blocked_attention, dense_attention, fused_attention

CORES = {"dense": dense_attention, "blocked": blocked_attention, "fused": fused_attention}
# the XLA fused path takes its softmax in float32 whatever the input dtype
ATOL = {"dense": 1e-12, "blocked": 1e-12, "fused": 1e-5}


def _inputs(n=11, heads=2, e=4, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (heads, n, e), jnp.float64) / math.sqrt(e)
    k = jax.random.normal(kk, (heads, n, e), jnp.float64)
    v = jax.random.normal(kv, (heads, n, e), jnp.float64)
    return q, k, v


def _reference(q, k, v, lw=None, weights=None, bias=None, causal=False):
    """$\\sum_p W_{kp} e^{s_{kp}} v_p / \\sum_p W_{kp} e^{s_{kp}}$ by a direct NumPy loop
    (0 when no key is admissible)."""
    q, k, v = (np.asarray(a) for a in (q, k, v))
    h, n, _ = q.shape
    w = np.ones((n, n)) if weights is None else np.asarray(weights, np.float64)
    if lw is not None:
        w = w * np.exp(np.asarray(lw))[None, :]
    if causal:
        w = w * np.tril(np.ones((n, n)))
    b = np.zeros((h, n, n)) if bias is None else np.broadcast_to(np.asarray(bias), (h, n, n))
    out = np.zeros_like(v)
    for m in range(h):
        for i in range(n):
            keep = (w[i] != 0) & np.isfinite(b[m, i])
            if not keep.any():
                continue
            s = q[m, i] @ k[m].T + np.where(keep, b[m, i], 0.0)
            e = np.where(keep, np.exp(s - s[keep].max()), 0.0) * w[i]
            out[m, i] = e @ v[m] / e.sum()
    return out


def _call(core, q, k, v, **kw):
    return CORES[core](q, k, v, block_size=4, **kw)


@pytest.mark.parametrize("core", list(CORES))
@pytest.mark.parametrize("causal", [False, True])
def test_positive_query_weights_and_bias_equal_the_direct_sum(core, causal):
    q, k, v = _inputs()
    n = q.shape[1]
    rng = np.random.default_rng(1)
    weights = rng.uniform(0.2, 2.0, (n, n)) * (rng.uniform(size=(n, n)) > 0.2)
    np.fill_diagonal(weights, 1.0)
    bias = rng.normal(size=(2, n, n))
    lw = jnp.asarray(np.log(rng.uniform(0.5, 2.0, n)))
    got = _call(
        core,
        q,
        k,
        v,
        token_log_weights=lw,
        query_weights=jnp.asarray(weights),
        score_bias=jnp.asarray(bias),
        causal=causal,
    )
    ref = _reference(q, k, v, lw, weights, bias, causal)
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL[core])


@pytest.mark.parametrize("core", ["dense", "blocked"])
def test_signed_query_weights_equal_the_direct_sum(core):
    q, k, v = _inputs()
    n = q.shape[1]
    rng = np.random.default_rng(2)
    weights = rng.uniform(0.5, 2.0, (n, n))
    weights[:, ::3] *= -0.1  # a few small negative weights; every row sum stays positive
    got = _call(core, q, k, v, query_weights=jnp.asarray(weights), signed_weights=True)
    ref = _reference(q, k, v, weights=weights)
    assert (weights < 0).any()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


def test_fused_refuses_signed_weights():
    q, k, v = _inputs()
    w = jnp.ones((q.shape[1],) * 2)
    with pytest.raises(ValueError, match="signed"):
        fused_attention(q, k, v, query_weights=w, signed_weights=True)


# one case per core by default (per-query weights with empty rows, and every key padded);
# the other ways to empty a row run with -m slow
EMPTY_CASES = [
    pytest.param(
        core, how, marks=[] if how in ("query_weights", "log_weights") else pytest.mark.slow
    )
    for core in CORES
    for how in ("log_weights", "query_weights", "bias", "signed")
    if not (core == "fused" and how == "signed")  # fused refuses signed weights (above)
]


@pytest.mark.parametrize("core,how", EMPTY_CASES)
def test_rows_without_keys_give_zero_with_finite_gradients(core, how):
    """Rows 0 and 5 see no key (a padded sequence, a fully masked row): output 0 in every
    core, gradients finite, and the other rows unchanged."""
    q, k, v = _inputs(n=9)
    n = q.shape[1]
    w = np.ones((n, n))
    w[[0, 5], :] = 0.0
    kw = {}
    if how == "log_weights":  # every key padded: the whole output is 0
        kw["token_log_weights"] = jnp.full((n,), -jnp.inf)
        w = np.zeros((n, n))
    elif how == "query_weights":
        kw["query_weights"] = jnp.asarray(w)
    elif how == "signed":
        kw.update(query_weights=jnp.asarray(w), signed_weights=True)
    else:
        kw["score_bias"] = jnp.asarray(np.where(w > 0, 0.0, -np.inf))
    for causal in (False, True):

        @jax.jit  # one compile instead of an op-by-op gradient of the block loop
        def value_and_grads(q, k, v, causal=causal):
            out = _call(core, q, k, v, causal=causal, **kw)
            grads = jax.grad(
                lambda q, k, v: jnp.sum(jnp.tanh(_call(core, q, k, v, causal=causal, **kw))),
                argnums=(0, 1, 2),
            )(q, k, v)
            return out, grads

        got, grads = value_and_grads(q, k, v)
        ref = _reference(q, k, v, weights=w, causal=causal)
        assert np.all(np.asarray(got)[:, ~w.any(axis=1)] == 0.0)
        np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL[core])
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_rows_without_keys_stay_finite_in_low_precision_under_large_cotangents(dtype):
    """The dense core shifts a keyless row by the lowest finite number and adds e^(lo - m)
    to its sum (1 there, exactly 0 elsewhere): its output is 0, its gradients finite even
    for a cotangent of 1e30, and every other row equals the float64 direct sum."""
    q, k, v = _inputs(n=9)
    n = q.shape[1]
    mask = np.ones(n, bool)
    mask[:3] = False  # left padding: under causal, queries 0-2 see no key
    lw = jnp.where(jnp.asarray(mask), 0.0, -jnp.inf).astype(dtype)
    q, k, v = (a.astype(dtype) for a in (q, k, v))

    @jax.jit
    def value_and_grads(q, k, v):
        f = lambda q, k, v: dense_attention(q, k, v, token_log_weights=lw, causal=True)  # noqa: E731
        out, vjp = jax.vjp(f, q, k, v)
        return out, vjp(jnp.full(out.shape, 1e30, dtype))

    got, grads = value_and_grads(q, k, v)
    assert np.all(np.asarray(got[:, :3], np.float64) == 0.0)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    ref = _reference(*(a.astype(jnp.float64) for a in (q, k, v)), weights=np.tile(mask, (n, 1)),
                     causal=True)  # fmt: skip
    tol = 1e-6 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), ref, rtol=0, atol=tol)


def test_bias_as_a_function_of_indices_equals_the_array():
    q, k, v = _inputs(n=10)
    n = q.shape[1]
    b = jax.random.normal(jax.random.PRNGKey(5), (2, n, n), jnp.float64)
    fn = lambda iq, ik: b[:, iq[:, None], ik[None, :]]  # noqa: E731
    for core in ("dense", "blocked", "fused"):  # jitted: one compile per call, not per op
        got = jax.jit(lambda q, k, v, core=core: _call(core, q, k, v, score_bias=fn, causal=True))(
            q, k, v
        )
        ref = jax.jit(lambda q, k, v, core=core: _call(core, q, k, v, score_bias=b, causal=True))(
            q, k, v
        )
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


def test_bad_pair_terms_raise():
    q, k, v = _inputs(n=6)
    with pytest.raises(ValueError, match="query_weights"):
        dense_attention(q, k, v, query_weights=jnp.ones((5, 6)))
    with pytest.raises(ValueError, match="score_bias"):
        blocked_attention(q, k, v, score_bias=jnp.ones((3, 6, 6)))
    with pytest.raises(ValueError, match="signed_weights=True` needs `query_weights"):
        dense_attention(q, k, v, signed_weights=True)
    with pytest.raises(TypeError, match="signed_weights"):
        dense_attention(q, k, v, query_weights=jnp.ones((6, 6)), signed_weights="yes")
