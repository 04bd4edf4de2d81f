"""A session of many prompt lengths through the one generation engine (`itde._generate`).

Tiny GPT-2 (learned positions), Llama (grouped-query attention, RoPE), Mistral (a sliding
window of 4 tokens) and Qwen2 (biases on the projections), built by `transformers` from
configs with random weights, float64, with 1100 positions (so that prompts fall into
three window buckets: 512, 1024 and the model's 1100):

- the logits of the token after each prompt, as generation computes them (the prompt
  padded into its bucket, solved by the cache in chunks of 64 rows), equal Hugging Face's
  unpadded forward to 1e-12, at drawn lengths here and at every length 1..300 in the slow
  tier; greedy generation gives transformers' own tokens;
- compilations are part of the contract: a workload of many prompt lengths compiles at
  most a prefill and a decode loop per bucket, and a second workload of new lengths in
  the same buckets compiles nothing at all (no XLA compilation, eager ones included).
"""

import jax
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import spread_hf_weights
from hypothesis import given, settings
from hypothesis import strategies as st

import itde
from itde.train import TrainExperiment, from_dict, sample_stream
from itde.train._internal import init_token_model

VOCAB = 40
COMMON = dict(vocab_size=VOCAB, pad_token_id=1, bos_token_id=2, eos_token_id=3)
POSITIONS = 1100
FAMILIES = ("gpt2", "llama", "mistral", "qwen2")


def _build(family, positions=POSITIONS, layers=2):
    if family == "gpt2":
        config = tf.GPT2Config(n_embd=8, n_layer=layers, n_head=2, n_inner=12,
                               n_positions=positions, **COMMON)  # fmt: skip
        cls = tf.GPT2LMHeadModel
    elif family == "llama":
        config = tf.LlamaConfig(
            hidden_size=8, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=6, intermediate_size=12,
            max_position_embeddings=positions, **COMMON,
        )  # fmt: skip
        cls = tf.LlamaForCausalLM
    elif family == "mistral":
        config = tf.MistralConfig(
            hidden_size=8, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=12, sliding_window=4,
            max_position_embeddings=positions, **COMMON,
        )  # fmt: skip
        cls = tf.MistralForCausalLM
    else:
        config = tf.Qwen2Config(
            hidden_size=8, num_hidden_layers=layers, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=12, max_position_embeddings=positions,
            **COMMON,
        )  # fmt: skip
        cls = tf.Qwen2ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = spread_hf_weights(cls(config)).double().eval()
    return model, itde.from_hf(model)


class _Models(dict):
    """family -> (transformers model, converted model), each built on first use (the
    default tier uses GPT-2 and Llama only)."""

    def __missing__(self, family):
        assert family in FAMILIES, family
        self[family] = _build(family)
        return self[family]


@pytest.fixture(scope="module")
def models():
    return _Models()


def _prompt(n, seed=0):
    return np.random.RandomState(seed + n).randint(4, VOCAB, size=n).astype(np.int32)


def _hf_last_logits(model, ids):
    with torch.no_grad(), itde.interop.hf_float64():
        return model(torch.as_tensor(ids[None]).long()).logits[0, -1].numpy()


def _hf_greedy(model, ids, n):
    with torch.no_grad(), itde.interop.hf_float64():
        out = model.generate(torch.as_tensor(ids[None]).long(), max_new_tokens=n,
                             do_sample=False, pad_token_id=1,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))  # fmt: skip
    return out[0].numpy()


@pytest.mark.parametrize(
    "family", ["gpt2", "llama", pytest.param("mistral", marks=pytest.mark.slow),
               pytest.param("qwen2", marks=pytest.mark.slow)],
)  # fmt: skip
@settings(max_examples=3)
@given(lengths=st.lists(st.integers(1, POSITIONS - 1), min_size=1, max_size=3, unique=True))
def test_next_token_logits_equal_the_unpadded_forward(models, family, lengths):
    """Prompts of drawn lengths at once (a batch bucket, each in its window bucket):
    each row is Hugging Face's forward of that prompt alone, to 1e-12."""
    model, lm = models[family]
    prompts = [_prompt(n) for n in lengths]
    got = lm.next_token_logits(prompts)
    for ids, row in zip(prompts, got, strict=True):
        np.testing.assert_allclose(row, _hf_last_logits(model, ids), rtol=0, atol=1e-12)
    one = lm.next_token_logits([prompts[-1]])  # alone: a batch of one, no map over rows
    np.testing.assert_allclose(one[0], got[-1], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "family", ["gpt2", "llama", pytest.param("mistral", marks=pytest.mark.slow),
               pytest.param("qwen2", marks=pytest.mark.slow)],
)  # fmt: skip
def test_greedy_generation_is_transformers_across_buckets(models, family):
    """Greedy tokens equal `generate(do_sample=False)` for prompts in two buckets and at
    a chunk boundary (64), single and batched."""
    model, lm = models[family]
    lengths = (1, 64, 65, 600)
    for n in lengths:
        ids = _prompt(n)
        np.testing.assert_array_equal(lm.generate(ids, 5, chunk=2), _hf_greedy(model, ids, 5))
    rows = lm.generate_batch([_prompt(n) for n in lengths[:3]], 4)
    for n, row in zip(lengths, rows, strict=False):
        np.testing.assert_array_equal(row, _hf_greedy(model, _prompt(n), 4))


def test_many_prompt_lengths_compile_per_bucket_then_nothing(models):
    """Twelve prompt lengths over three buckets compile nothing once each bucket has run
    (not one XLA program, eager operations included), and another `chunk` compiles one
    decode loop per bucket, no more. A change that compiles per prompt length, or an eager
    operation on a shape of the prompt's, fails here."""
    _, lm = models["gpt2"]
    lengths = np.random.RandomState(7).choice(np.arange(1, POSITIONS - 3), 24, replace=False)
    for n in (5, 600, 1090):  # one prompt in each bucket first
        lm.generate(_prompt(n), 3)
    before = itde.programs.compiled
    with itde.count_compilations() as warm:
        for n in lengths[:12]:
            lm.generate(_prompt(int(n)), 3)
    assert (itde.programs.compiled - before, warm.count) == (0, 0)
    with itde.count_compilations() as chunked:
        for n in lengths[12:]:
            lm.generate(_prompt(int(n), seed=1), 2, chunk=1)  # another chunk: another loop
    hit = {min(b for b in (512, 1024, POSITIONS) if n + 2 <= b) for n in lengths[12:]}
    assert itde.programs.compiled - before == len(hit) == chunked.count


def test_a_fresh_model_compiles_two_programs_per_bucket():
    """From nothing: thirty prompt lengths in two buckets (512 and the model's 700) cost
    a prefill and a greedy decode loop per bucket, besides the rows' keys (the model's
    layers are split once, on the host: no program on the CPU backend); sampling adds the
    sampled loop of the bucket it runs in, for any key and temperature."""
    _, lm = _build("gpt2", positions=700)
    itde.programs.clear()
    for n in np.random.RandomState(3).choice(np.arange(1, 690), 30, replace=False):
        lm.generate(_prompt(int(n)), 2)
    assert itde.programs.compiled == 1 + 2 * 2
    for n in (3, 17, 33):
        lm.generate(_prompt(n), 2, key=jax.random.key(n), temperature=0.5 + n / 10)
    assert itde.programs.compiled == 1 + 2 * 2 + 1


def test_batches_of_any_size_share_a_row_bucket(models):
    """Three and four prompts run in the same programs (rows padded to 4)."""
    _, lm = models["llama"]
    lm.generate_batch([_prompt(n) for n in (3, 9, 20)], 2)
    before = itde.programs.compiled
    lm.generate_batch([_prompt(n) for n in (4, 8, 21, 30)], 2)
    assert itde.programs.compiled == before


def test_sample_compiles_per_bucket_not_per_prompt():
    """`itde sample`'s path (a trained TokenModel on the same engine): prompts of many
    lengths within the context compile the prefill and the greedy decode loop once."""
    cfg = from_dict(TrainExperiment, {"task": {"name": "charlm", "context": 600},
                                      "model": {"n_layers": 1, "n_features": 8, "n_heads": 2,
                                                "n_hidden": 8, "block": "pre_norm"}})  # fmt: skip
    model = init_token_model(jax.random.key(0), cfg.model, vocab=5, context=600, causal=True)
    itos = ("a", "b", "c", "d", "\n")
    assert len("".join(sample_stream(model, itos, "ab" * 3, 4, temperature=0.0))) == 4
    before = itde.programs.compiled
    with itde.count_compilations() as c:
        for n in (1, 7, 40, 200, 333):
            "".join(sample_stream(model, itos, ("abcd" * 100)[:n], 4, temperature=0.0))
    assert itde.programs.compiled == before and c.count == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_prompt_length_to_300(models, family):
    """Every prompt length 1..300, one prompt at a time and all at once: the engine's
    next-token logits equal Hugging Face's unpadded forward to 1e-12 (the rows of one
    forward of 300 tokens: the model is causal), and greedy generation at a sample of
    lengths gives transformers' tokens."""
    model, lm = models[family]
    ids = _prompt(300, seed=11)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids[None]).long()).logits[0].numpy()
    prompts = [ids[:n] for n in range(1, 301)]
    single = np.stack([lm.next_token_logits([p])[0] for p in prompts])
    np.testing.assert_allclose(single, ref, rtol=0, atol=1e-12)
    together = lm.next_token_logits(prompts)
    np.testing.assert_allclose(together, ref, rtol=0, atol=1e-12)
    for n in (1, 2, 63, 64, 65, 128, 129, 255, 256, 257, 299, 300):
        np.testing.assert_array_equal(lm.generate(ids[:n], 3), _hf_greedy(model, ids[:n], 3))


def _maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.slow
def test_150_prompt_lengths_in_one_process_keep_the_mappings_bounded():
    """150 distinct prompt lengths with a 12-layer model (GPT-2's depth): the programs of
    its three buckets and the rows' keys (the layers are split on the host), nothing per
    length; the process's memory mappings grow by less than 10,000 in all (each compiled
    program holds its own; before the buckets each prompt length added about a thousand
    at GPT-2's shape)."""
    _, lm = _build("gpt2", layers=12)
    lengths = np.random.RandomState(5).choice(np.arange(1, POSITIONS - 2), 150, replace=False)
    itde.programs.clear()
    before = _maps()
    for n in lengths:
        lm.generate(_prompt(int(n)), 2)
    assert itde.programs.compiled == 1 + 2 * 3
    assert _maps() - before < 10_000
