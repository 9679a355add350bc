"""Host W4A16 expert kernel: GB/s of 4-bit weights read, by thread count and M, next to DRAM and torch.

    python benchmarks/bench_host_kernel.py --out host.json                  # the default run (both shapes)
    python benchmarks/bench_host_kernel.py --shapes 1024x2048 --pool-gb 0.2 --threads 1,2   # a smoke run
    python benchmarks/bench_host_kernel.py --isa all --no-torch --shapes user --threads 1,all   # paths side by side

For each shape (``mixtral``: H 4096, I 14336 per expert; ``user``: H 5120, I_r 768; or ``HxI``) and each
thread count (1, 2, 4, 8, all = the CPUs this process may use) it measures, in the same run:

- ``host``: ``HostKernel.experts_mlp`` (this package, csrc/host_kernel.c) on one layer's worth of experts
  per call (each expert gets the same M token rows), cycling through a pool of distinct experts of
  ``--pool-gb`` (default 2 GB, far beyond any LLC) so every call reads its weights from DRAM;
- ``torch``: torch's int4 CPU kernel (``_weight_int4pack_mm_for_cpu``, group 128, weights converted once
  by ``_convert_weight_to_int4pack_for_cpu``) computing the same MLP (gate|up GEMM, SiLU * up, down
  GEMM) on a pool of the same bytes, ``torch.set_num_threads`` = the thread count;
- ``dram``: a torch sum over a buffer of ``--pool-gb`` with the same thread count (read bandwidth).

GB/s counts the 4-bit weight bytes of the experts computed (3 * H * I / 2 per expert; scales excluded)
per second, median of the timed calls (``--timer thread``: by the calling thread's CPU time, for 1-thread
runs on a machine shared with other jobs, where elapsed time counts their time slices too). Bars (issue 15):
host >= 80% of dram at M = 1 with all cores; host > torch at every M. Prints a table; ``--out`` writes JSON
(inputs, machine, every row). ``--isa`` takes one path, a comma-separated list or ``all`` (every path this CPU
has): the paths are then measured back to back at each (threads, M), a row each; the bars are the first
path's. Each call's job list (a tuple of views per expert) is made before timing, as a caller keeps them
(until session 35 the timed call made it too: ~20 us of list building per 6-expert call on the build box, counted as the
kernel's Python side). Each host row's JSON carries ``diag``: the timed calls' mean, the part of it in C and
the rest (Python: checks and the job array), and in a library built with ``-DDIAG_TIMING`` (``scripts/host_kernel_sweep.sh``)
the threads' join delay, time in units and idle time per call; ``--diag`` prints it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmap_offload.host.kernel import ISAS, HostKernel, available_isas  # noqa: E402
from mmap_offload.native import library_status  # noqa: E402

SHAPES = {"mixtral": (4096, 14336), "user": (5120, 768)}
GROUP = 128


def parse_shape(s: str) -> tuple[str, int, int]:
    if s in SHAPES:
        return (s, *SHAPES[s])
    h, i = s.lower().split("x")
    return (s, int(h), int(i))


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def cpu_flags(path: str = "/proc/cpuinfo") -> list[str]:
    """The CPU's vector and matrix extensions that bear on the kernel's next paths (AVX-512 subsets,
    AVX-VNNI, AMX tiles), from the first processor's flags; [] where they cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    have = line.split(":", 1)[1].split()
                    return sorted(x for x in have if x.startswith(("avx512", "amx", "avx_vnni")))
    except OSError:
        pass
    return []


def parse_isas(spec: str, available: list[str]) -> list[str]:
    """``--isa``'s paths in order: ``auto`` (the kernel's own choice, the first available), ``all`` (every
    available path, fastest first) or names; a name the CPU lacks is an error naming the ones it has."""
    out: list[str] = []
    for name in (p.strip().lower() for p in spec.split(",") if p.strip()):
        got = available[:1] if name == "auto" else available if name == "all" else [name]
        for isa in got:
            if isa not in available:
                raise SystemExit(f"bench_host_kernel: this CPU has no {isa!r} kernel path (it has: "
                                 f"{', '.join(available)}); pass --isa auto, all or one of those")
            if isa not in out:
                out.append(isa)
    return out or available[:1]


def timed_calls(fn, seconds: float, min_reps: int = 3, clock=time.perf_counter, before=None) -> list[float]:
    """Seconds of each timed call of ``fn`` by ``clock`` (after one warm-up call, then ``before()`` if
    given), timing for about ``seconds`` of wall time."""
    fn()
    if before is not None:
        before()
    times, t_end = [], time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = clock()
        fn()
        times.append(clock() - t0)
        if len(times) >= 10000:
            break
    return times


def timed(fn, seconds: float, min_reps: int = 3, clock=time.perf_counter) -> float:
    """Median seconds of one call of ``fn`` (``timed_calls``)."""
    return statistics.median(timed_calls(fn, seconds, min_reps, clock))


def diag_summary(d: dict, call_mean_us: float) -> dict:
    """One row's ``HostKernel.diag()`` (per call, us) boiled down: the Python side of a call (the timed
    mean less the time in C), and with per-thread sums the threads' mean join delay, time in units,
    reductions, waits and idle time (open to the end of the work, less join and units) and the units'
    spread over threads."""
    out = {"calls": d["calls"], "call_us": call_mean_us, "python_us": call_mean_us - d["c_us"],
           **{k: d[k] for k in ("c_us", "prep_us", "run_us", "finish_us")}}
    th = [t for t in d.get("threads", []) if t["joined"]]
    if th:
        n = len(th)
        out.update({
            "threads_joined": sum(t["joined"] for t in th) / max(1, d["calls"]),
            "join_us": sum(t["join_us"] for t in th) / n, "join_max_us": max(t["join_us"] for t in th),
            "busy_us": sum(t["busy_us"] for t in th) / n, "red_us": sum(t["red_us"] for t in th) / n,
            "wait_us": sum(t["wait_us"] for t in th) / n,
            "idle_us": sum(d["run_us"] - t["join_us"] - t["busy_us"] for t in th) / n,
            "last_min_us": min(t["last_us"] for t in th), "units_min": min(t["units"] for t in th),
            "units_max": max(t["units"] for t in th)})
    return out


def diag_line(name: str, t: int, m: int, s: dict) -> str:
    line = (f"#   {name} {t} thr M={m}: call {s['call_us']:.0f} us = python {s['python_us']:.0f} + C {s['c_us']:.0f} "
            f"(prep {s['prep_us']:.0f}, run {s['run_us']:.0f}, finish {s['finish_us']:.0f})")
    if "busy_us" in s:
        line += (f"; per thread: joined {s['threads_joined']:.1f}, join {s['join_us']:.0f} "
                 f"(max {s['join_max_us']:.0f}), units {s['busy_us']:.0f} (sums {s['red_us']:.0f}, "
                 f"waits {s['wait_us']:.0f}), idle {s['idle_us']:.0f}, first out at {s['last_min_us']:.0f}, "
                 f"units {s['units_min']:.1f}-{s['units_max']:.1f}")
    return line


def weight_nbytes(h: int, i: int) -> int:
    return 3 * h * i // 2


class HostPool:
    """Distinct experts in the cache's Marlin layout (random words and scales: speed only; ``gen=None``:
    constant words per expert, made at memory speed, for pools of GBs where values do not matter)."""

    def __init__(self, h: int, i: int, count: int, gen: torch.Generator | None):
        g13, g2 = h // GROUP, i // GROUP if i > GROUP else 1
        self.experts = []
        for e in range(count):
            if gen is None:
                self.experts.append((torch.full((h // 16, 4 * i), 0x12345678 + e, dtype=torch.int32),
                                     torch.full((g13, 2 * i), 0.01, dtype=torch.bfloat16),
                                     torch.full((i // 16, 2 * h), 0x7654321 + e, dtype=torch.int32),
                                     torch.full((g2, h), 0.01, dtype=torch.bfloat16)))
                continue
            self.experts.append((
                torch.randint(-2**31, 2**31 - 1, (h // 16, 4 * i), dtype=torch.int32, generator=gen),
                (torch.rand(g13, 2 * i, generator=gen) * 0.01).to(torch.bfloat16),
                torch.randint(-2**31, 2**31 - 1, (i // 16, 2 * h), dtype=torch.int32, generator=gen),
                (torch.rand(g2, h, generator=gen) * 0.01).to(torch.bfloat16)))
        self.next = 0

    def take(self, n: int) -> list:
        out = []
        for _ in range(n):
            out.append(self.experts[self.next])
            self.next = (self.next + 1) % len(self.experts)
        return out


class TorchPool:
    """The same MLP with torch's int4 CPU kernel: w13 [2I, H] and w2 [H, I] converted once."""

    def __init__(self, h: int, i: int, count: int, gen: torch.Generator):
        self.experts = []
        for _ in range(count):
            w13 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.randint(0, 16, (2 * i, h), dtype=torch.int32, generator=gen), 2)
            w2 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.randint(0, 16, (h, i), dtype=torch.int32, generator=gen), 2)
            sz13 = (torch.rand(h // GROUP, 2 * i, 2, generator=gen) * 0.01).to(torch.bfloat16)
            sz2 = (torch.rand(max(1, i // GROUP), h, 2, generator=gen) * 0.01).to(torch.bfloat16)
            self.experts.append((w13, sz13, w2, sz2))
        self.i = i
        self.next = 0

    def run(self, x: torch.Tensor, n: int, out: torch.Tensor) -> None:
        g2 = GROUP if self.i >= GROUP else self.i
        for _ in range(n):
            w13, sz13, w2, sz2 = self.experts[self.next]
            self.next = (self.next + 1) % len(self.experts)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w13, GROUP, sz13)
            a = torch.nn.functional.silu(y[:, : self.i]) * y[:, self.i:]
            out += torch.ops.aten._weight_int4pack_mm_for_cpu(a, w2, g2, sz2)


def dram_read(buf: torch.Tensor, threads: int, seconds: float, clock=time.perf_counter) -> float:
    torch.set_num_threads(threads)
    return buf.numel() * buf.element_size() / timed(lambda: buf.sum(), seconds, clock=clock)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="mixtral,user", help="mixtral, user, or HxI, comma-separated")
    ap.add_argument("--threads", default="1,2,4,8,all", help="thread counts ('all' = the CPUs this process may use)")
    ap.add_argument("--m", default="1,3,8,16", help="token rows per expert")
    ap.add_argument("--pool-gb", type=float, default=2.0, help="GB of distinct weights cycled through (>> LLC)")
    ap.add_argument("--experts-per-call", type=int, default=0,
                    help="experts per experts_mlp call (0: enough for >= 32 MB per call, at most 8)")
    ap.add_argument("--seconds", type=float, default=0.5, help="timing per measurement")
    ap.add_argument("--isa", default="auto",
                    help=f"host kernel path(s): auto, all, or names ({', '.join(ISAS)}), comma-separated; "
                         "the bars are the first one's")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's int4 kernel")
    ap.add_argument("--timer", choices=("wall", "thread"), default="wall",
                    help="wall: elapsed time; thread: CPU time of the calling thread (1-thread rows only, where "
                         "it does all the work: steadier on a machine shared with other jobs)")
    ap.add_argument("--diag", action="store_true",
                    help="print where each host row's call time went (HostKernel.diag: Python, C, and per thread in a "
                         "-DDIAG_TIMING build; the JSON rows carry it either way)")
    ap.add_argument("--out", help="JSON output path")
    a = ap.parse_args(argv)

    cores = len(os.sched_getaffinity(0))
    threads = sorted({cores if t == "all" else int(t) for t in a.threads.split(",")})
    threads = [t for t in threads if t <= cores] or [cores]
    if a.timer == "thread" and threads != [1]:
        ap.error("--timer thread measures the calling thread only: use it with --threads 1")
    clock = time.thread_time if a.timer == "thread" else time.perf_counter
    ms = [int(m) for m in a.m.split(",")]
    isas = parse_isas(a.isa, available_isas())
    shapes = [parse_shape(s) for s in a.shapes.split(",")]
    gen = torch.Generator().manual_seed(0)
    info = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": cores, "isas": available_isas(),
            "library": library_status("mo_host"),
            "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv, "group": GROUP,
            "timer": a.timer,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"# {info['cpu']}, {cores} CPUs, host kernel paths {info['isas']}, {info['library']}")
    print(f"# CPU flags: {' '.join(info['cpu_flags']) or '-'}")

    pool_bytes = int(a.pool_gb * 1e9)
    dram_buf = torch.ones(max(1, pool_bytes // 4), dtype=torch.float32)
    dram = {t: dram_read(dram_buf, t, a.seconds, clock) for t in threads}
    del dram_buf
    for t in threads:
        print(f"# dram read ({t} threads): {dram[t] / 1e9:.1f} GB/s")

    rows = []
    hdr = (f"{'shape':>10} {'isa':>17} {'thr':>4} {'M':>3} {'host GB/s':>10} {'torch GB/s':>10} {'dram GB/s':>9} "
           f"{'host/dram':>9} {'host/torch':>10}")
    print(hdr)
    for name, h, i in shapes:
        eb = weight_nbytes(h, i)
        per_call = a.experts_per_call or max(1, min(8, -(-32_000_000 // eb)))
        count = max(per_call, pool_bytes // eb)
        host_pool = HostPool(h, i, count, gen)
        torch_pool = None if a.no_torch else TorchPool(h, i, count, gen)
        for t in threads:
            kernels = [HostKernel(threads=t, isa=isa) for isa in isas]
            torch.set_num_threads(t)
            for m in ms:
                x = torch.randn(m, h, generator=gen).to(torch.bfloat16) * 0.1
                out = torch.zeros(m, h, dtype=torch.bfloat16)
                rows_t = torch.arange(m)
                w = torch.full((m,), 0.125)
                tor = None
                if torch_pool is not None:
                    tout = torch.zeros(m, h, dtype=torch.bfloat16)
                    tor = per_call * eb / timed(lambda: torch_pool.run(x, per_call, tout), a.seconds, clock=clock)
                # each call's job list is made before the clock starts (as a caller keeps its views), so a
                # timed call is experts_mlp alone; the lists still cycle through every expert of the pool
                calls = [[(rows_t, *e, GROUP, w) for e in host_pool.take(per_call)]
                         for _ in range(-(-count // per_call))]
                for k in kernels:

                    def host_call(k=k, nxt=itertools.cycle(calls)):
                        k.experts_mlp(x, next(nxt), out)

                    times = timed_calls(host_call, a.seconds, clock=clock, before=k.diag)
                    host = per_call * eb / statistics.median(times)
                    diag = diag_summary(k.diag(), 1e6 * statistics.fmean(times))
                    row = {"shape": name, "hidden": h, "inter": i, "threads": t, "m": m, "isa": k.isa,
                           "experts_per_call": per_call, "host_gbs": host / 1e9,
                           "torch_gbs": None if tor is None else tor / 1e9, "dram_gbs": dram[t] / 1e9,
                           "host_over_dram": host / dram[t], "host_over_torch": None if tor is None else host / tor,
                           "diag": diag}
                    rows.append(row)
                    tt = "-" if tor is None else f"{tor / 1e9:10.1f}"
                    ht = "-" if tor is None else f"{host / tor:9.2f}x"
                    print(f"{name:>10} {k.isa:>17} {t:>4} {m:>3} {host / 1e9:10.1f} {tt:>10} {dram[t] / 1e9:9.1f} "
                          f"{100 * host / dram[t]:8.0f}% {ht:>10}", flush=True)
                    if a.diag:
                        print(diag_line(name, t, m, diag), flush=True)
            for k in kernels:
                k.close()
        del host_pool, torch_pool
    bars = {}
    for name, h, i in shapes:
        sel = [r for r in rows if r["shape"] == name and r["isa"] == rows[0]["isa"]]
        top = max(r["threads"] for r in sel)
        m1 = [r for r in sel if r["threads"] == top and r["m"] == 1]
        bars[name] = {
            "host_over_dram_m1_all_threads": m1[0]["host_over_dram"] if m1 else None,
            "dram_bar_met": bool(m1 and m1[0]["host_over_dram"] >= 0.8),
            "ahead_of_torch_every_m": None if a.no_torch else all(
                r["host_over_torch"] > 1.0 for r in sel if r["threads"] == top),
        }
    print("# bars:", json.dumps(bars))
    result = {"info": info, "dram_gbs": {str(t): dram[t] / 1e9 for t in threads}, "rows": rows, "bars": bars}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
