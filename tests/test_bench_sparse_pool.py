"""benchmarks/bench_sparse_pool.py runs end to end on a small trace, and its numbers keep their order:
no policy beats Belady (the future known), which no fixed set beats either."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_sparse_pool_bench_runs_and_its_ceilings_bound_the_policies(tmp_path, capsys):
    import bench_sparse_pool

    out = tmp_path / "pool.json"
    assert bench_sparse_pool.main(["--experts", "32", "--layers", "2", "--top-k", "4", "--batch", "4", "--slots", "8",
                                   "--steps", "40", "--warm-up", "8", "--policies", "lfu-decay,lru", "--max-admit",
                                   "1,4", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["rows"]) == 4 and "| belady (future known) |" in capsys.readouterr().out
    top, bel = res["ceilings"]["static_top"], res["ceilings"]["belady"]
    assert 0 < top <= bel <= 1
    assert all(0 <= r["hit"] <= bel for r in res["rows"])
