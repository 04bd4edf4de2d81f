"""Exactness against PyTorch itself: one Lie splitting step with dt = 1 is one post-LN block."""

import copy

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


# By default two (case, precision) pairs that together cover every option (gelu, eps 0 and
# > 0, causal, both batch layouts, with and without biases and final norm) in both
# precisions; every other pair runs with `-m slow` (relu and non-causal are covered by the
# tests below, and every pair of options, pre-LN included, at tiny width by
# `test_reference_torch.py`).
DEFAULT_PAIRS = {(1, "float64"), (2, "float32")}


@pytest.mark.parametrize(
    "case,precision",
    [
        pytest.param(
            case,
            precision,
            id=f"d{case[0]}h{case[1]}ff{case[2]}{case[4]}eps{case[5]}c{int(case[6])}-{precision}",
            marks=() if (i, precision) in DEFAULT_PAIRS else pytest.mark.slow,
        )
        for i, case in enumerate(CASES)
        for precision in ("float32", "float64")
    ],
)
def test_from_torch_matches_pytorch(case, precision):
    d, h, dff, L, act, eps, causal, bf, bias, final = case
    tdtype = {"float32": torch.float32, "float64": torch.float64}[precision]
    enc = _encoder(d, h, dff, L, act, eps, bf, bias, final, tdtype)
    x = np.random.default_rng(1).standard_normal((3, 11, d)).astype(precision)
    y_ref = _torch_out(enc, x, causal, bf)
    model = itde.from_torch(enc, causal=causal)
    if bf:
        y = np.asarray(jax.jit(jax.vmap(model))(jnp.asarray(x)))
    else:  # x is [batch, tokens, d] here: vmap over axis 0 is right, and the model (which
        # cannot tell) says what to check for a batch_first=False module
        with pytest.warns(UserWarning, match=r"batch_first=False.*does not apply"):
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


def _with_norm2_eps(enc, eps):
    enc = copy.deepcopy(enc)
    for layer in enc.layers:
        layer.norm2.eps = eps
    return enc


@pytest.mark.parametrize(
    "eps,act", [(1e-2, "relu"), (0.0, "gelu"), pytest.param(1e-5, "relu", marks=pytest.mark.slow)]
)
def test_relaxation_form_is_pytorch_with_four_times_the_norm2_eps(eps, act):
    r"""The relaxation form projects $(v + F(v))/2$ instead of $v + F(v)$. LayerNorm is
    invariant under scaling except through eps: with $w = u/2$, mean and deviation halve
    and the variance quarters, so $LN_\epsilon(u/2) = \gamma (u - m)/\sqrt{var + 4\epsilon}
    + \beta = LN_{4\epsilon}(u)$. Hence: relaxation form = PyTorch with norm2.eps = 4 eps,
    exactly, while the residual form is PyTorch itself (and with eps = 0 both are)."""
    enc = _encoder(16, 2, 24, 3, act, eps, True, True, False, torch.float64)
    x = np.random.default_rng(4).standard_normal((2, 6, 16))
    res = jax.vmap(itde.from_torch(enc))(jnp.asarray(x))
    rel = jax.vmap(itde.from_torch(enc, relaxation=True))(jnp.asarray(x))
    y_ref = _torch_out(enc, x, False, True)
    y_4eps = _torch_out(_with_norm2_eps(enc, 4 * eps), x, False, True)
    assert float(np.max(np.abs(np.asarray(res) - y_ref))) < 1e-12
    assert float(np.max(np.abs(np.asarray(rel) - y_4eps))) < 1e-12


def test_relaxation_form_differs_by_the_analytic_order_eps_effect():
    r"""One layer, eps = 1e-2: with $v = x_1 + F(x_1)$ the input of norm2 (per token mean $m$,
    biased variance $s^2$), the two forms differ by exactly
    $\Delta = \gamma (v - m) (1/\sqrt{s^2 + 4\epsilon} - 1/\sqrt{s^2 + \epsilon})$.
    With $z = (v - m)/\sqrt{s^2 + \epsilon}$ and $x = \epsilon / s^2$ this is
    $-\gamma z\, f(x)$, $f(x) = 1 - \sqrt{(1 + x)/(1 + 4x)} = 1.5x - 4.875x^2 + O(x^3)$,
    so $(1 - 4x)\, 1.5x \le f(x) \le 1.5x$ for the small x here: an O(eps) change."""
    eps = 1e-2
    enc = _encoder(16, 2, 24, 1, "relu", eps, True, True, False, torch.float64)
    layer = enc.layers[0]
    x = np.random.default_rng(6).standard_normal((2, 6, 16))
    with torch.no_grad():  # torch's own sub-modules give norm2's input
        xt = torch.as_tensor(x)
        x1 = layer.norm1(xt + layer.self_attn(xt, xt, xt, need_weights=False)[0])
        v = (x1 + layer.linear2(layer.activation(layer.linear1(x1)))).numpy()
    gamma = layer.norm2.weight.detach().numpy()
    m, s2 = v.mean(-1, keepdims=True), v.var(-1, keepdims=True)
    delta = gamma * (v - m) * (1 / np.sqrt(s2 + 4 * eps) - 1 / np.sqrt(s2 + eps))
    first_order = 1.5 * (eps / s2) * np.abs(gamma * (v - m) / np.sqrt(s2 + eps))
    res = jax.vmap(itde.from_torch(enc))(jnp.asarray(x))
    rel = jax.vmap(itde.from_torch(enc, relaxation=True))(jnp.asarray(x))
    measured = np.asarray(rel) - np.asarray(res)
    np.testing.assert_allclose(measured, delta, rtol=0, atol=1e-13)
    assert np.all(np.abs(measured) <= first_order + 1e-13)
    assert np.all(np.abs(measured) >= (1 - 4 * eps / s2) * first_order - 1e-13)
    assert float(np.max(np.abs(measured))) > 1e-3  # the effect is real at this eps


def test_pre_ln_relaxation_mixed_layers_and_bad_modules_rejected():
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, norm_first=True)
    with pytest.raises(ValueError, match="relaxation=False"):
        itde.from_torch(layer, relaxation=True)
    post = torch.nn.TransformerEncoderLayer(8, 2, 16, norm_first=False)
    enc = torch.nn.TransformerEncoder(post, 2, enable_nested_tensor=False)
    enc.layers[1] = layer
    with pytest.raises(ValueError, match="norm_first"):
        itde.from_torch(enc)
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
    """Training runs in float32: a float32 torch layer gives a float32 model whose output
    matches torch's float32 output to float32 accuracy."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True).eval()
    model = itde.from_torch(layer)
    assert model.controls.values.attention.wq.dtype == jnp.float32
    x = np.random.default_rng(7).standard_normal((2, 5, 16)).astype(np.float32)
    out = jax.vmap(model)(jnp.asarray(x, jnp.float32))
    assert out.dtype == jnp.float32
    with torch.no_grad():
        y_ref = layer(torch.as_tensor(x)).numpy()
    np.testing.assert_allclose(np.asarray(out), y_ref, rtol=0, atol=2e-5)
