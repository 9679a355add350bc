"""benchmarks/bench_cpu_pairs.py: the probe runs on whatever CPUs it may use and reports every ordered
pair (not timed: what the numbers are is the GPU machine's business)."""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_probe_measures_every_cpu_and_ordered_pair(tmp_path, capsys):
    import bench_cpu_pairs

    cpus = sorted(os.sched_getaffinity(0))[:2]
    text = ",".join(map(str, cpus))
    res = bench_cpu_pairs.main(["--cpus", text, "--rounds", "2", "--repeats", "1", "--sibling-ratio", "0",
                                "--out", str(tmp_path)])
    assert res["cpus"] == cpus and all(len(res["idle_us"][c]) == 2 and min(res["idle_us"][c]) > 0 for c in cpus)
    assert {(i, j) for i in cpus for j in res["pair_ratio"][i]} == {(i, j) for i in cpus for j in cpus if i != j}
    assert all(r > 0 for i in cpus for r in res["pair_ratio"][i].values())
    assert set(res["all_busy_ratio"]) == set(cpus)
    # a ratio threshold of 0 names every other CPU a sibling: the report follows the threshold
    assert res["measured_siblings"] == {i: [j for j in cpus if j != i] for i in cpus}
    assert json.loads((tmp_path / "cpu_pairs.json").read_text())["cpus"] == cpus
    assert "| cpu | idle us" in capsys.readouterr().out
    # the probe gives this process its CPUs back
    assert sorted(os.sched_getaffinity(0))[:2] == cpus


def test_cpu_lists_parse_like_the_kernels():
    import bench_cpu_pairs

    assert bench_cpu_pairs.parse_cpus("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert bench_cpu_pairs.parse_cpus(None) == sorted(os.sched_getaffinity(0))


def test_one_cpu_has_no_pairs(tmp_path):
    import bench_cpu_pairs

    cpu = sorted(os.sched_getaffinity(0))[0]
    res = bench_cpu_pairs.main(["--cpus", str(cpu), "--rounds", "1", "--repeats", "1"])
    assert res["pair_ratio"] == {cpu: {}} and res["measured_pairs"] == [] and res["all_busy_ratio"][cpu] > 0
