"""Exactness against Hugging Face `transformers` itself: `itde.from_hf(model)` computes
`model(...).last_hidden_state` on the real tokens, for every converted family, in float32
and float64, with and without padding (right and left), for the "eager" and "sdpa"
attention implementations.

Models are built from tiny configs with random weights (nothing is downloaded), re-drawn
with a larger spread than Hugging Face's initialisation (std 0.02 would leave every block
close to the identity and the comparison nearly trivial). One converted model serves the
three paddings of a family and dtype in one jitted, vmapped call (the mask is data), and
one Hugging Face model serves both attention implementations (switched in place).
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


def _config(family):
    common = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)
    if family == "bert":
        return tf.BertModel, tf.BertConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
            max_position_embeddings=16, hidden_act="gelu", **common,
        ), {"add_pooling_layer": False}  # fmt: skip
    if family == "roberta":
        return tf.RobertaModel, tf.RobertaConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
            max_position_embeddings=16, hidden_act="gelu_new", **common,
        ), {"add_pooling_layer": False}  # fmt: skip
    if family == "distilbert":
        return tf.DistilBertModel, tf.DistilBertConfig(
            dim=8, n_layers=2, n_heads=2, hidden_dim=12, max_position_embeddings=16,
            activation="relu", **common,
        ), {}  # fmt: skip
    if family == "gpt2":
        return (
            tf.GPT2Model,
            tf.GPT2Config(n_embd=8, n_layer=2, n_head=2, n_inner=12, n_positions=16, **common),
            {},
        )
    if family == "llama":  # grouped-query attention, head_dim != hidden / heads, biases
        return tf.LlamaModel, tf.LlamaConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=6, intermediate_size=12, attention_bias=True, mlp_bias=True, **common,
        ), {}  # fmt: skip
    raise AssertionError(family)


def _model(family, dtype, seed=0):
    cls, config, kwargs = _config(family)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config, **kwargs)
    spread_hf_weights(model)
    return model.to(dtype).eval()


def _ids(family):
    ids = np.random.RandomState(0).randint(4, VOCAB, size=(len(MASKS), N))
    if family == "roberta":  # RoBERTa's positions count the tokens that are not padding
        ids = np.where(MASKS == 1, ids, PAD)
    return ids


def _hf(model, ids, impl):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(MASKS))
    return out.last_hidden_state.numpy()


def _errors(family, dtype):
    """Relative max error on the real tokens, per attention implementation and padding,
    and the number of compilations the jitted converted model needed for the paddings."""
    model = _model(family, dtype)
    m = itde.from_hf(model)
    forward = jax.jit(lambda m, i, k: m(i, attention_mask=k))  # the model as an argument
    ids = _ids(family)
    ours = [
        np.asarray(forward(m, jnp.asarray(i), jnp.asarray(k)))
        for i, k in zip(ids, MASKS, strict=True)
    ]
    assert ours[0].dtype == np.dtype(str(dtype).removeprefix("torch."))
    errors = {}
    for impl in ("eager", "sdpa"):
        ref = _hf(model, ids, impl)
        for name, r, o, mask in zip(("none", "right", "left"), ref, ours, MASKS, strict=True):
            real = mask == 1
            errors[impl, name] = np.max(np.abs(o[real] - r[real])) / np.max(np.abs(r[real]))
    return errors, forward._cache_size()


def _check(family, dtype):
    errors, compilations = _errors(family, dtype)
    assert all(np.isfinite(e) for e in errors.values()), errors
    assert max(errors.values()) <= TOL[dtype], errors
    assert compilations == 1, compilations


def test_jit_serves_every_mask_with_one_compilation():
    """GPT-2 in float32: `jax.jit(m)` serves no padding, right and left padding (three
    different masks) with one compilation, and equals Hugging Face on the real tokens."""
    _check("gpt2", torch.float32)


def test_batch_is_vmap():
    """`m.batch` (one solve over the batch) equals `jax.vmap(m)` (a solve per sequence)."""
    m = itde.from_hf(_model("distilbert", torch.float64))
    ids, masks = jnp.asarray(_ids("distilbert")), jnp.asarray(MASKS)
    one = jax.jit(lambda m, i, k: m.batch(i, k))(m, ids, masks)
    each = jax.jit(lambda m, i, k: jax.vmap(m)(i, k))(m, ids, masks)
    assert one.shape == (len(MASKS), N, 8)
    np.testing.assert_allclose(np.asarray(one), np.asarray(each), rtol=0, atol=1e-12)


@pytest.mark.slow
def test_float32_llama():
    """Llama in float32, Hugging Face's code unpatched (its float32 RoPE and RMSNorm)."""
    _check("llama", torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert"])
def test_float32(family):
    _check(family, torch.float32)


# Every family in float64 by default (about a second each): the one check of each
# converter against Hugging Face (a swapped pair of norms, a transposed weight or a lost
# bias in one family's converter shows nowhere else). Llama, whose float64 reference
# needs patching, is `test_float64_llama`.
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "gpt2"])
def test_float64(family):
    _check(family, torch.float64)


def test_bert_token_types_equal_hugging_face():
    """BERT with two segments (`token_type_ids` 0 then 1), float64, right padding."""
    model = _model("bert", torch.float64)
    m = itde.from_hf(model)
    ids = _ids("bert")[1]
    mask = MASKS[1]
    types = np.array([0, 0, 0, 1, 1, 1, 1])
    with torch.no_grad():
        untyped = (
            model(torch.as_tensor(ids[None]), attention_mask=torch.as_tensor(mask[None]))
            .last_hidden_state[0]
            .numpy()
        )
        ref = (
            model(
                torch.as_tensor(ids[None]),
                attention_mask=torch.as_tensor(mask[None]),
                token_type_ids=torch.as_tensor(types[None]),
            )
            .last_hidden_state[0]
            .numpy()
        )
    out = np.asarray(m(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(types)))
    real = mask == 1
    err = np.max(np.abs(out[real] - ref[real])) / np.max(np.abs(ref[real]))
    assert err <= TOL[torch.float64], err
    assert np.max(np.abs(untyped[real] - ref[real])) > 1e-3  # the segments matter


def test_float64_llama():
    """Llama in float64, against Hugging Face's Llama computed in float64 throughout.

    Hugging Face's Llama computes three things in float32 even for a float64 model: the
    rotary angles and their cos/sin (`inv_freq.float()`), RMSNorm (`.to(torch.float32)`)
    and, with eager attention, the softmax (`softmax(..., dtype=torch.float32)`). Each
    costs float32 round-off (~1e-7), which a float64 comparison at 1e-10 would read as a
    difference of the models; torch's float32 cos also differs from XLA's by 1 ulp in ~5% of
    entries. `itde.interop.hf_float64()` computes all three in float64, so both sides are
    the same model in float64; `test_float32` keeps Hugging Face's code unpatched.
    """
    with itde.interop.hf_float64():
        _check("llama", torch.float64)


def test_hf_float64_patches_and_restores():
    """Inside the block Llama's float64 forward moves (its float32 steps are gone); after
    it, Hugging Face's own code is back (the float32 steps return, bit for bit)."""
    model = _model("llama", torch.float64)
    ids = torch.as_tensor(_ids("llama")[:1])
    with torch.no_grad():
        before = model(ids).last_hidden_state
        with itde.interop.hf_float64():
            inside = model(ids).last_hidden_state
        after = model(ids).last_hidden_state
    assert torch.equal(before, after)
    assert 1e-12 < float((before - inside).abs().max()) < 1e-4


# ---------------------------------------------------------------- bad input: named errors
def _configured(family, **fields):
    cls, config, kwargs = _config(family)
    for k, v in fields.items():
        setattr(config, k, v)
    return cls(config, **kwargs).eval()


@pytest.mark.parametrize(
    "family, field, value",
    [
        ("bert", "add_cross_attention", True),
        ("roberta", "add_cross_attention", True),
        ("bert", "hidden_act", "gelu_fast"),
        ("distilbert", "activation", "tanh"),
        ("gpt2", "add_cross_attention", True),
        ("gpt2", "activation_function", "tanh"),
        ("gpt2", "scale_attn_weights", False),
        ("llama", "hidden_act", "relu2"),
    ],
)
def test_unsupported_config_names_the_field(family, field, value):
    model = _configured(family)
    setattr(model.config, field, value)  # after construction: the model need not support it
    with pytest.raises(ValueError, match=rf"`config\.{field}`={value!r}"):
        itde.from_hf(model)


def test_rope_scaling_names_the_field():
    """A rope type whose frequencies follow the sequence's length is refused by name
    (`linear` and `llama3` convert: tests/test_hf_rotary.py)."""
    cls, config, _ = _config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match=r"rope_type.*'dynamic'.*sequence's length.*'linear'"):
        itde.from_hf(cls(config))


def test_unsupported_class_names_it_and_the_supported_ones():
    cls, config, _ = _config("bert")
    with pytest.raises(TypeError, match=r"BertForMaskedLM.*head.*BertModel.*model\.base_model"):
        itde.from_hf(tf.BertForMaskedLM(config))
    with pytest.raises(TypeError, match=r"Linear, not a Hugging Face.*BertModel, RobertaModel"):
        itde.from_hf(torch.nn.Linear(2, 2))


def test_bad_inputs_name_the_argument():
    m = itde.from_hf(_model("gpt2", torch.float32))
    ids = jnp.arange(4, 4 + N)
    with pytest.raises(ValueError, match=r"`attention_mask`.*\(7,\).*\(5,\)|`attention_mask`.*5"):
        m(ids, attention_mask=jnp.ones(5, int))
    with pytest.raises(TypeError, match=r"`attention_mask`.*float"):
        m(ids, attention_mask=jnp.ones(N))
    with pytest.raises(ValueError, match=r"`input_ids`.*\[0, 50\).*50"):
        m(ids.at[2].set(VOCAB))
    with pytest.raises(
        ValueError,
        match=r"20 tokens, more than the 16 .*"
        r"max_position_embeddings = 16\)",
    ):
        m(jnp.arange(20) % VOCAB)
    with pytest.raises(TypeError, match=r"`input_ids` is a torch tensor"):
        m(torch.arange(N))
    with pytest.raises(ValueError, match=r"`input_ids`.*one sequence.*jax.vmap"):
        m(ids[None])
    with pytest.raises(ValueError, match=r"token type"):
        m(ids, token_type_ids=jnp.zeros(N, int))
    with pytest.raises(ValueError, match=r"`input_ids` is empty"):
        m(jnp.zeros((0,), int))


# ---------------------------------------------------------------- back to Hugging Face
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "gpt2", "llama"])
def test_to_hf_round_trip(family, tmp_path):
    """`to_hf(from_hf(model))` has exactly `model`'s state; a model changed in itde goes
    back with its change (its Hugging Face forward equals the itde forward), and survives
    `save_pretrained` / `from_pretrained` bit for bit."""
    model = _model(family, torch.float64)
    m = itde.from_hf(model)
    back = itde.to_hf(m)
    assert type(back) is type(model)
    ours, theirs = back.state_dict(), model.state_dict()
    for k, v in theirs.items():
        if k in ours:
            assert torch.equal(ours[k], v), k
    assert set(ours) <= set(theirs) and len(ours) >= len(theirs) - 2, set(theirs) - set(ours)

    # change every layer's attention value weights in itde, then write back
    layers = m.equation.controls.values
    changed = eqx.tree_at(
        lambda m: m.equation.controls.values.attention.wv, m, layers.attention.wv * 1.5
    )
    hf = itde.to_hf(changed)
    ids = _ids(family)[:1]
    with torch.no_grad(), itde.interop.hf_float64():
        ref = hf(torch.as_tensor(ids)).last_hidden_state[0].numpy()
        old = model(torch.as_tensor(ids)).last_hidden_state[0].numpy()
    out = np.asarray(changed(jnp.asarray(ids[0])))
    assert np.max(np.abs(out - ref)) <= 1e-10 * np.max(np.abs(ref))
    assert np.max(np.abs(old - ref)) > 1e-3  # the change reached Hugging Face

    hf.save_pretrained(tmp_path)
    loaded = type(hf).from_pretrained(tmp_path, dtype=torch.float64).eval()
    for k, v in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_to_hf_refuses_what_has_no_module():
    m = itde.from_hf(_model("bert", torch.float64))
    with pytest.raises(ValueError, match=r"to_hf.*feature affines.*continuum form"):
        itde.to_hf(m.continuum_form())
    with pytest.raises(ValueError, match=r"no Hugging Face family and config"):
        itde.to_hf(dataclasses.replace(m, family=None))
    with pytest.raises(TypeError, match=r"`m` must be a model converted by itde.from_hf"):
        itde.to_hf(m.equation)


def test_no_family_converts_another_familys_model():
    """The traps of routing one family through another's converter fail loudly: a Gemma
    model handed to the Llama converter (its norm gain 1 + w and embedding scale would be
    lost: 0.94 off), and a Llama config carrying Mistral's `sliding_window` (the window
    would be ignored)."""
    from itde.interop._internal import LlamaFamily

    gemma = tf.GemmaModel(tf.GemmaConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, intermediate_size=12,
    ))  # fmt: skip
    with pytest.raises(TypeError, match=r"GemmaModel.*LlamaFamily.*converts LlamaModel"):
        LlamaFamily().check(gemma, "GemmaModel")
    cls, config, _ = _config("llama")
    config.sliding_window = 4
    with pytest.raises(ValueError, match=r"`config\.sliding_window`=4 is not a field LlamaFamily"):
        itde.from_hf(cls(config))
    config.sliding_window = None  # a field switched off is no trap
    itde.from_hf(cls(config))


def test_is_causal_false_is_not_read_as_off():
    """`config.is_causal=False` makes Hugging Face's causal mask bidirectional: a family
    that does not read it refuses it (False is "off" for other unknown fields)."""
    cls, config, _ = _config("gpt2")
    config.is_causal = False
    with pytest.raises(ValueError, match=r"`config\.is_causal`=False is not a field GPT2Family"):
        itde.from_hf(cls(config))


def test_position_embedding_type_is_inert_in_transformers_5():
    """`position_embedding_type="relative_key"` was refused, yet transformers 5's BertModel
    ignores it: the model converts and equals Hugging Face's."""
    model = _configured("bert", position_embedding_type="relative_key").double()
    ids = _ids("bert")[:1]
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)).last_hidden_state[0].numpy()
    out = np.asarray(itde.from_hf(model)(jnp.asarray(ids[0])))
    assert np.max(np.abs(out - ref)) <= 1e-10 * np.max(np.abs(ref))
