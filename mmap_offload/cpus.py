"""The CPUs this process may run on, and how many physical cores they are.

Default thread counts count **cores**, not hardware threads: the host kernel's (``HostKernel(threads=0)``)
is the core count, and hybrid's per rank (``vllm_backend.host_experts.default_threads``) at most one per
core but the launching thread's. On a host with two threads per core (SMT) two busy threads of one core
share its load and store units and its caches, and the host kernel is DRAM-bound with one thread per
core already (docs/BENCHMARKS.md: 80% of DRAM read bandwidth at all cores of the H200's host); counting
hardware threads would put vLLM's launching thread, the bound of eager decode at batch 1, beside a busy
sibling. llama.cpp's default thread count is the physical cores for the same reason. An explicit count
(``--mmap-host-threads``, ``HostKernel(threads=)``) is taken as given.

Cores are read from sysfs: CPUs whose ``topology/thread_siblings_list`` (``core_cpus_list`` on newer
kernels) names the same set are one core. A CPU whose topology cannot be read counts as a core of its
own, so a host or container without sysfs gets the CPU count, as before this module.
"""

from __future__ import annotations

import os
from pathlib import Path

SYSFS = Path("/sys/devices/system/cpu")  # a module constant so tests can point it at a made-up tree


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where there is none)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list (``"0-3,8,10-11"``) as a set; ValueError on anything else."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        a = int(lo)
        b = int(hi) if sep else a
        if b < a:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError("empty CPU list")
    return out


def _siblings(cpu: int, root: Path) -> frozenset[int] | None:
    topo = root / f"cpu{cpu}" / "topology"
    for name in ("core_cpus_list", "thread_siblings_list"):
        try:
            got = parse_cpu_list((topo / name).read_text())
        except (OSError, ValueError):
            continue
        if cpu in got:
            return frozenset(got)
    return None


def core_count(cpus: set[int] | None = None, root: Path | None = None) -> int:
    """How many physical cores ``cpus`` (default: ``allowed_cpus()``) are: hardware threads of one
    core count once; a CPU without readable topology counts as one core. At least 1."""
    cpus = allowed_cpus() if cpus is None else set(cpus)
    root = SYSFS if root is None else root
    cores: set = set()
    for cpu in cpus:
        sib = _siblings(cpu, root)
        cores.add(("cpu", cpu) if sib is None else sib)
    return max(1, len(cores))


__all__ = ["SYSFS", "allowed_cpus", "core_count", "parse_cpu_list"]
