"""`benchmarks/bench_session.py` runs: a session of prompts of different lengths, itde
against transformers, compile included, with the programs it compiled and its mappings."""

import json
import sys
from pathlib import Path

import pytest

import itde

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_session  # noqa: E402


def test_one_session_in_process_writes_its_table(tmp_path):
    """`--tiny --single`: the record is complete, itde's greedy tokens are transformers',
    and the three prompts of one bucket compiled three programs (the rows' keys, the
    prefill and the decode loop; the layers are split on the host), not some per prompt."""
    itde.programs.clear()  # count from nothing, whatever ran before in this process
    r = bench_session.main(["--tiny", "--single", "--prompts", "3", "--min", "5", "--max",
                            "60", "--new", "2", "--out", str(tmp_path)])["single"]  # fmt: skip
    assert json.loads((tmp_path / "bench_session.json").read_text())["single"] == r
    assert len(set(r["lengths"])) == 3 and r["tokens_agreeing"] == r["tokens"] == 6
    assert r["itde_programs_compiled"] == 3
    assert r["itde_s"] > 0 and r["transformers_s"] > 0 and r["ratio"] > 0


@pytest.mark.slow
def test_three_processes_cold_fill_warm(tmp_path):
    """The full run at a tiny size: a cold process, one that fills a persistent cache and
    one that loads from it (no compilation of the library's programs)."""
    r = bench_session.main(["--tiny", "--prompts", "3", "--max", "50", "--new", "2",
                            "--out", str(tmp_path)])  # fmt: skip
    assert r["cold"]["xla_loaded"] == 0 and r["warm"]["xla_loaded"] >= 2
    assert all(r[k]["tokens_agreeing"] == r[k]["tokens"] for k in ("cold", "fill", "warm"))
