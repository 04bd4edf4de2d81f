"""`benchmarks/bench_generate.py --tiny` runs: itde's cached generation against
transformers' `generate` with its cache, on the same tiny GPT-2, and writes its JSON."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_generate  # noqa: E402


def test_generate_benchmark_tiny_writes_its_table(tmp_path):
    r = bench_generate.main(["--tiny", "--rounds", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "bench_generate.json").read_text())
    assert saved == r and r["tiny"] is True and r["new"] == 8
    # float32 greedy tokens of the same weights: the same continuation
    assert r["tokens_agreeing"] == 8
    assert r["itde_tokens_per_s"] > 0 and r["transformers_tokens_per_s"] > 0
    assert r["itde_compile_s"] == r["itde_first_call_s"] - r["itde_s"]


def test_generate_benchmark_batch_agrees_with_transformers_row_by_row(tmp_path):
    """`--batch 3`: three prompts at once on both sides, every drawn token compared."""
    r = bench_generate.main(["--tiny", "--rounds", "1", "--batch", "3", "--out", str(tmp_path)])
    assert r["batch"] == 3 and r["tokens_agreeing"] == 3 * 8
