"""`benchmarks/bench_hf_scale.py --tiny`: the conversion-at-scale benchmark runs, on tiny
widths of the Qwen2.5-0.5B and Llama-3.2-1B configs, and its fields mean what they say."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_hf_scale
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return bench_hf_scale


def test_bench_hf_scale_tiny_writes_its_json(tmp_path):
    bench = _bench()
    out = tmp_path / "hf_scale.json"
    args = ["--tiny", "--shapes", "llama-3.2-1b", "--dtypes", "bfloat16", "--out", str(out)]
    assert bench.main(args) == 0
    records = json.loads(out.read_text())["records"]
    assert [(r["shape"], r["dtype"]) for r in records] == [("llama-3.2-1b (tiny)", "bfloat16")]
    for r in records:
        # the tiny config: 2 layers of width 64 (4 heads of 16, 2 kv heads), feed-forward
        # 128, vocabulary 256, tied head; counted by hand
        d, kv, f, v = 64, 2 * 16, 128, 256
        layer = d * d * 2 + 2 * d * kv + 3 * d * f + 2 * d
        assert r["parameters"] == 2 * layer + v * d + d
        assert r["model_bytes"] == r["parameters"] * (4 if r["dtype"] == "float32" else 2)
        assert r["convert_peak_bytes"] >= 0 and r["tokens"] == 16
        assert set(r["forward_s"]) == {"itde", "transformers"}
        # the same network: float32 round-off, or bfloat16's (2**-8 relative, a few roundings)
        tol = 1e-5 if r["dtype"] == "float32" else 0.1
        assert r["max_abs_diff"] <= tol * r["output_scale"], r
        # bfloat16: each side against the float32 network, the hidden state the same one
        # max_abs_diff compares (so the two errors bound it); itde keeps its residual
        # stream in float32, so its hidden state is the closer one
        hidden, logits = r["error_vs_float32"]["hidden"], r["error_vs_float32"]["logits"]
        assert r["max_abs_diff"] <= hidden["itde"] + hidden["transformers"], r
        assert 0 < hidden["itde"] <= hidden["transformers"] <= 0.05 * hidden["scale"], r
        assert 0 < logits["itde"] <= 0.05 * logits["scale"], r
        assert 0 < logits["transformers"] <= 0.05 * logits["scale"], r
        layers = r["error_vs_float32"]["after_layer"]  # 2 layers: the state after the first
        assert len(layers["itde"]) == len(layers["transformers"]) == len(layers["scale"]) == 1
        assert 0 < layers["itde"][0] <= layers["transformers"][0], r
