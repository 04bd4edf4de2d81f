"""Qwen3-MoE as an equation: `Qwen3MoeForCausalLM` exact against `transformers` (float64
inside `itde.interop.hf_float64()`): Qwen3's query/key norm per head (`itde.PerHeadQKNorm`,
`head_dim` 6, which is not 16 / 4) and a mixture of experts whose top-k probabilities are
renormalised over the chosen ones (`norm_topk_prob=True`, Qwen3-30B-A3B's); logits at drawn
lengths with left and right padding, greedy generation with the KV cache, `to_hf` back;
every length 1..300 in the slow tier. Layers all dense convert to the gated feed-forward,
dense and sparse together are refused by name (`mlp_only_layers`, `decoder_sparse_step`),
and `use_sliding_window` is a window in every layer.

One tiny model for the module (2 layers, width 16, 4 query heads sharing 2 key/value heads,
6 experts of which 2 per token, attention biases, vocabulary 64), its logits compiled once
for a padded window of `L` tokens. Hugging Face's experts run
`_experts_implementation="eager"` (its default `grouped_mm` is float32 or narrower only).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import hf_logits as _hf_logits
from helpers import padded_window, spread_hf_weights
from helpers import relative_error as _rel
from hypothesis import given, settings
from hypothesis import strategies as st

import itde

L, VOCAB = 40, 64
LOGITS = jax.jit(jax.vmap(lambda lm, i, k: lm.logits(i, k), in_axes=(None, 0, 0)))


def _config(**fields):
    sizes = dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=20, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=6, num_experts=6,
        num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True,
        attention_bias=True, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    config = tf.Qwen3MoeConfig(**(sizes | fields))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def _model(config, cls=tf.Qwen3MoeForCausalLM):
    torch.manual_seed(0)
    return spread_hf_weights(cls(config)).double().eval()


@pytest.fixture(scope="module")
def qwen3_moe():
    model = _model(_config())
    return model, itde.from_hf(model)


def _padded(ids, n, side, length=L):
    return padded_window(ids, n, side, length)


def test_the_converted_layers_are_per_head_qk_norms_and_mixtures(qwen3_moe):
    model, lm = qwen3_moe
    blocks = lm.base.equation.controls.blocks
    assert isinstance(blocks.attention.qk_norm, itde.PerHeadQKNorm)
    ff = blocks.feedforward
    assert isinstance(ff, itde.MixtureOfExperts)
    assert ff.routing == itde.RenormalisedTopK(2)  # norm_topk_prob=True: renormalised
    assert ff.shared is None and ff.n_experts == 6
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (6,)  # one head


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, L), seed=st.integers(0, 2**16))
def test_logits_equal_transformers_at_drawn_lengths_and_padding(qwen3_moe, n, seed):
    """n drawn tokens in the compiled window of L, padded on the left and on the right."""
    model, lm = qwen3_moe
    ids = np.random.RandomState(seed).randint(3, VOCAB, size=n)
    (a, ma), (b, mb) = _padded(ids, n, "left"), _padded(ids, n, "right")
    rows, masks = np.stack([a, b]), np.stack([ma, mb])
    ours = np.asarray(LOGITS(lm, jnp.asarray(rows), jnp.asarray(masks)))
    ref = _hf_logits(model, rows, masks)
    real = masks == 1
    assert _rel(ours[real], ref[real]) <= 1e-10


def test_greedy_generation_with_the_cache_equals_transformers(qwen3_moe):
    model, lm = qwen3_moe
    prompt = np.random.RandomState(1).randint(3, VOCAB, size=5)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0].numpy()  # fmt: skip
    ours = lm.generate(jnp.asarray(prompt), 8, max_length=16, chunk=4, cache=True)
    np.testing.assert_array_equal(ours, ref)


def test_to_hf_round_trip_is_exact(qwen3_moe):
    model, lm = qwen3_moe
    back = itde.to_hf(lm)
    assert type(back) is type(model)
    ours, theirs = back.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k


def _base_check(model, n=9, seed=2):
    """The base `Qwen3MoeModel`'s hidden states on n tokens, unpadded, within 1e-10."""
    m = itde.from_hf(model)
    ids = np.random.RandomState(seed).randint(3, VOCAB, size=n)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids[None])).last_hidden_state[0].numpy()
    assert _rel(np.asarray(m(jnp.asarray(ids))), ref) <= 1e-10
    return m


def test_dense_layers_convert_when_all_are_dense_and_are_refused_when_mixed():
    """Every layer dense (`mlp_only_layers` lists them all): the gated feed-forward of
    `intermediate_size`, exact and back; dense and sparse layers together: refused naming
    the fields."""
    model = _model(_config(mlp_only_layers=[0, 1]), tf.Qwen3MoeModel)
    m = _base_check(model)
    assert isinstance(m.equation.controls.blocks.feedforward, itde.GatedFeedForward)
    back = itde.to_hf(m)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    for fields in (dict(mlp_only_layers=[1]), dict(decoder_sparse_step=2)):
        mixed = tf.Qwen3MoeModel(_config(**fields))
        with pytest.raises(ValueError, match=r"mlp_only_layers.*decoder_sparse_step.*dense"):
            itde.from_hf(mixed)


def test_a_window_in_every_layer_and_softmax_routing_equal_transformers():
    """`use_sliding_window` with `sliding_window=4` (every layer, 9 tokens: past the window)
    and `norm_topk_prob=False` (`itde.SoftmaxTopK`), one layer, the base model."""
    fields = dict(use_sliding_window=True, sliding_window=4, norm_topk_prob=False,
                  num_hidden_layers=1)  # fmt: skip
    m = _base_check(_model(_config(**fields), tf.Qwen3MoeModel))
    assert m.equation.window == itde.SlidingWindow(4.0)
    assert m.equation.controls.blocks.feedforward.routing == itde.SoftmaxTopK(2)


@pytest.mark.slow
def test_logits_equal_transformers_at_every_length_to_300(qwen3_moe):
    """Every length 1..300, each as a window of 300 tokens padded on the right and on the
    left (one compiled program), against Hugging Face's batch with the same masks."""
    model, lm = qwen3_moe
    ids = np.random.RandomState(3).randint(3, VOCAB, size=300)
    run = jax.jit(jax.vmap(lambda i, k: lm.logits(i, k)))
    worst = 0.0
    for side in ("right", "left"):
        for start in range(1, 301, 50):
            rows, masks = map(np.stack, zip(*(
                _padded(ids, n, side, 300) for n in range(start, start + 50)
            )))  # fmt: skip
            ours = np.asarray(run(jnp.asarray(rows), jnp.asarray(masks)))
            ref = _hf_logits(model, rows, masks)
            real = masks == 1
            worst = max(worst, _rel(ours[real], ref[real]))
    assert worst <= 1e-10, worst
