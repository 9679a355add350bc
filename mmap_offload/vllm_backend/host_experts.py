"""Host compute of missed experts inside vLLM's MoE forward (``hybrid`` option of the mmap backend).

At decode a layer's misses are known only after its router ran; copying them moves every missed
byte through DRAM three times (page cache -> ring -> DMA) while UVA's kernel reads it once. The
host can instead compute those experts where their bytes already are, straight from the cache's
Marlin words (``host.kernel.HostKernel``, W4A16) or bf16 rows (torch), and send back only the few
output rows. Per layer, with the expert cache (residency.py):

    route (after the router)   hits stay on the GPU; misses are split between the host and the
                               copy path so that both finish together (``split``: the cost model
                               of ``host/cost.py``, the same one bench_moe's HybridMoE uses); the
                               (token, expert) pairs given to the host get weight 0 and a resident
                               slot in the GPU kernel's ids (they add nothing there); the host job
                               (prepared here, on the calling thread) starts on the C kernel's own
                               pthreads (``HostKernel.experts_mlp_start``): the calling thread goes
                               on launching the layer's GPU work, with no Python thread and no GIL
                               between it and the kernel (bf16 caches: torch in one Python thread)
    forward_modular (patch 4b) the GPU kernel runs hits + copied misses; then the host rows are
                               waited for, copied up (pinned) and added to the kernel's output,
                               before vLLM's top-k reduce / all-reduce sees it (TP ranks each add
                               their own shard's partial sums, as the kernel does)

The cost model is calibrated when this object is made (``cost.calibrate_host``: the kernel at this
process's thread count on experts not in the CPU caches, which also maps their pages) and learns
from every host job (``add_to``) and every batch of copies (``note_copy``); the copy side is known
from the first copies. A side the model has not seen in service yet is tried once (``explore``:
the cheapest miss goes to the host), and again whenever the host got nothing for
``EXPLORE_EVERY`` calls, so a stale estimate cannot starve the host for good.

Threads (``default_threads``): the CPUs of this rank, less the copy engine's threads (6 by default
with hybrid, ``MmapOptions.copy_threads``: 9 host threads at 16 cores) and one for the thread that
launches vLLM's GPU work, and at most one per physical core but that thread's (two threads per core:
``cpus.py``). On the stream path with ``hybrid_share`` 1 (the default) the copy threads copy
only the pool's admissions (~18 MiB per decode step at batch 8) and sleep while idle, so at most
``HELD_SHARE_COPY_CORES`` (3) of them are counted: 12 host threads at 16 cores (BENCHMARKS.md "Real
vLLM", sessions 31-32). On the Python path the kernel gets one thread more than that
count: its thread 0 is the launching thread, which joins the job only at ``add_to``, when it has nothing
to launch. On the stream path (``stream``: hybrid calls started and collected by the async step's
callbacks) the joining thread is CUDA's callback thread while the launching thread runs on, so the kernel
gets the count itself: with one more, 8 host + 8 copy threads and the launching thread were 17 on the
H200's 16 cores, and a stand-in for that thread (``benchmarks/bench_launch_contention.py``) ran 2.4-3.3x
slower than alone, descheduled ~40% of the time (CPU time / wall 0.54-0.61, 110-143 forced switches per
second), against 1.7-1.9x (0.89-0.92, 2-5 per second) with 7 host threads, whose kernel read as many GB/s
beside the copies (34.1 / 29.3 against 34.0: DRAM-bound). A call completes when its work is
done, so a worker that wakes late is not waited for (csrc/host_kernel.c, ``pool_finish``). Pages: the
cache's mappings are populated (``MADV_POPULATE_READ``) by a background thread when this object is
made, layer by layer, if the experts fit in half the memory available (else that would cycle the
page cache); an expert used before its layer is done is populated on the calling thread before the
job starts, so the kernel's threads never fault.

Tolerance: the host kernel accumulates in fp32 and rounds once to the activations' dtype per
row (every host expert of a token summed first), the GPU kernel in its own order; the host rows
are then added to the GPU kernel's output in that dtype (a second rounding). Outputs agree to
bf16 rounding (relative ~1e-2 per element of the sum), not bit for bit; greedy tokens of a model
agree unless two logits are within that rounding.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..cpus import allowed_cpus, core_count
from ..errors import UnsupportedError
from ..host.cost import EXPERT_TENSORS, CostModel, calibrate_host, rates_from_host
from ..host.kernel import HostReadFault, guarded_touch
from .options import HELD_SHARE_COPY_CORES


@dataclass
class _Job:
    call: Any  # HostCall (W4A16 kernel) or _TorchCall: wait() -> it, with .seconds and .upper_bound
    n: int  # token rows of the step
    experts: int
    rows: int  # (token, expert) pairs in all
    t_start: float
    out: torch.Tensor | None = None  # where the host rows land


class _TorchCall:
    """A torch job running in ``_TorchExperts``' thread; ``wait()`` as ``HostCall.wait``. Its time is
    taken in that thread, so when the job was done before ``wait()`` it may include the wait for the
    GIL after the work: an upper bound (``upper_bound``)."""

    def __init__(self, fut: Future):
        self._fut = fut
        self.seconds: float | None = None
        self.upper_bound = False

    def wait(self) -> "_TorchCall":
        if self.seconds is None:
            self.upper_bound = self._fut.done()
            self.seconds = self._fut.result()
        return self


class _TorchExperts:
    """bf16 experts on the host with torch (an unquantized cache's rows), the kernel's contract:
    ``experts_mlp(x, [(rows, w13, w2, group, weights), ...], out)`` adds to ``out``;
    ``experts_mlp_start`` runs it in one Python thread (torch releases the GIL inside its ops)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmap-offload-host")

    def experts_mlp_start(self, x: torch.Tensor, jobs, out: torch.Tensor) -> _TorchCall:
        def run() -> float:
            t0 = time.perf_counter()
            self.experts_mlp(x, jobs, out)
            return time.perf_counter() - t0

        return _TorchCall(self._thread.submit(run))

    def experts_mlp(self, x: torch.Tensor, jobs, out: torch.Tensor) -> None:
        for rows, w13, w2, _group, w in jobs:
            guarded_touch(w13)  # views of the mapping: an unreadable page fails the job (HostReadFault),
            guarded_touch(w2)  # not the process (torch's own reads are not guarded)
            h = x[rows].float() @ w13.float().t()
            i = h.shape[1] // 2
            y = (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ w2.float().t()
            out.index_add_(0, rows, (y * w[:, None]).to(out.dtype))

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class HostExperts:
    """The host half of the hybrid step for one offloader (module docstring)."""

    MAX_TOKENS = 64  # beyond this the GPU wins (prefill, large batches): no host compute
    EXPLORE_EVERY = 64  # calls without a host job before one miss is tried on the host again

    def __init__(self, off, threads: int = 0, calibrate: bool = True, populate: bool = True, stream: bool = False):
        self.cache = off.cache
        self.device = off.device
        q = self.cache.manifest.identity.quantization
        self.kind = q.get("kind", "unquantized")
        self.group = int(q.get("group_size", 0) or 0)
        if q.get("actorder"):
            raise UnsupportedError("hybrid host compute does not support act-order (g_idx) W4A16 caches",
                                   "pass hybrid=false (the expert cache still serves it)")
        opts = getattr(off, "options", None)  # the backend's MmapOptions; None outside it (tests, benchmarks)
        explicit = threads > 0 and (opts is None or opts.host_threads > 0)
        if not explicit:  # the backend passes its own default: this one knows the copy engine's threads
            copy = 0
            if opts is not None:
                copy = opts.copy_threads()
                if stream and opts.hybrid_share == 1:  # the copy threads copy admissions only
                    copy = min(copy, HELD_SHARE_COPY_CORES)
            threads = default_threads(int(getattr(off, "tp_size", 1) or 1), copy)
        self.threads = int(threads)
        if self.kind == "w4a16":
            from ..host.kernel import HostKernel

            # Python path: one more than the computing threads: its thread 0 is the caller, which
            # launches the layer's GPU work while the job runs (experts_mlp_start) and only joins in at
            # add_to. Stream path (``stream``): the thread that joins each job is CUDA's callback thread
            # (the collect callback) while the launching thread goes on, so it is one of the computing
            # threads: one more would leave the launching thread no core (module docstring)
            self.kernel: Any = HostKernel(threads=self.threads if stream else self.threads + 1,
                                          spin_us=None if opts is None else opts.host_spin_us)
            self._names = EXPERT_TENSORS
        else:  # the torch path runs on this process's intra-op threads: changed only when asked
            if explicit:
                torch.set_num_threads(self.threads)
            self.threads = torch.get_num_threads()
            self.kernel = _TorchExperts(self.threads)
            self._names = ("w13_weight", "w2_weight")
        self.expert_nbytes = sum(s.nbytes for s in self.cache.expert_specs)
        spec = {s.name: s for s in self.cache.expert_specs}
        # w2: Marlin words [I/16, 2H] (8 nibbles per int32, 16 rows per tile row), or [H, I] bf16
        w2 = spec["w2_weight_packed" if self.kind == "w4a16" else "w2_weight"]
        self.hidden = int(w2.shape[-1] // 2 if self.kind == "w4a16" else w2.shape[0])
        self._x = self._out = None  # pinned [MAX_TOKENS, H] in the model's dtype, made on first use
        self._pending: dict[int, _Job] = {}  # target index -> its host job
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._since_host = self.EXPLORE_EVERY  # calls since the host last got work (explore at once)
        self._copy_end: float | None = None
        self.metrics: dict[str, Any] = dict(host_experts=0, host_bytes=0, host_s=0.0, host_wait_s=0.0, host_calls=0,
                                            copied_experts=0, explored=0, populated_experts=0, populate_s=0.0,
                                            populated_layers=0, populate_background_s=0.0)
        self._layers_done: set[int] = set()  # layers the background thread populated whole
        self._stop = threading.Event()
        self._populator = None
        if calibrate:
            cal = calibrate_host(self.cache, {self.threads: self.kernel}, group=self.group, hidden=self.hidden,
                                 tensors=self._names)
            rates = rates_from_host(self.cache, cal, self.threads, self.threads, max_host_rows=self.MAX_TOKENS)
        else:  # tests: a model given later (``model.rates``), nothing measured yet
            from ..host.cost import Rates

            rates = Rates(expert_bytes=self.expert_nbytes, host_base_s={}, host_row_s={}, threads_split=self.threads,
                          threads_all=self.threads, copy_bw=0.0, max_host_rows=self.MAX_TOKENS)
        self.model = CostModel(rates)
        if populate and _fits_in_memory(self.cache):
            self._populator = threading.Thread(target=self._populate_all, name="mmap-offload-populate", daemon=True)
            self._populator.start()

    def _populate_all(self) -> None:
        """Background: page tables of every layer's mapping (one madvise per layer, GIL released)."""
        from ..host.hybrid import populate_range

        t0 = time.perf_counter()
        for layer in self.cache.layers:
            if self._stop.is_set():
                return
            try:
                populate_range(self.cache.layer_buffer(layer))
            except Exception:  # noqa: BLE001 - an optimisation only: the job populates what it uses
                return
            self._layers_done.add(layer)
            self.metrics["populated_layers"] += 1
            self.metrics["populate_background_s"] = time.perf_counter() - t0

    # -- planning -------------------------------------------------------------------------------
    @property
    def host_rate(self) -> float:
        """Bytes/s of one more expert on the host now (the model's per-expert cost at one row)."""
        r = self.model.rates
        b = r.host_base_s.get(self.threads)
        return 0.0 if not b else self.expert_nbytes / (b + r.host_row_s.get(self.threads, 0.0))

    @property
    def copy_rate(self) -> float:
        return max(0.0, self.model.rates.copy_bw)

    def split(self, misses: np.ndarray, tokens_per_expert: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(host, copy) partition of ``misses`` (``tokens_per_expert`` rows each) so that both
        finish together (``CostModel.plan``: the GPU call runs in any case). A side not measured in
        service yet, or a host idle for ``EXPLORE_EVERY`` calls, gets the cheapest miss once."""
        misses = np.asarray(misses)
        if len(misses) == 0:
            return misses, misses
        tokens = np.asarray(tokens_per_expert, dtype=np.int64)
        plan = self.model.plan(tokens, hits=1)
        host = plan.host
        if host.size:
            self._since_host = 0
        else:
            self._since_host += 1
            seen = self.model.observed
            stale = self._since_host >= self.EXPLORE_EVERY or not seen["host"] or not seen["copy"]
            if stale and len(misses) >= 2 and self.threads in self.model.rates.host_base_s:
                j = int(np.argsort(tokens, kind="stable")[0])
                if tokens[j] <= self.model.rates.max_host_rows:
                    host = np.array([j])
                    self._since_host = 0
                    self.metrics["explored"] += 1
        keep = np.ones(len(misses), dtype=bool)
        keep[host] = False
        return misses[np.sort(host)], misses[keep]

    def note_copy(self, nbytes: int, seconds: float) -> None:
        """A batch of copies of this layer's call (``nbytes`` of experts in ``seconds``): the model's link."""
        self._copy_end = time.perf_counter()
        n = int(round(nbytes / max(1, self.expert_nbytes)))
        if n and seconds > 0:
            self.model.observe_copy(n, seconds)

    # -- the host job ---------------------------------------------------------------------------
    def _expert(self, layer: int, e: int, new: list) -> tuple[torch.Tensor, ...]:
        key = (layer, e)
        v = self._views.get(key)
        if v is None:  # zero-copy views of the mapped cache; its pages are populated by the job
            v = self._views[key] = tuple(self.cache.tensor(layer, e, n) for n in self._names)
            if layer not in self._layers_done:
                new.append(self.cache.expert_buffer(layer, e))
        return v

    def staging(self, dtype: torch.dtype) -> torch.Tensor:
        """The pinned ``[MAX_TOKENS, H]`` buffer the caller copies the step's activations into."""
        if self._x is None or self._x.dtype != dtype:
            pin = self.device.type == "cuda"
            self._x = torch.empty((self.MAX_TOKENS, self.hidden), dtype=dtype, pin_memory=pin)
            self._out = torch.empty((self.MAX_TOKENS, self.hidden), dtype=dtype, pin_memory=pin)
        return self._x

    def start(self, t, x_host: torch.Tensor, ids_host: np.ndarray, w_host: np.ndarray, host: np.ndarray) -> None:
        """Run experts ``host`` of layer ``t`` on the tokens routed to them, in the background. The
        jobs are built here (the calling thread holds the GIL anyway); the job's thread only
        populates new experts' pages and calls the kernel (both release the GIL)."""
        n = x_host.shape[0]
        jobs, new, pairs = [], [], 0
        for e in host:
            rows, cols = np.nonzero(ids_host == e)
            w = np.ascontiguousarray(w_host[rows, cols], dtype=np.float32)
            jobs.append((torch.from_numpy(rows), *self._expert(t.layer, int(e), new), self.group, torch.from_numpy(w)))
            pairs += len(rows)
        self.metrics["host_experts"] += len(jobs)
        self.metrics["host_bytes"] += len(jobs) * self.expert_nbytes
        self.metrics["host_calls"] += 1
        if self._out is None or self._out.dtype != x_host.dtype:
            self.staging(x_host.dtype)
        if self._pending:  # a step that failed between a layer's start and its add_to: drop its rows
            self._drop_pending()
        out = self._out[:n]
        if new:  # first use of these experts before the background populate reached them
            self._populate(new)
        out.zero_()
        call = self.kernel.experts_mlp_start(x_host, jobs, out)
        self._pending[t.index] = _Job(call, n, len(jobs), pairs, time.perf_counter(), out)

    def _drop_pending(self) -> None:
        for job in self._pending.values():
            try:
                job.call.wait()
            except Exception:  # noqa: BLE001 - its step failed already; nothing reads these rows
                pass
        self._pending.clear()

    def _populate(self, new: list) -> None:
        """Page tables of experts used for the first time, in one call each (no fault per page)."""
        from ..host.hybrid import populate_range

        t0 = time.perf_counter()
        for arr in new:
            populate_range(arr)
        self.metrics["populated_experts"] += len(new)
        self.metrics["populate_s"] += time.perf_counter() - t0

    def add_to(self, t, out: torch.Tensor) -> torch.Tensor:
        """Patch 4b: add layer ``t``'s host rows to the GPU kernel's output (if a job is pending)."""
        job = self._pending.pop(t.index, None)
        if job is None:
            return out
        if not isinstance(out, torch.Tensor):
            raise UnsupportedError("this MoE kernel returns an unfinalized output, which hybrid cannot add to",
                                   "pass hybrid=false")
        t0 = time.perf_counter()
        try:
            call = job.call.wait()  # HostCall: the kernel's own clock, from the start to its last unit of work
        except HostReadFault as e:  # the rows are not the experts': the step fails, the process goes on
            raise self.cache.fault_error(e.address) from None
        host, seconds = job.out, call.seconds
        self.metrics["host_wait_s"] += time.perf_counter() - t0
        self.metrics["host_s"] += seconds
        self.model.observe_host(self.threads, job.experts, job.rows, seconds,
                                upper_bound=getattr(call, "upper_bound", False))
        if self._copy_end is not None and self._copy_end > job.t_start:  # this call's copies' end -> rows needed
            self.model.observe_gap(t0 - self._copy_end)
        self._copy_end = None
        add = host.to(self.device, non_blocking=True) if out.is_cuda else host
        out[: job.n] += add.to(out.dtype)
        return out

    def summary(self) -> dict[str, Any]:
        """Metrics and the model's current rates (GB/s, ms)."""
        r = self.model.rates
        out = dict(self.metrics)
        out.update(threads=self.threads, host_rate_gbps=self.host_rate / 1e9, copy_rate_gbps=self.copy_rate / 1e9,
                   host_call_ms=1e3 * r.call_s(self.threads), copy_lat_ms=1e3 * r.copy_lat_s,
                   gap_ms=1e3 * r.gpu_call_s, observed=dict(self.model.observed))
        return out

    def close(self) -> None:
        self._stop.set()
        if self._populator is not None:
            self._populator.join()
        self._drop_pending()
        self._views.clear()
        close = getattr(self.kernel, "close", None)
        if close is not None:
            close()


def _fits_in_memory(cache) -> bool:
    """The cache's layer files fit in half of MemAvailable (populating them reads any that is not cached)."""
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(l.split()[1]) * 1024 for l in f if l.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return False
    total = sum(int(cache.layer_buffer(l).nbytes) for l in cache.layers)
    return total <= avail // 2


def default_threads(tp_size: int, engine_threads: int = 0) -> int:
    """Host compute threads per rank: this rank's share of the CPUs (hardware threads) less the copy
    engine's threads and, beside them, one for the thread that launches the GPU work (module
    docstring); and at most one per physical core (``cpus.core_count``) but the launching thread's.
    Without SMT the first bound is the one (12 at 16 cores beside 3 counted copy threads). With two
    threads per core the second is: one host thread per core, the launching thread's core left to it
    (its sibling idle or a copy thread's), the copy threads, which sleep while idle, on the host cores'
    siblings: 7 per rank at TP=2 on 16 cores x 2, where counting hardware threads gave 12 (a busy
    sibling beside the launching thread) and counting cores alone 4 (3 cores held for sleeping copy
    threads)."""
    tp = max(1, tp_size)
    threads, cores = len(allowed_cpus()) // tp, core_count() // tp
    if engine_threads > 0:
        threads -= engine_threads + 1
        cores -= 1
    return max(1, min(threads, cores))

__all__ = ["HostExperts", "default_threads"]
