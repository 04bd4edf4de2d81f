"""OLMoE as an equation: `OlmoeForCausalLM` exact against `transformers` (float64 inside
`itde.interop.hf_float64()`): OLMo's query/key norm over the whole projection
(`itde.JointQKNorm`) and a mixture of experts whose top-k probabilities are kept as they are
(`norm_topk_prob=False`, OLMoE-1B-7B's) or renormalised; logits at drawn lengths with left
and right padding, greedy generation with the KV cache, `to_hf` back; every length 1..300
in the slow tier. `clip_qkv` is refused by name.

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
        vocab_size=VOCAB, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
        attention_bias=True, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    config = tf.OlmoeConfig(**(sizes | fields))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def _model(config, cls=tf.OlmoeForCausalLM):
    torch.manual_seed(0)
    return spread_hf_weights(cls(config)).double().eval()


@pytest.fixture(scope="module")
def olmoe():
    model = _model(_config())
    return model, itde.from_hf(model)


def _padded(ids, n, side, length=L):
    return padded_window(ids, n, side, length)


def test_the_converted_layers_are_joint_qk_norms_and_mixtures(olmoe):
    model, lm = olmoe
    blocks = lm.base.equation.controls.blocks
    assert isinstance(blocks.attention.qk_norm, itde.JointQKNorm)
    ff = blocks.feedforward
    assert isinstance(ff, itde.MixtureOfExperts)
    assert ff.routing == itde.SoftmaxTopK(2)  # norm_topk_prob=False: not renormalised
    assert ff.shared is None and ff.n_experts == 6
    assert model.model.layers[0].self_attn.q_norm.weight.shape == (16,)  # the whole projection


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, L), seed=st.integers(0, 2**16))
def test_logits_equal_transformers_at_drawn_lengths_and_padding(olmoe, n, seed):
    """n drawn tokens in the compiled window of L, padded on the left and on the right."""
    model, lm = olmoe
    ids = np.random.RandomState(seed).randint(3, VOCAB, size=n)
    (a, ma), (b, mb) = _padded(ids, n, "left"), _padded(ids, n, "right")
    rows, masks = np.stack([a, b]), np.stack([ma, mb])
    ours = np.asarray(LOGITS(lm, jnp.asarray(rows), jnp.asarray(masks)))
    ref = _hf_logits(model, rows, masks)
    real = masks == 1
    assert _rel(ours[real], ref[real]) <= 1e-10


def test_greedy_generation_with_the_cache_equals_transformers(olmoe):
    model, lm = olmoe
    prompt = np.random.RandomState(1).randint(3, VOCAB, size=5)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0].numpy()  # fmt: skip
    ours = lm.generate(jnp.asarray(prompt), 8, max_length=16, chunk=4, cache=True)
    np.testing.assert_array_equal(ours, ref)


def test_to_hf_round_trip_is_exact(olmoe):
    model, lm = olmoe
    back = itde.to_hf(lm)
    assert type(back) is type(model)
    ours, theirs = back.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k


def test_renormalised_routing_equals_transformers():
    """`norm_topk_prob=True`: the gates renormalised over each token's top k
    (`itde.RenormalisedTopK`), the base `OlmoeModel`'s hidden states exact."""
    model = _model(_config(norm_topk_prob=True, num_hidden_layers=1), tf.OlmoeModel)
    m = itde.from_hf(model)
    assert m.equation.controls.blocks.feedforward.routing == itde.RenormalisedTopK(2)
    ids = np.random.RandomState(2).randint(3, VOCAB, size=7)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids[None])).last_hidden_state[0].numpy()
    assert _rel(np.asarray(m(jnp.asarray(ids))), ref) <= 1e-10


def test_clip_qkv_is_refused_by_name():
    model = tf.OlmoeModel(_config(clip_qkv=8.0, num_hidden_layers=1))
    with pytest.raises(ValueError, match=r"`config\.clip_qkv`=8\.0 is not supported: .*clamps"):
        itde.from_hf(model)


@pytest.mark.slow
def test_logits_equal_transformers_at_every_length_to_300(olmoe):
    """Every length 1..300, each as a window of 300 tokens padded on the right and on the
    left (one compiled program), against Hugging Face's batch with the same masks."""
    model, lm = olmoe
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
