"""Variants of the Hugging Face families, exact against `transformers` itself: BERT and
RoBERTa as decoders (`is_decoder=True`: causal), GPT-2 with its layer-wise score scaling
(`scale_attn_by_inverse_layer_idx`) and reordered float32 scores
(`reorder_and_upcast_attn`), and T5's encoder (RMSNorm, unscaled scores, the relative
position bias of layer 0 shared by every layer, ReLU or gated-GELU feed-forward,
`n_heads * d_kv != d_model`).

As in `test_hf.py`: tiny configs, random weights spread wider than Hugging Face's
initialisation, padding none/right/left through one jitted converted model, eager and sdpa
from one Hugging Face model; float64 inside `itde.interop.hf_float64()` at 1e-10 and
float32 unpatched at 2e-5.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import spread_hf_weights

import itde

N, VOCAB, PAD = 7, 50, 1
TOL = {torch.float32: 2e-5, torch.float64: 1e-10}
MASKS = np.array([[1] * N, [1] * (N - 2) + [0, 0], [0, 0] + [1] * (N - 2)])  # none, right, left
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)


def _config(name):
    if name == "bert_decoder":
        return tf.BertModel, tf.BertConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
            max_position_embeddings=16, hidden_act="gelu", is_decoder=True, **COMMON,
        ), {"add_pooling_layer": False}  # fmt: skip
    if name == "roberta_decoder":
        return tf.RobertaModel, tf.RobertaConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
            max_position_embeddings=16, hidden_act="gelu_new", is_decoder=True, **COMMON,
        ), {"add_pooling_layer": False}  # fmt: skip
    if name == "gpt2_scaled":  # three layers: the divisor 3 is not a power of two
        return tf.GPT2Model, tf.GPT2Config(
            n_embd=8, n_layer=3, n_head=2, n_inner=12, n_positions=16,
            scale_attn_by_inverse_layer_idx=True, reorder_and_upcast_attn=True, **COMMON,
        ), {}  # fmt: skip
    if name in ("t5", "t5_gated"):  # 3 heads of 4: inner 12 != d_model 8; 8 buckets to 6
        return tf.T5EncoderModel, tf.T5Config(
            d_model=8, d_kv=4, d_ff=12, num_layers=2, num_heads=3,
            relative_attention_num_buckets=8, relative_attention_max_distance=6,
            feed_forward_proj="gated-gelu" if name == "t5_gated" else "relu", **COMMON,
        ), {}  # fmt: skip
    raise AssertionError(name)


def _model(name, dtype, seed=0):
    cls, config, kwargs = _config(name)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config, **kwargs)
    spread_hf_weights(model)
    return model.to(dtype).eval()


_CACHE = {}
# one jitted forward for the module (the model is an argument): a model changed in itde
# reuses the compilation of the one it came from
FORWARD = jax.jit(lambda m, i, k: m(i, attention_mask=k))


def _cached(name, dtype):
    """One Hugging Face model per variant and dtype for the whole module."""
    if (name, dtype) not in _CACHE:
        _CACHE[name, dtype] = _model(name, dtype)
    return _CACHE[name, dtype]


def _ids(name):
    ids = np.random.RandomState(0).randint(4, VOCAB, size=(len(MASKS), N))
    if name.startswith("roberta"):  # RoBERTa's positions count the tokens that are not padding
        ids = np.where(MASKS == 1, ids, PAD)
    return ids


def _errors(name, dtype):
    """Relative max error on the real tokens per attention implementation and padding, and
    the number of compilations the jitted converted model needed for the three paddings."""
    model = _cached(name, dtype)
    m = itde.from_hf(model)
    ids = _ids(name)
    before = FORWARD._cache_size()
    ours = [
        np.asarray(FORWARD(m, jnp.asarray(i), jnp.asarray(k)))
        for i, k in zip(ids, MASKS, strict=True)
    ]
    errors = {}
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad(), itde.interop.hf_float64():
            ref = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(MASKS))
        ref = ref.last_hidden_state.numpy()
        for pad, r, o, mask in zip(("none", "right", "left"), ref, ours, MASKS, strict=True):
            real = mask == 1
            errors[impl, pad] = np.max(np.abs(o[real] - r[real])) / np.max(np.abs(r[real]))
    model.set_attn_implementation("eager")
    return errors, FORWARD._cache_size() - before


def _check(name, dtype):
    errors, compilations = _errors(name, dtype)
    assert all(np.isfinite(e) for e in errors.values()), errors
    assert max(errors.values()) <= TOL[dtype], errors
    assert compilations <= 1, compilations


# ---------------------------------------------------------------- exactness
# By default one check per converter path: the decoders' causal mask (BERT; RoBERTa differs
# only by its positions, tested on the encoder in test_hf.py), GPT-2's layer scaling in
# float64 (exact) and T5 with each feed-forward (ReLU in float64, gated in float32, against
# Hugging Face's unpatched float32 RMSNorm).
@pytest.mark.parametrize(
    "name, dtype",
    [
        ("bert_decoder", "float64"),
        ("gpt2_scaled", "float64"),
        ("t5", "float64"),
        ("t5_gated", "float32"),
        pytest.param("roberta_decoder", "float64", marks=pytest.mark.slow),
        pytest.param("t5_gated", "float64", marks=pytest.mark.slow),
        pytest.param("gpt2_scaled", "float32", marks=pytest.mark.slow),
        pytest.param("bert_decoder", "float32", marks=pytest.mark.slow),
        pytest.param("roberta_decoder", "float32", marks=pytest.mark.slow),
        pytest.param("t5", "float32", marks=pytest.mark.slow),
    ],
)
def test_equals_hugging_face(name, dtype):
    _check(name, getattr(torch, dtype))


def test_reorder_and_upcast_float64_needs_the_patch():
    """Hugging Face's reordered scores are float32 even in a float64 model (its eager path
    then fails on the float64 mask); `hf_float64` runs them in float64."""
    model = _cached("gpt2_scaled", torch.float64)
    ids = torch.as_tensor(_ids("gpt2_scaled")[:1])
    with torch.no_grad(), pytest.raises(RuntimeError, match="upcasting"):
        model(ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad(), itde.interop.hf_float64():
        assert torch.isfinite(model(ids).last_hidden_state).all()


def test_t5_buckets_equal_hugging_face():
    """`itde.t5_bucket` is Hugging Face's bidirectional `_relative_position_bucket` for T5's
    own settings (32 buckets to 128) and the test's (8 to 6), at every distance (constant
    beyond the maximal one)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = np.arange(-256, 256)
    for n, far in ((32, 128), (8, 6)):
        theirs = T5Attention._relative_position_bucket(
            torch.as_tensor(rel), bidirectional=True, num_buckets=n, max_distance=far
        ).numpy()
        ours = itde.t5_bucket(jnp.asarray(rel, jnp.int32), n_buckets=n, max_distance=far)
        np.testing.assert_array_equal(np.asarray(ours), theirs)


def test_t5_bias_is_shared_and_matters():
    """Every layer reads layer 0's bias table (Hugging Face's later layers have none), and
    the bias changes the output (so the comparison tests it)."""
    model = _cached("t5", torch.float64)
    assert not hasattr(model.encoder.block[1].layer[0].SelfAttention, "relative_attention_bias")
    m = itde.from_hf(model)
    table = model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight
    ours = m.equation.score_bias.embedding
    np.testing.assert_array_equal(np.asarray(ours), table.detach().numpy())
    ids, real = jnp.asarray(_ids("t5")[0]), jnp.ones(N, int)
    flat = eqx.tree_at(lambda m: m.equation.score_bias.embedding, m, jnp.zeros_like(ours))
    diff = np.asarray(FORWARD(m, ids, real) - FORWARD(flat, ids, real))
    assert np.max(np.abs(diff)) > 1e-3


# ---------------------------------------------------------------- refusals
def _configured(name, **fields):
    cls, config, kwargs = _config(name)
    for k, v in fields.items():
        setattr(config, k, v)
    return cls(config, **kwargs).eval()


@pytest.mark.parametrize(
    "name, field, value",
    [
        ("bert_decoder", "add_cross_attention", True),
        ("roberta_decoder", "add_cross_attention", True),
        ("gpt2_scaled", "add_cross_attention", True),
        ("t5", "is_decoder", True),
        ("t5", "feed_forward_proj", "gated-tanh"),
        ("t5", "relative_attention_num_buckets", 2),
        ("t5", "relative_attention_max_distance", 2),  # not above the 2 exact buckets
    ],
)
def test_unsupported_config_names_the_field(name, field, value):
    model = _configured(name)
    setattr(model.config, field, value)
    if field == "feed_forward_proj":
        model.config.dense_act_fn = "tanh"
    with pytest.raises(ValueError, match=rf"`config\.{field}`={value!r}"):
        itde.from_hf(model)


def test_t5_buckets_that_round_apart_are_refused():
    """With 6 buckets to 100 a bucket boundary falls on distance 10, where torch's and XLA's
    float32 logarithms round to different sides: refused, naming both fields and the
    distance, instead of a bias that differs from Hugging Face's there."""
    model = _configured("t5", relative_attention_num_buckets=6, relative_attention_max_distance=100)
    with pytest.raises(ValueError, match=r"max_distance`=100.*num_buckets`=6.*distance -?10"):
        itde.from_hf(model)


def test_t5_with_a_decoder_is_not_converted():
    _, config, _ = _config("t5")
    with pytest.raises(TypeError, match=r"T5ForConditionalGeneration.*T5EncoderModel"):
        itde.from_hf(tf.T5ForConditionalGeneration(config))


# ---------------------------------------------------------------- back to Hugging Face
@pytest.mark.parametrize(
    "name, forward",
    [("bert_decoder", True), ("gpt2_scaled", True), ("t5", True), ("t5_gated", False)],
)
def test_to_hf_round_trip(name, forward):
    """`to_hf(from_hf(model))` has `model`'s state (bit for bit, except GPT-2's query
    weights of layer 3, whose division by 3 rounds: within one unit in the last place), and
    a model changed in itde goes back with its change (checked where the float64 forward is
    compiled anyway)."""
    model = _cached(name, torch.float64)
    m = itde.from_hf(model)
    back = itde.to_hf(m)
    assert type(back) is type(model)
    ours, theirs = back.state_dict(), model.state_dict()
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for k, v in theirs.items():
        if name == "gpt2_scaled" and k.startswith("h.2.attn.c_attn"):
            q, q_back = v[..., :8].numpy(), ours[k][..., :8].numpy()
            np.testing.assert_array_max_ulp(q_back, q, maxulp=1)
            assert torch.equal(ours[k][..., 8:], v[..., 8:]), k
        else:
            assert torch.equal(ours[k], v), k
    if not forward:
        return

    wv = m.equation.controls.values.attention.wv
    changed = eqx.tree_at(lambda m: m.equation.controls.values.attention.wv, m, wv * 1.5)
    hf = itde.to_hf(changed)
    ids = torch.as_tensor(_ids(name)[:1])
    with torch.no_grad(), itde.interop.hf_float64():
        ref = hf(ids).last_hidden_state[0].numpy()
        old = model(ids).last_hidden_state[0].numpy()
    out = np.asarray(FORWARD(changed, jnp.asarray(ids[0].numpy()), jnp.ones(N, int)))
    assert np.max(np.abs(out - ref)) <= 1e-10 * np.max(np.abs(ref))
    assert np.max(np.abs(old - ref)) > 1e-3  # the change reached Hugging Face


def test_to_hf_refuses_a_causality_the_config_does_not_have():
    m = itde.from_hf(_cached("bert_decoder", torch.float64))
    encoder = dataclasses.replace(m, equation=dataclasses.replace(m.equation, causal=False))
    with pytest.raises(ValueError, match=r"to_hf.*not causal.*is_decoder=True"):
        itde.to_hf(encoder)
