"""`itde.analysis.interaction_energy` against the particle model's formula evaluated in
50-digit arithmetic (mpmath), at non-uniform feature weights, at inverse temperatures where
e^beta alone overflows the dtype but the energy does not, for tokens of any scale; and the
states it cannot take (a real token of zero norm, no real token) refused by name."""

import equinox as eqx
import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest

import itde.analysis as A

mpmath.mp.dps = 50


def _reference(u, beta, mask=None, w=None) -> mpmath.mpf:
    r"""$E_\beta = \frac{1}{2\beta n^2}\sum_{i,j} e^{\beta\langle x_i, x_j\rangle_w}$ with
    $x_i = u_i / \|u_i\|_w$, $\langle a, b\rangle_w = \sum_k w_k a_k b_k$ (w = 1: the dot
    product), over the real tokens, every entry an exact binary float taken into mpmath."""
    u = np.asarray(u, np.float64)
    rows = [u[i] for i in range(u.shape[0]) if mask is None or mask[i]]
    d = u.shape[1]
    w = [mpmath.mpf(1)] * d if w is None else [mpmath.mpf(float(x)) for x in w]
    xs = []
    for r in rows:
        r = [mpmath.mpf(float(v)) for v in r]
        norm = mpmath.sqrt(mpmath.fsum(w[k] * r[k] ** 2 for k in range(d)))
        xs.append([v / norm for v in r])
    b = mpmath.mpf(float(beta))
    total = mpmath.fsum(
        mpmath.exp(b * mpmath.fsum(w[k] * xi[k] * xj[k] for k in range(d)))
        for xi in xs
        for xj in xs
    )
    return total / (2 * b * len(xs) ** 2)


def test_energy_with_non_uniform_feature_weights_is_the_weighted_formula():
    """Unit weights cannot tell w from w^2 or sqrt(w) in the inner product or the norm:
    weights from 0.2 to 3 and a mask, against the formula in mpmath."""
    r = np.random.default_rng(4)
    u = r.normal(size=(6, 5))
    w = np.array([0.2, 3.0, 1.0, 0.5, 2.2])
    mask = np.array([True, False, True, True, True, False])
    for beta in (0.7, 3.0):
        want = float(_reference(u, beta, mask, w))
        got = A.interaction_energy(jnp.asarray(u), beta, mask, feature_weights=w)
        np.testing.assert_allclose(float(got), want, rtol=1e-13)
        # and w^2 would be another number (far beyond the tolerance): the weights matter
        assert abs(float(_reference(u, beta, mask, w**2)) / want - 1) > 1e-3
    trace = A.energy_along(jnp.stack([jnp.asarray(u), jnp.asarray(2 * u[::-1])]), 3.0,
                           mask, feature_weights=w)  # fmt: skip
    want = [float(_reference(u, 3.0, mask, w)), float(_reference(2 * u[::-1], 3.0, mask, w))]
    np.testing.assert_allclose(np.asarray(trace.energies), want, rtol=1e-13)


@pytest.mark.parametrize(("dtype", "beta", "rtol"), [(np.float32, 89.0, 1e-4),
                                                      (np.float64, 710.0, 1e-11)])  # fmt: skip
def test_energy_is_finite_where_e_to_the_beta_alone_overflows(dtype, beta, rtol):
    """e^89 overflows float32 and e^710 float64, but the energies (~1e35 and ~1e304) are
    representable: the value, not inf. (Relative accuracy: beta times the dtype's
    round-off of the cosines.)"""
    u = np.random.default_rng(5).normal(size=(4, 3)).astype(dtype)
    want = _reference(u, beta)
    assert float(want) < np.finfo(dtype).max  # representable
    got = A.interaction_energy(jnp.asarray(u), beta)
    assert got.dtype == dtype and np.isfinite(float(got))
    np.testing.assert_allclose(float(got), float(want), rtol=rtol)


def test_energy_of_tokens_of_any_scale():
    """Each token is normalised, so its scale cannot matter: tokens of 1e-30 and 1e30 in
    float32 (whose squares underflow and overflow) give the energy of the unit tokens."""
    u = np.random.default_rng(6).normal(size=(4, 3)).astype(np.float32)
    scales = np.array([1e-30, 1.0, 1e30, 3.0], np.float32)[:, None]
    want = float(_reference(u, 2.5))
    got = A.interaction_energy(jnp.asarray(u * scales), 2.5)
    np.testing.assert_allclose(float(got), want, rtol=1e-6)


def test_a_zero_token_is_refused_by_name_and_a_masked_one_is_left_out():
    u = np.random.default_rng(7).normal(size=(5, 3))
    u[1] = 0.0
    with pytest.raises(ValueError, match=r"real token of `u` is zero \(token 1\).*`mask` False"):
        A.interaction_energy(jnp.asarray(u), 2.0)
    mask = np.array([True, False, True, True, True])
    np.testing.assert_allclose(
        float(A.interaction_energy(jnp.asarray(u), 2.0, mask)), float(_reference(u, 2.0, mask)),
        rtol=1e-13,
    )
    us = jnp.stack([jnp.ones((5, 3)), jnp.asarray(u)])
    with pytest.raises(ValueError, match=r"`us` is zero \(\(depth, token\) \(1, 1\)\)"):
        A.energy_along(us, 2.0)
    with pytest.raises(ValueError, match=r"`mask` leaves no real token"):
        A.interaction_energy(jnp.asarray(u), 2.0, np.zeros(5, bool))
    # traced (inside a jit), the same refusal at run time instead of a NaN
    with pytest.raises(Exception, match=r"real token of `u` is zero"):
        jax.block_until_ready(eqx.filter_jit(A.interaction_energy)(jnp.asarray(u), 2.0))


def test_a_nested_list_is_a_state():
    u = np.random.default_rng(8).normal(size=(3, 4))
    got = A.interaction_energy(u.tolist(), 1.5)
    np.testing.assert_allclose(float(got), float(_reference(u, 1.5)), rtol=1e-13)


def test_energy_trace_pins_the_violation_and_its_relative_size():
    """A trajectory whose energy rises, falls by less than it rose, then rises and falls
    again (clusters formed and broken by hand): `increments`, `violation` (the largest
    fall) and `relative_violation` (over the total rise max E - E_0, or over E_0 when it
    never rises) against the formula in mpmath."""
    r = np.random.default_rng(9)
    spread = r.normal(size=(4, 3))
    direction = r.normal(size=3)

    def towards(a):  # a = 0: spread tokens; a = 1: one cluster
        return (1 - a) * spread + a * direction

    us = np.stack([towards(a) for a in (0.0, 0.7, 0.4, 0.9, 0.5)])
    beta = 1.3
    e = np.array([float(_reference(u, beta)) for u in us])
    inc = np.diff(e)
    assert inc[0] > 0 and inc[1] < 0 and inc[2] > 0 and inc[3] < 0  # the shape assumed
    tr = A.energy_along(jnp.asarray(us), beta)
    np.testing.assert_allclose(np.asarray(tr.energies), e, rtol=1e-13)
    np.testing.assert_allclose(np.asarray(tr.increments), inc, rtol=1e-11)
    fall = max(-inc)
    assert float(tr.violation) == pytest.approx(fall, rel=1e-11)
    assert float(tr.relative_violation) == pytest.approx(fall / (e.max() - e[0]), rel=1e-11)
    # never rising: relative to E_0
    e3 = e[[3, 2, 0]]
    assert e3[1] < e3[0] and e3[2] < e3[1]
    down = A.energy_along(jnp.asarray(us[[3, 2, 0]]), beta)
    fall = max(e3[0] - e3[1], e3[1] - e3[2])
    assert float(down.violation) == pytest.approx(fall, rel=1e-11)
    assert float(down.relative_violation) == pytest.approx(fall / e3[0], rel=1e-11)
