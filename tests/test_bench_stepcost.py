"""`benchmarks/bench_step_cost.py --tiny` runs and reports what it promises: the FLOP
shares counted by hand, each row's time ratio to the baseline and its overhead = ratio /
count against the times it reports and a count worked out by hand, and
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


# Strang's count of A and F is unequal, so its row checks the weighting by the shares; its
# training step compiles for about 12 s more than Lie's on 2 cores: the slow tier
@pytest.mark.parametrize(
    ("scheme", "count"),
    # per token at the tiny shape A = 4 * 16^2 + 2 * 8 * 16 = 1280, F = 8 * 16^2 = 2048:
    # Lie (A + F) / (A + F) = 1, Strang (4 A + 2 F) / (A + F) = 9216 / 3328
    [
        pytest.param("lie", 1.0, id="lie"),
        pytest.param("strang", 9216 / 3328, id="strang", marks=pytest.mark.slow),
    ],
)
def test_tiny_run(bench, tmp_path, scheme, count):
    """One round (the median of one ratio is that ratio): each row's time ratio is its
    median time over the baseline's, read from the times the run reports; its count (by
    hand above) and its overhead = the ratio over that count."""
    r = bench.main(["--tiny", "--rounds", "1", "--schemes", scheme, "--out", str(tmp_path)])
    rows = {row["name"]: row for row in r["rows"]}
    assert list(rows) == ["discrete GPT (lie, per-layer)", scheme]
    base, row = rows["discrete GPT (lie, per-layer)"], rows[scheme]
    assert base["count"] == pytest.approx(1.0) and row["count"] == pytest.approx(count)
    for kind in ("train", "forward"):
        assert np.isfinite(row[f"{kind}_ms"]) and row[f"{kind}_ms"] > 0
        ratio = row[f"{kind}_ms"] / base[f"{kind}_ms"]
        assert row[f"{kind}_ratio"] == pytest.approx(ratio, rel=1e-12), kind
        assert row[f"{kind}_overhead"] == pytest.approx(ratio / count, rel=1e-12), kind
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
