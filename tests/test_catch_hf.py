"""A converter that the default run of tests/test_hf.py does not compare with Hugging Face
(DistilBERT's comparison is a slow test there): one small float64 comparison, one
sequence, no padding, so that a swapped LayerNorm or projection fails the default suite.
The model is built from a tiny config with random weights (nothing is downloaded)."""

import jax.numpy as jnp
import numpy as np
import torch
import transformers as tf

import itde


def test_distilbert_equals_hugging_face():
    config = tf.DistilBertConfig(
        vocab_size=30, dim=8, n_layers=1, n_heads=2, hidden_dim=12, max_position_embeddings=8,
        activation="gelu", pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.DistilBertModel(config)
    with torch.no_grad():  # spread wider than the initialisation, so no block is ~identity
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.ndim > 1 else 0.3) + (p if p.ndim == 1 else 0))
    model = model.double().eval()
    ids = np.array([5, 17, 3, 29, 11, 8])
    with torch.no_grad():
        ref = model(torch.as_tensor(ids[None])).last_hidden_state[0].numpy()
    got = np.asarray(itde.from_hf(model)(jnp.asarray(ids)))
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-10 * np.abs(ref).max())
