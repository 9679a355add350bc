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
    mmap-hybrid    the mmap-cache pool; per layer hits on the GPU first, misses split between host compute
                   (host.kernel.HostKernel on the mapped Marlin words) and copies by a cost model calibrated
                   at set-up (mmap_offload/host/hybrid.py); at prefill-like batches, when the model copies
                   everything, whole layers are streamed into the same VRAM (the mmap-prefetch path)
    host-only      every routed expert computed on the host (llama.cpp --cpu-moe / KTransformers), no
                   expert weights in VRAM; prefill skipped unless --host-prefill

mmap-cache and mmap-hybrid here are the library's synchronous Python paths: the vLLM backend has since
moved to deciding each layer on the stream (async_step.py, host jobs started from its callbacks), which
``bench_vllm.py --shapes harness`` measures at these shapes in real vLLM (BENCHMARKS.md, session 13).

Routing: synthetic traces (uniform, skewed), or ``--trace FILE`` (CSV ``step,layer,expert ids[,weights]``,
traces.read_csv) replayed: step and layer modulo the file's, its rows tiled over the batch. The hybrid
variant prints its calibrated rates, the crossover (tokens per step -> host / copied misses) and a
model of the same split on a PCIe Gen4 machine (``--model-h2d-gbps``, labelled as a model).

Per run it records tokens/s, bytes over PCIe per step (uva: a model of the kernel's reads = routed
experts x M-blocks reading them; engines: bytes their copies moved), routed bytes per step (distinct
routed experts x expert bytes), pinned bytes, peak RSS (VmHWM, reset per variant where the kernel
allows), and time to ready (from a built cache to the first forward). Writes results.json,
results.md and PNG plots under ``--out``; every number in docs/BENCHMARKS.md comes from here.
"""

from __future__ import annotations

import argparse
import functools
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
from vllm_runner import proc_status  # noqa: E402  (one /proc/self/status reader for the benchmarks)

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
    group: int = 128
    top_k: int = 8
    host: dict = field(default_factory=dict)  # host compute: threads, kernel, max_rows, prefill


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
        self.pf = LayerPrefetcher(c.cache, self.engine, c.device, lookahead=max(1, nb - 1), num_buffers=nb,
                                  verify_first_use=False)  # transfers only (a check warms the page cache)
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
                              policy=self.policy, verify_first_use=False)
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
# hybrid: misses split between host compute and the copy path (issue 15); host-only
# ----------------------------------------------------------------------------------------------


def _host_kernels(ctx: Ctx, one_pool: bool | None = None) -> tuple[dict, str, int, int]:
    """{threads: host kernel} for the split and the all-cores thread counts; (kernels, name, split, all)."""
    from mmap_offload.host import hybrid

    h = ctx.host
    cores = hybrid.default_threads(0)[1]
    # one core stays with the Python thread that launches the GPU work while the host computes
    t_all = int(h.get("threads") or (max(1, cores - 1) if ctx.device.type == "cuda" else cores))
    t_split = max(1, t_all - ctx.engine_threads)
    if h.get("one_pool") if one_pool is None else one_pool:
        t_all = t_split  # one pool, never more threads than the cores beside the copy engine
    kernels, name = {}, ""
    for t in sorted({t_split, t_all}):
        kernels[t], name = hybrid.make_host_kernel(h.get("kernel", "auto"), threads=t,
                                                   memo=ctx.device.type == "cpu" and h.get("kernel") == "torch")
    return kernels, name, t_split, t_all


def _close_kernels(kernels: dict) -> None:
    for k in kernels.values():
        close = getattr(k, "close", None)
        if close is not None:
            close()


class HybridVariant(EngineVariant):
    """ExpertCache (the same pool as mmap-cache) + host compute of the misses the cost model gives the
    host (mmap_offload/host/hybrid.py). When the model sends nothing to the host and nearly every expert
    of a layer is routed (prefill), whole layers are streamed into the same VRAM (LayerPrefetcher, 2
    buffers, lookahead 1) as mmap-prefetch does: the best copy path at that size."""

    suffix = "hybrid"

    def setup(self):
        from mmap_offload.host import hybrid

        c = self.ctx
        self._open_engine("experts")
        self._pattern = "experts"
        self.kernels, kname, self.t_split, self.t_all = _host_kernels(c)
        self.notes["host_kernel"] = kname
        self.notes["populate"] = hybrid.populate(c.cache, c.layers)
        self.mode = None
        self.ec = self.pf = self.hy = None
        self._set_mode("experts")
        # calibration: host GB/s per thread count, copy GB/s, one GPU call, activations down/up
        slots = self.ec.slots(c.layers[0])
        w = mk.weights_from_tensors(slots, c.hidden, c.inter)
        k = c.top_k
        xg = torch.randn(1, c.hidden, device=c.device).to(_dtype(c.device))
        rwg = torch.full((1, k), 1.0 / k, device=c.device)
        sid = np.arange(k).reshape(1, k) % self.ec.slots_per_pool

        def gpu_call():
            mk.moe_forward(xg, sid, rwg, w, impl=c.impl)

        self.rates = hybrid.calibrate(c.cache, self.engine, c.device, self.kernels, group=c.group, hidden=c.hidden,
                                      threads_split=self.t_split, threads_all=self.t_all, gpu_call=gpu_call,
                                      dtype=_dtype(c.device), max_host_rows=c.host.get("max_rows", 64))
        self.planner = hybrid.Planner(self.rates)
        self.hy.planner = self.planner
        self.notes["rates"] = self.rates.to_dict()
        self.resident_frac = min(1.0, self.ec.capacity_bytes / (len(c.layers) * c.layer_nbytes))
        self.notes["resident_frac"] = self.resident_frac
        self.notes["crossover"] = hybrid.crossover_table(self.rates, c.cache.num_experts, k, self.resident_frac)
        print(f"{self.name}: host kernel {kname}; " + describe_rates(self.rates), flush=True)
        self._moved0 = 0
        self.calls: dict = {}

    def _set_mode(self, mode: str) -> None:
        from mmap_offload.expert_cache import ExpertCache
        from mmap_offload.host import hybrid
        from mmap_offload.prefetch import LayerPrefetcher

        if mode == self.mode:
            return
        c = self.ctx
        moved = self.pcie_bytes() if self.mode else 0
        if self.ec is not None:
            self.ec.sync()
            self.notes.setdefault("expert_cache", []).append(dict(self.ec.summary()))
            self.hy.close()
            self.ec = self.hy = None
        if self.pf is not None:
            self.pf.sync()
            self.notes.setdefault("prefetch", []).append(dict(self.pf.metrics))
            self.pf = None
        gc.collect()
        if c.device.type == "cuda":
            torch.cuda.empty_cache()
        self._moved_base = moved
        self.w_cache = {}
        pattern = "experts" if mode == "experts" else "layer"
        if self.mode and c.engine_opts.get(pattern) != c.engine_opts.get(self._pattern):  # the tuned options
            pinned = self.pinned_bytes
            self._close_engine()
            self._open_engine(pattern)
            self.pinned_bytes = max(pinned, self.pinned_bytes)
            self._pattern = pattern
        if mode == "experts":
            self.ec = ExpertCache(c.cache, self.engine, c.device, capacity_bytes=c.budget_bytes, shared=True,
                                  verify_first_use=False)
            self.vram_weight_bytes = self.ec.capacity_bytes
            planner = getattr(self, "planner", None) or hybrid.Planner(hybrid.Rates(
                expert_bytes=c.expert_nbytes, host_base_s={self.t_split: 1.0, self.t_all: 1.0},
                host_row_s={self.t_split: 0.0, self.t_all: 0.0}, threads_split=self.t_split,
                threads_all=self.t_all, copy_bw=1e9))
            self.hy = hybrid.HybridMoE(c.cache, self.ec, self.kernels, planner, self._gpu_forward, c.device,
                                       group=c.group, record=True)
        else:
            nb = max(1, min(len(c.layers), c.budget_bytes // c.layer_nbytes))
            self.pf = LayerPrefetcher(c.cache, self.engine, c.device, lookahead=max(1, nb - 1), num_buffers=nb,
                                      verify_first_use=False)
            self.vram_weight_bytes = max(self.vram_weight_bytes, nb * c.layer_nbytes)
        self.mode = mode

    def _gpu_forward(self, layer, x, slot_ids, rw):
        slots = self.ec.slots(layer)
        w = self.w_cache.get(id(slots))
        if w is None:
            w = self.w_cache[id(slots)] = mk.weights_from_tensors(slots, self.ctx.hidden, self.ctx.inter)
        return mk.moe_forward(x, slot_ids, rw, w, impl=self.ctx.impl)

    def prepare(self, batch: int, kind: str) -> None:
        """Choose the copy path for this batch size from the cost model (see the class docstring)."""
        from mmap_offload.host import hybrid

        c = self.ctx
        E, k = c.cache.num_experts, c.top_k
        row = hybrid.crossover_table(self.rates, E, k, self.resident_frac, tokens=(batch,))[0]
        stream = row["host"] == 0 and hybrid.expected_distinct(batch, E, k) >= 0.9 * E
        self._set_mode("layer" if stream else "experts")
        self.notes.setdefault("modes", {})[f"{kind}-{batch}"] = self.mode

    def begin(self):
        if self.mode == "layer":
            self.pf.start_prefetch(self.ctx.layers[0])
        else:
            self.hy.calls.clear()

    def forward(self, li, x, ids, rw):
        layer = self.ctx.layers[li]
        if self.mode == "layer":
            bufs = self.pf.wait_for_layer(layer)
            self.pf.start_prefetch(self.pf.layer_after(layer))
            w = self.w_cache.get(id(bufs))
            if w is None:
                w = self.w_cache[id(bufs)] = mk.weights_from_tensors(bufs, self.ctx.hidden, self.ctx.inter)
            return mk.moe_forward(x, ids, rw, w, impl=self.ctx.impl)
        return self.hy.forward(layer, x, ids, rw)

    def after_warm(self):
        if self.hy is not None:
            self.hy.calls.clear()
            self._m0 = dict(self.hy.metrics)

    def row_extra(self, steps: int, key) -> dict:
        if self.hy is None:
            return dict(mode=self.mode, host_bytes_per_step=0.0)
        m, m0 = self.hy.metrics, getattr(self, "_m0", {})
        d = {k: m[k] - m0.get(k, 0) for k in ("hits", "misses", "host_experts", "copied_experts", "host_s",
                                               "host_wait_s", "plan_s", "ensure_s")}
        self.calls[key] = [(t, h, r.tolist()) for t, h, r in self.hy.calls]
        return dict(mode=self.mode, host_bytes_per_step=d["host_experts"] * self.ctx.expert_nbytes / steps,
                    host_experts_per_step=d["host_experts"] / steps, copied_experts_per_step=d["copied_experts"] / steps,
                    hit_experts_per_step=d["hits"] / steps, host_wait_ms=1e3 * d["host_wait_s"] / steps,
                    host_compute_ms=1e3 * d["host_s"] / steps)

    def pcie_bytes(self):
        cur = 0
        if self.ec is not None:
            cur = int(self.ec.metrics["bytes_moved"])
        elif self.pf is not None:
            cur = int(self.pf.metrics["bytes_moved"])
        return getattr(self, "_moved_base", 0) + cur

    def close(self):
        try:
            if self.ec is not None:
                self.ec.sync()
                self.notes.setdefault("expert_cache", []).append(dict(self.ec.summary()))
                self.notes["hybrid"] = dict(self.hy.metrics)
                # the cost model after the run (it learns from every host job and copy): rates and counts
                self.notes["rates_end"] = self.planner.rates.to_dict()
                self.notes["observed"] = dict(self.planner.model.observed)
                self.hy.close()
            if self.pf is not None:
                self.pf.sync()
        finally:
            self.notes["calls"] = {f"{k[0]}/{k[1]}": v for k, v in self.calls.items()}
            _close_kernels(self.kernels)
            self._close_engine()


class HostOnlyVariant(Variant):
    """Every routed expert computed on the host from the mapped cache (llama.cpp --cpu-moe,
    KTransformers): no expert weights in VRAM, activations down and rows up per layer."""

    name = "host-only"

    def setup(self):
        from mmap_offload.host import hybrid

        c = self.ctx
        self.kernels, kname, _, t_all = _host_kernels(c, one_pool=False)
        _close_kernels({t: k for t, k in self.kernels.items() if t != t_all})  # only the all-cores pool
        self.kernels = {t_all: self.kernels[t_all]}
        self.kernel = self.kernels[t_all]
        self.notes["host_kernel"] = kname
        if c.device.type == "cuda" and "stand-in" in kname and c.host.get("kernel") != "torch":
            _close_kernels(self.kernels)
            raise RuntimeError(f"host-only: {kname}; the torch stand-in needs minutes per step at these sizes "
                               "(pass --host-kernel torch to run it anyway)")
        self.notes["populate"] = hybrid.populate(c.cache, c.layers)
        self.bufs: dict = {}
        self.vram_weight_bytes = 0
        self._bytes = 0
        print(f"host-only: host kernel {kname}", flush=True)

    def skip(self, wl: str, kind: str) -> str | None:
        if kind == "prefill" and not self.ctx.host.get("prefill"):
            return "host-only: prefill not run (compute-bound on the host; --host-prefill runs it)"
        return None

    def forward(self, li, x, ids, rw):
        from mmap_offload.host import hybrid

        self._bytes += len(np.unique(ids)) * self.ctx.expert_nbytes
        y = hybrid.host_forward(self.ctx.cache, self.kernel, self.ctx.layers[li], x, ids, rw, self.ctx.group, self.bufs)
        self.pinned_bytes = sum(t.numel() * t.element_size() for t in self.bufs.values()) if x.is_cuda else 0
        return y

    def row_extra(self, steps: int, key) -> dict:
        b, self._bytes = self._bytes, 0
        return dict(host_bytes_per_step=b / max(1, steps))

    def after_warm(self):
        self._bytes = 0

    def close(self):
        _close_kernels(self.kernels)
        self.bufs.clear()


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def describe_rates(r) -> str:
    hs = ", ".join(f"{t} thr {r.host_gbps(t):.1f} GB/s + {1e3 * r.call_s(t):.2f} ms/call (+{1e3 * r.host_row_s[t]:.3f} "
                   "ms/row)" for t in sorted(r.host_base_s))
    return (f"host {hs}; copy {r.copy_bw / 1e9:.1f} GB/s + {1e3 * r.copy_lat_s:.2f} ms; GPU call "
            f"{1e3 * r.gpu_call_s:.2f} ms; activations {1e3 * r.xfer_s:.3f} ms; both at once: host x{r.slow_host:.2f}, "
            f"copy x{r.slow_copy:.2f}")


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
    if trace.startswith("file:"):  # replay: step and layer modulo the file's, its rows tiled over the batch
        ft = args.trace_ids
        s_i = np.arange(steps) % ft.shape[0]
        l_i = np.arange(L) % ft.shape[1]
        b_i = np.arange(batch) % ft.shape[2]
        return ft[s_i][:, l_i][:, :, b_i]
    if trace == "uniform":
        return traces.uniform_trace(steps, L, E, k, batch=batch, seed=args.seed)
    if kind == "prefill":  # popularity skew only: temporal locality has no meaning inside one prompt
        return traces.skewed_trace(steps, L, E, k, batch=batch, zipf_s=args.zipf_s, sticky_p=0.0, seed=args.seed)
    return traces.skewed_trace(steps, L, E, k, batch=batch, zipf_s=args.zipf_s, sticky_p=args.sticky_p,
                               seed=args.seed)


def run_steps(var: Variant, ctx: Ctx, trace: np.ndarray, x0: torch.Tensor, rw: torch.Tensor, first: int, n: int,
              sync) -> tuple[float, torch.Tensor]:
    """Run steps [first, first + n) of ``trace``; returns (seconds, output of the last step).

    ``rw``: route weights [T, k] for every layer, or [steps, L, T, k] (a trace file's weights). A variant
    with ``forward`` (hybrid, host-only) runs the whole layer; its host time in the call is its delivery."""
    sync()
    t0 = time.perf_counter()
    y = x0
    fwd = getattr(var, "forward", None)
    for s in range(first, first + n):
        x = x0
        for li in range(len(ctx.layers)):
            ids = trace[s, li]
            rwl = rw if rw.dim() == 2 else rw[s, li]
            t1 = time.perf_counter()
            if fwd is not None:
                y = fwd(li, x, ids, rwl)
                var.deliver_s += time.perf_counter() - t1
            else:
                w, slot_ids = var.layer(li, ids)
                var.deliver_s += time.perf_counter() - t1
                y = mk.moe_forward(x, slot_ids, rwl, w, impl=ctx.impl)
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
                why = var.skip(wl, kind) if hasattr(var, "skip") else None
                if why:
                    row["skipped"] = why
                    rows.append(row)
                    print(_fmt_row(row), flush=True)
                    continue
                tr = make_traces(args, shp, batch, kind, trace_kind, steps_total + warm_steps)
                g = torch.Generator().manual_seed(args.seed + batch)
                x0 = torch.randn(batch, ctx.hidden, generator=g).to(dtype).to(dev)
                rw = torch.softmax(torch.randn(batch, shp["top_k"], generator=g), -1).to(dev)
                if trace_kind.startswith("file:") and args.trace_weights is not None:
                    fw = args.trace_weights
                    n_s = tr.shape[0]
                    rw = torch.from_numpy(np.ascontiguousarray(
                        fw[np.arange(n_s) % fw.shape[0]][:, np.arange(len(ctx.layers)) % fw.shape[1]][
                            :, :, np.arange(batch) % fw.shape[2]])).to(dev)
                if hasattr(var, "prepare"):
                    var.prepare(batch, kind)
                var.begin()
                if warm_steps:
                    _, y_first = run_steps(var, ctx, tr, x0, rw, 0, 1, sync)  # compile + warm caches
                if hasattr(var, "after_warm"):
                    var.after_warm()
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
                if hasattr(var, "row_extra"):
                    row.update(var.row_extra(done, (trace_kind, wl)))
                if getattr(var, "host_semantics", False) or hasattr(var, "forward"):
                    # the host kernel computes the Marlin layout's function, the harness's GPU kernel the
                    # GPTQ reinterpretation of the same bytes (moe_kernel.py): outputs are not comparable
                    # here (tests/test_hybrid.py checks hybrid == all-GPU on one semantics)
                    pass
                elif not var.cold:
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


def tokens_per_s(rows: list[dict], variant: str, trace: str, wl: str) -> float | None:
    """The tokens/s of the first row of ``variant`` x ``trace`` x workload ``wl`` that has one (None: no such row)."""
    for r in rows:
        if r["variant"] == variant and r["trace"] == trace and r["workload"] == wl and "tokens_per_s" in r:
            return r["tokens_per_s"]
    return None


def decode_bars(rows: list[dict], variant: str) -> list[dict]:
    """The decode bars of ``variant``: its decode-1 and decode-8 tokens/s over uva's, >= 1.0 on the uniform
    trace and >= 1.5 on the skewed one (value None where a row is missing)."""
    out = []
    for trace, need in (("uniform", 1.0), ("skewed", 1.5)):
        for wl in ("decode-1", "decode-8"):
            a, b = tokens_per_s(rows, variant, trace, wl), tokens_per_s(rows, "uva", trace, wl)
            out.append(dict(bar=f"{wl} {trace}: {variant} / uva >= {need}", value=(a / b) if a and b else None,
                            need=need))
    return out


def bars(rows: list[dict]) -> list[dict]:
    """The issue's bars as ratios of this run."""
    tps = functools.partial(tokens_per_s, rows)
    out = decode_bars(rows, "mmap-cache")
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


def hybrid_bars(rows: list[dict]) -> list[dict]:
    """Issue 15's bars for mmap-hybrid (ratios of this run): decode 1 and 8 against uva, prefill against
    the best copy variant, pinned bytes."""
    tps = functools.partial(tokens_per_s, rows)
    if not any(r["variant"] == "mmap-hybrid" for r in rows):
        return []
    out = decode_bars(rows, "mmap-hybrid")
    for trace in ("uniform", "skewed"):
        best = max([v for v in (tps(n, trace, "prefill-2k") for n in ("mmap-cache", "mmap-prefetch", "kvikio-cache"))
                    if v] or [0])
        a = tps("mmap-hybrid", trace, "prefill-2k")
        if a or best:
            out.append(dict(bar=f"prefill-2k {trace}: mmap-hybrid / best copy variant >= 1.0",
                            value=(a / best) if a and best else None, need=1.0))
    pinned = [r["pinned_bytes"] for r in rows if r["variant"] == "mmap-hybrid" and "pinned_bytes" in r]
    if pinned:
        out.append(dict(bar="pinned: mmap-hybrid <= 0.5 GiB", value=max(pinned) / 2**30, need=0.5, lower_is_better=True))
    for trace in ("uniform", "skewed"):
        for wl in ("decode-1", "decode-8"):
            a, b = tps("host-only", trace, wl), tps("uva", trace, wl)
            if a and b:
                out.append(dict(bar=f"{wl} {trace}: host-only / uva (reported)", value=a / b, need=None))
    for b_ in out:
        if b_["need"] is not None and b_["value"] is not None:
            b_["ok"] = b_["value"] <= b_["need"] if b_.get("lower_is_better") else b_["value"] >= b_["need"]
    return out


def _rates_from(d: dict):
    from mmap_offload.host import hybrid

    return hybrid.Rates.from_dict(d)


def hybrid_model(meta: dict, rows: list[dict], variants: list[dict]) -> dict | None:
    """Decode step times from the cost model, on this machine (to check the model against the
    measured rows) and on a PCIe Gen4 machine (``--model-h2d-gbps``, ``--model-cores``): the misses of
    each layer call recorded in the mmap-hybrid run, re-planned with the other machine's rates. A model,
    labelled as such: the forward's own time is the vram row's step time on this machine; uva's
    step = that + its modelled PCIe bytes at (the other link x this run's UVA-read / H2D ratio); the
    host rates are this machine's at the same thread counts (the other host's DRAM bandwidth assumed
    equal, shared by ``--model-ranks`` ranks)."""
    from mmap_offload.host import hybrid

    hv = next((v for v in variants if v.get("variant") == "mmap-hybrid" and "notes" in v
               and "rates" in v["notes"]), None)
    if hv is None:
        return None
    rates = _rates_from(hv["notes"]["rates"])
    args = meta.get("args", {})
    h2d = meta.get("tuning", {}).get("pinned_h2d_gbps")
    kern = [c for c in meta.get("tuning", {}).get("kernel", {}).get("candidates", []) if "gbps" in c]
    uva_gbps = max([c["gbps"] for c in kern] or [0]) or (0.88 * h2d if h2d else None)
    g_h2d = float(args.get("model_h2d_gbps", 25.0))
    ranks = max(1, int(args.get("model_ranks", 2)))
    gen4 = hybrid.pcie_model_rates(rates, g_h2d, h2d, int(args.get("model_cores", 32)),
                                   label=f"model: PCIe {g_h2d:.0f} GB/s H2D")
    if ranks > 1:  # ranks share the host's DRAM: each gets 1/ranks of the host rate
        gen4.host_base_s = {t: v * ranks for t, v in gen4.host_base_s.items()}
        gen4.host_row_s = {t: v * ranks for t, v in gen4.host_row_s.items()}
    uva_ratio = (uva_gbps / h2d) if (uva_gbps and h2d) else 0.88

    def row(variant, trace, wl):
        return next((r for r in rows if r["variant"] == variant and r["trace"] == trace and r["workload"] == wl
                     and "tokens_per_s" in r), None)

    L = len(meta.get("layers", [])) or int(meta["shapes"]["layers"])
    out = []
    for key, calls in hv["notes"].get("calls", {}).items():
        trace, wl = key.split("/", 1)
        hyb, uva, vram = row("mmap-hybrid", trace, wl), row("uva", trace, wl), row("vram", trace, wl)
        if not calls or hyb is None or hyb.get("kind") != "decode":
            continue
        steps = len(calls) / L
        batch = hyb["batch"]
        fwd_s = (vram["step_ms"] / 1e3) if vram else 0.0

        def plan_s(r_):
            pl = hybrid.Planner(r_)
            return sum(pl.plan(np.asarray(m)).est_s for _, _, m in calls) / steps

        def copy_s(r_):
            return sum(r_.copy_s(len(m), False) + (r_.gpu_call_s if len(m) else 0.0) for _, _, m in calls) / steps

        d = dict(trace=trace, workload=wl, batch=batch, fwd_ms=1e3 * fwd_s,
                 measured_hybrid=hyb["tokens_per_s"], measured_uva=uva["tokens_per_s"] if uva else None)
        d["model_hybrid_here"] = batch / (fwd_s + plan_s(rates))
        d["model_hybrid_gen4"] = batch / (fwd_s + plan_s(gen4))
        d["model_copy_gen4"] = batch / (fwd_s + copy_s(gen4))
        if uva:
            pcie = uva["pcie_bytes_per_step"]
            d["model_uva_here"] = batch / (fwd_s + pcie / (uva_ratio * h2d * 1e9)) if h2d else None
            d["model_uva_gen4"] = batch / (fwd_s + pcie / (uva_ratio * g_h2d * 1e9))
        out.append(d)
    return dict(rates_here=rates.to_dict(), rates_gen4=gen4.to_dict(), uva_read_over_h2d=uva_ratio,
                ranks=ranks, rows=out, forward_from_vram=any(r["variant"] == "vram" for r in rows))


def hybrid_lines(meta: dict, rows: list[dict], variants: list[dict], model: dict | None) -> list[str]:
    """The Hybrid section of results.md: rates, crossover, the split per row, the PCIe Gen4 model."""
    hv = next((v for v in variants if v.get("variant") == "mmap-hybrid" and "rates" in v.get("notes", {})), None)
    lines = []
    if hv is not None:
        r = _rates_from(hv["notes"]["rates"])
        lines += ["", "## Hybrid (mmap-hybrid)", "",
                  f"Host kernel: {hv['notes'].get('host_kernel')}; populate: {hv['notes'].get('populate')}.  ",
                  f"Calibrated at start ({hv['notes']['rates']['notes'].get('seconds', 0):.1f} s): {describe_rates(r)}.  ",
                  f"Copy paths chosen per batch: {hv['notes'].get('modes')}", "",
                  f"Crossover (cost model on uniform routing, {100 * hv['notes'].get('resident_frac', 0.25):.0f}% of experts "
                  "resident; host = misses computed on the host):", "",
                  "| tokens/step | rows/expert | routed | misses | host | copied | est ms/layer | copy-all ms/layer |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for c in hv["notes"].get("crossover", []):
            lines.append(f"| {c['tokens']} | {c['rows_per_expert']:.1f} | {c['routed']:.1f} | {c['misses']:.1f} | "
                         f"{c['host']:.1f} | {c['copied']:.1f} | {c['est_ms']:.2f} | {c['copy_all_ms']:.2f} |")
    split = [r for r in rows if r["variant"] in ("mmap-hybrid", "host-only") and "tokens_per_s" in r]
    if split:
        lines += ["", "| variant | trace | workload | mode | hits/step | copied/step | host experts/step | host MiB/step | "
                  "host compute ms/step | host wait ms/step |", "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in split:
            lines.append(f"| {r['variant']} | {r['trace']} | {r['workload']} | {r.get('mode', 'host')} | "
                         f"{r.get('hit_experts_per_step', 0):.1f} | {r.get('copied_experts_per_step', 0):.1f} | "
                         f"{r.get('host_experts_per_step', 0):.1f} | {r.get('host_bytes_per_step', 0) / 2**20:.1f} | "
                         f"{r.get('host_compute_ms', 0):.2f} | {r.get('host_wait_ms', 0):.2f} |")
    if model and model["rows"]:
        g = model["rates_gen4"]
        lines += ["", f"**Model, not a measurement**: the same split on a PCIe Gen4 machine "
                  f"({g['notes']['h2d_gbps']:.0f} GB/s H2D; copies at {g['copy_gbps']:.1f} GB/s; host rates as measured "
                  f"here, shared by {model['ranks']} TP ranks; UVA reads at {model['uva_read_over_h2d']:.2f} x H2D as here; "
                  f"forward time from the vram rows{'' if model['forward_from_vram'] else ' (no vram row: 0)'}). "
                  "The 'model here' columns apply the same model to this machine, next to what was measured.", "",
                  "| trace | workload | measured hybrid / uva | model here: hybrid / uva | Gen4 model: uva tok/s | "
                  "Gen4 model: copy-only tok/s | Gen4 model: hybrid tok/s | Gen4 model: hybrid / uva |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for d in model["rows"]:
            mu, mh = d.get("measured_uva"), d["measured_hybrid"]
            here = (d["model_hybrid_here"] / d["model_uva_here"]) if d.get("model_uva_here") else None
            gu = d.get("model_uva_gen4")

            def f(v, p=2):
                return "n/a" if v is None else f"{v:.{p}f}"

            lines.append(f"| {d['trace']} | {d['workload']} | {f(mh / mu if mu else None)} | {f(here)} | {f(gu, 1)} | "
                         f"{d['model_copy_gen4']:.1f} | {d['model_hybrid_gen4']:.1f} | "
                         f"{f(d['model_hybrid_gen4'] / gu if gu else None)} |")
    return lines


def write_report(out: Path, meta: dict, rows: list[dict], variants: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    bar_rows = bars(rows) + hybrid_bars(rows)
    try:
        model = hybrid_model(meta, rows, variants)
    except Exception as exc:  # the model is derived; the rows are the record
        model = None
        print(f"hybrid model skipped: {type(exc).__name__}: {exc}")
    (out / "results.json").write_text(json.dumps(dict(meta=meta, rows=rows, variants=variants, bars=bar_rows,
                                                      hybrid_model=model), indent=1, default=str))
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
    lines += ["", "mmap-cache and mmap-hybrid are the library's synchronous Python paths; the vLLM backend's path (the "
              "step on the stream) at these shapes: `bench_vllm.py --shapes harness`.", "",
              "| bar | value | need | ok |", "| --- | ---: | ---: | --- |"]
    for b in bar_rows:
        v = "n/a" if b["value"] is None else f"{b['value']:.2f}"
        lines.append(f"| {b['bar']} | {v} | {b['need'] if b['need'] is not None else ''} | {b.get('ok', '')} |")
    lines += hybrid_lines(meta, rows, variants, model)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    if meta.get("args", {}).get("no_plots"):
        return
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
    p.add_argument("--traces", default=None, help="uniform,skewed (default; only the file's with --trace)")
    p.add_argument("--trace", default=None, help="replay a routing trace CSV (step,layer,expert ids[,weights])")
    p.add_argument("--host-threads", type=int, default=0,
                   help="host compute threads when nothing is copied (default: the cores this process may use, "
                        "less one on CUDA for the thread launching GPU work); "
                        "beside copies: this minus --engine-threads")
    p.add_argument("--host-kernel", choices=("auto", "native", "torch"), default="auto")
    p.add_argument("--host-max-rows", type=int, default=64, help="experts with more token rows stay on the GPU")
    p.add_argument("--host-prefill", action="store_true", help="run host-only at prefill too (slow)")
    p.add_argument("--host-one-pool", action="store_true",
                   help="mmap-hybrid: one host pool of --host-threads - --engine-threads threads, also when nothing "
                        "is copied (default: a second pool of --host-threads for layers computed wholly on the host)")
    p.add_argument("--model-h2d-gbps", type=float, default=25.0,
                   help="the modelled machine's H2D (PCIe Gen4 x16 ~25 GB/s: the user's 2x RTX 3090)")
    p.add_argument("--model-cores", type=int, default=32)
    p.add_argument("--model-ranks", type=int, default=2, help="TP ranks sharing the modelled host (2x RTX 3090: 2)")
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
    p.add_argument("--no-plots", action="store_true", help="results.json + results.md only (fewer files)")
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
    args.trace_ids = args.trace_weights = None
    if args.trace:  # before the (long) set-up: a bad file is one line, at once
        from mmap_offload import traces as traces_mod
        from mmap_offload.errors import MmapOffloadError

        try:
            args.trace_ids, args.trace_weights = traces_mod.read_csv(args.trace, with_weights=True)
            traces_mod.check_trace(args.trace_ids, shp["experts"], shp["top_k"], f"routing trace {args.trace}")
        except MmapOffloadError as exc:
            print(f"bench_moe: {exc}", file=sys.stderr)
            return 2
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
              pinned_ring=args.pinned_ring_mib << 20, group=shp["group"], top_k=shp["top_k"],
              host=dict(threads=args.host_threads, kernel=args.host_kernel, max_rows=args.host_max_rows,
                        prefill=args.host_prefill, one_pool=args.host_one_pool))
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
    trace_kinds = [t for t in (args.traces or ("" if args.trace else "uniform,skewed")).split(",") if t]
    if args.trace:
        trace_kinds.append("file:" + Path(args.trace).stem)
        meta["trace_file"] = dict(path=str(args.trace), shape=list(args.trace_ids.shape),
                                  weights=args.trace_weights is not None)
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
    if name == "mmap-hybrid":
        return HybridVariant(ctx, engine_kind="mmap")
    if name == "host-only":
        return HostOnlyVariant(ctx)
    parts = name.split("-")
    if len(parts) in (2, 3) and parts[0] in ("mmap", "pread", "kvikio") and parts[1] in ("cache", "prefetch"):
        cold = len(parts) == 3 and parts[2] == "cold"
        cls = CacheVariant if parts[1] == "cache" else PrefetchVariant
        return cls(ctx, engine_kind=parts[0], cold=cold)
    return None


if __name__ == "__main__":
    sys.exit(main())
