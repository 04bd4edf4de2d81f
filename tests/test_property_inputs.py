"""Right at every input users bring: every sequence length, padding, batch, width and dtype.

Two kinds of tests.

- **Pure decisions at every length.** What a model computes at $N$ tokens is decided at
  trace time from $N$: whether the token grid is the unit grid (the discrete Transformer's
  masked sum) or needs Volterra weights, whether the token weights are uniform, which keys
  a sliding window admits, which key blocks the blocked core visits, T5's buckets, ALiBi's
  slopes. Each is checked at every $N$ from 1 to 4096 against a reference written here
  from the mathematics (closed forms, integer arithmetic, Hugging Face's own bucket map),
  in NumPy with no compilation per $N$: seconds in all. The unit grid's decision once
  compared computed weights $N \\cdot (1/N)$ with 1, which fails in float64 at
  $N = 49, 98, 103, \\dots$, and every converted causal model computed another attention
  there.
- **End to end, drawn by Hypothesis.** Sequence lengths (1 to 300), padding patterns
  (none, left, right, all but one token), batch sizes, head sizes and dtypes; the
  converted families (GPT-2, Llama with grouped-query attention and RoPE, BERT as an
  encoder and as a causal decoder, Mistral, Qwen2) against `transformers` itself (float64
  inside `itde.interop.hf_float64()`, float32 unpatched), and native causal and
  bidirectional models (`itde.from_torch` of `nn.TransformerEncoder`, pre- and post-norm)
  against PyTorch. Every distinct length is an XLA compile, so the default tier runs one or
  two explicit examples per family (from one model per family built once for the module),
  the lengths 49, 98 and 103 among them (`@example`); the slow tier draws the profile's
  count of inputs per family (`*_drawn`) and sweeps every length from 1 to 300 for GPT-2,
  Llama and the BERT decoder.
"""

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from helpers import spread_hf_weights
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st

import itde
from itde._internal import key_block_plan


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The torch references here compute on tiny tensors: one torch thread (on a loaded
    2-core machine two threads synchronise on every small op, many times slower), the
    thread count restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


N_MAX = 4096  # the pure decisions are checked at every N from 1 to N_MAX
EVERY_N = range(1, N_MAX + 1)
# Each check builds the library's objects at N (equinox modules, a band of N entries), some
# milliseconds per N and rule: the default tier checks every N to 512 and, above it, every
# length where N * (1/N) != 1 in float64 (505 of them to 4096, the old failure's lengths),
# every 61st N and N_MAX; `-m slow` checks every N to N_MAX.
SAMPLE_N = sorted({*range(1, 513), *(n for n in EVERY_N if n * (1.0 / n) != 1.0),
                   *range(513, N_MAX + 1, 61), N_MAX})  # fmt: skip
SWEEPS = [pytest.param(SAMPLE_N, id="sample"),
          pytest.param(EVERY_N, id="every", marks=pytest.mark.slow)]  # fmt: skip


# ================================================================ pure decisions, every N
def _weights_reference(name: str, n: int, length: fractions.Fraction):
    """(uniform, unit) of a rule's `n` weights on an interval of `length`, from the rule's
    formula in exact rational arithmetic (Gauss-Legendre: from NumPy's nodes for n <= 40,
    where the end weight is visibly smaller than the middle one for n >= 3)."""
    if name in ("midpoint", "periodic-trapezoid"):  # every weight L / N
        return True, length / n == 1
    if name == "trapezoid":  # h/2, h, ..., h, h/2 with h = L / (N - 1)
        h = length / (n - 1)
        weights = {h / 2} if n == 2 else {h / 2, h}
    elif name == "simpson":  # (h/3) (1, 4, 2, ..., 4, 1)
        h = length / (n - 1)
        weights = {h / 3, 4 * h / 3} | ({2 * h / 3} if n > 3 else set())
    else:  # gauss-legendre
        if n > 40:
            return False, False
        w = np.polynomial.legendre.leggauss(n)[1]
        uniform = bool(np.max(w) - np.min(w) <= 1e-12 * np.max(w))
        return uniform, uniform and length == n
    return len(weights) == 1, weights == {1}


RULE_CLASSES = [itde.Midpoint, itde.Trapezoid, itde.Simpson, itde.GaussLegendre,
                itde.PeriodicTrapezoid]  # fmt: skip


def _lengths(cls, top):
    return [n for n in range(cls.min_nodes, top + 1) if not (cls is itde.Simpson and n % 2 == 0)]


def _check_rule(rule, n, interval):
    """`uniform_weights`, `is_unit` and `causal_weights` of `rule` at `n` against the
    reference; on the unit grid also the exact weights and nodes (to 256, at the lengths
    where N * (1/N) != 1 and at every 97th). Returns `is_unit`."""
    cls = type(rule)
    length = fractions.Fraction(n if interval is None else interval[1] - interval[0])
    uniform, unit = _weights_reference(cls.name, n, length)
    assert rule.uniform_weights(n) == uniform, n
    assert rule.is_unit(n) == unit, n
    if cls is itde.GaussLegendre and not unit and n > 16:
        return unit  # its Volterra weights cost O(n^3) to build: checked to 16
    causal = rule.causal_weights(n)
    assert (causal is None) == unit, n
    if unit and (n <= 256 or n * (1.0 / n) != 1.0 or n % 97 == 0):  # nodes: a sample
        x, w = rule.nodes_weights(n)
        assert np.array_equal(w, np.ones(n)), n  # exactly 1, not N * (1/N)
        a = 0.0 if interval is None else interval[0]
        offset = {itde.Midpoint: 0.5, itde.PeriodicTrapezoid: 0.0}.get(cls)
        if offset is not None:  # whole or half numbers, exactly
            assert np.array_equal(x, a + np.arange(n) + offset), n
    elif not unit and cls is itde.Midpoint:  # Volterra weights on cells of width L / N
        assert isinstance(causal, itde.MidpointVolterra) and causal.n == n
        assert causal.h == float(length) / n, n
    return unit


@pytest.mark.parametrize("ns", SWEEPS)
@pytest.mark.parametrize("cls", RULE_CLASSES, ids=lambda c: c.name)
def test_unit_grid_decision_at_every_length(cls, ns):
    """On `interval=None` ([0, N]), at every N to 4096: the unit grid (`causal_weights`
    None: the Transformer's masked sum; weights exactly 1) is where the rule's weights are
    all equal, whatever the floating-point value of N * (1/N): every N for the midpoint and
    periodic trapezoid rules, N <= 2 for trapezoid and Gauss-Legendre, never for Simpson."""
    rule = cls()
    lengths = sorted(set(_lengths(cls, N_MAX)) & set(ns))
    units = [n for n in lengths if _check_rule(rule, n, None)]
    expected = {"midpoint": len(lengths), "periodic-trapezoid": len(lengths), "trapezoid": 1,
                "gauss-legendre": 2, "simpson": 0}  # fmt: skip
    assert len(units) == expected[cls.name]


@pytest.mark.parametrize("interval", [(0.0, 1.0), (0.0, 49.0), (-2.5, 1.5), (3.0, 5.0)])
def test_unit_grid_decision_on_an_interval(interval):
    """On a given interval [a, b] the grid is the unit grid only at N = b - a (every weight
    (b - a)/N = 1) for the rules with equal weights: every rule at N to 256."""
    for cls in RULE_CLASSES:
        rule = cls(interval=interval)
        units = [n for n in _lengths(cls, 256) if _check_rule(rule, n, interval)]
        length = interval[1] - interval[0]
        uniform_at = {"midpoint": True, "periodic-trapezoid": True, "simpson": False,
                      "trapezoid": length == 2, "gauss-legendre": length in (1, 2)}  # fmt: skip
        assert units == ([int(length)] if uniform_at[cls.name] else []), cls


@pytest.mark.parametrize("ns", SWEEPS)
def test_the_lengths_where_n_times_one_over_n_is_not_one_are_the_unit_grid(ns):
    """The lengths of the old failure are real (N * (1/N) != 1 in float64 there), and at
    every N to 4096 the unit grid of every converted model (`Grid.unit`) has unit token
    weights, no token log-weights (uniform) and no Volterra weights (the masked sum)."""
    bad = [n for n in EVERY_N if n * (1.0 / n) != 1.0]
    assert bad[:3] == [49, 98, 103] and len(bad) > 100
    grid = itde.Grid.unit(8)
    for n in ns:
        assert grid.causal_weights(n) is None, n
        assert grid.token_log_weights(n) is None, n
    for n in bad:
        assert np.array_equal(grid.token_weights(n), np.ones(n)), n


def test_token_log_weights_where_the_weights_differ():
    """Where the weights differ, `token_log_weights` is their logarithm (trapezoid on
    [0, 1]: h/2 at both ends, h inside), at a sample of N to 4096 (a JAX array each)."""
    trap = itde.Trapezoid(interval=(0.0, 1.0))
    assert trap.token_log_weights(2) is None  # (1/2, 1/2): uniform
    for n in [*range(3, 64), *range(64, N_MAX + 1, 61), N_MAX]:
        got = trap.token_log_weights(n, jnp.float64)
        h = 1.0 / (n - 1)
        ref = np.full(n, math.log(h))
        ref[[0, -1]] = math.log(h / 2)
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-14, atol=1e-14)


def test_tensor_grid_uniform_weights():
    """A tensor grid's weights are uniform exactly when both rules' are."""
    rules = [itde.Midpoint(interval=(0.0, 1.0)), itde.Trapezoid(interval=(0.0, 2.0)),
             itde.GaussLegendre(interval=(0.0, 1.0))]  # fmt: skip
    counts = (2, 3, 7, 49)
    for r1 in rules:
        for r2 in rules:
            for n1 in counts:
                for n2 in counts:
                    g = itde.TensorGrid2D(r1, r2, n1, n2)
                    w = np.outer(r1.nodes_weights(n1)[1], r2.nodes_weights(n2)[1])
                    ref = bool(np.ptp(w) <= 1e-12 * np.max(w))
                    assert g.uniform_weights() == ref, (r1, r2, n1, n2)
                    assert (g.token_log_weights() is None) == ref


def test_feature_weights_are_skipped_exactly_on_the_unit_grid():
    """The equation multiplies by the feature weights unless the feature rule is the unit
    grid (then `feature_weights()` is None): at widths 8 and 49 (where 49 * (1/49) != 1),
    for rules whose weights are all 1, all equal but not 1, or unequal."""
    for d in (8, 49):
        rules = [itde.Midpoint(), itde.PeriodicTrapezoid(), itde.Midpoint(interval=(0.0, d)),
                 itde.Midpoint(interval=(0.0, 1.0)), itde.PeriodicTrapezoid(interval=(2.0, 3.0)),
                 itde.Trapezoid(interval=(0.0, 1.0)), itde.GaussLegendre()]  # fmt: skip
        for rule in rules:
            grid = itde.Grid(itde.Midpoint(), rule, d)
            m = itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=d,
                                         n_heads=1, n_hidden=4, grid=grid)  # fmt: skip
            length = d if rule.interval is None else rule.interval[1] - rule.interval[0]
            unit = rule.name in ("midpoint", "periodic-trapezoid") and length == d
            got = m.feature_weights()
            if unit:
                assert got is None, (d, rule)
            else:  # the rule's weights themselves, whatever they are
                ref = {"midpoint": np.full(d, length / d),
                       "periodic-trapezoid": np.full(d, length / d)}.get(rule.name)  # fmt: skip
                if rule.name == "trapezoid":
                    ref = np.full(d, 1 / (d - 1))
                    ref[[0, -1]] /= 2
                if rule.name == "gauss-legendre":
                    ref = d / 2 * np.polynomial.legendre.leggauss(d)[1]
                np.testing.assert_allclose(got, ref, rtol=1e-13, err_msg=str((d, rule)))


def _band_reference(n: int, length: float):
    """The keys each query reads on the unit grid (nodes k + 1/2): |k - p| < L, in
    integers: |k - p| <= ceil(L) - 1."""
    reach = math.ceil(length) - 1
    k = np.arange(n)
    return np.maximum(0, k - reach), np.minimum(n - 1, k + reach), reach


WINDOWS = (1.0, 4.0, 4.5, 7.25)
# a band is a tuple of N Python ints, so checking every N costs O(N^2) in all: every N to
# 1024 (L = 4, Mistral's form) or 256 (the other lengths), then every 37th N to 4096
# (`-m slow`; the default tier: every N to 256 for L = 4 as for the others, then every
# 37th N from 1061)
BAND_NS = {4.0: [*range(1, 1025), *range(1061, N_MAX + 1, 37)]}
SAMPLE_BAND_NS = {4.0: [*range(1, 257), *range(1061, N_MAX + 1, 37)]}
BAND_SWEEPS = [pytest.param(SAMPLE_BAND_NS, id="sample"),
               pytest.param(BAND_NS, id="every", marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize("band_ns", BAND_SWEEPS)
def test_sliding_window_bands_at_every_length(band_ns):
    """`SlidingWindow(L).on_nodes` on the unit grid's nodes, and the band's `offsets`."""
    for length in WINDOWS:
        window = itde.SlidingWindow(length)
        for n in band_ns.get(length, range(1, 257)):
            band = window.on_nodes(itde.Midpoint().nodes_weights(n)[0])
            first, last, reach = _band_reference(n, length)
            assert np.array_equal(band.first, first) and np.array_equal(band.last, last), n
            assert band.offsets() == (min(reach, n - 1), min(reach, n - 1)), n


def _blocks_reference(n, bs, causal, first=None, last=None):
    """For each query block, the first and last key block with an admitted pair: the
    union over the block's queries q of [first[q], last[q]] (last[q] cut at q if causal),
    by NumPy reductions over the queries (no monotonicity assumed)."""
    k = np.arange(n)
    first = np.zeros(n, np.int64) if first is None else np.asarray(first)
    last = np.full(n, n - 1) if last is None else np.asarray(last)
    if causal:
        last = np.minimum(last, k)
    starts = np.arange(0, n, bs)
    return np.minimum.reduceat(first, starts) // bs, np.maximum.reduceat(last, starts) // bs


def _check_plan(n, bs, causal, window, first=None, last=None):
    lo, hi, start, span = key_block_plan(n, bs, causal, window)
    ref_lo, ref_hi = _blocks_reference(n, min(bs, n), causal, first, last)
    assert np.array_equal(lo, ref_lo) and np.array_equal(hi, ref_hi), (n, bs, causal)
    nb = -(-n // min(bs, n))
    assert span == int(np.max(ref_hi - ref_lo + 1)) and 1 <= span <= nb
    assert np.all(start >= 0) and np.all(start + span <= nb)
    assert np.all(start <= lo) and np.all(start + span - 1 >= hi)  # the run covers the need


@pytest.mark.parametrize("ns, band_ns", [
    pytest.param(SAMPLE_N, SAMPLE_BAND_NS, id="sample"),
    pytest.param(EVERY_N, BAND_NS, id="every", marks=pytest.mark.slow),
])  # fmt: skip
def test_key_block_plan_at_every_length(ns, band_ns):
    """The blocked core's plan (which key blocks each query block visits) at every N to
    4096, causal or not, for block sizes 16 and 64 (a block larger than N included) and 1
    (to 256); with a sliding window of length 4 and 7.25 at the lengths of the bands'
    test."""
    for n in ns:
        for bs in (1, 16, 64) if n <= 256 else (16, 64):
            for causal in (False, True):
                _check_plan(n, bs, causal, None)
    for length in (4.0, 7.25):
        for n in band_ns.get(length, range(1, 257)):
            first, last, _ = _band_reference(n, length)
            band = itde.TokenBand(tuple(first.tolist()), tuple(last.tolist()))
            for causal in (False, True):
                _check_plan(n, 16, causal, band, first, last)


@pytest.mark.parametrize(
    "n_buckets, max_distance, bidirectional",
    [(32, 128, True), (32, 128, False), (8, 6, True), (64, 256, False)],
)
def test_t5_buckets_at_every_distance(n_buckets, max_distance, bidirectional):
    """`t5_bucket` equals Hugging Face's `T5Attention._relative_position_bucket` at every
    relative position from -4096 to 4096 (every pair of a sequence of up to 4097 tokens)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = np.arange(-N_MAX, N_MAX + 1)
    theirs = T5Attention._relative_position_bucket(
        torch.as_tensor(rel), bidirectional=bidirectional, num_buckets=n_buckets,
        max_distance=max_distance,
    ).numpy()  # fmt: skip
    ours = itde.t5_bucket(jnp.asarray(rel, jnp.int32), bidirectional=bidirectional,
                          n_buckets=n_buckets, max_distance=max_distance)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(ours), theirs)


def _alibi_reference(n: int) -> np.ndarray:
    """Press et al.'s slopes as written in their code (and BLOOM's): the nearest lower
    power of two's geometric sequence, then every other slope of the next power."""
    closest = 2 ** int(math.floor(math.log2(n)))
    while closest * 2 <= n:  # guard the float log2 of the reference itself
        closest *= 2
    while closest > n:
        closest //= 2
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = base ** np.arange(1, closest + 1)
    if closest != n:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes = np.concatenate([slopes, extra ** np.arange(1, 2 * (n - closest), 2)])
    return slopes


def test_alibi_slopes_at_every_head_count():
    """`alibi_slopes(n)` at every head count to 1024 against the reference formula."""
    for n in range(1, 1025):
        np.testing.assert_allclose(itde.alibi_slopes(n), _alibi_reference(n), rtol=1e-13)


# ================================================================ end to end, drawn
VOCAB, PAD, MAX_N = 50, 1, 300
TOL = {"float64": 1e-10, "float32": 1e-4}  # relative to the largest output on real tokens
COMMON = dict(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=2, eos_token_id=3)
PADDINGS = ("none", "left", "right", "all_but_one")


def _hf_config(family: str, heads: int):
    """A tiny config of `family` with `heads` query heads (width 8; 16 for Qwen2)."""
    if family in ("gpt2",):
        return tf.GPT2Model, tf.GPT2Config(
            n_embd=8, n_layer=2, n_head=heads, n_inner=12, n_positions=MAX_N, **COMMON
        ), {}  # fmt: skip
    if family in ("bert", "bert_decoder"):
        return tf.BertModel, tf.BertConfig(
            hidden_size=8, num_hidden_layers=2, num_attention_heads=heads, intermediate_size=12,
            max_position_embeddings=MAX_N, hidden_act="gelu", is_decoder=family != "bert",
            **COMMON,
        ), {"add_pooling_layer": False}  # fmt: skip
    rope = dict(  # grouped-query attention (heads / 2 key-value heads), RoPE, head_dim 6
        hidden_size=8, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=6, intermediate_size=12,
        max_position_embeddings=MAX_N, **COMMON,
    )  # fmt: skip
    if family == "llama":
        return tf.LlamaModel, tf.LlamaConfig(attention_bias=True, **rope), {}
    if family == "mistral":  # a window of 16 tokens: it cuts at most lengths drawn
        return tf.MistralModel, tf.MistralConfig(sliding_window=16, **rope), {}
    if family == "qwen2":  # q/k/v biases
        rope.update(hidden_size=16, head_dim=None)
        rope.pop("head_dim")
        return tf.Qwen2Model, tf.Qwen2Config(**rope), {}
    raise AssertionError(family)


_MODELS: dict = {}


def _models(family: str, heads: int, dtype: str):
    """(Hugging Face model, converted model) of a family, head count and dtype, built once
    for the module (float64 a copy of the float32 model)."""
    key = (family, heads, dtype)
    if key not in _MODELS:
        cls, config, kwargs = _hf_config(family, heads)
        config._attn_implementation = "eager"
        torch.manual_seed(heads)
        model = spread_hf_weights(cls(config, **kwargs)).to(getattr(torch, dtype)).eval()
        _MODELS[key] = model, itde.from_hf(model)
    return _MODELS[key]


def _masks(n: int, rows) -> np.ndarray:
    """`[batch, n]` 0/1 masks from per-row patterns (kind, k): `none`; `left`/`right`:
    k padded tokens (at most n - 1) before or after the real ones; `all_but_one`: the one
    real token at position k."""
    masks = np.ones((len(rows), n), np.int64)
    for mask, (kind, k) in zip(masks, rows, strict=True):
        if kind == "left":
            mask[: min(k, n - 1)] = 0
        elif kind == "right":
            mask[n - min(k, n - 1) :] = 0
        elif kind == "all_but_one":
            mask[:] = 0
            mask[k % n] = 1
    return masks


@st.composite
def inputs(draw, max_batch=3, dtypes=("float64", "float32"), heads=(1, 2, 4)):
    """(n, masks, dtype, heads, seed): a length from 1 to 300, 1 to `max_batch` rows each
    with its own padding pattern, a dtype, a head count and a seed for the token ids."""
    n = draw(st.integers(1, MAX_N))
    row = st.tuples(st.sampled_from(PADDINGS), st.integers(1, MAX_N))
    rows = draw(st.lists(row, min_size=1, max_size=max_batch))
    dtype = draw(st.sampled_from(dtypes))
    return n, _masks(n, rows), dtype, draw(st.sampled_from(heads)), draw(st.integers(0, 99))


def _case(n, *rows, dtype="float64", heads=2, seed=0):
    """An explicit input for `@example`: length `n`, rows of (kind, k)."""
    return n, _masks(n, rows or [("none", 0)]), dtype, heads, seed


def _rel_error(ours, ref, masks):
    real = masks == 1
    return np.max(np.abs(ours[real] - ref[real])) / np.max(np.abs(ref[real]))


FORWARD = jax.jit(lambda m, ids, masks: m.batch(ids, masks))  # one solve for the batch


def _check_family(family, case):
    n, masks, dtype, heads, seed = case
    model, m = _models(family, heads, dtype)
    ids = np.random.RandomState(seed).randint(4, VOCAB, size=masks.shape)
    ours = np.asarray(FORWARD(m, jnp.asarray(ids), jnp.asarray(masks)))
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(masks))
    ref = ref.last_hidden_state.numpy()
    assert ours.shape == ref.shape and ours.dtype == np.dtype(dtype)
    err = _rel_error(ours, ref, masks)
    assert err <= TOL[dtype], (family, n, dtype, heads, err)


# Every distinct input (length, batch, dtype, head count) is a compile of the forward pass.
# The default tier runs each family's explicit examples only (`EXPLICIT`), which hold the
# lengths where N * (1/N) != 1 in float64 (49, 98, 103: the old unit-grid decision failed
# there) for every causal family, float32, every padding pattern and the largest head
# count; the slow twins (`*_drawn`) draw the profile's count of inputs besides the examples.
EXPLICIT = settings(phases=[Phase.explicit])


@EXPLICIT
@given(case=inputs())
@example(case=_case(49, ("none", 0), ("left", 5)))
@example(case=_case(98, ("right", 30), ("all_but_one", 50), dtype="float32", heads=4))
def test_gpt2_equals_transformers(case):
    _check_family("gpt2", case)


@pytest.mark.slow
@given(case=inputs())
@example(case=_case(49, ("none", 0), ("left", 5)))
@example(case=_case(98, ("right", 30), dtype="float32"))
@example(case=_case(103, ("all_but_one", 50), ("none", 0), heads=4))
def test_gpt2_equals_transformers_drawn(case):
    _check_family("gpt2", case)


@EXPLICIT
@given(case=inputs(heads=(2, 4)))
@example(case=_case(103, ("left", 11), ("none", 0), ("right", 2), heads=4))
def test_llama_equals_transformers(case):
    """Llama with grouped-query attention (heads / 2 key-value heads), RoPE and biases."""
    _check_family("llama", case)


@pytest.mark.slow
@given(case=inputs(heads=(2, 4)))
@example(case=_case(49, ("left", 11), heads=4))
@example(case=_case(103, ("none", 0), ("right", 2)))
def test_llama_equals_transformers_drawn(case):
    _check_family("llama", case)


@EXPLICIT
@given(case=inputs())
@example(case=_case(98, ("none", 0), ("left", 1)))
def test_bert_decoder_equals_transformers(case):
    """BERT as a causal decoder (`is_decoder=True`)."""
    _check_family("bert_decoder", case)


@pytest.mark.slow
@given(case=inputs())
@example(case=_case(98, ("none", 0), ("left", 1)))
def test_bert_decoder_equals_transformers_drawn(case):
    _check_family("bert_decoder", case)


@EXPLICIT
@given(case=inputs())
@example(case=_case(37, ("right", 5), ("none", 0), dtype="float32", heads=4))
def test_bert_encoder_equals_transformers(case):
    _check_family("bert", case)


@pytest.mark.slow
@given(case=inputs())
def test_bert_encoder_equals_transformers_drawn(case):
    _check_family("bert", case)


@EXPLICIT
@given(case=inputs(heads=(2, 4), dtypes=("float64",)))
@example(case=_case(49, ("right", 20), ("left", 7)))
def test_mistral_with_a_window_equals_transformers(case):
    """Mistral with a sliding window of 16 tokens (the band decided at every length)."""
    _check_family("mistral", case)


@pytest.mark.slow
@given(case=inputs(heads=(2, 4), dtypes=("float64",)))
@example(case=_case(49, ("right", 20), ("left", 7)))
def test_mistral_with_a_window_equals_transformers_drawn(case):
    _check_family("mistral", case)


@EXPLICIT
@given(case=inputs(heads=(2, 4), dtypes=("float64",)))
@example(case=_case(103, ("all_but_one", 0)))
def test_qwen2_equals_transformers(case):
    _check_family("qwen2", case)


@pytest.mark.slow
@given(case=inputs(heads=(2, 4), dtypes=("float64",)))
@example(case=_case(103, ("all_but_one", 0)))
def test_qwen2_equals_transformers_drawn(case):
    _check_family("qwen2", case)


# ---------------------------------------------------------------- native models
def _encoder(heads: int, pre: bool, gelu: bool, dtype: str, seed: int = 0):
    """A 2-layer `nn.TransformerEncoder` (width 8) with norms and biases moved away from
    their initialisation."""
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        8, heads, 12, dropout=0.0, activation="gelu" if gelu else "relu", layer_norm_eps=1e-5,
        batch_first=True, norm_first=pre, dtype=torch.float64,
    )  # fmt: skip
    enc = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc.to(getattr(torch, dtype)).eval()


def _numpy_encoder(enc, x, keep, causal, gelu):
    """The encoder computed in float64 NumPy from its parameters, one sequence and one head
    at a time: softmax over the admitted keys (real, and not later with `causal`; a padded
    query with none gets 0, as PyTorch would give NaN there); exact GELU (erf) or ReLU."""
    erf = np.vectorize(math.erf)
    p = lambda t: t.detach().numpy().astype(np.float64)  # noqa: E731
    out = []
    for u, real in zip(np.asarray(x, np.float64), keep, strict=True):
        n = u.shape[0]
        admit = real[None, :] & (np.tril(np.ones((n, n), bool)) if causal else True)
        for layer in enc.layers:
            att, heads = layer.self_attn, layer.self_attn.num_heads
            wq, wk, wv = np.split(p(att.in_proj_weight), 3)
            bq, bk, bv = np.split(p(att.in_proj_bias), 3)

            def attention(v, att=att, heads=heads, wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv):
                q, k, val = v @ wq.T + bq, v @ wk.T + bk, v @ wv.T + bv
                hd = q.shape[1] // heads
                o = np.zeros_like(q)
                for h in range(heads):
                    sl = slice(h * hd, (h + 1) * hd)
                    s = np.where(admit, q[:, sl] @ k[:, sl].T / math.sqrt(hd), -np.inf)
                    top = np.max(s, axis=1, keepdims=True)
                    e = np.where(admit, np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
                    total = e.sum(axis=1, keepdims=True)  # 0: a padded query with no key
                    o[:, sl] = (e / np.where(total > 0, total, 1)) @ val[:, sl]
                return o @ p(att.out_proj.weight).T + p(att.out_proj.bias)

            def ff(v, layer=layer):
                hid = v @ p(layer.linear1.weight).T + p(layer.linear1.bias)
                act = 0.5 * hid * (1 + erf(hid / math.sqrt(2))) if gelu else np.maximum(hid, 0)
                return act @ p(layer.linear2.weight).T + p(layer.linear2.bias)

            def norm(v, ln):
                c = v - v.mean(axis=1, keepdims=True)
                var = (c * c).mean(axis=1, keepdims=True)
                return c / np.sqrt(var + ln.eps) * p(ln.weight) + p(ln.bias)

            if layer.norm_first:
                u = u + attention(norm(u, layer.norm1))
                u = u + ff(norm(u, layer.norm2))
            else:
                u = norm(u + attention(u), layer.norm1)
                u = norm(u + ff(u), layer.norm2)
        out.append(u)
    return np.stack(out)


@EXPLICIT
@given(case=inputs(), causal=st.booleans(), pre=st.booleans(), gelu=st.booleans())
@example(case=_case(49, ("left", 3), ("none", 0)), causal=True, pre=False, gelu=False)
@example(
    case=_case(20, ("all_but_one", 7), ("right", 4), dtype="float32", heads=4),
    causal=False,
    pre=True,
    gelu=True,
)
def test_native_models_equal_a_numpy_loop(case, causal, pre, gelu):
    """`itde.from_torch` of a post- or pre-norm encoder, causal or bidirectional, on the
    unit grid (a native `TransformerIDE`) against the same network written out in NumPy."""
    _check_native(case, causal, pre, gelu)


@pytest.mark.slow
@given(case=inputs(), causal=st.booleans(), pre=st.booleans(), gelu=st.booleans())
@example(case=_case(49, ("left", 3), ("none", 0)), causal=True, pre=False, gelu=False)
def test_native_models_equal_a_numpy_loop_drawn(case, causal, pre, gelu):
    _check_native(case, causal, pre, gelu)


def _check_native(case, causal, pre, gelu):
    n, masks, dtype, heads, seed = case
    enc = _encoder(heads, pre, gelu, dtype)
    m = itde.from_torch(enc, causal=causal)
    x = np.random.RandomState(seed).standard_normal((len(masks), n, 8))
    keep = masks == 1
    ours = np.asarray(FORWARD(m, jnp.asarray(x, dtype), jnp.asarray(keep)))
    ref = _numpy_encoder(enc, x.astype(dtype), keep, causal, gelu)
    assert ours.dtype == np.dtype(dtype)
    err = _rel_error(ours, ref, masks)
    assert err <= TOL[dtype], (n, causal, pre, gelu, dtype, heads, err)


# ---------------------------------------------------------------- every length, slow
SWEEP_CHUNK = 50


def _sweep_rows(n):
    """Two rows at length n: no padding, and a padding that cycles with n (left, right,
    all but one token)."""
    kind = PADDINGS[1 + n % 3]
    return ("none", 0), (kind, {"left": n // 3, "right": n // 4}.get(kind, n // 2))


@pytest.mark.slow
@pytest.mark.parametrize("start", range(1, MAX_N + 1, SWEEP_CHUNK))
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert_decoder"])
def test_every_length_equals_transformers(family, start):
    """Every length from 1 to 300 (this test: 50 of them), float64, end to end against
    `transformers`: one compilation per length."""
    for n in range(start, min(start + SWEEP_CHUNK, MAX_N + 1)):
        _check_family(family, _case(n, *_sweep_rows(n), heads=4 if family == "llama" else 2))
