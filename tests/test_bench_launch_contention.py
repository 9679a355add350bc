"""bench_launch_contention.py on the CPU: a tiny run measures the loop beside the host kernel and a
copy thread (pinned apart where there is more than one CPU), and beside a compute-only thread, and writes
every row; a bad scenario exits
in one line. (The numbers are the GPU machine's business: BENCHMARKS.md, session 17.)"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_launch_contention  # noqa: E402


def test_scenarios_parse_and_a_bad_word_is_named():
    assert bench_launch_contention.parse_scenario("idle") == {"name": "idle", "host": 0, "copy": 0, "spin": 0,
                                                              "pin": False}
    assert bench_launch_contention.parse_scenario("host=7,copy=8,pin") == {"name": "host=7,copy=8,pin", "host": 7,
                                                                         "copy": 8, "spin": 0, "pin": True}
    assert bench_launch_contention.parse_scenario("spin=15")["spin"] == 15
    with pytest.raises(SystemExit, match="'hosts=2' is not host=N"):
        bench_launch_contention.parse_scenario("hosts=2")


def test_a_tiny_run_loads_the_host_and_writes_its_rows(tmp_path):
    import os

    cpus = os.sched_getaffinity(0)
    res = bench_launch_contention.main(["--device", "cpu", "--pool-gb", "0.02", "--copy-gb", "0.07", "--seconds", "0.2",
                                        "--scenarios", "idle|host=1,copy=1,pin|spin=1", "--out", str(tmp_path)])
    idle, busy, spin = res["rows"]
    assert idle["scenario"] == "idle" and idle["x_idle"] == 1.0 and idle["host_gbs"] == idle["copy_gbs"] == 0
    assert idle["spin_gflops"] == 0 and busy["spin_gflops"] == 0
    assert busy["host_gbs"] > 0 and busy["copy_gbs"] > 0 and busy["iters"] > 0
    assert spin["spin_gflops"] > 0 and spin["host_gbs"] == spin["copy_gbs"] == 0 and spin["spin_threads"] == 1
    assert busy["pinned"] == (len(cpus) > 1) and 0 < busy["cpu_over_wall"] <= 1.05
    assert 0 < busy["cpu_us_per_iter"] <= busy["us_per_iter"] * 1.05 and idle["x_idle_cpu"] == 1.0
    assert os.sched_getaffinity(0) == cpus  # the loop's affinity is given back
    assert json.loads((tmp_path / "launch_contention.json").read_text())["rows"][1]["scenario"] == "host=1,copy=1,pin"
