"""cpus.py: default thread counts count physical cores, read from sysfs topology (a made-up tree here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmap_offload import cpus


def _tree(root: Path, siblings: dict[int, str], name: str = "thread_siblings_list") -> Path:
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / name).write_text(text + "\n")
    return root


def smt_host(root: Path, cores: int = 4) -> Path:
    """cores x 2 threads, Linux's usual numbering: CPU c and c + cores are one core."""
    return _tree(root, {c: f"{c % cores},{c % cores + cores}" for c in range(2 * cores)})


def test_parse_cpu_list():
    assert cpus.parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpus.parse_cpu_list("5") == {5}
    for bad in ("", "3-1", "a", "1-"):
        with pytest.raises(ValueError):
            cpus.parse_cpu_list(bad)


def test_two_threads_per_core_count_once(tmp_path):
    root = smt_host(tmp_path, cores=4)
    assert cpus.core_count(set(range(8)), root) == 4
    assert cpus.core_count({0, 4}, root) == 1  # both threads of core 0
    assert cpus.core_count({0, 1, 4}, root) == 2
    assert cpus.core_count({0, 1, 2, 3}, root) == 4  # one thread of each core


def test_newer_kernels_core_cpus_list_and_ranges(tmp_path):
    root = _tree(tmp_path, {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}, name="core_cpus_list")
    assert cpus.core_count({0, 1, 2, 3}, root) == 2


def test_unreadable_topology_counts_each_cpu(tmp_path):
    root = _tree(tmp_path, {0: "0,2", 2: "0,2", 1: "garbage", 3: "7"})  # 3 names a list without itself
    # cpu0/cpu2: one core; cpu1 unparsable, cpu3 inconsistent, cpu4 absent: a core each
    assert cpus.core_count({0, 1, 2, 3, 4}, root) == 4
    assert cpus.core_count(set(), root) == 1  # never 0


def test_default_thread_counts_use_cores_not_hardware_threads(tmp_path, monkeypatch):
    """On 8 cores x 2 threads the backend's default host threads per rank are one per core but the
    launching thread's (the copy threads, asleep while idle, on the siblings); the kernel's own default
    is the core count."""
    from mmap_offload.host import hybrid
    from mmap_offload.host.kernel import HostKernel
    from mmap_offload.vllm_backend import host_experts

    monkeypatch.setattr(cpus, "SYSFS", smt_host(tmp_path, cores=8))
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    assert cpus.core_count() == 8
    assert host_experts.default_threads(1, engine_threads=3) == 7  # 8 cores - the launching thread's, not 16 - 4
    assert host_experts.default_threads(1, engine_threads=10) == 5  # 16 threads - 10 copy - 1 launching
    assert host_experts.default_threads(2, engine_threads=3) == 3  # 4 cores per rank - 1
    assert host_experts.default_threads(2) == 4
    assert hybrid.default_threads(2) == (6, 8)
    k = HostKernel(threads=0, isa="plain")
    try:
        assert k.threads == 8
    finally:
        k.close()
    k = HostKernel(threads=3, isa="plain")  # an explicit count is taken as given
    try:
        assert k.threads == 3
    finally:
        k.close()
