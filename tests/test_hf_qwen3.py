"""Qwen3 as an equation, exact against `transformers` itself, and the query/key norm it
introduced ([`PerHeadQKNorm`][itde.PerHeadQKNorm], [`JointQKNorm`][itde.JointQKNorm])
against PyTorch's `nn.RMSNorm` over the domains Qwen3 and OLMo 2 normalise.

One tiny `Qwen3ForCausalLM` (2 layers, width 16, 4 query heads sharing 2 key/value heads of
`head_dim` 6, which is not 16 / 4, attention biases on: each is added before the norm) is
built for the module, float64, compared inside `itde.interop.hf_float64()`. The converted
forward runs through the model's own length buckets, so lengths share compiled programs.
"""

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
SIZES = dict(
    hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=6, max_position_embeddings=MAX_N, **COMMON,
)  # fmt: skip
TOL = 1e-10  # relative to the largest logit on real tokens, float64


def _build(seed=0, **fields):
    config = tf.Qwen3Config(**{**SIZES, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return spread_hf_weights(tf.Qwen3ForCausalLM(config)).double().eval()


@pytest.fixture(scope="module")
def pair():
    """(Hugging Face model, converted model), built once for the module."""
    model = _build(attention_bias=True)
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
@pytest.mark.parametrize("start", range(1, MAX_N + 1, 50))
def test_every_length_equals_transformers(pair, start):
    """Every length from 1 to 300 (this test: 50 of them), one row unpadded and one padded
    on the left or right."""
    for n in range(start, min(start + 50, MAX_N + 1)):
        _check(*pair, n, [("none", 0), ("left" if n % 2 else "right", n // 3)], seed=n)


def test_to_hf_round_trip_is_exact(pair):
    """`to_hf` writes back every weight bit for bit, the q/k norms' gains included, for the
    causal LM and for its base `Qwen3Model`."""
    model, lm = pair
    for theirs, ours in ((model, lm), (model.model, itde.from_hf(model.model))):
        back = itde.to_hf(ours)
        assert type(back) is type(theirs)
        state = back.state_dict()
        assert set(state) == set(theirs.state_dict())
        for k, v in theirs.state_dict().items():
            assert torch.equal(state[k], v), k
    assert any("q_norm" in k for k in model.state_dict())


def test_cached_greedy_generation_equals_transformers(pair):
    model, lm = pair
    prompt = np.random.RandomState(1).randint(4, VOCAB, size=5)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(
            torch.as_tensor(prompt[None]), max_new_tokens=6, do_sample=False, pad_token_id=PAD
        )[0].numpy()  # fmt: skip
    np.testing.assert_array_equal(lm.generate(prompt, 6, cache=True), ref)


def test_attention_weights_are_the_normalised_kernels(pair):
    """`itde.analysis.attention_weights` of layer 0 (its queries and keys normalised, then
    rotated) equal the weights Hugging Face's eager attention returns."""
    model, lm = pair
    ids = np.random.RandomState(2).randint(4, VOCAB, size=9)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids[None]), output_attentions=True).attentions[0][0].numpy()
    ours = itde.analysis.attention_weights(lm, 0.0, lm.base.embed(jnp.asarray(ids)))
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=1e-12)


def test_every_layer_in_a_window_equals_transformers():
    """`use_sliding_window` with `max_window_layers=0`: every layer attends within 4 tokens."""
    model = _build(seed=3, use_sliding_window=True, max_window_layers=0, sliding_window=4)
    assert set(model.config.layer_types) == {"sliding_attention"}
    lm = itde.from_hf(model)
    assert _check(model, lm, 13, [("none", 0), ("left", 3)]) <= TOL
    full = itde.from_hf(_build(seed=3))
    ids = jnp.asarray(np.random.RandomState(0).randint(4, VOCAB, size=13))
    assert float(jnp.max(jnp.abs(full(ids) - lm(ids)))) > 1e-3  # the window matters


def test_a_score_scaling_is_folded_into_the_queries_gain():
    """A family whose score scaling is not head_dim ** -0.5 (Gemma 3's
    query_pre_attn_scalar) folds the ratio into the queries' gain, not into W^Q, which the
    projection would undo: Qwen3 with its attention's `scaling` set to 0.3 (eager attention
    reads it) converts to the same logits."""
    model = _build(seed=4, num_hidden_layers=1)
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.3
    _check(model, itde.from_hf(model), 13, [("none", 0), ("right", 4)])


def test_layers_of_both_kinds_are_refused_by_name():
    model = _build(use_sliding_window=True, max_window_layers=1, sliding_window=4)
    with pytest.raises(ValueError, match=r"`config\.layer_types`.*Qwen3.*every layer"):
        itde.from_hf(model)


# ------------------------------------------------------------------ the operator
def _torch_rms(x, gain, eps):
    norm = torch.nn.RMSNorm(x.shape[-1], eps=eps, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(torch.as_tensor(gain))
    return norm(torch.as_tensor(x)).detach().numpy()


@pytest.mark.parametrize("kind", ["per_head", "joint"])
def test_qk_norm_equals_torch_rms_norm_over_its_domain(kind):
    """Per head: `nn.RMSNorm(head_dim)` on each head's row (Qwen3's `q_norm` on
    `q_proj(x).view(..., heads, head_dim)`); joint: `nn.RMSNorm(heads * head_dim)` on the
    token's whole projection, then split into heads (OLMo 2's)."""
    h, hkv, n, e, eps = 4, 2, 5, 3, 1e-6
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(h, n, e)), rng.normal(size=(hkv, n, e))
    cls = itde.QK_NORMS[kind]
    size = {"per_head": (e, e), "joint": (h * e, hkv * e)}[kind]
    gq, gk = rng.normal(size=size[0]), rng.normal(size=size[1])
    norm = cls(itde.RMSNormProjection(1.0, jnp.asarray(gq), eps),
               itde.RMSNormProjection(1.0, jnp.asarray(gk), eps))  # fmt: skip
    oq, ok = norm(jnp.asarray(q), jnp.asarray(k))

    def ref(x, g):
        heads = x.shape[0]
        if kind == "per_head":
            return _torch_rms(x, g, eps)
        flat = x.transpose(1, 0, 2).reshape(n, heads * e)
        return _torch_rms(flat, g, eps).reshape(n, heads, e).transpose(1, 0, 2)

    np.testing.assert_allclose(np.asarray(oq), ref(q, gq), rtol=0, atol=1e-14)
    np.testing.assert_allclose(np.asarray(ok), ref(k, gk), rtol=0, atol=1e-14)
    # without gains, on the constraint set: each head's (each token's) mean square is 1
    unit = cls.identity(h, hkv, e, eps=0.0, dtype=jnp.float64)
    uq = np.asarray(unit(jnp.asarray(q), jnp.asarray(k))[0])
    ms = (uq**2).mean(-1) if kind == "per_head" else (uq**2).mean((0, 2))
    np.testing.assert_allclose(ms, 1.0, rtol=1e-13)


def test_attention_refuses_a_qk_norm_of_the_wrong_size():
    att = itde.Attention.init(jax_key(), 8, 2, n_kv_heads=1, head_dim=3)
    with pytest.raises(ValueError, match=r"q_norm\.gain.*expected \[6\]"):
        type(att)(**{**vars(att), "qk_norm": itde.JointQKNorm.identity(2, 1, 4)})
    with pytest.raises(TypeError, match="qk_norm"):
        type(att)(**{**vars(att), "qk_norm": "per_head"})
    ok = type(att)(**{**vars(att), "qk_norm": itde.PerHeadQKNorm.identity(2, 1, 3)})
    assert ok.qk_norm is not None
    # the input affine folded into W^Q, W^K, W^V keeps the norm (it acts after them)
    assert ok.with_input_affine(jnp.ones(8), None).qk_norm is ok.qk_norm


def jax_key():
    import jax

    return jax.random.key(0)
