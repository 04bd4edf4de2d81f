"""FSDP and gradient accumulation on 8 virtual CPU devices (a fresh process, since
`XLA_FLAGS=--xla_force_host_platform_device_count=8` must be set before JAX starts).

One script measures everything (one compile per layout) and the tests check its figures:

- a step sharded over a `("data", "fsdp") = (2, 4)` mesh equals one device's step, to
  float32 round-off, and leaves parameters and Adam moments in the FSDP layout;
- each device holds about 1/4 of the parameter and optimiser-state bytes
  (`addressable_shards`), every array of at least `MIN_SHARD_SIZE` elements exactly 1/4;
- a step of 2 micro-batches on the sharded mesh equals one device's step of the whole
  batch;
- a sharded, accumulating run killed after its step-1 checkpoint and resumed ends equal,
  bit for bit, to the uninterrupted run, in the sharded layout; `itde.train.load` returns
  its trained model whole.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile, time
    from pathlib import Path
    import jax, numpy as np, equinox as eqx
    assert len(jax.devices()) == 8, jax.devices()
    from itde.train import Run, TrainExperiment, from_dict, load, train

    TABLE = {
        "task": {"name": "sort", "length": 8, "vocab": 16, "eval_size": 16},
        "model": {"n_layers": 1, "n_features": 64, "n_heads": 2, "n_hidden": 256},
        "optim": {"steps": 2, "batch_size": 16, "warmup": 0, "lr": 1e-2},
        "run": {"log_every": 1, "eval_every": 2, "checkpoint_every": 1, "progress": False},
    }

    def config(fsdp, accumulate):
        return from_dict(TrainExperiment, {**TABLE, "parallel": {"fsdp": fsdp},
                                           "optim": {**TABLE["optim"], "accumulate": accumulate}})

    def named(tree):
        pairs = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
        return {jax.tree_util.keystr(k): x for k, x in pairs}

    def one_step(fsdp, accumulate, n):
        t = time.perf_counter()
        run = Run(config(fsdp, accumulate), devices=jax.devices()[:n])
        placed = run.place_state(*run.init_state())
        batch = run.batch(0)
        model, opt, loss = run.make_step()(*placed, batch)
        jax.block_until_ready((model, opt))
        return dict(placed=placed, after=(model, opt), loss=float(loss), batch=batch,
                    seconds=time.perf_counter() - t)

    def compare(a, b):
        (ma, oa), (mb, ob) = a["after"], b["after"]
        pa, pb, na, nb = named(ma), named(mb), named(oa), named(ob)
        # Adam's first step moves a parameter by lr * g / (|g| + eps): where the gradient g
        # is round-off (the key bias's is identically zero: softmax is shift invariant) its
        # normalisation makes that round-off an O(lr) step. Compared: the elements whose
        # gradient exceeds 1e-6 of the largest.
        mu = {k: np.asarray(na[m]) for k in pa for m in na if m.endswith(".mu" + k)}
        scale = max(float(np.max(np.abs(g))) for g in mu.values())
        params, skipped = 0.0, 0
        for k, g in mu.items():
            keep = np.abs(g) > 1e-6 * scale
            d = np.abs(np.asarray(pa[k]) - np.asarray(pb[k]))[keep]
            params, skipped = max(params, float(np.max(d, initial=0.0))), skipped + (~keep).sum()
        out = {"loss": abs(a["loss"] - b["loss"]) / abs(a["loss"]), "params": params,
               "skipped": int(skipped), "compared": sum(g.size for g in mu.values())}
        for moment in ("mu", "nu"):
            keys = [k for k in na if f".{moment}." in k]
            assert keys, list(na)
            scale = max(float(np.max(np.abs(np.asarray(na[k])))) for k in keys)
            err = max(float(np.max(np.abs(np.asarray(na[k]) - np.asarray(nb[k]))))
                      for k in keys)
            out[moment] = err / scale
        return out

    def layout(tree):
        rows = []
        for k, x in named(tree).items():
            per_device = {}
            for s in x.addressable_shards:
                per_device[str(s.device)] = per_device.get(str(s.device), 0) + s.data.nbytes
            rows.append({"key": k, "shape": list(x.shape), "nbytes": x.size * x.dtype.itemsize,
                         "spec": str(x.sharding.spec), "per_device": per_device})
        return rows

    runs = {
        "single": one_step(1, 1, 1),
        "sharded": one_step(4, 1, 8),
        "sharded_accumulated": one_step(4, 2, 8),
    }
    sh = runs["sharded"]
    result = {
        "seconds": {k: r["seconds"] for k, r in runs.items()},
        "sharded": compare(runs["single"], sh),
        "sharded_accumulated": compare(runs["single"], runs["sharded_accumulated"]),
        "mesh": dict(Run(config(4, 1)).mesh.shape),
        "batch_per_device": [s.data.shape[0] for s in sh["batch"][0].addressable_shards],
        "layout_placed": layout(sh["placed"]),
        "layout_after": layout(sh["after"]),
        "layout_after_accumulated": layout(runs["sharded_accumulated"]["after"]),
    }

    # a sharded, accumulating run killed after step 1 and resumed equals the whole run
    t = time.perf_counter()
    out = Path(tempfile.mkdtemp())
    try:  # 16 examples do not split into 4 micro-batches over 8 devices
        train(config(4, 4), out=out / "refused")
    except ValueError as e:
        result["refused"] = [str(e), (out / "refused").exists()]
    if "resume" not in sys.argv[1:]:  # the kill-and-resume run: the slow test only
        print("RESULT " + json.dumps(result))
        sys.exit(0)
    cfg = config(4, 2)
    full = train(cfg, out=out / "full")
    part = train(cfg, out=out / "part", stop_at=1)
    assert part.step == 1
    resumed = train(resume=out / "part")
    a, b = named((full.model, full.opt_state)), named((resumed.model, resumed.opt_state))
    result["resume_bitwise"] = all(
        np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a) and a.keys() == b.keys()
    result["layout_resumed"] = layout((resumed.model, resumed.opt_state))
    model, loaded_cfg, meta = load(out / "full")
    want, got = named(full.model), named(model)
    result["load"] = {
        "equal": all(np.array_equal(np.asarray(want[k]), np.asarray(got[k])) for k in want),
        "keys_equal": want.keys() == got.keys(),
        "devices": sorted({len(x.sharding.device_set) for x in got.values()}),
        "step": meta["step"], "run_id": meta["run_id"] == full_run_id
        if (full_run_id := json.loads((out / "full" / "checkpoint.json").read_text())["run_id"])
        else False,
        "fsdp": loaded_cfg.parallel.fsdp, "accumulate": loaded_cfg.optim.accumulate,
    }
    result["seconds"]["train_resume_load"] = time.perf_counter() - t
    print("RESULT " + json.dumps(result))
    """
)


@pytest.fixture(scope="module")
def measured():
    return _measure()


@pytest.fixture(scope="module")
def measured_with_resume():
    return _measure("resume")


def _measure(*args):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["MPLBACKEND"] = "Agg"
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    result["seconds"]["process"] = time.perf_counter() - t
    # XLA's warning when a sharded array has to be gathered onto one device (e.g. passed
    # whole through a run-time check that runs there) and scattered back
    result["rematerialized"] = [
        x[:300] for x in proc.stderr.splitlines() if "Involuntary full rematerialization" in x
    ]
    print(json.dumps(result["seconds"]))
    return result


def _expected_spec(shape, fsdp):
    """The documented rule, written out: split the largest axis `fsdp` divides (the first
    of equal ones) over "fsdp", as the text of its PartitionSpec."""
    from jax.sharding import PartitionSpec

    axis = -max((n, -i) for i, n in enumerate(shape) if n % fsdp == 0)[1]
    return str(PartitionSpec(*[None] * axis, "fsdp"))


def _assert_fsdp_layout(rows, fsdp=4, min_size=1024):
    """Every array with `min_size` elements or more and an axis `fsdp` divides is split in
    `fsdp` equal parts, over the mesh's second axis; every other array is whole on every
    device."""
    sharded = 0
    for row in rows:
        size = row["nbytes"] // 4 if row["nbytes"] >= 4 else 0  # float32 / int32 leaves
        divisible = any(n % fsdp == 0 for n in row["shape"])
        per_device = list(row["per_device"].values())
        assert len(per_device) == 8, row
        if size >= min_size and divisible:
            assert row["spec"] == _expected_spec(row["shape"], fsdp), row
            assert per_device == [row["nbytes"] // fsdp] * 8, row
            sharded += 1
        else:
            assert "fsdp" not in row["spec"] and "data" not in row["spec"], row
            assert per_device == [row["nbytes"]] * 8, row
    return sharded


def _sharded_step_equals_one_device_step(measured):
    """(a) data=2 x fsdp=4: the same loss, gradient moments and parameters, to float32
    round-off; the parameters and Adam moments leave the step in the FSDP layout."""
    assert measured["mesh"] == {"data": 2, "fsdp": 4}
    assert measured["batch_per_device"] == [2] * 8  # 16 examples over both axes
    diff = measured["sharded"]
    assert diff["loss"] <= 1e-6, diff
    assert diff["mu"] <= 1e-5 and diff["nu"] <= 1e-5, diff
    assert diff["params"] <= 1e-5, diff
    assert _assert_fsdp_layout(measured["layout_after"]) >= 10


def _each_device_holds_a_quarter_of_the_state(measured):
    """(b) per-device bytes of parameters and optimiser state, from `addressable_shards`,
    as placed and after a step: about 1/fsdp of the total (the arrays below
    MIN_SHARD_SIZE elements stay whole)."""
    for key in ("layout_placed", "layout_after"):
        rows = measured[key]
        _assert_fsdp_layout(rows)
        total = sum(r["nbytes"] for r in rows)
        most = max(sum(r["per_device"][d] for r in rows) for d in rows[0]["per_device"])
        assert 1 / 4 <= most / total <= 1 / 4 + 0.03, (key, most, total)


def _accumulated_step_equals_the_whole_batch_step(measured):
    """(c) 2 micro-batches of 8 on the sharded mesh give the step of the whole batch of
    16 on one device, to float32 round-off."""
    for key in ("sharded_accumulated",):
        diff = measured[key]
        assert diff["loss"] <= 1e-6, (key, diff)
        assert diff["mu"] <= 1e-5 and diff["nu"] <= 1e-5, (key, diff)
        assert diff["params"] <= 1e-5, (key, diff)
    _assert_fsdp_layout(measured["layout_after_accumulated"])


def _batch_the_micro_batches_and_devices_do_not_divide_is_refused(measured):
    message, written = measured["refused"]
    assert "`optim.batch_size`=16 does not split into `optim.accumulate`=4" in message
    assert "over the 8 devices" in message and "multiple of 32" in message and not written


def test_fsdp_and_accumulation_on_8_devices(measured):
    """The checks (a)-(c) below and the refusal, on the one measurement (a single test, so
    that pytest-xdist does not run the 8-device process once per worker)."""
    _sharded_step_equals_one_device_step(measured)
    _each_device_holds_a_quarter_of_the_state(measured)
    _accumulated_step_equals_the_whole_batch_step(measured)
    _batch_the_micro_batches_and_devices_do_not_divide_is_refused(measured)
    # the solve's run-time checks see a scalar, not the sharded state
    assert not measured["rematerialized"], measured["rematerialized"]


@pytest.mark.slow  # three sharded training runs (~15 s); by default test_train_resume.py
# checks resume bit for bit and `load` on one device
def test_sharded_run_resumes_bitwise_and_loads_whole(measured_with_resume):
    """A sharded, accumulating run killed after its step-1 checkpoint and resumed ends
    equal, bit for bit, to the uninterrupted run, in the FSDP layout; `load` returns the
    final model whole on one device, with its config and sidecar."""
    measured = measured_with_resume
    assert measured["resume_bitwise"]
    _assert_fsdp_layout(measured["layout_resumed"])
    loaded = measured["load"]
    assert loaded["equal"] and loaded["keys_equal"], loaded
    assert loaded["devices"] == [1] and loaded["step"] == 2 and loaded["run_id"], loaded
    assert loaded["fsdp"] == 4 and loaded["accumulate"] == 2, loaded


def test_bad_layout_settings_name_the_key_the_value_and_the_fix():
    import jax

    from itde.train import ConfigError, Run, TrainExperiment, from_dict, make_step

    table = {"optim": {"batch_size": 10, "accumulate": 4}}
    with pytest.raises(ConfigError, match=r"`optim.accumulate`=4 .*`optim.batch_size`=10"):
        from_dict(TrainExperiment, table)
    with pytest.raises(ConfigError, match=r"`parallel.fsdp` must be positive, got 0"):
        from_dict(TrainExperiment, {"parallel": {"fsdp": 0}})
    cfg = from_dict(TrainExperiment, {"parallel": {"fsdp": 3}})
    with pytest.raises(ValueError, match=r"`parallel.fsdp`=3 does not divide the 1 devices"):
        Run(cfg, devices=jax.devices()[:1])
    run = Run(TrainExperiment(), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match=r"`accumulate`=0 must be a positive integer"):
        make_step(run.optimizer, run.task, accumulate=0)
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh"):
        make_step(run.optimizer, run.task, mesh="data")
