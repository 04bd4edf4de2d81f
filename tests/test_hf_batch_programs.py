"""`HFTransformer.batch` at many lengths: the embedding runs inside the solve's bucketed
program, so a new length in a bucket compiles nothing (through `jax.vmap(embed)` each new
length compiled about 18 eager programs: the id checks, the gathers, the positions), and
the result is the unpadded computation's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import itde

VOCAB, POSITIONS = 50, 48  # a position table that holds the 32 bucket, not the 64 one


@pytest.fixture(scope="module")
def gpt2():
    config = tf.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=16, n_layer=2,
                           n_head=2, attn_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    model = tf.GPT2Model(config).double().eval()
    return model, itde.from_hf(model)


def _inputs(n):
    ids = np.random.RandomState(n).randint(0, VOCAB, size=(2, n))
    mask = np.ones_like(ids)
    mask[1, : n // 4] = 0  # left padding in the second row
    return ids, mask


def test_new_lengths_of_a_bucket_compile_nothing_and_equal_transformers(gpt2):
    model, ours = gpt2
    ours.batch(*_inputs(17))  # the 32 bucket's program
    with itde.count_compilations() as c:
        outs = {n: ours.batch(*_inputs(n)) for n in (19, 25, 32)}
    assert c.count == 0, c.count
    for n, out in outs.items():
        ids, mask = _inputs(n)
        with torch.no_grad():
            ref = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask))
        real = mask == 1
        ref = ref.last_hidden_state.numpy()
        np.testing.assert_allclose(np.asarray(out)[real], ref[real], rtol=1e-10, atol=1e-10)
        # the unpadded path: the embedding per row, then the equation's batch
        u0 = jax.vmap(ours.embed)(jnp.asarray(ids))
        same = ours.equation.batch(u0, jnp.asarray(mask))
        np.testing.assert_allclose(np.asarray(out)[real], np.asarray(same)[real], rtol=1e-12,
                                   atol=1e-12)  # fmt: skip


def test_a_bucket_past_the_position_table_runs_at_the_length_itself(gpt2):
    """Past 32 tokens the bucket (64) has rows the position table (48) does not: one
    program at the length itself, equal to transformers; ids out of range are named."""
    model, ours = gpt2
    ids, mask = _inputs(40)
    with itde.count_compilations() as c:
        out = ours.batch(ids, mask)
    assert c.count >= 1
    with torch.no_grad():
        ref = model(torch.as_tensor(ids), attention_mask=torch.as_tensor(mask))
    real = mask == 1
    np.testing.assert_allclose(np.asarray(out)[real], ref.last_hidden_state.numpy()[real],
                               rtol=1e-10, atol=1e-10)  # fmt: skip
    bad = ids.copy()
    bad[1, 3] = VOCAB
    said = rf"`input_ids` holds ids outside \[0, {VOCAB}\).* {VOCAB}\."
    with pytest.raises(ValueError, match=said):
        ours.batch(bad, mask)
    with pytest.raises(ValueError, match=r"has 49 tokens, more than the 48"):
        ours.batch(np.zeros((1, 49), np.int64))


def test_the_head_at_new_lengths_of_a_bucket_compiles_nothing():
    """`HFCausalLM.project` of concrete states runs one program per token bucket (the head
    acts token by token): eager, each new length compiled its einsum, bias and cap."""
    config = tf.GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=16, n_layer=1,
                           n_head=2, attn_implementation="eager")  # fmt: skip
    torch.manual_seed(1)
    model = tf.GPT2LMHeadModel(config).double().eval()
    lm = itde.from_hf(model)
    h = np.random.RandomState(2).normal(size=(2, 32, 16))
    lm.project(h[:, :17]), lm.project(h[0, :17])  # the 32 bucket's programs, each rank
    with itde.count_compilations() as c:
        outs = {n: lm.project(h[:, :n]) for n in (18, 25, 32)}
        one = lm.project(h[0, :20])  # one sequence [tokens, features]: the same bucket
    assert c.count == 0, c.count
    w = model.lm_head.weight.detach().numpy()
    for n, out in outs.items():
        assert out.shape == (2, n, VOCAB)
        np.testing.assert_allclose(out, h[:, :n] @ w.T, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(one, h[0, :20] @ w.T, rtol=1e-12, atol=1e-12)


def test_a_mask_of_another_shape_is_named(gpt2):
    _, ours = gpt2
    ids, mask = _inputs(9)
    with pytest.raises(ValueError, match=r"`attention_mask` must have shape \[batch, tokens\]"):
        ours.batch(ids, mask[:1])
