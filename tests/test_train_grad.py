"""The gradient of the whole training loss (embedding, depth solve, readout, loss) against
central finite differences in float64, leaf by leaf, for the discrete Transformer regime
(Lie, per-layer controls) and for continuous depth (RK4 and Strang on Legendre controls)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from itde.train import TASKS, TrainExperiment, build_model, from_dict, loss_fn

CASES = {
    "lie-sort": {
        "task": {"name": "sort", "length": 4, "vocab": 5},
        "model": {"n_layers": 2, "n_features": 4, "n_heads": 2, "n_hidden": 6,
                  "activation": "gelu"},
    },
    "rk4-burgers": {
        "task": {"name": "burgers", "n_grid": 8, "n_modes": 2},
        "model": {"n_layers": 1, "n_features": 4, "n_heads": 2, "n_hidden": 6, "activation": "gelu",
                  "scheme": "rk4", "dt": 0.5, "n_modes": 2},
    },
    "strang-charlm": {
        "task": {"name": "charlm", "context": 5},
        "model": {"n_layers": 1, "n_features": 4, "n_heads": 1, "n_hidden": 4, "activation": "gelu",
                  "scheme": "strang", "dt": 0.5},
    },
}  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [
        "lie-sort",
        # the continuous-depth cases compile a float64 RK4 / Strang solve (~15 s each)
        pytest.param("rk4-burgers", marks=pytest.mark.slow),
        pytest.param("strang-charlm", marks=pytest.mark.slow),
    ],
)
def test_training_loss_gradient_matches_central_differences(name):
    cfg = from_dict(TrainExperiment, CASES[name])
    task = TASKS[cfg.task.name](cfg.task)
    model = build_model(cfg, jax.random.key(0), task=task, dtype=jnp.float64)
    x, y = task.train_batch(jax.random.key(1), 3)
    if x.dtype == np.float32:
        x, y = x.astype(np.float64), y.astype(np.float64)
    batch = (jnp.asarray(x), jnp.asarray(y))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    assert all(p.dtype == jnp.float64 for p in jax.tree.leaves(params))

    @jax.jit
    def loss(p):
        return loss_fn(eqx.combine(p, static), batch, task)

    grads = jax.jit(jax.grad(loss))(params)
    leaves, treedef = jax.tree.flatten(params)
    g_leaves = treedef.flatten_up_to(grads)
    rng = np.random.default_rng(0)
    h = 1e-5
    checked = 0
    for i, (leaf, g) in enumerate(zip(leaves, g_leaves, strict=True)):
        v = rng.standard_normal(leaf.shape)
        v /= max(np.linalg.norm(v), 1e-300)

        def shifted(sign, i=i, v=v):
            ls = list(leaves)
            ls[i] = leaves[i] + sign * h * v
            return float(loss(jax.tree.unflatten(treedef, ls)))

        fd = (shifted(+1) - shifted(-1)) / (2 * h)
        ad = float(np.sum(np.asarray(g) * v))
        assert abs(fd - ad) <= 1e-6 * max(1.0, abs(ad)), (name, i, fd, ad)
        checked += abs(ad) > 1e-8
    assert checked >= len(leaves) // 2  # the check is not vacuous
