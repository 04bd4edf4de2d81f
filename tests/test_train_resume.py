"""Checkpoints: a killed and resumed run ends bit-for-bit equal to an uninterrupted one, and
a missing, truncated or mismatched checkpoint is an error, never a silent fresh start."""

import json
import shutil
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest

from itde.train import (
    CheckpointError,
    ConfigError,
    Run,
    TrainExperiment,
    from_dict,
    load,
    load_checkpoint,
    read_checkpoint_meta,
    train,
)

SIDECAR = "checkpoint.json"
ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "task": {"name": "sort", "length": 5, "vocab": 6, "eval_size": 16},
    "model": {"n_layers": 2, "n_features": 8, "n_heads": 2, "n_hidden": 16},
    "optim": {"steps": 6, "batch_size": 8, "warmup": 2, "lr": 1e-2},
    "run": {"log_every": 1, "eval_every": 3, "checkpoint_every": 2, "progress": False},
}
TINY_RK4 = {
    "task": {"name": "burgers", "n_grid": 8, "n_modes": 2, "eval_size": 8},
    "model": {"n_layers": 1, "n_features": 8, "n_heads": 2, "n_hidden": 8, "scheme": "rk4",
              "dt": 0.5, "activation": "gelu"},
    "optim": {"steps": 5, "batch_size": 4, "warmup": 1},
    "run": {"log_every": 1, "eval_every": 5, "checkpoint_every": 2, "progress": False},
}  # fmt: skip


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _assert_bitwise(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def _losses(path):
    return [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())]


@pytest.mark.parametrize(
    "table",
    [TINY, pytest.param(TINY_RK4, marks=pytest.mark.slow)],  # rk4: a second, longer compile
    ids=["lie-sort", "rk4-burgers"],
)
def test_killed_and_resumed_run_is_bitwise_equal(tmp_path, table):
    cfg = from_dict(TrainExperiment, table)
    full = train(cfg, out=tmp_path / "full")
    # "killed" after step 3: the last checkpoint is step 2, step 3's progress is lost
    part = train(cfg, out=tmp_path / "part", stop_at=3)
    assert part.step == 3
    assert read_checkpoint_meta(tmp_path / "part")["step"] == 2
    with open(tmp_path / "part" / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 0.5')  # killed mid-append: a torn last line
    resumed = train(out=None, resume=tmp_path / "part")  # the checkpoint's own config
    assert resumed.step == cfg.optim.steps and resumed.complete
    part = tmp_path / "part"
    state = f"state-{cfg.optim.steps:08d}.eqx"
    written = ["metrics.jsonl", "loss_curve.png", SIDECAR, state]
    assert resumed.files == [str(part / name) for name in written]
    _assert_bitwise(full.model, resumed.model)
    _assert_bitwise(full.opt_state, resumed.opt_state)
    # the saved final checkpoints are equal too, and so is every logged loss
    run = Run(cfg)
    a, _ = load_checkpoint(tmp_path / "full", run.init_state())
    b, _ = load_checkpoint(tmp_path / "part", run.init_state())
    _assert_bitwise(a, b)
    assert _losses(tmp_path / "full" / "metrics.jsonl") == _losses(
        tmp_path / "part" / "metrics.jsonl"
    )
    assert (tmp_path / "part" / "loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    names = [p.name for p in (tmp_path / "part").glob("state-*.eqx")]
    assert names == [f"state-{cfg.optim.steps:08d}.eqx"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    cfg = from_dict(TrainExperiment, TINY)  # the bitwise test's config: its compiled step
    train(cfg, out=out, stop_at=2)
    return cfg, out


def test_resume_with_other_model_config_is_refused(trained, tmp_path):
    cfg, out = trained
    table = {**TINY, "model": {**TINY["model"], "n_features": 16}}
    other = from_dict(TrainExperiment, table, "other.toml")
    with pytest.raises(ConfigError, match=r"other\.toml.*model\.n_features"):
        train(other, resume=out, source="other.toml", out=tmp_path)
    # a change of logging cadence only is allowed
    again = from_dict(TrainExperiment, {**TINY, "run": {**TINY["run"], "log_every": 2}})
    assert train(again, resume=out, out=tmp_path / "ok").step == TINY["optim"]["steps"]


def test_checkpoint_of_another_shape_is_refused(trained):
    cfg, out = trained
    table = {**TINY, "model": {**TINY["model"], "n_hidden": 24}}
    template = Run(from_dict(TrainExperiment, table)).init_state()
    match = r"another model: 9 leaves differ, e\.g\. .*feedforward\.b1: \[\[2, 16\].*\[\[2, 24\]"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(out, template)


def test_truncated_checkpoint_is_refused(trained, tmp_path):
    _, out = trained
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta = read_checkpoint_meta(bad)
    state = bad / meta["leaves"]
    state.write_bytes(state.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        train(resume=bad)
    state.write_bytes(b"")
    with pytest.raises(CheckpointError, match="truncated"):
        train(resume=bad)


def test_corrupted_or_missing_checkpoint_is_refused(trained, tmp_path):
    _, out = trained
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta = read_checkpoint_meta(bad)
    raw = bytearray((bad / meta["leaves"]).read_bytes())
    raw[-1] ^= 0xFF
    (bad / meta["leaves"]).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256"):
        train(resume=bad)
    (bad / meta["leaves"]).unlink()
    with pytest.raises(CheckpointError, match="is missing"):
        train(resume=bad)
    (bad / SIDECAR).write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        train(resume=bad)
    (bad / SIDECAR).unlink()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        train(resume=bad)
    with pytest.raises(CheckpointError, match="does not exist"):
        train(resume=tmp_path / "nowhere")


def test_checkpoint_of_another_data_stream_is_refused(trained, tmp_path):
    _, out = trained
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta = json.loads((bad / SIDECAR).read_text())
    meta["data_key"][0] += 1
    (bad / SIDECAR).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="data_key"):
        train(resume=bad)


def test_training_into_a_checkpointed_directory_is_refused(trained):
    cfg, out = trained
    with pytest.raises(CheckpointError, match=r"already holds a checkpoint.*--resume .*"
                       r"itde.train.train\(resume=.*`overwrite=True`"):
        train(cfg, out=out)


def test_sidecar_records_what_a_resume_needs(trained):
    cfg, out = trained
    meta = read_checkpoint_meta(out)
    assert meta["step"] == 2 and meta["config"]["model"]["n_features"] == 8
    assert {"jax", "equinox", "optax", "diffrax", "itde"} <= set(meta["versions"])
    assert meta["shapes"]["[0].embedding"] == [[6, 8], "float32"]
    assert meta["data_key_impl"] and len(meta["data_key"]) == 2


def test_edited_config_in_the_sidecar_is_refused(trained, tmp_path):
    """Editing `optim.lr` in checkpoint.json used to make the learning rate jump silently on
    resume (0.003 -> 0.49): the sidecar records its config's digest."""
    _, out = trained
    bad = tmp_path / "edited"
    shutil.copytree(out, bad)
    meta = json.loads((bad / SIDECAR).read_text())
    meta["config"]["optim"]["lr"] = 0.49
    (bad / SIDECAR).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"`config` was edited.*config_sha256.*--config"):
        train(resume=bad)


def test_another_runs_checkpoint_copied_in_is_refused(trained, tmp_path):
    """A checkpoint of run B copied into run A's directory used to continue B and mix the
    two runs' metrics rows: each row names its run, and the checkpoint does too."""
    cfg, out = trained
    mixed = tmp_path / "mixed"
    shutil.copytree(out, mixed)
    meta = read_checkpoint_meta(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["run"] == meta["run_id"] for r in rows)
    (mixed / "metrics.jsonl").write_text(
        "".join(json.dumps({**r, "run": "0123456789abcdef"}) + "\n" for r in rows)
    )
    with pytest.raises(ValueError, match=r"line 1 belongs to run '0123456789abcdef'.*"
                       rf"{meta['run_id']}.*copied into this directory"):  # fmt: skip
        train(resume=mixed)


def test_load_returns_the_trained_model_its_config_and_sidecar(trained):
    cfg, out = trained
    model, loaded, meta = load(out)
    assert loaded == cfg and meta["step"] == 2 == read_checkpoint_meta(out)["step"]
    assert meta["run_id"] == read_checkpoint_meta(out)["run_id"]
    (want, _), _ = load_checkpoint(out, Run(cfg).init_state())
    _assert_bitwise(want, model)
    initial, _ = Run(cfg).init_state()
    assert not all(np.array_equal(a, b) for a, b in zip(_leaves(initial), _leaves(model)))
    assert load(TrainExperiment, ROOT / "configs" / "sort.toml") == TrainExperiment()


def test_load_refuses_what_is_not_a_run_directory(trained, tmp_path):
    _, out = trained
    with pytest.raises(CheckpointError, match=r"`directory`='.*nowhere'.*does not exist; give"):
        load(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"`directory`=.*holds no checkpoint"):
        load(tmp_path)
    with pytest.raises(CheckpointError, match=r"is a TOML config.*load_config\(TrainExp"):
        load(ROOT / "configs" / "sort.toml")
    with pytest.raises(TypeError, match=r"`directory`=3 must be the path"):
        load(3)
    with pytest.raises(TypeError, match=r"`path`='x.toml' is only for `load\(TrainExperiment"):
        load(out, "x.toml")
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    meta = read_checkpoint_meta(bad)
    (bad / meta["leaves"]).write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match=r"`directory`=.*truncated.*restore the dire"):
        load(bad)


def test_layout_keys_may_change_on_resume(trained):
    """`[optim] accumulate` and `[parallel] fsdp` change how a step is computed, not which:
    a run may resume with other values (on a machine with fewer devices or less memory)."""
    from itde.train._internal import config_for_resume

    _, out = trained
    table = {**TINY, "optim": {**TINY["optim"], "accumulate": 2}, "parallel": {"fsdp": 2}}
    other = from_dict(TrainExperiment, table)
    assert config_for_resume(out, other, "other.toml")[0] == other
