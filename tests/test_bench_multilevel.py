"""`benchmarks/bench_multilevel.py --tiny`: runs, and its discrete baseline is
`bench_nanogpt.py`'s discrete itde GPT (same stream, optimiser, evaluation), bit for bit."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    import bench_multilevel
    import bench_nanogpt

    return bench_multilevel, bench_nanogpt


@pytest.fixture(scope="module")
def tiny(bench, tmp_path_factory):
    bm, _ = bench
    out = tmp_path_factory.mktemp("bench") / "b"
    return out, bm.main(["--tiny", "--layers", "2", "--steps", "4", "--eval-every", "2",
                      "--methods", "discrete", "ml-2x-50", "--out", str(out)])  # fmt: skip


def test_tiny_run_writes_its_table_figure_and_counts(bench, tiny):
    _, bn = bench
    out, result = tiny
    assert (out / "bench_multilevel.png").stat().st_size > 0
    saved = sorted(f.name for f in (out / "models").iterdir())
    assert saved == ["L2_seed0_discrete.eqx", "L2_seed0_ml-2x-50.eqx"]
    assert json.loads((out / "bench_multilevel.json").read_text())["summary"]
    (run,) = result["runs"]
    base, ml = run["methods"]
    assert base["method"] == "discrete" and base["time_ratio"] == 1.0
    from itde.data import TokenCorpus, builtin_text_path

    corpus = TokenCorpus.from_path(builtin_text_path(), progress=False)
    # FLOPs: 2 of the 4 steps run 1 layer instead of 2 (6 layer-steps against 8); per
    # sequence and layer 12 d^2 n multiply-adds in the matmuls and 2 n^2 d in attention,
    # d V n in the head
    d, n, v = bn.TINY["width"], bn.TINY["context"], corpus.vocab_size
    layer, head = 12 * d * d * n + 2 * n * n * d, d * v * n
    assert ml["flops_ratio"] == pytest.approx((6 * layer + 4 * head) / (8 * layer + 4 * head))
    assert [e["dt"] for e in ml["evals"]] == [1.0, 2.0, 1.0]  # start, end of coarse, end
    assert set(base["val_at_dt"]) == {"2.0", "0.5"}  # dt = 4 needs 4 layers


@pytest.mark.slow
def test_tiny_baseline_is_bench_nanogpts_discrete_gpt(bench, tiny):
    """The same GPT trained by bench_nanogpt on the same stream ends at the same loss."""
    _, bn = bench
    _, result = tiny
    from itde.data import TokenCorpus, builtin_text_path

    corpus = TokenCorpus.from_path(builtin_text_path(), progress=False)
    s = {**bn.TINY, "steps": 4, "eval_every": 2}
    ref = bn.run_seed(corpus, s, 0, (), with_torch=False, log=lambda *_: None)
    assert result["runs"][0]["methods"][0]["final_val"] == ref["evals"][-1]["itde"]


def test_merge_takes_runs_made_apart_into_one_summary_and_figure(bench, tiny, tmp_path):
    """`--merge`: a second seed's run (here the tiny run with its seed and losses changed)
    joins the first; each method's summary is the mean over both, each seed's time to the
    target kept; the same run twice, or a run of another set-up, is refused."""
    bm, _ = bench
    out, result = tiny
    other = json.loads((out / "bench_multilevel.json").read_text())
    (run,) = other["runs"]
    run["seed"] = 1
    for m in run["methods"]:
        m["final_val"] += 0.5
        m["time_ratio"] *= 2
    second = tmp_path / "seed1.json"
    second.write_text(json.dumps(other))
    merged = bm.main(["--merge", str(out / "bench_multilevel.json"), str(second),
                      "--out", str(tmp_path / "all")])  # fmt: skip
    assert [(r["n_layers"], r["seed"]) for r in merged["runs"]] == [(2, 0), (2, 1)]
    (first,) = result["runs"]
    for m0, m1 in zip(first["methods"], run["methods"], strict=True):
        got = merged["summary"][f"2/{m0['method']}"]
        assert got["final_val"] == pytest.approx((m0["final_val"] + m1["final_val"]) / 2)
        assert got["time_ratio"] == pytest.approx(m0["time_ratio"] * 1.5)
        assert got["time_to_target"] == [m0["time_to_target"], m1["time_to_target"]]
    assert (tmp_path / "all" / "bench_multilevel.png").stat().st_size > 0
    assert json.loads((tmp_path / "all" / "bench_multilevel.json").read_text()) == merged
    with pytest.raises(SystemExit, match="ml-2x-50 at 2 layers, seed 0 is in both"):
        bm.main(["--merge", str(out / "bench_multilevel.json"),
                 str(out / "bench_multilevel.json"), "--out", str(tmp_path / "x")])  # fmt: skip
    other["steps"] += 1
    second.write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="has steps"):
        bm.main(["--merge", str(out / "bench_multilevel.json"), str(second),
                 "--out", str(tmp_path / "y")])  # fmt: skip


def test_merge_joins_methods_of_one_seed_run_in_two_processes(bench, tiny, tmp_path):
    """The same depth and seed in two files: one run with the methods of both, the added
    method keeping its own process's discrete time (its ratios' base); the discrete GPT
    once."""
    bm, _ = bench
    out, result = tiny
    other = json.loads((out / "bench_multilevel.json").read_text())
    (run,) = other["runs"]
    run["discrete_train_s"] *= 3
    run["methods"][1]["method"] = "ml-other"
    second = tmp_path / "other.json"
    second.write_text(json.dumps(other))
    merged = bm.main(["--merge", str(out / "bench_multilevel.json"), str(second),
                      "--out", str(tmp_path / "all")])  # fmt: skip
    (joined,) = merged["runs"]
    names = [m["method"] for m in joined["methods"]]
    assert names == ["discrete", "ml-2x-50", "ml-other"]
    assert joined["methods"][2]["discrete_train_s"] == run["discrete_train_s"]
    assert joined["discrete_train_s"] == result["runs"][0]["discrete_train_s"]
    assert set(merged["summary"]) == {"2/discrete", "2/ml-2x-50", "2/ml-other"}
    # the figure's times: each method against its own process's discrete GPT
    added = joined["methods"][2]
    xs, ys = bm.curve(joined, added)
    assert xs == [e["train_s"] / run["discrete_train_s"] for e in added["evals"]]
    assert ys == [e["val"] for e in added["evals"]]
