"""Reverse-mode gradients through every continuous-depth scheme against central finite
differences, in float64.

A tiny continuum model (smooth Legendre controls, a moving constraint set
$S_1(\\sigma_1(t), \\sigma_2(t))$, the exact projection) is solved to depth 1 in two steps
with each scheme of `itde.SCHEMES`; `jax.grad` of a scalar of the final state, with
respect to every parameter and the initial state at once, is compared with the central
difference $(L(p + hv) - L(p - hv)) / 2h$ along one random direction $v$. The difference
quotient's error is $O(h^2) + O(\\varepsilon / h)$, about $10^{-9}$ relative here, so a
gradient that drops or doubles any path (a stop-gradient on the constraint's drift, a
projection left out of the backward pass) fails the $10^{-6}$ tolerance.

By default the splittings and one projected method of each order class run (Lie, Strang,
parallel, Heun, RK4: each a compile of a few seconds); the other projected methods, the same
code path with other tableaux, with `-m slow`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde

# the default run: the paper's splitting and one projected Runge-Kutta scheme (the others'
# gradients go through the same adjoint; Strang's is also checked in test_solvers_splitting)
DEFAULT = ("lie", "heun")
H = 1e-5  # the finite-difference step
RTOL = 1e-6


@pytest.fixture(scope="module")
def problem():
    key = jax.random.key(0)
    controls = itde.LegendreControls.init(
        key, n_modes=2, n_features=4, n_heads=2, n_hidden=4, activation="gelu", eps=0.0,
        sigma1=(0.0, 0.2), sigma2=(1.0, 0.3), dtype=jnp.float64,
    )  # fmt: skip
    model = itde.TransformerIDE(controls, itde.Grid.unit(4))
    f = jax.random.normal(jax.random.fold_in(key, 1), (3, 4), jnp.float64)
    return model, f


def test_every_scheme_is_covered():
    assert set(DEFAULT) <= set(itde.SCHEMES)


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in itde.SCHEMES]
)
def test_gradient_of_the_solve_matches_central_differences(problem, name):
    model, f = problem
    scheme = itde.SCHEMES[name]
    params, static = eqx.partition(model, eqx.is_inexact_array)
    weights = jnp.sin(jnp.arange(f.size, dtype=jnp.float64)).reshape(f.shape) + 1.5

    def loss(p):
        m, u0 = eqx.combine(p[0], static), p[1]
        # the initial condition projected onto S1(0) inside the loss, so that sigma(0)
        # acts on the solution the same way in every scheme's terms
        u = itde.solve(m, m.project(0.0, u0), solver=scheme.make(), terms=scheme.terms, dt0=0.5).ys[
            -1
        ]
        return jnp.sum(weights * jnp.sin(u))

    value_and_grad = jax.jit(jax.value_and_grad(loss))  # one compile serves every call
    p = (params, f)
    value, grad = value_and_grad(p)
    leaves, treedef = jax.tree.flatten(p)
    rng = np.random.default_rng(1)
    v = [rng.standard_normal(a.shape) for a in leaves]
    norm = np.sqrt(sum(np.sum(x**2) for x in v))
    v = [x / norm for x in v]

    def at(sign):
        shifted = [a + sign * H * x for a, x in zip(leaves, v, strict=True)]
        return float(value_and_grad(jax.tree.unflatten(treedef, shifted))[0])

    fd = (at(+1) - at(-1)) / (2 * H)
    ad = sum(
        float(np.sum(np.asarray(g) * x))
        for g, x in zip(treedef.flatten_up_to(grad), v, strict=True)
    )
    assert np.isfinite(float(value)) and abs(ad) > 1e-3  # a direction the loss changes along
    assert abs(fd - ad) <= RTOL * abs(ad), (name, fd, ad)
