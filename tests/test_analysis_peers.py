"""The peers' definitions (`itde.analysis`): Tong et al.'s token exponent
(`TongExponent`) and feed-forward spectrum (the eigenvalues of $W_1 W_2$), each against a
port of their code (qkvflow, `qkvflow/analysis/lyapunov.py` and
`qkvflow/analysis/spectral.py`) run on a model both sides read: a Hugging Face GPT-NeoX
with the parallel block $u + A(N_1 u) + F(N_2 u)$, their block form, in float64. The
reference reads the model through torch (its layers' own modules, differentiated by torch
autograd), never through itde.

Also: the exact and Tong's token exponents differ, in sign and in ranking. (`itde analyze
--exponent tong` runs in test_analysis_finishes.py, with the programs of its other runs.)"""

import contextlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.analysis import (
    FlowMap,
    TongExponent,
    analyze,
    feedforward_eigenvalues,
    feedforward_singular_values,
    spectra,
    token_lyapunov_exponents,
)
from itde.cli import main

N, D, L, H = 7, 8, 3, 0.5  # tokens, features, layers, the depth length of a layer


@pytest.fixture(scope="module")
def neox():
    """A tiny GPT-NeoX (spread weights, float64), its itde equation with layers of depth
    length H (so each layer is u + H f_l(u), Tong et al.'s Euler step with dt = H), the
    torch fields f_l (a layer's output minus its input, the rotary angles in float64: HF
    computes them in float32 whatever the model's dtype) and the torch trajectory."""
    import torch
    import transformers as tf
    from helpers import spread_hf_weights

    config = tf.GPTNeoXConfig(hidden_size=D, num_hidden_layers=L, num_attention_heads=2,
                              intermediate_size=12, rotary_pct=0.5, vocab_size=50,
                              max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    hf = spread_hf_weights(tf.GPTNeoXModel(config)).double().eval()
    model = itde.from_hf(hf)
    eq = model.equation
    assert isinstance(eq.block, itde.Parallel) and eq.causal
    c = eq.controls
    eq = eqx.tree_at(lambda e: e.controls, eq, itde.PiecewiseConstant(c.values, layer_length=H))
    ids = [3, 17, 5, 42, 8, 1, 33]
    u0 = model.embed(jnp.asarray(ids))
    assert u0.dtype == jnp.float64

    pos = torch.arange(N)[None]
    causal = torch.full((N, N), -torch.inf, dtype=torch.float64).triu(1)[None, None]
    ang = pos[0, :, None].double() * hf.rotary_emb.inv_freq.double()[None]
    emb = torch.cat([ang, ang], -1)[None]
    rotary = (emb.cos(), emb.sin())

    def field(n, x):  # f_n(x) = layer_n(x) - x, x [tokens, features]
        y = hf.layers[n](x[None], attention_mask=causal, position_ids=pos,
                         position_embeddings=rotary)  # fmt: skip
        return (y[0] if isinstance(y, tuple) else y)[0] - x

    xs = [torch.as_tensor(np.array(u0))]
    for n in range(L):
        xs.append((xs[-1] + H * field(n, xs[-1])).detach())
    return hf, eq, u0, field, xs


def qkvflow_lyapunov(field, trajectory, dt, output_index):
    """A port of qkvflow's `compute_lyapunov_exponent` (`qkvflow/analysis/lyapunov.py`,
    Tong et al.) to torch: at every layer, the Jacobian of the layer's vector field at
    the trajectory's state, output token `output_index` against every input token, the
    identity added to every token's block, one QR step; returns the log |diag R| of
    every layer, `[layers, tokens, features]`."""
    import torch

    n, d = trajectory[0].shape
    q = torch.eye(d, dtype=torch.float64).repeat(n, 1, 1)  # q0: the identity per token
    lambdas = []
    with one_torch_thread():
        for t, x in enumerate(trajectory):
            J = torch.autograd.functional.jacobian(lambda y: field(t, y)[output_index], x)
            J = J.permute(1, 0, 2)  # "n k m -> k n m": [token, out feature, in feature]
            tangent = J @ q
            q = q + tangent * dt
            q, r = torch.linalg.qr(q)
            lambdas.append(torch.log(torch.abs(torch.diagonal(r, dim1=-2, dim2=-1))))
    return torch.stack(lambdas).numpy()


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread: the port's many ops on 8 x 8 tensors are several times slower
    on two threads of a loaded 2-core machine (the threads synchronise on every op)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tong(neox):
    """itde's Tong exponents (all features, towards the last token) at the start and at the
    end of each step, and the exact ones, in one compilation."""
    _, eq, u0, _, _ = neox

    def run(eq, u):
        return (
            token_lyapunov_exponents(eq, u, k=D, method="tong"),
            token_lyapunov_exponents(eq, u, k=D, method=TongExponent(at_step_end=True)),
            token_lyapunov_exponents(eq, u, target=3, k=D, method=TongExponent()),
            token_lyapunov_exponents(eq, u, target=-1),
            token_lyapunov_exponents(eq, u, target=3),
        )

    return jax.jit(run)(eq, u0)


@pytest.mark.parametrize("at_step_end", [False, True])
def test_tong_exponent_is_qkvflows(neox, tong, at_step_end):
    """Every one of the D exponents of every token equals the port's, to round-off: at
    the states where the layers start (default), and at the states after each layer, as
    their `compute_lyapunov_exponent_for_sentence` passes them (`compute_trajectory`)."""
    _, eq, u0, field, xs = neox
    if not at_step_end:  # the two sides read the same network: the same states
        states = np.asarray(FlowMap(eq).states(u0, [0.0, H, 2 * H, 3 * H]))
        np.testing.assert_allclose(states, np.stack([x.numpy() for x in xs]), atol=1e-13)
    got = tong[1] if at_step_end else tong[0]
    lambdas = qkvflow_lyapunov(field, xs[1:] if at_step_end else xs[:-1], H, N - 1)
    summed = lambdas.sum(axis=0)  # their reading: the sum over layers (their depth is 1)
    want = np.sort(summed, axis=-1)[:, ::-1] / (L * H)
    np.testing.assert_allclose(got.exponents, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.singular_values, np.exp(want * L * H), rtol=1e-12)
    # the number they colour each token by: the largest
    np.testing.assert_allclose(got.exponents[:, 0] * L * H, summed.max(-1), atol=1e-12)
    assert int(got.n_vjps) == L * D and int(got.n_jvps) == 0


def test_the_exact_and_tongs_definitions_differ(neox, tong):
    """Causal attention: output token 3 does not read tokens 4..6, so their blocks of the
    flow's Jacobian are 0 (exact exponent -inf) while Tong's product is I (exponent 0,
    exactly). Towards the last token the exact exponents have a negative one where every
    one of Tong's is positive, and the two rank the tokens differently."""
    _, _, _, field, xs = neox
    tong_last, _, tong_3, exact_last, exact_3 = tong
    assert np.all(np.isneginf(np.asarray(exact_3.exponents)[4:]))
    assert np.all(np.asarray(tong_3.exponents)[4:] == 0.0)
    want = np.sort(qkvflow_lyapunov(field, xs[:-1], H, 3).sum(0), -1)[:, ::-1] / (L * H)
    np.testing.assert_allclose(tong_3.exponents, want, rtol=0, atol=1e-12)
    exact, theirs = np.asarray(exact_last.exponents[:, 0]), np.asarray(tong_last.exponents[:, 0])
    assert exact.min() < 0 < theirs.min()
    assert np.argmax(exact) != np.argmax(theirs)
    assert not np.array_equal(np.argsort(exact), np.argsort(theirs))


def test_tong_exponent_in_float32_with_padding(neox, tong):
    """Float32, two padded tokens after the real ones: the padded tokens get NaN, the real
    ones (towards the last *real* token) keep their float64 exponents to float32
    accuracy."""
    _, eq, u0, _, _ = neox
    eq32 = jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, eq)
    u = jnp.concatenate([u0, jnp.full((2, D), 3.0)]).astype(jnp.float32)
    mask = jnp.arange(N + 2) < N
    got = jax.jit(lambda e, x: token_lyapunov_exponents(e, x, mask=mask, k=2, method="tong"))(
        eq32, u
    )
    assert got.exponents.dtype == jnp.float32
    assert np.all(np.isnan(np.asarray(got.exponents)[N:]))
    np.testing.assert_allclose(got.exponents[:N], tong[0].exponents[:, :2], rtol=1e-4, atol=1e-5)


def qkvflow_ff_spectrum(ff1, ff2):
    """A port of qkvflow's `examine_FF_spectra_info` (`qkvflow/analysis/spectral.py`) for
    one layer, `rank=None`: the eigenvalues of `ff1 @ ff2`, GPT-2's (levanter's)
    `c_fc.weight` `[embed, mlp]` and `c_proj.weight` `[mlp, embed]`, sorted as `jnp.sort`
    sorts complex numbers (real part, then imaginary). They then store the real parts
    only; this keeps the complex values."""
    m = ff1 @ ff2
    return np.sort(np.linalg.eigvals(m))


def test_feedforward_spectrum_is_qkvflows(neox):
    """`spectra(...).w1w2_eigenvalues` of every layer equal their eigenvalues of W1 W2
    (GPT-NeoX's `dense_h_to_4h` and `dense_4h_to_h`, torch `[out, in]` transposed to
    `[in, out]`), complex, to round-off."""
    hf, eq, _, _, _ = neox
    sp = spectra(eq)
    assert sp.w1w2_eigenvalues.shape == (L, D)  # d_ff = 12 > d: all d can be nonzero
    for n, layer in enumerate(hf.layers):
        ff1 = layer.mlp.dense_h_to_4h.weight.detach().numpy().T
        ff2 = layer.mlp.dense_4h_to_h.weight.detach().numpy().T
        want = qkvflow_ff_spectrum(ff1, ff2)
        got = np.sort(np.asarray(sp.w1w2_eigenvalues[n]))
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12 * np.abs(want).max())
        lam = np.asarray(sp.w1w2_eigenvalues[n])  # by decreasing modulus
        assert np.all(np.diff(np.abs(lam)) <= 1e-12)


def test_feedforward_eigenvalues_with_quadrature_weights_and_a_narrow_hidden_layer():
    """d_ff = 3 < d = 5: the 3 eigenvalues of W1 W2 that can be nonzero; with feature
    weights w and hidden weights w_z, those of the integral operator, the eigenvalues of
    W1 D_z W2 D_w (a matrix similar to the symmetric scaling)."""
    k1, k2 = jax.random.split(jax.random.key(7))
    w1 = jax.random.normal(k1, (5, 3), jnp.float64)
    w2 = jax.random.normal(k2, (3, 5), jnp.float64)
    ff = itde.FeedForward(w1, w2, None, None, activation="gelu")
    w = np.asarray([0.1, 0.3, 0.2, 0.25, 0.15])
    wz = np.asarray([0.5, 1.5, 1.0])
    got = np.asarray(feedforward_eigenvalues(ff, feature_weights=w, hidden_weights=wz))
    full = np.linalg.eigvals(np.asarray(w1) @ np.diag(wz) @ np.asarray(w2) @ np.diag(w))
    want = full[np.argsort(-np.abs(full))][:3]
    assert got.shape == (3,) and np.abs(full[np.argsort(-np.abs(full))][3:]).max() < 1e-12
    np.testing.assert_allclose(np.sort_complex(got), np.sort_complex(want), atol=1e-12)
    plain = np.linalg.eigvals(np.asarray(w1 @ w2))
    np.testing.assert_allclose(
        np.sort_complex(np.asarray(feedforward_eigenvalues(ff))),
        np.sort_complex(plain[np.argsort(-np.abs(plain))][:3]), atol=1e-12,
    )  # fmt: skip
    with pytest.raises(TypeError, match="`feedforward` must be a discrete"):
        feedforward_eigenvalues("w1")


def test_bad_choices_are_named(neox):
    _, eq, u0, _, _ = neox
    with pytest.raises(ValueError, match=r"`target`='all': Tong et al.'s exponent follows one"):
        token_lyapunov_exponents(eq, u0, target="all", method="tong")
    with pytest.raises(ValueError, match=r"`method`='tongs' is not a token exponent; give one "
                       r"of \['exact', 'tong'\]"):  # fmt: skip
        token_lyapunov_exponents(eq, u0, method="tongs")
    with pytest.raises(ValueError, match=r"`token_exponent`='qr' is not a token exponent"):
        analyze(eq, u0, token_exponent="qr")
    import diffrax

    adaptive = FlowMap(eq, solver=diffrax.Tsit5(), terms="tangent",
                       stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6))  # fmt: skip
    with pytest.raises(ValueError, match="no fixed step grid; give FlowMap a fixed `dt0`"):
        token_lyapunov_exponents(adaptive, u0, method="tong")
    with pytest.raises(TypeError, match="`at_step_end`=.yes. must be True or False"):
        TongExponent(at_step_end="yes")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--exponent", "tong", "--no-lyapunov"], "`--exponent tong` chooses the token exponents"),
        (["--exponent", "qr"], "`--exponent`='qr' is not a token exponent"),
    ],
)
def test_cli_analyze_refuses_bad_exponents(tmp_path, capsys, argv, said):
    assert main(["analyze", "--out", str(tmp_path / "x"), *argv]) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("function", [feedforward_singular_values, feedforward_eigenvalues])
def test_feedforward_spectra_refuse_a_function_kernel_by_name(function):
    """Both spectra of a feed-forward read discrete kernels `w1 [d, d_ff]`, `w2 [d_ff, d]`;
    anything else is named with the fix, not an AttributeError inside the product."""
    message = r"`feedforward` must be a discrete .*got object.*discretise"
    with pytest.raises(TypeError, match=message):
        function(object())
