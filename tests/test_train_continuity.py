"""Models that stay continuous (`[continuity]`): the consistency and transport terms of the
objective, and the distance to the refined solve logged at every evaluation, each checked
against a computation another way (`itde.solve` saving chosen depths, `predict` of the model
re-targeted with `with_depth`)."""

import json

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import itde
from itde.train import (
    ConfigError,
    DepthRegularisation,
    Run,
    TrainExperiment,
    continuity_metrics,
    from_dict,
    loss_fn,
    predict,
    regularised_loss,
    train,
    with_depth,
)

TABLE = {
    "task": {"name": "sort", "length": 5, "vocab": 6, "eval_size": 8},
    "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 8,
              "activation": "gelu", "scheme": "rk4", "dt": 0.5, "n_modes": 2, "eps": 0.0},
    "optim": {"steps": 2, "batch_size": 4, "warmup": 0},
    "run": {"log_every": 1, "eval_every": 2, "checkpoint_every": 2, "progress": False},
}  # fmt: skip


@pytest.fixture(scope="module")
def problem():
    cfg = from_dict(TrainExperiment, TABLE)
    run = Run(cfg)
    model, _ = run.init_state()
    model = jax.tree.map(lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating)
                         else a, model)  # fmt: skip
    x, y = run.batch(0)
    return run, model, x, y


def _outputs(model, x, dt):
    return np.asarray(predict(with_depth(model, dt=dt), x))


def _transport(model, x):
    """sum_k |u_{k+1} - u_k|^2 / h from the states `itde.solve` saves on the step grid."""
    h, T = model.dt, model.equation.depth
    grid = jnp.asarray(np.arange(0, T + h / 2, h))
    u0 = jax.vmap(model.initial_state)(x)
    solver = itde.SCHEMES[model.scheme]
    ys = jax.vmap(
        lambda u: (
            itde.solve(
                model.equation,
                u,
                solver=solver.make(),
                dt0=h,
                terms=solver.terms,
                saveat=diffrax.SaveAt(ts=grid),
            ).ys
        )
    )(u0)
    du = np.diff(np.asarray(ys), axis=1)  # [batch, steps, tokens, features]
    return float(np.mean(np.sum(du**2, axis=-1), axis=(0, 2)).sum() / h)


def test_objective_is_the_loss_plus_both_terms(problem):
    run, model, x, y = problem
    base = float(loss_fn(model, (x, y), run.task))
    coarse, fine = _outputs(model, x, 0.5), _outputs(model, x, 0.25)
    consistency = np.sum((coarse - fine) ** 2) / np.sum(fine**2)
    transport = _transport(model, x)
    assert consistency > 1e-12 and transport > 0.1  # both terms are there to be seen
    # (a smooth initialisation is close to its limit: consistency ~1e-9, so weighed up)
    for mu, lam in ((3e4, 0.0), (0.0, 0.2)):  # each term alone (their sum is linear)
        objective = eqx.filter_jit(regularised_loss)
        got = float(objective(model, (x, y), run.task, None, DepthRegularisation(mu, lam)))
        want = mu * consistency + lam * transport
        assert got - base == pytest.approx(want, rel=1e-7, abs=1e-13)


def test_logged_distance_is_that_of_the_refined_outputs(problem):
    run, model, x, _ = problem
    coarse, fine = _outputs(model, x, 0.5), _outputs(model, x, 0.5 / 8)
    m = continuity_metrics(model, x, 8)
    assert m["eval_continuum_distance"] == pytest.approx(
        np.linalg.norm(coarse - fine) / np.linalg.norm(fine), rel=1e-7
    )
    assert m["eval_transport"] == pytest.approx(_transport(model, x), rel=1e-9)


def test_training_with_a_term_logs_the_distance(tmp_path):
    """The step `train` runs carries the run's terms (the transport cost here: the cheaper
    compile; the terms themselves are checked above) and every evaluation logs the
    distance."""
    table = {**TABLE, "continuity": {"transport": 0.1, "refine": 4}}
    cfg = from_dict(TrainExperiment, table)
    train(cfg, out=tmp_path / "run")
    rows = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval_token_acc" in row]
    assert len(evals) == 1 and 0 < evals[0]["eval_continuum_distance"] < 1
    assert evals[0]["eval_transport"] > 0
    # the step trained the objective: the loss logged at step 1 is the regularised loss of
    # the initial model on batch 0, not the bare task loss
    run = Run(cfg)
    model0, _ = run.init_state()
    batch = run.batch(0)
    full = float(regularised_loss(model0, batch, run.task, None, run.regularisation))
    bare = float(loss_fn(model0, batch, run.task))
    assert rows[0]["step"] == 1 and rows[0]["loss"] == pytest.approx(full, rel=1e-5)
    assert abs(full - bare) > 1e-3 * abs(bare)


@pytest.mark.parametrize(
    ("continuity", "model", "said"),
    [
        ({"consistency": 1.0}, {"scheme": "lie", "dt": 1.0, "n_modes": None, "eps": None},
         "`continuity.consistency` > 0 asks a per-layer network"),
        ({"transport": 0.5}, {"scheme": "lie", "dt": 1.0, "n_modes": None, "eps": None},
         "`continuity.transport` > 0 asks a per-layer network"),
        ({"consistency": -1.0}, {}, "`continuity.consistency` must be a finite weight >= 0"),
        ({"transport": float("nan")}, {}, "`continuity.transport` must be a finite weight"),
        ({"refine": 1}, {}, "`continuity.refine`=1 must be an integer >= 2"),
    ],
)  # fmt: skip
def test_bad_continuity_settings_name_the_key(continuity, model, said):
    m = {k: v for k, v in {**TABLE["model"], **model}.items() if v is not None}
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        from_dict(TrainExperiment, {**TABLE, "model": m, "continuity": continuity})
