"""Real checkpoints' configs: every `config.json` of `tests/fixtures/configs/` (the public
checkpoints people convert most; where each came from is in that folder's README) builds a
model with its widths, depths and vocabulary shrunk and every other field kept, random
weights, float64, and `itde.from_hf` converts it exactly (against `transformers` inside
`itde.interop.hf_float64()`) or refuses it naming the field and why.

Also the rule behind it (`itde/interop/_hf_family.py`): a set field that the config class
neither defines nor transformers' code of the model reads is metadata and accepted; one that
either does and the family does not convert is refused by name with where it is read.
"""

import json
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import spread_hf_weights

import itde
from itde.interop._hf_family import transformers_fields

FIXTURES = Path(__file__).parent / "fixtures" / "configs"
N = 9  # tokens of the one forward per config

# Widths, depths and vocabulary shrunk (each name as the family's config spells it); every
# other field is the checkpoint's own.
SHRINK = {
    "hidden_size": 16, "n_embd": 16, "dim": 16, "d_model": 16,
    "intermediate_size": 24, "n_inner": 24, "hidden_dim": 24, "d_ff": 24,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2,
    "head_dim": 8, "d_kv": 8, "vocab_size": 64,
    # mixtures of experts: the experts' widths and (Qwen2-MoE's 60) their number
    "moe_intermediate_size": 12, "shared_expert_intermediate_size": 24, "num_experts": 8,
}  # fmt: skip
HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads")

# The base class converted for a checkpoint whose own class (`architectures`) has a head
# itde does not convert (a masked-LM or a seq2seq head): its encoder.
BASE = {"bert": "BertModel", "roberta": "RobertaModel", "distilbert": "DistilBertModel",
        "t5": "T5EncoderModel"}  # fmt: skip

# None: converts exactly; a pattern: the refusal's message. Every checkpoint listed converts.
EXPECTED = {
    "all-minilm-l6-v2": None, "bert-base-uncased": None, "distilbert-base-uncased": None,
    "distilgpt2": None, "gemma-2b": None, "gemma-2-2b": None, "gemma-3-270m": None, "olmo-2-0425-1b": None, "gpt2": None, "llama-3.2-1b": None,
    "mistral-7b-v0.1": None, "pythia-70m": None, "qwen2.5-0.5b": None, "qwen3-0.6b": None,
    "phi-3-mini-4k-instruct": None,
    "roberta-base": None, "smollm2-135m": None, "smollm2-135m-instruct": None,
    "smollm2-360m": None, "t5-small": None, "vit-base-patch16-224-in21k": None,
    "mixtral-8x7b-v0.1": None, "qwen1.5-moe-a2.7b": None,
    "olmoe-1b-7b-0924": None, "qwen3-30b-a3b": None,
}  # fmt: skip

# Fields of these files that no transformers code defines or reads: the metadata the
# converters refused before (the SmolLM2 ones are the issue's), accepted now.
METADATA = {
    "smollm2-135m-instruct": {"is_llama_config", "rope_interleaved", "transformers.js_config"},
    "smollm2-135m": {"is_llama_config", "rope_interleaved"},
    "smollm2-360m": {"is_llama_config", "rope_interleaved"},
    "gpt2": {"n_ctx"},
    "distilgpt2": {"n_ctx", "_num_labels"},
    "qwen2.5-0.5b": {"use_mrope"},
    "qwen3-30b-a3b": {"max_window_layers"},
    "t5-small": {"output_past"},
    "distilbert-base-uncased": {"tie_weights_"},
}


def _shrunk(raw: dict) -> dict:
    d = dict(raw)
    for k, v in SHRINK.items():
        if k in d:
            d[k] = v
    for k in HEADS:
        if k in d:
            d[k] = 4
    pad = d.get("pad_token_id")
    if isinstance(pad, int) and "vocab_size" in d and pad >= d["vocab_size"]:
        d["pad_token_id"] = d["vocab_size"] - 1  # Phi-3's 32000: an id of the shrunk vocabulary
    kv = raw.get("num_key_value_heads")
    if kv is not None:  # multi-query stays multi-query, grouped stays grouped
        heads = next(raw[k] for k in HEADS if k in raw)
        d["num_key_value_heads"] = 1 if kv == 1 else 4 if kv == heads else 2
    kinds = raw.get("layer_types")
    if isinstance(kinds, list) and "num_hidden_layers" in d:  # Gemma 3's: the last layers,
        d["layer_types"] = kinds[-d["num_hidden_layers"] :]  # which end on a full one
    return d


def _model(name: str):
    raw = json.loads((FIXTURES / f"{name}.json").read_text())
    config = tf.AutoConfig.for_model(**_shrunk(raw))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # transformers' default computes in float32
    arch = (raw.get("architectures") or [None])[0]
    cls = getattr(tf, arch if arch in itde.interop.HF_FAMILIES else BASE[raw["model_type"]])
    torch.manual_seed(0)
    model = cls(config)
    spread_hf_weights(model)
    return raw, model.double().eval()


def _inputs(model):
    rng = np.random.RandomState(0)
    if isinstance(model, tf.ViTModel):
        c = model.config
        return rng.normal(size=(c.num_channels, c.image_size, c.image_size))
    return rng.randint(0, model.config.vocab_size, size=N)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_config_converts_exactly_or_is_refused_by_name(name):
    raw, model = _model(name)
    kept = set(model.config.to_dict())
    assert METADATA.get(name, set()) <= kept  # the metadata reached the model's config
    expected = EXPECTED[name]
    if expected is not None:
        with pytest.raises(ValueError, match=expected):
            itde.from_hf(model)
        return
    m = itde.from_hf(model)
    x = _inputs(model)
    with torch.no_grad(), itde.interop.hf_float64():
        if isinstance(model, tf.ViTModel):
            ref = model(torch.as_tensor(x[None])).last_hidden_state[0].numpy()
        elif isinstance(m, itde.HFCausalLM):
            ref = model(torch.as_tensor(x[None])).logits[0].numpy()
        else:
            ref = model(torch.as_tensor(x[None])).last_hidden_state[0].numpy()
    ours = np.asarray(m(jnp.asarray(x)))
    assert ours.shape == ref.shape
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err <= 1e-10, (name, err)


def test_every_fixture_has_an_expectation_and_a_readme_line():
    names = {p.stem for p in FIXTURES.glob("*.json")}
    assert names == set(EXPECTED)
    readme = (FIXTURES / "README.md").read_text()
    for name in names:
        assert f"`{name}.json`" in readme, name


# ---------------------------------------------------------------- the rule
def _tiny_llama(**fields):
    config = tf.LlamaConfig(
        vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, **fields,
    )  # fmt: skip
    return tf.LlamaForCausalLM(config).eval()


def test_metadata_is_accepted_and_changes_nothing():
    """The issue's reproduction: `unk_token_id`, `_model_name_or_path`,
    `transformers.js_config`, `is_llama_config` (metadata hub configs carry) no longer
    refuse a tiny Llama; the conversion equals the one without them."""
    plain = _tiny_llama()
    meta = _tiny_llama(unk_token_id=0, is_llama_config=True)
    meta.config._model_name_or_path = "Smollm2 135M 8k Lc100K Mix1 Ep2"
    setattr(meta.config, "transformers.js_config", {"kv_cache_dtype": {"fp16": "float16"}})
    meta.load_state_dict(plain.state_dict())
    ids = jnp.arange(5)
    np.testing.assert_array_equal(
        np.asarray(itde.from_hf(meta)(ids)), np.asarray(itde.from_hf(plain)(ids))
    )


@pytest.mark.parametrize(
    "field, value, where",
    [
        # read by transformers' cache and masks: a window Llama does not convert
        ("sliding_window", 4, r"transformers reads it \(.*(cache_utils|masking_utils)"),
        ("attention_chunk_size", 3, r"transformers reads it \(.*(cache_utils|masking_utils)"),
        ("layer_types", ["sliding_attention"], r"transformers reads it"),
    ],
)
def test_a_field_transformers_reads_is_refused_with_where(field, value, where):
    model = _tiny_llama()
    setattr(model.config, field, value)
    pattern = rf"`config\.{field}`={re.escape(repr(value))}.*LlamaFamily.*{where}"
    with pytest.raises(ValueError, match=pattern):
        itde.from_hf(model)


def test_transformers_fields_reads_the_installed_sources():
    """The semantic fields of a Llama: what `LlamaConfig` defines, and what the code running
    the model reads (`pretraining_tp` is defined; `sliding_window` is only read, by the cache
    and masks); metadata is in neither."""
    why = transformers_fields(tf.LlamaForCausalLM, tf.LlamaConfig)
    assert why["pretraining_tp"] == "LlamaConfig defines it"
    assert why["rms_norm_eps"] == "LlamaConfig defines it"
    assert why["sliding_window"].startswith("transformers reads it")
    for meta in ("unk_token_id", "is_llama_config", "_model_name_or_path", "rope_interleaved"):
        assert meta not in why, meta
    # GPT-2's attribute_map names are the config's too
    assert "num_attention_heads" in transformers_fields(tf.GPT2Model, tf.GPT2Config)


@pytest.fixture
def unreadable_sources(monkeypatch):
    """transformers' sources unreadable (a compiled or stripped install): `inspect.getsource`
    raises OSError, with the rule's caches emptied before and after."""
    from itde.interop import _hf_family

    def no_source(obj):
        raise OSError("could not get source code")

    _hf_family._reads.cache_clear()
    _hf_family.transformers_fields.cache_clear()
    monkeypatch.setattr(_hf_family.inspect, "getsource", no_source)
    yield
    monkeypatch.undo()
    _hf_family._reads.cache_clear()
    _hf_family.transformers_fields.cache_clear()


def test_unreadable_sources_refuse_what_they_would_decide(unreadable_sources):
    """Without transformers' sources the rule fails closed: a Llama carrying
    `sliding_window` (read by the masks, not defined by `LlamaConfig`) is refused with why,
    not converted; a field `LlamaConfig` defines is refused as before, and a config the
    family knows entirely still converts (no source needed)."""
    model = _tiny_llama()
    model.config.sliding_window = 4
    with pytest.raises(ValueError, match=r"`config\.sliding_window`=4 is not a field "
                       r"LlamaFamily converts, and whether transformers reads it cannot be "
                       r"decided: the source of `transformers\..*` cannot be read \(OSError"
                       r".*refused rather than ignored.*Install transformers with its Python "
                       r"sources"):  # fmt: skip
        itde.from_hf(model)
    model = _tiny_llama()
    model.config.rope_interleaved = True  # metadata, but undecidable without the sources
    with pytest.raises(ValueError, match=r"`config\.rope_interleaved`=True .*cannot be decided"):
        itde.from_hf(model)
    itde.from_hf(_tiny_llama())


def test_quantized_weights_are_refused_by_name():
    model = _tiny_llama()
    with torch.no_grad():
        packed = torch.nn.Parameter(
            torch.zeros((8, 4), dtype=torch.uint8), requires_grad=False
        )
    model.model.layers[0].self_attn.q_proj.weight = packed
    model.config.quantization_config = {"quant_method": "gguf", "dequantize": False}
    with pytest.raises(ValueError, match=r"q_proj.weight.*torch.uint8.*quantization_config.*gguf"
                       r".*dequantized"):  # fmt: skip
        itde.from_hf(model)


def test_a_field_the_family_ignores_is_accepted_and_exact():
    """`attention_bias=True` on a Mistral config: `MistralAttention` builds its projections
    without bias whatever the field says (transformers neither defines nor reads it for
    Mistral), so the model is the one without it, and the conversion equals it."""
    config = tf.MistralConfig(
        vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attention_bias=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = spread_hf_weights(tf.MistralModel(config)).double().eval()
    assert model.layers[0].self_attn.q_proj.bias is None
    ids = np.arange(3, 10)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids[None])).last_hidden_state[0].numpy()
    out = np.asarray(itde.from_hf(model)(jnp.asarray(ids)))
    assert np.max(np.abs(out - ref)) <= 1e-10 * np.max(np.abs(ref))


# ---------------------------------------------------------------- edges (issue 33, section 6)
def test_mistral_head_model_with_a_window_round_trips():
    """`to_hf(from_hf(MistralForCausalLM))` with `sliding_window=4` was refused ("attends
    within None"): the head family now attends as its base family does. The model written
    back has the same state and window, and its logits past the window are the itde
    model's."""
    config = tf.MistralConfig(
        vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = spread_hf_weights(tf.MistralForCausalLM(config)).double().eval()
    lm = itde.from_hf(model)
    back = lm.to_hf()
    assert type(back) is tf.MistralForCausalLM and back.config.sliding_window == 4
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ids = np.arange(2, 12)  # 10 tokens: the window of 4 matters
    with torch.no_grad(), itde.interop.hf_float64():
        ref = back(torch.as_tensor(ids[None])).logits[0].numpy()
    out = np.asarray(lm.logits(jnp.asarray(ids)))
    assert np.max(np.abs(out - ref)) <= 1e-10 * np.max(np.abs(ref))


@pytest.mark.parametrize("value", [0, -2])  # a float or bool: MistralConfig refuses it
def test_a_bad_sliding_window_is_named_before_work(value):
    config = tf.MistralConfig(
        vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = tf.MistralModel(config)
    model.config.sliding_window = value
    with pytest.raises(ValueError, match=rf"^`config\.sliding_window`={value!r} is not supported:"
                       r".*integer >= 1.*None for attention without a window\.$"):  # fmt: skip
        itde.from_hf(model)


def test_rotary_pct_zero_is_named_before_work():
    config = tf.GPTNeoXConfig(
        vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=20, rotary_pct=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^`config\.rotary_pct`=0 .*partial_rotary_factor.*none "
                       r"of the 8 features.*rotary_pct >= 0\.25\)\.$"):  # fmt: skip
        itde.from_hf(tf.GPTNeoXModel(config))


def _saved_gpt2(path):
    config = tf.GPT2Config(vocab_size=32, n_embd=8, n_layer=1, n_head=2, n_positions=16)
    torch.manual_seed(0)
    tf.GPT2LMHeadModel(config).save_pretrained(path)
    return path / "model.safetensors"


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda b: b[:-100], r"lies at bytes \d+\.\.\d+ of \d+ data bytes"),  # truncated
        (lambda b: b"\xff" * 8 + b[8:], r"header claims \d+ bytes"),  # header length
        (lambda b: b[:8] + b"#" + b[9:], r"header is not JSON"),
        (lambda b: b[:5], r"5 bytes, shorter than the 8-byte header length"),
        (lambda b: b + b"\0" * 8, r"its tensors fill \d+ of its \d+ data bytes"),  # extra bytes
    ],
)
def test_a_corrupted_safetensors_file_is_named_with_the_fix(tmp_path, damage, why):
    """A damaged weights file under `[model] init = "hf:DIR"` (and `--hf DIR`) is one line
    naming the key, the file and the fix, before transformers starts loading; the intact
    directory passes the same check and loads."""
    from itde.interop._hf_files import check_safetensors
    from itde.train._init import HFInit

    weights = _saved_gpt2(tmp_path)
    check_safetensors(tmp_path, "model.init")  # intact: no error
    weights.write_bytes(damage(weights.read_bytes()))
    pattern = (rf"^`model\.init`: the weights file model\.safetensors in .* is not a whole "
               rf"safetensors file \([^()]*{why}[^()]*\): it is truncated or corrupted; save "
               r"the model there again with `model\.save_pretrained\(DIR\)`\.$")  # fmt: skip
    with pytest.raises(ValueError, match=pattern):
        HFInit(tmp_path).lm()
    from itde.cli._model_study import _hf_problem

    with pytest.raises(ValueError, match=r"^`--hf`: the weights file model\.safetensors"):
        _hf_problem(str(tmp_path), None, 2)


def test_a_dequantized_checkpoint_converts_with_its_quantization_config():
    """transformers' GGUF loader dequantizes a Llama into plain float weights and records
    `quantization_config` on the config: the weights are what the model multiplies by, so
    it converts (packed weights are refused: `test_quantized_weights_are_refused_by_name`)."""
    model = _tiny_llama()
    model.config.quantization_config = {"quant_method": "gguf", "dequantize": False}
    ids = jnp.arange(5)
    with torch.no_grad():
        ref = model(torch.as_tensor(np.arange(5)[None])).logits[0].numpy()
    out = np.asarray(itde.from_hf(model)(ids))
    assert np.max(np.abs(out - ref)) <= 2e-5 * np.max(np.abs(ref))
