"""OLMo 2 as an equation, exact against `transformers` itself: a norm after each sublayer,
inside the residual ([`OutputNorm`][itde.OutputNorm]), and the queries and keys normalised
over the whole projection ([`JointQKNorm`][itde.JointQKNorm]).

One tiny `Olmo2ForCausalLM` (2 layers, width 16, 4 query heads sharing 2 key/value heads of
size 4, attention biases on, an untied head) is built for the module, float64, compared
inside `itde.interop.hf_float64()`.
"""

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

VOCAB, PAD, MAX_N = 64, 1, 300
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)
SIZES = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=MAX_N, attention_bias=True,
             tie_word_embeddings=False, **COMMON)  # fmt: skip
TOL = 1e-10  # relative to the largest logit on real tokens, float64


def _build(seed=0, **fields):
    config = tf.Olmo2Config(**{**SIZES, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return spread_hf_weights(tf.Olmo2ForCausalLM(config)).double().eval()


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


def test_to_hf_round_trip_is_exact(pair):
    """`to_hf` writes back every weight bit for bit (the output norms and the joint q/k
    norms included), for the causal LM and for its base `Olmo2Model`."""
    model, lm = pair
    for theirs, ours in ((model, lm), (model.model, itde.from_hf(model.model))):
        back = itde.to_hf(ours)
        assert type(back) is type(theirs)
        state = back.state_dict()
        assert set(state) == set(theirs.state_dict())
        for k, v in theirs.state_dict().items():
            assert torch.equal(state[k], v), k
    assert any("post_feedforward_layernorm" in k for k in model.state_dict())


def test_cached_greedy_generation_equals_transformers(pair):
    model, lm = pair
    prompt = np.random.RandomState(1).randint(4, VOCAB, size=5)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(
            torch.as_tensor(prompt[None]), max_new_tokens=8, do_sample=False, pad_token_id=PAD,
            eos_token_id=None,
        )[0].numpy()  # fmt: skip
    assert len(ref) == len(prompt) + 8
    np.testing.assert_array_equal(lm.generate(prompt, 8, cache=True), ref)


def test_decode_steps_equal_the_uncached_logits(pair):
    """Each decode step (the output norms applied to the cached attention's output) gives
    the uncached forward's logits of its position, to float64 round-off."""
    _, lm = pair
    eq = lm.base.equation
    layers = itde.split_layers(eq)
    ids = jnp.asarray(np.random.RandomState(4).randint(4, VOCAB, size=12))
    u0 = lm.base.embed(ids)
    ref = np.asarray(lm.logits(ids))
    _, cache = itde.prefill(eq, layers, u0, 5)
    step = jax.jit(lambda u, cache: itde.decode(eq, layers, u, cache))
    for p in range(5, 12):
        h, cache = step(u0[p : p + 1], cache)
        got = np.asarray(lm.project(eq.output(h)))[0]
        np.testing.assert_allclose(got, ref[p], rtol=0, atol=1e-12 * np.abs(ref).max())


def test_the_output_norms_are_the_sublayers_not_the_states(pair):
    """`OutputNorm` reads the state itself and normalises the sublayers' outputs: the
    same controls under `PreNorm` (norms on the inputs) give other logits, and a pre-norm
    model never reaches `attention_output`."""
    _, lm = pair
    import dataclasses

    ids = jnp.asarray(np.random.RandomState(0).randint(4, VOCAB, size=9))
    pre = dataclasses.replace(
        lm, base=dataclasses.replace(lm.base, equation=dataclasses.replace(
            lm.base.equation, block=itde.PreNorm()))
    )  # fmt: skip
    assert np.max(np.abs(np.asarray(pre(ids)) - np.asarray(lm(ids)))) > 1e-3
    with pytest.raises(ValueError, match=r"OutputNorm block.*nn\.TransformerEncoderLayer"):
        itde.OutputNorm().torch_layer_options(1e-6)


def test_a_set_field_olmo2_does_not_convert_is_refused_by_name():
    model = _build()
    model.config.sliding_window = 4
    with pytest.raises(ValueError, match=r"`config\.sliding_window`=4.*Olmo2Family"):
        itde.from_hf(model)


@pytest.mark.parametrize("form", ["output_norm", "sandwich_norm"])
def test_norm_after_forms_are_their_own_continuum_and_take_the_solvers(form):
    """A model of either form from `TransformerIDE.init` (its output norms built): Lie with
    one step per layer is the model's own forward, `continuum_form` returns it unchanged,
    and Strang (one form) or Heun (the other) integrates it at half a layer (finite, the
    same shape); smooth controls fit through its layers."""
    import diffrax

    from itde_solvers import LieTrotter, Strang

    m = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=2, n_features=8, n_heads=2, block=form, norm="rms",
        causal=True, dtype=jnp.float64,
    )  # fmt: skip
    assert m.continuum_form() is m
    u = jax.random.normal(jax.random.key(1), (5, 8), jnp.float64)
    lie = itde.solve(m, u, solver=LieTrotter(), dt0=1.0).ys[-1]
    np.testing.assert_allclose(np.asarray(lie), np.asarray(m(u)), rtol=0, atol=1e-14)
    solver = Strang() if form == "output_norm" else diffrax.Heun()
    out = itde.solve(m, u, solver=solver, dt0=0.5).ys[-1]
    assert out.shape == u.shape and bool(jnp.all(jnp.isfinite(out)))
    smooth = itde.LegendreControls.from_layers(m, 2)
    assert itde.TransformerIDE(smooth, m.grid, causal=True, block=m.block).block == m.block
