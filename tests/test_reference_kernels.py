r"""Function-kernel operators against their quadrature sums written out in NumPy.

For kernels $W(\xi, \eta) = \sum_{ab} c_{ab}\,\varphi_a(\xi)\,\psi_b(\eta)$ and biases
$b(\eta) = \sum_b c_b\,\psi_b(\eta)$ (`itde.function`), the operators on a grid must be the
rule's quadrature of the paper's integrals, term by term:

$$F(u)_{kj} = \sum_m w^z_m\, W_2(z_m, y_j)\,\rho\Big(\sum_i w^y_i\, W_1(y_i, z_m)\,u_{ki}
  + b_1(z_m)\Big) + b_2(y_j),$$

$$A(u)_{kj} = \sum_h \sum_p \gamma^h_{kp} \sum_r w^\eta_r\, W^O_h(\eta_r, y_j)\, V_h(x_p, \eta_r)
  + b^O(y_j),\quad
  \gamma^h_{kp} = \frac{w^x_p\, e^{s^h_{kp}}}{\sum_q w^x_q\, e^{s^h_{kq}}},\quad
  s^h_{kp} = \frac{\sum_r w^\eta_r\, Q_h(x_k, \eta_r)\, K_h(x_p, \eta_r)}{\sqrt{|\Omega_h|}},$$

with $Q_h(x_k, \eta_r) = \sum_i w^y_i\, W^Q_h(y_i, \eta_r)\, u_{ki} + b^Q_h(\eta_r)$ (and $K$,
$V$ alike). The references below are plain loops over these sums, with the bases and the
rules' nodes and weights written out from their definitions (NumPy's Gauss–Legendre
nodes, the trapezoid weights), never read from itde's sampled matrices. Every bias is
non-zero, so a bias sampled twice, or not at all, is a different number.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.function import (
    FourierBasis,
    FunctionAttention,
    FunctionBlock,
    FunctionFeedForward,
    FunctionField,
    LegendreBasis,
)

Y, H, Z, X = (0.0, 1.0), (0.0, 2.0), (0.0, 2 * math.pi), (-1.0, 1.0)
N_TOKENS, N_FEATURES, N_HEAD, N_HIDDEN = 5, 4, 3, 5
TOL = 1e-12  # float64, relative to the output's size


# ----------------------------------------------------------- bases and rules, written out
def legendre(n, interval, x):
    """Orthonormal Legendre polynomials on `interval`: sqrt((2k+1)/L) P_k(2(x-a)/L - 1)."""
    a, b = interval
    t = 2 * (np.asarray(x, float) - a) / (b - a) - 1
    return np.stack(
        [math.sqrt((2 * k + 1) / (b - a)) * np.polynomial.Legendre.basis(k)(t) for k in range(n)],
        axis=-1,
    )


def fourier(n, interval, x):
    """1/sqrt(L), then sqrt(2/L) cos(2 pi j s), sqrt(2/L) sin(2 pi j s), s = (x-a)/L."""
    a, b = interval
    L = b - a
    s = (np.asarray(x, float) - a) / L
    cols = [np.full_like(s, 1 / math.sqrt(L))]
    for j in range(1, n):
        cols += [math.sqrt(2 / L) * np.cos(2 * math.pi * j * s)]
        cols += [math.sqrt(2 / L) * np.sin(2 * math.pi * j * s)]
    return np.stack(cols[:n], axis=-1)


def gauss_legendre(n, interval):
    a, b = interval
    t, w = np.polynomial.legendre.leggauss(n)
    return a + (b - a) * (t + 1) / 2, (b - a) * w / 2


def trapezoid(n, interval):
    a, b = interval
    h = (b - a) / (n - 1)
    w = np.full(n, h)
    w[0] = w[-1] = h / 2
    return a + h * np.arange(n), w


def periodic_trapezoid(n, interval):
    a, b = interval
    return a + (b - a) * np.arange(n) / n, np.full(n, (b - a) / n)


def gelu(x):
    return 0.5 * x * (1 + math.erf(x / math.sqrt(2)))


def kernel(c, basis_in, basis_out, xi, eta):
    """W(xi, eta) = sum_ab c_ab phi_a(xi) psi_b(eta), as a double loop over the modes."""
    phi, psi = basis_in(xi), basis_out(eta)
    return sum(c[a, b] * phi[a] * psi[b] for a in range(c.shape[0]) for b in range(c.shape[1]))


def bias(c, basis, eta):
    psi = basis(eta)
    return sum(c[b] * psi[b] for b in range(c.shape[0]))


# ----------------------------------------------------------------------- the operators
KEY = jax.random.key(7)
BY = lambda x: legendre(4, Y, np.atleast_1d(x))[0]  # noqa: E731  feature basis
BH = lambda x: legendre(3, H, np.atleast_1d(x))[0]  # noqa: E731  head basis
BZ = lambda x: fourier(3, Z, np.atleast_1d(x))[0]  # noqa: E731  hidden basis


def _operators():
    att = FunctionAttention.init(
        KEY, n_heads=2, feature_basis=LegendreBasis(4, Y), head_basis=LegendreBasis(3, H),
        head_rule=itde.GaussLegendre(interval=H), n_head_nodes=N_HEAD, scale=0.7,
        dtype=jnp.float64,
    )  # fmt: skip
    ffn = FunctionFeedForward.init(
        jax.random.fold_in(KEY, 1), feature_basis=LegendreBasis(4, Y),
        hidden_basis=FourierBasis(3, Z), hidden_rule=itde.PeriodicTrapezoid(interval=Z),
        n_hidden_nodes=N_HIDDEN, activation="gelu", dtype=jnp.float64,
    )  # fmt: skip
    return att, ffn


GRID = itde.Grid(itde.Trapezoid(interval=X), itde.GaussLegendre(interval=Y), N_FEATURES)


def _state():
    field = FunctionField.init(
        jax.random.fold_in(KEY, 2), LegendreBasis(3, X), LegendreBasis(4, Y), dtype=jnp.float64
    )
    return np.asarray(field.sample_grid(GRID, N_TOKENS)), field


def _c(x):
    return np.asarray(x.coeffs, np.float64)


def feedforward_reference(ffn, u):
    y, wy = gauss_legendre(N_FEATURES, Y)
    z, wz = periodic_trapezoid(N_HIDDEN, Z)
    c1, c2, cb1, cb2 = _c(ffn.w1), _c(ffn.w2), _c(ffn.b1), _c(ffn.b2)
    out = np.zeros_like(u)
    for k in range(u.shape[0]):
        for j in range(N_FEATURES):
            total = bias(cb2, BY, y[j])
            for m in range(N_HIDDEN):
                inner = bias(cb1, BZ, z[m])
                for i in range(N_FEATURES):
                    inner += wy[i] * kernel(c1, BY, BZ, y[i], z[m]) * u[k, i]
                total += wz[m] * kernel(c2, BZ, BY, z[m], y[j]) * gelu(inner)
            out[k, j] = total
    return out


def attention_reference(att, u):
    y, wy = gauss_legendre(N_FEATURES, Y)
    eta, weta = gauss_legendre(N_HEAD, H)
    _, wx = trapezoid(N_TOKENS, X)
    n = u.shape[0]
    out = np.array([[bias(_c(att.bo), BY, y[j]) for j in range(N_FEATURES)]] * n)
    for h in range(att.n_heads):

        def transform(w, b, h=h):  # [tokens, head nodes]: the feature integral plus bias
            return np.array(
                [
                    [
                        bias(_c(b)[h], BH, eta[r])
                        + sum(
                            wy[i] * kernel(_c(w)[h], BY, BH, y[i], eta[r]) * u[p, i]
                            for i in range(N_FEATURES)
                        )
                        for r in range(N_HEAD)
                    ]
                    for p in range(n)
                ]
            )

        q, kk, v = (transform(w, b) for w, b in ((att.wq, att.bq), (att.wk, att.bk),
                                                  (att.wv, att.bv)))  # fmt: skip
        length = H[1] - H[0]
        for k in range(n):
            s = [sum(weta[r] * q[k, r] * kk[p, r] for r in range(N_HEAD)) / math.sqrt(length)
                 for p in range(n)]  # fmt: skip
            top = max(s)
            e = [wx[p] * math.exp(s[p] - top) for p in range(n)]
            gamma = [ep / sum(e) for ep in e]
            for j in range(N_FEATURES):
                out[k, j] += sum(
                    gamma[p]
                    * sum(
                        weta[r] * kernel(_c(att.wo)[h], BH, BY, eta[r], y[j]) * v[p, r]
                        for r in range(N_HEAD)
                    )
                    for p in range(n)
                )
    return out


def _close(out, ref):
    out = np.asarray(out)
    assert out.shape == ref.shape and out.dtype == np.float64
    err = np.max(np.abs(out - ref))
    assert err <= TOL * max(1.0, np.max(np.abs(ref))), err


def test_rules_and_bases_written_here_are_itdes():
    """The nodes the references use are those of the operators (so a difference below is
    the operators', not a different grid)."""
    np.testing.assert_allclose(
        GRID.features.nodes_weights(N_FEATURES), gauss_legendre(N_FEATURES, Y), atol=1e-15
    )
    att, ffn = _operators()
    np.testing.assert_allclose(att.head_nodes_weights(), gauss_legendre(N_HEAD, H), atol=1e-15)
    np.testing.assert_allclose(
        ffn.hidden_nodes_weights(), periodic_trapezoid(N_HIDDEN, Z), atol=1e-15
    )
    np.testing.assert_allclose(GRID.token_weights(N_TOKENS), trapezoid(N_TOKENS, X)[1])


def test_function_field_is_its_series_at_the_nodes():
    u, field = _state()
    x, _ = trapezoid(N_TOKENS, X)
    y, _ = gauss_legendre(N_FEATURES, Y)
    bx = lambda s: legendre(3, X, np.atleast_1d(s))[0]  # noqa: E731
    ref = np.array([[kernel(_c(field), bx, BY, xk, yj) for yj in y] for xk in x])
    _close(u, ref)


def test_function_feedforward_is_its_quadrature_sum():
    att, ffn = _operators()
    u, _ = _state()
    assert all(np.max(np.abs(_c(b))) > 0.1 for b in (ffn.b1, ffn.b2))
    _close(ffn(jnp.asarray(u), GRID), feedforward_reference(ffn, u))


def test_function_attention_is_its_quadrature_sum():
    att, _ = _operators()
    u, _ = _state()
    assert all(np.max(np.abs(_c(b))) > 0.1 for b in (att.bq, att.bk, att.bv, att.bo))
    _close(att(jnp.asarray(u), GRID), attention_reference(att, u))


@pytest.mark.parametrize("part", ["attention", "feedforward"])
def test_model_with_function_kernels_has_these_fields(part):
    """Inside a `TransformerIDE` (post-norm, residual form) the vector fields at a depth are
    the same quadrature sums: the equation's own route (`discretise`, the grid's weights)."""
    att, ffn = _operators()
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, 0.0)
    block = FunctionBlock(att, norm, ffn, norm)
    model = itde.TransformerIDE(itde.PiecewiseConstant(itde.stack([block])), GRID)
    u, _ = _state()
    if part == "attention":
        _close(model.attention_field(0.5, jnp.asarray(u)), attention_reference(att, u))
    else:
        _close(model.feedforward_field(0.5, jnp.asarray(u)), feedforward_reference(ffn, u))
