"""Position schemes against their formulas written out: RoPE's frequencies, and the ALiBi
and T5 score biases on a grid whose token spacing is not 1 (the length unit `spacing`).

Written to catch one-line bugs that the equivalence tests elsewhere cannot see: those take
the frequencies from `Rope.init` itself, or compare the biases on the unit grid only, where
multiplying and dividing by the spacing agree."""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.models.t5.modeling_t5 import T5Attention

import itde


def test_rope_frequencies_are_base_to_the_minus_2j_over_r():
    # omega_j = base^(-2j / r), j = 0 .. r/2 - 1 (Su et al.; Hugging Face's default RoPE)
    for head_dim, rotary_dim, base in ((8, None, 10000.0), (12, 8, 500.0)):
        r = head_dim if rotary_dim is None else rotary_dim
        expected = np.array([base ** (-2.0 * j / r) for j in range(r // 2)])
        rope = itde.Rope.init(head_dim, base=base, rotary_dim=rotary_dim, dtype=jnp.float64)
        np.testing.assert_allclose(np.asarray(rope.inv_freq), expected, rtol=1e-15, atol=0)


def _nodes(n, spacing):
    return spacing * (np.arange(n) + 0.5)  # a midpoint grid of cell width `spacing`


def test_alibi_on_a_grid_of_spacing_h_is_minus_slope_times_distance_over_h():
    spacing, n = 0.1, 6
    x = _nodes(n, spacing)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    got = np.asarray(itde.ALiBi(jnp.asarray(slopes), spacing)(jnp.asarray(x), jnp.asarray(x)))
    distance_in_cells = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
    expected = -slopes[:, None, None] * distance_in_cells[None]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)


def test_t5_bias_on_a_grid_of_spacing_h_reads_the_bucket_of_the_distance_in_cells():
    spacing, n, h = 0.1, 9, 3
    x = _nodes(n, spacing)
    emb = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (16, h), jnp.float64))
    for bidirectional in (True, False):
        bias = itde.T5RelativeBias(jnp.asarray(emb), bidirectional, 6, spacing)
        cells = torch.arange(n)
        buckets = T5Attention._relative_position_bucket(
            cells[None, :] - cells[:, None], bidirectional=bidirectional, num_buckets=16,
            max_distance=6,
        ).numpy()  # fmt: skip
        expected = np.moveaxis(emb[buckets], -1, 0)  # [heads, query, key]
        np.testing.assert_array_equal(np.asarray(bias(jnp.asarray(x), jnp.asarray(x))), expected)
