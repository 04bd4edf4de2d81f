"""Multilevel training in depth: restriction and prolongation of per-layer controls against
numpy, the coarse network against one built by the public constructor, the optimiser's
moments on a switch, the `[multilevel]` table's errors, the loop's level switches and a
resume across a switch, bit for bit, and `itde eval --dt` at a coarser step."""

import dataclasses
import json
import tomllib
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from itde import PiecewiseConstant
from itde.train import (
    MOMENTS,
    PROLONGATIONS,
    RESTRICTIONS,
    ConfigError,
    LevelSchedule,
    Run,
    TrainExperiment,
    Transfer,
    coarsen,
    evaluate,
    from_dict,
    train,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "multilevel.toml"
# configs/multilevel.toml at a tiny size (the README's command with these `--set`s)
SMALL = {
    "task": {"context": 8, "eval_size": 16},
    "model": {"n_features": 8, "n_heads": 2, "n_hidden": 16},
    "optim": {"steps": 6, "batch_size": 8, "warmup": 1, "lr": 1e-2},
    "run": {"log_every": 1, "eval_every": 3, "checkpoint_every": 1, "progress": False},
}
SETS = [f"{t}.{k}={json.dumps(v)}" for t, kv in SMALL.items() for k, v in kv.items()]
TINY = tomllib.loads(CONFIG.read_text())
for _t, _kv in SMALL.items():
    TINY[_t].update(_kv)
del TINY["run"]["out"]


def _cfg(**tables):
    table = {k: dict(v) for k, v in TINY.items()}
    for k, v in tables.items():  # None: the table (or key) left out
        table[k] = None if v is None else {**table.get(k, {}), **v}
        if v is not None:
            table[k] = {key: x for key, x in table[k].items() if x is not None}
    table = {k: v for k, v in table.items() if v is not None}
    return from_dict(TrainExperiment, table)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The tiny multilevel run (2 layers at dt = 2 for 3 steps, then 4 at dt = 1)."""
    out = tmp_path_factory.mktemp("ml") / "full"
    return train(_cfg(), out=out), out


@pytest.fixture(scope="module")
def state(full_run):
    """A trained fine state: the run's model and AdamW state after its 6 steps."""
    result, _ = full_run
    return Run(_cfg()), result.model, result.opt_state


def _values(model):
    return [np.asarray(a) for a in jax.tree.leaves(model.equation.controls.values)]


# ----------------------------------------------------------------------- layer maps
@pytest.mark.parametrize(
    "name, ref",
    [("even", lambda a: a[0::2]), ("odd", lambda a: a[1::2]),
     ("mean", lambda a: (a[0::2] + a[1::2]) / 2)],
)  # fmt: skip
def test_restriction_picks_every_other_layer(state, name, ref):
    _, model, _ = state
    coarse = Transfer(restriction=RESTRICTIONS[name]).model(model, 2.0)
    assert coarse.dt == 2.0 and coarse.equation.controls.layer_length == 2.0
    assert coarse.equation.controls.n_layers == 2
    for a, c in zip(_values(model), _values(coarse), strict=True):
        np.testing.assert_allclose(c, ref(a), rtol=1e-6, atol=0)
    # what is not a control is untouched
    np.testing.assert_array_equal(coarse.embedding, model.embedding)


def test_prolongations_against_numpy(state):
    _, model, _ = state
    coarse = Transfer().model(model, 2.0)
    copy = Transfer(prolongation=PROLONGATIONS["copy"]).model(coarse, 1.0)
    linear = Transfer(prolongation=PROLONGATIONS["linear"]).model(coarse, 1.0)
    assert copy.equation.controls.layer_length == 1.0 and copy.dt == 1.0
    for c, p, q in zip(_values(coarse), _values(copy), _values(linear), strict=True):
        np.testing.assert_array_equal(p, np.repeat(c, 2, axis=0))
        # coarse midpoints 1, 3; fine midpoints 0.5, 1.5, 2.5, 3.5 (layer units)
        ref = np.apply_along_axis(lambda v: np.interp([0.5, 1.5, 2.5, 3.5], [1, 3], v), 0, c)
        np.testing.assert_allclose(q, ref, rtol=1e-6, atol=1e-7)


def test_coarse_network_is_the_constructed_one(state):
    """The restricted model computes what a model built by `PiecewiseConstant(...)` from
    the even layers, two layers long, run at dt = 2, computes."""
    run, model, _ = state
    pc = model.equation.controls
    even = jax.tree.map(lambda a: a[0::2], pc.values)
    built = PiecewiseConstant(even, t0=pc.t0, layer_length=2.0)
    equation = dataclasses.replace(model.equation, controls=built)
    ref = dataclasses.replace(model, equation=equation, dt=2.0)
    x = run.batch(0)[0]
    logits = eqx.filter_jit(lambda m, x: jax.vmap(m)(x))
    got = logits(coarsen(model, 2.0), x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(logits(ref, x)))
    # and differs from the fine network (a different computation)
    assert not np.allclose(np.asarray(got), np.asarray(logits(model, x)))


def test_coarsen_refuses_a_step_that_skips_part_of_a_layer_group(state):
    _, model, _ = state
    with pytest.raises(ValueError, match=r"`dt`=3 must be the step 1 times a divisor r of the 4"):
        coarsen(model, 3.0)
    with pytest.raises(ValueError, match=r"`restriction`='every' is not known"):
        coarsen(model, 2.0, "every")


def _moments(opt_state):
    """Adam's mu and nu trees in the optimiser state (model-shaped)."""
    found = []
    jax.tree.map(lambda x: found.append(x) if hasattr(x, "equation") else None, opt_state,
                 is_leaf=lambda x: hasattr(x, "equation"))  # fmt: skip
    return found


def test_moments_are_transferred_by_the_same_maps(state):
    _, model, opt_state = state
    fine = _moments(opt_state)
    assert len(fine) == 2  # mu and nu of the trained parameters
    coarse_model, coarse_state = Transfer(restriction=RESTRICTIONS["odd"])(model, opt_state, 2.0)
    coarse = _moments(coarse_state)
    for f, c in zip(fine, coarse, strict=True):
        for a, b in zip(_values(f), _values(c), strict=True):
            np.testing.assert_array_equal(b, a[1::2])
        np.testing.assert_array_equal(np.asarray(c.embedding), np.asarray(f.embedding))
    counts = [x for x in jax.tree.leaves(opt_state) if x.ndim == 0]
    assert counts and [int(x) for x in jax.tree.leaves(coarse_state) if x.ndim == 0] == [
        int(x) for x in counts
    ]
    # the coarse state works with the optimiser: structure equal to the coarse parameters'
    run = state[0]
    params = eqx.filter(coarse_model, eqx.is_inexact_array)
    grads = jax.tree.map(jnp.ones_like, params)
    jax.eval_shape(run.optimizer.update, grads, coarse_state, params)


def test_reset_moments_zero_and_keep_the_counts(state):
    _, model, opt_state = state
    _, reset = Transfer(moments=MOMENTS["reset"])(model, opt_state, 2.0)
    for m in _moments(reset):
        assert all(not np.asarray(a).any() for a in jax.tree.leaves(eqx.filter(m, eqx.is_array)))
    before = [int(x) for x in jax.tree.leaves(opt_state) if x.ndim == 0]
    assert [int(x) for x in jax.tree.leaves(reset) if x.ndim == 0] == before and max(before) == 6


def test_smooth_controls_keep_their_parameters():
    cfg = _cfg(model={"scheme": "rk4", "dt": 0.5, "n_modes": 2},
               multilevel={"layers": None, "dt": [2.0, 0.5], "shares": [0.5, 0.5]})  # fmt: skip
    run = Run(cfg)
    model, opt_state = run.init_state()
    coarse, state = run.at_level(model, opt_state, 0)
    assert coarse.dt == 2.0 and model.dt == 0.5
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(coarse), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------- the schedule
def test_schedule_from_shares():
    s = LevelSchedule.from_shares([4.0, 2.0, 1.0], [0.25, 0.25, 0.5], 10)
    assert s.ends == (2, 5, 10)
    assert [s.dt(i) for i in range(10)] == [4.0] * 2 + [2.0] * 3 + [1.0] * 5


@pytest.mark.parametrize(
    "table, message",
    [
        ({"layers": [3, 4]}, r"`multilevel.layers`: 3 does not divide `model.n_layers`=4"),
        ({"layers": None, "dt": [1.5, 1.0]},
         r"the level dt = 1.5 does not divide the depth T = `model.n_layers` = 4"),
        ({"shares": [0.5, 0.4]}, r"`multilevel.shares`=\[0.5, 0.4\] sum to 0.9; .* must sum to 1"),
        ({"shares": [1.0]}, r"has 1 entries for 2 levels"),
        ({"layers": [4, 2]}, r"the last level \(dt = 2\) must be the model's own `model.dt`=1"),
        ({"dt": [2.0, 1.0]}, r"`multilevel.dt`=\[2.0, 1.0\] and `multilevel.layers`=\[2, 4\] both"),
        ({"restriction": "every"},
         r"`multilevel.restriction`='every' is not known; choose one of \['even', 'mean', 'odd'\]"),
        ({"prolongation": "cubic"},
         r"`multilevel.prolongation`='cubic' is not known; choose one of \['copy', 'linear'\]"),
        ({"moments": "keep"},
         r"`multilevel.moments`='keep' is not known; choose one of \['reset', 'transfer'\]"),
        ({"shares": [0.0, 1.0]}, r"0.0 is not a positive level or share"),
    ],
)  # fmt: skip
def test_bad_schedules_are_clear_errors(table, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(multilevel=table)


def test_per_layer_level_must_keep_whole_layer_groups():
    """dt = 2 is 8 steps of 0.25: 8 layers do not fit in 4."""
    with pytest.raises(ConfigError, match=r"dt = 2 of a per-layer model must be `model.dt`=0.25 "
                       r"times a divisor r of `model.n_layers`=4"):  # fmt: skip
        _cfg(model={"dt": 0.25}, multilevel={"layers": None, "dt": [2.0, 0.25]})
    # the same steps on a continuous model are fine
    _cfg(model={"dt": 0.25, "scheme": "rk4"}, multilevel={"layers": None, "dt": [2.0, 0.25]})


# ----------------------------------------------------------------------- the loop
def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_metrics_record_level_dt_depth_steps_and_cost(full_run):
    result, out = full_run
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["level"] for r in rows] == [0, 0, 0, 1, 1, 1]
    assert [r["dt"] for r in rows] == [2.0] * 3 + [1.0] * 3
    assert [r["depth_steps"] for r in rows] == [2] * 3 + [4] * 3
    assert all(r["step_s"] > 0 for r in rows)
    assert result.model.equation.controls.n_layers == 4 and result.model.dt == 1.0


@pytest.mark.parametrize(
    "stop_at", [3, pytest.param(4, marks=pytest.mark.slow)], ids=["at-switch", "after-switch"]
)
def test_resume_across_a_switch_is_bitwise(full_run, tmp_path, stop_at):
    full, out = full_run
    part = tmp_path / "part"
    train(_cfg(), out=part, stop_at=stop_at)
    resumed = train(resume=part)
    for a, b in zip(jax.tree.leaves(full.model), jax.tree.leaves(resumed.model), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    losses = [(r["step"], r["loss"]) for r in _rows(out)]
    assert [(r["step"], r["loss"]) for r in _rows(part)] == losses


def test_eval_at_a_coarser_step(full_run, capsys):
    """`itde eval --dt 2` on a per-layer checkpoint: the even layers at twice the step,
    the loss of the model the public constructor builds from them."""
    from itde.cli import main

    result, out = full_run
    assert main(["eval", "--checkpoint", str(out), "--dt", "2"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["dt"] == 2.0
    model = result.model
    pc = model.equation.controls
    built = PiecewiseConstant(jax.tree.map(lambda a: a[0::2], pc.values), layer_length=2.0)
    equation = dataclasses.replace(model.equation, controls=built)
    ref = dataclasses.replace(model, equation=equation, dt=2.0)
    run = Run(_cfg())
    want = evaluate(ref, run.eval_chunks(), run.task)
    assert want and all(row[k] == pytest.approx(v, rel=1e-6) for k, v in want.items())


@pytest.mark.runs("train charlm")
def test_the_config_file_runs_as_the_readme_says(full_run, tmp_path):
    """`itde train --config configs/multilevel.toml` (tiny `--set`s) is the fixture's run:
    the same losses, bit for bit."""
    from itde.cli import main

    out = tmp_path / "cli"
    assert main(["train", "--config", str(CONFIG), "--out", str(out), "--no-progress",
                 *[x for s in SETS for x in ("--set", s)]]) == 0  # fmt: skip
    assert [r["loss"] for r in _rows(out)] == [r["loss"] for r in _rows(full_run[1])]
