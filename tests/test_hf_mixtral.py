"""Mixtral as an equation, and the sparse mixture of experts it brings
(`itde.MixtureOfExperts`): the operator against a reference written out in torch (softmax,
top-k, each expert's SwiGLU, the shared expert's sigmoid gate), its refusal by the solvers and
forms that assume a smooth field, and `MixtralForCausalLM` exact against `transformers`
(float64 inside `itde.interop.hf_float64()`: logits at drawn lengths with left and right
padding, greedy generation with the KV cache, `to_hf` back; every length 1..300 in the slow
tier).

One tiny model for the module (2 layers, width 16, 4 experts of which 2 per token, a
sliding window of 6 tokens, vocabulary 64), its logits compiled once for a padded window of
`L` tokens. Hugging Face's experts run `_experts_implementation="eager"`: its default
(`grouped_mm`) computes in float32 or narrower only.
"""

import dataclasses

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from helpers import hf_logits as _hf_logits
from helpers import relative_error as _rel
from helpers import spread_hf_weights
from hypothesis import given, settings
from hypothesis import strategies as st

import itde

L, VOCAB, WINDOW = 40, 64, 6
LOGITS = jax.jit(jax.vmap(lambda lm, i, k: lm.logits(i, k), in_axes=(None, 0, 0)))


@pytest.fixture(scope="module")
def mixtral():
    config = tf.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=512, sliding_window=WINDOW,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = spread_hf_weights(tf.MixtralForCausalLM(config)).double().eval()
    return model, itde.from_hf(model)


# ---------------------------------------------------------------- the operator
def _reference(moe, u, renormalise):
    """The mixture written out in torch: softmax over every expert, the top k, each chosen
    expert's SwiGLU times its gate, plus the sigmoid-gated shared expert."""
    T = lambda a: torch.as_tensor(np.array(a))  # noqa: E731
    U, e = T(u), moe.experts
    p = F.softmax(U @ T(moe.router), dim=-1)
    top, index = torch.topk(p, moe.routing.top_k, dim=-1)
    if renormalise:
        top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(U)
    for n in range(U.shape[0]):
        for j in range(moe.routing.top_k):
            i = int(index[n, j])
            x = U[n]
            y = (F.silu(x @ T(e.w_gate[i])) * (x @ T(e.w1[i]))) @ T(e.w2[i])
            out[n] += top[n, j] * y
    if moe.shared is not None:
        s = moe.shared
        y = (F.silu(U @ T(s.w_gate)) * (U @ T(s.w1))) @ T(s.w2)
        out += torch.sigmoid(U @ T(moe.shared_gate))[:, None] * y
    return out.numpy()


def _moe(routing, shared, key=jax.random.key(0), d=6, n_experts=5, hidden=7):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    experts = jax.vmap(lambda k: itde.GatedFeedForward.init(k, d, hidden))(
        jax.random.split(k2, n_experts)
    )
    return itde.MixtureOfExperts(
        router=jax.random.normal(k1, (d, n_experts)),
        experts=experts,
        routing=routing,
        shared=itde.GatedFeedForward.init(k3, d, hidden + 2) if shared else None,
        shared_gate=jax.random.normal(k4, (d,)) if shared else None,
    )


@pytest.mark.parametrize(
    "routing, shared",
    [(itde.RenormalisedTopK(2), False), (itde.SoftmaxTopK(3), True),
     (itde.RenormalisedTopK(1), True)],
)  # fmt: skip
def test_mixture_of_experts_equals_the_routed_sum_written_out(routing, shared):
    moe = _moe(routing, shared)
    u = np.random.default_rng(0).normal(size=(9, 6))
    ref = _reference(moe, u, isinstance(routing, itde.RenormalisedTopK))
    np.testing.assert_allclose(moe(jnp.asarray(u)), ref, rtol=0, atol=1e-13)
    gates = np.asarray(moe.gates(jnp.asarray(u)))
    assert np.all(np.sum(gates > 0, axis=-1) == routing.top_k)  # k experts per token
    assert itde.ROUTERS["renormalised_top_k"] is itde.RenormalisedTopK
    assert itde.ROUTERS["softmax_top_k"] is itde.SoftmaxTopK


def test_mixture_of_experts_is_refused_where_a_smooth_field_is_assumed():
    """A routed mixture jumps where a token's top-k set changes: an adaptive controller and
    `continuum_form` refuse it by name; fixed steps run; keeping every expert is smooth."""
    m = itde.TransformerIDE.init(
        jax.random.key(1), n_layers=2, n_features=6, n_heads=2, block="pre_norm", norm="rms",
        gated=True, activation="silu", bias=False, causal=True,
    )  # fmt: skip
    moe = _moe(itde.RenormalisedTopK(2), True)
    routed = eqx.tree_at(
        lambda m: m.controls, m,
        itde.PiecewiseConstant(itde.stack([
            dataclasses.replace(m.controls.layer(i), feedforward=moe) for i in range(2)
        ])),
    )  # fmt: skip
    u0 = jax.random.normal(jax.random.key(2), (5, 6))
    assert routed.discontinuity is not None and m.discontinuity is None
    with pytest.raises(ValueError, match=r"PIDController.*MixtureOfExperts.*top 2 of its 5"):
        itde.solve(routed, u0, solver=diffrax.Tsit5(), dt0=0.5,
                   stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6))  # fmt: skip
    with pytest.raises(ValueError, match=r"continuum_form.*MixtureOfExperts.*fixed|one step"):
        routed.continuum_form()
    with pytest.raises(ValueError, match=r"continuum_form.*MixtureOfExperts"):
        itde.continuum_form(routed)
    out = itde.solve(routed, u0).ys[-1]  # the network's scheme: accepted
    assert bool(jnp.all(jnp.isfinite(out)))
    every = eqx.tree_at(lambda m: m.controls.blocks.feedforward.routing, routed,
                        itde.RenormalisedTopK(5))  # fmt: skip
    assert every.discontinuity is None and every.continuum_form() is every


def test_mixture_of_experts_arguments_are_named():
    moe = _moe(itde.RenormalisedTopK(2), False)
    with pytest.raises(ValueError, match=r"top_k`=0"):
        itde.RenormalisedTopK(0)
    with pytest.raises(ValueError, match=r"top_k`=6 exceeds the 5 experts"):
        dataclasses.replace(moe, routing=itde.SoftmaxTopK(6))
    with pytest.raises(ValueError, match=r"experts.w1` has shape"):
        dataclasses.replace(moe, router=moe.router[:, :4])
    with pytest.raises(ValueError, match="shared_gate` is given without"):
        dataclasses.replace(moe, shared_gate=jnp.ones(6))
    with pytest.raises(TypeError, match="routing"):
        dataclasses.replace(moe, routing="top2")


# ---------------------------------------------------------------- Mixtral
def _padded(ids, n, side):
    """`ids` (length >= n) as a window of L tokens: n real ones, padded left or right."""
    return _padded_to(ids, n, side, L)


def _padded_to(ids, n, side, length):
    row = np.zeros(length, np.int64)
    mask = np.zeros(length, np.int64)
    real = slice(length - n, length) if side == "left" else slice(0, n)
    row[real], mask[real] = ids[:n], 1
    return row, mask


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, L), seed=st.integers(0, 2**16))
def test_logits_equal_transformers_at_drawn_lengths_and_padding(mixtral, n, seed):
    """n drawn tokens in the compiled window of L, padded on the left and on the right."""
    model, lm = mixtral
    ids = np.random.RandomState(seed).randint(3, VOCAB, size=n)
    (a, ma), (b, mb) = _padded(ids, n, "left"), _padded(ids, n, "right")
    rows, masks = np.stack([a, b]), np.stack([ma, mb])
    ours = np.asarray(LOGITS(lm, jnp.asarray(rows), jnp.asarray(masks)))
    ref = _hf_logits(model, rows, masks)
    real = masks == 1
    assert _rel(ours[real], ref[real]) <= 1e-10


def test_greedy_generation_with_the_cache_equals_transformers(mixtral):
    model, lm = mixtral
    prompt = np.random.RandomState(1).randint(3, VOCAB, size=5)
    with torch.no_grad(), itde.interop.hf_float64():
        ref = model.generate(torch.as_tensor(prompt[None]), max_new_tokens=8, do_sample=False,
                             pad_token_id=0, eos_token_id=None)[0].numpy()  # fmt: skip
    ours = lm.generate(jnp.asarray(prompt), 8, max_length=16, chunk=4, cache=True)
    np.testing.assert_array_equal(ours, ref)


def test_to_hf_round_trip_is_exact(mixtral):
    model, lm = mixtral
    back = itde.to_hf(lm)
    assert type(back) is type(model)
    ours, theirs = back.state_dict(), model.state_dict()
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k


@pytest.mark.slow
def test_logits_equal_transformers_at_every_length_to_300(mixtral):
    """Every length 1..300, each as a window of 300 tokens padded on the right and on the
    left (one compiled program), against Hugging Face's batch with the same masks."""
    model, lm = mixtral
    ids = np.random.RandomState(3).randint(3, VOCAB, size=300)
    run = jax.jit(jax.vmap(lambda i, k: lm.logits(i, k)))
    worst = 0.0
    for side in ("right", "left"):
        for start in range(1, 301, 50):
            rows, masks = map(np.stack, zip(*(
                _padded_to(ids, n, side, 300) for n in range(start, start + 50)
            )))  # fmt: skip
            ours = np.asarray(run(jnp.asarray(rows), jnp.asarray(masks)))
            ref = _hf_logits(model, rows, masks)
            real = masks == 1
            worst = max(worst, _rel(ours[real], ref[real]))
    assert worst <= 1e-10, worst
