"""Eager solves at many token counts: one program per bucket, exact to round-off.

An eager `itde.solve` at N tokens pads the state to its bucket (powers of two), carries the
token rule's nodes and weights as data (padded nodes of weight zero, masked), and runs the
program compiled for the bucket. These tests hold the padded solve to the unpadded one
(float64: 1e-12 relative; float32: 1e-5) for several rules, causal and not; count the
programs a sweep inside one bucket compiles (a change that recompiles per N fails here);
and check that what cannot be padded still solves exactly, one program per N."""

import dataclasses

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde import GregoryVolterra

D = 8  # features


def _model(tokens=None, *, causal=False, dtype=jnp.float64, **kw):
    grid = None if tokens is None else itde.Grid(tokens, itde.Midpoint(), D)
    return itde.TransformerIDE.init(
        jax.random.key(0), n_layers=2, n_features=D, n_heads=2, n_hidden=16,
        activation="gelu", causal=causal, grid=grid, dtype=dtype, **kw,
    )  # fmt: skip


def _state(n, dtype=jnp.float64, seed=0):
    """A state drawn on the host (a JAX draw would compile a program per shape)."""
    return np.random.default_rng(seed + n).standard_normal((n, D)).astype(dtype)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


UNIT = (0.0, 1.0)
# (rule, causal, token counts inside one bucket): the unit grid (the discrete Transformer),
# rules whose weights are not uniform, and causal attention with each kind of Volterra
# weights (strict formulas, Gregory's signed one, the spectral matrix)
# (the non-causal rules with weights that are not uniform share one program at N <= 8)
CASES = {
    "unit-midpoint": (itde.Midpoint(), False, (5, 7)),
    "trapezoid": (itde.Trapezoid(interval=UNIT), False, (5,)),
    "gauss-legendre": (itde.GaussLegendre(interval=UNIT), False, (6,)),
    "simpson": (itde.Simpson(interval=UNIT), False, (7,)),
    "causal-unit-midpoint": (itde.Midpoint(), True, (6,)),
    "causal-trapezoid": (itde.Trapezoid(interval=UNIT), True, (7,)),
    "causal-gauss-legendre": (itde.GaussLegendre(interval=UNIT), True, (5, 7)),
    "causal-simpson": (itde.Simpson(interval=UNIT), True, (7,)),
}
# Every count is a compile of the exact solve. The default tier solves one count of three
# cases: the causal unit grid (the converted causal models'), non-causal weights that are
# not uniform (token log-weights as data) and the spectral Volterra matrix. The other
# rules' padded Volterra rows are checked without a solve
# (`test_padded_volterra_weights_keep_the_real_rows`), causal trapezoid is solved padded
# in `test_positions_are_data_too`, the non-causal unit grid in the float32 test, and the
# whole table (two counts of a bucket where given) is `slow`.
DEFAULT_CASES = {"gauss-legendre": 6, "causal-unit-midpoint": 6, "causal-gauss-legendre": 7}


def _check_padded_solve(case, ns):
    rule, causal, _ = CASES[case]
    model = _model(rule, causal=causal)
    for n in ns:
        assert itde.PowerOfTwoBuckets().size(n) > n or n == 8  # padded tokens exist
        u = _state(n)
        padded = itde.solve(model, u).ys
        exact = itde.solve(model, u, buckets=None).ys
        assert padded.shape == exact.shape == (1, n, D)
        assert _rel(padded, exact) < 1e-12, (case, n)


@pytest.mark.parametrize("case", list(DEFAULT_CASES))
def test_padded_solve_is_the_unpadded_one(case):
    _check_padded_solve(case, (DEFAULT_CASES[case],))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_padded_solve_is_the_unpadded_one_every_rule(case):
    _check_padded_solve(case, CASES[case][2])


def test_positions_are_data_too():
    """RoPE and a position bias read the token nodes, which are data of the padded program
    (the padded nodes repeat the last one); the blocked core's blocks split the padded
    tokens."""
    model = _model(itde.Trapezoid(interval=UNIT), causal=True, rope_base=100.0, head_dim=4)
    model = dataclasses.replace(
        model, attention_core=itde.Blocked(4), score_bias=itde.ALiBi.init(2)
    )
    u = _state(6)
    assert _rel(itde.solve(model, u).ys, itde.solve(model, u, buckets=None).ys) < 1e-12


def test_float32_padded_solve_is_the_unpadded_one():
    model = _model(dtype=jnp.float32)
    u = _state(5, jnp.float32)
    padded = itde.solve(model, u).ys
    assert padded.dtype == jnp.float32
    assert _rel(padded, itde.solve(model, u, buckets=None).ys) < 1e-5


def test_a_key_mask_and_a_batch_are_padded_too_and_one_program_serves_the_bucket():
    """A user's mask is extended with False; `batched` solves, `model.batch` (both layouts),
    `model(u)` and `trajectory` give the unpadded numbers (this model has no output map,
    so each is the batched solve's final state). Then the model's own entry points at the
    other counts of the bucket (N = 5, 7, 8; masked or not) compile nothing at all."""
    model = _model(itde.GaussLegendre(interval=UNIT))
    n = 6
    u = np.stack([_state(n), _state(n, seed=1)])
    mask = np.array([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0]])
    padded = itde.solve(model, u, batched=True, args=mask).ys
    exact = itde.solve(model, u, batched=True, args=mask != 0, buckets=None).ys
    assert _rel(padded, exact) < 1e-12
    ref = exact[-1]
    assert _rel(model.batch(u, mask), ref) < 1e-12
    tokens_first = dataclasses.replace(model, batch_axis=1)
    assert _rel(tokens_first.batch(np.moveaxis(u, 0, 1), mask), np.moveaxis(ref, 0, 1)) < 1e-12
    assert _rel(model(u[0], mask[0]), ref[0]) < 1e-12
    assert _rel(model.trajectory(u[1], mask[1])[-1], ref[1]) < 1e-12
    with itde.count_compilations() as c:
        for n in (5, 7, 8):
            jax.block_until_ready(model(_state(n), np.arange(n) % 4 != 3))
            jax.block_until_ready(model.batch(np.stack([_state(n)] * 2)))
            jax.block_until_ready(model.trajectory(_state(n)))
    assert c.count == 0


def test_many_token_counts_in_one_bucket_compile_one_program():
    """N = 9..16 share the bucket 16: the first solve compiles its program, the others
    compile nothing at all (no program of the library's, no eager operation's). A change
    that compiles per N fails this."""
    model = _model(itde.Trapezoid(interval=UNIT), causal=True)
    before = itde.programs.compiled
    with itde.count_compilations() as first:
        itde.solve(model, _state(9))
    assert itde.programs.compiled - before <= 1
    assert first.count <= 3  # the program, and diffrax's scalar constants once a process
    with itde.count_compilations() as rest:
        for n in range(10, 17):
            jax.block_until_ready(itde.solve(model, _state(n)).ys)
    assert rest.count == 0, f"{rest.count} programs compiled for N = 10..16"
    assert itde.programs.compiled - before <= 1


def test_rules_share_a_program_their_nodes_and_weights_are_data():
    """Trapezoid and Gauss-Legendre differ only in their nodes and weights: one program
    serves both at every N of a bucket."""
    u = _state(5)
    itde.solve(_model(itde.Trapezoid(interval=UNIT)), u)
    with itde.count_compilations() as c:
        itde.solve(_model(itde.GaussLegendre(interval=UNIT)), _state(7))
    assert c.count == 0


# ---------------------------------------------------------------- what is not padded
def test_what_is_not_padded_says_so_and_solves_exactly():
    """A sliding window (a static band of token indices), a `DiscreteBias` (one count) and
    causal Simpson below 4 nodes have no padded form; their eager solves are the exact
    ones, one program per N."""
    window = _model(window=itde.SlidingWindow(3.0), causal=True)
    assert window.padded_tokens(5, 8) is None
    bias = dataclasses.replace(_model(), score_bias=itde.DiscreteBias(jnp.zeros((2, 5, 5))))
    assert bias.padded_tokens(5, 8) is None
    assert _model(itde.Simpson(interval=UNIT), causal=True).padded_tokens(3, 8) is None
    assert GregoryVolterra(n=3, h=0.5).padded(8) is None
    grid2d = itde.TensorGrid2D(itde.Midpoint(), itde.Midpoint(), 2, 3)
    assert grid2d.padded(6, 8) is None
    before = itde.programs.compiled
    u = _state(5)
    exact = itde.solve(window, u, buckets=None).ys
    assert _rel(itde.solve(window, u).ys, exact) < 1e-12
    itde.solve(window, _state(6))
    # one program per N: the eager solve at 5 is the exact solve's program itself
    assert itde.programs.compiled - before == 2


def test_solve_options_that_would_see_the_padded_tokens_solve_exactly():
    """An adaptive controller's error norm and a saved `fn` of the state would count the
    padded tokens: those solves run at N itself, the exact solve's own program (a padded
    one would be a second program, its steps chosen from other errors)."""
    model = _model(block="pre_norm")
    u = _state(5)
    kw = dict(
        solver=diffrax.Tsit5(), dt0=0.5,
        stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-6),
    )  # fmt: skip
    before = itde.programs.compiled
    eager = itde.solve(model, u, **kw).ys
    exact = itde.solve(model, u, buckets=None, **kw).ys
    assert itde.programs.compiled - before <= 1
    assert eager.shape == (1, 5, D) and _rel(eager, exact) < 1e-12
    fn = diffrax.SaveAt(t1=True, fn=lambda t, y, a: jnp.sum(y**2))
    total = itde.solve(model, u, saveat=fn).ys
    assert _rel(total, jnp.sum(itde.solve(model, u).ys[-1] ** 2)) < 1e-12


# ---------------------------------------------------------------- the pieces
def test_padded_domain_holds_the_rules_nodes_and_weights_then_zeros():
    rule = itde.GaussLegendre(interval=UNIT)
    dom = rule.padded(5, 8)
    x, w = rule.nodes_weights(5)
    np.testing.assert_array_equal(np.asarray(dom.nodes)[:5], x)
    np.testing.assert_array_equal(np.asarray(dom.nodes)[5:], x[-1])
    np.testing.assert_array_equal(np.asarray(dom.weights), np.r_[w, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(dom.token_log_weights(8))[:5], np.log(w))
    assert itde.Midpoint().padded(5, 8).token_log_weights(8) is None  # uniform: no bias
    with pytest.raises(ValueError, match="8 nodes, but the state has 5"):
        dom.token_log_weights(5)
    with pytest.raises(ValueError, match="`n_padded`=4 is below the token count 5"):
        rule.padded(5, 4)
    with pytest.raises(ValueError, match="odd number of nodes"):
        itde.Simpson().padded(6, 8)


@pytest.mark.parametrize("name", ["midpoint", "trapezoid", "simpson", "gauss-legendre"])
def test_padded_volterra_weights_keep_the_real_rows(name):
    """Rows i < N of the padded partial-interval weights are the N-node ones (up to the
    spacing, which both integrals of each row carry) and read no padded node."""
    rule = itde.RULES[name](interval=UNIT)
    n = 7
    cw = rule.causal_weights(n)
    padded = rule.padded(n, 16, causal=True).volterra
    assert type(padded) is type(cw) and padded.n == 16
    W, P = cw.matrix(), padded.matrix()
    np.testing.assert_allclose(P[:n, :n], W, rtol=1e-14, atol=1e-15)
    assert np.all(P[:n, n:] == 0)


def test_buckets_and_their_errors():
    assert [itde.PowerOfTwoBuckets().size(n) for n in (1, 8, 9, 403)] == [8, 8, 16, 512]
    assert [itde.BlockBuckets(64).size(n) for n in (1, 64, 65)] == [64, 64, 128]
    with pytest.raises(TypeError, match="`buckets`='pow2' must be an itde bucket policy"):
        itde.solve(_model(), _state(5), buckets="pow2")
    with pytest.raises(ValueError, match="`smallest`=0 must be an integer >= 1"):
        itde.PowerOfTwoBuckets(0)
    out = itde.solve(_model(), _state(5), buckets=itde.BlockBuckets(4)).ys
    assert out.shape == (1, 5, D)


def test_a_nan_state_is_named_through_the_padded_program():
    u = _state(5)
    u[2, 3] = np.nan  # a padded program's check, as the exact solve's
    with pytest.raises(Exception, match="itde.solve: the initial state `u0` has a NaN"):
        itde.solve(_model(), u)


def test_under_a_trace_nothing_is_padded():
    model = _model(itde.GaussLegendre(interval=UNIT))
    u = _state(6)
    traced = jax.jit(lambda x: itde.solve(model, x).ys)(u)
    assert traced.shape == (1, 6, D)
    assert _rel(traced, itde.solve(model, u).ys) < 1e-12


def test_a_token_convergence_study_compiles_per_bucket_not_per_count():
    """`itde converge --axis tokens`: the grid solves are eager, so every token count of a
    bucket (and every rule of the same structure) shares one program. One rule, its causal
    row, three counts in the bucket 8: two programs for the grids and two for the
    references (9 Gauss-Legendre nodes), not one per count (eight)."""
    from itde.studies import run_grid_study
    from itde.studies._internal import ConvergeExperiment

    cfg = ConvergeExperiment()
    study = dataclasses.replace(
        cfg.study, axis="tokens", rules=("trapezoid",), nodes=(5, 6, 7), reference_nodes=9,
        layers=1, modes=3,
    )  # fmt: skip
    # counted as a difference (4 from nothing; fewer where a test of this process compiled
    # the same study), not from an emptied cache: emptying it would make every later test
    # of the process compile its programs again
    before = itde.programs.compiled
    res = run_grid_study(dataclasses.replace(cfg, study=study), "tokens", progress=False)
    assert [r["scheme"] for r in res["results"]] == ["trapezoid", "causal-trapezoid"]
    assert all(np.all(np.isfinite(r["errors"])) for r in res["results"])
    assert itde.programs.compiled - before <= 4, itde.programs


def test_an_analysis_solves_its_inputs_padded():
    """`itde.analysis.analyze` solves its inputs as an eager solve does (`_solve_all`): the
    exact states, and at a second token count of the bucket no new program."""
    from itde.analysis._internal import _solve_all, _solve_all_program

    model = _model()
    save = diffrax.SaveAt(ts=jnp.asarray([0.0, 1.0, 2.0]))  # analyze's: the layer boundaries
    fixed = dict(solver=None, dt0=None, terms=None)
    u = np.stack([_state(5), _state(5, seed=1)])
    exact = eqx.filter_jit(_solve_all_program)(model, u, None, save, fixed)  # traced: exact
    assert _rel(_solve_all(model, u, None, save, fixed), exact) < 1e-12  # the bucket's program
    with itde.count_compilations() as c:
        mask = np.arange(7) < np.array([[7], [6]])
        ys = _solve_all(model, np.stack([_state(7), _state(7, seed=1)]), mask, save, fixed)
    assert ys.shape == (2, 3, 7, D) and c.count == 0


@pytest.mark.slow  # analyze's geometry and spectra compile per count (not padded)
def test_an_analysis_at_a_new_token_count_reuses_its_solve():
    model = _model()
    itde.analysis.analyze(model, np.stack([_state(5), _state(5, seed=1)]))
    before = itde.programs.compiled
    u = np.stack([_state(7), _state(7, seed=1)])
    r = itde.analysis.analyze(model, u, mask=np.arange(7) < np.array([[7], [6]]))
    assert r["tokens"] == 7 and itde.programs.compiled == before
