"""MoE forward-loop benchmark: mmap-offload weight delivery against vLLM-style UVA, same kernel for all.

    python benchmarks/bench_moe.py --out bench-out                 # GPU, default shapes (~5 GB cache)
    python benchmarks/bench_moe.py --device cpu --tiny --out /tmp/b # toy size, torch kernel, seconds

What runs: a synthetic W4A16 checkpoint (``synth.make_checkpoint``) is warmed up into a cache
(``warmup.warmup``), then an L-layer MoE forward loop runs over routing traces (``traces.py``) with one
expert compute (``moe_kernel.moe_forward``: the Triton W4A16 kernel on CUDA, the torch path on CPU). Only
the weight delivery differs between variants, each given the same VRAM budget for expert weights
(``--budget-layers`` whole layers' worth of bytes, default 2 = double-buffered layer prefetch):

    vram           every expert resident on the device (roofline; ignores the budget)
    uva            vLLM --offload-backend uva: the first budget/layer_bytes layers stay on the device,
                   the rest are [E, ...] parameters pinned with torch's caching host allocator
                   (power-of-two blocks, as Tensor.pin_memory()) and read in place over PCIe
    mmap-prefetch  LayerPrefetcher: whole layers into 2 fixed device buffers, lookahead 1 (warm cache)
    mmap-cache     ExpertCache (shared pool, budget bytes): routed experts only, misses fetched (warm)
    *-cold         the same after the cache files were evicted from the page cache (first steps only)
    pread-cold     ExpertCache / LayerPrefetcher over the O_DIRECT pread engine
    kvikio-cold    the same over kvikio (skipped with the reason where kvikio is not installed)

Per run it records tokens/s, bytes over PCIe per step (uva: a model of the kernel's reads = routed
experts x M-blocks reading them; engines: bytes their copies moved), routed bytes per step (distinct
routed experts x expert bytes), pinned bytes, peak RSS (VmHWM, reset per variant where the kernel
allows), and time to ready (from a built cache to the first forward). Writes results.json,
results.md and PNG plots under ``--out``; every number in docs/BENCHMARKS.md comes from here.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import moe_kernel as mk  # noqa: E402

SHAPES = {
    # per-expert shapes of real model classes; layers/experts scaled to fit the machine and the time
    "default": dict(hidden=4096, inter=1536, experts=64, top_k=8, layers=8, group=128),  # Qwen3-235B-class experts
    "user": dict(hidden=5120, inter=768, experts=160, top_k=8, layers=6, group=128),  # GLM-4.5-class, TP=2 rank slice
    "tiny": dict(hidden=256, inter=128, experts=16, top_k=4, layers=4, group=64),
}
WORKLOADS = {"decode-1": (1, "decode"), "decode-8": (8, "decode"), "decode-64": (64, "decode"),
             "prefill-2k": (2048, "prefill")}
TINY_WORKLOADS = {"decode-1": (1, "decode"), "decode-8": (8, "decode"), "decode-64": (64, "decode"),
                  "prefill-2k": (256, "prefill")}


# ----------------------------------------------------------------------------------------------
# process memory
# ----------------------------------------------------------------------------------------------


def proc_status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile / RssShmem in bytes (Linux)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (``echo 5 > /proc/self/clear_refs``); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def host_allocator_stats() -> dict:
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return {}
    try:
        s = fn()
        return {k: int(v) for k, v in s.items() if "bytes" in k and ("current" in k or "peak" in k)}
    except Exception:
        return {}


def empty_host_cache() -> None:
    for fn in (getattr(torch._C, "_host_emptyCache", None), getattr(torch.cuda, "empty_host_cache", None)):
        if fn is not None:
            try:
                fn()
                return
            except Exception:
                pass


def drop_page_cache(paths: list[Path]) -> dict:
    """Evict ``paths`` from the page cache: fadvise DONTNEED per file, then drop_caches if root."""
    from mmap_offload import transfer

    for p in paths:
        try:
            transfer.evict_page_cache(p)
        except Exception:
            pass
    dropped = False
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        dropped = True
    except OSError:
        pass
    try:
        resident = float(np.mean([transfer.resident_fraction(p) for p in paths]))
    except Exception:
        resident = float("nan")
    return {"drop_caches": dropped, "resident_fraction_after": resident}


def warm_page_cache(paths: list[Path]) -> None:
    buf = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


# ----------------------------------------------------------------------------------------------
# variants
# ----------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    cache: object
    device: torch.device
    impl: str
    hidden: int
    inter: int
    layers: list[int]
    expert_nbytes: int
    layer_nbytes: int
    budget_bytes: int
    engine_threads: int
    pinned_ring: int
    engine_opts: dict = field(default_factory=dict)  # pattern -> make_engine options (mmap engine)


class Variant:
    """Weight delivery for the forward loop: ``layer(li, ids) -> (ExpertWeights, slot_ids)``."""

    name = "?"
    cold = False
    deliver_s = 0.0  # host time inside layer() (cache lookups, submits, waits for copies to issue)

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.notes: dict = {}
        self.pinned_bytes = 0
        self.vram_weight_bytes = 0

    def setup(self) -> None: ...

    def begin(self) -> None:
        """Called before a run's first step (after any page-cache change)."""

    def layer(self, li: int, ids: np.ndarray): ...

    def pcie_bytes(self) -> int:
        return 0

    def close(self) -> None: ...


def _load_layer_params(ctx: Ctx, layer: int, device, pin: bool) -> dict[str, torch.Tensor]:
    """Per-name [E, *shape] tensors of ``layer`` read from the cache (page cache -> host/device)."""
    cache = ctx.cache
    out = {}
    for spec in cache.expert_specs:
        if spec.name not in mk._MARLIN_TO_GPTQ:
            continue
        shape = (cache.num_experts, *spec.shape)
        if pin:
            t = torch.empty(shape, dtype=spec.torch_dtype, pin_memory=True)  # CachingHostAllocator, as pin_memory()
        else:
            t = torch.empty(shape, dtype=spec.torch_dtype, device="cpu")
        for e in range(cache.num_experts):
            t[e].copy_(cache.tensor(layer, e, spec.name))
        out[spec.name] = t if (pin or device.type == "cpu") else t.to(device)
    return out


class VramVariant(Variant):
    name = "vram"

    def setup(self):
        c = self.ctx
        self.w = []
        for layer in c.layers:
            params = _load_layer_params(c, layer, c.device, pin=False)
            self.w.append(mk.weights_from_tensors(params, c.hidden, c.inter))
        c.cache.close()  # drop the read mappings: RSS counts only what the variant keeps
        self.vram_weight_bytes = c.layer_nbytes * len(c.layers)

    def layer(self, li, ids):
        return self.w[li], ids

    def close(self):
        self.w = []


class UvaVariant(Variant):
    """vLLM UVA offload at the same VRAM budget: leading layers resident, the rest pinned + zero-copy."""

    name = "uva"

    def setup(self):
        c = self.ctx
        self.resident = min(len(c.layers), c.budget_bytes // c.layer_nbytes)
        self.w, self.offloaded = [], []
        requested = rounded = 0
        methods = set()
        on_cuda = c.device.type == "cuda"
        for i, layer in enumerate(c.layers):
            if i < self.resident:
                params = _load_layer_params(c, layer, c.device, pin=False)
                self.offloaded.append(False)
            else:
                params = _load_layer_params(c, layer, c.device, pin=on_cuda)
                for name, t in list(params.items()):
                    n = t.numel() * t.element_size()
                    requested += n
                    rounded += next_pow2(n)
                    if on_cuda:
                        params[name], m = mk.uva_alias(t, c.device)
                        params[name]._host = t  # keep the pinned storage alive
                        methods.add(m)
                self.offloaded.append(True)
            self.w.append(mk.weights_from_tensors(params, c.hidden, c.inter))
        c.cache.close()
        self.vram_weight_bytes = self.resident * c.layer_nbytes
        stats = host_allocator_stats()
        self.pinned_bytes = stats.get("reserved_bytes.current", stats.get("allocated_bytes.current", rounded)) if on_cuda else 0
        self.notes.update(resident_layers=self.resident, pinned_requested=requested, pinned_pow2=rounded,
                          uva_alias=sorted(methods), host_allocator=stats,
                          emulated=not on_cuda)
        self._bytes = 0

    def layer(self, li, ids):
        if self.offloaded[li]:
            ids = np.asarray(ids)
            counts = np.bincount(ids.reshape(-1), minlength=self.ctx.cache.num_experts)
            used = counts[counts > 0]
            bm = mk._pick_config(ids.size / max(1, used.size), self.ctx.hidden, 128)["BLOCK_M"]
            self._bytes += int(np.ceil(used / bm).sum()) * self.ctx.expert_nbytes
        return self.w[li], ids

    def pcie_bytes(self):
        return self._bytes

    def close(self):
        self.w = []
        gc.collect()
        empty_host_cache()


def _make_engine(ctx: Ctx, kind: str, pattern: str = "experts"):
    """An engine of ``kind`` with the options chosen for ``pattern`` ("experts" | "layer")."""
    from mmap_offload.transfer import make_engine

    if kind == "kvikio":
        return make_engine("kvikio", ctx.device, threads=ctx.engine_threads)
    opts = dict(threads=ctx.engine_threads)
    opts.update(ctx.engine_opts.get(pattern, {}) if kind == "mmap" else {})
    return make_engine(kind, ctx.device, pinned_bytes=ctx.pinned_ring, **opts)


class EngineVariant(Variant):
    """A variant fed by a transfer engine of ``engine_kind``: opens, pre-faults and closes it."""

    suffix = "?"

    def __init__(self, ctx, engine_kind="mmap", cold=False):
        super().__init__(ctx)
        self.engine_kind = engine_kind
        self.cold = cold
        self.name = engine_kind + "-" + self.suffix + ("-cold" if cold else "")

    def _open_engine(self, pattern: str) -> None:
        self.engine = _make_engine(self.ctx, self.engine_kind, pattern)
        _prefault(self, self.engine)
        self.pinned_bytes = int(self.engine.metrics.get("pinned_bytes", 0))

    def _close_engine(self) -> None:
        self.pinned_bytes = max(self.pinned_bytes, int(self.engine.metrics.get("pinned_bytes", 0)))
        self.notes["engine"] = _engine_notes(self.engine)
        self.engine.close()


class PrefetchVariant(EngineVariant):
    """LayerPrefetcher, lookahead 1, 2 buffers of [E, ...]: the whole budget."""

    suffix = "prefetch"

    def setup(self):
        from mmap_offload.prefetch import LayerPrefetcher

        c = self.ctx
        self._open_engine("layer")
        nb = max(1, min(len(c.layers), c.budget_bytes // c.layer_nbytes))
        self.pf = LayerPrefetcher(c.cache, self.engine, c.device, lookahead=max(1, nb - 1), num_buffers=nb)
        self.vram_weight_bytes = nb * c.layer_nbytes
        self.w_cache = {}

    def begin(self):
        self.pf.start_prefetch(self.ctx.layers[0])

    def layer(self, li, ids):
        layer = self.ctx.layers[li]
        bufs = self.pf.wait_for_layer(layer)
        self.pf.start_prefetch(self.pf.layer_after(layer))
        key = id(bufs)
        w = self.w_cache.get(key)
        if w is None:
            w = self.w_cache[key] = mk.weights_from_tensors(bufs, self.ctx.hidden, self.ctx.inter)
        return w, ids

    def pcie_bytes(self):
        return int(self.pf.metrics["bytes_moved"])  # counted when submitted

    def close(self):
        try:
            self.pf.sync()
        finally:
            self.notes["prefetch"] = dict(self.pf.metrics)
            self._close_engine()


class CacheVariant(EngineVariant):
    """ExpertCache over a shared pool of budget bytes; routed experts only."""

    suffix = "cache"

    def __init__(self, ctx, engine_kind="mmap", cold=False, policy="lfu-decay"):
        super().__init__(ctx, engine_kind, cold)
        self.policy = policy

    def setup(self):
        from mmap_offload.expert_cache import ExpertCache

        c = self.ctx
        self._open_engine("experts")
        self.ec = ExpertCache(c.cache, self.engine, c.device, capacity_bytes=c.budget_bytes, shared=True,
                              policy=self.policy)
        self.vram_weight_bytes = self.ec.capacity_bytes
        self.w_cache = {}

    def layer(self, li, ids):
        layer = self.ctx.layers[li]
        slot_ids = self.ec.ensure(layer, ids)
        slots = self.ec.slots(layer)
        key = id(slots)
        w = self.w_cache.get(key)
        if w is None:
            w = self.w_cache[key] = mk.weights_from_tensors(slots, self.ctx.hidden, self.ctx.inter)
        return w, np.asarray(slot_ids)

    def pcie_bytes(self):
        return int(self.ec.metrics["bytes_moved"])

    def close(self):
        try:
            self.ec.sync()
        finally:
            self.notes["expert_cache"] = dict(self.ec.summary())
            self._close_engine()


# ----------------------------------------------------------------------------------------------
# tuning in the same run: kernel tile config (applies to every variant), engine options (mmap)
# ----------------------------------------------------------------------------------------------

KERNEL_CANDIDATES = [
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=5),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=6),
]


def tune_kernel(ctx: Ctx, args) -> dict:
    """Pick the decode tile config that reads one UVA (pinned, zero-copy) layer fastest at batch 1.

    The winner becomes ``moe_kernel.DECODE_CONFIG`` for every variant, so UVA is measured with the
    kernel config that suits it best and no variant gets a different kernel."""
    c = ctx
    layer = c.layers[-1]
    params = _load_layer_params(c, layer, c.device, pin=True)
    for name, t in list(params.items()):
        params[name], _ = mk.uva_alias(t, c.device)
        params[name]._host = t
    c.cache.close()
    w = mk.weights_from_tensors(params, c.hidden, c.inter)
    rng = np.random.default_rng(args.seed)
    E, k = c.cache.num_experts, args.top_k_for_tune
    x = torch.randn(1, c.hidden, device=c.device).to(torch.bfloat16)
    rw = torch.full((1, k), 1.0 / k, device=c.device)
    results = []
    for cfg in KERNEL_CANDIDATES:
        mk.DECODE_CONFIG = dict(cfg)
        try:
            mk.moe_forward(x, rng.choice(E, (1, k), replace=False), rw, w)  # compile
            torch.cuda.synchronize(c.device)
            t0 = time.perf_counter()
            n = 10
            for _ in range(n):
                mk.moe_forward(x, rng.choice(E, (1, k), replace=False), rw, w)
            torch.cuda.synchronize(c.device)
            dt = (time.perf_counter() - t0) / n
            results.append(dict(cfg=cfg, ms=1e3 * dt, gbps=k * c.expert_nbytes / dt / 1e9))
        except Exception as exc:
            results.append(dict(cfg=cfg, error=f"{type(exc).__name__}: {exc}"))
    ok = [r for r in results if "ms" in r]
    best = min(ok, key=lambda r: r["ms"])["cfg"] if ok else KERNEL_CANDIDATES[0]
    mk.DECODE_CONFIG = dict(best)
    del w, params
    gc.collect()
    empty_host_cache()
    for r in results:
        print(f"kernel {r['cfg']}: " + (f"{r['ms']:.2f} ms/layer, {r['gbps']:.1f} GB/s over PCIe" if "ms" in r
                                       else r["error"]), flush=True)
    return dict(candidates=results, chosen=best)


ENGINE_CANDIDATES = [  # small batches are cut adaptively; only those within --engine-threads are chosen
    dict(threads=8, slot_bytes=16 << 20, native=False),  # Python copy threads (the fallback)
    dict(threads=8),  # the defaults: native pool, hot slots, rep movsb, 4 MiB slots
    dict(threads=8, slot_bytes=2 << 20),
    dict(threads=8, slot_bytes=8 << 20),
    dict(threads=8, slot_bytes=16 << 20, slot_reuse="oldest", copy_impl="nt4"),  # session 2's default
    dict(threads=12),  # beyond the 8 threads of the serving bar: reported
]


def _engine_notes(engine) -> dict:
    """Where an engine's time went (fill = CPU copy/read, issue = H2D launch, ring wait, populate)."""
    keep = ("engine", "native", "copy_impl", "slot_reuse", "threads", "slot_bytes", "bytes_moved", "tickets", "chunks", "fill_seconds",
            "issue_seconds", "ring_wait_seconds", "populate_seconds", "stall_seconds")
    return {k: v for k, v in engine.metrics.items() if k in keep}


def _prefault(var: "Variant", engine) -> None:
    """Warm variants: set up the engine's page tables of the (page-cache-resident) cache files
    before timing, as a server does once at start (MmapEngine.prefault; a no-op for other engines)."""
    if getattr(var, "cold", False):
        return
    t0 = time.perf_counter()
    done = engine.prefault([var.ctx.cache.layer_file(l) for l in var.ctx.layers])
    var.notes["prefault"] = dict(bytes=done, seconds=round(time.perf_counter() - t0, 3))


def tune_engine(ctx: Ctx, args) -> dict:
    """Time the mmap engine (warm page cache) on the two copy patterns of the variants, per option
    set: "experts" = 6 routed experts of a layer per submit/wait (ExpertCache misses at decode),
    "layer" = one whole layer per submit/wait (LayerPrefetcher). The fastest set serves that pattern."""
    from mmap_offload.transfer import Copy, make_engine

    c = ctx
    cache = c.cache
    specs = [s for s in cache.expert_specs if s.name in mk._MARLIN_TO_GPTQ]
    E = cache.num_experts
    n_exp = min(6, E)
    dst_e = {s.name: torch.empty((n_exp, *s.shape), dtype=s.torch_dtype, device=c.device) for s in specs}
    dst_l = {s.name: torch.empty((E, *s.shape), dtype=s.torch_dtype, device=c.device) for s in specs}
    rng = np.random.default_rng(args.seed)
    sync = (lambda: torch.cuda.synchronize(c.device)) if c.device.type == "cuda" else (lambda: None)
    results = []
    for opts in ENGINE_CANDIDATES:
        row = dict(opts=opts)
        if opts.get("threads", 8) > max(8, args.engine_threads) and c.device.type != "cuda":
            continue
        try:
            eng = make_engine("mmap", c.device, pinned_bytes=c.pinned_ring, **opts)
            row["native"] = bool(getattr(eng, "native", False))
            eng.prefault([cache.layer_file(l) for l in c.layers])
            try:
                for pattern in ("layer", "experts"):
                    for rep in range(2):  # first pass maps + populates; the second is timed
                        sync()
                        t0 = time.perf_counter()
                        moved = 0
                        if pattern == "layer":
                            for layer in c.layers[:2]:
                                dst = [(e * cache.record_nbytes + s.offset, s.nbytes, dst_l[s.name][e])
                                       for e in range(E) for s in specs]
                                eng.wait(eng.submit([Copy(src=cache.layer_extent(layer), dst=dst)]))
                                moved += E * c.expert_nbytes
                        else:
                            for li in range(min(8, len(c.layers))):
                                ids = rng.choice(E, n_exp, replace=False)
                                copies = [Copy(src=cache.expert_extent(c.layers[li], int(e)),
                                               dst=[(s.offset, s.nbytes, dst_e[s.name][j]) for s in specs])
                                          for j, e in enumerate(ids)]
                                eng.wait(eng.submit(copies))
                                moved += n_exp * c.expert_nbytes
                        sync()
                        dt = time.perf_counter() - t0
                    row[pattern] = moved / dt / 1e9
            finally:
                eng.close()
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"
        results.append(row)
        print(f"engine {opts} native={row.get('native')}: " + (f"layer {row['layer']:.1f} GB/s, experts {row['experts']:.1f} GB/s"
                                    if "error" not in row else row["error"]), flush=True)
    chosen = {}
    for pattern in ("layer", "experts"):
        ok = [r for r in results if pattern in r and r["opts"].get("threads", 8) <= args.engine_threads]
        if ok:
            chosen[pattern] = max(ok, key=lambda r: r[pattern])["opts"]
    del dst_e, dst_l
    return dict(candidates=results, chosen=chosen)


def pinned_h2d_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """The ceiling of this run: pinned host -> device copy of ``nbytes`` (torch)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    gbps = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    del src, dst
    empty_host_cache()
    return gbps


# ----------------------------------------------------------------------------------------------
# the forward loop
# ----------------------------------------------------------------------------------------------


def make_traces(args, shp: dict, batch: int, kind: str, trace: str, steps: int) -> np.ndarray:
    from mmap_offload import traces

    L, E, k = shp["layers"], shp["experts"], shp["top_k"]
    if trace == "uniform":
        return traces.uniform_trace(steps, L, E, k, batch=batch, seed=args.seed)
    if kind == "prefill":  # popularity skew only: temporal locality has no meaning inside one prompt
        return traces.skewed_trace(steps, L, E, k, batch=batch, zipf_s=args.zipf_s, sticky_p=0.0, seed=args.seed)
    return traces.skewed_trace(steps, L, E, k, batch=batch, zipf_s=args.zipf_s, sticky_p=args.sticky_p,
                               seed=args.seed)


def run_steps(var: Variant, ctx: Ctx, trace: np.ndarray, x0: torch.Tensor, rw: torch.Tensor, first: int, n: int,
              sync) -> tuple[float, torch.Tensor]:
    """Run steps [first, first + n) of ``trace``; returns (seconds, output of the last step)."""
    sync()
    t0 = time.perf_counter()
    y = x0
    for s in range(first, first + n):
        x = x0
        for li in range(len(ctx.layers)):
            ids = trace[s, li]
            t1 = time.perf_counter()
            w, slot_ids = var.layer(li, ids)
            var.deliver_s += time.perf_counter() - t1
            y = mk.moe_forward(x, slot_ids, rw, w, impl=ctx.impl)
            x = y * torch.rsqrt(y.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(y.dtype)
        y = x
    sync()
    return time.perf_counter() - t0, y


def bench_variant(var: Variant, ctx: Ctx, args, shp, workloads, trace_kinds, reference: dict, deadline: float,
                  cache_files: list[Path]) -> list[dict]:
    rows = []
    dev = ctx.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    cold_info = {}
    if var.cold:
        ctx.cache.close()
        cold_info = drop_page_cache(cache_files)
    reset_ok = reset_peak_rss()
    rss0 = proc_status()
    t0 = time.perf_counter()
    var.setup()
    sync()
    ttr = time.perf_counter() - t0
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for trace_kind in trace_kinds:
        for wl in workloads:
            batch, kind = (TINY_WORKLOADS if args.tiny else WORKLOADS)[wl]
            row = dict(variant=var.name, trace=trace_kind, workload=wl, batch=batch, kind=kind)
            if var.cold and not _cold_wanted(var, wl, trace_kind):
                continue
            if time.perf_counter() > deadline:
                row["skipped"] = "deadline"
                rows.append(row)
                continue
            try:
                if var.cold and rows:  # each cold run starts cold
                    if isinstance(var, EngineVariant):
                        var.close()
                    ctx.cache.close()
                    cold_info = drop_page_cache(cache_files)
                    var.setup()
                steps_total = args.cold_steps if var.cold else args.steps if kind == "decode" else args.prefill_steps
                warm_steps = 0 if var.cold else 1
                tr = make_traces(args, shp, batch, kind, trace_kind, steps_total + warm_steps)
                g = torch.Generator().manual_seed(args.seed + batch)
                x0 = torch.randn(batch, ctx.hidden, generator=g).to(dtype).to(dev)
                rw = torch.softmax(torch.randn(batch, shp["top_k"], generator=g), -1).to(dev)
                var.begin()
                if warm_steps:
                    _, y_first = run_steps(var, ctx, tr, x0, rw, 0, 1, sync)  # compile + warm caches
                b0 = var.pcie_bytes()
                # time-bounded: stop early once the run's time budget is spent (cold disks are slow)
                secs, done, y = 0.0, 0, None
                var.deliver_s = 0.0
                while done < steps_total:
                    n = min(steps_total - done, max(1, steps_total // 4))
                    dt, y = run_steps(var, ctx, tr, x0, rw, warm_steps + done, n, sync)
                    secs += dt
                    done += n
                    if secs > args.run_seconds or time.perf_counter() > deadline:
                        break
                moved = var.pcie_bytes() - b0
                routed = 0
                for s in range(warm_steps, warm_steps + done):
                    for li in range(len(ctx.layers)):
                        routed += len(np.unique(tr[s, li])) * ctx.expert_nbytes
                tokens = batch * done
                row.update(steps=done, seconds=secs, tokens_per_s=tokens / secs,
                           step_ms=1e3 * secs / done, pcie_bytes_per_step=moved / done,
                           routed_bytes_per_step=routed / done, deliver_ms=1e3 * var.deliver_s / done)
                if not var.cold:
                    key = (trace_kind, wl)
                    yf = y_first.float().cpu()
                    if key not in reference:
                        reference[key] = yf
                    else:
                        ref = reference[key]
                        row["max_rel_diff_vs_first_variant"] = float((yf - ref).abs().max() / ref.abs().max().clamp_min(1e-12))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                if args.verbose:
                    traceback.print_exc()
            rows.append(row)
            print(_fmt_row(row), flush=True)
    rss1 = proc_status()
    try:
        var.close()
    except Exception as exc:
        var.notes["close_error"] = repr(exc)
    common = dict(time_to_ready_s=ttr, pinned_bytes=int(var.pinned_bytes), vram_weight_bytes=int(var.vram_weight_bytes),
                  peak_rss_bytes=rss1.get("VmHWM", 0),
                  anon_shmem_bytes=rss1.get("RssAnon", 0) + rss1.get("RssShmem", 0), peak_rss_reset=reset_ok, rss_start=rss0, rss_end=rss1,
                  notes=var.notes, **({"cold_info": cold_info} if var.cold else {}))
    for r in rows:
        r.update({k: v for k, v in common.items() if k not in ("notes", "rss_start", "rss_end")})
    return rows, common


def _cold_wanted(var: Variant, wl: str, trace_kind: str) -> bool:
    if isinstance(var, CacheVariant):
        return wl in ("decode-1", "decode-8")
    return wl in ("prefill-2k",) and trace_kind == "uniform"


def _fmt_row(r: dict) -> str:
    if "tokens_per_s" in r:
        return (f"{r['variant']:>18} {r['trace']:>8} {r['workload']:>10}: {r['tokens_per_s']:10.1f} tok/s "
                f"step {r['step_ms']:8.2f} ms  pcie {r['pcie_bytes_per_step'] / 2**20:9.1f} MiB "
                f"routed {r['routed_bytes_per_step'] / 2**20:9.1f} MiB  host in delivery {r.get('deliver_ms', 0):7.2f} ms")
    return f"{r['variant']:>18} {r['trace']:>8} {r['workload']:>10}: {r.get('error') or r.get('skipped')}"


# ----------------------------------------------------------------------------------------------
# set-up: checkpoint + cache
# ----------------------------------------------------------------------------------------------


def build_cache(args, shp: dict, work: Path) -> tuple[Path, dict]:
    from mmap_offload import synth, warmup

    info = {}
    ckpt = work / "ckpt"
    cache_dir = work / "cache"
    marker = work / "shapes.json"
    want = json.dumps(shp, sort_keys=True)
    if not (marker.exists() and marker.read_text() == want and (ckpt / "config.json").exists()):
        t0 = time.perf_counter()
        synth.make_checkpoint(
            ckpt, arch="mixtral", quant="w4a16", num_layers=shp["layers"], num_experts=shp["experts"],
            hidden=shp["hidden"], intermediate=shp["inter"], top_k=shp["top_k"], group_size=shp["group"],
            vocab_size=512, num_heads=1, num_kv_heads=1, head_dim=128 if shp["hidden"] >= 128 else shp["hidden"],
            seed=args.seed,
        )
        info["synth_s"] = time.perf_counter() - t0
        marker.write_text(want)
    t0 = time.perf_counter()
    rep = warmup.warmup(ckpt, cache_dir, tp_size=1, device="auto", progress=False)
    info["warmup_s"] = time.perf_counter() - t0
    info["warmup_bytes_written"] = int(getattr(rep, "bytes_written", 0))
    info["warmup_layers_written"] = int(getattr(rep, "layers_written", 0))
    return cache_dir, info


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def gib(n) -> str:
    return f"{n / 2**30:.2f}"


def bars(rows: list[dict]) -> list[dict]:
    """The issue's bars as ratios of this run."""

    def tps(variant, trace, wl):
        for r in rows:
            if r["variant"] == variant and r["trace"] == trace and r["workload"] == wl and "tokens_per_s" in r:
                return r["tokens_per_s"]
        return None

    out = []
    for trace, need in (("uniform", 1.0), ("skewed", 1.5)):
        for wl in ("decode-1", "decode-8"):
            a, b = tps("mmap-cache", trace, wl), tps("uva", trace, wl)
            out.append(dict(bar=f"{wl} {trace}: mmap-cache / uva >= {need}", value=(a / b) if a and b else None,
                            need=need))
    a = max([v for v in (tps("mmap-prefetch", "uniform", "prefill-2k"), tps("mmap-cache", "uniform", "prefill-2k")) if v] or [0])
    b = tps("uva", "uniform", "prefill-2k")
    out.append(dict(bar="prefill-2k uniform: mmap / uva >= 1.0", value=(a / b) if a and b else None, need=1.0))
    pinned = {r["variant"]: r["pinned_bytes"] for r in rows if "pinned_bytes" in r}
    mm = max([v for k, v in pinned.items() if k.startswith("mmap")] or [0])
    out.append(dict(bar="pinned: mmap <= 2 GiB", value=mm / 2**30, need=2.0, lower_is_better=True))
    if "uva" in pinned:
        out.append(dict(bar="pinned: uva (all offloaded experts, pow2 blocks), GiB", value=pinned["uva"] / 2**30,
                        need=None))
    for b_ in out:
        if b_["need"] is not None and b_["value"] is not None:
            b_["ok"] = b_["value"] <= b_["need"] if b_.get("lower_is_better") else b_["value"] >= b_["need"]
    return out


def write_report(out: Path, meta: dict, rows: list[dict], variants: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bar_rows = bars(rows)
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, variants=variants, bars=bar_rows),
                                                 indent=1, default=str))
    lines = [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}; shapes: {meta['shapes']}; expert {meta['expert_nbytes'] / 2**20:.2f} MiB, "
        f"layer {gib(meta['layer_nbytes'])} GiB, all experts {gib(meta['total_expert_bytes'])} GiB, "
        f"VRAM budget for expert weights {gib(meta['budget_bytes'])} GiB.  ",
        f"Tuning in this run: {json.dumps({k: v for k, v in meta.get('tuning', {}).items() if k in ('pinned_h2d_gbps', 'decode_config', 'engine_opts')})}",
        "",
        "| variant | trace | workload | tokens/s | step ms | host in delivery ms | PCIe MiB/step | routed MiB/step | pinned GiB | VRAM wts GiB | peak RSS GiB | anon+shm GiB | ready s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['variant']} | {r['trace']} | {r['workload']} | {r.get('error') or r.get('skipped')} "
                         "| | | | | | | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['trace']} | {r['workload']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | "
            f"{r.get('deliver_ms', 0):.2f} | {r['pcie_bytes_per_step'] / 2**20:.1f} | {r['routed_bytes_per_step'] / 2**20:.1f} | "
            f"{gib(r['pinned_bytes'])} | {gib(r['vram_weight_bytes'])} | {gib(r['peak_rss_bytes'])} | "
            f"{gib(r.get('anon_shmem_bytes', 0))} | {r['time_to_ready_s']:.2f} |"
        )
    lines += ["", "| bar | value | need | ok |", "| --- | ---: | ---: | --- |"]
    for b in bar_rows:
        v = "n/a" if b["value"] is None else f"{b['value']:.2f}"
        lines.append(f"| {b['bar']} | {v} | {b['need'] if b['need'] is not None else ''} | {b.get('ok', '')} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")
    try:
        plot(out, rows, meta)
    except Exception as exc:  # plots are a convenience; the table is the record
        print(f"plots skipped: {exc}")


def plot(out: Path, rows: list[dict], meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "tokens_per_s" in r]
    traces_ = sorted({r["trace"] for r in ok})
    wls = [w for w in WORKLOADS if any(r["workload"] == w for r in ok)]
    variants = list(dict.fromkeys(r["variant"] for r in ok))
    fig, axes = plt.subplots(1, len(traces_), figsize=(7 * len(traces_), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces_):
        width = 0.8 / max(1, len(variants))
        for i, v in enumerate(variants):
            vals = []
            for w in wls:
                m = [r["tokens_per_s"] for r in ok if r["variant"] == v and r["trace"] == trace and r["workload"] == w]
                vals.append(m[0] if m else 0)
            ax.bar(np.arange(len(wls)) + i * width, vals, width, label=v)
        ax.set_xticks(np.arange(len(wls)) + 0.4 - width / 2)
        ax.set_xticklabels(wls)
        ax.set_yscale("log")
        ax.set_ylabel("tokens/s (log)")
        ax.set_title(f"{trace} routing")
        ax.legend(fontsize=7)
    fig.suptitle(f"MoE forward, same W4A16 kernel; VRAM budget {gib(meta['budget_bytes'])} GiB of "
                 f"{gib(meta['total_expert_bytes'])} GiB experts")
    fig.tight_layout()
    fig.savefig(out / "tokens_per_s.png", dpi=110)
    plt.close(fig)

    per_var = {}
    for r in rows:
        if "pinned_bytes" in r:
            per_var.setdefault(r["variant"], r)
    names = list(per_var)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in ((axes[0], "pinned_bytes", "pinned host memory (GiB)"),
                           (axes[1], "peak_rss_bytes", "peak RSS (GiB)"),
                           (axes[2], "time_to_ready_s", "time to ready (s)")):
        vals = [per_var[n].get(key, 0) / (2**30 if "bytes" in key else 1) for n in names]
        ax.bar(names, vals, color="tab:gray")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "memory.png", dpi=110)
    plt.close(fig)

    dec = [r for r in ok if r["kind"] == "decode"]
    if dec:
        fig, ax = plt.subplots(figsize=(8, 4))
        labels = [f"{r['variant']}\n{r['trace'][:4]} {r['workload'][7:]}" for r in dec]
        ax.bar(np.arange(len(dec)) - 0.2, [r["pcie_bytes_per_step"] / 2**20 for r in dec], 0.4, label="PCIe")
        ax.bar(np.arange(len(dec)) + 0.2, [r["routed_bytes_per_step"] / 2**20 for r in dec], 0.4, label="routed")
        ax.set_xticks(np.arange(len(dec)))
        ax.set_xticklabels(labels, fontsize=5, rotation=90)
        ax.set_ylabel("MiB per decode step")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "bytes_per_step.png", dpi=110)
        plt.close(fig)


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="toy shapes (CPU debugging)")
    p.add_argument("--shapes", choices=sorted(SHAPES), default=None)
    for k in ("layers", "experts", "hidden", "inter", "top_k", "group"):
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None)
    p.add_argument("--budget-layers", type=float, default=2.0, help="VRAM budget for expert weights, in layers")
    p.add_argument("--variants", default="vram,uva,mmap-cache,mmap-prefetch,mmap-cache-cold,pread-prefetch-cold,"
                   "kvikio-prefetch-cold,pread-cache-cold,kvikio-cache-cold")
    p.add_argument("--workloads", default="decode-1,decode-8,decode-64,prefill-2k")
    p.add_argument("--traces", default="uniform,skewed")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per run")
    p.add_argument("--prefill-steps", type=int, default=3)
    p.add_argument("--cold-steps", type=int, default=6)
    p.add_argument("--run-seconds", type=float, default=0.6, help="stop a run after this much timed work")
    p.add_argument("--deadline", type=float, default=300.0, help="skip what is left after this many seconds")
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--sticky-p", type=float, default=0.3)
    p.add_argument("--engine-threads", type=int, default=8)
    p.add_argument("--engine-opts", default=None,
                   help='JSON {"experts": {...}, "layer": {...}} of mmap make_engine options (skips --tune)')
    p.add_argument("--no-tune", action="store_true", help="no kernel / engine tuning (defaults)")
    p.add_argument("--pinned-ring-mib", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help="checkpoint + cache (reused when shapes match)")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--verbose", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    deadline = t_start + args.deadline
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: use --device cpu --tiny", file=sys.stderr)
        return 2
    shp = dict(SHAPES[args.shapes or ("tiny" if args.tiny else "default")])
    for k in ("layers", "experts", "hidden", "inter", "top_k", "group"):
        v = getattr(args, k)
        if v is not None:
            shp[k] = v
    impl = "triton" if device.type == "cuda" else "torch"
    work = Path(args.workdir or (Path(args.out) / "work"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"shapes {shp}, device {device}, kernel {impl}", flush=True)
    cache_dir, setup = build_cache(args, shp, work)
    print(f"set-up: {setup}", flush=True)

    from mmap_offload.cache_reader import open_cache

    t0 = time.perf_counter()
    cache = open_cache(cache_dir)
    open_s = time.perf_counter() - t0
    specs = [s for s in cache.expert_specs if s.name in mk._MARLIN_TO_GPTQ]
    expert_nbytes = sum(s.nbytes for s in specs)
    layer_nbytes = expert_nbytes * cache.num_experts
    ctx = Ctx(cache=cache, device=device, impl=impl, hidden=shp["hidden"], inter=shp["inter"], layers=list(cache.layers),
              expert_nbytes=expert_nbytes, layer_nbytes=layer_nbytes,
              budget_bytes=int(args.budget_layers * layer_nbytes), engine_threads=args.engine_threads,
              pinned_ring=args.pinned_ring_mib << 20)
    cache_files = [cache.layer_file(l) for l in cache.layers]
    warm_page_cache(cache_files)
    tuning = {}
    if device.type == "cuda":
        tuning["pinned_h2d_gbps"] = pinned_h2d_gbps(device)
        print(f"pinned H2D: {tuning['pinned_h2d_gbps']:.1f} GB/s", flush=True)
    if args.engine_opts:
        ctx.engine_opts = json.loads(args.engine_opts)
    elif not args.no_tune:
        tuning["engine"] = tune_engine(ctx, args)
        ctx.engine_opts = tuning["engine"]["chosen"]
    if device.type == "cuda" and impl == "triton" and not args.no_tune:
        args.top_k_for_tune = shp["top_k"]
        tuning["kernel"] = tune_kernel(ctx, args)
    tuning["decode_config"] = dict(mk.DECODE_CONFIG)
    tuning["engine_opts"] = ctx.engine_opts
    meta = dict(
        command="python " + " ".join([os.path.relpath(__file__, HERE.parent)] + sys.argv[1:]),
        machine=f"{platform.node()} {torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor() or 'cpu'}, "
                f"{os.cpu_count()} cores, torch {torch.__version__}",
        shapes=shp, kernel=impl, expert_nbytes=expert_nbytes, layer_nbytes=layer_nbytes,
        total_expert_bytes=layer_nbytes * len(cache.layers), budget_bytes=ctx.budget_bytes,
        open_cache_s=open_s, setup=setup, tuning=tuning, args=vars(args),
    )
    workloads = [w for w in args.workloads.split(",") if w]
    trace_kinds = [t for t in args.traces.split(",") if t]
    if args.tiny:  # toy size on a CPU: fewer, shorter runs
        args.steps, args.prefill_steps, args.cold_steps = min(args.steps, 4), 1, min(args.cold_steps, 2)
        args.run_seconds = min(args.run_seconds, 0.5)
    rows, variants = [], []
    reference: dict = {}
    for vname in [v for v in args.variants.split(",") if v]:
        if time.perf_counter() > deadline:
            variants.append(dict(variant=vname, skipped="deadline"))
            continue
        var = _variant(vname, ctx)
        if var is None:
            variants.append(dict(variant=vname, error="unknown variant"))
            continue
        try:
            if not var.cold and any(v.get("cold") for v in variants):
                warm_page_cache(cache_files)
            vr, common = bench_variant(var, ctx, args, shp, workloads, trace_kinds, reference, deadline, cache_files)
            rows += vr
            variants.append(dict(variant=var.name, **common, cold=var.cold))
            print(f"{var.name}: ready {common['time_to_ready_s']:.2f} s, pinned {gib(common['pinned_bytes'])} GiB, "
                  f"peak RSS {gib(common['peak_rss_bytes'])} GiB", flush=True)
        except Exception as exc:
            msg = f"{type(exc).__name__}: {exc}"
            print(f"{vname}: {msg}", flush=True)
            if args.verbose:
                traceback.print_exc()
            variants.append(dict(variant=vname, error=msg))
            rows.append(dict(variant=vname, trace="-", workload="-", error=msg))
            try:
                var.close()
            except Exception:
                pass
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    meta["total_s"] = time.perf_counter() - t_start
    write_report(Path(args.out), meta, rows, variants)
    print((Path(args.out) / "results.md").read_text())
    return 0


def _variant(name: str, ctx: Ctx) -> Variant | None:
    if name == "vram":
        return VramVariant(ctx)
    if name == "uva":
        return UvaVariant(ctx)
    parts = name.split("-")
    if len(parts) in (2, 3) and parts[0] in ("mmap", "pread", "kvikio") and parts[1] in ("cache", "prefetch"):
        cold = len(parts) == 3 and parts[2] == "cold"
        cls = CacheVariant if parts[1] == "cache" else PrefetchVariant
        return cls(ctx, engine_kind=parts[0], cold=cold)
    return None


if __name__ == "__main__":
    sys.exit(main())
