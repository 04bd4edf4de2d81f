"""Sampling as Hugging Face's `generate(do_sample=True)` samples: temperature, top-k and top-p
equal `transformers`' own logits processors on the same logits (ties and odd vocabularies
included); the compiled loops of `itde sample` and `HFCausalLM.generate` apply them with one
compilation for every value; a byte-level BPE stream never shows half a character and joins
into the full decode of the drawn tokens, at every chunk boundary."""

import functools
import inspect
import json
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import spread_hf_weights
from hypothesis import example, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import itde
from itde.cli import main
from itde.train import (
    TASKS,
    IncrementalDecoder,
    TrainExperiment,
    from_dict,
    load,
    sample,
    sample_stream,
    warp_logits,
)
from itde.train._internal import _sample as sampler

REPLACEMENT = "\ufffd"


# ---------------------------------------------------------------- the filters
def _transformers(z, temperature, top_k, top_p, *, stable=False):
    """`transformers`' processors on the scores `z` [batch, vocab], each added where
    `generate(do_sample=True)` adds it (`_get_logits_processor`: temperature != 1, top_k
    not None or 0, top_p < 1), in its order. `stable`: `torch.sort` made stable (its order
    of ties is otherwise unspecified, and arbitrary from 17 entries on)."""
    warpers = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p, min_tokens_to_keep=1))
    scores = z if isinstance(z, torch.Tensor) else torch.from_numpy(np.array(z))
    sort = functools.partial(torch.sort, stable=True) if stable else torch.sort
    with mock.patch.object(torch, "sort", sort):
        for w in warpers:
            scores = w(None, scores)
    return scores.numpy() if scores.dtype.itemsize >= 4 else scores.float().numpy()


def test_the_order_is_that_of_generate():
    """The installed `generate` adds the warpers as temperature, top-k, top-p (the order
    `_transformers` and `itde._next_token` follow), and only with `do_sample`."""
    source = inspect.getsource(tf.GenerationMixin._get_logits_processor)
    at = [source.index(f"{name}(") for name in
          ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")]  # fmt: skip
    assert at == sorted(at)
    assert "top_p < 1.0" in source and "temperature != 1.0" in source


VOCABS = (1, 2, 3, 17, 49, 103, 197)  # odd sizes; 17 and up: torch's sort is unstable


@st.composite
def _cases(draw):
    vocab = draw(st.sampled_from(VOCABS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["spread", "ties", "equal", "wide"]))
    if kind == "spread":
        z = rng.standard_normal((2, vocab)) * draw(st.sampled_from([0.3, 3.0]))
    elif kind == "ties":  # few distinct values: ties across every cut
        z = rng.integers(-3, 4, (2, vocab)) * draw(st.sampled_from([0.25, 1.0]))
    elif kind == "equal":
        z = np.full((2, vocab), draw(st.sampled_from([0.0, -2.5])))
    else:  # probabilities that underflow in float32
        z = rng.uniform(-200, 20, (2, vocab))
    temperature = draw(st.sampled_from([1.0, 0.7, 1.3, 0.05]) | st.floats(0.01, 10.0))
    top_k = draw(st.none() | st.integers(1, vocab + 2))
    top_p = draw(st.sampled_from([1.0, 0.5, 1e-9, 1 - 1e-7]) | st.floats(0, 1, exclude_min=True))
    return z.astype(np.float32), temperature, top_k, top_p


@hsettings(max_examples=120)  # seven shapes: seven compilations, then milliseconds each
@given(_cases())
def test_filters_equal_transformers_processors(case):
    """`warp_logits` against `TemperatureLogitsWarper`, `TopKLogitsWarper` and
    `TopPLogitsWarper` (`min_tokens_to_keep=1`): bit for bit, every removed token at -inf,
    against the processors with ties sorted stably; against the processors as they are,
    the same scores kept (where tied scores straddle the top-p cut, torch's sort may
    remove another of the equal tokens, never another number), and bit for bit where no
    tie straddles the cut."""
    z, temperature, top_k, top_p = case
    ours = np.asarray(warp_logits(jnp.asarray(z), temperature=temperature, top_k=top_k,
                                  top_p=top_p))  # fmt: skip
    stable = _transformers(z, temperature, top_k, top_p, stable=True)
    np.testing.assert_array_equal(ours, stable)
    theirs = _transformers(z, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.sort(ours, axis=-1), np.sort(theirs, axis=-1))
    scaled = _transformers(z, temperature, None, 1.0)  # the scores the cuts compare
    for row, ref, scores in zip(ours, theirs, scaled, strict=True):
        kept = np.isfinite(ref)
        if not set(scores[kept].tolist()) & set(scores[~kept].tolist()):
            np.testing.assert_array_equal(row, ref)
    assert np.isfinite(ours).sum(-1).min() >= 1  # one token kept at least


def test_top_p_one_keeps_every_token_as_generate_does():
    """`top_p=1` filters nothing: `generate` adds no `TopPLogitsWarper` then (the warper
    itself, called with 1.0, would remove the tokens whose float32 probability is 0)."""
    z = np.array([[0.0, -200.0, 5.0, -1e4, 5.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(warp_logits(z, top_p=1.0)), z)
    direct = TopPLogitsWarper(1.0)(None, torch.from_numpy(z)).numpy()
    assert np.isinf(direct[0, [1, 3]]).all()  # what `generate` avoids by leaving it out
    np.testing.assert_array_equal(np.asarray(warp_logits(z, temperature=0.5)), z / np.float32(0.5))


def test_one_token_is_kept_and_top_k_keeps_ties():
    """`min_tokens_to_keep=1`: a top-p below every probability keeps the single most
    likely token (of tied maxima, the one a stable sort puts last); top-k keeps every
    score equal to the k-th largest; top-k beyond the vocabulary keeps all."""
    z = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 2.0]], np.float32)
    one = np.asarray(warp_logits(z, top_p=1e-9))
    assert np.flatnonzero(np.isfinite(one[0])).tolist() == [4]
    np.testing.assert_array_equal(one, _transformers(z, 1.0, None, 1e-9))  # 7 < 17: stable
    ties = np.asarray(warp_logits(z, top_k=2))
    assert np.flatnonzero(np.isfinite(ties[0])).tolist() == [1, 2, 4]
    np.testing.assert_array_equal(ties, _transformers(z, 1.0, 2, 1.0))
    np.testing.assert_array_equal(np.asarray(warp_logits(z, top_k=100)), z)


def test_float64_logits_equal_transformers_in_float64():
    rng = np.random.default_rng(5)
    z = rng.standard_normal((2, 49)) * 2
    ours = np.asarray(warp_logits(jnp.asarray(z, jnp.float64), temperature=0.7, top_k=30,
                                  top_p=0.8))  # fmt: skip
    assert ours.dtype == np.float64
    np.testing.assert_array_equal(ours, _transformers(z, 0.7, 30, 0.8, stable=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_half_logits_keep_the_tokens_transformers_keeps(dtype):
    """2000 rows of 40 scores in bfloat16, float16 and float32 at several temperatures,
    top-k and top-p: bit for bit the processors' scores, the same tokens kept in every row
    (torch divides a half type by a Python float in float32 and rounds once; its softmax
    and cumsum of a half type run in float32, each output rounded to it: dividing and
    summing in the half type kept another number of tokens in 10-80 rows of 2000)."""
    rng = np.random.default_rng(7)
    z = torch.from_numpy(rng.standard_normal((2000, 40)) * 3).to(getattr(torch, dtype))
    logits = jnp.asarray(z.float().numpy()).astype(dtype)  # the same values
    filters = [(1.0, None, 0.8), (0.7, None, 0.8), (1.3, None, 0.8), (0.7, 20, 0.9),
               (1.3, None, 1.0), (0.3, 10, 0.5)]  # fmt: skip
    for temperature, top_k, top_p in filters:
        ours = warp_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        assert ours.dtype == logits.dtype
        ours = np.asarray(ours.astype(jnp.float32))
        theirs = _transformers(z, temperature, top_k, top_p, stable=True)
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"top_k": 0}, r"`top_k`=0 must be an integer >= 1.*leave it out"),
        ({"top_k": -3}, r"`top_k`=-3 must be an integer >= 1"),
        ({"top_k": 2.5}, r"`top_k`=2.5 must be an integer"),
        ({"top_k": True}, r"`top_k`=True must be an integer"),
        ({"top_p": 0.0}, r"`top_p`=0.0 must be a number in \(0, 1\].*1 keeps every token"),
        ({"top_p": 1.5}, r"`top_p`=1.5 must be a number in \(0, 1\]"),
        ({"top_p": float("nan")}, r"`top_p`=nan must be"),
        ({"temperature": 0.0}, r"`temperature`=0.0 must be a finite number > 0"),
    ],
)
def test_bad_filters_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        warp_logits(np.zeros((1, 3), np.float32), **kwargs)


# ---------------------------------------------------------------- a byte-level BPE stream
TEXT = "héllo wörld, 中文字符 and emoji 🙂🚀 naïve café — 日本語のテキスト.\n" * 12
SAMPLE_TEXT = "café 中文 🙂🚀 naïve — 日本語"


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """A byte-level BPE (GPT-2's scheme) of 300 tokens saved as a model directory's
    `tokenizer.json`: too few merges to make every character one token."""
    import tokenizers as tk

    path = tmp_path_factory.mktemp("bytebpe")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    trainer = tk.trainers.BpeTrainer(vocab_size=300, show_progress=False, initial_alphabet=alphabet)
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    return path, tok


def _decode(tok):
    return lambda ids: tok.decode(list(ids))


def test_stream_never_shows_half_a_character_at_any_boundary(byte_tokenizer):
    """The text split at every token boundary into two pushes, and token by token: the
    pieces join into the text and none holds U+FFFD, although tokens alone do (the
    characters are split between tokens)."""
    _, tok = byte_tokenizer
    ids = tok.encode(SAMPLE_TEXT).ids
    assert tok.decode(ids) == SAMPLE_TEXT
    alone = [tok.decode([i]) for i in ids]
    assert sum(REPLACEMENT in t for t in alone) >= 4  # what printing token by token showed
    for k in range(len(ids) + 1):
        d = IncrementalDecoder(_decode(tok))
        pieces = [d.push(ids[:k]), d.push(ids[k:]), d.flush()]
        assert "".join(pieces) == SAMPLE_TEXT, k
        assert not any(REPLACEMENT in p for p in pieces), (k, pieces)
    d = IncrementalDecoder(_decode(tok))
    pieces = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(pieces) == SAMPLE_TEXT and not any(REPLACEMENT in p for p in pieces)
    # after a prompt (its ids the context): the text that follows it, whole
    cut = [tok.decode(ids[:k]) for k in range(len(ids))].index("café")
    d = IncrementalDecoder(_decode(tok), ids[:cut])
    assert "".join([d.push([i]) for i in ids[cut:]] + [d.flush()]) == SAMPLE_TEXT[4:]


def test_stream_decodes_in_the_context_of_what_came_before():
    """A SentencePiece-style decoder (Metaspace) drops the leading space of a text's first
    token: pushed token by token, and after a prompt, the words keep their spaces."""
    import tokenizers as tk

    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.Metaspace()
    tok.decoder = tk.decoders.Metaspace()
    tok.train_from_iterator([TEXT], tk.trainers.BpeTrainer(vocab_size=120, show_progress=False))
    ids = tok.encode("naïve café and emoji").ids
    assert tok.decode(ids[1:]) == "café and emoji"  # the space before "café" is dropped alone
    d = IncrementalDecoder(_decode(tok))
    assert "".join([d.push([i]) for i in ids] + [d.flush()]) == "naïve café and emoji"
    d = IncrementalDecoder(_decode(tok), ids[:1])
    assert "".join([d.push([i]) for i in ids[1:]] + [d.flush()]) == " café and emoji"


@hsettings(max_examples=60)
@given(ids=st.lists(st.integers(0, 299), max_size=40), cuts=st.lists(st.integers(0, 40)))
def test_stream_joins_into_the_full_decode_of_any_tokens(byte_tokenizer, ids, cuts):
    """Any ids (stray continuation bytes, characters never finished) pushed in any pieces:
    the pieces and the flush join into the tokenizer's decode of them all."""
    _, tok = byte_tokenizer
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    d = IncrementalDecoder(_decode(tok))
    pieces = [d.push(ids[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert "".join([*pieces, d.flush()]) == tok.decode(ids)
    assert not any(p.endswith(REPLACEMENT) for p in pieces)  # the tail waits for the flush


def _utf8(ids):
    """A byte-per-token decoder: UTF-8 with U+FFFD for what is not a whole character."""
    return bytes(ids).decode("utf-8", "replace")


def _after_context(decode, context, pushes):
    """The pieces of `pushes` after `context`, and what they must join into: the full
    decode minus the context's text up to a character it ends inside."""
    d = IncrementalDecoder(decode, context)
    joined = "".join([d.push(p) for p in pushes] + [d.flush()])
    full, own = decode(context + [i for p in pushes for i in p]), decode(context)
    complete = own.rstrip(REPLACEMENT)
    assert full.startswith(complete)
    return joined, full[len(complete) :]


@hsettings(max_examples=40)
@example(text="hi 😀 ok", cut=4, cuts=[])  # the context ends after 1 byte of 4: " ok" was out
@example(text="hi 😀 ok", cut=5, cuts=[])  # after 2 of 4
@example(text="hi 😀 ok", cut=6, cuts=[7, 8])
@example(text="é中🙂", cut=1, cuts=list(range(9)))  # byte by byte after half an "é"
@given(text=st.text(st.characters(codec="utf-8"), max_size=10), cut=st.integers(0, 40),
       cuts=st.lists(st.integers(0, 40), max_size=6))  # fmt: skip
def test_a_context_that_ends_inside_a_character(text, cut, cuts):
    """A context that ends inside a multi-byte character, at any byte, then the rest
    pushed in any pieces: the pieces join into the full decode minus the context's whole
    characters, the split character given out whole (it was never given out)."""
    ids = list(text.encode())
    cut = min(cut, len(ids))
    bounds = sorted({min(max(c, cut), len(ids)) for c in cuts} | {cut, len(ids)})
    pushes = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    joined, expected = _after_context(_utf8, ids[:cut], pushes)
    assert joined == expected == text[len(_utf8(ids[:cut]).rstrip(REPLACEMENT)) :]


def test_a_context_split_at_every_token_of_a_byte_level_bpe(byte_tokenizer):
    """The byte-level BPE's ids of the sample text, the context cut at every token (the
    characters split between tokens among the cuts), the rest pushed token by token and
    at once: the pieces join into the text after the context's whole characters."""
    _, tok = byte_tokenizer
    ids = tok.encode(SAMPLE_TEXT).ids
    split = 0
    for cut in range(len(ids) + 1):
        own = tok.decode(ids[:cut])
        split += own.endswith(REPLACEMENT)
        rest = SAMPLE_TEXT[len(own.rstrip(REPLACEMENT)) :]
        for pushes in ([[i] for i in ids[cut:]], [ids[cut:]]):
            assert _after_context(_decode(tok), ids[:cut], pushes) == (rest, rest), cut
    assert split >= 4  # contexts that end inside a character


# ---------------------------------------------------------------- the sampler's loop
TINY = {
    "model": {"n_layers": 1, "n_features": 8, "n_heads": 2, "n_hidden": 8},
    "optim": {"steps": 2, "batch_size": 4, "warmup": 0},
    "run": {"log_every": 1, "eval_every": 2, "checkpoint_every": 2, "progress": False},
}


@pytest.fixture(scope="module")
def textlm(byte_tokenizer, tmp_path_factory):
    """A 2-step textlm run of `itde train` with the byte-level tokenizer (`hf:DIR`) on the
    multi-byte text; returns (run dir, model, task)."""
    path, _ = byte_tokenizer
    root = tmp_path_factory.mktemp("textlm")
    (root / "text.txt").write_text(TEXT)
    table = {**TINY, "task": {"name": "textlm", "text_path": str(root / "text.txt"),
                              "tokenizer": f"hf:{path}", "context": 8, "eval_size": 4,
                              "cache_dir": str(root / "cache")}}  # fmt: skip
    config = root / "textlm.toml"
    config.write_text(_toml(table))
    assert main(["train", "--config", str(config), "--out", str(root / "run"),
                 "--no-progress"]) == 0  # fmt: skip
    model, cfg, meta = load(root / "run")
    return root / "run", model, TASKS["textlm"].from_checkpoint(cfg.task, meta["task"])


def _toml(table):
    return "\n".join(f"[{name}]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
                     for name, keys in table.items()) + "\n"  # fmt: skip


def _drawn_ids(model, task, prompt, length, **kwargs):
    """The ids `sample_stream` draws (what it pushes to its decoder)."""
    drawn, push = [], IncrementalDecoder.push

    def recorded(self, ids):
        drawn.extend(np.asarray(ids).tolist())
        return push(self, ids)

    with mock.patch.object(IncrementalDecoder, "push", recorded):
        list(sample_stream(model, task.itos, prompt, length, encode=task.encode,
                           decode=task.tokenizer.decode, context=8, **kwargs))  # fmt: skip
    assert len(drawn) == length
    return drawn


@pytest.mark.parametrize("chunk", [1, 3])
def test_byte_level_sample_joins_into_the_full_decode(textlm, chunk):
    """The sampler's pieces, a chunk of 1 (every token boundary is a piece boundary) or 3,
    join into the tokenizer's decode of prompt + drawn ids, minus the prompt; no piece but
    the last ends in U+FFFD. The prompt's multi-byte characters are accepted (a byte-level
    vocabulary encodes any text)."""
    _, model, task = textlm
    prompt, kw = "café 中", dict(temperature=1.0, seed=4, top_k=50, top_p=0.95, chunk=chunk)
    ids = _drawn_ids(model, task, prompt, 30, **kw)
    pieces = list(sample_stream(model, task.itos, prompt, 30, encode=task.encode,
                                decode=task.tokenizer.decode, context=8, **kw))  # fmt: skip
    full = task.tokenizer.decode(task.encode(prompt) + ids)
    assert prompt + "".join(pieces) == full
    assert not any(p.endswith(REPLACEMENT) for p in pieces[:-1])
    naive = "".join(task.itos[i] for i in ids)  # the former stream: one token's text at a time
    assert naive.count(REPLACEMENT) > full.count(REPLACEMENT)


@pytest.mark.runs("sample")
def test_sample_command_on_a_byte_level_textlm_with_top_k_and_top_p(textlm, capsys):
    out, model, task = textlm
    argv = ["sample", "--checkpoint", str(out), "--prompt", "naïve 日", "--length", "24",
            "--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--seed", "7"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    ids = _drawn_ids(model, task, "naïve 日", 24, temperature=0.8, top_k=40, top_p=0.9, seed=7)
    assert printed == task.tokenizer.decode(task.encode("naïve 日") + ids) + "\n"
    assert printed == sample(model, task.itos, "naïve 日", 24, temperature=0.8, top_k=40,
                             top_p=0.9, seed=7, encode=task.encode,
                             decode=task.tokenizer.decode, context=8) + "\n"  # fmt: skip


@pytest.mark.parametrize(
    ("flag", "value", "needle"),
    [("--top-k", "0", "`--top-k`=0 must be an integer >= 1"),
     ("--top-p", "0", "`--top-p`=0.0 must be a number in (0, 1]"),
     ("--top-p", "1.5", "`--top-p`=1.5 must be a number in (0, 1]"),
     ("--top-p", "nan", "`--top-p`=nan")],
)  # fmt: skip
def test_sample_command_refuses_bad_filters_before_reading(tmp_path, capsys, flag, value, needle):
    assert main(["sample", "--checkpoint", str(tmp_path / "none"), flag, value]) == 2
    err = capsys.readouterr().err
    assert needle in err and "holds no checkpoint" not in err, err


def test_sample_help_names_every_text_task_and_the_filters(capsys):
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    shown = capsys.readouterr().out
    for name, cls in TASKS.items():
        assert (name in shown) == cls.can_sample, name
    assert "--top-k K" in shown and "--top-p P" in shown and "charlm checkpoint" not in shown


@pytest.fixture(scope="module")
def charlm_model():
    cfg = from_dict(TrainExperiment, {**TINY, "task": {"name": "charlm", "context": 8}})
    task = TASKS["charlm"](cfg.task)
    return task.init_model(cfg.model, jax.random.key(3), dtype=jnp.float32), task.itos


@eqx.filter_jit
def _logits(model, window, last):
    return model(window)[last].astype(jnp.float32)


def test_the_loop_draws_from_transformers_filtered_logits(charlm_model):
    """Token by token (past the point where the window slides), `sample_stream` draws
    `categorical(fold_in(key, i), .)` of the logits filtered by `transformers`' processors;
    new temperatures, top-k and top-p values compile nothing new; top-k 1 is greedy."""
    model, itos = charlm_model
    stoi = {c: i for i, c in enumerate(itos)}

    def reference(prompt, length, temperature, top_k, top_p, seed):
        ids, key = [stoi[c] for c in prompt], jax.random.key(seed)
        for i in range(length):
            window = np.zeros(8, np.int32)
            tail = ids[-8:]
            window[: len(tail)] = tail
            z = np.asarray(_logits(model, jnp.asarray(window), jnp.int32(len(tail) - 1)))
            warped = _transformers(z[None], temperature, top_k, top_p, stable=True)[0]
            ids.append(int(jax.random.categorical(jax.random.fold_in(key, i), warped)))
        return "".join(itos[i] for i in ids)

    def ours(prompt, length, **kw):
        return prompt + "".join(sample_stream(model, itos, prompt, length, chunk=5, **kw))

    traces = itde.programs.compiled
    got = ours("the", 14, temperature=0.7, top_k=6, top_p=0.8, seed=2)
    compiled = itde.programs.compiled
    assert compiled - traces <= 4  # split layers, the rows' keys, prefill, sampled loop
    assert got == reference("the", 14, 0.7, 6, 0.8, 2)
    assert ours("fox", 14, temperature=1.3, top_p=0.5, seed=3) == reference("fox", 14, 1.3, None,
                                                                           0.5, 3)  # fmt: skip
    plain = ours("a", 14, temperature=1.5, seed=1)
    assert plain == reference("a", 14, 1.5, None, 1.0, 1)
    greedy = ours("a", 14, temperature=0.0)  # the greedy decode loop: one program more
    assert ours("a", 14, temperature=1.5, top_k=1, seed=1) == greedy != plain
    assert itde.programs.compiled <= compiled + 1


# ---------------------------------------------------------------- HFCausalLM.generate
@pytest.fixture(scope="module")
def gpt2():
    config = tf.GPT2Config(n_embd=8, n_layer=1, n_head=2, n_inner=12, n_positions=16,
                           vocab_size=50, bos_token_id=2, eos_token_id=3)  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = spread_hf_weights(tf.GPT2LMHeadModel(config)).to(torch.float64).eval()
    return model, itde.from_hf(model)


def test_generate_filters_as_transformers_with_one_compilation(gpt2):
    """`HFCausalLM.generate` with a key, top-k and top-p: each token a draw from the
    model's logits filtered by `transformers`' processors (Hugging Face's logits of the
    same window, in float64), one compilation whatever the filters; top-k 1 is greedy, which equals
    `generate(do_sample=False)`."""
    model, lm = gpt2
    prompt, key = np.array([5, 9, 11]), jax.random.key(4)
    before = itde.programs.compiled
    drawn = lm.generate(prompt, 6, key=key, temperature=0.9, top_k=7, top_p=0.85, max_length=9)
    compiled = itde.programs.compiled  # the prefill, the sampled loop (and the rows' keys)
    ids = list(prompt)
    for i in range(6):
        with torch.no_grad(), itde.interop.hf_float64():
            z = model(torch.as_tensor([ids])).logits[0, -1].numpy()
        warped = _transformers(z[None], 0.9, 7, 0.85, stable=True)[0]
        ids.append(int(jax.random.categorical(jax.random.fold_in(key, i), warped)))
    np.testing.assert_array_equal(drawn, ids)
    one = lm.generate(prompt, 6, key=key, temperature=1.7, top_k=1, max_length=9)
    with torch.no_grad(), itde.interop.hf_float64():
        hf = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=6, do_sample=False,
                            pad_token_id=0)[0].numpy()  # fmt: skip
    np.testing.assert_array_equal(one, hf)
    lm.generate(prompt, 6, key=key, top_p=0.3, max_length=9)
    assert compiled - before <= 3 and itde.programs.compiled == compiled
    with pytest.raises(ValueError, match=r"`top_k`=5, `top_p`=1.0 without a `key`"):
        lm.generate(prompt, 2, top_k=5)
    with pytest.raises(ValueError, match=r"`top_p`=0 must be a number in \(0, 1\]"):
        lm.generate(prompt, 2, key=key, top_p=0)


def test_a_prompt_the_tokenizer_cannot_encode_is_named(byte_tokenizer):
    """A BPE of characters lacks a character: named. A tokenizer whose tokens do not give
    the prompt back (here one that drops what it does not know): named with what they
    decode to. A byte-level BPE encodes any prompt, multi-byte characters included."""
    from itde.data import BPETokenizer, HFTokenizer

    bpe = BPETokenizer.train(iter(["abc abd ab"]), vocab_size=12, alphabet="abcd ")
    with pytest.raises(ValueError, match=r"outside the model's vocabulary: 'Xé'"):
        sampler._prompt_ids(bpe.itos, "abXé", lambda t: bpe.encode(t).tolist(), bpe.decode)
    assert bpe.decode(sampler._prompt_ids(bpe.itos, "ab d", lambda t: bpe.encode(t).tolist(),
                                          bpe.decode)) == "ab d"  # fmt: skip
    known = {"a": 0, "b": 1}
    with pytest.raises(ValueError, match=r"outside the model's vocabulary: 'z' \(its tokens "
                                         r"decode to 'ab'\)"):  # fmt: skip
        sampler._prompt_ids(("a", "b"), "azb", lambda t: [known[c] for c in t if c in known],
                            lambda ids: "".join("ab"[i] for i in ids))  # fmt: skip
    _, tok = byte_tokenizer
    hf = HFTokenizer(tok)
    ids = sampler._prompt_ids(hf.itos, "🙂 中é", lambda t: hf.encode(t).tolist(), hf.decode)
    assert hf.decode(ids) == "🙂 中é"
