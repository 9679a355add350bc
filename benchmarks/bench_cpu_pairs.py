"""Which CPUs of this machine slow each other down: hidden SMT siblings and slow CPUs, measured.

A VM may show its vCPUs as separate cores ("Thread(s) per core: 1") while the host runs two of them on
the two hardware threads of one physical core; a busy thread on one then slows the other ~1.3-2x, and
Linux inside the VM cannot know it (no ``thread_siblings_list`` to read). vLLM's decode step at batch 1
is its launching thread's CPU time, so a busy host-kernel worker on that thread's hidden sibling slows
every step. This probe measures it instead of trusting the topology the OS shows:

1. per-CPU speed, machine idle: a fixed pure-Python loop pinned to each CPU in turn (the best of
   ``--repeats`` windows), ``--rounds`` sweeps, to tell a slow CPU (slow in every round) from drift;
2. pairs: the same loop on CPU i while one busy process (a Python arithmetic loop) sits on CPU j, for
   every ordered pair, as a ratio to CPU i's time with that process stopped, measured right before;
3. all others busy: CPU i's loop with a busy process on every other CPU (all-core clock).

    python benchmarks/bench_cpu_pairs.py --out OUT          # ~10-30 s on 16 CPUs
    python benchmarks/bench_cpu_pairs.py --cpus 0-3 --rounds 1 --repeats 3   # a smoke run

Prints per-CPU speed, each CPU's worst neighbour, the pairs slowed more than ``--sibling-ratio`` (what
the machine's ``thread_siblings_list`` says beside it), and writes JSON."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

LOOP_ITERS = 20000  # ~1-2 ms of interpreter work per window


def work(iters: int = LOOP_ITERS) -> float:
    """Seconds for one window of interpreter work (dict stores, integer arithmetic)."""
    d: dict[int, int] = {}
    t = time.perf_counter()
    acc = 0
    for i in range(iters):
        acc += i * 7 & 1023
        d[i & 15] = acc
    return time.perf_counter() - t


def best_us(repeats: int) -> float:
    """The best of ``repeats`` windows, in microseconds."""
    return min(work() for _ in range(repeats)) * 1e6


def parse_cpus(text: str | None) -> list[int]:
    if not text:
        return sorted(os.sched_getaffinity(0))
    out: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def os_siblings(cpu: int) -> str:
    p = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return p.read_text().strip()
    except OSError:
        return "-"


SPIN_SRC = "x = 0\nwhile True:\n    x = (x * 1103515245 + 12345) & 0xFFFFFFFF\n"


class Spinner:
    """One busy process, movable between CPUs and stoppable (SIGSTOP) between measurements."""

    def __init__(self, cpu: int):
        self.p = subprocess.Popen([sys.executable, "-c", SPIN_SRC])
        self.move(cpu)

    def move(self, cpu: int) -> None:
        os.sched_setaffinity(self.p.pid, {cpu})

    def stop(self) -> None:
        os.kill(self.p.pid, signal.SIGSTOP)

    def go(self) -> None:
        os.kill(self.p.pid, signal.SIGCONT)

    def close(self) -> None:
        try:
            self.p.kill()
            self.p.wait(5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpus", help="CPUs to probe, e.g. 0-15 or 0,2,4 (default: this process's affinity)")
    ap.add_argument("--rounds", type=int, default=3, help="per-CPU speed sweeps (default 3)")
    ap.add_argument("--repeats", type=int, default=7, help="windows per measurement, best kept (default 7)")
    ap.add_argument("--sibling-ratio", type=float, default=1.2,
                    help="a neighbour that slows a CPU by this ratio or more is reported as its sibling (1.2)")
    ap.add_argument("--out", help="folder for cpu_pairs.json")
    a = ap.parse_args(argv)
    cpus = parse_cpus(a.cpus)
    home = os.sched_getaffinity(0)
    t0 = time.time()
    res: dict = {"cpus": cpus, "loop_iters": LOOP_ITERS, "repeats": a.repeats, "rounds": a.rounds,
                 "os_siblings": {c: os_siblings(c) for c in cpus}}
    spinners: list[Spinner] = []
    try:
        # 1. per-CPU speed, idle
        speed = {c: [] for c in cpus}
        for _ in range(a.rounds):
            for c in cpus:
                os.sched_setaffinity(0, {c})
                work(2000)  # settle on the CPU
                speed[c].append(round(best_us(a.repeats), 1))
        res["idle_us"] = speed
        # 2. ordered pairs: loop on i, one busy process on j
        sp = Spinner(cpus[0])
        spinners.append(sp)
        sp.stop()
        ratio: dict[int, dict[int, float]] = {}
        for i in cpus:
            os.sched_setaffinity(0, {i})
            ratio[i] = {}
            for j in cpus:
                if j == i:
                    continue
                sp.stop()
                base = best_us(a.repeats)
                sp.move(j)
                sp.go()
                time.sleep(0.002)  # let it start spinning there
                busy = best_us(a.repeats)
                sp.stop()
                ratio[i][j] = round(busy / base, 3)
        res["pair_ratio"] = ratio
        # 3. every other CPU busy
        sp.close()
        spinners.clear()
        allbusy: dict[int, float] = {}
        spinners = [Spinner(c) for c in cpus]
        for s in spinners:
            s.stop()
        for k, i in enumerate(cpus):
            os.sched_setaffinity(0, {i})
            base = best_us(a.repeats)
            for m, s in enumerate(spinners):
                if m != k:
                    s.go()
            time.sleep(0.005)
            busy = best_us(a.repeats)
            for m, s in enumerate(spinners):
                if m != k:
                    s.stop()
            allbusy[i] = round(busy / base, 3)
        res["all_busy_ratio"] = allbusy
    finally:
        for s in spinners:
            s.close()
        os.sched_setaffinity(0, home)
    res["wall_s"] = round(time.time() - t0, 1)

    # report
    med = {c: statistics.median(v) for c, v in speed.items()}
    fastest = min(med.values())
    sib: dict[int, list[int]] = {}
    print(f"# CPU pairs: {len(cpus)} CPUs, loop {LOOP_ITERS} iterations, best of {a.repeats}, {res['wall_s']} s\n")
    print("| cpu | idle us (rounds) | x fastest | worst neighbour (ratio) | all others busy | OS siblings |")
    print("| ---: | --- | ---: | --- | ---: | --- |")
    for c in cpus:
        worst = max(ratio[c].items(), key=lambda kv: kv[1]) if ratio[c] else (None, 1.0)
        sib[c] = sorted(j for j, r in ratio[c].items() if r >= a.sibling_ratio)
        print(f"| {c} | {', '.join(f'{v:.0f}' for v in speed[c])} | {med[c] / fastest:.2f} | "
              f"{worst[0]} ({worst[1]:.2f}) | {allbusy[c]:.2f} | {res['os_siblings'][c]} |")
    pairs = sorted({tuple(sorted((i, j))) for i in cpus for j in sib[i]})
    all_r = sorted(r for i in cpus for r in ratio[i].values())
    if all_r:  # one CPU: no pairs
        print(f"\npair ratios: median {statistics.median(all_r):.3f}, max {all_r[-1]:.3f}; "
              f"pairs at >= {a.sibling_ratio}: {pairs if pairs else 'none'}")
    res["measured_siblings"] = dict(sib)
    res["measured_pairs"] = [list(p) for p in pairs]
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "cpu_pairs.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
