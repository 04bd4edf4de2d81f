"""The key/value cache for causal generation (`itde.KVCache`): cached == uncached.

For GPT-2 (learned positions), Llama (RoPE, grouped-query attention), Mistral (a sliding
window shorter than the sequence) and GPT-NeoX (parallel attention and feed-forward),
built by `transformers` from tiny configs with random weights: the float64 logits of the
prefill and of every decoded token equal the uncached model's (itself equal to
transformers') to 1e-12, and greedy generation with the cache gives transformers' own
`generate(do_sample=False)` tokens. The refusals (multi-stage schemes, adaptive steps,
Volterra rules, non-causal models) are named.
"""

import copy
import dataclasses
import re
from unittest import mock

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import spread_hf_weights
from hypothesis import given, settings
from hypothesis import strategies as st

import itde
from itde_solvers import RK4, Strang

VOCAB = 40
COMMON = dict(vocab_size=VOCAB, pad_token_id=1, bos_token_id=2, eos_token_id=3)
MAX = 64  # the position limit of every tiny model


def _build(family):
    if family == "gpt2":
        config = tf.GPT2Config(n_embd=8, n_layer=2, n_head=2, n_inner=12, n_positions=MAX,
                               **COMMON)  # fmt: skip
        cls = tf.GPT2LMHeadModel
    elif family == "llama":  # grouped-query attention, RoPE, head_dim != width / heads
        config = tf.LlamaConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=6, intermediate_size=12, max_position_embeddings=MAX, **COMMON,
        )  # fmt: skip
        cls = tf.LlamaForCausalLM
    elif family == "mistral":  # a window of 4 tokens, much shorter than the sequences
        config = tf.MistralConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            intermediate_size=12, sliding_window=4, max_position_embeddings=MAX, **COMMON,
        )  # fmt: skip
        cls = tf.MistralForCausalLM
    else:  # parallel attention and feed-forward, partial rotary
        config = tf.GPTNeoXConfig(
            hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=20,
            rotary_pct=0.5, max_position_embeddings=MAX, use_parallel_residual=True, **COMMON,
        )  # fmt: skip
        cls = tf.GPTNeoXForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = spread_hf_weights(cls(config)).double().eval()
    lm = itde.from_hf(model)
    return model, lm, itde.split_layers(lm.base.equation)


FAMILIES = ("gpt2", "llama", "mistral", "neox")


class _Models(dict):
    """family -> (transformers model, converted model, its layers), each built on first use
    (the default tier uses GPT-2 and Llama only)."""

    def __missing__(self, family):
        assert family in FAMILIES, family
        self[family] = _build(family)
        return self[family]


@pytest.fixture(scope="module")
def models():
    return _Models()


# one compilation per model structure and window length
LOGITS = jax.jit(lambda lm, ids: lm.logits(ids))


@eqx.filter_jit
def _prefill(lm, layers, window, filled):
    eq = lm.base.equation
    u, cache = itde.prefill(eq, layers, lm.base.embed(window), filled)
    return lm.project(eq.output(u)), cache


@eqx.filter_jit
def _step(lm, layers, window, cache):
    """One token decoded against the cache: the token at position `cache.length`."""
    u = jax.lax.dynamic_slice_in_dim(lm.base.embed(window), cache.length, 1)
    eq = lm.base.equation
    h, cache = itde.decode(eq, layers, u, cache)
    return lm.project(eq.output(h)[0]), cache


def _check_cached_equals_uncached(lm, layers, ids, prompt_len, max_length):
    window = np.zeros((max_length,), np.int32)
    window[: len(ids)] = ids
    window = jnp.asarray(window)
    pre, cache = _prefill(lm, layers, window, jnp.asarray(prompt_len, jnp.int32))
    dec = []
    for _ in range(len(ids) - prompt_len):
        row, cache = _step(lm, layers, window, cache)
        dec.append(np.asarray(row))
    ref = np.asarray(LOGITS(lm, jnp.asarray(ids)))
    assert int(cache.length) == len(ids)
    # the prefill's rows of the prompt, then each decoded token's row
    np.testing.assert_allclose(np.asarray(pre)[:prompt_len], ref[:prompt_len], rtol=0,
                               atol=1e-12)  # fmt: skip
    if dec:
        np.testing.assert_allclose(np.stack(dec), ref[prompt_len:], rtol=0, atol=1e-12)


def test_layers_split_on_the_host_are_the_slices_and_compile_nothing(models):
    """On the CPU backend `split_layers` copies each layer's controls in NumPy: no XLA
    program, and each leaf is exactly the traced split's (a program slicing the stack)."""
    eq = models["llama"][1].base.equation
    with itde.count_compilations() as c:
        host = itde.split_layers(eq)
    assert c.count == 0 and len(host) == eq.n_layers
    traced = jax.jit(itde.split_layers)(eq)
    for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(traced), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert [float(x.controls.t0) for x in host] == [float(x.controls.t0) for x in traced]


# GPT-2 and Llama (GQA, RoPE) in the default tier; Mistral's window and NeoX's parallel
# block in the slow one (the default tier's budget)
@pytest.mark.parametrize(
    "family", [f if f in ("gpt2", "llama") else pytest.param(f, marks=pytest.mark.slow)
               for f in FAMILIES],
)  # fmt: skip
def test_cached_logits_equal_uncached_float64(models, family):
    _, lm, layers = models[family]
    ids = np.random.RandomState(1).randint(4, VOCAB, size=13).astype(np.int32)
    _check_cached_equals_uncached(lm, layers, ids, prompt_len=5, max_length=16)


@pytest.mark.parametrize(
    "family", ["gpt2", "llama", pytest.param("mistral", marks=pytest.mark.slow),
               pytest.param("neox", marks=pytest.mark.slow)],
)  # fmt: skip
def test_cached_greedy_generation_is_transformers(models, family):
    model, lm, _ = models[family]
    prompt = np.random.RandomState(2).randint(4, VOCAB, size=5).astype(np.int32)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(torch.as_tensor(prompt[None]).long(), do_sample=False,
                             max_new_tokens=11, pad_token_id=1)[0].numpy()  # fmt: skip
    got = lm.generate(prompt, 11, cache=True, max_length=16, chunk=4, eos_token_id=3)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.slow
def test_sampling_with_cache_draws_the_uncached_tokens(models):
    _, lm, _ = models["llama"]
    prompt = np.array([5, 9, 7], np.int32)
    kw = dict(key=jax.random.key(3), temperature=0.9, top_k=10, top_p=0.9, max_length=16)
    np.testing.assert_array_equal(
        lm.generate(prompt, 12, cache=True, **kw), lm.generate(prompt, 12, cache=False, **kw)
    )


def test_one_prefill_and_one_decode_program_per_bucket(models):
    """Prompts of three lengths, with and without `max_length`, in one window bucket: the
    prefill and the decode loop are compiled once each (then held by `itde.programs`)."""
    _, lm, _ = models["gpt2"]
    before = itde.programs.compiled
    for prompt, n, most in (([5, 6], 3, 20), ([7, 8, 9, 10, 11], 6, None), ([4], 9, 15)):
        lm.generate(np.array(prompt, np.int32), n, max_length=most, chunk=4)  # cache: default
    assert itde.programs.compiled - before <= 2


@pytest.mark.slow
@settings(max_examples=6, deadline=None)
@given(prompt_len=st.integers(1, 51), extra=st.integers(0, 4),
       max_length=st.sampled_from([56, MAX]))  # fmt: skip
def test_cached_equals_uncached_over_lengths(models, prompt_len, extra, max_length):
    """Prompt lengths (odd ones included) and window lengths: the cache's masks read the
    filled positions only, whatever the filler after them (Mistral: the sliding window
    of 4 tokens slides along the cache)."""
    _, lm, layers = models["mistral"]
    n = prompt_len + extra
    ids = np.random.RandomState(n).randint(4, VOCAB, size=n).astype(np.int32)
    _check_cached_equals_uncached(lm, layers, ids, prompt_len, max_length)


# ------------------------------------------------------------------ bfloat16
@pytest.fixture(scope="module")
def llama_bf16(models):
    """The tiny Llama in bfloat16 (transformers' copy and its conversion), with the
    float64 transformers model it was cast from."""
    model, _, _ = models["llama"]
    half = copy.deepcopy(model).to(torch.bfloat16)
    lm = itde.from_hf(half)
    dtypes = {a.dtype for a in jax.tree.leaves(eqx.filter(lm, eqx.is_array))}
    assert dtypes == {jnp.dtype("bfloat16")}
    return model, half, lm, itde.split_layers(lm.base.equation)


@eqx.filter_jit
def _solve_states(eq, u0):
    return itde.solve(eq, u0).ys[-1]


@eqx.filter_jit
def _prefill_states(eq, layers, u0, length):
    return itde.prefill(eq, layers, u0, length)


@eqx.filter_jit
def _decode_states(eq, layers, u, cache):
    return itde.decode(eq, layers, u, cache)


def test_bfloat16_cache_computes_the_solve_in_its_precision(llama_bf16):
    """A bfloat16 model: `itde.solve` carries the state in float32 (matrix products in
    bfloat16, accumulated in float32); the prefill, a prompt decoded as one chunk into an
    empty cache, and every decode step carry it so too (the keys and values stored in it)
    and give the solve's final states, in its dtype, to float32 round-off (the decode
    step's sums run in another order). The cache used to carry the state in bfloat16:
    states 0.2-0.3 apart, and the greedy tokens of cache=True and cache=False differed."""
    _, _, lm, layers = llama_bf16
    eq = lm.base.equation
    ids = np.random.RandomState(1).randint(4, VOCAB, size=13).astype(np.int32)
    window = np.zeros((16,), np.int32)
    window[: len(ids)] = ids
    u0 = lm.base.embed(jnp.asarray(window))
    assert u0.dtype == jnp.bfloat16
    ref = np.asarray(_solve_states(eq, u0))
    assert ref.dtype == np.float32
    scale = np.abs(ref[: len(ids)]).max()
    # the prompt solved at once (`prefill`) and as a chunk against an empty cache (how the
    # engine solves it), then token by token
    empty = itde.empty_cache(eq, layers, 16, u0.dtype)
    for u, cache in (_prefill_states(eq, layers, u0, 5), _decode_states(eq, layers, u0[:5], empty)):
        assert u.dtype == cache.keys[0].dtype == cache.values[0].dtype == ref.dtype
        rows = [np.asarray(u)[:5]]
        for i in range(5, len(ids)):
            h, cache = _decode_states(eq, layers, u0[i : i + 1], cache)
            assert h.dtype == ref.dtype
            rows.append(np.asarray(h))
        np.testing.assert_allclose(np.concatenate(rows), ref[: len(ids)], rtol=0,
                                   atol=1e-6 * scale)  # fmt: skip


@pytest.mark.slow  # ~25 s: the bfloat16 generation programs, with the cache and without
def test_bfloat16_greedy_generation_cached_is_uncached_and_transformers(llama_bf16):
    """Greedy generation of a bfloat16 Llama: the same tokens with the cache and without,
    on six prompts (one differed); and transformers' bfloat16 tokens on the prompts where
    transformers agrees with itself (its cached and uncached bfloat16 runs and its float64
    run give the same tokens: tokens bfloat16's rounding does not decide there; itde
    rounds otherwise, its state in float32 where transformers' is bfloat16)."""
    model64, half, lm, _ = llama_bf16
    kw = dict(do_sample=False, max_new_tokens=11, pad_token_id=1)
    compared = 0
    for seed in range(6):
        prompt = np.random.RandomState(seed).randint(4, VOCAB, size=5).astype(np.int32)
        cached = lm.generate(prompt, 11, cache=True, max_length=16, chunk=4, eos_token_id=3)
        plain = lm.generate(prompt, 11, cache=False, max_length=16, chunk=4, eos_token_id=3)
        np.testing.assert_array_equal(cached, plain, err_msg=f"prompt {seed}")
        ids = torch.as_tensor(prompt[None]).long()
        with torch.no_grad():
            runs = [half.generate(ids, use_cache=c, **kw)[0].tolist() for c in (True, False)]
            with itde.interop.hf_float64():
                runs.append(model64.generate(ids, **kw)[0].tolist())
        if runs[0] == runs[1] == runs[2]:
            assert cached.tolist() == runs[0], seed
            compared += 1
    assert compared >= 4


# ------------------------------------------------------------------ refusals
def test_rk4_and_adaptive_steps_are_refused_by_name(models):
    _, lm, _ = models["gpt2"]
    eq = lm.base.equation
    with pytest.raises(itde.NotCacheableError, match=r"`solver`=Strang: .*RK4's stages 2 "
                       r"and 3 share one\), so the keys cannot be indexed"):  # fmt: skip
        itde.check_cacheable(eq, 16, solver=Strang())
    with pytest.raises(itde.NotCacheableError, match=r"`solver`=RK4 on per-layer controls"):
        itde.check_cacheable(eq, 16, solver=RK4(), dt0=1.0)
    with pytest.raises(itde.NotCacheableError, match=r"`stepsize_controller`=PIDController: "
                       r"an adaptive controller chooses the depth steps from the error of the "
                       r"whole sequence"):  # fmt: skip
        itde.check_cacheable(
            eq, 16, stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-3)
        )
    with pytest.raises(itde.NotCacheableError, match=r"`dt0`=0.5: .*one Lie step per layer"):
        itde.check_cacheable(eq, 16, dt0=0.5)
    assert itde.check_cacheable(eq, 16) is None


def _native(tokens_rule, controls="piecewise"):
    eq = itde.TransformerIDE.init(
        jax.random.key(0), n_features=8, n_heads=2, n_layers=2, causal=True,
        block="pre_norm", grid=itde.Grid(tokens_rule, itde.Midpoint(), 8),
    )  # fmt: skip
    if controls != "piecewise":
        eq = eqx.tree_at(
            lambda e: e.controls,
            eq,
            itde.LegendreControls.from_layers(eq, 2, block=eq.block),
        )
    return eq


@pytest.fixture(scope="module")
def continuous():
    """A native pre-norm causal model with smooth (Legendre) controls, float64."""
    return _native(itde.Midpoint(), "legendre")


@eqx.filter_jit
def _rk_prefill(eq, u0, length):
    return itde.prefill(eq, None, u0, length, solver=RK4(), dt0=1.0)


@eqx.filter_jit
def _rk_decode(eq, u0, cache):
    u = jax.lax.dynamic_slice_in_dim(u0, cache.length, 1)
    return itde.decode(eq, None, u, cache, solver=RK4(), dt0=1.0)


def test_continuous_rk4_cached_equals_the_uncached_diffrax_solve(continuous):
    """RK4 at dt0 = 0.5 on smooth controls (4 steps x 4 stages of cached keys): the prefill
    and every decoded token equal `itde.solve(eq, u0, solver=RK4(), dt0=1.0)` (diffrax's
    own Runge-Kutta loop over the whole sequence) to 1e-12."""
    eq = continuous
    itde.check_cacheable(eq, 12, solver=RK4(), dt0=1.0)
    assert itde.n_evaluations(eq, RK4(), 1.0) == 8
    u0 = jax.random.normal(jax.random.key(5), (12, 8), jnp.float64)
    ref = np.asarray(itde.solve(eq, u0, solver=RK4(), dt0=1.0).ys[-1])
    u, cache = _rk_prefill(eq, u0, 7)
    np.testing.assert_allclose(np.asarray(u)[:7], ref[:7], rtol=0, atol=1e-12)
    for p in range(7, 12):
        h, cache = _rk_decode(eq, u0, cache)
        np.testing.assert_allclose(np.asarray(h)[0], ref[p], rtol=0, atol=1e-12)
    # the cache is what makes it right: a decode that reads no earlier key differs
    blank = eqx.tree_at(lambda c: c.keys, cache, tuple(k * 0 for k in cache.keys))
    blank = eqx.tree_at(lambda c: c.length, blank, jnp.asarray(11, jnp.int32))
    h, _ = _rk_decode(eq, u0, blank)
    assert np.max(np.abs(np.asarray(h)[0] - ref[11])) > 1e-6


def test_volterra_rules_and_continuous_controls_are_refused_by_name():
    with pytest.raises(itde.NotCacheableError, match=r"is not the unit grid: its nodes and "
                       r"Volterra weights for the earlier tokens change with the number of "
                       r"tokens N"):  # fmt: skip
        itde.check_cacheable(_native(itde.Trapezoid()), 16)
    assert itde.check_cacheable(_native(itde.Midpoint()), 16) is None
    with pytest.raises(itde.NotCacheableError, match=r"controls of type LegendreControls are "
                       r"smooth in depth"):  # fmt: skip
        itde.check_cacheable(_native(itde.Midpoint(), "legendre"), 16)
    with pytest.raises(itde.NotCacheableError, match=r"`solver`=RK4 needs a fixed step `dt0`"):
        itde.check_cacheable(_native(itde.Midpoint(), "legendre"), 16, solver=RK4())


def test_non_causal_model_is_refused_and_cache_true_raises(models):
    _, lm, _ = models["gpt2"]
    eq = dataclasses.replace(lm.base.equation, causal=False)
    with pytest.raises(itde.NotCacheableError, match=r"the model is not causal"):
        itde.check_cacheable(eq, 16)
    with pytest.raises(ValueError, match=r"`cache`='yes' must be None"):
        lm.generate(np.array([5], np.int32), 2, cache="yes")
    grid = itde.Grid(itde.Trapezoid(), itde.Midpoint(), lm.base.equation.n_features)
    volterra = eqx.tree_at(lambda m: m.base.equation.grid, lm, grid)
    with pytest.raises(itde.NotCacheableError, match=r"Trapezoid.* is not the unit grid"):
        volterra.generate(np.array([5], np.int32), 2, cache=True)


@pytest.mark.parametrize("value", [0, 1, 0.0, "yes"])
def test_cache_takes_none_or_a_bool_only(models, value):
    """`cache` is None (the cache where possible), True or False: 0 and 1 are refused by
    name (`0 in (None, True, False)` holds, and `cache=0` used the cache), in `generate`
    and in `itde.train.sample_stream`; NumPy bools are bools (`np.True_` on a model the
    cache refuses raises why)."""
    _, lm, _ = models["gpt2"]
    said = rf"`cache`={value!r} must be None \(the cache when the model is cacheable\), True"
    with pytest.raises(ValueError, match=said):
        lm.generate(np.array([5], np.int32), 2, cache=value)
    from itde.train import sample_stream

    model, itos = _charlm(block="post_norm", scheme="rk4", dt=0.5)
    with pytest.raises(ValueError, match=said):
        next(sample_stream(model, itos, "the", 3, cache=value))
    grid = itde.Grid(itde.Trapezoid(), itde.Midpoint(), lm.base.equation.n_features)
    volterra = eqx.tree_at(lambda m: m.base.equation.grid, lm, grid)
    with pytest.raises(itde.NotCacheableError, match=r"is not the unit grid"):
        volterra.generate(np.array([5], np.int32), 2, cache=np.True_)
    with mock.patch("itde.interop._hf_lm.generate_rows", return_value=iter(())) as rows:
        lm.generate(np.array([5], np.int32), 2, cache=np.False_)  # what the engine is told
    assert rows.call_args.kwargs["cache"] is False


# ------------------------------------------------------------------ itde sample
def _charlm(**model):
    from itde.train import TASKS, TrainExperiment, from_dict

    cfg = from_dict(TrainExperiment, {
        "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 8, **model},
        "task": {"name": "charlm", "context": 8},
    })  # fmt: skip
    task = TASKS["charlm"](cfg.task)
    return task.init_model(cfg.model, jax.random.key(3), dtype=jnp.float64), task.itos


@pytest.mark.slow
@pytest.mark.parametrize("model", [dict(block="pre_norm"),
                                   dict(block="pre_norm", scheme="rk4", dt=0.5)])  # fmt: skip
def test_itde_sample_with_cache_draws_the_uncached_text(model):
    """Pre-norm causal charlm models, float64, discrete and continuous (RK4 on smooth
    controls): the same text with and without the cache, greedy and sampled, past the
    point where the window (8 tokens) is full and slides."""
    from itde.train import _sample as sampler
    from itde.train import sample_stream

    model, itos = _charlm(**model)
    assert sampler.cacheable(model, 8)
    for kw in (dict(temperature=0.0), dict(temperature=0.9, top_k=5, seed=4)):
        cached = "".join(sample_stream(model, itos, "the", 13, chunk=5, cache=True, **kw))
        plain = "".join(sample_stream(model, itos, "the", 13, chunk=5, cache=False, **kw))
        assert cached == plain and len(cached) == 13


def test_itde_sample_falls_back_for_post_norm_rk4_and_refuses_cache_true():
    from itde.train import _sample as sampler
    from itde.train import sample_stream

    model, itos = _charlm(block="post_norm", scheme="rk4", dt=0.5)
    assert not sampler.cacheable(model, 8)
    with pytest.raises(itde.NotCacheableError, match=r"a post-norm equation lives on a "
                       r"constraint set"):  # fmt: skip
        next(sample_stream(model, itos, "the", 3, cache=True))


# ------------------------------------------------------------------ batched generation
PROMPTS = [[5, 9, 7, 11, 4], [6, 8], [12, 4, 4, 9, 5, 7, 13]]  # three lengths, no padding


@pytest.mark.parametrize("family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_batched_greedy_rows_are_the_single_prompt_generations(models, family):
    """Each row of `generate_batch` is `generate` of its prompt alone (its own positions
    and cache), with the cache and without; a row that draws the end token stops there
    while the others go on."""
    _, lm, _ = models[family]
    prompts = [np.array(p, np.int32) for p in PROMPTS]
    kw = dict(max_length=20, chunk=4)
    want = [lm.generate(p, 9, cache=True, **kw) for p in prompts]
    got = lm.generate_batch(prompts, 9, cache=True, **kw)
    assert [len(g) for g in got] == [len(p) + 9 for p in prompts]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    eos = int(want[1][len(prompts[1]) + 2])  # row 1's third drawn token
    ends = lm.generate_batch(prompts, 9, cache=False, eos_token_id=eos, **kw)
    for p, g in zip(prompts, ends, strict=True):
        np.testing.assert_array_equal(g, lm.generate(p, 9, cache=False, eos_token_id=eos, **kw))
    assert ends[1][-1] == eos and len(ends[1]) <= len(prompts[1]) + 3  # ended early


def test_batched_sampling_row_b_uses_fold_in_key_b(models):
    """Sampled (temperature, top-k, top-p), row b is `generate(prompt_b, key=fold_in(key,
    b))`: rows with the same prompt draw different tokens."""
    _, lm, _ = models["llama"]
    key = jax.random.key(7)
    kw = dict(temperature=1.3, top_k=12, top_p=0.95, max_length=20, chunk=4)
    prompts = np.array([PROMPTS[0], PROMPTS[0]], np.int32)  # a 2-D array: two equal rows
    got = lm.generate_batch(prompts, 10, key=key, cache=True, **kw)
    for b in range(2):
        want = lm.generate(prompts[b], 10, key=jax.random.fold_in(key, b), cache=True, **kw)
        np.testing.assert_array_equal(got[b], want)
    assert not np.array_equal(got[0], got[1])


@pytest.mark.parametrize(
    ("prompts", "kw", "error", "said"),
    [([], {}, ValueError, "non-empty list"),
     (np.zeros((2, 3, 4), np.int32), {}, ValueError, "must be 2-D"),
     ([[5, 6], [7, VOCAB + 3]], {}, ValueError, "`prompts[1]`: `prompt_ids` holds ids outside"),
     ([[5, 6], []], {}, ValueError, "`prompts[1]`: `prompt_ids` must be one non-empty"),
     ([[5, 6], [7, 8, 9]], {"max_length": 4}, ValueError, "`prompts[1]`: `max_length`=4"),
     ([[5, 6]], {"top_k": 3}, ValueError, "without a `key`")],
)  # fmt: skip
def test_batched_generation_refuses_bad_prompts_by_row(models, prompts, kw, error, said):
    _, lm, _ = models["gpt2"]
    with pytest.raises(error, match=re.escape(said)):
        lm.generate_batch(prompts, 2, **kw)


def test_batched_generation_names_no_row_for_an_option_of_all_rows(models):
    """A bad option is the same for every row: its message names the option, not a row."""
    _, lm, _ = models["gpt2"]
    with pytest.raises(ValueError) as e:
        lm.generate_batch([[5, 6], [7, 8, 9]], 2, temperature=-1.0)
    assert str(e.value).startswith("`temperature`=-1.0 must be a finite number >= 0")


def test_decode_refuses_rows_past_the_end_of_the_cache(models):
    """`decode` of rows that do not fit after the filled positions is an error naming the
    sizes, eagerly (a ValueError before any work) and under `jax.jit` (a runtime error),
    never a write past the end (XLA would clamp the update and return finite numbers)."""
    _, lm, layers = models["llama"]
    eq = lm.base.equation
    cache = itde.empty_cache(eq, layers, 3, jnp.float64)
    u = lm.base.embed(jnp.asarray([1, 2, 3, 4]))
    _, cache = itde.decode(eq, layers, u[:2], cache)  # 2 of 3 positions
    with pytest.raises(ValueError, match=r"`u` has 2 rows.*`cache.max_length`=3.*`cache.length`=2"):
        itde.decode(eq, layers, u[2:4], cache)
    step = eqx.filter_jit(lambda u, cache: itde.decode(eq, layers, u, cache))
    _, full = step(u[2:3], cache)  # the last position fits
    assert int(full.length) == 3
    with pytest.raises(eqx.EquinoxRuntimeError, match=r"do not fit the cache"):
        jax.block_until_ready(step(u[3:4], full))
