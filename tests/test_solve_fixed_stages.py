"""A fixed-step projected RK4 solve read at step ends evaluates its field 4 times a step,
not 5 (the first-same-as-last stage feeds only the error estimate and dense output, and
`Projected` restarts every step), with the same solution as the five-stage method."""

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
import itde_solvers as solvers


@pytest.fixture(scope="module")
def ide():
    with jax.enable_x64(True):
        return itde.TransformerIDE.init(
            jax.random.key(0), n_features=8, n_heads=2, n_layers=2, dtype=jnp.float64
        ).continuum_form()


def _counted(ide):
    """The model's tangent field as one counting sub-flow, then its projection."""
    n = [0]
    field, *rest = ide.terms("tangent").terms

    def f(t, y, args):
        jax.debug.callback(lambda: n.__setitem__(0, n[0] + 1))
        return field.vf(t, y, args)

    return solvers.SplitTerm((diffrax.ODETerm(f), *rest)), n


def test_projected_rk4_fixed_steps_evaluate_four_stages(ide):
    with jax.enable_x64(True):
        u0 = jax.random.normal(jax.random.key(1), (5, 8), jnp.float64)
        terms, n = _counted(ide)
        solver = solvers.Projected(solvers.RK4())
        ends = itde.solve(ide, u0, solver=solver, dt0=1.0, terms=terms).ys[-1]
        assert n[0] == 2 * 4  # 2 steps, 4 stages each
        # the reference: SaveAt(ts=...) reads the dense output, which needs f(t1, y1), so
        # the five-stage method is kept; at a step end it is the step's own end point
        n[0] = 0
        ref = itde.solve(ide, u0, solver=solver, dt0=1.0, terms=terms,
                         saveat=diffrax.SaveAt(ts=[2.0])).ys[-1]  # fmt: skip
        assert n[0] == 2 * 5
        np.testing.assert_allclose(ends, ref, rtol=1e-12, atol=1e-12)


def test_without_error_estimate_is_rk4():
    assert solvers.RK4(scan_kind="bounded").without_error_estimate().scan_kind == "bounded"
    p = solvers.Projected(solvers.RK4(), reuse_fsal=True)
    assert p.for_fixed_steps() is p  # reusing the stage: nothing to drop
    q = solvers.Projected(diffrax.Heun())
    assert q.for_fixed_steps() is q  # not first-same-as-last: nothing to drop
    t = solvers.Projected(diffrax.Tsit5(scan_kind="lax")).for_fixed_steps().solver
    assert type(t).__name__ == "Tsit5Stages" and t.scan_kind == "lax"
    assert type(t) is type(solvers.Projected(diffrax.Tsit5()).for_fixed_steps().solver)
    assert t.order(None) == 5 and t.tableau.num_stages == 6


@pytest.mark.parametrize("method, stages", [
    (diffrax.Tsit5, 6), pytest.param(diffrax.Dopri5, 6, marks=pytest.mark.slow),
    pytest.param(diffrax.Dopri8, 13, marks=pytest.mark.slow),
])  # fmt: skip
def test_projected_fsal_methods_drop_their_last_stage(ide, method, stages):
    """Tsit5, Dopri5, Dopri8: their tableau without the last row on fixed steps read at
    step ends (one evaluation a step less), the same solution as the full method."""
    with jax.enable_x64(True):
        u0 = jax.random.normal(jax.random.key(1), (5, 8), jnp.float64)
        terms, n = _counted(ide)
        solver = solvers.Projected(method())
        ends = itde.solve(ide, u0, solver=solver, dt0=1.0, terms=terms).ys[-1]
        assert n[0] == 2 * stages
        n[0] = 0
        ref = itde.solve(ide, u0, solver=solver, dt0=1.0, terms=terms,
                         saveat=diffrax.SaveAt(ts=[2.0])).ys[-1]  # fmt: skip
        assert n[0] == 2 * (stages + 1)
        np.testing.assert_allclose(ends, ref, rtol=1e-12, atol=1e-12)
