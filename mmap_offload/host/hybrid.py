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

The cost model (``Rates``), calibrated at start by ``calibrate`` from measured rates, not constants:

    host_s(rows)   = base[threads] + per_row[threads] * rows      one expert on the host (GEMV: base is
                     its bytes / the kernel's GB/s at M = 1; per_row grows with M, the host has few FLOP/s)
    copy_s(n)      = copy_lat + n * expert_bytes / copy_bw         n experts through the copy engine
    gpu_call_s     one GPU MoE call at decode (launch + host work of the call; its bytes come from VRAM)
    xfer_s         activations down + results up (pinned, small)
    slow_host, slow_copy: each side's slow-down while both run at once (they share cores and DRAM)

``Planner.plan`` orders misses for the host by (rows ascending, popularity ascending: popular experts
are copied so that they become resident) and picks the host count n that minimises
``max(xfer + host_s(first n), copy_s(rest) + gpu_call)``; n = 0 is always a candidate, so when the host is
slower per expert than the link (prefill, large batches: per_row dominates) it copies everything. With
no copies at all the host job runs with every thread (``threads_all``), else with ``threads_split``
(the copy engine has the rest).

The host kernel is ``host.kernel.HostKernel`` (native, Marlin words read in place) when it is built;
``TorchHostKernel`` here is a slow stand-in with the same contract (dequantise + matmul), selectable
with ``make_host_kernel("torch")``, so that everything runs and is tested on CPU either way.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

__all__ = [
    "TorchHostKernel", "make_host_kernel", "populate", "Rates", "Plan", "Planner",
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


def populate(cache, layers: Sequence[int] | None = None) -> dict:
    """Set up the page tables of ``cache``'s own read mappings (``cache.tensor`` views) for ``layers``:
    ``madvise(MADV_POPULATE_READ)``, else a read of one byte per page. Returns bytes and seconds."""
    t0 = time.perf_counter()
    done = 0
    libc = None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        pass
    for layer in (cache.layers if layers is None else layers):
        arr = cache.layer_buffer(layer)
        n = int(arr.nbytes)
        ok = False
        if libc is not None and n:
            addr = arr.ctypes.data
            ok = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), _MADV_POPULATE_READ) == 0
        if not ok and n:
            int(arr[::4096].sum())  # touch every page once
        done += n
    return dict(bytes=done, seconds=time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# Cost model
# ---------------------------------------------------------------------------------------------


@dataclass
class Rates:
    """Calibrated rates of one machine (module docstring). Times in seconds, bandwidths in bytes/s."""

    expert_bytes: int
    host_base_s: dict  # threads -> seconds of one expert at 0 rows (its bytes / GB/s)
    host_row_s: dict  # threads -> seconds per extra row of one expert
    threads_split: int  # host threads while the copy engine runs
    threads_all: int  # host threads when everything goes to the host
    copy_bw: float  # bytes/s of expert copies through the engine (page cache -> ring -> GPU)
    copy_lat_s: float = 0.0  # fixed cost of one batch of copies (submit, first chunk)
    gpu_call_s: float = 0.0  # one GPU MoE call at decode
    xfer_s: float = 0.0  # activations down + rows up
    slow_host: float = 1.0  # host time x this while copies run
    slow_copy: float = 1.0  # copy time x this while the host computes
    max_host_rows: int = 64  # an expert with more rows than this is never sent to the host
    label: str = "measured"
    notes: dict = field(default_factory=dict)

    def host_gbps(self, threads: int) -> float:
        return self.expert_bytes / self.host_base_s[threads] / 1e9

    def host_s(self, rows: np.ndarray, threads: int, concurrent: bool) -> float:
        rows = np.asarray(rows, dtype=np.float64)
        t = rows.size * self.host_base_s[threads] + float(rows.sum()) * self.host_row_s[threads]
        return t * (self.slow_host if concurrent else 1.0)

    def copy_s(self, n: int, concurrent: bool) -> float:
        if n <= 0:
            return 0.0
        t = self.copy_lat_s + n * self.expert_bytes / self.copy_bw
        return t * (self.slow_copy if concurrent else 1.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["host_gbps"] = {t: self.host_gbps(t) for t in self.host_base_s}
        d["copy_gbps"] = self.copy_bw / 1e9
        return d


@dataclass
class Plan:
    host: np.ndarray  # indices into the misses given to plan(), computed on the host
    copy: np.ndarray  # indices copied
    threads: int  # host threads for this layer (0: no host job)
    est_s: float  # estimated time of the layer's delivery + compute beyond the hits
    est_host_s: float
    est_copy_s: float


class Planner:
    """Splits a layer's misses between host compute and the copy path (module docstring).

    Admission: a miss computed on the host never enters the VRAM cache, so a planner that sends every
    miss to the host would leave the cache cold forever. ``admit`` returns the misses that are copied
    whatever the rates: while the pool has free slots, the most popular misses (up to the free count);
    after that, a miss whose decayed use count is ``admit_factor`` x the median of the layer's resident
    experts' (and >= ``admit_min``): under skewed routing the hot experts become resident, under uniform
    routing (no expert much hotter than the resident ones) nothing is forced."""

    def __init__(self, rates: Rates, half_life_calls: float = 512.0, admit_factor: float = 2.0,
                 admit_min: float = 3.0):
        self.rates = rates
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

    def plan(self, miss_rows: np.ndarray, popularity: np.ndarray | None = None,
             host_allowed: bool = True, hits: int = 0, forced_copy: np.ndarray | None = None) -> Plan:
        """Choose the host set among misses with ``miss_rows`` token rows each (see module docstring);
        ``forced_copy`` (bool per miss) are copied in any case; ``hits`` > 0: a GPU call runs anyway."""
        r = self.rates
        rows = np.asarray(miss_rows, dtype=np.int64)
        n = rows.size
        empty = np.zeros(0, dtype=np.int64)
        if n == 0:
            return Plan(empty, empty, 0, 0.0, 0.0, 0.0)
        pop = np.zeros(n) if popularity is None else np.asarray(popularity, dtype=np.float64)
        forced = np.zeros(n, dtype=bool) if forced_copy is None else np.asarray(forced_copy, dtype=bool)
        # host candidates: not forced, few enough rows; fewest rows first, then least popular
        cand = np.flatnonzero(~forced & (rows <= r.max_host_rows)) if host_allowed else empty
        order = cand[np.lexsort((pop[cand], rows[cand]))]
        copy_only = r.copy_s(n, False) + r.gpu_call_s
        best = (copy_only, 0, 0, 0.0, copy_only)
        m = order.size
        if m:  # every host count k = 1..m at once
            k = np.arange(1, m + 1)
            cum_rows = np.cumsum(rows[order])
            rest = n - k
            ts, ta = r.threads_split, r.threads_all
            host = r.xfer_s + np.where(
                rest > 0, (k * r.host_base_s[ts] + cum_rows * r.host_row_s[ts]) * r.slow_host,
                k * r.host_base_s[ta] + cum_rows * r.host_row_s[ta])
            cp = np.where(rest > 0, (r.copy_lat_s + rest * (r.expert_bytes / r.copy_bw)) * r.slow_copy + r.gpu_call_s,
                          r.gpu_call_s if hits else 0.0)
            t = np.maximum(host, cp)
            i = int(np.argmin(t))
            if t[i] < best[0]:
                best = (float(t[i]), i + 1, ta if rest[i] == 0 else ts, float(host[i]), float(cp[i]))
        t, k, threads, host, cp = best
        host_idx = np.sort(order[:k])
        copy_mask = np.ones(n, dtype=bool)
        copy_mask[host_idx] = False
        return Plan(host_idx, np.flatnonzero(copy_mask), threads, t, host, cp)


def expected_distinct(tokens: int, experts: int, top_k: int) -> float:
    """Expected distinct experts of a layer under uniform routing of ``tokens`` tokens."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def crossover_table(rates: Rates, experts: int, top_k: int, resident_frac: float,
                    tokens: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048), seed: int = 0) -> list[dict]:
    """Tokens per step -> the planner's split on uniform routing with ``resident_frac`` of the
    experts resident (random draws, the mean of 8 per size). Where n_host falls to 0 is the crossover."""
    rng = np.random.default_rng(seed)
    planner = Planner(rates)
    out = []
    for t in tokens:
        acc = np.zeros(6)
        for _ in range(8):
            ids = np.argsort(rng.random((t, experts)), axis=1)[:, :top_k]  # t uniform top-k draws
            uniq, counts = np.unique(ids, return_counts=True)
            resident = rng.random(uniq.size) < resident_frac
            miss_rows = counts[~resident]
            p = planner.plan(miss_rows, hits=int(resident.sum()))
            copy_all = rates.copy_s(miss_rows.size, False) + (rates.gpu_call_s if miss_rows.size else 0.0)
            acc += (uniq.size, miss_rows.size, p.host.size, p.copy.size, p.est_s, copy_all)
        acc /= 8
        out.append(dict(tokens=t, routed=acc[0], misses=acc[1], host=acc[2], copied=acc[3],
                        est_ms=1e3 * acc[4], copy_all_ms=1e3 * acc[5],
                        rows_per_expert=t * top_k / max(acc[0], 1e-9)))
    return out


def pcie_model_rates(rates: Rates, h2d_gbps: float, measured_h2d_gbps: float | None, cores: int,
                     label: str, link_efficiency: float = 0.9) -> Rates:
    """The same split on another machine, from this one's per-byte rates (a model, labelled as such):
    copies at min(this run's copy rate, the other link x ``link_efficiency``: the copy engine streams at
    90-93% of pinned H2D once the CPU side is not the limit, TRANSFER.md); host rates at the thread
    counts the other machine can give (capped at this machine's: the other host's DRAM bandwidth is
    assumed equal to this one's); GPU call and activation costs as measured here.
    ``measured_h2d_gbps`` (this run's pinned H2D) is recorded beside it."""
    copy_bw = min(rates.copy_bw, link_efficiency * h2d_gbps * 1e9)
    threads = sorted(rates.host_base_s)
    t_all = max(t for t in threads if t <= max(cores, min(threads)))
    return Rates(
        expert_bytes=rates.expert_bytes, host_base_s=dict(rates.host_base_s), host_row_s=dict(rates.host_row_s),
        threads_split=rates.threads_split, threads_all=t_all, copy_bw=copy_bw,
        copy_lat_s=rates.copy_lat_s, gpu_call_s=rates.gpu_call_s, xfer_s=rates.xfer_s,
        slow_host=rates.slow_host, slow_copy=rates.slow_copy, max_host_rows=rates.max_host_rows,
        label=label, notes=dict(h2d_gbps=h2d_gbps, link_efficiency=link_efficiency,
                                measured_h2d_gbps=measured_h2d_gbps),
    )


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
            m["ensure_s"] += time.perf_counter() - t2
            slot_of = self.ec.slot_map(layer).copy()
            keep = np.zeros(E, dtype=bool)
            keep[copy_e if y is not None else gpu_e] = True
            sid, rw = self._masked(ids, route_w, keep, slot_of)
            y2 = self.gpu_forward(layer, x, sid, rw)
            y = y2 if y is None else y + y2
        if fut is not None:
            t3 = time.perf_counter()
            m["host_s"] += fut.result()
            m["host_wait_s"] += time.perf_counter() - t3
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


def _time_host(cache, kernel, layer: int, experts: Sequence[int], rows: int, group: int, hidden: int,
               dtype, reps: int) -> float:
    """Seconds per expert of ``kernel.experts_mlp`` on ``experts`` with ``rows`` rows each (best of reps)."""
    x = torch.randn(rows, hidden).to(dtype)
    out = torch.zeros(rows, hidden, dtype=dtype)
    jobs = []
    for e in experts:
        v = tuple(cache.tensor(layer, e, n) for n in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed",
                                                       "w2_weight_scale"))
        jobs.append((torch.arange(rows), *v, group, torch.full((rows,), 0.5)))
    kernel.experts_mlp(x, jobs[:1], out)  # first touch / set-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        kernel.experts_mlp(x, jobs, out)
        best = min(best, time.perf_counter() - t0)
    return best / len(experts)


def calibrate(cache, engine, device, kernels: dict, *, group: int, hidden: int, threads_split: int,
              threads_all: int, gpu_call: Callable[[], None] | None = None, dtype=torch.bfloat16,
              n_experts: int = 8, rows_hi: int = 16, reps: int = 3, max_host_rows: int = 64,
              time_budget_s: float = 20.0) -> Rates:
    """Measure the rates of ``Rates`` on this machine (a few seconds at real sizes):

    host: ``experts_mlp`` on ``n_experts`` distinct experts (last layer, so other layers' pages are not
    pulled into the CPU caches) at M = 1 and M = ``rows_hi``, per kernel (thread count); copy: the
    engine moving 1 and ``n_experts`` experts of another layer into a device scratch buffer (freed);
    concurrent: the split kernel and the copy at once (slow-down factors); gpu_call: ``gpu_call()``
    timed (it must synchronise); xfer: [16, H] down and up."""
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
    base, per_row = {}, {}
    raw = {}
    for th, k in sorted(kernels.items()):
        t1 = _time_host(cache, k, h_layer, ex, 1, group, hidden, dtype, reps)
        tr = t1
        if time.perf_counter() - t_start < time_budget_s / 2:
            tr = _time_host(cache, k, h_layer, ex, rows_hi, group, hidden, dtype, max(1, reps - 1))
        pr = max(0.0, (tr - t1) / (rows_hi - 1))
        per_row[th] = pr
        base[th] = max(1e-9, t1 - pr)
        raw[th] = dict(m1_s=t1, m_hi_s=tr, gbps_m1=expert_bytes / t1 / 1e9)

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
        jobs = [(torch.arange(1), *(cache.tensor(h_layer, e, nm) for nm in (
            "w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")), group, torch.ones(1))
                for e in ex]
        res = {}

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
        slow_host = max(1.0, best_h / (n * (base[threads_split] + per_row[threads_split])))
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
        threads_all=threads_all, copy_bw=copy_bw, copy_lat_s=copy_lat, gpu_call_s=gcall, xfer_s=xfer,
        slow_host=slow_host, slow_copy=slow_copy, max_host_rows=max_host_rows,
        notes=dict(host=raw, copy_1_s=c1, copy_n_s=cn, n_experts=n, seconds=time.perf_counter() - t_start),
    )


def default_threads(engine_threads: int) -> tuple[int, int]:
    """(split, all): host threads beside a copy engine of ``engine_threads``, and all cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores - engine_threads), max(1, cores)
