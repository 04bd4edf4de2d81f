"""Exactness against PyTorch itself: one Lie splitting step with dt = 1 is one post-LN block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import itde

CASES = [
    # d_model, nhead, d_ff, layers, activation, eps, causal, batch_first, bias, final norm
    (32, 4, 48, 3, "relu", 1e-5, False, True, True, False),
    (32, 2, 80, 3, "gelu", 0.0, True, False, True, True),
    (24, 3, 24, 4, "gelu", 1e-5, True, True, False, False),
    (16, 1, 40, 3, "relu", 0.0, False, False, False, True),
    (48, 6, 32, 3, "relu", 1e-6, True, True, True, False),
]


def _encoder(d, h, dff, L, act, eps, batch_first, bias, final, dtype, seed=0):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        d,
        h,
        dim_feedforward=dff,
        dropout=0.1,
        activation=act,
        layer_norm_eps=eps,
        batch_first=batch_first,
        norm_first=False,
        bias=bias,
        dtype=dtype,
    )
    norm = torch.nn.LayerNorm(d, eps=eps, bias=bias, dtype=dtype) if final else None
    enc = torch.nn.TransformerEncoder(layer, L, norm=norm, enable_nested_tensor=False)
    with torch.no_grad():  # make the default-initialised norms and biases non-trivial
        for p in enc.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return enc.eval()


def _torch_out(enc, x, causal, batch_first):
    n = x.shape[1]
    xt = torch.as_tensor(x if batch_first else np.swapaxes(x, 0, 1))
    kwargs = {}
    if causal:
        kwargs = dict(
            mask=torch.nn.Transformer.generate_square_subsequent_mask(n, dtype=xt.dtype),
            is_causal=True,
        )
    with torch.no_grad():
        y = enc(xt, **kwargs).numpy()
    return y if batch_first else np.swapaxes(y, 0, 1)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"d{c[0]}h{c[1]}ff{c[2]}{c[4]}eps{c[5]}c{int(c[6])}"
)
@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_from_torch_matches_pytorch(case, precision):
    d, h, dff, L, act, eps, causal, bf, bias, final = case
    tdtype = {"float32": torch.float32, "float64": torch.float64}[precision]
    enc = _encoder(d, h, dff, L, act, eps, bf, bias, final, tdtype)
    x = np.random.default_rng(1).standard_normal((3, 11, d)).astype(precision)
    y_ref = _torch_out(enc, x, causal, bf)
    model = itde.from_torch(enc, causal=causal)
    y = np.asarray(jax.jit(jax.vmap(model))(jnp.asarray(x)))
    assert y.dtype == np.dtype(precision)
    err = np.max(np.abs(y - y_ref))
    assert err <= (2e-5 if precision == "float32" else 1e-10), err
    # one sequence, no vmap
    y0 = np.asarray(model(jnp.asarray(x[0])))
    assert np.max(np.abs(y0 - y_ref[0])) <= (2e-5 if precision == "float32" else 1e-10)


def test_single_layer_and_to_torch_round_trip():
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(20, 5, 36, dropout=0.0, batch_first=True).eval()
    x = np.random.default_rng(0).standard_normal((2, 9, 20)).astype("float32")
    model = itde.from_torch(layer)
    with torch.no_grad():
        y_ref = layer(torch.as_tensor(x)).numpy()
    assert np.max(np.abs(np.asarray(jax.vmap(model)(jnp.asarray(x))) - y_ref)) <= 2e-5
    back = itde.to_torch(model)
    with torch.no_grad():
        y_back = back(torch.as_tensor(x)).numpy()
    np.testing.assert_array_equal(y_back, y_ref)  # the same weights give bit-identical output


def test_every_layer_state_matches_torch_layers():
    """SaveAt gives every layer's state: compare with running torch's layers one by one."""
    enc = _encoder(16, 2, 24, 4, "gelu", 1e-5, True, True, False, torch.float64)
    x = np.random.default_rng(2).standard_normal((7, 16))
    model = itde.from_torch(enc)
    traj = np.asarray(model.trajectory(jnp.asarray(x)))
    h = torch.as_tensor(x[None])
    np.testing.assert_allclose(traj[0], x, atol=0)
    with torch.no_grad():
        for n, layer in enumerate(enc.layers):
            h = layer(h)
            assert np.max(np.abs(traj[n + 1] - h[0].numpy())) < 1e-12


@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_relaxation_form_differs_by_a_small_amount_residual_form_exact(eps):
    enc = _encoder(32, 4, 64, 3, "relu", eps, True, True, False, torch.float64)
    x = np.random.default_rng(4).standard_normal((2, 10, 32))
    y_ref = _torch_out(enc, x, False, True)
    res = jax.vmap(itde.from_torch(enc, ffn_form="residual"))(jnp.asarray(x))
    rel = jax.vmap(itde.from_torch(enc, ffn_form="relaxation"))(jnp.asarray(x))
    err_res = float(np.max(np.abs(np.asarray(res) - y_ref)))
    err_rel = float(np.max(np.abs(np.asarray(rel) - y_ref)))
    assert err_res < 1e-10
    # relaxation halves u2 + F(u2) before the projection: the eps-regularised LayerNorm
    # then sees var/4, i.e. an effective eps of 4*eps -- a first-order change ~ 1.5 eps/var
    assert 1e-10 < err_rel < 50 * eps, err_rel


def test_relaxation_form_exact_when_eps_zero():
    enc = _encoder(32, 4, 64, 3, "gelu", 0.0, True, True, True, torch.float64)
    x = np.random.default_rng(5).standard_normal((2, 10, 32))
    y_ref = _torch_out(enc, x, False, True)
    rel = jax.vmap(itde.from_torch(enc, ffn_form="relaxation"))(jnp.asarray(x))
    assert float(np.max(np.abs(np.asarray(rel) - y_ref))) < 1e-10


def test_pre_ln_rejected_and_bad_modules():
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, norm_first=True)
    with pytest.raises(ValueError, match="norm_first=True"):
        itde.from_torch(layer)
    with pytest.raises(TypeError, match="Linear"):
        itde.from_torch(torch.nn.Linear(3, 3))


def test_to_torch_needs_unit_grid():
    m = itde.TransformerIDE.init(
        jax.random.key(0),
        n_layers=1,
        n_features=8,
        n_heads=2,
        grid=itde.Grid(itde.Trapezoid(interval=(0, 1)), itde.Midpoint(), 8),
    )
    with pytest.raises(ValueError, match="unit grid"):
        itde.to_torch(m)


def test_float32_model_in_float32_pipeline():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
    model = itde.from_torch(layer)
    assert model.controls.values.attention.wq.dtype == jnp.float32
    out = jax.vmap(model)(jnp.ones((2, 5, 16), jnp.float32) + jnp.arange(16.0, dtype=jnp.float32))
    assert out.dtype == jnp.float32
