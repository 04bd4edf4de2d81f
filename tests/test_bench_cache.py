"""`benchmarks/bench_generate.py --tiny` runs: itde's cached generation against
transformers' `generate` with its cache, on the same tiny GPT-2, and writes its JSON.

The generations run for real (their tokens are compared), but the benchmark reads a clock
that moves only when one of them returns, by a time the test gives it: its times, tokens/s,
ratio and compile time are then known in advance and checked against numbers worked out by
hand (a median of the rounds, the first call less a warm one)."""

import json
import sys
import types
from pathlib import Path

import pytest
import transformers

import itde

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_generate  # noqa: E402

# Seconds each call takes on the test's clock: itde's first call (3 s of compilation on top
# of a warm call's 0.5 s), then one a round; transformers' warm-up, then one a round. The
# medians: itde 0.5 s, transformers 2 s; the rounds' ratios 0.5, 0.45, 0.075 (median 0.45,
# not the ratio of the medians, 0.25).
ITDE_S = [3.5, 0.5, 0.9, 0.3]
HF_S = [9.0, 1.0, 2.0, 4.0]


@pytest.fixture
def clock(monkeypatch):
    """The benchmark's clock, moved by each generation as it returns by the next of its
    scripted times (`ITDE_S` for itde's, `HF_S` for transformers')."""
    now = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(bench_generate, "time", types.SimpleNamespace(perf_counter=lambda: now.t))

    def script(cls, name, times):
        original, left = getattr(cls, name), list(times)

        def timed(*args, **kwargs):
            out = original(*args, **kwargs)
            now.t += left.pop(0)
            return out

        monkeypatch.setattr(cls, name, timed)

    script(transformers.GPT2LMHeadModel, "generate", HF_S)
    for name in ("generate", "generate_batch"):  # --batch 1 calls generate, else the batch
        script(itde.interop.HFCausalLM, name, ITDE_S)


def test_generate_benchmark_tiny_writes_its_table(tmp_path, clock):
    r = bench_generate.main(["--tiny", "--rounds", "3", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_generate.json").read_text())
    assert saved == r and r["tiny"] is True and r["new"] == 8
    # float32 greedy tokens of the same weights: the same continuation
    assert r["tokens_agreeing"] == 8
    assert r["itde_s"] == pytest.approx(0.5) and r["transformers_s"] == pytest.approx(2.0)
    assert r["itde_tokens_per_s"] == pytest.approx(8 / 0.5)
    assert r["transformers_tokens_per_s"] == pytest.approx(8 / 2.0)
    assert r["ratio"] == pytest.approx(0.45)
    assert r["itde_first_call_s"] == pytest.approx(3.5)
    assert r["itde_compile_s"] == pytest.approx(3.0)


def test_generate_benchmark_batch_agrees_with_transformers_row_by_row(tmp_path, clock):
    """`--batch 3`: three prompts at once on both sides, every drawn token compared; tokens/s
    counts every row's new tokens."""
    r = bench_generate.main(["--tiny", "--rounds", "3", "--batch", "3", "--out", str(tmp_path)])
    assert r["batch"] == 3 and r["tokens_agreeing"] == 3 * 8
    assert r["itde_tokens_per_s"] == pytest.approx(3 * 8 / 0.5)
    assert r["transformers_tokens_per_s"] == pytest.approx(3 * 8 / 2.0)
