"""Blocked (online-softmax) attention equals the dense reference, values and gradients."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from itde import blocked_attention, dense_attention, fused_attention


def _inputs(n, dtype, heads=2, e=8, seed=0):
    kq, kk, kv, kw = jax.random.split(jax.random.PRNGKey(seed + n), 4)
    q = jax.random.normal(kq, (heads, n, e), dtype) / math.sqrt(e)
    k = jax.random.normal(kk, (heads, n, e), dtype)
    v = jax.random.normal(kv, (heads, n, e), dtype)
    w = jax.random.uniform(kw, (n,), dtype, 0.1, 3.0)  # non-uniform quadrature weights
    return q, k, v, jnp.log(w)


TOL = {jnp.float64: 1e-12, jnp.float32: 1e-5}


def _check_blocked_equals_dense(variant, n_block, causal, dtype):
    n, block = n_block
    q, k, v, lw = _inputs(n, dtype)
    ref = dense_attention(q, k, v, token_log_weights=lw, causal=causal)
    blocked = functools.partial(blocked_attention, causal=causal, block_size=block)
    got = variant(lambda q, k, v, lw: blocked(q, k, v, token_log_weights=lw))(q, k, v, lw)
    assert got.shape == ref.shape and got.dtype == ref.dtype == q.dtype == dtype
    chex.assert_trees_all_close(got, ref, rtol=0, atol=TOL[dtype])


class BlockedEqualsDense(chex.TestCase):
    """Blocked attention, called directly and under `jax.jit`, equals the dense reference:
    a ragged last block (37 = 4 x 8 + 5) and an exact multiple (64 = 4 x 16), each dtype,
    with and without the causal mask."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(
        dtype=[jnp.float64, jnp.float32], causal=[False, True], n_block=[(37, 8), (64, 16)]
    )
    def test_blocked_equals_dense(self, n_block, causal, dtype):
        _check_blocked_equals_dense(self.variant, n_block, causal, dtype)


@pytest.mark.slow  # more shapes of the same property: one token, and more ragged blocks
class BlockedEqualsDenseMoreShapes(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.product(
        dtype=[jnp.float64, jnp.float32], causal=[False, True], n_block=[(1, 4), (100, 16)]
    )
    def test_blocked_equals_dense(self, n_block, causal, dtype):
        _check_blocked_equals_dense(self.variant, n_block, causal, dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_blocked_without_weights_and_block_larger_than_tokens(causal):
    q, k, v, _ = _inputs(13, jnp.float64)
    ref = dense_attention(q, k, v, causal=causal)
    for block in (5, 13, 512, None):
        got = blocked_attention(q, k, v, causal=causal, block_size=block)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
# a ragged last block by default; the exact multiple with -m slow (its forward stays default)
@pytest.mark.parametrize("n,block", [(23, 8), pytest.param(32, 8, marks=pytest.mark.slow)])
def test_gradients_blocked_equal_dense(n, block, causal):
    q, k, v, lw = _inputs(n, jnp.float64)
    ct = jax.random.normal(jax.random.PRNGKey(9), q.shape, q.dtype)

    def loss(fn, *args):
        return jnp.sum(
            jnp.tanh(fn(*args[:3], token_log_weights=args[3], causal=causal, block_size=block)) * ct
        )

    # jitted: one compile instead of an op-by-op gradient of the block loop
    g_ref = jax.jit(jax.grad(lambda *a: loss(dense_attention, *a), argnums=(0, 1, 2, 3)))(
        q, k, v, lw
    )
    g_blk = jax.jit(jax.grad(lambda *a: loss(blocked_attention, *a), argnums=(0, 1, 2, 3)))(
        q, k, v, lw
    )
    chex.assert_tree_all_finite(g_blk)
    chex.assert_trees_all_close(g_blk, g_ref, rtol=0, atol=1e-12)


def test_forward_mode_derivative_blocked_equals_dense():
    q, k, v, lw = _inputs(19, jnp.float64)
    dq = jax.random.normal(jax.random.PRNGKey(3), q.shape, q.dtype)
    f = lambda fn: lambda x: fn(x, k, v, token_log_weights=lw, causal=True, block_size=8)  # noqa: E731
    _, t_ref = jax.jvp(f(dense_attention), (q,), (dq,))
    _, t_blk = jax.jvp(f(blocked_attention), (q,), (dq,))
    np.testing.assert_allclose(t_blk, t_ref, rtol=0, atol=1e-12)


# `jax.nn.dot_product_attention` (XLA path) always takes the softmax in float32, even for
# float64 inputs, so the fused path is float32-accurate whatever the dtype.
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_equals_dense(causal, dtype):
    q, k, v, lw = _inputs(29, dtype)
    ref = dense_attention(q, k, v, token_log_weights=lw, causal=causal)
    got = fused_attention(q, k, v, token_log_weights=lw, causal=causal)
    assert got.dtype == ref.dtype
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    got = fused_attention(q, k, v, causal=causal)
    np.testing.assert_allclose(got, dense_attention(q, k, v, causal=causal), rtol=0, atol=1e-5)


def test_uniform_log_weight_cancels():
    q, k, v, _ = _inputs(21, jnp.float64)
    ref = blocked_attention(q, k, v, block_size=8)
    got = blocked_attention(q, k, v, token_log_weights=jnp.full((21,), -3.7), block_size=8)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-13)


def test_bad_arguments_raise():
    q, k, v, lw = _inputs(10, jnp.float64)
    with pytest.raises(ValueError, match="block_size"):
        blocked_attention(q, k, v, block_size=0)
    with pytest.raises(ValueError, match="token_log_weights"):
        blocked_attention(q, k, v, token_log_weights=lw[:5])
    with pytest.raises(ValueError, match="heads, tokens, head_dim"):
        dense_attention(q[0], k[0], v[0])
