"""Issue 13, "also prove": serving under memory pressure, and two TP ranks sharing one page cache.

The drivers are benchmarks/soak_pressure.py and benchmarks/bench_ranks.py (the lead runs them at several
GiB on the H200); here they run small on the CPU. The soak needs a writable memory cgroup (root, v1 or
v2) and is skipped cleanly where there is none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

from fakes import flip_byte  # noqa: E402


def _cgroup_reason() -> str | None:
    """Why no memory cgroup can be made here (None: one can)."""
    try:
        from vllm_runner import Cgroup
    except Exception as e:  # noqa: BLE001 - any import problem means: cannot test here
        return f"benchmarks/vllm_runner.py does not import ({e})"
    cg = Cgroup(f"mmo-probe-{os.getpid()}", 64 << 20)
    try:
        return None if cg.enforced else cg.reason or "no memory cgroup"
    finally:
        cg.remove()


def _driver(script: str, *args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def cgroups():
    reason = _cgroup_reason()
    if reason:
        pytest.skip(f"no writable memory cgroup: {reason}")


def test_soak_serves_a_cache_twice_the_cgroup_cap_with_every_byte_right(cgroups, tmp_path):
    out = tmp_path / "soak.json"
    proc = _driver("soak_pressure.py", "--gib", 0.75, "--cap-gib", 0.34, "--seconds", 120, "--device", "cpu",
                   "--workdir", tmp_path / "w", "--out", out)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["ok"] and r["returncode"] == 0 and r["signal"] is None and r["oom_kill"] == 0
    assert r["cache_bytes"] >= 2 * r["cap_bytes"] and r["distinct_bytes"] >= 2 * r["cap_bytes"]
    assert r["mismatches"] == 0 and r["bytes"] >= 2 * r["cache_bytes"]
    assert r["memory_peak"] is None or r["memory_peak"] <= r["cap_bytes"]


def test_soak_fails_when_the_cap_cannot_hold_the_server(cgroups, tmp_path):
    """The harness can fail: a cap below what the server process itself needs ends in an OOM kill,
    reported as a failed soak (exit 1), not as a pass."""
    out = tmp_path / "soak.json"
    proc = _driver("soak_pressure.py", "--gib", 0.25, "--cap-gib", 0.06, "--seconds", 30, "--device", "cpu",
                   "--workdir", tmp_path / "w", "--out", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert not r["ok"] and (r["oom_kill"] or r["signal"] == "SIGKILL")


def test_soak_refuses_a_cache_under_twice_the_cap(tmp_path):
    proc = _driver("soak_pressure.py", "--gib", 0.05, "--cap-gib", 0.04, "--workdir", tmp_path / "w")
    assert proc.returncode == 2 and "twice the cap" in proc.stderr


def test_the_soaks_checker_catches_a_flipped_byte(tmp_path):
    from mmap_offload.cache_reader import open_cache
    from mmap_offload.transfer import make_engine
    from soak_pressure import build_random_cache, serve_and_check

    d = build_random_cache(tmp_path / "rank-0-of-1", 8 << 20, experts=4, record_mib=0.5)
    cache = open_cache(d)
    flip_byte(cache.layer_file(cache.layers[1]), 2 * cache.record_nbytes + 9, 0x10)
    eng = make_engine("auto", "cpu", pinned_bytes=8 << 20, threads=2)
    try:
        r = serve_and_check(cache, eng, torch.device("cpu"), top_k=4, max_bytes=1, seconds=60, seed=0)
    finally:
        eng.close()
    assert r["mismatches"] >= 1 and f"layer {cache.layers[1]} expert 2" in r["first_mismatches"][0]


def test_two_ranks_serve_one_cache_at_once_with_the_right_bytes(tmp_path):
    from mmap_offload.cache_reader import open_cache
    from mmap_offload.synth import make_checkpoint
    from mmap_offload.warmup import warmup

    ckpt = make_checkpoint(tmp_path / "ckpt", arch="mixtral", quant="w4a16", group_size=128, num_layers=2,
                           num_experts=4, hidden=256, intermediate=512, top_k=2, vocab_size=256, num_heads=4,
                           num_kv_heads=2)
    warmup(ckpt, tmp_path / "cache", tp_size=2, device="cpu")
    out = tmp_path / "ranks.json"
    proc = _driver("bench_ranks.py", "--cache-dir", tmp_path / "cache", "--device", "cpu", "--passes", 50,
                   "--threads", 2, "--workdir", tmp_path / "w", "--out", out)
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r["ok"] and r["overlap_s"] > 0  # both ranks served at the same time
    for row in r["rows"]:
        c = open_cache(tmp_path / "cache", row["rank"], 2)
        assert row["mismatches"] == 0
        assert row["checked_bytes"] == len(c.layers) * c.num_experts * c.record_nbytes
    # the two ranks' bytes differ (each served its own shard, not the other's)
    a, b = open_cache(tmp_path / "cache", 0, 2), open_cache(tmp_path / "cache", 1, 2)
    assert a.layer_file(a.layers[0]).read_bytes() != b.layer_file(b.layers[0]).read_bytes()

    # a flipped byte in rank 1's shard fails the run (the check is real)
    flip_byte(b.layer_file(b.layers[1]), b.record_nbytes + 3)
    proc = _driver("bench_ranks.py", "--cache-dir", tmp_path / "cache", "--device", "cpu", "--passes", 1,
                   "--threads", 2, "--workdir", tmp_path / "w2")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rank1 = [l for l in proc.stdout.splitlines() if l.startswith("1 ")][0]
    assert "mismatch" in rank1 and " 0 mismatch" not in rank1
