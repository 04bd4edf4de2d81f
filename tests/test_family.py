"""The Transformer family as equations: pre-norm and parallel blocks, RMSNorm, gated
feed-forward, activations, RoPE, grouped-query attention, padding masks.

References are PyTorch (its modules and functional ops, float64) and properties that hold
by construction of the mathematics (closest point, relative positions), never itde itself.
"""

import dataclasses
import functools

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import itde
import itde_solvers

KEY = jax.random.key(0)


def _torch_encoder(norm_first, n_layers=2, d=8, h=2, ff=16, final=True, act="gelu", seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        d, h, ff, dropout=0.0, batch_first=True, norm_first=norm_first, activation=act
    ).double()
    norm = torch.nn.LayerNorm(d).double() if final else None
    enc = torch.nn.TransformerEncoder(layer, n_layers, norm=norm, enable_nested_tensor=False)
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0.0, 0.4)
    return enc.eval()


# ------------------------------------------------------------------ pre-norm (exact)
@pytest.mark.parametrize("final", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pre_ln_encoder_equals_torch_with_padding_and_round_trip(final):
    enc = _torch_encoder(norm_first=True, final=final)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    pad = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # torch: True = padding
    m = itde.from_torch(enc)
    assert m.block == itde.PreNorm() and (m.final_norm is not None) == final
    xj = jnp.asarray(x.numpy())
    np.testing.assert_allclose(m.batch(xj), enc(x).detach().numpy(), rtol=0, atol=1e-12)
    ref = enc(x, src_key_padding_mask=pad).detach().numpy()
    out = np.asarray(m.batch(xj, jnp.asarray(~pad.numpy())))
    np.testing.assert_allclose(out[0], ref[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(out[1, :4], ref[1, :4], rtol=0, atol=1e-12)  # real tokens
    back = itde.to_torch(m)
    assert back.layers[0].norm_first
    np.testing.assert_allclose(back(x).detach().numpy(), enc(x).detach().numpy(), atol=1e-13)


def test_pre_ln_causal_equals_torch():
    enc = _torch_encoder(norm_first=True)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.float64)
    ref = enc(x, mask=causal, is_causal=True).detach().numpy()[0]
    m = itde.from_torch(enc, causal=True)
    np.testing.assert_allclose(m(jnp.asarray(x.numpy()[0])), ref, rtol=0, atol=1e-12)


def test_parallel_block_equals_torch_composition():
    """u + A(N1 u) + F(N2 u) with PyTorch's own sub-blocks of a pre-LN layer."""
    enc = _torch_encoder(norm_first=True, n_layers=2, final=False, act="relu")
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    ref = x
    for layer in enc.layers:
        ref = ref + layer._sa_block(layer.norm1(ref), None, None) + layer._ff_block(
            layer.norm2(ref)
        )
    pre = itde.from_torch(enc)
    par = itde.TransformerIDE(pre.controls, pre.grid, block=itde.Parallel())
    out = par(jnp.asarray(x.numpy()[0]))
    np.testing.assert_allclose(out, ref.detach().numpy()[0], rtol=0, atol=1e-12)
    assert float(jnp.max(jnp.abs(out - pre(jnp.asarray(x.numpy()[0]))))) > 1e-2  # not pre-LN


# ------------------------------------------------------------------ operators
def test_rms_norm_equals_torch_and_is_the_closest_point():
    d = 6
    v = np.random.default_rng(0).normal(size=(5, d))
    gain = np.random.default_rng(1).normal(size=d)
    ref = torch.nn.RMSNorm(d, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.as_tensor(gain))
    out = itde.RMSNormProjection(1.0, jnp.asarray(gain), 1e-6)(jnp.asarray(v))
    np.testing.assert_allclose(out, ref(torch.as_tensor(v)).detach().numpy(), atol=1e-14)
    # exact projection (eps=0, no gain) onto {mean u^2 = sigma^2}: on the sphere, and no point
    # of the sphere is closer to v
    sigma = 1.7
    p = np.asarray(itde.RMSNormProjection(sigma, None, 0.0)(jnp.asarray(v)))
    np.testing.assert_allclose(np.mean(p**2, axis=-1), sigma**2, rtol=1e-13)
    others = np.random.default_rng(2).normal(size=(2000, 5, d))
    others *= sigma / np.sqrt(np.mean(others**2, axis=-1, keepdims=True))
    best = np.linalg.norm(p - v, axis=-1)
    assert np.all(np.linalg.norm(others - v, axis=-1) >= best - 1e-12)
    with pytest.raises(ValueError, match="sigma"):
        itde.RMSNormProjection(-1.0)


def test_gated_feedforward_and_activations_equal_torch():
    ff = itde.GatedFeedForward.init(KEY, 6, 10, activation="silu", bias=True)
    u = np.random.default_rng(0).normal(size=(4, 6))
    t = {k: torch.as_tensor(np.array(getattr(ff, k))) for k in
         ("w_gate", "w1", "w2", "b_gate", "b1", "b2")}  # fmt: skip
    U = torch.as_tensor(u)
    ref = (F.silu(U @ t["w_gate"] + t["b_gate"]) * (U @ t["w1"] + t["b1"])) @ t["w2"] + t["b2"]
    np.testing.assert_allclose(ff(jnp.asarray(u)), ref.numpy(), atol=1e-13)
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    refs = {
        "relu": F.relu(x),
        "gelu": F.gelu(x),
        "gelu_tanh": F.gelu(x, approximate="tanh"),
        "silu": F.silu(x),
        "quick_gelu": x * torch.sigmoid(1.702 * x),  # transformers' QuickGELUActivation
    }
    assert set(refs) == set(itde.ACTIVATIONS)
    for name, r in refs.items():
        got = itde.ACTIVATIONS[name](jnp.asarray(x.numpy()))
        np.testing.assert_allclose(got, r.numpy(), atol=1e-14, err_msg=name)


@pytest.mark.parametrize("impl", [itde.Dense(), itde.Blocked(3)])
def test_grouped_query_attention_equals_torch_sdpa(impl):
    """4 query heads sharing 2 key/value heads, head size 5 (not d / heads), value size 3."""
    d, h, hkv, e, ev, n = 8, 4, 2, 5, 3, 7
    rng = np.random.default_rng(0)
    w = lambda *s: jnp.asarray(rng.normal(size=s) * 0.5)  # noqa: E731
    att = itde.Attention(
        wq=w(h, d, e), wk=w(hkv, d, e), wv=w(hkv, d, ev), wo=w(h, ev, d),
        bq=w(h, e), bk=w(hkv, e), bv=w(hkv, ev), bo=w(d),
    )  # fmt: skip
    u = rng.normal(size=(n, d))
    T = lambda a: torch.as_tensor(np.array(a))  # noqa: E731  (a copy: JAX arrays are read-only)
    U = T(u)
    q = torch.einsum("nd,hde->hne", U, T(att.wq)) + T(att.bq)[:, None]
    k = torch.einsum("nd,hde->hne", U, T(att.wk)) + T(att.bk)[:, None]
    v = torch.einsum("nd,hde->hne", U, T(att.wv)) + T(att.bv)[:, None]
    for causal in (False, True):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        ref = torch.einsum("hne,hed->nd", o, T(att.wo)) + T(att.bo)
        got = att(jnp.asarray(u), causal=causal, core=impl)
        np.testing.assert_allclose(got, ref.numpy(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="kv_heads dividing"):
        itde.Attention(wq=w(4, d, e), wk=w(3, d, e), wv=w(3, d, e), wo=w(4, e, d),
                       bq=None, bk=None, bv=None, bo=None)  # fmt: skip
    with pytest.raises(ValueError, match="n_kv_heads"):
        itde.Attention.init(KEY, 8, 4, n_kv_heads=3)


def test_rope_is_a_function_of_relative_position_and_matches_the_rotate_half_reference():
    rope = itde.Rope.init(8, base=100.0, dtype=jnp.float64)
    rng = np.random.default_rng(0)
    q, k = jnp.asarray(rng.normal(size=(1, 1, 8))), jnp.asarray(rng.normal(size=(1, 1, 8)))

    def score(x, y):
        rq = itde._operators._rope.rotate(q, rope.cos_sin(jnp.asarray([x]), q.dtype))
        rk = itde._operators._rope.rotate(k, rope.cos_sin(jnp.asarray([y]), q.dtype))
        return float(jnp.sum(rq * rk))

    s = score(3.25, 1.0)
    for c in (-2.0, 0.5, 17.3):  # positions anywhere on the real line, not only integers
        assert abs(score(3.25 + c, 1.0 + c) - s) < 1e-12
    assert abs(score(3.25, 1.0) - score(1.0, 3.25)) > 1e-3  # not symmetric: sign of x - y
    # rotate-half as in GPT-NeoX / Llama (transformers' apply_rotary_pos_emb) at positions
    # 0..N-1 of the unit grid
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n = 5
    Q = rng.normal(size=(1, 2, n, 8))
    pos = np.arange(n, dtype=np.float64)
    inv = np.asarray(rope.inv_freq)
    emb = np.concatenate([np.outer(pos, inv)] * 2, axis=-1)
    qt, _ = apply_rotary_pos_emb(
        torch.as_tensor(Q), torch.as_tensor(Q), torch.as_tensor(np.cos(emb))[None],
        torch.as_tensor(np.sin(emb))[None],
    )  # fmt: skip
    nodes, _ = itde.Grid.unit(8).tokens.nodes_weights(n)
    got = itde._operators._rope.rotate(jnp.asarray(Q[0]), rope.cos_sin(nodes, jnp.float64))
    np.testing.assert_allclose(got, qt.numpy()[0], atol=1e-13)


# ------------------------------------------------------------------ masks as data
def _llama_like(**kw):
    m = itde.TransformerIDE.init(
        KEY, n_layers=2, n_features=8, n_heads=4, n_kv_heads=2, block="pre_norm", norm="rms",
        gated=True, activation="silu", bias=False, rope_base=1000.0, final_norm=True,
        causal=True,
    )  # fmt: skip
    return dataclasses.replace(m, **kw)


def test_masked_tokens_are_removed_from_the_domain():
    """Real tokens of a padded sequence see exactly the unpadded sequence (right padding,
    bidirectional and causal), for every block form and attention core."""
    x = jax.random.normal(KEY, (7, 8))
    mask = jnp.array([1, 1, 1, 1, 1, 0, 0], bool)
    for m in (
        itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, block="parallel"),
        _llama_like(attention_core=itde.Blocked(3)),
    ):
        np.testing.assert_allclose(m(x, mask)[:5], m(x[:5]), rtol=0, atol=1e-12)


def test_one_compiled_model_serves_every_mask_under_vmap_batch_and_grad():
    m = _llama_like()
    x = jax.random.normal(KEY, (3, 6, 8))
    masks = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], bool)
    f = jax.jit(jax.vmap(lambda u, k: m(u, k)))
    a = f(x, masks)
    b = f(x, masks[::-1])  # sequence i now with mask 2 - i
    assert f._cache_size() == 1
    # the reversed masks give each sequence's answer under its new mask (the batched solve
    # computes it independently), which differs where the mask differs
    np.testing.assert_allclose(m.batch(x, masks[::-1]), b, rtol=0, atol=1e-12)
    assert float(jnp.max(jnp.abs(b[0] - a[0]))) > 1e-3  # masks 2 and 0 differ
    np.testing.assert_allclose(m.batch(x, masks), a, rtol=0, atol=1e-12)
    # left padding under causal: the padded queries 0, 1 have no admissible key; their
    # output is defined (finite) and the real tokens equal the unpadded sequence
    assert bool(jnp.all(jnp.isfinite(a[2])))
    np.testing.assert_allclose(a[2, 2:], m(x[2, 2:]), rtol=0, atol=1e-12)

    def loss(model, u, k):
        return jnp.sum(model.batch(u, k) ** 2)

    g = eqx.filter_jit(eqx.filter_grad(loss))(m, x, masks)  # jitted: not op by op
    leaves = jax.tree.leaves(g)
    assert leaves and all(bool(jnp.all(jnp.isfinite(v))) for v in leaves)
    sol = itde.solve(m, x[1], args=masks[1])
    np.testing.assert_allclose(m.final_norm(sol.ys[-1]), a[1], atol=1e-12)


def test_bad_masks_and_options_are_named():
    m = _llama_like()
    x = jnp.zeros((4, 8)) + jnp.arange(8.0)
    with pytest.raises(ValueError, match=r"shape \[\.\.\., 4\].*\(3,\)"):
        m(x, jnp.ones((3,), bool))
    with pytest.raises(TypeError, match="float"):
        m(x, jnp.ones((4,)))
    with pytest.raises(ValueError, match="only 0 and 1"):
        m(x, jnp.array([1, 2, 1, 1]))
    with pytest.raises(ValueError, match=r"\[batch, tokens\]"):
        m.batch(x[None], jnp.ones((2, 4), bool))
    with pytest.raises(TypeError, match="block"):
        itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, block="sandwich")
    with pytest.raises(ValueError, match="norm"):
        itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, norm="batch")
    with pytest.raises(ValueError, match="activation"):
        itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, activation="tanh")
    with pytest.raises(ValueError, match="ffn_form"):
        itde._blocks.block_from_names("pre_norm", "relaxation")
    with pytest.raises(ValueError, match="no constraint set"):
        m.constraint(0.0)
    with pytest.raises(ValueError, match="rotary"):
        itde.Rope.init(8, rotary_dim=5)


# ------------------------------------------------------------------ the continuum
PRE_NORM_ORDERS = [("lie", 1), ("rk4", 4), pytest.param(("strang", 2), marks=pytest.mark.slow),
                   pytest.param(("heun", 2), marks=pytest.mark.slow)]  # fmt: skip


@pytest.fixture(scope="module")
def pre_norm_problem():
    ctrl = itde.LegendreControls.init(
        KEY, n_modes=3, n_features=8, n_heads=2, n_hidden=16, activation="gelu", norm="rms",
        gated=True, bias=False,
    )  # fmt: skip
    m = itde.TransformerIDE(ctrl, itde.Grid.unit(8), block=itde.PreNorm())
    u0 = jax.random.normal(jax.random.key(1), (5, 8))
    ref = itde.solve(
        m, u0, solver=diffrax.Dopri8(), terms="tangent", dt0=0.05,
        stepsize_controller=diffrax.PIDController(rtol=1e-12, atol=1e-12),
    ).ys[-1]  # fmt: skip
    return m, u0, ref


@pytest.mark.parametrize("case", PRE_NORM_ORDERS)
def test_pre_norm_continuum_orders(case, pre_norm_problem):
    """Smooth pre-norm controls: the ODE u_t = A(N1 u) + F(N2 u) has no constraint, and the
    observed orders of Lie (1), Strang (2), Heun (2) and RK4 (4) are the schemes' own, against
    a Dopri8 reference at tight tolerance."""
    m, u0, ref = pre_norm_problem
    name, expected = case
    sc = itde.SCHEMES[name]

    @jax.jit
    def final(dt):  # one compilation per scheme, the step is data
        return itde.solve(
            m, u0, solver=sc.make(), terms=sc.terms, dt0=dt, max_steps=20,
            stepsize_controller=diffrax.ConstantStepSize(),
        ).ys[-1]  # fmt: skip

    errs = [float(jnp.max(jnp.abs(final(jnp.asarray(1 / n)) - ref))) for n in (8, 16)]
    order = np.log2(errs[0] / errs[1])
    assert abs(order - expected) < 0.3, (name, errs, order)


def test_pre_norm_needs_no_projection(pre_norm_problem):
    """No constraint: a plain diffrax solver integrates it, as the projected one does."""
    m, u0, _ = pre_norm_problem
    plain = itde.solve(m, u0, solver=diffrax.Heun(), dt0=1 / 8).ys[-1]
    proj = itde.solve(m, u0, solver=itde_solvers.Projected(diffrax.Heun()), dt0=1 / 8).ys[-1]
    np.testing.assert_allclose(plain, proj, rtol=0, atol=1e-14)


def test_mask_and_rope_agree_across_dense_blocked_and_fused_cores():
    """The key mask and the rotary embedding ride on every attention core: same output and
    gradient to round-off (causal, left padding included: a query with no key gives 0)."""
    att = itde.Attention.init(KEY, 8, 4, n_kv_heads=2)
    rope = itde.Rope.init(att.head_dim, base=500.0, dtype=jnp.float64)
    u = jax.random.normal(jax.random.key(3), (6, 8))
    mask = jnp.array([0, 1, 1, 1, 1, 0], bool)
    cs = rope.cos_sin(jnp.arange(6) + 0.5, u.dtype)

    # jitted: one compile per core instead of an op-by-op (eager) gradient of the loops
    @functools.partial(jax.jit, static_argnums=0)
    def run(impl, u):
        out = att(u, causal=True, core=impl, key_mask=mask, rotary=cs)
        return out, jax.grad(lambda v: jnp.sum(jnp.sin(att(
            v, causal=True, core=impl, key_mask=mask, rotary=cs))))(u)  # fmt: skip

    ref, g_ref = run(itde.Dense(), u)
    np.testing.assert_allclose(ref[0], att.bo, atol=1e-14)  # no admissible key: A = bo
    for impl, tol in ((itde.Blocked(4), 1e-12), (itde.Fused(), 1e-6)):  # fused: f32 softmax
        out, g = run(impl, u)
        np.testing.assert_allclose(out, ref, rtol=0, atol=tol, err_msg=impl)
        np.testing.assert_allclose(g, g_ref, rtol=0, atol=10 * tol, err_msg=impl)


def test_alibi_score_bias_in_the_model_equals_the_masked_sum_with_a_linear_penalty():
    """`TransformerIDE(score_bias=ALiBi)`: the first layer's attention equals softmax(s -
    slope |x - x~|) written out with the bias matrix, and dense == blocked for the model."""
    m = itde.TransformerIDE.init(KEY, n_layers=1, n_features=8, n_heads=2, causal=True)
    alibi = itde.ALiBi.init(2)
    mb = dataclasses.replace(m, score_bias=alibi)
    u = jax.random.normal(jax.random.key(5), (6, 8))
    att = m.controls.layer(0).attention
    nodes = jnp.arange(6) + 0.5
    bias = -np.asarray(alibi.slopes)[:, None, None] * np.abs(
        np.subtract.outer(np.asarray(nodes), np.asarray(nodes))
    )[None]
    ref = att(u, causal=True, score_bias=jnp.asarray(bias))
    np.testing.assert_allclose(mb.attention_field(0.0, u), ref, rtol=0, atol=1e-13)
    assert float(jnp.max(jnp.abs(ref - att(u, causal=True)))) > 1e-3  # the bias acts
    blocked = dataclasses.replace(mb, attention_core=itde.Blocked(4))
    np.testing.assert_allclose(blocked.attention_field(0.0, u), ref, rtol=0, atol=1e-12)
    with pytest.raises(TypeError, match="score_bias"):
        dataclasses.replace(m, score_bias=np.zeros((2, 6, 6)))
