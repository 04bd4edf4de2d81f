"""Multi-host training for real: two CPU processes joined by `jax.distributed.initialize`
on a loopback coordinator, one CPU device each.

Only process 0 is given a usable output directory; process 1's does not exist and must
still not exist at the end.

- Default run (no training): process 0 writes a checkpoint that only it can see; both
  processes restore it and process 1's copy equals process 0's bit for bit; a damaged
  checkpoint and a directory without one stop both processes with process 0's message.
- `-m slow`: each process writes its own shards of a sharded state (format 3) into one
  shared directory, and both read it back on two layouts; a file of process 1's damaged
  stops both with one message.
- `-m slow`: a two-process run stops after step 3 (its last checkpoint is step 2), both
  processes are SIGKILLed, and two fresh processes resume it to the end: the final
  parameters and optimiser state of both equal, bit for bit, those of one process
  training the same config on two (forced host) CPU devices, the same mesh.

Every server here is started by the test and listens on 127.0.0.1 only: the coordinator
(`coordinator_bind_address`) and the gloo CPU collectives (pinned to 127.0.0.1 in the
worker). Every wait has a deadline; on a deadline the children are killed and the test
fails with their output, and the workers' own distributed timeouts are short, so an
orphaned worker stops by itself too. The workers share one persistent compilation cache.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

# The run's config, in one place (renamed keys go here).
CONFIG = {
    "task": {"name": "sort", "length": 5, "vocab": 6, "eval_size": 8},
    "model": {"n_layers": 1, "n_features": 8, "n_heads": 2, "n_hidden": 8},
    "optim": {"steps": 5, "batch_size": 4, "warmup": 1, "lr": 1e-2},
    "run": {"log_every": 1, "eval_every": 5, "checkpoint_every": 2, "progress": False},
}
STOP_AT = 3  # the killed run's last checkpoint is step 2; step 3 is lost and redone
DEADLINE_S = 480  # per phase: above the time measured on a loaded 2-core machine

ROOT = Path(__file__).resolve().parents[1]

WORKER = textwrap.dedent(
    """
    import functools, json, os, sys, time
    t0 = time.perf_counter()
    a = json.loads(os.environ["ITDE_TEST_WORKER"])
    stamp = lambda what: print(f"[{time.perf_counter() - t0:6.1f} s] {what}", flush=True)
    import jax
    if a["num_processes"] > 1:
        from jax._src import xla_bridge  # keep the gloo sockets on loopback (test only)
        make = getattr(xla_bridge._jax, "make_gloo_tcp_collectives", None)
        if make is not None:
            xla_bridge._jax.make_gloo_tcp_collectives = functools.partial(
                make, hostname="127.0.0.1")
        address = f"127.0.0.1:{a['port']}"
        jax.distributed.initialize(
            coordinator_address=address, coordinator_bind_address=address,
            num_processes=a["num_processes"], process_id=a["process_id"],
            initialization_timeout=60, heartbeat_timeout_seconds=20,
            shutdown_timeout_seconds=20)
    assert jax.process_count() == a["num_processes"] and len(jax.devices()) == 2
    stamp("joined")
    import equinox as eqx
    import numpy as np
    from itde.train import TrainExperiment, from_dict
    from itde.train import train
    stamp("imported")
    cfg = from_dict(TrainExperiment, a["config"]) if a["config"] else None
    from itde.train._internal import to_host  # whole arrays (a collective if sharded)
    leaves = lambda tree: jax.tree.leaves(to_host(eqx.filter(tree, eqx.is_array)))
    if a["mode"] == "shards":  # no training: both write their shards to one directory
        from jax.experimental.multihost_utils import sync_global_devices
        from itde.train import Run
        from itde.train._internal import _save
        run = Run(cfg)
        model, opt = run.init_state()
        model = jax.tree.map(lambda x: x + 1 if eqx.is_inexact_array(x) else x, model)
        if jax.process_index() == 0:
            np.savez(a["result"] + "-written.npz", *leaves((model, opt)))
        _save(run, a["out"], 7, run.place_state(model, opt), run.meta())
        stamp("wrote")
        for name, fsdp in (("sharded", None), ("replicated", 1)):  # and on another layout
            m, o, meta = Run(cfg, fsdp=fsdp).restore(a["out"])
            np.savez(a["result"] + f"-{name}.npz", *leaves((m, o)))
            print(f"RESTORED {name} {meta['step']}", flush=True)
        sync_global_devices("before the damage")
        if jax.process_index() == 0:  # damage a file that process 1 wrote
            files = [p for p in json.load(open(os.path.join(a["out"], "checkpoint.json")))["files"]
                     if p.startswith("ocdbt.process_1/")]
            path = os.path.join(a["out"], "state-00000007", max(files))
            raw = bytearray(open(path, "rb").read())
            raw[len(raw) // 2] ^= 0xFF
            open(path, "wb").write(bytes(raw))
        sync_global_devices("after the damage")
        try:
            run.restore(a["out"])
        except Exception as e:
            print("ERROR damaged " + json.dumps([type(e).__name__, str(e)]), flush=True)
        sys.exit(0)
    if a["mode"] == "restore":  # no training: process 0 writes, both restore
        from itde.train import Run, save_checkpoint
        run = Run(cfg)
        for name in ("good", "damaged"):
            directory = os.path.join(a["out"], name)  # process 1's does not exist
            if jax.process_index() == 0:
                model, opt = run.init_state()
                model = jax.tree.map(lambda x: x + 1 if eqx.is_inexact_array(x) else x, model)
                save_checkpoint(directory, 7, (model, opt), run.meta())
                stamp(f"wrote {name}")
                np.savez(a["result"] + f"-{name}-written.npz", *leaves((model, opt)))
                if name == "damaged":
                    path = os.path.join(directory, f"state-{7:08d}.eqx")
                    raw = bytearray(open(path, "rb").read())
                    raw[len(raw) // 2] ^= 0xFF
                    open(path, "wb").write(bytes(raw))
            try:
                model, opt, meta = run.restore(directory)
            except Exception as e:
                print(f"ERROR {name} " + json.dumps([type(e).__name__, str(e)]), flush=True)
                continue
            np.savez(a["result"] + f"-{name}-restored.npz", *leaves((model, opt)))
            print(f"RESTORED {name} {meta['step']}", flush=True)
        empty = os.path.join(a["out"], "empty")  # a directory with no checkpoint in it
        if jax.process_index() == 0:
            os.makedirs(empty)
        try:
            train(None, resume=empty)
        except Exception as e:
            print("ERROR empty " + json.dumps([type(e).__name__, str(e)]), flush=True)
        sys.exit(0)
    try:
        s = train(cfg, out=a["out"], resume=a["resume"], stop_at=a["stop_at"])
    except Exception as e:
        print("ERROR " + json.dumps([type(e).__name__, str(e)]), flush=True)
        sys.exit(3)
    np.savez(a["result"], *leaves((s.model, s.opt_state)))
    split = [not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(eqx.filter((s.model, s.opt_state), eqx.is_array))]
    print(f"SPLIT {sum(split)}", flush=True)
    stamp(f"DONE {s.step}")
    if a["hang"]:  # wait to be killed, as a preempted job would be; stop by itself anyway
        time.sleep(120)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CHILDREN: list[subprocess.Popen] = []
_SHARED: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
    """One persistent compilation cache for every worker of this module."""
    _SHARED["cache"] = str(tmp_path_factory.mktemp("jax-cache"))


@pytest.fixture(autouse=True)
def _no_orphans():
    """Whatever happens in a test, no worker outlives it."""
    yield
    while _CHILDREN:
        p = _CHILDREN.pop()
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)


def _start(tmp: Path, name: str, **args) -> tuple[subprocess.Popen, Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(
        # the workers compile the same small programs: share them through one cache
        JAX_COMPILATION_CACHE_DIR=_SHARED["cache"],
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        JAX_PLATFORMS="cpu",
        MPLBACKEND="Agg",
        PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT), str(ROOT / "solvers"), env.get("PYTHONPATH")) if p
        ),
        ITDE_TEST_WORKER=json.dumps(args),
    )
    if args["num_processes"] == 1:  # the same 2-device mesh in one process
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    log = tmp / f"{name}.log"
    with open(log, "wb") as f:
        p = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=f, stderr=f)
    _CHILDREN.append(p)
    return p, log


def _tail(logs) -> str:
    return "\n".join(f"--- {log.name}:\n{log.read_text()[-3000:]}" for log in logs)


def _kill(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def _wait(procs, logs, *, until=None) -> list[int]:
    """Wait for every process to exit (or, with `until`, for `until` in every log, then
    SIGKILL them all); kill them all and fail with their output on the deadline."""
    end = time.monotonic() + DEADLINE_S
    while time.monotonic() < end:
        codes = [p.poll() for p in procs]
        if until is not None and all(until in log.read_text() for log in logs):
            _kill(procs)
            return codes
        if until is None and None not in codes:
            return codes
        if until is not None and any(c is not None for c in codes):
            _kill(procs)
            raise AssertionError(f"a worker exited early ({codes}):\n{_tail(logs)}")
        time.sleep(0.2)
    _kill(procs)
    raise AssertionError(f"workers still running after {DEADLINE_S} s:\n{_tail(logs)}")


def _pair(tmp: Path, name: str, outs, args):
    port = _free_port()
    started = [
        _start(tmp, f"{name}{i}", num_processes=2, process_id=i, port=port, **args(i, outs[i]))
        for i in range(2)
    ]
    return [p for p, _ in started], [log for _, log in started]


def _state(path: Path) -> list[np.ndarray]:
    with np.load(path) as z:
        return [z[f"arr_{i}"] for i in range(len(z.files))]


def _assert_bitwise(want: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for a, b in zip(want, got, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _error(log: Path, case: str) -> list[str]:
    """`[class name, message]` of the error a worker reported for `case`."""
    tag = f"ERROR {case} "
    lines = [line for line in log.read_text().splitlines() if line.startswith(tag)]
    assert len(lines) == 1, f"no {tag!r} in {log.name}:\n{log.read_text()[-3000:]}"
    return json.loads(lines[0][len(tag) :])


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [1, 2], ids=["replicated", "fsdp2"])
def test_two_processes_killed_and_resumed_equal_one_process(tmp_path, fsdp):
    """With `fsdp = 2` every large parameter is split across the two processes: the
    checkpoint is gathered from both and restored into the split layout."""
    outs = [tmp_path / "out0", tmp_path / "nowhere" / "out1"]  # process 1's never exists
    # the single file: only process 0 sees the directory (the shards need a shared one)
    config = {**CONFIG, "parallel": {"fsdp": fsdp},
              "run": {**CONFIG["run"], "checkpoint_format": "file"}}  # fmt: skip
    if fsdp > 1:  # arrays of MIN_SHARD_SIZE elements and more, so that some are split
        config["model"] = {**CONFIG["model"], "n_features": 32, "n_hidden": 64}
    base = dict(mode="train", config=config, resume=None, stop_at=None, hang=False)
    ref, ref_log = _start(
        tmp_path, "ref", num_processes=1, process_id=0, port=0, **base,
        out=str(tmp_path / "ref"), result=str(tmp_path / "ref.npz"),
    )  # fmt: skip

    # 1. two processes train, stop after step STOP_AT, and are SIGKILLed
    def first(i, out):
        return {**base, "out": str(out), "stop_at": STOP_AT, "hang": True,
                "result": str(tmp_path / f"first{i}.npz")}  # fmt: skip

    procs, logs = _pair(tmp_path, "first", outs, first)
    _wait(procs, logs, until=f"DONE {STOP_AT}")
    sidecar = json.loads((outs[0] / "checkpoint.json").read_text())
    assert sidecar["step"] == 2, sidecar["step"]
    assert not outs[1].parent.exists()

    # 2. two fresh processes resume it with the checkpoint's own config
    def second(i, out):
        return {**base, "config": None, "out": None, "resume": str(out),
                "result": str(tmp_path / f"final{i}.npz")}  # fmt: skip

    procs, logs = _pair(tmp_path, "second", outs, second)
    codes = _wait(procs + [ref], logs + [ref_log])
    assert codes == [0, 0, 0], f"{codes}\n{_tail(logs + [ref_log])}"
    assert not outs[1].parent.exists()

    ref_state = _state(tmp_path / "ref.npz")
    assert len(ref_state) > 10
    split = {int(line.split()[1]) for log in logs for line in log.read_text().splitlines()
             if line.startswith("SPLIT ")}  # fmt: skip
    assert (split == {0}) if fsdp == 1 else (len(split) == 1 and min(split) >= 10), split
    for i in range(2):
        _assert_bitwise(ref_state, _state(tmp_path / f"final{i}.npz"))
    final = json.loads((outs[0] / "checkpoint.json").read_text())
    assert final["step"] == CONFIG["optim"]["steps"]
    ref_sidecar = json.loads((tmp_path / "ref" / "checkpoint.json").read_text())
    assert final["sha256"] == ref_sidecar["sha256"]  # the saved state files are equal too
    # every step logged once, with the uninterrupted run's loss
    assert _losses(outs[0] / "metrics.jsonl") == _losses(tmp_path / "ref" / "metrics.jsonl")


def test_process_0_reads_and_broadcasts_the_checkpoint_and_its_errors(tmp_path):
    """No training: process 0 writes checkpoints that only it can see; a good one reaches
    process 1 bit for bit, a damaged one or a directory without one stops both processes
    with process 0's message (process 1 on its own would report a missing directory)."""
    outs = [tmp_path / "out0", tmp_path / "nowhere"]

    def args(i, out):
        return {"mode": "restore", "config": CONFIG, "out": str(out),
                "result": str(tmp_path / f"p{i}")}  # fmt: skip

    procs, logs = _pair(tmp_path, "restore", outs, args)
    codes = _wait(procs, logs)
    assert codes == [0, 0], f"{codes}\n{_tail(logs)}"
    assert not outs[1].exists()
    written = _state(tmp_path / "p0-good-written.npz")
    for i in range(2):
        assert "RESTORED good 7" in logs[i].read_text(), _tail(logs)
        _assert_bitwise(written, _state(tmp_path / f"p{i}-good-restored.npz"))
    for case, words in (("damaged", "is corrupted"), ("empty", "holds no checkpoint")):
        errors = [_error(log, case) for log in logs]
        assert errors[0] == errors[1], errors
        kind, message = errors[0]
        assert kind == "CheckpointError" and words in message, message
        assert str(outs[0]) in message


@pytest.mark.slow
def test_each_process_writes_its_shards_and_both_read_them_on_any_layout(tmp_path):
    """The sharded format (`itde.train._shards`) on two processes sharing one directory:
    each writes the shards of its device (`ocdbt.process_<i>/`), both restore the state bit
    for bit split over both (fsdp = 2) and replicated (fsdp = 1), and a damaged file that
    process 1 wrote stops both processes with the same message."""
    shared = tmp_path / "shared"
    config = {**CONFIG, "parallel": {"fsdp": 2},  # arrays large enough to be split
              "model": {**CONFIG["model"], "n_features": 32, "n_hidden": 64}}  # fmt: skip

    def args(i, out):
        return {"mode": "shards", "config": config, "out": str(out),
                "result": str(tmp_path / f"p{i}")}  # fmt: skip

    procs, logs = _pair(tmp_path, "shards", [shared, shared], args)
    codes = _wait(procs, logs)
    assert codes == [0, 0], f"{codes}\n{_tail(logs)}"
    sidecar = json.loads((shared / "checkpoint.json").read_text())
    assert sidecar["format"] == 3 and sidecar["processes"] == 2
    for i in range(2):
        assert any(f.startswith(f"ocdbt.process_{i}/") for f in sidecar["files"]), sidecar
    written = _state(tmp_path / "p0-written.npz")
    assert len(written) > 10
    for i in range(2):
        for name in ("sharded", "replicated"):
            assert f"RESTORED {name} 7" in logs[i].read_text(), _tail(logs)
            _assert_bitwise(written, _state(tmp_path / f"p{i}-{name}.npz"))
    errors = [_error(log, "damaged") for log in logs]
    assert errors[0] == errors[1], errors
    kind, message = errors[0]
    assert kind == "CheckpointError" and "is corrupted" in message, message
    assert "ocdbt.process_1/" in message and str(shared) in message
