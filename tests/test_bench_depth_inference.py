"""`benchmarks/bench_depth_inference.py`: the adaptive solve's evaluation counts are the
field calls it makes, it steps onto every layer boundary, and on a tiny bench_multilevel
run the loss at dt = 1 is bench_multilevel's `final_val` of the same model, bit for bit."""

import json
import sys
from pathlib import Path

import diffrax
import equinox as eqx
import jax
import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bd():
    sys.path.insert(0, str(BENCH))
    import bench_depth_inference

    return bench_depth_inference


@pytest.fixture(scope="module")
def small(bd):
    """A random nanoGPT (2 layers) in itde, its matrices scaled up 5 times (at nanoGPT's
    initial scale the field is so small that Tsit5 takes one step per layer at any
    tolerance), and three validation sequences, one per chunk (so that the vmapped solve
    of a chunk runs exactly that sequence's steps)."""
    from bench_nanogpt import GPT, itde_from_gpt

    torch.manual_seed(0)
    model = itde_from_gpt(GPT(11, 8, 16, 2, 2))
    big = jax.tree.map(lambda x: 5 * x if eqx.is_inexact_array(x) and x.ndim >= 2 else x,
                       model.equation)  # fmt: skip
    model = eqx.tree_at(lambda m: m.equation, model, big)
    w = np.random.default_rng(0).integers(0, 11, (3, 9)).astype(np.int32)
    return model, [(w[i : i + 1, :-1], w[i : i + 1, 1:]) for i in range(3)]


def _counted(model):
    """The model's unsplit field, counting its calls on the host."""
    import itde_solvers

    n = [0]
    (field, *rest) = model.equation.terms("tangent").terms

    def f(t, y, args):
        jax.debug.callback(lambda: n.__setitem__(0, n[0] + 1))
        return field.vf(t, y, args)

    return itde_solvers.SplitTerm((diffrax.ODETerm(f), *rest)), n


def test_adaptive_counts_are_the_field_calls_and_steps_land_on_layers(bd, small):
    model, chunks = small
    terms, n = _counted(model)
    heun = diffrax.Heun()  # no first-same-as-last stage: the count is exact
    tight = bd.adaptive_val(model, chunks, heun, 1e-6, terms=terms)
    assert tight["failed"] == 0
    assert n[0] == sum(tight["steps"]) * 2 == sum(tight["steps"]) * bd.stages(heun)
    assert tight["mean_evals"] == pytest.approx(n[0] / 3)
    assert tight["compute"] == pytest.approx(n[0] / 3 / 2)  # over L = 2 layers
    assert min(tight["steps"]) > 4 and min(tight["rejected"]) >= 1  # it did adapt
    # a loose tolerance: one step per layer (clipped onto the boundary), no rejection, and
    # the same solution as Heun's fixed step of one layer
    loose = bd.adaptive_val(model, chunks, heun, 0.5, terms=terms)
    assert loose["steps"] == [2, 2, 2] and loose["rejected"] == [0, 0, 0]
    ref = bd.rk_fixed_val(model, chunks, heun)
    assert loose["val"] == pytest.approx(ref, rel=1e-8)
    assert tight["val"] != loose["val"]
    assert bd.stages(diffrax.Tsit5()) == 7 and bd.stages(diffrax.Bosh3()) == 4
    assert tight["compute_min"] == tight["compute"]  # nothing reused


def test_first_same_as_last_counts_bound_the_field_calls(bd, small):
    """Tsit5 reuses its last stage as the next step's first, except where a step starts
    on a layer boundary (each layer's first step at least): the calls lie between
    steps x 6 + layers and steps x 7, the bounds the benchmark reports."""
    model, chunks = small
    terms, n = _counted(model)
    r = bd.adaptive_val(model, chunks, diffrax.Tsit5(), 1e-6, terms=terms)
    steps, first_steps = sum(r["steps"]), 3 * 2  # 3 sequences, 2 layers
    assert steps > 3 * 4  # it adapted
    assert steps * 6 + first_steps <= n[0] < steps * 7
    assert r["compute_min"] * 2 * 3 == pytest.approx(steps * 6 + first_steps)
    assert r["compute"] * 2 * 3 == pytest.approx(steps * 7)


def test_bad_tolerances_are_refused(bd, small):
    model, chunks = small
    with pytest.raises(ValueError, match=r"`tol`=0 must be a tolerance in \(0, 1\)"):
        bd.adaptive_val(model, chunks, diffrax.Heun(), 0)
    with pytest.raises(SystemExit, match=r"--tols 2.0: each tolerance must lie in \(0, 1\)"):
        bd.main(["--tols", "2", "--runs", "nowhere"])
    with pytest.raises(SystemExit, match="--runs nowhere: no bench_multilevel.json there"):
        bd.main(["--runs", "nowhere"])


@pytest.mark.slow
def test_tiny_run_dt1_is_bench_multilevels_final_val(bd, tmp_path):
    import bench_multilevel

    runs = tmp_path / "ml"
    ml = bench_multilevel.main(["--tiny", "--layers", "4", "--steps", "4", "--eval-every",
                                "2", "--methods", "discrete", "ml-2x-50", "--out",
                                str(runs)])  # fmt: skip
    res = bd.main(["--tiny", "--runs", str(runs), "--solvers", "heun", "--out",
                   str(tmp_path / "di")])  # fmt: skip
    assert (tmp_path / "di" / "bench_depth_inference.png").stat().st_size > 0
    saved = json.loads((tmp_path / "di" / "bench_depth_inference.json").read_text())
    assert saved["summary"].keys() == {"4/discrete", "4/ml-2x-50"}
    (run,) = ml["runs"]
    rows = {r["method"]: r for r in res["rows"]}
    for m in run["methods"]:
        mine = rows[m["method"]]
        assert mine["fixed"]["1.0"] == m["final_val"]  # bit for bit
        for dt, v in m["val_at_dt"].items():  # bench_multilevel's own dt = 2, 4, 1/2
            assert mine["fixed"][dt] == v
        assert list(mine["fixed"]) == ["4.0", "2.0", "1.0", "0.5"]
        for a in mine["adaptive"]["heun"]:
            assert a["failed"] == 0
            assert a["mean_evals"] == pytest.approx(2 * np.mean(a["steps"]))
            assert min(a["steps"]) >= 4  # never fewer steps than layers
            assert a["compute"] >= 2.0
    # the table's verdict follows: Heun needs at least 2 evaluations per layer
    for v in res["summary"].values():
        assert v["adaptive_reaches_fine_cheaper"] == []
        assert v["fixed"]["1.0"]["n"] == 1
