"""Gemma 3 (text) as an equation, exact against `transformers` itself: Gemma 2's sandwich
norms and per-layer windows, each head's query and key normalised
([`PerHeadQKNorm`][itde.PerHeadQKNorm], gain $1 + w$), and a RoPE base per layer
(`rope_local_base_freq` in the sliding layers, `rope_theta` in the full ones: a
[`Rope`][itde.Rope] per layer in the controls).

One tiny `Gemma3ForCausalLM` built from a `Gemma3TextConfig` (2 layers: sliding within 5
tokens with base 100, then full with base 10000; width 16, 4 query heads sharing 2
key/value heads of `head_dim` 6; `query_pre_attn_scalar` 24, whose factor $1/2$ folded
into the query gain round-trips bit for bit; no soft-caps, as the published checkpoints)
is built for the module, float64, compared inside `itde.interop.hf_float64()`.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import check_causal_lm_logits, padding_rows, spread_hf_weights
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import itde

VOCAB, PAD, MAX_N, WINDOW = 64, 1, 300, 5
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)
SIZES = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=6, max_position_embeddings=MAX_N,
             sliding_window=WINDOW, query_pre_attn_scalar=24, rope_local_base_freq=100.0,
             rope_theta=10000.0, layer_types=["sliding_attention", "full_attention"],
             **COMMON)  # fmt: skip
TOL = 1e-10  # relative to the largest logit on real tokens, float64


def _build(seed=0, **fields):
    config = tf.Gemma3TextConfig(**{**SIZES, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return spread_hf_weights(tf.Gemma3ForCausalLM(config)).double().eval()


@pytest.fixture(scope="module")
def pair():
    """(Hugging Face model, converted model), built once for the module."""
    model = _build()
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
    49 and 103 tokens)."""
    _check(*pair, n, rows)


@pytest.mark.slow
@given(n=st.integers(1, MAX_N), rows=st.lists(PADDING, min_size=1, max_size=3))
def test_logits_equal_transformers_drawn(pair, n, rows):
    _check(*pair, n, rows)


@pytest.mark.slow
def test_every_length_equals_transformers(pair):
    """Every length from 1 to 300, one row unpadded and one padded on the left or right."""
    for n in range(1, MAX_N + 1):
        _check(*pair, n, [("none", 0), ("left" if n % 2 else "right", n // 3)], seed=n)


def _replace(tree, where, value):
    return eqx.tree_at(where, tree, value, is_leaf=lambda x: x is None)


def test_the_layer_ropes_and_qk_norms_bind(pair):
    """The layers rotate with their own bases (the sliding layer's is not the full one's)
    and the q/k norms change the logits: either taken away, the logits move."""
    _, lm = pair
    blocks = lm.base.equation.controls.values
    inv = np.asarray(blocks.rope.inv_freq)
    assert not np.allclose(inv[0], inv[1])
    ids = jnp.asarray(np.random.RandomState(0).randint(4, VOCAB, size=24))
    base = np.asarray(lm(ids))
    one_base = _replace(lm, lambda m: m.base.equation.controls.values.rope.inv_freq,
                        jnp.asarray(np.stack([inv[1], inv[1]])))  # fmt: skip
    no_qk = _replace(lm, lambda m: m.base.equation.controls.values.attention.qk_norm, None)
    for other in (one_base, no_qk):
        assert np.max(np.abs(np.asarray(other(ids)) - base)) > 1e-3


def test_to_hf_round_trip_is_exact(pair):
    """`to_hf` writes back every weight bit for bit (four norms and two q/k norms a
    layer), for the causal LM and for its base `Gemma3TextModel`."""
    model, lm = pair
    for theirs, ours in ((model, lm), (model.model, itde.from_hf(model.model))):
        back = itde.to_hf(ours)
        assert type(back) is type(theirs)
        state = back.state_dict()
        assert set(state) == set(theirs.state_dict())
        for k, v in theirs.state_dict().items():
            assert torch.equal(state[k], v), k
    assert any("q_norm" in k for k in model.state_dict())


def test_to_hf_refuses_ropes_the_config_does_not_give(pair):
    _, lm = pair
    inv = np.asarray(lm.base.equation.controls.values.rope.inv_freq)
    other = _replace(lm, lambda m: m.base.equation.controls.values.rope.inv_freq,
                     jnp.asarray(np.stack([inv[1], inv[1]])))  # fmt: skip
    with pytest.raises(ValueError, match=r"layer 0's RoPE frequencies.*'sliding_attention'"):
        itde.to_hf(other)


def test_cached_greedy_generation_equals_transformers(pair):
    model, lm = pair
    prompt = np.random.RandomState(1).randint(4, VOCAB, size=7)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(
            torch.as_tensor(prompt[None]), max_new_tokens=8, do_sample=False, pad_token_id=PAD,
            eos_token_id=None,
        )[0].numpy()  # fmt: skip
    assert len(ref) == len(prompt) + 8
    np.testing.assert_array_equal(lm.generate(prompt, 8, cache=True), ref)


def test_decode_steps_equal_the_uncached_logits(pair):
    """Each decode step (the layer's own RoPE at the row's position, its window in the
    mask) gives the uncached forward's logits of its position, past the window."""
    _, lm = pair
    eq = lm.base.equation
    layers = itde.split_layers(eq)
    ids = jnp.asarray(np.random.RandomState(4).randint(4, VOCAB, size=16))
    u0 = lm.base.embed(ids)
    ref = np.asarray(lm.logits(ids))
    _, cache = itde.prefill(eq, layers, u0, 6)
    step = jax.jit(lambda u, cache: itde.decode(eq, layers, u, cache))
    for p in range(6, 16):
        h, cache = step(u0[p : p + 1], cache)
        got = np.asarray(lm.project(eq.output(h)))[0]
        np.testing.assert_allclose(got, ref[p], rtol=0, atol=1e-12 * np.abs(ref).max())


@pytest.mark.parametrize("layer", [0, 1])
def test_attention_weights_equal_transformers(pair, layer):
    """`itde.analysis.attention_weights` of the sliding layer 0 (its own RoPE base, its
    window) and the full layer 1 equal Hugging Face's eager attention weights."""
    model, lm = pair
    ids = np.random.RandomState(2).randint(4, VOCAB, size=11)
    with torch.no_grad(), itde.interop.hf_float64():
        out = model(torch.as_tensor(ids[None]), output_attentions=True, output_hidden_states=True)
    ref = out.attentions[layer][0].numpy()
    u = jnp.asarray(out.hidden_states[layer][0].numpy())
    ours = itde.analysis.attention_weights(lm, float(layer), u)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=1e-12)


def test_blocked_core_is_exact(pair):
    _, lm = pair
    eq = lm.base.equation
    u0 = lm.base.embed(jnp.asarray(np.random.RandomState(3).randint(4, VOCAB, size=21)))
    blocked = dataclasses.replace(eq, attention_core=itde.Blocked(4))
    np.testing.assert_allclose(np.asarray(blocked(u0)), np.asarray(eq(u0)), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(use_bidirectional_attention=True), r"`config\.use_bidirectional_attention`"),
        (dict(rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
        }), r"rope_parameters\['full_attention'\]\['rope_type'\]`='yarn'"),
    ],
)  # fmt: skip
def test_unsupported_settings_are_refused_by_name(fields, match):
    sizes = {k: v for k, v in SIZES.items() if k not in ("rope_theta", "rope_local_base_freq")}
    config = tf.Gemma3TextConfig(**{**sizes, **fields})
    model = tf.Gemma3ForCausalLM(config).double().eval()
    with pytest.raises(ValueError, match=match):
        itde.from_hf(model)
