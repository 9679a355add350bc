"""Per-call latency of the vLLM hybrid path's host half (vllm_backend/host_experts.py), driven as
vLLM's residency step drives it: one layer at decode, 1-3 experts of one token each, views of a
freshly opened (mapped) cache, ``start`` then ``add_to``; next to the kernel alone on the same experts.

    python3 benchmarks/bench_host_experts.py [--workdir /tmp/mmo-he] [--experts 64] [--calls 200]
        [--threads 0] [--engine-threads 0] [--gap-ms 2] [--gil-ms 0.5] [--out FILE.json]

Rows (ms per call, median and p90; GB/s of expert bytes at the median):
  kernel        ``HostKernel.experts_mlp`` on prepared jobs, mapping populated, experts cycled through
                the whole cache (bytes not in the CPU caches); the floor
  first-touch   HostExperts on a fresh mapping, each call on experts not used before (page faults,
                or the job's own populate of them)
  first-use     the same after the background populate the backend starts when it makes HostExperts
  warm          HostExperts, every expert used before (views and page tables exist)
  warm+gil      as warm, while the calling thread runs Python for ``--gil-ms`` between start and add_to
                (vLLM launches the layer's GPU work there); host_s is what the host job reported
Between calls the thread sleeps ``--gap-ms`` (the rest of a decode layer: the pool's workers go idle).
``--engine-threads N`` runs N spinning native threads meanwhile (a copy engine's threads) and tells
HostExperts about them (its default thread count leaves them their cores), as the backend does.
The cache is the user's shape (H 5120, I 768, W4A16 group 128, 6.1 MB per expert), written once to
``--workdir`` (random words and scales)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def make_or_open(workdir: Path, experts: int, hidden: int, inter: int, group: int):
    from mmap_offload.cache_reader import open_cache

    d = workdir / f"cache-{hidden}-{inter}-{group}-{experts}"
    if not (d / "manifest.json").exists() and not any(d.glob("**/manifest*")):
        from test_hybrid import make_marlin_cache

        make_marlin_cache(d, hidden, inter, group, experts=experts, layers=(0,)).close()
    return open_cache(d, tp_rank=0, tp_size=1)


def _busy(stop: threading.Event, n: int) -> list:
    """n threads copying 32 MiB buffers (numpy releases the GIL): a copy engine's fill threads."""

    def spin():
        src, dst = np.ones(8 << 20, dtype=np.float32), np.empty(8 << 20, dtype=np.float32)
        while not stop.is_set():
            np.copyto(dst, src)

    ts = [threading.Thread(target=spin, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    return ts


def _python_for(ms: float) -> None:
    t_end = time.perf_counter() + ms / 1e3
    x = 0
    while time.perf_counter() < t_end:
        x += 1


def stats(ts: list[float], nbytes: float) -> dict:
    a = np.asarray(ts) * 1e3
    med = float(np.median(a))
    return dict(ms_median=med, ms_p90=float(np.percentile(a, 90)), ms_min=float(a.min()),
                gbps_median=nbytes / (med / 1e3) / 1e9, calls=len(a))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/mmo-host-experts")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--per-call", default="1,2,3", help="host experts per call (cycled)")
    p.add_argument("--threads", type=int, default=0, help="host threads (0: HostExperts' default)")
    p.add_argument("--engine-threads", type=int, default=0, help="spinning threads meanwhile (a copy engine)")
    p.add_argument("--gap-ms", type=float, default=2.0, help="sleep between calls (the rest of a layer)")
    p.add_argument("--gil-ms", type=float, default=0.5)
    p.add_argument("--hidden", type=int, default=5120)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)

    from mmap_offload.vllm_backend.host_experts import HostExperts
    from mmap_offload.vllm_backend.options import MmapOptions

    wd = Path(a.workdir)
    wd.mkdir(parents=True, exist_ok=True)
    per = [int(v) for v in a.per_call.split(",")]
    cache = make_or_open(wd, a.experts, a.hidden, a.inter, a.group)
    E = cache.num_experts
    nb = sum(s.nbytes for s in cache.expert_specs)
    rng = np.random.default_rng(0)
    x1 = (torch.randn(1, a.hidden) * 0.5).to(torch.bfloat16)
    stop = threading.Event()
    busy = _busy(stop, a.engine_threads) if a.engine_threads else []
    res: dict = dict(machine=dict(cpus=len(__import__("os").sched_getaffinity(0))), engine_threads=a.engine_threads,
                     gap_ms=a.gap_ms, gil_ms=a.gil_ms, expert_bytes=nb, experts=E, per_call=per, rows={})
    try:
        def drive(he, order, gil_ms: float, record):
            t = SimpleNamespace(index=0, layer=cache.layers[0])
            ts, pos, k_i, host_s = [], 0, 0, []
            xs = he.staging(torch.bfloat16)[:1]
            xs.copy_(x1)
            base = torch.zeros(1, a.hidden, dtype=torch.bfloat16)
            while len(ts) < a.calls and pos < len(order):
                k = per[k_i % len(per)]
                k_i += 1
                host = np.asarray(order[pos:pos + k])
                pos += k
                if len(host) < k:
                    break
                ids = np.concatenate([host, rng.choice(np.setdiff1d(np.arange(E), host), 8 - k, replace=False)])[None]
                w = np.full((1, 8), 1 / 8, dtype=np.float32)
                if a.gap_ms:
                    time.sleep(a.gap_ms / 1e3)
                s0 = he.metrics["host_s"]
                t0 = time.perf_counter()
                he.start(t, xs, ids, w, host)
                if gil_ms:
                    _python_for(gil_ms)
                he.add_to(t, base)
                dt = time.perf_counter() - t0
                ts.append(dt)
                host_s.append(he.metrics["host_s"] - s0)
                record.append(k)
            return ts, host_s

        def row(name, ts, ks, extra=None):
            r = stats(ts, nb * float(np.mean(ks)))
            r["experts_per_call"] = float(np.mean(ks))
            r.update(extra or {})
            res["rows"][name] = r
            print(f"{name:12s} {r['ms_median']:7.3f} ms median  p90 {r['ms_p90']:7.3f}  min {r['ms_min']:7.3f}  "
                  f"{r['gbps_median']:6.2f} GB/s  ({r['experts_per_call']:.1f} experts/call)"
                  + (f"  {extra}" if extra else ""), flush=True)

        # the backend's options when a copy engine's threads run beside (HostExperts' default leaves them
        # their cores), none otherwise (every core)
        opts = MmapOptions(threads=a.engine_threads, host_threads=max(0, a.threads)) if a.engine_threads else None
        off = SimpleNamespace(cache=cache, device=torch.device("cpu"), tp_size=1, options=opts)

        def make(**kw):
            return HostExperts(off, threads=a.threads, **kw)

        t_make = time.perf_counter()
        he = make(populate=False)
        res["make_s"] = time.perf_counter() - t_make
        res["threads"] = getattr(he.kernel, "threads", None)
        res["isa"] = getattr(he.kernel, "isa", None)
        print(f"host kernel: {he.kernel!r}; expert {nb / 1e6:.2f} MB; {E} experts; engine threads {a.engine_threads}; "
              f"made in {res['make_s']:.2f} s", flush=True)
        # first touch: a fresh mapping (the calibration mapped some pages of the old one), experts not used before
        cache.close()
        off.cache = he.cache = cache = make_or_open(wd, a.experts, a.hidden, a.inter, a.group)
        he._views.clear()
        order = rng.permutation(E).tolist()
        ks: list = []
        ts, _ = drive(he, order, 0.0, ks)
        row("first-touch", ts, ks)
        if hasattr(he, "_populator"):  # the backend's default: mappings populated in the background
            he.close()
            cache.close()
            off.cache = cache = make_or_open(wd, a.experts, a.hidden, a.inter, a.group)
            he = make(populate=True)
            he._populator.join()
            res["populate_background_s"] = he.metrics["populate_background_s"]
            order = rng.permutation(E).tolist()
            ks = []
            ts, _ = drive(he, order, 0.0, ks)
            row("first-use", ts, ks, dict(populate_background_s=round(res["populate_background_s"], 3)))
        # warm: every expert touched; cycle in a random order (bytes not in the CPU caches)
        order = np.concatenate([rng.permutation(E) for _ in range(1 + 3 * a.calls // E)]).tolist()
        ks = []
        ts, _ = drive(he, order, 0.0, ks)
        row("warm", ts, ks)
        if a.gil_ms:
            ks = []
            ts, hs = drive(he, order, a.gil_ms, ks)
            row("warm+gil", ts, ks, dict(host_s_reported_ms=1e3 * float(np.median(hs))))
        # the kernel alone on prepared jobs
        kern = he.kernel
        if kern is not None:
            names = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")
            views = {e: [cache.tensor(cache.layers[0], e, n) for n in names] for e in range(E)}
            out = torch.zeros(1, a.hidden, dtype=torch.bfloat16)
            rows = torch.zeros(1, dtype=torch.int64)
            wt = torch.full((1,), 0.125)
            ts, ks, pos = [], [], 0
            for i in range(a.calls):
                k = per[i % len(per)]
                es = order[pos:pos + k]
                pos += k
                jobs = [(rows, *views[e], he.group, wt) for e in es]
                if a.gap_ms:
                    time.sleep(a.gap_ms / 1e3)
                t0 = time.perf_counter()
                kern.experts_mlp(x1, jobs, out)
                ts.append(time.perf_counter() - t0)
                ks.append(k)
            row("kernel", ts, ks)
        summ = getattr(he, "summary", None)
        res["model"] = summ() if summ else dict(host_rate_gbps=he.host_rate / 1e9)
        print(f"model after the run: {res['model']}", flush=True)
        he.close()
    finally:
        stop.set()
        for t in busy:
            t.join()
        cache.close()
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
