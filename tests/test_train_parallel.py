"""Data parallelism: the batch sharded over two (forced host) CPU devices gives the same
training step as one device, to round-off; a batch the devices do not divide is refused.

`XLA_FLAGS=--xla_force_host_platform_device_count=2` must be set before JAX starts, so the
checks run in a fresh Python process. By default a tiny model's loss and gradient (one
compile per mesh); with `-m slow`, three optimiser steps of a larger one."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, equinox as eqx
    assert len(jax.devices()) == 2, jax.devices()
    from itde.train import Run, TrainExperiment, from_dict, loss_fn, make_step, place

    table = {
        "task": {"name": "sort", "length": 6, "vocab": 7, "eval_size": 8},
        "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 16},
        "optim": {"steps": 10, "batch_size": 8, "warmup": 1},
    }
    cfg = from_dict(TrainExperiment, table)
    out = {}
    for n in (1, 2):
        run = Run(cfg, devices=jax.devices()[:n])
        model, opt = run.init_state()
        model, opt = place(model, run.replicated), place(opt, run.replicated)
        step = make_step(run.optimizer, run.task)
        grads = eqx.filter_jit(eqx.filter_grad(loss_fn))(model, run.batch(0), run.task)
        losses = []
        for s in range(3):
            batch = run.batch(s)
            assert len(batch[0].sharding.device_set) == n
            assert batch[0].addressable_shards[0].data.shape[0] == 8 // n
            model, opt, loss = step(model, opt, batch)
            losses.append(float(loss))
        leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(model, eqx.is_array))
        assert len(leaves[0][1].sharding.device_set) == n  # replicated over the mesh
        params = {jax.tree_util.keystr(k): np.asarray(x) for k, x in leaves}
        out[n] = (losses, [np.asarray(g) for g in jax.tree.leaves(grads)], params)
    (l1, g1, p1), (l2, g2, p2) = out[1], out[2]
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    scale = max(float(np.max(np.abs(g))) for g in g1)
    gerr = max(float(np.max(np.abs(a - b))) for a, b in zip(g1, g2, strict=True))
    assert gerr <= 1e-5 * scale, (gerr, scale)
    # The key bias has an identically zero gradient (softmax is shift invariant), which
    # Adam's normalisation turns from round-off into O(lr) updates: not compared.
    perr = max(float(np.max(np.abs(p1[k] - p2[k]))) for k in p1 if not k.endswith(".bk"))
    assert perr < 1e-5, perr
    print("gradient difference", gerr, "of", scale, "; parameter difference", perr)

    bad = from_dict(TrainExperiment, {**table, "optim": {**table["optim"], "batch_size": 5}})
    try:
        Run(bad)
    except ValueError as e:
        msg = str(e)
        assert "batch_size`=5" in msg and "2 devices" in msg and "multiple of 2" in msg, msg
    else:
        raise AssertionError("batch 5 on 2 devices was accepted")
    print("OK")
    """
)


# The default check: the loss and its gradient of one batch, sharded in halves over two
# devices, equal those on one device (float32 round-off), for a tiny model.
SMALL_SCRIPT = textwrap.dedent(
    """
    import jax, numpy as np, equinox as eqx
    assert len(jax.devices()) == 2, jax.devices()
    from itde.train import Run, TrainExperiment, from_dict, loss_fn, place

    table = {
        "task": {"name": "sort", "length": 4, "vocab": 5},
        "model": {"n_layers": 1, "n_features": 4, "n_heads": 2, "n_hidden": 8},
        "optim": {"steps": 2, "batch_size": 4, "warmup": 0},
    }
    cfg = from_dict(TrainExperiment, table)
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    out = {}
    for n in (1, 2):
        run = Run(cfg, devices=jax.devices()[:n])
        model, _ = run.init_state()
        model = place(model, run.replicated)
        batch = run.batch(0)
        assert len(batch[0].sharding.device_set) == n
        assert batch[0].addressable_shards[0].data.shape[0] == 4 // n
        loss, grads = value_and_grad(model, batch, run.task)
        out[n] = (float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)])
    (l1, g1), (l2, g2) = out[1], out[2]
    assert abs(l1 - l2) <= 1e-6 * abs(l1), (l1, l2)
    scale = max(float(np.max(np.abs(g))) for g in g1)
    gerr = max(float(np.max(np.abs(a - b))) for a, b in zip(g1, g2, strict=True))
    assert scale > 1e-3 and gerr <= 1e-5 * scale, (gerr, scale)

    bad = from_dict(TrainExperiment, {**table, "optim": {**table["optim"], "batch_size": 5}})
    try:
        Run(bad)
    except ValueError as e:
        msg = str(e)
        assert "batch_size`=5" in msg and "2 devices" in msg and "multiple of 2" in msg, msg
    else:
        raise AssertionError("batch 5 on 2 devices was accepted")
    print("OK")
    """
)


def _run_on_two_devices(script):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


@pytest.mark.slow  # by default test_train_fsdp.py checks a data=2 x fsdp=4 step against one device
def test_sharded_loss_and_gradient_equal_single_device():
    _run_on_two_devices(SMALL_SCRIPT)


@pytest.mark.slow  # a fresh JAX process and two compiles of the step: ~40 s of CPU
def test_sharded_step_equals_single_device_step():
    _run_on_two_devices(SCRIPT)
