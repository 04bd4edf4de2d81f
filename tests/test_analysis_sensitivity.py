"""Sensitivity of the depth flow (`itde.analysis`): the leading singular values of
$\\partial u(t)/\\partial u(s)$ and the finite-time Lyapunov exponents, for the whole state
and per token, against independent references:

- a dense Jacobian (`jax.jacfwd` of `itde.solve`) and its SVD, for the discrete network;
- a linear equation $u_t = M u$ solved by Euler steps of $h$, whose flow's Jacobian is
  exactly $(I + h M)^n$ (and $e^{M (t - s)}$ as $h \\to 0$); for a diagonal $M$ the
  exponents are $\\log(1 + h a_i) / h$;
- dense per-token blocks of the same dense Jacobian;
- a padded sequence against the same sequence without its padding;
- a converted Hugging Face GPT-2 (a tiny config, random weights), in float32.

Each expensive function is compiled once per module (`jax.jit` with the model as an
argument, tolerances and caps as traced scalars).
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.analysis import FlowMap, lyapunov_spectrum, token_lyapunov_exponents
from itde_solvers import SplitTerm, Strang

N, D, L = 4, 6, 2  # tokens, features, layers of the small network


# ----------------------------------------------------------------- a linear equation
class Interval(itde.AbstractControls):
    """Controls that hold nothing, on [start, end]."""

    start: float = eqx.field(static=True)
    end: float = eqx.field(static=True)

    @property
    def t0(self):
        return self.start

    @property
    def t1(self):
        return self.end

    def __call__(self, t, side="right", part=None):
        return None

    @property
    def blocks(self):
        return None

    @property
    def default_step(self):
        return 0.05


class Linear(itde.AbstractEquation):
    """$u_t = M\\,\\mathrm{vec}(u)$ on states `[tokens, features]`: its flow's Jacobian
    from $s$ to $t$ is $e^{M (t - s)}$, and that of $n$ Euler steps of $h$ is
    $(I + h M)^n$, exactly."""

    controls: Interval
    M: jax.Array
    n: int = eqx.field(static=True)

    @property
    def has_constraint(self):
        return False

    @property
    def n_features(self):
        return self.n

    def project(self, t, u):
        return u

    def terms(self, kind="paper", batched=False):
        return SplitTerm(
            (diffrax.ODETerm(lambda t, u, args: (self.M @ u.reshape(-1)).reshape(u.shape)),)
        )


# ----------------------------------------------------------------- the network, dense
@pytest.fixture(scope="module")
def net():
    model = itde.TransformerIDE.init(
        jax.random.key(0), n_layers=L, n_features=D, n_heads=2, activation="gelu",
        dtype=jnp.float64,
    )  # fmt: skip
    u = jax.random.normal(jax.random.key(1), (N, D), jnp.float64)
    return model, u


@pytest.fixture(scope="module")
def dense(net):
    """The dense Jacobian `[N*D, N*D]` of the discrete network, from an independent
    implementation: the PyTorch encoder `itde.to_torch` gives, differentiated by torch."""
    import torch

    model, u = net
    encoder = itde.to_torch(model)
    x = torch.as_tensor(np.array(u))
    jac = torch.autograd.functional.jacobian(lambda y: encoder(y[None])[0], x)
    return jac.reshape(N * D, N * D).numpy()


def test_spectrum_matches_dense_svd(net, dense):
    spec = jax.jit(lambda model, u: lyapunov_spectrum(model, u, k=3))(*net)
    _, sv, Vt = np.linalg.svd(dense)
    s = np.asarray(spec.singular_values)
    assert bool(spec.converged) and np.all(np.asarray(spec.residuals) <= 1e-6)
    assert np.max(np.abs(s - sv[:3]) / sv[:3]) <= 1e-8, (s, sv[:3])
    np.testing.assert_allclose(spec.exponents, np.log(sv[:3]) / L, rtol=0, atol=1e-8)
    # the vectors: J x_i = sigma_i y_i, orthonormal, the dense right singular vectors
    X = np.asarray(spec.right_vectors).reshape(3, -1)
    Y = np.asarray(spec.left_vectors).reshape(3, -1)
    np.testing.assert_allclose(X @ dense.T, s[:, None] * Y, atol=1e-8)
    np.testing.assert_allclose(X @ X.T, np.eye(3), atol=1e-10)
    np.testing.assert_allclose(np.abs(np.sum(X * Vt[:3], axis=1)), 1.0, atol=1e-6)
    assert int(spec.n_jvps) == int(spec.n_vjps) == int(spec.n_iterations) * (2 * 3 + 2)


@pytest.mark.slow
def test_flow_maps_compose(net):
    """$\\varphi_{s,t} = \\varphi_{r,t} \\circ \\varphi_{s,r}$: from a layer boundary (the
    layers from there on) and from inside a layer, on the step grid, and the discrete
    network's layers 1..L are `trajectory`'s."""
    model, u = net
    np.testing.assert_allclose(FlowMap(model, 1.0)(model.trajectory(u)[1]), model.trajectory(u)[L],
                               rtol=1e-13)  # fmt: skip
    half = dict(dt0=0.5)
    whole = FlowMap(model, **half)(u)
    np.testing.assert_allclose(
        FlowMap(model, 0.5, **half)(FlowMap(model, 0.0, 0.5, **half)(u)), whole, rtol=1e-13
    )


# ----------------------------------------------------------------- the linear flow
S, T, H = 0.25, 1.0, 0.0125  # a flow map from inside the interval, 60 Euler steps


@pytest.fixture(scope="module")
def linear():
    """One compilation for every linear flow of the same shape (3 tokens, 4 features),
    every mask, tolerance, cap and `throw`: the spectrum (k=2 of a block of 3), the
    tokens' exponents (target "all"), the last token's (exact) and the dense Jacobian."""

    def run(flow, u, mask, rtol, cap, throw):
        kw = dict(k=2, block_size=3, mask=mask, rtol=rtol, max_iters=cap, throw=throw)
        spec = lyapunov_spectrum(flow, u, **kw)
        tokens = token_lyapunov_exponents(flow, u, **kw)
        last = token_lyapunov_exponents(flow, u, target=-1, k=4, mask=mask)
        return spec, tokens, last, flow.jacobian(u).as_matrix()

    return jax.jit(run)


def _linear_flow(M):
    eq = Linear(Interval(0.0, 1.0), jnp.asarray(M), 4)
    return FlowMap(eq, S, T, solver=diffrax.Euler(), dt0=H)


def _propagator(M):
    """The exact Jacobian of the Euler flow from S to T: $(I + h M)^n$."""
    return np.linalg.matrix_power(np.eye(len(M)) + H * M, round((T - S) / H))


RATES = -0.3 * np.arange(12.0)  # M = diag(RATES): the exponents, with gaps of 0.3
REAL = jnp.ones((3,), bool)


def test_linear_flow_is_the_euler_propagator(linear):
    """A non-normal $M$ that mixes tokens: $J = (I + h M)^n$, its SVD, its token blocks."""
    M = np.asarray(jax.random.normal(jax.random.key(2), (12, 12))) / 3.0
    spec, tokens, last, dense = linear(_linear_flow(M), jnp.ones((3, 4)), REAL, 1e-9, 200, True)
    exact = _propagator(M)
    np.testing.assert_allclose(dense, exact, atol=1e-10)
    sv = np.linalg.svd(exact, compute_uv=False)
    np.testing.assert_allclose(spec.singular_values, sv[:2], rtol=1e-9)
    np.testing.assert_allclose(spec.exponents, np.log(sv[:2]) / (T - S), rtol=1e-9)
    b = exact.reshape(12, 3, 4)  # [output, input token, input feature]
    ref = np.stack([np.linalg.svd(b[:, j], compute_uv=False)[:2] for j in range(3)])
    np.testing.assert_allclose(tokens.singular_values, ref, rtol=1e-8)
    assert bool(tokens.converged) and int(tokens.n_jvps) == 3 * 3 * int(tokens.n_iterations)
    # Tong et al.'s reading: the last token's output against each input token, exact (4
    # VJPs, no iteration)
    ref = np.stack([np.linalg.svd(b[8:, j], compute_uv=False) for j in range(3)])
    np.testing.assert_allclose(last.singular_values, ref, rtol=1e-10)
    np.testing.assert_allclose(last.exponents, np.log(ref) / (T - S), rtol=1e-10)
    assert int(last.n_vjps) == 4 and int(last.n_jvps) == 0 and int(last.n_iterations) == 0


def test_a_mask_restricts_the_jacobian_to_the_real_tokens(linear):
    """Token 2 padded: the spectrum is that of the real block $P J P$ (inputs and outputs
    on tokens 0 and 1), a token's block is measured on the real outputs, and the padded
    token has no exponent."""
    M = np.asarray(jax.random.normal(jax.random.key(2), (12, 12))) / 3.0
    mask = jnp.asarray([True, True, False])
    spec, tokens, _, _ = linear(_linear_flow(M), jnp.ones((3, 4)), mask, 1e-9, 200, True)
    exact = _propagator(M)
    sv = np.linalg.svd(exact[:8, :8], compute_uv=False)
    np.testing.assert_allclose(spec.singular_values, sv[:2], rtol=1e-9)
    assert np.all(np.asarray(spec.right_vectors)[:, 2] == 0)
    assert np.all(np.asarray(spec.left_vectors)[:, 2] == 0)
    ref = np.stack([np.linalg.svd(exact[:8, 4 * j : 4 * j + 4], compute_uv=False)[:2]
                    for j in range(2)])  # fmt: skip
    np.testing.assert_allclose(tokens.singular_values[:2], ref, rtol=1e-8)
    assert np.all(np.isnan(np.asarray(tokens.exponents)[2]))


@pytest.mark.parametrize("mask,last", [([1, 1, 0], 1), ([0, 1, 1], 2), ([1, 0, 1], 2)])
def test_the_last_token_target_is_the_last_real_token(linear, mask, last):
    """`target=-1` with padding is the last *real* token (right padding: token 1, not the
    padded token 2): its block against each real input token is the propagator's, padded
    inputs get NaN."""
    M = np.asarray(jax.random.normal(jax.random.key(2), (12, 12))) / 3.0
    real = np.asarray(mask, bool)
    _, _, got, _ = linear(_linear_flow(M), jnp.ones((3, 4)), jnp.asarray(real), 1e-9, 200, True)
    b = _propagator(M).reshape(3, 4, 3, 4)  # [output token, feature, input token, feature]
    for j in range(3):
        if real[j]:
            ref = np.linalg.svd(b[last, :, j], compute_uv=False)
            np.testing.assert_allclose(got.singular_values[j], ref, rtol=1e-10)
        else:
            assert np.all(np.isnan(np.asarray(got.singular_values[j])))


def test_a_target_on_padding_is_refused(net, linear):
    """An integer mask, concrete: refused before any solve, naming the fix; a traced mask
    (inside `jax.jit`) when the function runs."""
    model, u = net
    mask = [1, 1, 1, 0]
    with pytest.raises(ValueError, match=r"`target`=3 is a padded token.*one of \[0, 1, 2\]"):
        token_lyapunov_exponents(model, u, target=3, mask=mask)
    with pytest.raises(ValueError, match=r"`target`=-4 counts back 4 real tokens.*only 3"):
        token_lyapunov_exponents(model, u, target=-4, mask=mask)
    flow, none = _linear_flow(np.eye(12)), jnp.zeros((3,), bool)  # no real token to count back to
    with pytest.raises(Exception, match=r"`target`=-1 is not a real token.*fewer than 1 real"):
        jax.block_until_ready(linear(flow, jnp.ones((3, 4)), none, 1e-9, 200, True))


def test_exponents_of_a_diagonal_flow_are_its_rates(linear):
    flow = _linear_flow(np.diag(RATES))
    spec, tokens, _, _ = linear(flow, jnp.ones((3, 4)), REAL, 1e-10, 200, True)
    rates = np.log1p(H * RATES) / H  # Euler's rates, a + O(h a^2)
    np.testing.assert_allclose(spec.exponents, rates[:2], atol=1e-9)
    np.testing.assert_allclose(tokens.exponents, rates.reshape(3, 4)[:, :2], atol=1e-9)
    # the right vectors are the first two coordinates (token 0, features 0 and 1)
    X = np.abs(np.asarray(spec.right_vectors).reshape(2, -1))
    np.testing.assert_allclose(X[:, :2], np.eye(2), atol=1e-5)


def test_iteration_count_and_tolerance_contract(linear):
    flow, u = _linear_flow(np.diag(RATES)), jnp.ones((3, 4))
    counts = {}
    for rtol in (1e-3, 1e-6, 1e-10):
        spec = linear(flow, u, REAL, rtol, 500, True)[0]
        assert bool(spec.converged), rtol
        assert np.all(np.asarray(spec.residuals) <= rtol), (rtol, spec.residuals)
        counts[rtol] = int(spec.n_iterations)
        assert int(spec.n_jvps) == int(spec.n_vjps) == 3 * counts[rtol]
        # linear convergence: the residual of pair 2 shrinks by (sigma_4 / sigma_2)^2 =
        # about e^{-2 * 0.6 * 0.75} per iteration, from O(1) at the random start
        sigma = (1 + H * RATES) ** round((T - S) / H)
        rate = (sigma[3] / sigma[1]) ** 2
        assert counts[rtol] <= np.log(rtol) / np.log(rate) + 4, (rtol, counts)
    assert counts[1e-3] < counts[1e-6] < counts[1e-10], counts
    # the cap: one iteration does not meet 1e-10; without `throw` it says so in the result
    capped = linear(flow, u, REAL, 1e-10, 1, False)[0]
    assert int(capped.n_iterations) == 1 and not bool(capped.converged)
    assert int(capped.n_jvps) == 3 and np.max(np.asarray(capped.residuals)) > 1e-10
    with pytest.raises(Exception, match="did not meet `rtol` in max_iters iterations"):
        jax.block_until_ready(linear(flow, u, REAL, 1e-10, 1, True))


# ----------------------------------------------------------------- padding, HF, float32
@pytest.fixture(scope="module")
def gpt2():
    import torch
    import transformers as tf
    from helpers import spread_hf_weights

    config = tf.GPT2Config(n_embd=8, n_layer=2, n_head=2, n_inner=12, n_positions=16,
                           vocab_size=50)  # fmt: skip
    torch.manual_seed(0)
    model = spread_hf_weights(tf.GPT2Model(config)).eval()
    return itde.from_hf(model)


def test_hf_gpt2_float32_last_token_exponents_respect_padding(gpt2):
    """Tong et al.'s token exponents (the last token's output against each input token) of
    a converted GPT-2, in float32, with left padding: the padded tokens get NaN, and
    the real tokens' exponents do not change when the padded tokens do (without the mask
    the causal attention of every real token would read them)."""
    m = jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, gpt2)
    mask = jnp.arange(7) >= 2
    u = m.embed(jnp.asarray([1, 1, 5, 17, 3, 42, 8]))
    assert u.dtype == jnp.float32
    run = jax.jit(lambda eq, x: token_lyapunov_exponents(eq, x, target=-1, mask=mask, k=2))
    lam = run(m.equation, u)
    other = 3.0 * jax.random.normal(jax.random.key(3), (2, 8), jnp.float32)
    moved = run(m.equation, u.at[:2].set(other))
    assert lam.exponents.dtype == jnp.float32
    assert np.all(np.isnan(np.asarray(lam.exponents)[:2]))
    assert np.all(np.isfinite(np.asarray(lam.exponents)[2:]))
    np.testing.assert_allclose(lam.exponents[2:], moved.exponents[2:], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------- errors
def test_bad_input_is_named(net):
    model, u = net
    flow = _linear_flow(np.eye(12))
    for kwargs, match in (
        (dict(s=1.0, t=1.0), r"`s`=1.0 must be smaller than `t`=1.0"),
        (dict(s=1.5, t=1.0), r"`s`=1.5 must be smaller"),
        (dict(s=-1.0), r"`s`=-1.0 is before the model's first depth"),
        (dict(t=3.0), r"`t`=3.0 is past the model's depth"),
        (dict(dt0=2.0), r"`dt0`=2.0 is longer than one layer"),
        (dict(terms="nope"), r"`terms`='nope' is not known"),
    ):
        with pytest.raises(ValueError, match=match):
            FlowMap(model, **kwargs)
    with pytest.raises(TypeError, match="`model` must be an itde equation"):
        FlowMap("gpt2")
    with pytest.raises(ValueError, match=r"`k`=25 singular values asked, but the operator has "
                       r"only 24"):  # fmt: skip
        lyapunov_spectrum(model, u, k=N * D + 1)
    with pytest.raises(ValueError, match=r"`k`=7 .* only 6"):
        token_lyapunov_exponents(model, u, k=D + 1)
    with pytest.raises(ValueError, match=r"`block_size`=2 must be between k=3"):
        lyapunov_spectrum(model, u, k=3, block_size=2)
    with pytest.raises(ValueError, match=r"`rtol`=1e-20 must be in"):
        lyapunov_spectrum(model, u, rtol=1e-20)
    with pytest.raises(ValueError, match=r"`target`=4 is not a token"):
        token_lyapunov_exponents(model, u, target=N)
    with pytest.raises(ValueError, match=r"`target`='last' is not known"):
        token_lyapunov_exponents(model, u, target="last")
    with pytest.raises(TypeError, match="bfloat16, too coarse"):
        lyapunov_spectrum(model, u.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="`u` has 4 features but the model has 6"):
        lyapunov_spectrum(model, u[:, :4])
    with pytest.raises(ValueError, match=r"`mask` must have one entry per token"):
        lyapunov_spectrum(model, u, mask=jnp.ones((N + 1,), bool))
    with pytest.raises(Exception, match="the state `u` has a NaN or infinite entry"):
        lyapunov_spectrum(flow, jnp.ones((3, 4)).at[0, 0].set(jnp.nan))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["all", "self", -1])
def test_token_exponents_of_the_network_match_dense_blocks(net, dense, target):
    model, u = net
    tokens = jax.jit(lambda m, x: token_lyapunov_exponents(m, x, target=target, k=2))(model, u)
    blocks = dense.reshape(N, D, N, D)  # [i, a, j, b] = d u_ia(t) / d u_jb(s)
    if target == "all":
        pick = [blocks[:, :, j].reshape(N * D, D) for j in range(N)]
    elif target == "self":
        pick = [blocks[j, :, j] for j in range(N)]
    else:
        pick = [blocks[N - 1, :, j] for j in range(N)]
    ref = np.stack([np.linalg.svd(b, compute_uv=False)[:2] for b in pick])
    assert bool(tokens.converged)
    np.testing.assert_allclose(tokens.singular_values, ref, rtol=1e-8)


@pytest.mark.slow
def test_padding_is_the_sequence_without_it(net):
    """A padded sequence (non-causal, mask on the last token): the spectrum and the
    tokens' exponents of the real tokens equal those of the sequence without the padding."""
    model, u = net
    padded = jnp.concatenate([u, jnp.full((1, D), 5.0)])
    mask = jnp.arange(N + 1) < N

    def both(x, m):
        return lyapunov_spectrum(model, x, k=2, mask=m), token_lyapunov_exponents(model, x, mask=m)

    spec, tokens = jax.jit(both)(padded, mask)
    ref_spec, ref_tokens = jax.jit(both)(u, None)
    np.testing.assert_allclose(spec.singular_values, ref_spec.singular_values, rtol=1e-8)
    np.testing.assert_allclose(tokens.exponents[:N], ref_tokens.exponents, rtol=1e-8)
    assert np.isnan(np.asarray(tokens.exponents)[N]).all()
    assert np.all(np.asarray(spec.right_vectors)[:, N] == 0)


@pytest.mark.slow
def test_continuum_form_with_strang_matches_its_dense_jacobian(net):
    """The continuum of the network (`continuum_form`, Strang at half a layer per step):
    the spectrum of its flow against the dense Jacobian of `itde.solve` with the same
    solver and step (which starts from the projection of u onto the constraint set), in
    float64 and in float32."""
    model, u = net
    cf = model.continuum_form()
    jac = jax.jacrev(lambda x: itde.solve(cf, x, solver=Strang(), dt0=0.5).ys[-1])
    sv = np.linalg.svd(np.asarray(jax.jit(jac)(u)).reshape(N * D, N * D), compute_uv=False)
    run = jax.jit(lambda f, x: lyapunov_spectrum(f, x, k=2))
    spec = run(FlowMap(cf, solver=Strang(), dt0=0.5), u)
    np.testing.assert_allclose(spec.singular_values, sv[:2], rtol=1e-8)
    cf32 = jax.tree.map(lambda a: a.astype(jnp.float32) if eqx.is_inexact_array(a) else a, cf)
    spec32 = run(FlowMap(cf32, solver=Strang(), dt0=0.5), u.astype(jnp.float32))
    assert spec32.singular_values.dtype == jnp.float32 and bool(spec32.converged)
    np.testing.assert_allclose(spec32.singular_values, sv[:2], rtol=1e-3)
