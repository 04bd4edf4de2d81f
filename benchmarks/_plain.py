"""The plain-JAX baseline shared by the benchmark scripts: a post-LN Transformer encoder
written directly in JAX, `lax.scan` over the stacked layers, PyTorch's weight layout."""

import math

import jax
import jax.numpy as jnp


def layer_norm(x, g, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * g + b


def plain_encoder(p, x, n_heads, causal=False, act=jax.nn.relu, remat=False):
    """Post-LN encoder over `x` `[batch, tokens, width]`; `p` holds PyTorch's
    `TransformerEncoderLayer` parameters stacked along a leading layer axis (`w_in`, `b_in`,
    `w_out`, `b_out`, `w1`, `b1`, `w2`, `b2`, `g1`, `b1n`, `g2`, `b2n`). Attention is
    head-major (`[batch, heads, tokens, head]`, one transpose of q, k, v each: the faster
    forward on XLA:CPU, the same values). `remat`: each layer under `jax.checkpoint` (one
    state kept per layer, the layer recomputed in the backward pass: the memory policy of
    `itde.solve`)."""
    B, N, d = x.shape
    dh = d // n_heads
    mask = jnp.tril(jnp.ones((N, N), bool)) if causal else None

    def layer(x, p):
        qkv = (x @ p["w_in"].T + p["b_in"]).reshape(B, N, 3, n_heads, dh)
        q, k, v = qkv.transpose(2, 0, 3, 1, 4)
        s = jnp.einsum("bhne,bhme->bhnm", q / math.sqrt(dh), k)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        o = jnp.einsum("bhnm,bhme->bhne", jax.nn.softmax(s, -1), v)
        o = o.transpose(0, 2, 1, 3).reshape(B, N, d)
        x = layer_norm(x + o @ p["w_out"].T + p["b_out"], p["g1"], p["b1n"])
        h = act(x @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
        return layer_norm(x + h, p["g2"], p["b2n"]), None

    return jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, p)[0]


def random_params(key, n_layers: int, width: int, hidden: int) -> dict:
    """Random parameters for `plain_encoder` (weights N(0, 0.05^2), norms' gains 1)."""
    d, f = width, hidden
    shapes = dict(w_in=(3 * d, d), b_in=(3 * d,), w_out=(d, d), b_out=(d,), w1=(f, d),
                  b1=(f,), w2=(d, f), b2=(d,), g1=(d,), b1n=(d,), g2=(d,), b2n=(d,))  # fmt: skip
    keys = jax.random.split(key, len(shapes))
    return {
        n: jnp.ones((n_layers, *sh))
        if n in ("g1", "g2")
        else 0.05 * jax.random.normal(k, (n_layers, *sh))
        for (n, sh), k in zip(shapes.items(), keys)
    }
