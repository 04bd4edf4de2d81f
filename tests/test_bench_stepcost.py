"""`benchmarks/bench_step_cost.py --tiny` runs and reports what it promises: the FLOP
shares counted by hand, the ratio of the baseline to itself, overhead = ratio / count, and
a continuous model that is the discrete GPT (the smooth controls solved by Lie at Δt = 1
give the discrete network's logits)."""

import sys
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_step_cost
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_step_cost


def test_shares_counted_by_hand(bench):
    # nanoGPT's shape, per token: A = 4 * 128^2 + 2 * 64 * 128 = 81920 multiply-adds,
    # F = 8 * 128^2 = 131072; Strang (Heun sub-steps) = 4 A + 2 F, RK4 = 4 (A + F)
    fa, ff = bench.shares(bench.FULL)
    assert fa == pytest.approx(81920 / 212992) and ff == pytest.approx(131072 / 212992)
    c = bench.counts(bench.FULL)
    assert c["strang"] == (4, 2) and c["rk4"] == (4, 4) and c["lie"] == (1, 1)
    assert c["tsit5"] == (6, 6) and c["heun"] == (2, 2)


def test_tiny_run(bench, tmp_path):
    r = bench.main(["--tiny", "--schemes", "lie", "--out", str(tmp_path)])
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ["discrete GPT (lie, per-layer)", "lie"]
    base = rows["discrete GPT (lie, per-layer)"]
    assert base["train_ratio"] == 1.0 and base["forward_ratio"] == 1.0
    for row in rows.values():
        assert row["count"] == pytest.approx(1.0)
        assert row["train_overhead"] == pytest.approx(row["train_ratio"] / row["count"])
        assert np.isfinite(row["train_ms"]) and row["train_ms"] > 0
    assert (tmp_path / "bench_step_cost.json").exists()
    assert set(r["measured_shares"]) == {"forward", "train"}
    assert all(0 < v < 1 for v in r["measured_shares"].values())


def test_smooth_rows_are_the_discrete_network(bench):
    # Legendre controls from the layers, solved by Lie at dt = 1, read each layer's own
    # weights: the same logits as the per-layer discrete GPT
    table = bench.rows(bench.TINY, ["lie"])
    (discrete, _), (smooth, _) = table["discrete GPT (lie, per-layer)"], table["lie"]
    x = jnp.arange(bench.TINY["context"]).reshape(1, -1) % bench.TINY["vocab"]
    f = eqx.filter_jit(lambda m: m.batched(x))
    np.testing.assert_allclose(f(smooth), f(discrete), atol=2e-5, rtol=1e-4)
