"""How much the hybrid path's host threads slow the thread that launches vLLM's GPU work.

Eager vLLM's decode step is its launching thread's time (BENCHMARKS.md "Real vLLM", session 17: route()
plus vLLM's own time between and around the MoE layers, which drifted 8.9-15.0 ms per step between
children of one configuration). This measures a stand-in for that thread, a Python loop of small device
ops with a little interpreter work between them, alone and beside the loads the hybrid path puts on the
host: the host kernel (``HostKernel.experts_mlp`` on experts of the user's shape streamed from DRAM, 44
per call, 2 rows each: four times batch 8's share per layer, so that the calling Python thread takes the
GIL rarely) and copy threads (each copying 256 MiB blocks out of a pool: a read and a write per byte, as
the copy pool's page cache -> ring copies do; torch copies, one thread each, a stand-in for the copy
pool, not it).

    python benchmarks/bench_launch_contention.py --out OUT                 # GPU machine (cuda), ~30 s
    python benchmarks/bench_launch_contention.py --device cpu --pool-gb 0.1 --seconds 0.3 \\
        --scenarios "idle|host=1,copy=1"                                    # a smoke run

A scenario is ``idle`` or ``host=N,copy=M,spin=S[,pin]`` (any of the three counts): N host kernel threads
(the kernel's own pthreads, the calling thread among them), M copy threads, S compute-only threads (fp32
512 x 512 matrix products, their operands L2/L3-resident: the cores busy with wide vector arithmetic and
next to no DRAM traffic); ``pin`` puts the loop on CPU 0 and every background thread on the others (their
affinity is set before they start). ``spin`` tells the two ways a busy neighbour slows the loop apart: if
``spin=15`` slows it as much as the host kernel and the copies do, the cause is the core's (clock under
all-core turbo and AVX-512 licences, or a hidden SMT sibling in a VM), not shared L3 and DRAM.

Per scenario: microseconds per loop iteration (the median of 0.1 s windows), the same in the loop
thread's own CPU time (what slows the thread itself: clock, caches, DRAM; waits left out), the thread's
CPU time over wall time (below 1: it waited or was descheduled; at 1 and slower than idle: it ran
slowly), its involuntary context switches per second (preempted) and voluntary ones (waits: here the
GIL, which the background's Python threads take at each call's return), the background's GB/s and the
spinners' GFLOP/s. Prints a table; ``--out`` writes JSON."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_host_kernel import GROUP, SHAPES, HostPool, weight_nbytes  # noqa: E402
from mmap_offload.host.kernel import HostKernel  # noqa: E402

H, I = SHAPES["user"]  # the user's per-rank expert
EXPERT_BYTES = weight_nbytes(H, I)
DEFAULT_SCENARIOS = ("idle|host=9,copy=6|host=7,copy=8|spin=15|spin=8|copy=6|host=9|host=9,copy=6,pin|spin=15,pin|idle")
SPIN_N = 512  # the spinners' matrices: 2 x 1 MiB of fp32, 268 MFLOP per product
SPIN_POWER = 2**15 - 1  # products per call: matrix_power's ~30 squarings and products in one C++ call (~30 ms)
HOST_PER_CALL = 44  # experts per host kernel call: 4 x batch 8's share per layer, ~5 ms per call
COPY_BLOCK = 256 << 20  # bytes per copy call (~25-50 ms)
# Why calls this long: the background runs in Python threads, and each call's return takes the GIL.
# Session 19's run (H200 host) with calls of ~1 ms (64 MiB copies, one 512 x 512 product, 11 experts)
# had the loop wait for the GIL 600-6000 times a second (voluntary switches; 0 when idle) and off its
# CPU 6-12% of the time; vLLM's own pools are native threads that never take it. The table's cpu
# columns (the loop's CPU time per iteration) leave any such wait out either way.


def parse_scenario(text: str) -> dict:
    """``idle`` or ``host=N,copy=M,spin=S[,pin]`` -> {"name", "host", "copy", "spin", "pin"}; a bad word
    exits in one line."""
    out = {"name": text, "host": 0, "copy": 0, "spin": 0, "pin": False}
    if text == "idle":
        return out
    for word in text.split(","):
        key, sep, val = word.partition("=")
        if key == "pin" and not sep:
            out["pin"] = True
        elif key in ("host", "copy", "spin") and sep and val.isdigit():
            out[key] = int(val)
        else:
            raise SystemExit(f"scenario {text!r}: {word!r} is not host=N, copy=M, spin=S or pin (e.g. host=8,copy=8,pin)")
    return out


class Background:
    """The host kernel, the copy threads and the spinners, running until ``stop()``; bytes (flops for
    the spinners) counted per side."""

    def __init__(self, sc: dict, experts: list, copy_src: torch.Tensor, cpus: set[int] | None):
        self.sc, self.experts, self.src, self.cpus = sc, experts, copy_src, cpus
        self.halt = threading.Event()
        self.bytes = {"host": 0, "copy": 0, "spin": 0}
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []
        self.ready = threading.Barrier(1 + (sc["host"] > 0) + sc["copy"] + sc["spin"], timeout=120)

    def _pin(self) -> None:
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)  # this thread; the kernel's pthreads made here inherit it

    def _host(self) -> None:
        self._pin()
        k = HostKernel(threads=self.sc["host"])
        x = (torch.randn(2, H) * 0.1).to(torch.bfloat16)
        out = torch.zeros(2, H, dtype=torch.bfloat16)
        rows, w = torch.arange(2), torch.full((2,), 0.125)
        per, n = HOST_PER_CALL, len(self.experts)
        calls = [[(rows, *self.experts[(c * per + j) % n], GROUP, w) for j in range(per)] for c in range(max(1, n // per))]
        c = 0
        self.ready.wait()
        while not self.halt.is_set():  # little Python per call: the GIL stays with the loop (vLLM starts these from C)
            k.experts_mlp(x, calls[c], out)
            c = (c + 1) % len(calls)
            with self.lock:
                self.bytes["host"] += per * EXPERT_BYTES
        k.close()

    def _copy(self, idx: int) -> None:
        self._pin()
        block = min(COPY_BLOCK, self.src.numel())
        dst = torch.empty(block, dtype=torch.uint8)
        n = self.src.numel() // block
        i = idx
        self.ready.wait()
        while not self.halt.is_set():
            dst.copy_(self.src[(i % n) * block:(i % n + 1) * block])
            i += 1
            with self.lock:
                self.bytes["copy"] += block

    def _spin(self) -> None:
        self._pin()
        a = torch.linalg.qr(torch.randn(SPIN_N, SPIN_N))[0]  # orthogonal: its powers stay finite and normal
        per = 2 * (SPIN_POWER.bit_length() - 1) * 2 * SPIN_N**3  # matrix_power's products, flops each
        self.ready.wait()
        while not self.halt.is_set():
            torch.linalg.matrix_power(a, SPIN_POWER)
            with self.lock:
                self.bytes["spin"] += per

    def start(self) -> None:
        if self.sc["host"]:
            self.threads.append(threading.Thread(target=self._host, daemon=True))
        self.threads += [threading.Thread(target=self._copy, args=(j,), daemon=True) for j in range(self.sc["copy"])]
        self.threads += [threading.Thread(target=self._spin, daemon=True) for _ in range(self.sc["spin"])]
        for t in self.threads:
            t.start()
        self.ready.wait()

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join()


def launch_loop(x: torch.Tensor, seconds: float) -> dict:
    """The stand-in for vLLM's launching thread: per iteration 4 small device ops and a little Python
    (x grows to inf within a few hundred iterations: the launch cost, not the values, is measured)."""
    windows, cpu_windows, iters = [], [], 0
    meta = {f"k{j}": j for j in range(32)}
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    ru0, c0, t0 = resource.getrusage(resource.RUSAGE_THREAD), time.thread_time(), time.perf_counter()
    end = t0 + seconds
    while True:
        w0, u0, n = time.perf_counter(), time.thread_time(), 0
        while time.perf_counter() - w0 < 0.1:
            y = x * 1.0001
            y = y + x
            y = torch.nn.functional.silu(y)
            x.copy_(y)
            meta = {k: v + 1 for k, v in meta.items()}  # interpreter work between launches
            n += 1
        windows.append((time.perf_counter() - w0) / n * 1e6)
        cpu_windows.append((time.thread_time() - u0) / n * 1e6)  # the thread's own time: waits left out
        iters += n
        if time.perf_counter() >= end:
            break
    sync()
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    ru1 = resource.getrusage(resource.RUSAGE_THREAD)
    return {"us_per_iter": statistics.median(windows), "cpu_us_per_iter": statistics.median(cpu_windows), "iters": iters, "wall_s": wall, "cpu_over_wall": cpu / wall,
            "nivcsw_per_s": (ru1.ru_nivcsw - ru0.ru_nivcsw) / wall, "nvcsw_per_s": (ru1.ru_nvcsw - ru0.ru_nvcsw) / wall}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for launch_contention.json")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scenarios", default=DEFAULT_SCENARIOS, help=f"'|'-separated (default {DEFAULT_SCENARIOS})")
    p.add_argument("--seconds", type=float, default=2.0, help="timed loop per scenario")
    p.add_argument("--pool-gb", type=float, default=2.0, help="experts for the host kernel (beyond the LLC)")
    p.add_argument("--copy-gb", type=float, default=1.0, help="the copy threads' source")
    a = p.parse_args(argv)
    scenarios = [parse_scenario(s) for s in a.scenarios.split("|")]
    torch.set_num_threads(1)  # one core per copy thread; the loop's CPU ops (device cpu) on its own thread
    cpus = sorted(os.sched_getaffinity(0))
    # distinct experts beyond the LLC, constant words (values do not matter for speed)
    experts = HostPool(H, I, max(11, int(a.pool_gb * 1e9 // EXPERT_BYTES)), None).experts \
        if any(s["host"] for s in scenarios) else []
    src = torch.ones(max(64 << 20, int(a.copy_gb * 1e9) // (64 << 20) * (64 << 20)), dtype=torch.uint8) \
        if any(s["copy"] for s in scenarios) else None
    x = torch.randn(8, H, device=a.device).to(torch.bfloat16)
    launch_loop(x, 0.3)  # warm-up (first launches, allocator)
    rows = []
    for sc in scenarios:
        pin = sc["pin"] and len(cpus) > 1
        mine = {cpus[0]} if pin else set(cpus)
        bg = Background(sc, experts, src, set(cpus[1:]) if pin else None)
        os.sched_setaffinity(0, mine)
        bg.start()
        b0, t0 = dict(bg.bytes), time.perf_counter()
        r = launch_loop(x, a.seconds)
        # a load whose first call is still running has no rate yet (a busy machine, a short window): wait for it
        until = time.perf_counter() + max(10.0, 5 * a.seconds)
        while any(sc[k] and bg.bytes[k] == b0[k] for k in ("host", "copy", "spin")) and time.perf_counter() < until:
            time.sleep(0.005)
        dt = time.perf_counter() - t0
        b1 = dict(bg.bytes)
        bg.stop()
        os.sched_setaffinity(0, set(cpus))
        r.update(scenario=sc["name"], host_threads=sc["host"], copy_threads=sc["copy"], spin_threads=sc["spin"],
                 pinned=pin, host_gbs=(b1["host"] - b0["host"]) / dt / 1e9, copy_gbs=(b1["copy"] - b0["copy"]) / dt / 1e9,
                 spin_gflops=(b1["spin"] - b0["spin"]) / dt / 1e9)
        rows.append(r)
    idle = next((r for r in rows if r["scenario"] == "idle"), None)
    print(f"# launch loop beside the hybrid path's host load; device {a.device}, {len(cpus)} CPUs")
    print("| scenario | us / iteration | x idle | cpu us / iteration | x idle (cpu) | cpu / wall | forced switches / s "
          "| waits / s | host GB/s | copy GB/s | spin GFLOP/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        r["x_idle"] = r["us_per_iter"] / idle["us_per_iter"] if idle else None
        r["x_idle_cpu"] = r["cpu_us_per_iter"] / idle["cpu_us_per_iter"] if idle and idle["cpu_us_per_iter"] else None
        xi = f"{r['x_idle']:.2f}" if r["x_idle"] is not None else "-"
        xc = f"{r['x_idle_cpu']:.2f}" if r["x_idle_cpu"] is not None else "-"
        print(f"| {r['scenario']} | {r['us_per_iter']:.1f} | {xi} | {r['cpu_us_per_iter']:.1f} | {xc} | "
              f"{r['cpu_over_wall']:.2f} | {r['nivcsw_per_s']:.0f} | {r['nvcsw_per_s']:.0f} | {r['host_gbs']:.1f} | "
              f"{r['copy_gbs']:.1f} | {r['spin_gflops']:.0f} |")
    res = {"command": "python benchmarks/bench_launch_contention.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": a.device, "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None,
           "cpus": len(cpus), "pool_gb": a.pool_gb, "rows": rows}
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "launch_contention.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
