"""bfloat16: times stay float32, statistics float32, products bfloat16; results agree with
float32 within a bound stated from bfloat16's unit round-off."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
import itde_solvers

KEY = jax.random.PRNGKey(0)
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7: the spacing of bfloat16 numbers at 1


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


def _legendre_model(t1=1.0):
    c = itde.LegendreControls.init(KEY, n_modes=3, n_features=8, n_heads=2, n_hidden=16,
                                   activation="gelu", t1=t1, dtype=jnp.float32)  # fmt: skip
    return itde.TransformerIDE(c, itde.Grid.unit(8))


def test_bfloat16_times_do_not_collapse():
    """dt = 0.02 over T = 6: 301 times, 265 distinct in bfloat16 (StepTo failed)."""
    assert len(np.unique(np.asarray(jnp.arange(301) * 0.02, jnp.bfloat16))) < 301
    m = _cast(_legendre_model(t1=6.0), jnp.bfloat16)
    x = jax.random.normal(KEY, (4, 8)).astype(jnp.bfloat16)
    sol = itde.solve(m, x, dt0=0.02, solver=itde_solvers.Projected(itde_solvers.RK4()))
    assert int(sol.stats["num_steps"]) == 300
    assert bool(jnp.all(jnp.isfinite(sol.ys)))


# One discrete (Lie within layers) and one continuous (projected RK4) case by default; Lie
# at dt = 1 (the layer stack, a special case of dt = 1/4) and Strang run with -m slow.
@pytest.mark.parametrize(
    "scheme, dt0",
    [
        pytest.param("lie", 1.0, marks=pytest.mark.slow),
        ("lie", 0.25),
        pytest.param("strang", 0.25, marks=pytest.mark.slow),
        ("rk4", 0.25),
    ],
)
def test_bfloat16_agrees_with_float32(scheme, dt0):
    """Parameters and input rounded to bfloat16 perturb the model by a relative 2**-8;
    products in bfloat16 add a few such roundings per layer. The bound, 8 * 2**-7 of the
    state's size (the state has unit RMS on the constraint set), leaves room for that and
    fails for a path that computes LayerNorm statistics or the depth in bfloat16."""
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 8), jnp.float32)
    if scheme == "lie":
        m32 = itde.TransformerIDE.init(KEY, n_layers=2, n_features=8, n_heads=2, n_hidden=16,
                                       dtype=jnp.float32)  # fmt: skip
        solver = itde_solvers.LieTrotter()
    else:
        m32 = _legendre_model()
        solver = itde_solvers.Strang() if scheme == "strang" else itde_solvers.Projected(
            itde_solvers.RK4())  # fmt: skip
    m16 = _cast(m32, jnp.bfloat16)
    ref = itde.solve(m32, x, dt0=dt0, solver=solver).ys[-1]
    got = itde.solve(m16, x.astype(jnp.bfloat16), dt0=dt0, solver=solver).ys[-1]
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)))
    scale = float(jnp.max(jnp.abs(ref)))
    assert err < 8 * BF16_EPS * scale, (err, scale)
    # and the bfloat16 path is really different from float32 (products ran in bfloat16)
    assert err > 0


def test_model_call_returns_the_input_dtype():
    m = _cast(itde.TransformerIDE.init(KEY, n_layers=2, n_features=8, n_heads=2, n_hidden=16,
                                       dtype=jnp.float32), jnp.bfloat16)  # fmt: skip
    x = jax.random.normal(KEY, (3, 5, 8)).astype(jnp.bfloat16)
    assert m(x[0]).dtype == jnp.bfloat16
    assert m.batch(x).dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(m.batch(x), np.float32),
                               np.asarray(jax.vmap(m)(x), np.float32), atol=0)  # fmt: skip


def test_layernorm_statistics_are_float32_in_bfloat16():
    """A token with a large mean: bfloat16 statistics lose its variance entirely."""
    norm = itde.LayerNormProjection(0.0, 1.0, None, None, eps=1e-5)
    u32 = 100.0 + jnp.linspace(-1.0, 1.0, 8)[None, :]
    u16 = u32.astype(jnp.bfloat16)
    got = norm(u16)
    assert got.dtype == jnp.bfloat16
    ref = norm(u16.astype(jnp.float32))  # the same bfloat16 input, float32 statistics
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=2 * BF16_EPS * 2)


def test_numpy_finfo_knows_bfloat16_and_the_floor_of_ml_dtypes_says_so():
    """`np.finfo(bfloat16)` (itde.solve's overflow check, the plots) needs ml_dtypes 0.7,
    above the 0.5 jax asks for: pyproject.toml's dependencies hold that floor, which
    .ci/min-versions installs and tests."""
    import tomllib
    from pathlib import Path

    from packaging.requirements import Requirement

    info = np.finfo(jnp.bfloat16)
    assert float(info.eps) == 2.0**-7 and float(info.max) == (2 - 2.0**-7) * 2.0**127
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    deps = [Requirement(r) for r in tomllib.loads(pyproject.read_text())["project"]["dependencies"]]
    (ml,) = [r for r in deps if r.name.replace("_", "-") == "ml-dtypes"]
    assert ml.specifier.contains("0.7.0") and not ml.specifier.contains("0.6.99"), ml
