"""The time `analyze` expects before it starts (`itde.analysis._estimate`): each stage's
operations counted from the model's shape, exactly as the module's table says, and the
price that turns them into seconds."""

import io
import math

import diffrax
import jax
import jax.numpy as jnp
import pytest

import itde
from itde.analysis import analyze
from itde.analysis._internal import _estimate

L, D, H, E, F = 3, 8, 2, 4, 12  # layers, features, heads, head size, hidden


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "gated"])
def eq(request):
    return itde.TransformerIDE.init(jax.random.key(3), n_layers=L, n_features=D, n_heads=H,
                                    n_hidden=F, gated=request.param)  # fmt: skip


def _c(n, gated):
    """One field evaluation on n tokens, counted by hand: W^Q, W^K, W^V, W^O (d x d each
    here) and two or three feed-forward kernels (d x hidden), then the scores and the
    weighted values of every head."""
    kernels = 4 * D * D + (3 if gated else 2) * D * F
    return 2 * n * kernels + 2 * n * n * H * (E + E)


def test_each_stage_counts_what_the_table_says(eq):
    gated = eq.controls.layer(0).feedforward.__class__.__name__.startswith("Gated")
    ts = [float(t) for t in range(L + 1)]
    B, N, n, k, p = 3, 7, 5, 6, 2
    ops = _estimate.operations(eq, ts, inputs=B, tokens=N, n_real=n, features=D, solver=None,
                               dt0=None, lyapunov=True, token_vjps=True, block=p,
                               iters=k)  # fmt: skip
    assert ops["solve"] == B * L * _c(N, gated)
    assert ops["geometry"] == 2 * B * (L + 1) * _c(N, gated)
    assert ops["spectra"] == L * (10 * D**3 + 6 * D * D * F)
    assert ops["interval"] == pytest.approx(L * 3 * k * p * _c(n, gated))  # one layer each
    assert ops["whole"] == 3 * k * p * L * _c(n, gated)
    assert ops["tokens"] == D * L * _c(n, gated)  # `features` VJPs through the depth
    power = _estimate.operations(eq, ts, inputs=B, tokens=N, n_real=n, features=D,
                                 solver=None, dt0=None, lyapunov=True, token_vjps=False,
                                 block=p, iters=k)  # fmt: skip
    assert power["tokens"] == 3 * k * p * n * L * _c(n, gated)  # a block on every token
    none = _estimate.operations(eq, ts, inputs=B, tokens=N, n_real=n, features=D, solver=None,
                                dt0=None, lyapunov=False, token_vjps=True, block=p,
                                iters=k)  # fmt: skip
    assert set(none) == {"solve", "geometry", "spectra"}


@pytest.mark.parametrize(
    ("solver", "dt0", "per_layer"),
    [(None, None, 1), (None, 0.5, 2), (diffrax.Heun(), 0.5, 2 * 2), (diffrax.Tsit5(), 0.5, 2 * 6),
     (diffrax.Tsit5(), 1.0, 6), (diffrax.Euler(), 0.25, 4)],
)  # fmt: skip
def test_evaluations_count_steps_and_the_stages_that_reach_the_solution(eq, solver, dt0,
                                                                         per_layer):  # fmt: skip
    """One a layer for the network; steps x stages of an explicit Runge-Kutta method, its
    first-same-as-last stage left out (Tsit5: 6 of 7)."""
    assert _estimate.evaluations(eq, 0.0, float(L), solver, dt0) == L * per_layer
    assert _estimate.evaluations(eq, 1.0, 2.0, solver, dt0) == per_layer


def test_seconds_price_operations_and_compilations(monkeypatch):
    """Operations at `rate` operations a second, slowed by the stage's efficiency, plus the
    stage's compilation in units of the reference one: on tables of round numbers, each
    stage's seconds worked out by hand (3e10 operations at 1e10/s and efficiency 0.5: 6 s,
    plus 4 x 0.25 s of compilation)."""
    monkeypatch.setattr(_estimate, "_EFFICIENCY", {"solve": 0.5, "tokens": 0.25})
    monkeypatch.setattr(_estimate, "_COMPILE", {"solve": 4.0, "tokens": 2.0})
    got = _estimate.seconds({"solve": 3e10, "tokens": 5e9}, rate=1e10, compile_s=0.25)
    assert got == pytest.approx({"solve": 6.0 + 1.0, "tokens": 2.0 + 0.5}, rel=1e-12)


def test_every_stage_has_a_price(eq):
    """The tables price every stage `operations` counts, with an efficiency at most the
    probe's own (a fraction of a large product's rate) and a positive compilation."""
    ts = [float(t) for t in range(L + 1)]
    ops = _estimate.operations(eq, ts, inputs=1, tokens=4, n_real=4, features=D, solver=None,
                               dt0=None, lyapunov=True, token_vjps=True, block=1,
                               iters=1)  # fmt: skip
    assert set(ops) == set(_estimate._EFFICIENCY) == set(_estimate._COMPILE)
    assert all(0 < e <= 1 for e in _estimate._EFFICIENCY.values())
    assert all(c > 0 for c in _estimate._COMPILE.values())


def test_probe_measures_a_rate_and_a_compilation():
    rate, compile_s = _estimate._probe(jnp.float32)
    assert math.isfinite(rate) and rate > 1e7  # any CPU multiplies faster than 10 MFLOP/s
    assert 0 < compile_s < 60


def test_expected_time_grows_with_the_iterations(eq):
    ts = [float(t) for t in range(L + 1)]
    shape = dict(inputs=2, tokens=6, n_real=6, features=D, dtype=jnp.float32, solver=None,
                 dt0=None, token_vjps=True, block=2)  # fmt: skip
    typical, bound = _estimate.expected(eq, ts, lyapunov=True, max_iters=100, **shape)
    assert 0 < typical < bound
    t5, b5 = _estimate.expected(eq, ts, lyapunov=True, max_iters=5, **shape)
    assert t5 == pytest.approx(b5, rel=0.5)  # both at 5 iterations: only the probe differs


def test_analyze_says_the_expected_time_first():
    """`analyze(progress=...)` says the expected time before its first stage (on the plain
    model: the gated one's line is the same code; its count is checked above)."""
    eq = itde.TransformerIDE.init(jax.random.key(3), n_layers=L, n_features=D, n_heads=H,
                                  n_hidden=F)  # fmt: skip
    buf = io.StringIO()
    u0 = jax.random.normal(jax.random.key(0), (2, 6, D))
    analyze(eq, u0, lyapunov=False, progress=buf)
    lines = buf.getvalue().splitlines()
    assert lines[1].startswith("itde analyze: expects about ") and "at most" not in lines[1]
    assert lines[2].startswith("itde analyze: solve ")
