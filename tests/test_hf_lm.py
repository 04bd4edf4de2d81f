"""Causal language models from Hugging Face, exact against `transformers` itself: the
logits of `GPT2LMHeadModel` (head tied to the word embeddings) and `LlamaForCausalLM`
(untied), the loss Hugging Face computes from `labels` (shifted, -100 ignored, padding),
greedy generation token for token against `generate(do_sample=False)`, sampling with a key
and a temperature, one compilation for a fixed window, and `to_hf` back to the head class.

Tiny configs with random weights spread wider than Hugging Face's initialisation, as in
`test_hf.py`; float64 inside `itde.interop.hf_float64()` (which also runs Hugging Face's
loss in float64), float32 unpatched.
"""

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
IDS = np.random.RandomState(0).randint(4, VOCAB, size=(len(MASKS), N))
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)

# the converted model is an argument: one compilation per model structure and shape
LOGITS = jax.jit(lambda lm, i, k: lm.logits(i, k))
# the loss through the perplexity (`perplexity` is `exp(loss)`): one compilation for both
LOSS = jax.jit(lambda lm, i, k, labels: jnp.log(lm.perplexity(i, k, labels)))


def _model(name, dtype, seed=0):
    if name == "gpt2":
        config = tf.GPT2Config(n_embd=8, n_layer=2, n_head=2, n_inner=12, n_positions=16, **COMMON)
        cls = tf.GPT2LMHeadModel
    else:  # grouped-query attention, head_dim != hidden / heads, untied head
        config = tf.LlamaConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=6, intermediate_size=12, max_position_embeddings=16, **COMMON,
        )  # fmt: skip
        cls = tf.LlamaForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    spread_hf_weights(model)
    return model.to(dtype).eval()


_CACHE = {}


def _cached(name, dtype):
    if (name, dtype) not in _CACHE:
        _CACHE[name, dtype] = _model(name, dtype)
    return _CACHE[name, dtype]


def _labels(masks):
    """Hugging Face's labels for a padded batch: -100 on padding, and on a left-padded
    row's first real token (predicted from a padded row, which means nothing)."""
    labels = np.where(masks == 1, IDS, -100)
    after_pad = np.zeros_like(masks, bool)
    after_pad[:, 1:] = (masks[:, 1:] == 1) & (masks[:, :-1] == 0)
    return np.where(after_pad, -100, labels)


def _hf(model, impl, masks, labels):
    model.set_attn_implementation(impl)
    with torch.no_grad(), itde.interop.hf_float64():
        out = model(
            torch.as_tensor(IDS), attention_mask=torch.as_tensor(masks),
            labels=torch.as_tensor(labels),
        )  # fmt: skip
    model.set_attn_implementation("eager")
    return out.logits.numpy(), float(out.loss)


# ---------------------------------------------------------------- logits and loss
@pytest.mark.parametrize(
    "name, dtype, logits",
    [
        ("gpt2", "float64", True),
        ("llama", "float64", True),
        ("gpt2", "float32", False),  # the loss (of every logit) in float32, one compilation
        pytest.param("gpt2", "float32", True, marks=pytest.mark.slow),
        pytest.param("llama", "float32", True, marks=pytest.mark.slow),
    ],
)
def test_logits_and_loss_equal_hugging_face(name, dtype, logits):
    """The logits of every padding (eager and sdpa) on the real tokens, from one
    compilation; the loss of the padded batch, with Hugging Face's labels and with none
    (the same targets: `loss` ignores those after a padded token itself)."""
    dtype = getattr(torch, dtype)
    model = _cached(name, dtype)
    lm = itde.from_hf(model)
    assert isinstance(lm, itde.HFCausalLM) and lm.tied == (name == "gpt2")
    if logits:
        before = LOGITS._cache_size()
        ours = [
            np.asarray(LOGITS(lm, jnp.asarray(i), jnp.asarray(k)))
            for i, k in zip(IDS, MASKS, strict=True)
        ]
        assert LOGITS._cache_size() - before <= 1
        assert ours[0].shape == (N, VOCAB) and ours[0].dtype == np.dtype(str(dtype)[6:])
    labels = _labels(MASKS)
    loss = LOSS(lm, jnp.asarray(IDS), jnp.asarray(MASKS), jnp.asarray(labels))
    assert loss.dtype == np.dtype(str(dtype)[6:])
    default = LOSS(lm, jnp.asarray(IDS), jnp.asarray(MASKS), jnp.asarray(IDS))
    for impl in ("eager", "sdpa"):
        ref, ref_loss = _hf(model, impl, MASKS, labels)
        assert abs(float(loss) - ref_loss) <= TOL[dtype] * ref_loss, (impl, loss, ref_loss)
        if logits:
            for o, r, mask in zip(ours, ref, MASKS, strict=True):
                real = mask == 1
                err = np.max(np.abs(o[real] - r[real])) / np.max(np.abs(r[real]))
                assert err <= TOL[dtype], (impl, err)
    assert float(default) == float(loss)


def test_loss_without_padding():
    """No mask: every next token counts, as Hugging Face with `labels=input_ids`; some
    labels ignored (-100)."""
    model = _cached("gpt2", torch.float64)
    lm = itde.from_hf(model)
    ones = np.ones_like(MASKS)
    labels = IDS.copy()
    labels[0, 3] = labels[2, 1] = -100
    loss = float(LOSS(lm, jnp.asarray(IDS), jnp.asarray(ones), jnp.asarray(labels)))
    _, ref = _hf(model, "eager", ones, labels)
    assert abs(loss - ref) <= 1e-12 * ref


def test_head_bias():
    """A head with a bias (another family's `lm_head`) is converted with it: the head
    equals the `nn.Linear`; writing it into a class whose head has none is refused."""
    model = _model("llama", torch.float64)
    model.lm_head = torch.nn.Linear(8, VOCAB, bias=True, dtype=torch.float64)
    lm = itde.from_hf(model)
    h = np.random.RandomState(1).normal(size=(3, 8))
    with torch.no_grad():
        ref = model.lm_head(torch.as_tensor(h)).numpy()
    np.testing.assert_allclose(np.asarray(lm.project(jnp.asarray(h))), ref, rtol=1e-13, atol=0)
    with pytest.raises(ValueError, match=r"to_hf.*a bias.*lm_head.*none"):
        lm.to_hf()


# ---------------------------------------------------------------- generation
@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_greedy_equals_hugging_face_generate(name):
    """Greedy generation token for token against `generate(do_sample=False)` in float64,
    also stopping at an end token as Hugging Face does."""
    model = _cached(name, torch.float64)
    lm = itde.from_hf(model)
    prompt = IDS[0, :3]

    def hf(n, eos):
        with torch.no_grad(), itde.interop.hf_float64():
            out = model.generate(
                torch.as_tensor(prompt[None]), max_new_tokens=n, do_sample=False,
                eos_token_id=eos, pad_token_id=PAD,
            )  # fmt: skip
        return out[0].numpy()

    ours = lm.generate(prompt, 4, max_length=N, chunk=3)
    np.testing.assert_array_equal(ours, hf(4, None))
    eos = int(ours[4])  # a token drawn on the way: both stop after it
    stopped = lm.generate(prompt, 4, max_length=N, chunk=3, eos_token_id=eos)
    np.testing.assert_array_equal(stopped, hf(4, eos))
    assert len(stopped) == 5 or eos == ours[3]


def test_one_compilation_streams_and_samples():
    """One compiled program serves the pieces of a generation and another prompt
    length, one more a key and any temperature (`itde.programs` counts them); the pieces
    come as they are drawn; a sample is `categorical(fold_in(key, i), logits / T)` of the
    model's own logits."""
    lm = itde.from_hf(_cached("gpt2", torch.float64))

    def traces():
        return itde.programs.compiled

    before = traces()
    prompt = IDS[1, :3]
    pieces = list(lm.generate_stream(prompt, 4, max_length=N, chunk=3))
    assert [len(p) for p in pieces] == [3, 1]
    compiled = traces()
    assert compiled - before <= 2  # two pieces, four tokens: the prefill and the loop
    shorter = lm.generate(IDS[2, :2], 5, chunk=3)  # another prompt and window: the same
    assert traces() == compiled
    key, temperature = jax.random.key(7), 0.7
    sampled = lm.generate(prompt, 4, key=key, temperature=temperature, max_length=N, chunk=3)
    compiled = traces()  # the sampled loop
    again = lm.generate(prompt, 4, key=jax.random.key(8), temperature=5.0, max_length=N, chunk=3)
    assert traces() == compiled  # another key and temperature: no new one
    assert len(shorter) == 7 and np.array_equal(shorter[:2], IDS[2, :2])

    # the samples again, from the logits of the window (the model is causal: the filler
    # after the last drawn token is never read) with the same key schedule
    window = np.zeros(N, IDS.dtype)  # the dtype of the logits test: no new compilation
    window[:3] = prompt
    for i in range(4):
        logits = LOGITS(lm, jnp.asarray(window), jnp.ones(N, int))[2 + i]
        tok = jax.random.categorical(jax.random.fold_in(key, i), logits / temperature)
        window[3 + i] = int(tok)
    np.testing.assert_array_equal(sampled, window)
    whole = lm.generate(prompt, 4, max_length=N, chunk=3)
    np.testing.assert_array_equal(np.concatenate([prompt, *pieces]), whole)
    assert not np.array_equal(again, sampled)


def test_generation_arguments_are_checked():
    lm = itde.from_hf(_cached("gpt2", torch.float64))
    prompt = IDS[0, :3]
    with pytest.raises(ValueError, match=r"`temperature`=0.5 without a `key`"):
        lm.generate(prompt, 2, temperature=0.5)
    with pytest.raises(ValueError, match=r"window of 20 tokens.*16 positions"):
        lm.generate(prompt, 17)
    with pytest.raises(ValueError, match=r"`max_length`=4 is shorter.*at least 5"):
        lm.generate(prompt, 2, max_length=4)
    with pytest.raises(TypeError, match=r"`prompt_ids` is a torch tensor"):
        lm.generate(torch.as_tensor(prompt), 2)
    with pytest.raises(ValueError, match=r"`prompt_ids` must be one non-empty"):
        lm.generate(prompt[None], 2)
    with pytest.raises(ValueError, match=r"`eos_token_id`=50"):
        lm.generate(prompt, 2, eos_token_id=VOCAB)
    with pytest.raises(ValueError, match=r"`temperature`=-1"):
        lm.generate(prompt, 2, key=jax.random.key(0), temperature=-1)
    with pytest.raises(ValueError, match=r"`temperature`=True must be a finite number"):
        lm.generate(prompt, 2, key=jax.random.key(0), temperature=True)
    # filters a greedy draw would ignore (transformers refuses temperature 0 to sample)
    with pytest.raises(ValueError, match=r"`top_k`=5, `top_p`=1.0 at `temperature`=0 would be"):
        lm.generate(prompt, 2, key=jax.random.key(0), temperature=0, top_k=5)
    with pytest.raises(ValueError, match=r"`top_k`=None, `top_p`=0.5 at `temperature`=0"):
        lm.generate(prompt, 2, key=jax.random.key(0), temperature=0.0, top_p=0.5)
    with pytest.raises(ValueError, match=r"`labels` holds ids outside \[0, 50\).*-100.*50"):
        lm.loss(jnp.asarray(IDS), labels=jnp.asarray(np.full_like(IDS, VOCAB)))
    with pytest.raises(ValueError, match=r"`attention_mask` must have the shape"):
        lm.loss(jnp.asarray(IDS), jnp.asarray(MASKS[:2]))


def test_a_numpy_temperature_is_a_number():
    """`np.float32(0.9)` is the temperature 0.9 (a NumPy float from an array or a config):
    the same draws, in `generate` and in `warp_logits`; a NumPy bool is refused."""
    from itde.train import warp_logits

    lm = itde.from_hf(_cached("gpt2", torch.float64))
    prompt, key = IDS[0, :3], jax.random.key(3)
    a = lm.generate(prompt, 3, key=key, temperature=np.float32(0.75))
    b = lm.generate(prompt, 3, key=key, temperature=float(np.float32(0.75)))
    np.testing.assert_array_equal(a, b)
    z = np.random.RandomState(0).randn(2, 9)
    np.testing.assert_array_equal(np.asarray(warp_logits(z, temperature=np.float32(0.5))),
                                  np.asarray(warp_logits(z, temperature=0.5)))  # fmt: skip
    with pytest.raises(ValueError, match=r"`temperature`=np.True_ must be a finite number"):
        warp_logits(z, temperature=np.True_)


# ---------------------------------------------------------------- back to Hugging Face
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_to_hf_round_trip(name):
    """`from_hf(model).to_hf()` is the head class with `model`'s state, tied where it was;
    a head changed in itde (for the tied GPT-2: its word embeddings, which are its head)
    goes back with its change, and Hugging Face's logits then equal the changed model's."""
    model = _cached(name, torch.float64)
    lm = itde.from_hf(model)
    back = lm.to_hf()
    assert type(back) is type(model)
    tied = back.lm_head.weight is back.get_input_embeddings().weight
    assert tied == (name == "gpt2")
    ours, theirs = back.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k

    if lm.tied:
        w = lm.base.word_embeddings
        changed = eqx.tree_at(lambda lm: lm.base.word_embeddings, lm, w * 1.5)
    else:
        changed = eqx.tree_at(lambda lm: lm.head, lm, lm.head * 1.5)
    hf = changed.to_hf()
    with torch.no_grad(), itde.interop.hf_float64():
        ref = hf(torch.as_tensor(IDS[:1])).logits[0].numpy()
        old = model(torch.as_tensor(IDS[:1])).logits[0].numpy()
    out = np.asarray(LOGITS(changed, jnp.asarray(IDS[0]), jnp.ones(N, int)))
    assert np.max(np.abs(out - ref)) <= 1e-10 * np.max(np.abs(ref))
    assert np.max(np.abs(old - ref)) > 1e-3


def test_an_untied_head_is_not_written_into_a_tied_class():
    lm = itde.from_hf(_cached("gpt2", torch.float64))
    untied = eqx.tree_at(
        lambda lm: lm.head, lm, lm.base.word_embeddings * 2.0, is_leaf=lambda x: x is None
    )
    with pytest.raises(ValueError, match=r"head differs.*tie_word_embeddings"):
        untied.to_hf()


def test_head_options_the_head_would_ignore_are_refused():
    model = _model("gpt2", torch.float32)
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match=r"`config\.logit_scale`=0\.5"):
        itde.from_hf(model)


@pytest.mark.parametrize(
    "cls, config",
    [
        ("MistralForCausalLM", tf.MistralConfig),
        ("Qwen2ForCausalLM", tf.Qwen2Config),
        ("GemmaForCausalLM", tf.GemmaConfig),
        ("GPTNeoXForCausalLM", tf.GPTNeoXConfig),
    ],
)
def test_every_registered_causal_lm_gives_hugging_faces_logits(cls, config):
    """The heads of the rotary families are one registry line each: their logits equal
    Hugging Face's (float64, padding none/right/left), and to_hf gives the head class back
    with the same state."""
    sizes = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
                 max_position_embeddings=16, **COMMON)  # fmt: skip
    if config is not tf.GPTNeoXConfig:
        sizes.update(num_key_value_heads=1, head_dim=4)
    if config is tf.MistralConfig:
        sizes.update(sliding_window=None)
    c = config(**sizes)
    c._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(tf, cls)(c)
    spread_hf_weights(model)
    model = model.to(torch.float64).eval()
    lm = itde.from_hf(model)
    assert isinstance(lm, itde.HFCausalLM)
    ours = np.asarray(jax.vmap(lm.logits)(jnp.asarray(IDS), jnp.asarray(MASKS)))
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(IDS), attention_mask=torch.as_tensor(MASKS)).logits.numpy()
    real = MASKS == 1
    assert np.max(np.abs(ours[real] - ref[real])) <= 1e-10 * np.max(np.abs(ref[real]))
    back = itde.to_hf(lm)
    assert type(back) is type(model)
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


def test_one_sequence_without_labels():
    """`loss(ids)` and `perplexity(ids)` of one sequence `[tokens]`, labels defaulting to the
    input, were refused ("`labels` must have the shape of `input_ids` (7,), got (1, 7)");
    they are Hugging Face's `model(ids[None], labels=ids[None]).loss` and its exponential."""
    model = _cached("gpt2", torch.float64)
    lm = itde.from_hf(model)
    ids = IDS[0]
    with torch.no_grad(), itde.interop.hf_float64():
        ref = float(model(torch.as_tensor(ids[None]), labels=torch.as_tensor(ids[None])).loss)
    loss = float(lm.loss(jnp.asarray(ids)))
    assert abs(loss - ref) <= 1e-12 * ref
    assert float(lm.perplexity(jnp.asarray(ids))) == pytest.approx(np.exp(ref), rel=1e-12)
    labels = ids.copy()
    labels[2] = -100  # explicit one-sequence labels still work
    with torch.no_grad(), itde.interop.hf_float64():
        ref2 = float(model(torch.as_tensor(ids[None]), labels=torch.as_tensor(labels[None])).loss)
    assert float(lm.loss(jnp.asarray(ids), labels=jnp.asarray(labels))) == pytest.approx(
        ref2, rel=1e-12
    )
