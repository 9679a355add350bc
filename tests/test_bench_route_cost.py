"""bench_route_cost.py on the CPU: a tiny run takes the stream hybrid path in every layer call, and its
row (microseconds per layer on the launching thread) is written as printed. (The numbers are the GPU
machine's business: BENCHMARKS.md, session 20.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_route_cost  # noqa: E402


def test_a_tiny_run_takes_the_hybrid_path_in_every_call_and_writes_its_row(tmp_path):
    row = bench_route_cost.main(["--device", "cpu", "--steps", "3", "--layers", "2", "--tokens", "3",
                                 "--out", str(tmp_path)])
    assert row["hybrid_calls"] == 3 * 2  # every measured layer call was a stream hybrid call
    assert row["variant"] == "fast" and row["fast_hybrid_calls"] == 3 * 2  # each the steady-state path
    assert row["route_us"] >= row["hybrid_call_us"] >= row["enqueue_us"] > 0
    assert row["add_host_us"] > 0 and row["step_us"] > 0 and row["floor_us"] > 0
    assert row["ours_us"] == row["step_us"] - row["floor_us"]
    assert row["standin_us"] > 0 and row["standin_floor_us"] > 0 and row["launches"] == 24
    assert row["standin_x"] == row["standin_us"] / row["standin_floor_us"]
    assert "host_funcs_step_us" not in row  # the no-op host functions' loop is CUDA's only
    assert json.loads((tmp_path / "route_cost.json").read_text()) == row


def test_one_token_with_room_in_the_pool_takes_the_async_expert_step(tmp_path):
    """--tokens 1 --slots 16: a call's 8 ids fit the pool, so every layer call takes the async expert step
    (batch 1's path in vLLM: no host job), and the stand-in's launches are timed in both loops."""
    row = bench_route_cost.main(["--device", "cpu", "--steps", "3", "--layers", "2", "--tokens", "1", "--slots", "16",
                                 "--launches", "4"])
    assert row["hybrid_calls"] == 0 and row["async_calls"] == 3 * 2
    assert row["standin_us"] > 0 and row["standin_floor_us"] > 0 and row["launches"] == 4


def test_the_general_variant_takes_route_s_general_path_for_every_call(tmp_path):
    """--variant general / old: the same calls through route()'s general path (what session 30's fast path
    replaced), the stream hybrid call in each; on the CPU no launches are fused in any variant."""
    for variant in ("general", "old"):
        row = bench_route_cost.main(["--device", "cpu", "--steps", "3", "--layers", "2", "--tokens", "3",
                                     "--launches", "2", "--variant", variant])
        assert row["variant"] == variant and row["hybrid_calls"] == 3 * 2 and row["fast_hybrid_calls"] == 0, row
        assert not row["fused_launches"]
