"""The paper's scheme (§3, substeps (3.5)-(3.10)) through diffrax: invariants, tracing."""

import chex
import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde_solvers import LieTrotter


def _model(d=16, d_ff=16, L=3, eps=0.0, form="relaxation", act="relu", causal=False, seed=0):
    return itde.TransformerIDE.init(
        jax.random.key(seed),
        n_layers=L,
        n_features=d,
        n_heads=4,
        n_hidden=d_ff,
        activation=act,
        eps=eps,
        block=itde.PostNorm(relaxation=form == "relaxation"),
        causal=causal,
    )


def _paper_table(model, u0):
    """The six substeps (3.5)-(3.10) written out literally (d_ff = d, weights I + W_j)."""
    d = model.n_features
    eye = jnp.eye(d)
    u = u0
    for n in range(model.n_layers):
        b = model.controls.layer(n)
        ff = b.feedforward
        W1, W2 = ff.w1 - eye, ff.w2 - eye  # the paper's W_j with standard weight I + W_j
        u1 = u + b.attention(u)  # (3.5) explicit Euler
        u2 = b.norm1(u1)  # (3.6) projection onto S1
        u3 = jnp.maximum(u2 + u2 @ W1 + ff.b1, 0.0)  # (3.7) semi-implicit, ReLU = P_S2
        u4 = u3 + u3 @ W2 + ff.b2  # (3.8) explicit
        u5 = 0.5 * (u4 + u2)  # (3.9) relaxation
        u = b.norm2(u5)  # (3.10) projection onto S1
    return u


@pytest.mark.parametrize("eps", [0.0, 1e-5])
def test_lie_step_with_dt_one_is_the_paper_table(eps):
    model = _model(eps=eps, form="relaxation")
    u0 = jax.random.normal(jax.random.key(1), (7, 16))
    np.testing.assert_allclose(
        np.asarray(model(u0)),
        np.asarray(jax.jit(lambda u: _paper_table(model, u))(u0)),  # jitted: not op by op
        atol=1e-12,
    )
    if eps == 0.0:  # then the residual form is the same block (P_S1 is scale invariant)
        res = itde.TransformerIDE(model.controls, model.grid, block=itde.PostNorm())
        np.testing.assert_allclose(np.asarray(res(u0)), np.asarray(model(u0)), atol=1e-12)


def test_every_saved_state_lies_on_S1():
    model = _model(eps=0.0, form="residual", L=4, act="gelu")
    u0 = jax.random.normal(jax.random.key(2), (9, 16)) * 3
    traj = model.trajectory(u0)
    for n in range(1, model.n_layers + 1):
        res = model.controls.layer(n - 1).norm2.residuals(traj[n])
        assert set(res) == {"mean", "var"}
        assert float(res["mean"]) < 1e-12 and float(res["var"]) < 1e-12
    u2 = model.project1(0.5, u0 + model.attention_field(0.0, u0))
    assert float(model.controls.layer(0).norm1.residual(u2)) < 1e-12


def test_half_steps_use_the_frozen_layer_controls():
    """dt = 1/2 with piecewise-constant controls: two Lie steps per layer, each with the
    controls of that layer (vector fields look right of t, projections left of t)."""
    model = _model(eps=1e-5, form="residual", L=3)
    u0 = jax.random.normal(jax.random.key(3), (5, 16))
    got = itde.solve(model, u0, dt0=0.5).ys[-1]

    @jax.jit  # the written-out steps, compiled once instead of op by op
    def by_hand(u):
        for n in range(model.n_layers):
            b = model.controls.layer(n)
            for _ in range(2):
                u = b.norm1(u + 0.5 * b.attention(u))
                u = b.norm2(u + 0.5 * b.feedforward(u))
        return u

    np.testing.assert_allclose(np.asarray(got), np.asarray(by_hand(u0)), atol=1e-12)


def test_forward_compiles_once_for_a_fixed_shape():
    @eqx.filter_jit
    @eqx.debug.assert_max_traces(max_traces=1)
    def forward(model, x):
        return jax.vmap(model)(x)

    m1, m2 = _model(seed=0, eps=1e-5), _model(seed=1, eps=1e-5)
    x = jnp.ones((2, 6, 16)) + jnp.arange(16.0)
    forward(m1, x)
    forward(m1, x * 2)
    forward(m2, x)  # same structure and shapes, new values: no retrace


def test_solve_with_diffrax_options():
    model = _model(eps=1e-5, form="residual", L=3)
    u0 = jax.random.normal(jax.random.key(4), (5, 16))
    sol = itde.solve(model, u0, solver=LieTrotter(), saveat=diffrax.SaveAt(steps=True))
    assert isinstance(sol, diffrax.Solution)
    assert sol.stats["num_steps"] == 3
    np.testing.assert_allclose(np.asarray(sol.ts), [1.0, 2.0, 3.0])
    np.testing.assert_allclose(np.asarray(sol.ys[-1]), np.asarray(model(u0)), atol=1e-13)


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "u0,match",
    [
        (jnp.ones((2, 5, 16)), r"shape \[tokens, 16\].*jax.vmap"),
        (jnp.ones((5, 12)), r"12 features but the model has 16"),
        (jnp.ones((5,)), r"one sequence"),
        (jnp.ones((5, 16), jnp.int32), r"floating-point"),
    ],
)
def test_bad_state_shapes(u0, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _model()(u0)


def test_non_finite_initial_state_is_an_error_not_a_nan():
    u0 = jnp.ones((5, 16)).at[2, 3].set(jnp.nan)
    with pytest.raises(Exception, match="NaN or infinite"):
        jax.block_until_ready(_model(eps=1e-5)(u0 + jnp.arange(16.0)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(dt0=0.0), r"`dt0`=0.0 must be a positive"),
        (dict(dt0=-1.0), r"`dt0`=-1.0"),
        (dict(t1=-2.0), r"`t1`=-2.0 must be finite and greater than t0"),
    ],
)
def test_bad_solve_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        itde.solve(_model(), jnp.ones((3, 16)), **kwargs)


def test_bad_model_arguments():
    with pytest.raises(ValueError, match=r"`n_heads`=5 does not divide.*`n_features`=16"):
        itde.TransformerIDE.init(jax.random.key(0), n_layers=1, n_features=16, n_heads=5)
    with pytest.raises(ValueError, match="n_layers"):
        itde.TransformerIDE.init(jax.random.key(0), n_layers=0, n_features=16, n_heads=4)
    with pytest.raises(TypeError, match="relaxation"):
        itde.PostNorm(relaxation="average")
    m = _model()
    with pytest.raises(ValueError, match=r"`grid.n_features`=12 does not match.*16"):
        itde.TransformerIDE(m.controls, itde.Grid.unit(12))


def test_lie_trotter_rejects_terms_that_do_not_fit():
    with pytest.raises(TypeError, match="SplitTerm"):
        diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, a: -y), LieTrotter(), 0.0, 1.0, 0.1, jnp.ones(3)
        )
    model = _model()
    with pytest.raises(ValueError, match="one solver per sub-flow"):
        itde.solve(
            model,
            jnp.ones((3, 16)) + jnp.arange(16.0),
            solver=LieTrotter(solvers=(diffrax.Euler(),)),
        )


# slow: by default test_family.py::test_one_compiled_model_serves_every_mask_under_vmap_
# batch_and_grad checks the batched solve against vmap, forward and gradient
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["paper", "tangent"])
def test_batched_solve_equals_vmap_forward_and_gradient(kind):
    import itde_solvers as solvers

    if kind == "paper":
        model = _model(eps=1e-5, form="residual", L=3)
        solve_kw = {}
    else:
        model = itde.TransformerIDE(
            itde.LegendreControls.init(
                jax.random.key(0), n_modes=2, n_features=16, n_heads=4, n_hidden=16, eps=0.0
            ),
            itde.Grid.unit(16),
        )
        solve_kw = dict(solver=solvers.Projected(solvers.RK4()), dt0=0.25)
    x = jax.random.normal(jax.random.key(9), (4, 6, 16))

    def one(m, u):
        return itde.solve(m, u, **solve_kw).ys[-1]

    def many(m, x):
        return itde.solve(m, x, batched=True, **solve_kw).ys[-1]

    np.testing.assert_allclose(
        np.asarray(many(model, x)), np.asarray(jax.vmap(lambda u: one(model, u))(x)), atol=1e-12
    )
    # jitted: an eager gradient through diffrax's loop dispatches op by op (~30 s here)
    g1 = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jnp.sin(many(m, x)))))(model)
    g2 = eqx.filter_jit(
        eqx.filter_grad(lambda m: jnp.sum(jnp.sin(jax.vmap(lambda u: one(m, u))(x))))
    )(model)
    chex.assert_trees_all_close(g1, g2, atol=1e-11, rtol=1e-10)
    if kind == "paper":
        np.testing.assert_allclose(
            np.asarray(model.batch(x)), np.asarray(jax.vmap(model)(x)), atol=1e-12
        )
    with pytest.raises(ValueError, match="batched=True"):
        itde.solve(model, x[0], batched=True)


def test_controls_part_is_that_operator_of_the_block():
    """A vector field evaluates only the operator it reads (`controls(t, side, part)`);
    that must be exactly the block's operator, for per-layer and smooth controls."""
    from itde._internal import BLOCK_PARTS

    per_layer = _model(L=3).controls
    smooth = itde.LegendreControls.init(
        jax.random.key(1), n_modes=2, n_features=8, n_heads=2, n_hidden=8, eps=0.0
    )
    for controls, t in ((per_layer, 1.0), (per_layer, 2.3), (smooth, 0.37)):
        for side in ("left", "right"):
            block = controls(t, side)
            for part in BLOCK_PARTS:
                chex.assert_trees_all_equal(controls(t, side, part), getattr(block, part))
    with pytest.raises(ValueError, match="`part`='ffn'.*feedforward"):
        per_layer(0.5, "right", "ffn")


# ------------------------------------------------------------- the scheme registry
#: The global orders of the methods, from their theory (not read from the code).
THEORY_ORDERS = {"lie": 1, "strang": 2, "parallel": 1, "euler": 1, "heun": 2, "midpoint": 2,
                 "rk4": 4, "tsit5": 5, "dopri5": 5, "dopri8": 8}  # fmt: skip


def test_each_scheme_reads_its_order_from_its_solver():
    """`Scheme.order` is the solver's own `order()` (nothing restated beside it), and it is
    each method's theoretical global order."""
    assert {name: s.order for name, s in itde.SCHEMES.items()} == THEORY_ORDERS
    assert all(s.name == name for name, s in itde.SCHEMES.items())


def test_solve_options_is_the_one_route_from_a_name_to_a_solve():
    """`solve_options`: the solver, its terms and the step, checked against the controls
    (per-layer: 'lie' only, a step of at most one layer; smooth: any scheme, at most T)."""
    net = _model(L=2)
    opts = itde.SCHEMES["lie"].solve_options(0.5, net.controls)
    assert isinstance(opts["solver"], LieTrotter) and opts == {**opts, "terms": "paper",
                                                                "dt0": 0.5}  # fmt: skip
    with pytest.raises(ValueError, match=r"`--dt`=1.5 is longer than one layer .*length 1\)"):
        itde.SCHEMES["lie"].solve_options(1.5, net.controls, name="--dt")
    with pytest.raises(ValueError, match=r"`scheme`='rk4' integrates the continuum equation"):
        itde.SCHEMES["rk4"].solve_options(0.5, net.controls)
    with pytest.raises(ValueError, match=r"`dt`=0 must be a positive depth step"):
        itde.SCHEMES["lie"].solve_options(0, net.controls)
    smooth = itde.LegendreControls(net.controls.values, 0.0, 2.0)  # smooth in depth, T = 2
    assert itde.SCHEMES["rk4"].solve_options(2.0, smooth)["dt0"] == 2.0
    with pytest.raises(ValueError, match=r"`dt`=2.5 is longer than the depth T \(2\)"):
        itde.SCHEMES["rk4"].solve_options(2.5, smooth)
    u0 = jax.random.normal(jax.random.key(1), (5, 16))
    ys = itde.solve(net, u0, **itde.SCHEMES["lie"].solve_options(0.5, net.controls)).ys[-1]
    chex.assert_trees_all_close(ys, itde.solve(net, u0, solver=LieTrotter(), dt0=0.5).ys[-1])
    with pytest.raises(ValueError, match=r"`name`='nope' is not known; choose one of \["):
        from itde._internal import scheme

        scheme("nope", what="`name`")
