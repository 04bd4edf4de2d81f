"""Sliding-window attention: the attention kernel restricted to |x - x̃| < L (causal:
0 <= x - x̃ < L), a length on the token domain.

Against a direct NumPy sum that decides each pair from the node positions; the three
attention cores equal each other with the window composed with the causal restriction,
padding, non-unit quadrature weights and a score bias; the boundary convention is Hugging
Face's (its mask functions, and a tiny `MistralModel` with `sliding_window=3` converted by
hand, float32 and float64, padding none/right/left, eager and sdpa); the window is the
same interval on a refined grid; the blocked core evaluates only the key blocks that meet
the window, so its work grows linearly in the tokens.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from transformers import masking_utils

import itde
from itde import blocked_attention, dense_attention, fused_attention
from itde._internal import key_block_plan

CORES = {"dense": dense_attention, "blocked": blocked_attention, "fused": fused_attention}
ATOL = {"dense": 1e-12, "blocked": 1e-12, "fused": 1e-5}  # fused: float32 softmax on XLA
N = 23


def _nodes(kind, n=N):
    if kind == "unit":
        return np.arange(n) + 0.5
    return itde.GaussLegendre(interval=(0.0, 9.0)).nodes_weights(n)[0]  # not equispaced


def _inputs(n=N, heads=2, e=4, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (heads, n, e), jnp.float64) / math.sqrt(e)
    k = jax.random.normal(kk, (heads, n, e), jnp.float64)
    v = jax.random.normal(kv, (heads, n, e), jnp.float64)
    return q, k, v


def _reference(q, k, v, x, length, causal, lw=None, weights=None, bias=None):
    """Windowed attention by a direct NumPy loop: key p is read from query i when
    |x_i - x_p| < length (and x_p <= x_i if causal), with weight w_ip e^{lw_p}."""
    q, k, v = (np.asarray(a) for a in (q, k, v))
    h, n, _ = q.shape
    w = np.ones((n, n)) if weights is None else np.asarray(weights, np.float64)
    if lw is not None:
        w = w * np.exp(np.asarray(lw))[None, :]
    b = np.zeros((h, n, n)) if bias is None else np.broadcast_to(np.asarray(bias), (h, n, n))
    out = np.zeros_like(v)
    for m in range(h):
        for i in range(n):
            seen = np.array(
                [abs(x[i] - x[p]) < length and (x[p] <= x[i] or not causal) for p in range(n)]
            )
            keep = seen & (w[i] != 0)
            if not keep.any():
                continue
            s = q[m, i] @ k[m].T + b[m, i]
            e = np.where(keep, np.exp(s - s[keep].max()), 0.0) * w[i]
            out[m, i] = e @ v[m] / e.sum()
    return out


@pytest.mark.parametrize("core", list(CORES))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("grid", ["unit", "gauss-legendre"])
def test_cores_equal_the_direct_sum(core, causal, grid):
    """Each core with a window, token weights, padded keys (weight 0; a query whose window
    holds only those gets 0), per-query weights and a score bias equals the direct sum; on
    Gauss-Legendre nodes the band is not the same at every query (the fused core then takes
    it as a bias, not `local_window_size`)."""
    q, k, v = _inputs()
    x = _nodes(grid)
    length = 3.0 if grid == "unit" else 1.3
    band = itde.SlidingWindow(length).on_nodes(x)
    assert (band.offsets() is None) == (grid != "unit")
    rng = np.random.default_rng(1)
    lw = np.log(rng.uniform(0.5, 2.0, N))
    lw[:4] = -np.inf  # padded keys: on the unit grid the first queries read none
    weights = rng.uniform(0.2, 2.0, (N, N))
    bias = rng.normal(size=(2, N, N))
    got = jax.jit(lambda q, k, v, lw, weights, bias: CORES[core](
        q, k, v, window=band, causal=causal, block_size=4, token_log_weights=lw,
        query_weights=weights, score_bias=bias,
    ))(q, k, v, jnp.asarray(lw), jnp.asarray(weights), jnp.asarray(bias))  # fmt: skip
    ref = _reference(q, k, v, x, length, causal, lw, weights, bias)
    np.testing.assert_allclose(got, ref, rtol=0, atol=ATOL[core])
    # the window matters here: without it the sum is another one
    assert np.max(np.abs(_reference(q, k, v, x, 1e9, causal, lw, weights, bias) - ref)) > 0.1


@pytest.mark.parametrize("core", ["dense", "blocked", "fused"])
def test_fused_and_blocked_take_the_window_alone(core):
    """No other pair term: the fused core's window is `local_window_size` only (no bias
    array), and the blocked core's plan skips blocks; both equal the direct sum."""
    q, k, v = _inputs()
    x = _nodes("unit")
    for causal in (False, True):
        band = itde.SlidingWindow(5.0).on_nodes(x)
        got = jax.jit(lambda q, k, v: CORES[core](
            q, k, v, window=band, causal=causal, block_size=3
        ))(q, k, v)  # fmt: skip
        np.testing.assert_allclose(
            got, _reference(q, k, v, x, 5.0, causal), rtol=0, atol=ATOL[core]
        )


@pytest.mark.slow  # reverse mode of the same plan (dynamic slices): 3 s of compilation
def test_gradients_blocked_equal_dense():
    """Reverse mode through the skipped blocks (dynamic slices of the key blocks)."""
    q, k, v = _inputs(n=17)
    band = itde.SlidingWindow(4.0).on_nodes(_nodes("unit", 17))
    lw = jnp.asarray(np.log(np.random.default_rng(2).uniform(0.5, 2.0, 17)))

    def loss(core, q, k, v):
        out = core(q, k, v, window=band, causal=True, token_log_weights=lw, block_size=4)
        return jnp.sum(jnp.sin(out))

    gd = jax.jit(jax.grad(lambda *a: loss(dense_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    gb = jax.jit(jax.grad(lambda *a: loss(blocked_attention, *a), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(gd, gb, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12)


# ----------------------------------------------------------------- Hugging Face's boundary
def test_band_is_hugging_faces_mask():
    """On the unit grid, a causal `SlidingWindow(W)` is `sliding_window_causal_mask_function(W)`
    (`kv_idx > q_idx - W`: the key W tokens back is out, W - 1 back is in), and
    `SlidingWindow(W + 1/2)` without causality is the bidirectional overlay
    (`|q_idx - kv_idx| <= W`: W away is in)."""
    n, w = 12, 3
    idx = torch.arange(n)
    for hf_fn, length, causal in (
        (masking_utils.sliding_window_causal_mask_function(w), w, True),
        (masking_utils.sliding_window_bidirectional_mask_function(w), w + 0.5, False),
    ):
        hf = np.array([[bool(hf_fn(0, 0, i, j)) for j in idx] for i in idx])
        ours = itde.SlidingWindow(length).on_nodes(_nodes("unit", n)).matrix()
        if causal:
            ours = ours & np.tril(np.ones((n, n), bool))
        np.testing.assert_array_equal(ours, hf)
    causal = itde.SlidingWindow(w).on_nodes(_nodes("unit", n)).matrix()
    assert causal[7, 7 - (w - 1)] and not causal[7, 7 - w]  # the boundary token


MISTRAL_N, MISTRAL_W, VOCAB = 8, 3, 50
MASKS = np.array([[1] * MISTRAL_N, [1] * 6 + [0, 0], [0, 0] + [1] * 6])  # none, right, left


@pytest.fixture(scope="module")
def mistral():
    config = tf.MistralConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=6, intermediate_size=12, sliding_window=MISTRAL_W,
        pad_token_id=1, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.MistralModel(config)
    with torch.no_grad():  # moved away from the initialisation (std 0.02: near identity)
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.5)
            else:
                p.add_(0.3 * torch.randn_like(p))
    ids = np.random.RandomState(0).randint(4, VOCAB, size=(len(MASKS), MISTRAL_N))
    return model.eval(), ids


def _by_hand(model, window):
    """Mistral read as the Llama converter reads Llama (the same weights), with `window`
    as the one extra keyword of the equation."""
    from itde.interop._internal import NoPositions
    from itde.interop._internal import _hf_glue as g

    config = model.config
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    blocks = []
    for layer in model.layers:
        at, mlp = layer.self_attn, layer.mlp
        blocks.append(
            itde.Block(
                g.attention(at.q_proj, at.k_proj, at.v_proj, at.o_proj, h, hkv),
                g.rms_norm(layer.input_layernorm),
                g.gated_feedforward(mlp.gate_proj, mlp.up_proj, mlp.down_proj, "silu"),
                g.rms_norm(layer.post_attention_layernorm),
            )
        )
    equation = g.equation(
        blocks, causal=True, block=itde.PreNorm(), final_norm=g.rms_norm(model.norm),
        rope=itde.Rope(g.a(model.rotary_emb.inv_freq)), window=window,
    )  # fmt: skip
    return itde.interop.HFTransformer(
        word_embeddings=g.a(model.embed_tokens.weight),
        position_embeddings=None,
        token_type_embeddings=None,
        embedding_norm=None,
        equation=equation,
        positions=NoPositions(),
    )


class _MistralFloat64:
    """Mistral's float32 RMSNorm and rotary angles in float64 (its family is not registered
    here, so `hf_float64` does not know them; the same patches as Llama's)."""

    def __enter__(self):
        from transformers.models.mistral import modeling_mistral

        from itde.interop._internal import float64_patches

        self.saved = []
        for owner, attr, new in float64_patches(modeling_mistral, "Mistral"):
            self.saved.append((owner, attr, vars(owner)[attr]))
            setattr(owner, attr, new)

    def __exit__(self, *exc):
        for owner, attr, old in reversed(self.saved):
            setattr(owner, attr, old)


def _mistral_errors(model, ids, dtype, windows):
    model = model.to(dtype)
    refs = {}
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(MASKS))
        refs[impl] = out.last_hidden_state.numpy()
    forward = jax.jit(jax.vmap(lambda m, i, k: m(i, attention_mask=k), in_axes=(None, 0, 0)))
    errors = {}
    for length in windows:
        ours = np.asarray(forward(_by_hand(model, length), jnp.asarray(ids), jnp.asarray(MASKS)))
        for impl, ref in refs.items():
            for name, r, o, mask in zip(("none", "right", "left"), ref, ours, MASKS, strict=True):
                real = mask == 1
                err = np.max(np.abs(o[real] - r[real])) / np.max(np.abs(r[real]))
                errors[length, impl, name] = err
    return errors


def test_mistral_sliding_window_float64(mistral):
    """`SlidingWindow(3)` equals `MistralModel(sliding_window=3)` in float64 (1e-15 relative)
    for every padding and both attention implementations; one token more (`SlidingWindow(4)`)
    is another network (the boundary token is out, as in Hugging Face)."""
    model, ids = mistral
    windows = (itde.SlidingWindow(MISTRAL_W), itde.SlidingWindow(MISTRAL_W + 1))
    with itde.interop.hf_float64(), _MistralFloat64():
        errors = _mistral_errors(model, ids, torch.float64, windows)
    exact = {key: e for key, e in errors.items() if key[0] == windows[0]}
    assert len(exact) == 6 and max(exact.values()) < 1e-13, exact
    for other in windows[1:]:
        assert min(e for key, e in errors.items() if key[0] == other) > 1e-3, errors


@pytest.mark.slow  # float64 above is the exactness check; this is float32's round-off
def test_mistral_sliding_window_float32(mistral):
    """The same in float32, Hugging Face's code unpatched (2e-5 relative, as test_hf)."""
    model, ids = mistral
    window = itde.SlidingWindow(MISTRAL_W)
    errors = _mistral_errors(model, ids, torch.float32, (window,))
    assert max(errors.values()) < 2e-5, errors


# ----------------------------------------------------------------- the equation
def _function_controls(seed=0):
    b = itde.LegendreBasis(4, (0.0, 1.0))
    gl = itde.GaussLegendre(interval=(0.0, 1.0))
    block = itde.FunctionBlock.init(
        jax.random.key(seed), n_heads=2, feature_basis=b, head_basis=b, hidden_basis=b,
        head_rule=gl, n_head_nodes=6, hidden_rule=gl, n_hidden_nodes=6, scale=0.5, decay=0.5,
    )  # fmt: skip
    return itde.PiecewiseConstant(itde.stack([block]))


def _support(model, n):
    """Which tokens each token's attention output depends on: `[n, n]` booleans, from one
    directional derivative per token (a random direction in its features)."""
    ku, kt = jax.random.split(jax.random.key(3))
    u = jax.random.normal(ku, (n, model.n_features))
    dirs = jax.random.normal(kt, (n, model.n_features))
    f = lambda du: jax.jvp(lambda u: model.attention_field(0.5, u), (u,), (du,))[1]  # noqa: E731
    tangents = jnp.eye(n)[:, :, None] * dirs[None]  # token p's direction only
    jac = jax.jit(jax.vmap(f))(tangents)  # [p, k, d]: d A(u)(x_k) along token p
    return np.asarray(jnp.sum(jnp.abs(jac), axis=-1) > 0).T


@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_window_is_the_same_length_on_a_refined_grid(causal):
    """A model with function kernels and `SlidingWindow(3)` on the token interval [0, 12]:
    on 12 nodes (spacing 1) a token's attention reads the tokens less than 3 away (3 behind
    in the causal model, itself included); moved with `on_grid` to 24 nodes (spacing 1/2)
    it reads the same interval, about twice as many tokens. The node distance 3 is out on
    both grids, although the nodes round it to 3 +- 4e-16."""
    features = itde.GaussLegendre(interval=(0.0, 1.0))  # the kernels' feature interval
    grid = lambda n: itde.Grid(itde.Midpoint(interval=(0.0, 12.0)), features, 6)  # noqa: E731
    coarse = itde.TransformerIDE(
        _function_controls(), grid(12), causal=causal, window=itde.SlidingWindow(3.0)
    )
    fine = coarse.on_grid(grid(24))
    assert fine.window == coarse.window
    # (the coarse grid is the unit grid's case, which Mistral's test covers: slow only here)
    for model, n in ((coarse, 12), (fine, 24)) if not causal else ((fine, 24),):
        i = np.arange(n)
        d = i[:, None] - i[None, :]  # x_i - x_p = d * 12 / n exactly (the nodes round off)
        want = (np.abs(d) * 12 < 3 * n) & ((d >= 0) | (not causal))
        np.testing.assert_array_equal(_support(model, n), want)
        # L / h tokens behind, itself included; 2 L / h - 1 in all without causality
        assert want[n // 2].sum() == {(12, True): 3, (24, True): 6, (12, False): 5,
                                      (24, False): 11}[n, causal]  # fmt: skip


def test_equation_keeps_the_window_and_every_core_agrees():
    """A causal post-norm model with RoPE, ALiBi and a window on a non-unit grid (spacing
    1/2: Volterra weights), left-padded: the attention field is the same in the three cores
    (`test_batch_keeps_the_window`, slow, shows the window changes the solution); the
    continuum form (its norms folded) keeps the window."""
    grid = itde.Grid(itde.Midpoint(interval=(0.0, 7.0)), itde.Midpoint(), 8)
    base = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=1, n_features=8, n_heads=2, causal=True, rope_base=100.0,
        grid=grid, window=itde.SlidingWindow(2.5),
    )  # fmt: skip
    model = itde.TransformerIDE(
        base.controls, grid, causal=True, block=base.block, rope=base.rope,
        score_bias=itde.ALiBi.init(2), window=base.window,
    )  # fmt: skip
    u = jax.random.normal(jax.random.key(1), (2, 14, 8))
    mask = np.ones((2, 14), bool)
    mask[1, :3] = False  # left padding
    field = jax.jit(lambda m, u, k: m.attention_field(0.5, u, k))
    outs = {
        name: np.asarray(field(_with_core(model, core), u[1], mask[1]))
        for name, core in (
            ("dense", itde.Dense()),
            ("blocked", itde.Blocked(block_size=4)),
            ("fused", itde.Fused()),
        )
    }
    np.testing.assert_allclose(outs["blocked"], outs["dense"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(outs["fused"], outs["dense"], rtol=0, atol=1e-5)
    form = model.continuum_form()
    assert form.readout is not None and form.window == model.window


@pytest.mark.slow  # two solves compiled (4 s); `batch` maps the same equation's fields
def test_batch_keeps_the_window():
    grid = itde.Grid(itde.Midpoint(interval=(0.0, 7.0)), itde.Midpoint(), 8)
    model = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=1, n_features=8, n_heads=2, causal=True, grid=grid,
        window=itde.SlidingWindow(2.5),
    )  # fmt: skip
    u = jax.random.normal(jax.random.key(1), (2, 14, 8))
    mask = np.ones((2, 14), bool)
    mask[1, :3] = False
    blocked = _with_core(model, itde.Blocked(block_size=4))
    np.testing.assert_allclose(blocked.batch(u, mask)[1], model(u[1], mask[1]), atol=1e-12)
    plain = _with_window(model, None)(u[1], mask[1])
    assert np.max(np.abs(plain - model(u[1], mask[1]))) > 1e-2


def _with_core(model, core):
    import dataclasses

    return dataclasses.replace(model, attention_core=core)


def _with_window(model, window):
    import dataclasses

    return dataclasses.replace(model, window=window)


# ----------------------------------------------------------------- skipped blocks
def _scan_lengths(jaxpr) -> list[int]:
    lengths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            lengths.append(eqn.params["length"])
        for p in eqn.params.values():
            for sub in p if isinstance(p, (list, tuple)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    lengths += _scan_lengths(inner)
    return lengths


def _evaluated_blocks(n, block, window, causal):
    """How many (query block, key block) pairs the blocked core evaluates, counted at run
    time by a score bias that reports each call (it is called once per evaluated block)."""
    count = [0]

    def bias(iq, ik):
        jax.debug.callback(lambda: count.__setitem__(0, count[0] + 1))
        return jnp.zeros((1, iq.shape[0], ik.shape[0]), jnp.float32)

    q = jnp.ones((1, n, 2), jnp.float32)
    f = jax.jit(lambda q: blocked_attention(
        q, q, q, window=window, causal=causal, score_bias=bias, block_size=block
    ))  # fmt: skip
    jax.block_until_ready(f(q))
    jax.effects_barrier()
    return count[0]


@pytest.mark.parametrize("causal", [False, True])
def test_blocked_core_evaluates_only_the_blocks_that_meet_the_window(causal):
    """N = 1024 and 2048 tokens, blocks of 64, window 100: the blocked core evaluates exactly
    the (query block, key block) pairs that hold an admitted pair (counted at run time), a
    number linear in N; its inner scan has the same length for both N (3 blocks causal, 5
    not), where without a window it runs over all N / 64 blocks."""
    counts = {}
    for n in (1024, 2048):
        band = itde.SlidingWindow(100.0).on_nodes(_nodes("unit", n))
        admitted = band.matrix() & (np.tril(np.ones((n, n), bool)) if causal else True)
        nb = n // 64
        meets = admitted.reshape(nb, 64, nb, 64).any(axis=(1, 3))
        counts[n] = _evaluated_blocks(n, 64, band, causal)
        assert counts[n] == meets.sum()
        q = jnp.ones((1, n, 2), jnp.float32)
        lengths = _scan_lengths(jax.make_jaxpr(
            lambda q: blocked_attention(q, q, q, window=band, causal=causal, block_size=64)
        )(q).jaxpr)  # fmt: skip
        assert sorted(lengths) == sorted([nb, 3 if causal else 5]), lengths
        plain = jax.make_jaxpr(lambda q: blocked_attention(q, q, q, block_size=64))(q).jaxpr
        assert sorted(_scan_lengths(plain)) == [nb, nb]
    assert counts[2048] <= 2.1 * counts[1024]  # linear, not quadratic (x4)
    nb = 1024 // 64  # without a window: every block (causal: those at or before the query's)
    assert _evaluated_blocks(1024, 64, None, causal) == (nb * (nb + 1) // 2 if causal else nb**2)
    assert key_block_plan(2048, 64, causal, None)[3] == 2048 // 64


# ----------------------------------------------------------------- refusals
@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan])
def test_window_length_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match=r"`SlidingWindow\(length\)`=.*positive and finite"):
        itde.SlidingWindow(bad)


@pytest.mark.parametrize("bad", [True, "3", None])
def test_window_length_must_be_a_number(bad):
    with pytest.raises(TypeError, match=r"`SlidingWindow\(length\)`=.*must be a number"):
        itde.SlidingWindow(bad)


def test_equation_refuses_what_cannot_take_a_window():
    m = itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=8, n_heads=2)
    with pytest.raises(TypeError, match=r"`window`=3.*itde.SlidingWindow"):
        _with_window(m, 3)
    grid2d = itde.Grid(
        itde.TensorGrid2D(itde.Midpoint(), itde.Midpoint(), 2, 2), itde.Midpoint(), 8
    )
    with pytest.raises(
        ValueError, match=r"`window` is a length on a 1-D token domain.*TensorGrid2D"
    ):
        itde.TransformerIDE(m.controls, grid2d, window=itde.SlidingWindow(2.0))


def test_cores_refuse_a_wrong_band():
    q, k, v = _inputs()
    with pytest.raises(TypeError, match=r"`window`=.*itde.TokenBand"):
        dense_attention(q, k, v, window=itde.SlidingWindow(3.0))
    band = itde.SlidingWindow(3.0).on_nodes(_nodes("unit", N + 1))
    with pytest.raises(ValueError, match=r"`window` was bound to 24 token nodes.*23 tokens"):
        blocked_attention(q, k, v, window=band)
    with pytest.raises(ValueError, match=r"non-causal `window` reaches ahead.*cuDNN"):
        fused_attention(q, k, v, window=itde.SlidingWindow(3.0).on_nodes(_nodes("unit")),
                        implementation="cudnn")  # fmt: skip
    with pytest.raises(ValueError, match=r"`TokenBand\(first, last\)` must hold"):
        itde.TokenBand((0, 2), (1, 1))
    with pytest.raises(ValueError, match=r"`nodes` must be finite and increasing"):
        itde.SlidingWindow(3.0).on_nodes([0.5, 0.2])
