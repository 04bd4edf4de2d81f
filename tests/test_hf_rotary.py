"""The rotary Hugging Face families (Qwen2, Mistral, Gemma, GPT-NeoX, and Llama's scaled rope
types) against `transformers` itself: `itde.from_hf(model)` computes
`model(...).last_hidden_state` on the real tokens in float32 (Hugging Face's code unpatched)
and float64 (inside `itde.interop.hf_float64()`), with no, right and left padding, for the
"eager" and "sdpa" attention implementations; every option the equation cannot express is
refused by name; `itde.to_hf` writes a converted (and changed) model back.

Models are built from tiny configs with random weights moved away from their
initialisation (as in `test_hf.py`); each Hugging Face model is built once per module and
dtype, and one jitted, vmapped forward serves the three paddings of a model.
"""

import copy
import dataclasses
import functools
import re

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
LLAMA = dict(
    hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=6, intermediate_size=12, **COMMON,
)  # fmt: skip
# llama3 with head_dim 6 (wavelengths 6.3, 135, 2920) and a context of 512: one frequency
# of each kind (kept, smoothed, divided by the factor)
LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=512, rope_theta=10000.0,
)  # fmt: skip


def _config(name):
    """The class and config of a named test model."""
    if name == "qwen2":  # q/k/v biases, grouped-query attention
        return tf.Qwen2Model, tf.Qwen2Config(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=12, **COMMON,
        )  # fmt: skip
    if name in ("qwen2_full", "qwen2_window"):  # use_sliding_window, a window of 3 of 7
        # tokens; layers from max_window_layers on slide: none (2 of 2 layers) or all (0)
        return tf.Qwen2Model, tf.Qwen2Config(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=12, use_sliding_window=True, sliding_window=3,
            max_window_layers=2 if name == "qwen2_full" else 0, **COMMON,
        )  # fmt: skip
    if name == "mistral":  # head_dim != hidden / heads
        return tf.MistralModel, tf.MistralConfig(sliding_window=None, **LLAMA)
    if name == "mistral_window":  # 7 tokens, a window of 3: the window matters
        return tf.MistralModel, tf.MistralConfig(sliding_window=3, **LLAMA)
    if name == "gemma":  # multi-query attention, sqrt(8) rounds in float32, biases
        return tf.GemmaModel, tf.GemmaConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
            head_dim=6, intermediate_size=12, attention_bias=True, **COMMON,
        )  # fmt: skip
    if name == "neox":  # Pythia: parallel block, a quarter of each head rotates
        return tf.GPTNeoXModel, tf.GPTNeoXConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
            rotary_pct=0.25, **COMMON,
        )  # fmt: skip
    if name == "neox_sequential":  # the pre-norm block, half of each head, no biases
        return tf.GPTNeoXModel, tf.GPTNeoXConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=12,
            rotary_pct=0.5, use_parallel_residual=False, attention_bias=False,
            hidden_act="gelu_new", **COMMON,
        )  # fmt: skip
    if name == "llama_linear":
        rope = dict(rope_type="linear", factor=4.0, rope_theta=10000.0)
        return tf.LlamaModel, tf.LlamaConfig(rope_parameters=rope, **LLAMA)
    if name == "llama3":
        return tf.LlamaModel, tf.LlamaConfig(rope_parameters=dict(LLAMA3), **LLAMA)
    raise AssertionError(name)


FAMILIES = [
    "qwen2", "qwen2_full", "qwen2_window", "mistral", "mistral_window", "gemma", "neox",
    "neox_sequential", "llama_linear", "llama3",
]  # fmt: skip


@functools.cache
def _model(name, dtype=torch.float64):
    """One Hugging Face model per name (float32 built, float64 its copy)."""
    if dtype != torch.float32:
        return copy.deepcopy(_model(name, torch.float32)).to(dtype).eval()
    cls, config = _config(name)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config)
    spread_hf_weights(model)
    return model.eval()


_FORWARD = jax.jit(lambda m, ids, mask: jax.vmap(m)(ids, mask))


def _forward(m, ids, masks=MASKS):
    """The converted model on a batch: one compilation per model structure and dtype,
    shared by the tests (the model is an argument; its source and config, static fields
    the forward never reads, are blanked so that Mistral and Llama's rope types share
    theirs)."""
    m = dataclasses.replace(m, source="", config="", family=None)
    return np.asarray(_FORWARD(m, jnp.asarray(ids), jnp.asarray(masks)))


def _ids():
    return np.random.RandomState(0).randint(4, VOCAB, size=(len(MASKS), N))


def _hf(model, ids, impl="eager", masks=MASKS):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(torch.as_tensor(ids), attention_mask=torch.as_tensor(masks)).last_hidden_state


def _rel(ours, ref, mask):
    real = mask == 1
    return np.max(np.abs(ours[real] - ref[real])) / np.max(np.abs(ref[real]))


def _errors(name, dtype):
    """Relative max error on the real tokens, per attention implementation and padding."""
    model = _model(name, dtype)
    m = itde.from_hf(model)
    ids = _ids()
    ours = _forward(m, ids)
    assert ours.dtype == np.dtype(str(dtype).removeprefix("torch."))
    errors = {}
    for impl in ("eager", "sdpa"):
        ref = _hf(model, ids, impl).numpy()
        for pad, r, o, mask in zip(("none", "right", "left"), ref, ours, MASKS, strict=True):
            errors[impl, pad] = _rel(o, r, mask)
    return errors


def _check(name, dtype):
    errors = _errors(name, dtype)
    assert all(np.isfinite(e) for e in errors.values()), errors
    assert max(errors.values()) <= TOL[dtype], errors


# ---------------------------------------------------------------- exact against Hugging Face
@pytest.mark.parametrize("name", FAMILIES)
def test_float64(name):
    """float64 throughout (Hugging Face's float32 RMSNorm, rotary angles and softmax
    patched): every converter's one exact check (1e-10; about 1e-15 in practice)."""
    with itde.interop.hf_float64():
        _check(name, torch.float64)


# float32 with Hugging Face's own code: by default Gemma, whose float32 steps are its own
# (the norm's `1 + w` and its product in float32, sqrt(d) rounded to float32); the others'
# float32 steps (rotary angles, RMSNorm or LayerNorm, softmax) are Llama's and GPT-2's.
@pytest.mark.parametrize(
    "name", ["gemma"] + [pytest.param(n, marks=pytest.mark.slow) for n in FAMILIES if n != "gemma"]
)
def test_float32(name):
    _check(name, torch.float32)


def test_gemma_embedding_scale_is_rounded_to_the_dtype():
    """Gemma multiplies the embeddings by sqrt(hidden_size) rounded to their dtype: in
    float32 sqrt(8) loses bits, and the converted model keeps that number."""
    m32 = itde.from_hf(_model("gemma", torch.float32))
    assert m32.embedding_scale == float(np.float32(np.sqrt(8.0)))
    assert m32.embedding_scale != np.sqrt(8.0)


def test_scaled_rope_types_hold_their_frequencies():
    """`linear` and `llama3` convert through `rotary_emb.inv_freq`, which holds the scaled
    frequencies (they differ from the default ones), with no factor on cos and sin."""
    default = _model("mistral").rotary_emb.inv_freq.numpy()  # same head_dim and theta
    linear = _model("llama_linear").rotary_emb
    llama3 = _model("llama3").rotary_emb
    assert linear.attention_scaling == 1.0 and llama3.attention_scaling == 1.0
    np.testing.assert_allclose(linear.inv_freq.numpy(), default / 4.0, rtol=1e-6)
    ratio = llama3.inv_freq.numpy() / default  # kept, smoothed, divided by the factor
    assert ratio[0] == 1.0 and 1 / 8 < ratio[1] < 1.0 and np.isclose(ratio[2], 1 / 8, rtol=1e-6)
    m = itde.from_hf(_model("llama3"))
    np.testing.assert_array_equal(np.asarray(m.equation.rope.inv_freq), llama3.inv_freq.numpy())


def test_partial_rotary_leaves_the_other_features():
    """NeoX rotates the first `rotary_pct` of each head's features (4 of 8 here), as the
    equation's `Rope` of two frequencies does."""
    model = _model("neox_sequential")
    m = itde.from_hf(model)
    assert m.equation.rope.rotary_dim == 4 == model.layers[0].attention.rotary_ndims
    assert isinstance(m.equation.block, itde.PreNorm)
    assert isinstance(itde.from_hf(_model("neox")).equation.block, itde.Parallel)


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gemma", "neox"])
def test_hf_float64_patches_and_restores(name):
    """Inside the block the family's float64 forward moves (its float32 steps are gone);
    after it, Hugging Face's own code is back bit for bit."""
    model = _model(name)
    ids = torch.as_tensor(_ids()[:1])
    model.set_attn_implementation("sdpa")  # the softmax patch aside: the family's own
    with torch.no_grad():
        before = model(ids).last_hidden_state
        with itde.interop.hf_float64():
            inside = model(ids).last_hidden_state
        after = model(ids).last_hidden_state
    assert torch.equal(before, after)
    assert 1e-12 < float((before - inside).abs().max()) < 1e-4


def test_qwen2_sliding_window_without_use_sliding_window_is_inert():
    """`config.sliding_window` set while `use_sliding_window` is False changes nothing in
    Hugging Face (no layer is a "sliding_attention" layer), so it is converted."""
    cls, config = _config("qwen2")
    config.sliding_window = 2  # after the config's own reset to None
    windowed = cls(config).eval()
    windowed.load_state_dict(_model("qwen2", torch.float32).state_dict())
    ids = _ids()
    for impl in ("eager", "sdpa"):
        ref = _hf(_model("qwen2", torch.float32), ids, impl)
        assert torch.equal(_hf(windowed, ids, impl), ref)
    assert windowed.config.to_dict()["sliding_window"] == 2
    itde.from_hf(windowed)


def test_qwen2_window_follows_the_layer_types_transformers_builds():
    """`use_sliding_window` slides the layers from `max_window_layers` on (Qwen2Config's
    `layer_types`): with `max_window_layers` the number of layers no layer slides and the
    model converts with full attention; with 0 every layer slides and the window is the
    equation's (both exact against Hugging Face: `test_float64`); with 1 the layers differ,
    which is refused by name."""
    assert _model("qwen2_full").config.layer_types == ["full_attention"] * 2
    assert _model("qwen2_full").config.sliding_window == 3  # set, and inert
    assert itde.from_hf(_model("qwen2_full")).equation.window is None
    assert _model("qwen2_window").config.layer_types == ["sliding_attention"] * 2
    assert itde.from_hf(_model("qwen2_window")).equation.window == itde.SlidingWindow(3.0)
    cls, config = _config("qwen2_full")
    config = tf.Qwen2Config(**{**config.to_dict(), "max_window_layers": 1, "layer_types": None})
    assert config.layer_types == ["full_attention", "sliding_attention"]
    said = r"`config\.layer_types`=\['full_attention', 'sliding_attention'\] is not supported"
    with pytest.raises(ValueError, match=said + r": .*one attention window"):
        itde.from_hf(cls(config))


# ---------------------------------------------------------------- refusals, by name
def _configured(name, **fields):
    cls, config = _config(name)
    for k, v in fields.items():
        setattr(config, k, v)
    return cls(config).eval()


@pytest.mark.parametrize(
    "name, field, value, why",
    [
        ("qwen2", "layer_types", ["full_attention", "sliding_attention"], "one attention window"),
        ("qwen2", "layer_types", ["chunked_attention"] * 2, "every layer must be 'full_att"),
        ("qwen2_window", "sliding_window", 0, "integer >= 1"),
        ("gemma", "use_bidirectional_attention", True, "causal"),
        ("gemma", "hidden_activation", "relu", "ignores hidden_activation"),
        ("gemma", "hidden_act", "relu2", "feed-forward takes"),
        ("neox", "hidden_act", "tanh", "feed-forward takes"),
        # read by transformers' masks and cache, not converted (an inert field, such as
        # Mistral's `attention_bias`, is accepted: tests/test_hf_configs.py)
        ("mistral", "attention_chunk_size", 4, "not a field MistralFamily converts.*reads it"),
        ("qwen2", "attention_chunk_size", 4, "not a field Qwen2Family converts.*reads it"),
        ("neox", "head_dim", 4, "not a field GPTNeoXFamily converts"),
    ],
)
def test_unsupported_config_names_the_field(name, field, value, why):
    model = _configured(name)
    setattr(model.config, field, value)  # after construction: the model need not support it
    with pytest.raises(ValueError, match=re.escape(f"`config.{field}`={value!r}") + f".*{why}"):
        itde.from_hf(model)


@pytest.mark.parametrize("name", ["llama_linear", "qwen2", "mistral", "gemma", "neox"])
def test_bidirectional_is_refused(name):
    """`config.is_causal=False` makes Hugging Face's mask bidirectional (a False the base
    check would read as "off")."""
    model = _model(name, torch.float32)
    ids = torch.as_tensor(_ids()[:1])
    config = model.config
    try:
        config.is_causal = False
        with torch.no_grad():
            moved = model(ids).last_hidden_state
        with pytest.raises(ValueError, match=r"`config\.is_causal`=False.*causal"):
            itde.from_hf(model)
    finally:
        del config.is_causal
    with torch.no_grad():
        assert not torch.allclose(moved, model(ids).last_hidden_state)


@pytest.mark.parametrize(
    "name, rope, why",
    [
        ("llama_linear", dict(rope_type="dynamic", factor=2.0), "sequence's length"),
        ("llama_linear", dict(rope_type="yarn", factor=2.0), "attention factor"),
        (
            "llama_linear",
            dict(
                rope_type="longrope",
                short_factor=[1.0] * 3,
                long_factor=[2.0] * 3,
                original_max_position_embeddings=8,
            ),
            "short and long",
        ),
        ("qwen2", dict(rope_type="dynamic", factor=2.0), "sequence's length"),
        ("mistral", dict(rope_type="yarn", factor=2.0), "attention factor"),
        ("gemma", dict(rope_type="dynamic", factor=2.0), "sequence's length"),
        ("neox", dict(rope_type="dynamic", factor=2.0, partial_rotary_factor=0.5), "length"),
    ],
)
def test_rope_types_refused_by_name(name, rope, why):
    cls, config = _config(name)
    config.rope_parameters = {"rope_theta": 10000.0, **rope}
    with pytest.raises(
        ValueError, match=rf"`config\.rope_parameters\['rope_type'\]`={rope['rope_type']!r}.*{why}"
    ):
        itde.from_hf(cls(config))


def test_rope_attention_factor_and_partial_rotary_refused():
    model = copy.deepcopy(_model("mistral", torch.float32))
    model.rotary_emb.attention_scaling = 1.5
    with pytest.raises(ValueError, match=r"attention_scaling`=1.5.*scores"):
        itde.from_hf(model)
    cls, config = _config("llama_linear")
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match=r"partial_rotary_factor'\]`=0.5.*whole heads"):
        itde.from_hf(cls(config))


# ---------------------------------------------------------------- back to Hugging Face
@pytest.mark.parametrize(
    "name",
    ["qwen2", "mistral_window", "gemma", "neox",
     pytest.param("qwen2_window", marks=pytest.mark.slow),
     pytest.param("neox_sequential", marks=pytest.mark.slow)],
)  # fmt: skip
def test_to_hf_round_trip(name, tmp_path):
    """`to_hf(from_hf(model))` has `model`'s state (Gemma's norm weights `w` as `1 + w`,
    the gain the model computes: `(1 + w) - 1` need not be `w` in floating point); a model
    changed in itde goes back with its change, and survives `save_pretrained` /
    `from_pretrained` bit for bit."""
    model = _model(name)
    m = itde.from_hf(model)
    back = itde.to_hf(m)
    assert type(back) is type(model)
    ours, theirs = back.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        if name == "gemma" and k.endswith("norm.weight"):
            assert torch.equal(1.0 + ours[k], 1.0 + v), k
        else:
            assert torch.equal(ours[k], v), k

    # change every layer's attention value weights in itde, then write back
    layers = m.equation.controls.values
    changed = eqx.tree_at(
        lambda m: m.equation.controls.values.attention.wv, m, layers.attention.wv * 1.5
    )
    hf = itde.to_hf(changed)
    ids = _ids()
    with itde.interop.hf_float64():
        ref = _hf(hf, ids).numpy()
        old = _hf(model, ids).numpy()
    out = _forward(changed, ids)
    for o, r, mask in zip(out, ref, MASKS, strict=True):
        assert _rel(o, r, mask) <= 1e-10
    assert np.max(np.abs(old - ref)) > 1e-3  # the change reached Hugging Face

    hf.save_pretrained(tmp_path)
    loaded = type(hf).from_pretrained(tmp_path, dtype=torch.float64).eval()
    for k, v in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_to_hf_refuses_what_the_config_rebuilds_otherwise():
    """Gemma's embedding scale and NeoX's block form come from the config: a model whose
    own differ is refused, not written back changed."""
    m = itde.from_hf(_model("gemma"))
    with pytest.raises(ValueError, match=r"embedding_scale`=3.0.*sqrt\(hidden_size\)"):
        itde.to_hf(dataclasses.replace(m, embedding_scale=3.0))
    m = itde.from_hf(_model("neox"))
    pre = eqx.tree_at(lambda m: m.equation.block, m, itde.PreNorm())
    with pytest.raises(ValueError, match=r"PreNorm\(\).*use_parallel_residual=True"):
        itde.to_hf(pre)


def test_mistral_window_is_the_equations_and_to_hf_keeps_it():
    """Mistral's `sliding_window` becomes the equation's `SlidingWindow` (without it the
    output moves by O(1): test_window measures 0.89); `to_hf` refuses a model whose window
    its config would not rebuild."""
    import dataclasses

    m = itde.from_hf(_model("mistral_window"))
    assert m.equation.window == itde.SlidingWindow(3.0)
    dropped = dataclasses.replace(m, equation=dataclasses.replace(m.equation, window=None))
    with pytest.raises(ValueError, match=r"to_hf.*attends within None.*SlidingWindow"):
        itde.to_hf(dropped)
    assert itde.from_hf(_model("mistral")).equation.window is None
