"""The accelerator benchmark script runs (on CPU, `--tiny`) and writes the JSON it promises.

No timing is asserted: only that the script runs, that its records are complete and
finite, that its model FLOPs match a count made by hand, and that itde and PyTorch (the
same weights and batch) give the same loss."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import itde

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"

# charlm --tiny: batch 4, context 16, width 16, hidden 32, 2 layers, vocabulary 12, counted
# by hand: per token 2 * (4 * 16**2 + 2 * 16 * 32) + 16 * 12 = 4288 multiply-adds;
# attention 2 layers * 2 * 16**2 * 16 = 16384 per sequence; forward = 2 * (4 * 16 * 4288
# + 4 * 16384) = 679936 FLOPs; forward + backward = 3x.
TINY_FLOPS = 3 * 679936


def _run(tmp_path, *args):
    out = tmp_path / "gpu.json"
    env = dict(os.environ)
    path = [str(ROOT), str(ROOT / "solvers"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(path)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--repeats", "1", "--out", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def _check(r, impls, dtypes):
    assert r["tiny"] is True
    assert r["shape"] == {"layers": 2, "heads": 2, "width": 16, "hidden": 32, "context": 16,
                          "vocab": 12, "batch": 4}  # fmt: skip
    assert r["flops_per_step"] == TINY_FLOPS
    assert [(q["dtype"], q["impl"]) for q in r["records"]] == [
        (d, i) for d in dtypes for i in impls
    ]
    for q in r["records"]:
        for key in ("compile_s", "step_s", "tokens_per_s", "torch_step_s",
                    "ratio_itde_over_torch"):  # fmt: skip
            assert math.isfinite(q[key]) and q[key] > 0, (key, q)
        assert q["tokens_per_s"] == pytest.approx(4 * 16 / q["step_s"])
        assert q["ratio_itde_over_torch"] == pytest.approx(q["step_s"] / q["torch_step_s"])
        # the same model, weights and batch in both frameworks
        tol = 1e-5 if q["dtype"] == "float32" else 2e-2
        assert q["loss"] == pytest.approx(q["loss_torch"], rel=tol)
        assert q["loss"] == pytest.approx(math.log(12), rel=0.5)  # a random model's loss
        assert q["memory"]["xla"]["temp_size_in_bytes"] > 0
    assert r["peak_memory"]["host_rss_bytes"] > 0


def test_gpu_script_tiny_runs_and_writes_its_json(tmp_path):
    # one configuration by default (each costs a compile of the training pass); the float32
    # one, where itde's loss must equal PyTorch's to round-off. Every one: the slow test.
    r = _run(tmp_path, "--impls", "dense", "--dtypes", "float32")
    _check(r, ["dense"], ["float32"])


def test_gpu_script_named_shapes_are_the_models_they_name():
    """`--shape nanogpt` / `gpt2-124m`: the shapes of nanoGPT's CPU run and GPT-2 small,
    their step FLOPs counted here by hand, and GPT-2 small's parameter count (124M with a
    tied head: embeddings 50257 x 768 and 1024 x 768, per layer 12 * 768^2 weights plus
    13 * 768 biases and LayerNorms, a final LayerNorm)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    n = gpu.SHAPES["nanogpt"]
    assert (n["layers"], n["heads"], n["width"], n["context"], n["batch"]) == (4, 4, 128, 64, 12)
    # per token: 4 layers * (4 * 128^2 + 2 * 128 * 512) + 128 * 65 = 794,752 multiply-adds;
    # attention 4 layers * 2 * 64^2 * 128 = 4,194,304 per sequence
    assert gpu.flops_per_step(n) == 3 * 2 * (12 * 64 * 794_752 + 12 * 4_194_304)
    g = gpu.SHAPES["gpt2-124m"]
    d, L, V, T = g["width"], g["layers"], g["vocab"], g["context"]
    tied = V * d + T * d + L * (12 * d * d + 13 * d) + 2 * d
    assert 124_000_000 < tied < 124_600_000 and g["hidden"] == 4 * d and g["heads"] == 12
    with pytest.raises(SystemExit):
        gpu.main(["--shape", "gpt3"])


@pytest.mark.slow
def test_gpu_script_tiny_every_configuration(tmp_path):
    r = _run(tmp_path)
    _check(r, ["dense", "blocked", "fused"], ["float32", "bfloat16"])
    assert r["torch_compiled"] is False


@pytest.mark.slow
def test_gpu_script_compiled_torch_baseline(tmp_path):
    # the baseline through torch.compile, as on a GPU (~100 s on CPU, most of it inductor's
    # C++ compile): the same loss as itde and the uncompiled model
    r = _run(tmp_path, "--impls", "dense", "--dtypes", "float32", "--torch-compile", "on")
    _check(r, ["dense"], ["float32"])
    assert r["torch_compiled"] is True and r["records"][0]["torch_compile_s"] > 0


def test_gpu_script_refuses_cudnn_without_a_gpu(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit) as e:  # argparse's error: exit status 2
        gpu.main(["--tiny", "--impls", "cudnn", "--out", str(out)])
    assert e.value.code == 2 and "--impls cudnn needs an NVIDIA GPU" in capsys.readouterr().err
    assert not out.exists()


def test_nanogpt_benchmark_tiny_trains_both_on_the_same_stream(tmp_path):
    # benchmarks/bench_nanogpt.py --tiny, in this process: itde's GPT and nanoGPT's in
    # PyTorch start from the same weights and see the same batches with the same
    # optimiser, so their validation losses agree at every evaluation (a different
    # stream, schedule, decay mask or architecture would part them at once)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_nanogpt
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    r = bench_nanogpt.main(["--tiny", "--variants", "--out", str(tmp_path),
                            "--cache-dir", str(tmp_path)])  # fmt: skip
    assert json.loads((tmp_path / "bench_nanogpt.json").read_text()) == r
    (run,) = r["seeds"]
    assert run["initial_max_abs_logit_diff"] < 1e-5
    assert [e["step"] for e in run["evals"]] == [0, 6, 12]
    for e in run["evals"]:
        assert e["itde"] == pytest.approx(e["torch"], abs=2e-4), e
    assert run["evals"][-1]["itde"] < run["evals"][0]["itde"] - 0.1  # it learns
    assert run["timed_steps"] == 11
    s = run["step_s"]
    assert run["ratio_itde_over_torch"] == pytest.approx(s["itde"] / s["torch"])
    assert run["tokens_per_s"]["itde"] == pytest.approx(4 * 16 / s["itde"])
    assert r["optim"]["b2"] == 0.99 and r["optim"]["weight_decay"] == 0.1


def _bench_nanogpt():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_nanogpt
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_nanogpt


def test_nanogpt_continuous_variants_start_from_the_same_network():
    # the variants' starting point: the GPT's per-layer controls interpolated in depth
    # (one Legendre mode per layer) are the same network under Lie at dt = 1, with the
    # same trained-parameter count
    b = _bench_nanogpt()
    torch.manual_seed(0)
    net = b.GPT(11, 8, 16, 3, 2)
    with torch.no_grad():  # norms that differ between layers (at initialisation all are 1)
        for p in net.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.3)
    init = b.itde_from_gpt(net)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 11, (2, 8)))
    want = np.asarray(b.itde_logits(init, x))
    lie = b.smooth(init, "lie", 1.0)
    assert isinstance(lie.equation.controls, itde.LegendreControls)
    assert lie.equation.controls.n_modes == 3
    np.testing.assert_allclose(np.asarray(b.itde_logits(lie, x)), want, atol=2e-5)
    assert b.n_trained(lie) == b.n_trained(init)
    # 3 layers of 16 wide: 4 * 16^2 + 2 * 16 * 64 weights, 9 * 16 biases and 4 * 16
    # LayerNorm gains/shifts each; embeddings 11 x 16 and 8 x 16; final LayerNorm
    assert b.n_trained(init) == 3 * (4 * 256 + 2 * 16 * 64 + 9 * 16 + 4 * 16) + 19 * 16 + 32
    rk4 = b.smooth(init, "rk4", 1.0)
    assert (rk4.scheme, rk4.dt) == ("rk4", 1.0) and eqx.tree_equal(rk4.equation, lie.equation)


@pytest.mark.slow
def test_nanogpt_benchmark_tiny_variants(tmp_path):
    """`bench_nanogpt.py --tiny` with every continuous variant (about a minute: two
    training compilations per variant); the default counterpart is
    `test_nanogpt_continuous_variants_start_from_the_same_network`."""
    b = _bench_nanogpt()
    r = b.main(["--tiny", "--no-torch", "--out", str(tmp_path), "--cache-dir", str(tmp_path)])
    (run,) = r["seeds"]
    assert "torch" not in run["step_s"] and run["evals"][-1]["torch"] is None
    names = [v["name"] for v in run["variants"]]
    assert names == list(b.VARIANTS)
    for v in run["variants"]:
        assert v["params"] == run["params"]
        assert v["steps"] >= 5 and [e["step"] for e in v["evals"]][0] == 0
        assert v["evals"][-1]["step"] == v["steps"]
        assert v["train_s"] == pytest.approx(v["step_s"] * v["steps"])
        ratio = v["calibration_s"]["variant"] / v["calibration_s"]["discrete"]
        assert v["step_ratio_to_discrete"] == pytest.approx(ratio)
        assert v["steps"] == max(5, min(12, int(12 / ratio)))
        assert v["evals"][-1]["val"] < v["evals"][0]["val"]  # it learns
        assert 0 < v["evals"][-1]["eval_continuum_distance"] < 1
    assert r["variants"]["rk4+consistency"]["consistency"] == 1.0


@pytest.mark.slow
def test_continuity_benchmark_tiny_writes_its_table(tmp_path):
    """`benchmarks/continuity.py --tiny`: the four option sets, each trained and measured
    (about a minute: four training compilations)."""
    script = ROOT / "benchmarks" / "continuity.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "solvers")]))
    proc = subprocess.run(
        [sys.executable, str(script), "--tiny", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads((tmp_path / "continuity.json").read_text())
    assert [row["option"] for row in r["rows"]] == ["none", "consistency", "transport", "both"]
    for row in r["rows"]:
        assert 0 <= row["distance_dt_over_8"] < 1 and row["transport"] > 0
    assert "| option | seq. accuracy" in proc.stdout and "say nothing" in proc.stdout


def test_every_mutant_of_the_catalogue_still_applies():
    """`benchmarks/mutants.toml`: each mutant's `find` occurs exactly once in its file and
    its tests exist, so that a change to the code is noticed here (a mutant whose line
    is gone reports `not-applicable` only when someone runs the study)."""
    import tomllib

    mutants = tomllib.loads((ROOT / "benchmarks" / "mutants.toml").read_text())["mutant"]
    assert len(mutants) >= 100 and len({m["name"] for m in mutants}) == len(mutants)
    stale = [m["name"] for m in mutants if (ROOT / m["file"]).read_text().count(m["find"]) != 1]
    assert not stale, f"mutants whose `find` is not exactly once in their file: {stale}"
    tests = {t.split("::")[0] for m in mutants for t in m["tests"]}
    assert all((ROOT / t).is_file() for t in tests), sorted(
        t for t in tests if not (ROOT / t).is_file()
    )
