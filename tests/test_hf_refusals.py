"""A model `itde.from_hf` does not convert is refused with what is missing, by name (issue
47, item 4): the features of its forward no family converts, read off the model's modules
and config, and the nearest class that converts; a set config field no family of the model
converts names the families that do. Never only a list of classes.

Tiny models with their initial weights (nothing runs but the refusal). A class a family of
the package lists today (Gemma 3, OLMoE, when they land) is taken out of
`itde.interop.HF_FAMILIES` for the test, so its refusal is the one a user met before.
"""

import pytest
import torch
import transformers as tf

import itde
from itde.interop._hf_missing import NEAREST

HF_FAMILIES = itde.interop.HF_FAMILIES
TINY = dict(vocab_size=32, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1)  # fmt: skip


def _unlisted(monkeypatch, *names):
    for name in names:
        monkeypatch.delitem(HF_FAMILIES, name, raising=False)


def test_gemma3_names_its_features_and_gemma(monkeypatch):
    """The issue's Gemma 3 270M: `Gemma3ForCausalLM` was refused by class name only."""
    _unlisted(monkeypatch, "Gemma3ForCausalLM", "Gemma3TextModel")
    model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**TINY, head_dim=4))
    with pytest.raises(TypeError) as e:
        itde.from_hf(model)
    msg = str(e.value)
    assert msg.startswith("`model` is a Gemma3ForCausalLM, which itde.from_hf does not convert")
    for part in ("Gemma 3 needs", "query/key normalisation (`self_attn.q_norm`",
                 "norms around each sublayer (`post_feedforward_layernorm`",
                 "a RoPE per layer type", "`config.query_pre_attn_scalar`",
                 "nearest supported: Gemma"):  # fmt: skip
        assert part in msg, (part, msg)
    assert "BertModel" not in msg  # not a list of classes


def test_olmoe_names_the_mixture_and_the_query_key_norm(monkeypatch):
    _unlisted(monkeypatch, "OlmoeForCausalLM", "OlmoeModel")
    config = tf.OlmoeConfig(**TINY, num_experts=4, num_experts_per_tok=2)
    with pytest.raises(TypeError) as e:
        itde.from_hf(tf.OlmoeForCausalLM(config))
    msg = str(e.value)
    assert "OLMoE needs query/key normalisation" in msg
    assert "a sparse mixture of experts (`config.num_experts`" in msg
    nearest = msg.split("nearest supported: ")[1].split(".")[0]
    assert nearest in HF_FAMILIES and nearest in NEAREST["olmoe"][1]


def test_a_family_with_nothing_named_missing_still_gets_the_nearest():
    """Phi-2 (`PhiForCausalLM`): no feature the rules name, but no family's forward is its
    own (one LayerNorm, a parallel block with biases, partial rotary): GPT-NeoX's is the
    nearest."""
    config = tf.PhiConfig(vocab_size=32, hidden_size=8, intermediate_size=12,
                          num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    with pytest.raises(TypeError, match=r"PhiForCausalLM.*not been checked.*Phi-1/Phi-2\); "
                       r"nearest supported: GPTNeoXForCausalLM\."):  # fmt: skip
        itde.from_hf(tf.PhiForCausalLM(config))


def test_an_unknown_family_gets_the_class_whose_fields_it_shares_most():
    """A model_type `NEAREST` does not know (Granite's sibling, Helium): the supported class
    whose family reads most of its config's fields."""
    config = tf.HeliumConfig(**TINY, head_dim=4)
    with pytest.raises(TypeError) as e:
        itde.from_hf(tf.HeliumForCausalLM(config))
    msg = str(e.value)
    assert "model_type 'helium'" in msg
    nearest = msg.split("nearest supported: ")[1].split(".")[0]
    keys = set(config.to_dict())
    shared = {c: len(keys & set(f.fields)) for c, f in HF_FAMILIES.items()}
    assert shared[nearest] == max(shared.values()) > 0


def test_a_head_class_names_its_base():
    config = tf.Qwen3Config(**TINY, head_dim=4)
    with pytest.raises(TypeError, match=r"Qwen3ForSequenceClassification, whose head.*"
                       r"a Qwen3Model, converts.*itde\.from_hf\(model\.base_model\)"):  # fmt: skip
        itde.from_hf(tf.Qwen3ForSequenceClassification(config))


def test_a_setting_names_the_families_that_convert_it():
    """A Llama config carrying Mistral's `sliding_window`: refused by name, with the
    families that convert the field."""
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY))
    model.config.sliding_window = 4
    with pytest.raises(ValueError, match=r"`config\.sliding_window`=4 .*The families that "
                       r"convert `sliding_window`: .*MistralFamily"):  # fmt: skip
        itde.from_hf(model)


def test_every_nearest_class_is_a_real_class():
    """Each `NEAREST` entry's candidates are transformers classes, and the last of each is
    one a family converts today (so every entry has a nearest supported class)."""
    for model_type, (_, candidates) in NEAREST.items():
        assert all(hasattr(tf, c) for c in candidates), model_type
        assert candidates[-1] in HF_FAMILIES, model_type


def test_not_a_transformers_model():
    with pytest.raises(TypeError, match=r"Linear, not a Hugging Face.*from_torch"):
        itde.from_hf(torch.nn.Linear(2, 2))
