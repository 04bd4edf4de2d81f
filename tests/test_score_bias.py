"""Score-bias kernels: ALiBi and T5's relative bias equal Hugging Face's definitions on the
unit grid, and every bias gives the same attention in the dense, blocked and fused cores,
forward and gradient, with and without the causal mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.bloom.modeling_bloom import _get_alibi_slopes, build_alibi_tensor
from transformers.models.t5.modeling_t5 import T5Attention

import itde

CORES = {
    "dense": itde.dense_attention,
    "blocked": itde.blocked_attention,
    "fused": itde.fused_attention,
}


def test_alibi_slopes_equal_hugging_face():
    for h in (1, 2, 3, 4, 6, 8, 12, 16):
        np.testing.assert_allclose(
            itde.alibi_slopes(h), _get_alibi_slopes(h, torch.device("cpu")).double().numpy(),
            rtol=1e-6,  # Hugging Face computes them in float32
        )  # fmt: skip


def test_t5_bucket_equals_hugging_face():
    rel = np.arange(-300, 301)
    for bidirectional in (True, False):
        for nb, md in ((32, 128), (16, 40)):
            ref = T5Attention._relative_position_bucket(
                torch.tensor(rel), bidirectional=bidirectional, num_buckets=nb, max_distance=md
            ).numpy()
            got = itde.t5_bucket(
                jnp.asarray(rel), bidirectional=bidirectional, n_buckets=nb, max_distance=md
            )
            np.testing.assert_array_equal(np.asarray(got), ref)


def _qkv(n=10, heads=4, e=4):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(3), 3)
    shape = (heads, n, e)
    return tuple(jax.random.normal(kk_, shape, jnp.float64) for kk_ in (kq, kk, kv))


def _softmax_attention(q, k, v, bias, causal):
    """Attention with an explicit [heads, n, n] bias, in NumPy."""
    s = np.einsum("hne,hme->hnm", q, k) + bias
    if causal:
        s = np.where(np.tril(np.ones(s.shape[1:], bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hnm,hme->hne", p / p.sum(-1, keepdims=True), v)


def test_alibi_on_the_unit_grid_is_bloom_alibi():
    """Causal attention with ALiBi on the unit grid's nodes equals attention with BLOOM's
    bias (slope times key position; a constant per query away from the paper's)."""
    n, h = 10, 4
    q, k, v = _qkv(n, h)
    nodes = itde.Midpoint().nodes_weights(n)[0]  # k + 1/2: unit spacing
    hf = build_alibi_tensor(torch.ones(1, n), h, torch.float64).numpy()  # [h, 1, n]
    ref = _softmax_attention(*(np.asarray(a) for a in (q, k, v)), hf, causal=True)
    # HF's float32 slopes (the slopes themselves: test_alibi_slopes_equal_hugging_face)
    slopes = _get_alibi_slopes(h, torch.device("cpu")).double().numpy()
    bias = itde.ALiBi(jnp.asarray(slopes)).on_nodes(nodes)
    got = itde.dense_attention(q, k, v, score_bias=bias, causal=True)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-12)


def test_t5_bias_on_the_unit_grid_is_t5s():
    n, h = 10, 4
    emb = jax.random.normal(jax.random.PRNGKey(0), (32, h), jnp.float64)
    bias = itde.T5RelativeBias(emb, bidirectional=False, max_distance=6)
    nodes = itde.Midpoint().nodes_weights(n)[0]
    pos = torch.arange(n)
    buckets = T5Attention._relative_position_bucket(
        pos[None, :] - pos[:, None], bidirectional=False, num_buckets=32, max_distance=6
    ).numpy()
    ref = np.moveaxis(np.asarray(emb)[buckets], -1, 0)  # HF's compute_bias: [h, q, k]
    np.testing.assert_array_equal(np.asarray(bias(nodes, nodes)), ref)
    np.testing.assert_array_equal(
        np.asarray(bias.on_nodes(nodes)(jnp.arange(n), jnp.arange(n))), ref
    )


def _biases(n, h):
    nodes = jnp.asarray(itde.Trapezoid(interval=(0.0, 1.0)).nodes_weights(n)[0])
    return {
        "alibi": itde.ALiBi.init(h, spacing=0.1, dtype=jnp.float64).on_nodes(nodes),
        "t5": itde.T5RelativeBias.init(
            jax.random.PRNGKey(1), h, max_distance=8, spacing=0.1, scale=1.0, dtype=jnp.float64
        ).on_nodes(nodes),
        "discrete": itde.DiscreteBias(jax.random.normal(jax.random.PRNGKey(2), (h, n, n))),
    }


# the default run keeps the discrete bias in every core (the same code path as a sampled
# position bias; ALiBi in the model is in test_family); ALiBi and T5 here with -m slow
@pytest.mark.parametrize("kind", [pytest.param("alibi", marks=pytest.mark.slow),
                                  pytest.param("t5", marks=pytest.mark.slow), "discrete"])
def test_biases_equal_in_every_core_forward_and_gradient(kind):
    n, h = 11, 4
    q, k, v = _qkv(n, h)
    bias = _biases(n, h)[kind]
    lw = jnp.log(jnp.linspace(0.5, 1.5, n))
    ct = jax.random.normal(jax.random.PRNGKey(9), q.shape, q.dtype)
    for causal in (False, True):

        def loss(q, k, v, bias, core):
            out = CORES[core](
                q, k, v, token_log_weights=lw, score_bias=bias, causal=causal, block_size=4
            )
            return jnp.sum(jnp.tanh(out) * ct), out

        # jitted: one compile per core instead of an op-by-op gradient of the block loops
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True), static_argnums=4)
        res = {core: grad(q, k, v, bias, core) for core in CORES}
        for core in ("blocked", "fused"):
            atol = 1e-12 if core == "blocked" else 1e-5  # XLA's fused softmax: float32
            jax.tree.map(
                lambda a, b, atol=atol: np.testing.assert_allclose(a, b, rtol=0, atol=atol),
                res[core], res["dense"],
            )  # fmt: skip


def test_bias_arguments_are_checked():
    with pytest.raises(ValueError, match="spacing"):
        itde.ALiBi.init(4, spacing=0.0)
    with pytest.raises(ValueError, match="n_heads"):
        itde.alibi_slopes(0)
    with pytest.raises(ValueError, match="embedding"):
        itde.T5RelativeBias(jnp.zeros((4,)))
    with pytest.raises(ValueError, match="heads, N, N"):
        itde.DiscreteBias(jnp.zeros((2, 3, 4)))
