"""Gemma 2 as an equation, exact against `transformers` itself: norms before and after
each sublayer ([`SandwichNorm`][itde.SandwichNorm]), soft-capped scores and logits
([`SoftCap`][itde.SoftCap]), `query_pre_attn_scalar`, and a sliding and a full layer from
`layer_types` (a [`LayerWindow`][itde.LayerWindow] per layer, as data).

One tiny `Gemma2ForCausalLM` (2 layers: sliding within 5 tokens, then full; width 16, 4
query heads sharing 2 key/value heads of `head_dim` 6; caps low enough to bind) is built
for the module, float64, compared inside `itde.interop.hf_float64()`.
"""

import dataclasses

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
             sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
             final_logit_softcapping=2.5, **COMMON)  # fmt: skip
TOL = 1e-10  # relative to the largest logit on real tokens, float64


def _build(seed=0, **fields):
    config = tf.Gemma2Config(**{**SIZES, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return spread_hf_weights(tf.Gemma2ForCausalLM(config)).double().eval()


@pytest.fixture(scope="module")
def pair():
    """(Hugging Face model, converted model), built once for the module."""
    model = _build()
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    return model, itde.from_hf(model)


def _check(model, lm, n, rows, seed=0):
    return check_causal_lm_logits(model, lm, n, rows, vocab=VOCAB, tol=TOL, seed=seed)


PADDING = padding_rows(MAX_N)


@settings(phases=[Phase.explicit])
@given(n=st.integers(1, MAX_N), rows=st.lists(PADDING, min_size=1, max_size=3))
@example(n=49, rows=[("none", 0), ("left", 5)])
@example(n=103, rows=[("right", 30), ("left", 1), ("none", 0)])
@example(n=4, rows=[("none", 0), ("right", 1)])
def test_logits_equal_transformers(pair, n, rows):
    """Drawn lengths and left/right padding (the default tier runs the examples, among them
    49 and 103 tokens, and one shorter than the window)."""
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


def test_the_caps_the_window_and_the_output_norms_bind(pair):
    """Each of Gemma 2's pieces changes the logits here (so the equality above checks it):
    without the score cap, the logit cap, the window or the output norms they move."""
    _, lm = pair
    ids = jnp.asarray(np.random.RandomState(0).randint(4, VOCAB, size=24))
    base = np.asarray(lm(ids))
    eq = lm.base.equation
    no_cap = eqx_replace(lm, lambda m: m.base.equation.controls.values.attention.score_cap, None)
    no_window = eqx_replace(lm, lambda m: m.base.equation.controls.values.window, None)
    blocks = eq.controls.values
    unit = jnp.ones_like(blocks.out_norm1.gain)
    plain = eqx_replace(lm, lambda m: m.base.equation.controls.values.out_norm1.gain, unit)
    for other in (no_cap, no_window, plain, dataclasses.replace(lm, logit_cap=None)):
        assert np.max(np.abs(np.asarray(other(ids)) - base)) > 1e-3


def eqx_replace(tree, where, value):
    import equinox as eqx

    return eqx.tree_at(where, tree, value, is_leaf=lambda x: x is None)


def test_to_hf_round_trip_is_exact(pair):
    """`to_hf` writes back every weight bit for bit, the four norms of each layer included,
    for the causal LM and for its base `Gemma2Model`."""
    model, lm = pair
    for theirs, ours in ((model, lm), (model.model, itde.from_hf(model.model))):
        back = itde.to_hf(ours)
        assert type(back) is type(theirs)
        state = back.state_dict()
        assert set(state) == set(theirs.state_dict())
        for k, v in theirs.state_dict().items():
            assert torch.equal(state[k], v), k
        assert back.config.layer_types == theirs.config.layer_types
    assert any("post_feedforward_layernorm" in k for k in model.state_dict())


def test_to_hf_refuses_a_window_the_config_does_not_have(pair):
    _, lm = pair
    other = eqx_replace(
        lm, lambda m: m.base.equation.controls.values.window.length, jnp.asarray([7.0, np.inf])
    )
    with pytest.raises(ValueError, match=r"layer 0's window is 7\.0 tokens.*sliding_window"):
        itde.to_hf(other)


def test_cached_greedy_generation_equals_transformers(pair):
    """Greedy tokens with the key/value cache (the sliding layer's window in the decode
    step's mask, the cap on the cached scores) equal transformers' past the window."""
    model, lm = pair
    prompt = np.random.RandomState(1).randint(4, VOCAB, size=7)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(
            torch.as_tensor(prompt[None]), max_new_tokens=8, do_sample=False, pad_token_id=PAD,
            eos_token_id=None,
        )[0].numpy()  # fmt: skip
    assert len(ref) == len(prompt) + 8
    np.testing.assert_array_equal(lm.generate(prompt, 8, cache=True), ref)
    np.testing.assert_array_equal(lm.generate(prompt, 8, cache=False), ref)


def test_decode_steps_equal_the_uncached_logits(pair):
    """Each decode step (one row against the cache: the capped scores, the sliding layer's
    window in the mask, the output norms) gives the uncached forward's logits of its
    position, past the window, to float64 round-off."""
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
def test_attention_weights_are_the_capped_windowed_kernels(pair, layer):
    """`itde.analysis.attention_weights` of the sliding layer 0 and the full layer 1 equal
    the weights Hugging Face's eager attention returns (the states fed are its own)."""
    model, lm = pair
    ids = np.random.RandomState(2).randint(4, VOCAB, size=11)
    with torch.no_grad(), itde.interop.hf_float64():
        out = model(torch.as_tensor(ids[None]), output_attentions=True, output_hidden_states=True)
    ref = out.attentions[layer][0].numpy()
    u = jnp.asarray(out.hidden_states[layer][0].numpy())
    ours = itde.analysis.attention_weights(lm, float(layer), u)
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=1e-12)
    assert (ref[:, -1, :-WINDOW] == 0).all() == (layer == 0)


def test_blocked_core_is_exact_and_fused_refuses_the_cap(pair):
    """The blocked core caps each block of scores and applies the per-layer window as a
    bias: the dense core's result to round-off; the fused core has no cap and says so."""
    _, lm = pair
    ids = jnp.asarray(np.random.RandomState(3).randint(4, VOCAB, size=21))
    eq = lm.base.equation
    blocked = dataclasses.replace(eq, attention_core=itde.Blocked(4))
    u0 = lm.base.embed(ids)
    np.testing.assert_allclose(np.asarray(blocked(u0)), np.asarray(eq(u0)), rtol=0, atol=1e-12)
    fused = dataclasses.replace(eq, attention_core=itde.Fused())
    with pytest.raises(ValueError, match=r"`score_cap`=SoftCap.*Dense\(\) or itde\.Blocked"):
        fused(u0)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "field, value, match",
    [
        ("layer_types", ["sliding_attention", "chunked_attention"], r"`config\.layer_types`"),
        ("attn_logit_softcapping", -1.0, r"`config\.attn_logit_softcapping`=-1\.0"),
        ("query_pre_attn_scalar", 0, r"`config\.query_pre_attn_scalar`=0"),
        ("hidden_act", "silu", r"`config\.hidden_act`='silu'"),
    ],
)
def test_unsupported_settings_are_refused_by_name(field, value, match):
    model = _build(num_hidden_layers=2)
    setattr(model.config, field, value)
    with pytest.raises(ValueError, match=match):
        itde.from_hf(model)


def test_a_sandwich_without_output_norms_and_smooth_windows_are_refused(pair):
    _, lm = pair
    eq = lm.base.equation
    bare = eqx_replace(eq, lambda e: e.controls.values.out_norm2, None)
    with pytest.raises(ValueError, match=r"SandwichNorm\(\).*no out_norm2"):
        dataclasses.replace(bare, controls=bare.controls)
    smooth = itde.LegendreControls(eq.controls.values, 0.0, 2.0)
    with pytest.raises(ValueError, match=r"per-layer sliding window.*LegendreControls"):
        dataclasses.replace(eq, controls=smooth)
    with pytest.raises(ValueError, match=r"SandwichNorm block.*nn\.TransformerEncoderLayer"):
        eq.block.torch_layer_options(1e-6)


def test_soft_cap_is_c_tanh_and_refuses_bad_bounds():
    s = jnp.linspace(-40.0, 40.0, 9)
    np.testing.assert_allclose(np.asarray(itde.SoftCap(5.0)(s)), 5.0 * np.tanh(s / 5.0),
                               rtol=1e-15, atol=0)  # fmt: skip
    for bad in (0.0, -2.0, float("inf")):
        with pytest.raises(ValueError, match=r"SoftCap\(cap\)"):
            itde.SoftCap(bad)
    with pytest.raises(TypeError, match=r"`Attention\.score_cap`='x'"):
        att = itde.Attention.init(jax.random.key(0), 8, 2)
        dataclasses.replace(att, score_cap="x")
