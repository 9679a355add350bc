"""Hybrid MoE execution per layer: hits on the GPU, misses split between host compute and the copy path.

At decode a layer's misses are known only after its router ran. Copying them moves every missed byte
through DRAM three times (page cache -> pinned ring by the CPU, ring -> GPU by DMA); the host can
instead compute a missed expert where its bytes already are (the mapped cache, Marlin words as
stored) and send back only the few output rows. Per layer (``HybridMoE.forward``)::

    routed experts -> hits (resident in the ExpertCache) + misses
    plan            misses -> host set + copy set, chosen by the calibrated cost model so that the host
                    job and the copy + GPU kernel finish together (``Planner``)
    host job        x of the host-routed tokens down (pinned), one GIL-free ``experts_mlp`` call in a
                    thread, its rows back up and summed on the device
    hits first      one GPU call on the hits (route weights of other pairs masked to 0), launched before
                    the copies are submitted
    copies          ``ExpertCache.ensure(hits + copy set)``, then one GPU call on the copied misses

The cost model is ``cost.py``'s (``CostModel``: the same one vLLM's ``HostExperts`` uses): the host
side calibrated at start on experts not in the CPU caches (``cost.calibrate_host``), the copy side,
the GPU call, activations and the slow-down of each side while both run measured by ``calibrate``
here; every host job and every batch of copies then updates it (``observe_host``, ``observe_copy``).
``Planner`` adds popularity (popular misses are copied so that they become resident) and admission.
With no copies at all the host job runs with every thread (``threads_all``), else with
``threads_split`` (the copy engine has the rest).

The host kernel is ``host.kernel.HostKernel`` (native, Marlin words read in place) when it is built;
``TorchHostKernel`` here is a slow stand-in with the same contract (dequantise + matmul), selectable
with ``make_host_kernel("torch")``, so that everything runs and is tested on CPU either way.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch

from ..cpus import core_count
from .cost import (EXPERT_TENSORS, CostModel, Plan, Rates, calibrate_host, crossover_table,  # noqa: F401 (API)
                   expected_distinct, pcie_model_rates)

__all__ = [
    "TorchHostKernel", "make_host_kernel", "populate", "populate_range", "Rates", "Plan", "Planner", "CostModel",
    "HybridMoE", "calibrate", "crossover_table", "pcie_model_rates", "expected_distinct",
]

# ---------------------------------------------------------------------------------------------
# Host kernels: the native one, or a torch stand-in with the same contract
# ---------------------------------------------------------------------------------------------

from .kernel import dequantize_marlin  # the torch reference of the Marlin layout (fp32 [K, N])


class TorchHostKernel:
    """Slow stand-in for ``host.kernel.HostKernel`` (same contract): dequantise + fp32 matmul.

    ``memo`` keeps dequantised experts by data pointer (tests and toy sizes only: 8x the bytes)."""

    isa = "torch"

    def __init__(self, threads: int = 0, isa: str = "auto", memo: bool = False):
        self.threads = int(threads) or torch.get_num_threads()
        self._memo: dict | None = {} if memo else None

    def _deq(self, words, scales, K, N, group, which):
        key = (words.data_ptr(), scales.data_ptr(), K, N)
        if self._memo is not None and key in self._memo:
            return self._memo[key]
        # vLLM's scale permutation: w13 grouped whenever group > 0 (size_k = 4 I), w2 iff 0 < group < K
        grouped = group > 0 if which == "w13" else 0 < group < K
        w = dequantize_marlin(words, scales, K, N, group, grouped_perm=grouped)
        if self._memo is not None:
            self._memo[key] = w
        return w

    def expert_mlp(self, x, w13, s13, w2, s2, *, group, out=None, accumulate_weight=None):
        H = x.shape[1]
        I2 = w13.shape[1] // 2  # 2 I_r columns of w13
        I = I2 // 2
        W13 = self._deq(w13, s13, H, I2, group, "w13")
        h = x.float() @ W13
        a = torch.nn.functional.silu(h[:, :I]) * h[:, I:]
        a = a.to(x.dtype).float()  # the kernel feeds w2 activations in the model's dtype
        W2 = self._deq(w2, s2, I, H, group, "w2")
        y = a @ W2
        if accumulate_weight is not None:
            wt = torch.as_tensor(accumulate_weight, dtype=torch.float32).reshape(-1, 1)
            if out is None:
                raise ValueError("accumulate_weight needs out")
            out += (y * wt).to(out.dtype)
            return out
        if out is not None:
            out.copy_(y)
            return out
        return y.to(x.dtype)

    def experts_mlp(self, x, jobs, out) -> None:
        for rows, w13, s13, w2, s2, group, weights in jobs:
            r = torch.as_tensor(rows, dtype=torch.int64)
            y = self.expert_mlp(x[r], w13, s13, w2, s2, group=group)
            wt = torch.as_tensor(weights, dtype=torch.float32).reshape(-1, 1)
            out.index_add_(0, r, (y.float() * wt).to(out.dtype))


def make_host_kernel(impl: str = "auto", threads: int = 0, memo: bool = False):
    """(kernel, name): ``impl`` "native" (host.kernel.HostKernel), "torch" (the stand-in) or "auto"
    (native when it imports and builds, else the stand-in)."""
    if impl not in ("auto", "native", "torch"):
        raise ValueError(f"host kernel {impl!r} is not one of auto, native, torch")
    if impl in ("auto", "native"):
        try:
            from .kernel import HostKernel

            k = HostKernel(threads=threads)
            return k, f"native ({getattr(k, 'isa', '?')}, {getattr(k, 'threads', threads)} threads)"
        except Exception as exc:
            if impl == "native":
                raise
            why = f"{type(exc).__name__}: {exc}"[:120]
            k = TorchHostKernel(threads=threads, memo=memo)
            return k, f"torch stand-in (native unavailable: {why})"
    return TorchHostKernel(threads=threads, memo=memo), "torch stand-in"


# ---------------------------------------------------------------------------------------------
# Mappings: keep them populated (a warm file reads ~1.7x faster once its page tables exist)
# ---------------------------------------------------------------------------------------------

_MADV_POPULATE_READ = 22  # Linux 5.14+


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def populate_range(arr: np.ndarray) -> bool:
    """Page tables for the pages of ``arr`` (a view of a mapping): ``madvise(MADV_POPULATE_READ)``
    (one call, no fault per page), else a read of one byte per page. True if madvise did it. The
    call releases the GIL (ctypes)."""
    n = int(arr.nbytes)
    if not n:
        return True
    if _LIBC is not None:
        addr = arr.ctypes.data
        lo = addr & ~4095
        if _LIBC.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(n + addr - lo), _MADV_POPULATE_READ) == 0:
            return True
    int(arr.reshape(-1).view(np.uint8)[::4096].sum())  # touch every page once
    return False


def populate(cache, layers: Sequence[int] | None = None, experts: Sequence[int] | None = None) -> dict:
    """Set up the page tables of ``cache``'s own read mappings (``cache.tensor`` views) for ``layers``
    (every one by default), whole, or only ``experts`` of them (``populate_range``). Returns bytes and
    seconds."""
    t0 = time.perf_counter()
    done = 0
    for layer in (cache.layers if layers is None else layers):
        if experts is None:
            arr = cache.layer_buffer(layer)
            populate_range(arr)
            done += int(arr.nbytes)
            continue
        for e in experts:
            arr = cache.expert_buffer(layer, int(e))
            populate_range(arr)
            done += int(arr.nbytes)
    return dict(bytes=done, seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Cost model: cost.py (one model for this executor and vLLM's HostExperts); popularity and admission here
# ---------------------------------------------------------------------------------------------


class Planner:
    """Popularity and admission around the cost model's split (``cost.CostModel.plan``).

    Admission: a miss computed on the host never enters the VRAM cache, so a planner that sends every
    miss to the host would leave the cache cold forever. ``admit`` returns the misses that are copied
    whatever the rates: while the pool has free slots, the most popular misses (up to the free count);
    after that, a miss whose decayed use count is ``admit_factor`` x the median of the layer's resident
    experts' (and >= ``admit_min``): under skewed routing the hot experts become resident, under uniform
    routing (no expert much hotter than the resident ones) nothing is forced."""

    def __init__(self, rates: "Rates | CostModel", half_life_calls: float = 512.0, admit_factor: float = 2.0,
                 admit_min: float = 3.0):
        self.model = rates if isinstance(rates, CostModel) else CostModel(rates)
        self.admit_factor = admit_factor
        self.admit_min = admit_min
        self._count: dict = {}  # layer -> [E] decayed counts at time _last[layer]
        self._last: dict = {}  # layer -> [E] call number of the count
        self._now = 0
        self._lam = math.log(2.0) / max(half_life_calls, 1e-9)

    def _arrays(self, layer: int, n: int):
        c = self._count.get(layer)
        if c is None or c.size < n:  # grow, keeping what was counted
            m = max(n, 64, 0 if c is None else 2 * c.size)
            c2, l2 = np.zeros(m), np.zeros(m)
            if c is not None:
                c2[: c.size], l2[: c.size] = c, self._last[layer]
            c = self._count[layer] = c2
            self._last[layer] = l2
        return c, self._last[layer]

    def note_routed(self, layer: int, experts: np.ndarray) -> None:
        """Count a layer's routed experts (decayed), so popular misses are copied, rare ones computed."""
        self._now += 1
        experts = np.asarray(experts, dtype=np.int64)
        if not experts.size:
            return
        c, last = self._arrays(layer, int(experts.max()) + 1)
        c[experts] = c[experts] * np.exp(-self._lam * (self._now - last[experts])) + 1.0
        last[experts] = self._now

    def popularity(self, layer: int, experts: np.ndarray) -> np.ndarray:
        experts = np.asarray(experts, dtype=np.int64)
        if not experts.size:
            return np.zeros(0)
        c, last = self._arrays(layer, int(experts.max()) + 1)
        return c[experts] * np.exp(-self._lam * (self._now - last[experts]))

    def admit(self, layer: int, misses: np.ndarray, resident: np.ndarray, free_slots: int) -> np.ndarray:
        """bool mask over ``misses``: copied whatever the rates (see the class docstring)."""
        pop = self.popularity(layer, misses)
        forced = np.zeros(misses.size, dtype=bool)
        if free_slots > 0 and misses.size:
            forced[np.argsort(-pop, kind="stable")[:free_slots]] = True
        if resident.size and misses.size:
            bar = max(self.admit_min, self.admit_factor * float(np.median(self.popularity(layer, resident))))
            forced |= pop >= bar
        return forced

    @property
    def rates(self) -> Rates:
        return self.model.rates

    def plan(self, miss_rows: np.ndarray, popularity: np.ndarray | None = None,
             host_allowed: bool = True, hits: int = 0, forced_copy: np.ndarray | None = None) -> Plan:
        """The cost model's split (``cost.CostModel.plan``)."""
        return self.model.plan(miss_rows, popularity, host_allowed=host_allowed, hits=hits, forced_copy=forced_copy)


# ---------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------

GpuForward = Callable[[int, torch.Tensor, np.ndarray, torch.Tensor], torch.Tensor]
"""``gpu_forward(layer, x, slot_ids [T, k] host ints, route_w [T, k] on the device) -> [T, H]``: one
MoE call over the ExpertCache's slots of ``layer`` (pairs with weight 0 contribute nothing)."""


class HybridMoE:
    """Hybrid execution of one model's MoE layers over an ``ExpertCache`` (module docstring).

    ``kernels``: {threads: host kernel} (one per thread count the planner may choose); ``cache``: the
    ``cache_reader.Cache`` whose mapped bytes the host reads; ``gpu_forward``: see ``GpuForward``.
    ``host_allowed=False`` turns it into the plain expert cache (every miss copied)."""

    def __init__(self, cache, expert_cache, kernels: dict, planner: Planner, gpu_forward: GpuForward,
                 device, *, group: int, record: bool = False):
        self.cache = cache
        self.ec = expert_cache
        self.kernels = kernels
        self.planner = planner
        self.gpu_forward = gpu_forward
        self.device = torch.device(device)
        self.group = int(group)
        self.host_allowed = True
        self._maps = [expert_cache.slot_map(l) for l in expert_cache.layers]  # live views, one per layer
        n_pools = expert_cache.capacity_bytes // max(1, expert_cache.slots_per_pool * expert_cache.expert_nbytes)
        self._shared = n_pools == 1 and len(self._maps) > 1
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmap-offload-hybrid")
        self._views: dict = {}
        self._xbuf: torch.Tensor | None = None
        self._obuf: torch.Tensor | None = None
        self.record = record
        self.calls: list = []  # per call when recording: (tokens, hits, miss_rows)
        self.metrics = dict(calls=0, hits=0, misses=0, host_experts=0, copied_experts=0, host_s=0.0,
                            host_wait_s=0.0, plan_s=0.0, ensure_s=0.0)

    def _free(self, smap: np.ndarray) -> int:
        """Free slots of the pool serving the layer of ``smap`` (shared pool: over all layers)."""
        if self._shared:
            return self.ec.slots_per_pool - sum(int((m >= 0).sum()) for m in self._maps)
        return self.ec.slots_per_pool - int((smap >= 0).sum())

    def _expert(self, layer: int, e: int):
        v = self._views.get((layer, e))
        if v is None:
            c = self.cache
            v = self._views[(layer, e)] = tuple(c.tensor(layer, e, n) for n in (
                "w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"))
        return v

    def _buffers(self, t: int, h: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._xbuf is None or self._xbuf.shape[0] < t or self._xbuf.dtype != dtype or self._xbuf.shape[1] != h:
            pin = self.device.type == "cuda"
            n = max(t, 64)
            self._xbuf = torch.empty((n, h), dtype=dtype, pin_memory=pin)
            self._obuf = torch.empty((n, h), dtype=dtype, pin_memory=pin)
        return self._xbuf[:t], self._obuf[:t]

    def _host_job(self, kernel, x, jobs, out):
        t0 = time.perf_counter()
        out.zero_()
        kernel.experts_mlp(x, jobs, out)
        return time.perf_counter() - t0

    def _masked(self, ids: np.ndarray, route_w: torch.Tensor, keep: np.ndarray, slot_of: np.ndarray):
        """slot ids and route weights for the pairs whose expert is in ``keep`` (others: weight 0 and a
        slot already read by this call, so no extra expert bytes are read)."""
        mask = keep[ids]
        slot_ids = slot_of[ids]
        if mask.all():  # every pair runs here: weights as they are
            return slot_ids, route_w
        slot_ids[~mask] = slot_of[ids[mask][0]] if mask.any() else 0
        m = torch.from_numpy(mask.astype(np.float32))
        if route_w.device.type == "cuda":
            m = m.pin_memory().to(route_w.device, non_blocking=True)
        return slot_ids, route_w * m.to(route_w.dtype)

    def forward(self, layer: int, x: torch.Tensor, ids, route_w: torch.Tensor) -> torch.Tensor:
        """One MoE layer: x [T, H] on the device, ids [T, k] host ints, route_w [T, k] -> [T, H] (x's dtype)."""
        t0 = time.perf_counter()
        ids = np.asarray(ids, dtype=np.int64)
        T, _ = ids.shape
        E = self.ec.num_experts
        uniq, counts = np.unique(ids, return_counts=True)
        smap = self.ec.slot_map(layer)
        resident = smap[uniq] >= 0
        hits, misses, miss_rows = uniq[resident], uniq[~resident], counts[~resident]
        pl = self.planner
        pop = pl.popularity(layer, misses)
        forced = None
        if self.host_allowed and misses.size:
            forced = pl.admit(layer, misses, np.flatnonzero(smap >= 0), self._free(smap))
        pl.note_routed(layer, uniq)
        plan = pl.plan(miss_rows, pop, host_allowed=self.host_allowed, hits=hits.size, forced_copy=forced)
        host_e, copy_e = misses[plan.host], misses[plan.copy]
        m = self.metrics
        m["calls"] += 1
        m["hits"] += hits.size
        m["misses"] += misses.size
        m["host_experts"] += host_e.size
        m["copied_experts"] += copy_e.size
        if self.record:
            self.calls.append((T, int(hits.size), miss_rows.copy()))
        t1 = time.perf_counter()
        m["plan_s"] += t1 - t0

        fut = None
        if host_e.size:
            xh, oh = self._buffers(T, x.shape[1], x.dtype)
            xh.copy_(x)  # waits for the previous layer on the device: the host needs its output
            rw_h = route_w.float().cpu().numpy().reshape(-1)  # one small copy (the device is idle here anyway)
            flat = ids.reshape(-1)
            order = np.argsort(flat, kind="stable")  # pairs grouped by expert
            fs = flat[order]
            lo, hi = np.searchsorted(fs, host_e), np.searchsorted(fs, host_e, side="right")
            k_ = ids.shape[1]
            jobs = []
            for e, a, b in zip(host_e.tolist(), lo.tolist(), hi.tolist()):
                pairs = order[a:b]
                jobs.append((torch.from_numpy(pairs // k_), *self._expert(layer, e), self.group,
                             torch.from_numpy(rw_h[pairs])))
            fut = self._pool.submit(self._host_job, self.kernels[plan.threads], xh, jobs, oh)

        y = None
        slot_of = smap.copy()
        if hits.size and copy_e.size:  # hits first: they need no copy
            keep = np.zeros(E, dtype=bool)
            keep[hits] = True
            sid, rw = self._masked(ids, route_w, keep, slot_of)
            y = self.gpu_forward(layer, x, sid, rw)
        gpu_e = np.concatenate([hits, copy_e])
        if gpu_e.size:
            t2 = time.perf_counter()
            self.ec.ensure(layer, gpu_e)
            dt = time.perf_counter() - t2
            m["ensure_s"] += dt
            if copy_e.size:  # the model learns the link from every batch of copies
                pl.model.observe_copy(int(copy_e.size), dt, concurrent=fut is not None)
            slot_of = self.ec.slot_map(layer).copy()
            keep = np.zeros(E, dtype=bool)
            keep[copy_e if y is not None else gpu_e] = True
            sid, rw = self._masked(ids, route_w, keep, slot_of)
            y2 = self.gpu_forward(layer, x, sid, rw)
            y = y2 if y is None else y + y2
        if fut is not None:
            t3 = time.perf_counter()
            finished = fut.done()  # then its time may include waiting for the GIL after the kernel: a bound
            host_s = fut.result()
            m["host_s"] += host_s
            m["host_wait_s"] += time.perf_counter() - t3
            pl.model.observe_host(plan.threads, int(host_e.size), int(miss_rows[plan.host].sum()), host_s,
                                  concurrent=bool(copy_e.size), upper_bound=finished)
            up = oh.to(self.device, non_blocking=True) if self.device.type == "cuda" else oh
            y = up.to(x.dtype) if y is None else (y.float() + up.float()).to(x.dtype)
        if y is None:
            y = torch.zeros_like(x)
        return y

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._views.clear()


def host_forward(cache, kernel, layer: int, x: torch.Tensor, ids, route_w: torch.Tensor, group: int,
                 bufs: dict | None = None) -> torch.Tensor:
    """Every routed expert of ``layer`` on the host (the llama.cpp --cpu-moe / KTransformers way):
    x down, one ``experts_mlp`` call, rows up. ``bufs`` keeps pinned buffers between calls."""
    ids = np.asarray(ids, dtype=np.int64)
    T = ids.shape[0]
    dev = x.device
    bufs = {} if bufs is None else bufs
    xb = bufs.get("x")
    if xb is None or xb.shape[0] < T or xb.shape[1] != x.shape[1] or xb.dtype != x.dtype:
        pin = dev.type == "cuda"
        xb = bufs["x"] = torch.empty((max(T, 64), x.shape[1]), dtype=x.dtype, pin_memory=pin)
        bufs["o"] = torch.empty((max(T, 64), x.shape[1]), dtype=x.dtype, pin_memory=pin)
    xh, oh = xb[:T], bufs["o"][:T]
    xh.copy_(x)
    rw = route_w.float().cpu()
    jobs = []
    for e in np.unique(ids).tolist():
        r, c = np.nonzero(ids == e)
        v = tuple(cache.tensor(layer, e, n) for n in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed",
                                                       "w2_weight_scale"))
        jobs.append((torch.from_numpy(r), *v, group, rw[torch.from_numpy(r), torch.from_numpy(c)].contiguous()))
    oh.zero_()
    kernel.experts_mlp(xh, jobs, oh)
    return (oh.to(dev, non_blocking=True) if dev.type == "cuda" else oh).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------


def calibrate(cache, engine, device, kernels: dict, *, group: int, hidden: int, threads_split: int,
              threads_all: int, gpu_call: Callable[[], None] | None = None, dtype=torch.bfloat16,
              n_experts: int = 8, rows_hi: int = 16, reps: int = 3, max_host_rows: int = 64,
              time_budget_s: float = 20.0) -> Rates:
    """Measure the rates of ``Rates`` on this machine (a second or so at real sizes):

    host: ``cost.calibrate_host`` per kernel (thread count), on experts not in the CPU caches (fixed
    cost per call, per expert, per row); copy: the engine moving 1 and ``n_experts`` experts of the
    first layer into a device scratch buffer (freed); concurrent: the split kernel on ``n_experts``
    experts alone and while the engine copies (each side's slow-down); gpu_call: ``gpu_call()`` timed
    (it must synchronise); xfer: [16, H] down and up."""
    from ..transfer import Copy

    t_start = time.perf_counter()
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    layers = list(cache.layers)
    E = int(cache.num_experts)
    n = max(1, min(n_experts, E))
    rng = np.random.default_rng(0)
    specs = [s for s in cache.expert_specs]
    expert_bytes = sum(s.nbytes for s in specs)
    h_layer = layers[-1]
    ex = rng.choice(E, n, replace=False).tolist()
    cal = calibrate_host(cache, kernels, group=group, hidden=hidden, dtype=dtype, rows_hi=rows_hi,
                         budget_s=time_budget_s / 2)
    base, per_row, call = cal["base"], cal["row"], cal["call"]

    # copies through the engine, another layer (not in the host kernel's caches)
    c_layer = layers[0]
    scratch = {s.name: torch.empty((n, *s.shape), dtype=s.torch_dtype, device=dev) for s in specs}

    def copies(k):
        ids = rng.choice(E, k, replace=False).tolist()
        return [Copy(src=cache.expert_extent(c_layer, int(e)),
                     dst=[(s.offset, s.nbytes, scratch[s.name][j]) for s in specs], label=f"calibration expert {e}")
                for j, e in enumerate(ids)]

    def time_copy(k, reps_=reps):
        best = float("inf")
        engine.wait(engine.submit(copies(k)))  # pages mapped, ring warm
        sync()
        for _ in range(reps_):
            cs = copies(k)
            t0 = time.perf_counter()
            engine.wait(engine.submit(cs))
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    c1, cn = time_copy(1), time_copy(n)
    per = max(1e-9, (cn - c1) / max(1, n - 1)) if n > 1 else c1
    copy_bw = expert_bytes / per
    copy_lat = max(0.0, c1 - per)

    # both at once: the split kernel on the host while the engine copies n experts
    slow_host = slow_copy = 1.0
    ks = kernels.get(threads_split)
    if ks is not None and n > 1:
        x = torch.randn(1, hidden).to(dtype)
        out = torch.zeros(1, hidden, dtype=dtype)
        jobs = [(torch.arange(1), *(cache.tensor(h_layer, e, nm) for nm in EXPERT_TENSORS), group, torch.ones(1))
                for e in ex]
        res = {}
        alone = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            ks.experts_mlp(x, jobs, out)
            alone = min(alone, time.perf_counter() - t0)

        def host_side():
            t0 = time.perf_counter()
            ks.experts_mlp(x, jobs, out)
            res["host"] = time.perf_counter() - t0

        best_h, best_c = float("inf"), float("inf")
        for _ in range(reps):
            cs = copies(n)
            th_ = threading.Thread(target=host_side)
            t0 = time.perf_counter()
            th_.start()
            engine.wait(engine.submit(cs))
            sync()
            tc = time.perf_counter() - t0
            th_.join()
            best_h, best_c = min(best_h, res["host"]), min(best_c, tc)
        slow_host = max(1.0, best_h / alone)
        slow_copy = max(1.0, best_c / cn)
    del scratch

    gcall = 0.0
    if gpu_call is not None:
        gpu_call()
        sync()
        ts = []
        for _ in range(max(3, reps)):
            t0 = time.perf_counter()
            gpu_call()
            sync()
            ts.append(time.perf_counter() - t0)
        gcall = float(np.median(ts))

    xfer = 0.0
    if dev.type == "cuda":
        xd = torch.randn(16, hidden, device=dev).to(dtype)
        xh = torch.empty(16, hidden, dtype=dtype, pin_memory=True)
        oh = torch.empty(16, hidden, dtype=dtype, pin_memory=True)
        ts = []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            xh.copy_(xd)
            oh.to(dev, non_blocking=True)
            sync()
            ts.append(time.perf_counter() - t0)
        xfer = float(np.median(ts))
    return Rates(
        expert_bytes=expert_bytes, host_base_s=base, host_row_s=per_row, threads_split=threads_split,
        host_call_s=call, threads_all=threads_all, copy_bw=copy_bw, copy_lat_s=copy_lat, gpu_call_s=gcall,
        xfer_s=xfer, slow_host=slow_host, slow_copy=slow_copy, max_host_rows=max_host_rows,
        notes=dict(host=cal["notes"]["host"], calibration=cal["notes"], copy_1_s=c1, copy_n_s=cn, n_experts=n,
                   seconds=time.perf_counter() - t_start),
    )


def default_threads(engine_threads: int) -> tuple[int, int]:
    """(split, all): host threads beside a copy engine of ``engine_threads``, and all cores
    (physical: ``cpus.core_count``)."""
    cores = core_count()
    return max(1, cores - engine_threads), max(1, cores)
