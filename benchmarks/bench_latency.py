"""Where the time of one decode-sized batch goes: submit, copy-to-slot, H2D, and the cache's policy.

A decode step fetches a few experts per layer (1-12 x ~9 MiB) and the host waits for them before the
layer's kernel: the batch's latency, not the bandwidth of big copies, sets tokens/s. For batches of
n experts read from a warm, pre-faulted cache-like file it prints median times of:

    submit     the caller's submit() (Python planning + handing over)
    issued     submit -> every chunk copied to a slot and its H2D issued (what ExpertCache waits for)
    landed     submit -> the bytes are on the GPU (event synchronised)
    GB/s       batch bytes / landed

for the Python copy threads and the native pool (8 and 15 threads), next to two ceilings measured in
the same run: the same bytes copied by 8 threads into pinned memory with the native kernel and no DMA
(fill only), and one pinned H2D of the batch (DMA only). It also times ExpertCache.ensure() with an
engine that copies nothing (the policy's own cost per call).

    python benchmarks/bench_latency.py [--experts 64] [--record-mib 9.28] [--reps 40] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mmap_offload.cache_format import Extent  # noqa: E402
from mmap_offload.pinned import PinnedBuffer  # noqa: E402
from mmap_offload.transfer import Copy, make_engine, native_copy_lib  # noqa: E402

MiB = 1 << 20


def med_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def engine_latency(device, path: Path, E: int, rec: int, n: int, reps: int, opts: dict) -> dict:
    eng = make_engine("mmap", device, pinned_bytes=256 * MiB, **opts)
    try:
        eng.prefault([path])
        parts = 4  # four tensors per expert, as a W4A16 record (w13, w2 and their scales)
        sizes = [rec // parts] * parts
        dst = [[torch.empty(s, dtype=torch.uint8, device=device) for s in sizes] for _ in range(n)]
        rng = np.random.default_rng(n)
        sub, iss, land = [], [], []
        for r in range(reps + 3):
            ids = rng.choice(E, n, replace=False)
            copies = [Copy(Extent(str(path), int(e) * rec, rec),
                           [(j * sizes[0], sizes[j], dst[i][j]) for j in range(parts)])
                      for i, e in enumerate(ids)]
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            t = eng.submit(copies)
            t1 = time.perf_counter()
            eng.wait(t)
            t2 = time.perf_counter()
            eng.synchronize(t)
            t3 = time.perf_counter()
            if r >= 3:
                sub.append(t1 - t0)
                iss.append(t2 - t0)
                land.append(t3 - t0)
        m = eng.metrics
        return dict(opts=opts, native=bool(getattr(eng, "native", False)), experts=n, bytes=n * rec,
                    submit_ms=med_ms(sub), issued_ms=med_ms(iss), landed_ms=med_ms(land),
                    GBps=n * rec / statistics.median(land) / 1e9,
                    fill_per_thread_GBps=m["bytes_moved"] / max(m["fill_seconds"], 1e-9) / 1e9)
    finally:
        eng.close()


def fill_ceiling(path: Path, E: int, rec: int, n: int, reps: int, threads: int = 8) -> float:
    """Median seconds for ``threads`` threads to copy n records into pinned memory (no DMA)."""
    lib = native_copy_lib()
    buf = PinnedBuffer(n * rec)
    fd = os.open(path, os.O_RDONLY)
    import mmap as _mmap

    mm = _mmap.mmap(fd, E * rec, prot=_mmap.PROT_READ)
    base = np.frombuffer(mm, dtype=np.uint8)
    src_addr = base.ctypes.data
    copy = (lambda d, s, k: lib.mo_copy_nt4(d, s, k, 1024)) if lib else None
    if copy is None:
        from mmap_offload.pinned import memcpy as copy  # noqa: N813
    base.sum()  # fault the mapping in
    rng = np.random.default_rng(1)
    times = []
    pool = ThreadPoolExecutor(threads)
    list(pool.map(lambda k: None, range(threads)))
    for _ in range(reps):
        ids = rng.choice(E, n, replace=False)
        total = n * rec
        per = -(-total // threads)

        def work(k: int) -> None:
            lo, hi = k * per, min(total, (k + 1) * per)
            pos = lo
            while pos < hi:
                i, off = divmod(pos, rec)
                take = min(hi - pos, rec - off)
                copy(buf.ptr + pos, src_addr + int(ids[i]) * rec + off, take)
                pos += take

        t0 = time.perf_counter()
        list(pool.map(work, range(threads)))  # threads started once: only the copy is timed
        times.append(time.perf_counter() - t0)
    pool.shutdown()
    del base
    mm.close()
    os.close(fd)
    buf.close()
    return statistics.median(times)


def h2d_ceiling(device, nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def policy_cost(E: int, L: int, slots: int, k: int, calls: int) -> float:
    """Median seconds per ExpertCache.ensure() at decode-1 with a copy-free engine."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from fakes import make_cache  # a small real cache: the policy does not depend on tensor sizes

    from mmap_offload import traces
    from mmap_offload.expert_cache import ExpertCache

    class NoCopy:
        metrics: dict = {}

        def submit(self, copies, after=None):
            return object()

        def wait(self, ticket, stream=None):
            pass

    with tempfile.TemporaryDirectory() as d:
        cache = make_cache(Path(d), layers=tuple(range(L)), num_experts=E)
        ec = ExpertCache(cache, NoCopy(), "cpu", capacity_experts=slots, shared=True, verify_first_use=False)
        tr = traces.skewed_trace(calls // L + 1, L, E, k, batch=1, zipf_s=1.0, sticky_p=0.3, seed=0)
        times = []
        for s in range(tr.shape[0]):
            for li in range(L):
                t0 = time.perf_counter()
                ec.ensure(li, tr[s, li])
                times.append(time.perf_counter() - t0)
        cache.close()
    return statistics.median(times[L:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--record-mib", type=float, default=9.28)
    ap.add_argument("--batches", default="1,3,6,12")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--file", default="/tmp/mmo_latency.bin")
    ap.add_argument("--out", default=None)
    ap.add_argument("--configs", default=None, help='JSON list of mmap make_engine options to compare')
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    device = torch.device("cuda", 0)
    E = args.experts
    rec = int(args.record_mib * MiB) // 4096 * 4096
    path = Path(args.file)
    if not path.exists() or path.stat().st_size != E * rec:
        np.random.default_rng(0).integers(0, 255, size=E * rec, dtype=np.uint8).tofile(path)
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass
    res: dict = {"record_bytes": rec, "experts": E, "rows": []}
    pol = policy_cost(E, 8, 128, 8, 400)
    res["policy_ensure_ms"] = 1e3 * pol
    print(f"ExpertCache.ensure policy cost (decode-1, 8 layers x {E} experts, 128 shared slots): "
          f"{1e3 * pol:.3f} ms/call", flush=True)
    print(f"{'engine':34s} {'experts':>7s} {'MiB':>6s} {'submit':>8s} {'issued':>8s} {'landed':>8s} "
          f"{'GB/s':>6s} {'fill/thr':>8s}  ceilings: fill(8t) h2d  -> serial sum", flush=True)
    configs = [dict(threads=8, slot_bytes=16 * MiB, native=False),
               dict(threads=8, slot_bytes=8 * MiB, slot_reuse="oldest", copy_impl="nt4"),  # session 2
               dict(threads=8),  # defaults: hot slots, rep movsb, 4 MiB slots
               dict(threads=8, copy_impl="nt4"),  # hot slots, non-temporal stores
               dict(threads=8, slot_reuse="oldest"),  # rep movsb, oldest slot first
               dict(threads=8, slot_reuse="oldest", copy_impl="nt4")]
    if args.configs:
        configs = json.loads(args.configs)
    for n in [int(x) for x in args.batches.split(",")]:
        fc = fill_ceiling(path, E, rec, n, max(5, args.reps // 4))
        hc = h2d_ceiling(device, n * rec, max(5, args.reps // 4))
        for opts in configs:
            r = engine_latency(device, path, E, rec, n, args.reps, opts)
            r.update(fill_ceiling_ms=1e3 * fc, h2d_ceiling_ms=1e3 * hc)
            res["rows"].append(r)
            name = ("native " if r["native"] else "python ") + " ".join(
                f"{k[:5]}={v >> 10 if k.endswith('bytes') else v}" for k, v in opts.items()
                if k not in ("native", "threads") or v != 8)
            print(f"{name[:34]:34s} {n:7d} {n * rec / MiB:6.0f} {r['submit_ms']:8.3f} {r['issued_ms']:8.3f} "
                  f"{r['landed_ms']:8.3f} {r['GBps']:6.1f} {r['fill_per_thread_GBps']:8.1f}  "
                  f"{1e3 * fc:.3f} {1e3 * hc:.3f} -> {1e3 * (fc + hc):.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
