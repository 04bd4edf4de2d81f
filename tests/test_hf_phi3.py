"""Phi-3 as an equation, exact against `transformers` itself: the fused `qkv_proj` and
`gate_up_proj` split into the equation's kernels (and fused again by `to_hf`), the rotation
of half of each head (`partial_rotary_factor` 0.5), a sliding window of 16 tokens in every
layer, grouped-query attention; LongRoPE refused by name.

One tiny `Phi3ForCausalLM` (2 layers, width 16, 4 query heads sharing 2 key/value heads) is
built for the module, float64, compared inside `itde.interop.hf_float64()`. The converted
forward runs through the model's own length buckets, so lengths share compiled programs.
"""

import numpy as np
import pytest
import torch
import transformers as tf
from helpers import check_causal_lm_logits, padding_rows, spread_hf_weights
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import itde

VOCAB, PAD, MAX_N = 64, 1, 300
SIZES = dict(
    vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_N,
    pad_token_id=PAD, bos_token_id=2, eos_token_id=3,
)  # fmt: skip
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
TOL = 1e-10  # relative to the largest logit on real tokens, float64


def _build(seed=0, **fields):
    config = tf.Phi3Config(**{**SIZES, "rope_parameters": dict(ROPE), **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return spread_hf_weights(tf.Phi3ForCausalLM(config)).double().eval()


@pytest.fixture(scope="module")
def pair():
    """(Hugging Face model, converted model), built once for the module."""
    model = _build(sliding_window=16)
    return model, itde.from_hf(model)


def _check(model, lm, n, rows, seed=0):
    return check_causal_lm_logits(model, lm, n, rows, vocab=VOCAB, tol=TOL, seed=seed)


PADDING = padding_rows(MAX_N)


@settings(phases=[Phase.explicit])
@given(n=st.integers(1, MAX_N), rows=st.lists(PADDING, min_size=1, max_size=3))
@example(n=49, rows=[("none", 0), ("left", 5)])
@example(n=103, rows=[("right", 30), ("left", 1), ("none", 0)])
def test_logits_equal_transformers(pair, n, rows):
    """Drawn lengths and left/right padding (the default tier runs the examples, among them
    49 and 103 tokens: the window of 16 cuts)."""
    _check(*pair, n, rows)


@pytest.mark.slow
@given(n=st.integers(1, MAX_N), rows=st.lists(PADDING, min_size=1, max_size=3))
def test_logits_equal_transformers_drawn(pair, n, rows):
    _check(*pair, n, rows)


@pytest.mark.slow
@pytest.mark.parametrize("start", range(1, MAX_N + 1, 50))
def test_every_length_equals_transformers(pair, start):
    """Every length from 1 to 300 (this test: 50 of them), one row unpadded and one padded
    on the left or right."""
    for n in range(start, min(start + 50, MAX_N + 1)):
        _check(*pair, n, [("none", 0), ("left" if n % 2 else "right", n // 3)], seed=n)


def test_the_split_is_the_rotation_of_half_of_each_head(pair):
    """The converted model rotates 2 of each head's 4 features, and the window is 16."""
    _, lm = pair
    eq = lm.base.equation
    assert eq.rope.rotary_dim == 2 and eq.controls.values.attention.head_dim == 4
    assert eq.window == itde.SlidingWindow(16.0)


def test_to_hf_round_trip_is_exact(pair):
    """`to_hf` fuses `qkv_proj` and `gate_up_proj` again: every weight bit for bit, for the
    causal LM and for its base `Phi3Model`."""
    model, lm = pair
    for theirs, ours in ((model, lm), (model.model, itde.from_hf(model.model))):
        back = itde.to_hf(ours)
        assert type(back) is type(theirs)
        state = back.state_dict()
        assert set(state) == set(theirs.state_dict())
        for k, v in theirs.state_dict().items():
            assert torch.equal(state[k], v), k


def test_cached_greedy_generation_equals_transformers(pair):
    model, lm = pair
    prompt = np.random.RandomState(1).randint(4, VOCAB, size=14)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(
            torch.as_tensor(prompt[None]), max_new_tokens=6, do_sample=False, pad_token_id=PAD
        )[0].numpy()  # fmt: skip
    np.testing.assert_array_equal(lm.generate(prompt, 6, cache=True), ref)


def test_longrope_is_refused_by_name_with_the_fix():
    """Phi-3's 128k scaling (`longrope`; `su` in older configs) switches frequencies with
    the length and scales cos and sin: refused, naming the field, why, and what converts."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0], "long_factor": [4.0]}  # fmt: skip
    model = _build(rope_parameters=rope, original_max_position_embeddings=32)
    with pytest.raises(
        ValueError, match=r"`config\.rope_parameters\['rope_type'\]`='longrope'.*4k checkpoints"
    ):
        itde.from_hf(model)
