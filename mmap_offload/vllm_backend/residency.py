"""Routing-aware residency inside vLLM's MoE forward (the expert cache mode of the mmap backend).

Between the router's top-k choice and the expert kernel (patch 4: ``router.select_experts``),
``Residency.route(target, weights, ids)`` decides, per step and per layer, from the count of
distinct routed experts:

    experts   distinct <= the layer's pool slots and the step is small (decode): make them
              resident in the layer's VRAM pool (``ExpertCache``: hits stay, misses are copied
              once, LFU-decay eviction), write the layer's fixed int32 ``expert -> slot`` map in
              place, hand the kernel ``slot ids = map[ids]``. The layer's parameters are bound
              once to the pool tensors ``[S, ...]`` (S <= E), so vLLM's own kernel (Marlin MoE,
              Triton, CPU) runs unchanged on whatever is resident.
    sparse    more distinct experts than the pool holds, but at most ``layer_stream_fraction`` of
              the layer (decode at larger batches): the layer's slot buffer ``[E, ...]`` gets only
              the routed experts: hits copied from the pool on the device (one gather per
              tensor), misses read from the cache straight into their rows; ids pass unchanged.
              Bytes over PCIe = the routed misses, as UVA's. The pool still learns: the
              routed experts' use is counted and the hottest misses are copied from their
              rows into the pool on the device (``ExpertCache.admit``).
    layer     the step routes more than ``layer_stream_fraction`` of the layer's experts
              (prefill, large batches): the whole layer comes through the ``LayerPrefetcher``
              buffers (the next layer is started ahead), ids pass unchanged.

The host learns the routed experts with one small device->host copy per layer (the ids
themselves, into pinned staging), the price of fetching only what is routed. On CUDA a decode layer
does not even wait for that copy: the decision runs in a stream callback and the misses are copied
by a kernel (``async_step.py``; a call of more ids than the pool's slots takes the sparse form there);
``route()`` returns the slot ids (sparse: the ids) at once. Per call nothing
else is allocated but the slot ids from vLLM's caching allocator: the pools, maps and pinned
staging are made once; a layer's map is copied to the device only when its pool changed.

``routing_trace`` (a benchmark option) replaces the router's ids by a CSV trace's, to measure real
routing on a random model; outputs then differ from the model's own (clearly labelled in metrics).
"""

from __future__ import annotations

import os
import time
from typing import Any

try:  # Linux: the launching thread's own context switches (metrics)
    import resource

    _RUSAGE_THREAD = resource.RUSAGE_THREAD
except (ImportError, AttributeError):
    _RUSAGE_THREAD = None

import numpy as np
import torch

from ..async_step import AsyncStep
from ..errors import UnsupportedError
from ..expert_cache import ExpertCache
from ..expert_step import ExpertStep
from .patches import log, unpadded_tokens
from ..transfer import Copy

# the H200's pinned host -> device rate (docs/TRANSFER.md: 54.5-55.4 GB/s), the link on which
# hybrid_small_calls="auto"'s threshold was measured (options.py hybrid_small_ms)
REFERENCE_LINK_BPS = 55e9


class Residency:
    """Expert pools + per-layer routing decisions for one ``MmapOffloader`` (module docstring)."""

    def __init__(self, off, capacity_bytes: int):
        self.off = off
        opts = off.options
        self.device = off.device
        self.cache = off.cache
        self.num_experts = int(off.cache.num_experts)
        self.layers = [t.layer for t in off.targets]
        self.ec = ExpertCache(
            off.cache, off.engine, self.device, capacity_bytes=int(capacity_bytes), layers=self.layers,
            verify_first_use=opts.verify_first_use,
            stream_ordered=opts.stream_ordered and getattr(off.engine, "ordered_bytes", 0) > 0,
        )
        self.ordered = self.ec.stream_ordered
        # expert mode in one native call per layer (expert_step.py); None: the Python path only
        self.step = ExpertStep.create(self.ec) if opts.native_step else None
        # decode layers are decided on the stream (async_step.py): expert mode where the ids fit the
        # pool and its staging, the sparse form up to the step's cap
        self.async_step = None
        # (on the CPU it runs each job before returning: the same decisions, no overlap; vLLM-CPU's tests
        # run the path that way)
        self.async_off = "option async_step is off" if not opts.async_step else (
            "no native step" if self.step is None else "")
        if not self.async_off:
            nb = max(1, self.ec.expert_nbytes)
            got = AsyncStep.create(self.step, max_experts=max(1, min(self.ec.slots_per_pool, 16, (96 << 20) // nb)),
                                   max_ids=max(256, opts.sparse_max_ids))
            if isinstance(got, str):
                self.async_off = got
                log.warning("mmap-offload: %s; decode layers wait for their routed ids instead", got)
            else:
                self.async_step = got
                got.hybrid_parts = opts.hybrid_parts  # hybrid calls' parts (kept across set_host)
        self.hybrid_admit = int(opts.hybrid_admit)  # admissions per hybrid call (0: host-only decode)
        self._hy_share = float(opts.hybrid_share)  # -1: adapted from the calibrated start; else held
        # ids per call the async step can take (at most one miss per id: the pool and its staging)
        self.async_fits = min(self.ec.slots_per_pool, self.async_step.max_experts) if self.async_step is not None else 0
        self._async_dirty = False  # a call was enqueued since the last wait
        self.slots = self.ec.slots_per_pool
        # above this many distinct experts a layer is streamed whole
        self.threshold = max(1, int(opts.layer_stream_fraction * self.num_experts))
        # calls of up to this many ids are sparse on the stream whatever the threshold expects (0: none)
        self.sparse_ids = min(opts.sparse_max_ids, self.async_step.cap) if self.async_step is not None else 0
        E = self.num_experts
        pin = self.device.type == "cuda"
        self._map = {t.index: torch.full((E,), -1, dtype=torch.int32, device=self.device) for t in off.targets}
        self._map_host = {t.index: torch.full((E,), -1, dtype=torch.int32, pin_memory=pin) for t in off.targets}
        self._ids_staging: dict[torch.dtype, torch.Tensor] = {}  # pinned, per ids dtype (grown on demand)
        self._event = torch.cuda.Event() if pin else None
        self._map_event: dict[int, Any] = {}  # target index -> event after its map's last H2D copy
        self._bound: dict[int, Any] = {}  # target index -> "pool" | the layer tensors dict it is bound to
        self._twins: dict[str, torch.Tensor] = {}  # CPU platform transform: kernel layout of the pool
        self.trace = None
        if opts.routing_trace:
            from .. import traces

            self.trace = traces.DeviceTrace(traces.read_csv(opts.routing_trace), self.device, E,
                                            source=f"routing trace {opts.routing_trace}")
        self._step = 0
        self._route_end: float | None = None  # when the last route() returned
        self._route_end_cpu = 0.0  # the launching thread's CPU time then
        self._idx_host = torch.empty((2, E), dtype=torch.int64, pin_memory=pin)  # sparse: rows, slots
        self._ids_host = self._w_host = self._mask_host = None  # hybrid: made on first use
        self.host = None
        if opts.hybrid:
            from .host_experts import HostExperts

            # 0: its default (cores, TP, copy threads); stream: CUDA's callback thread joins its jobs
            self.host = HostExperts(off, threads=opts.host_threads,
                                    stream=self.async_step is not None and opts.hybrid_stream)
        # hybrid sparse calls on the stream (AsyncStep.run_hybrid): W4A16 (the native host kernel, which
        # the stream's callback starts), set up at the first call (x's dtype); None: not taken
        self._hy_sources: dict[int, np.ndarray] | None = None
        if (self.host is not None and self.async_step is not None and opts.hybrid_stream
                and self.host.kind == "w4a16"):
            self._hy_sources = {}
        self._hy_collect: int | None = None  # the target index whose host rows the stream still owes
        # target index -> (its last stream hybrid call's set-up, whether its ids fit the pool): _fast_hybrid
        # (MMO_FAST_HYBRID=0: route()'s general path for every call, as before session 30; benchmarks)
        self._fast: dict[int, tuple] = {}
        self._fast_on = os.environ.get("MMO_FAST_HYBRID", "1") != "0"
        # option check_after_experts: the end-of-step check waits in patch 4b (add_host) of the last layer,
        # after its kernel and collect are enqueued; _check_due: route() of the last layer left it there
        self.check_late = bool(opts.check_after_experts) and self.host is not None
        self._check_due = False
        self._last = len(off.targets) - 1  # the index of a forward's last MoE layer
        # calls whose ids fit the pool take the hybrid sparse form too (option hybrid_small_calls: "on";
        # "auto": while such calls miss hybrid_small_ms of link time or more each, _note_small_misses)
        self.hybrid_small = self._hy_sources is not None and opts.hybrid_small_calls == "on"
        self.hybrid_small_auto = self._hy_sources is not None and opts.hybrid_small_calls == "auto"
        # its threshold: hybrid_small_ms of link time per call, at this GPU's pinned host -> device rate
        # measured here (the reference rate on the CPU, or where the measurement failed)
        self.link_bps = self.async_step.link_h2d_bps() if self.hybrid_small_auto else None
        self._small_on_bytes = float(opts.hybrid_small_ms) * 1e-3 * (self.link_bps or REFERENCE_LINK_BPS)
        self._small_step = False  # the step's calls fit the pool (set by each route())
        self._small_seen = (0, 0)  # the async step's (calls, misses) at the last check
        self._small_miss_bytes: float | None = None  # misses per small call, bytes: an average over steps
        # route_s: host time in route() (ids_s getting the routed ids to the host, sync_s of it
        # waiting for them, ensure_s in the pool's ensure, misses' copies included, map_s the
        # slot map and slot ids after it, check_s the end-of-step check of stream-ordered reads,
        # native_s in the native expert step, all of it, for native_calls calls: expert_step.py);
        # map_copies: device maps rewritten (only on change); between_s: wall time from one layer's
        # route() to the next one's in the same forward (vLLM's layer code, launches, our kernel
        # call), outside_s: from the last layer's to the next forward's first (sampling, scheduling,
        # the layers before the first MoE layer); between_cpu_s / outside_cpu_s: the launching thread's CPU
        # time over the same spans (wall well above it: the thread waited or was preempted, not slow), and
        # thread_nvcsw / thread_nivcsw its voluntary / involuntary context switches so far (read once per
        # forward): what separates a slow thread from a waiting or descheduled one when vLLM's own time drifts;
        # fast_hybrid_calls: stream hybrid calls that took the steady-state path (_fast_hybrid);
        # collect_s: time in add_host (patch 4b: the host rows' collect, and the end-of-step check where
        # check_after_experts put it, late_checks of them), our part of between_s / outside_s;
        # trace_s: of route_s, the routing trace's ids made on the device (option routing_trace: a
        # benchmark's replay, which serving without a trace does not pay; uva's runs pay it in their router);
        # padded_rows: CUDA-graph padding rows given row 0's experts (_unpadded)
        self._unpad = getattr(off, "graph_mode", "eager") == "piecewise"
        self.metrics: dict[str, Any] = dict(padded_rows=0, expert_calls=0, sparse_calls=0, layer_calls=0, hybrid_calls=0, route_s=0.0,
                                            sync_s=0.0, ensure_s=0.0, check_s=0.0, ids_s=0.0, map_s=0.0, map_copies=0,
                                            native_calls=0, native_sparse_calls=0, native_s=0.0, async_calls=0, sparse_async_calls=0,
                                            hybrid_async_calls=0, fast_hybrid_calls=0,
                                            between_s=0.0, outside_s=0.0, between_cpu_s=0.0, outside_cpu_s=0.0,
                                            thread_nvcsw=0, thread_nivcsw=0, collect_s=0.0, late_checks=0,
                                            sparse_miss_bytes=0, sparse_hits=0, sparse_misses=0,
                                            small_hybrid_steps=0, small_auto_switches=0,
                                            trace=bool(self.trace is not None), trace_s=0.0)

    # -- binding --------------------------------------------------------------------------------
    def _bind_pool(self, t) -> None:
        if self._bound.get(t.index) == "pool":
            return
        pool = self.ec.slots(t.layer)
        for name in t.served:
            src = self._twin(t, name, pool[name]) if name in self.off._transforms else pool[name]
            getattr(t.experts, name).data = src
        self._bound[t.index] = "pool"

    def _twin(self, t, name: str, pool: torch.Tensor) -> torch.Tensor:
        key = f"{t.layer}:{name}"
        if key not in self._twins:
            self._twins[key] = torch.empty_like(pool)
        return self._twins[key]

    def _bind_layer(self, t, tensors: dict[str, torch.Tensor]) -> None:
        if self._bound.get(t.index) is tensors:  # bound to this buffer already (each decode step's sparse calls)
            return
        for name in t.served:
            buf = tensors[name]
            getattr(t.experts, name).data = buf.data if isinstance(buf, torch.nn.Parameter) else buf
        self._bound[t.index] = tensors  # the dict itself: a buffer's is kept for the run, twins' are made per call

    # -- the step -------------------------------------------------------------------------------
    def _routed(self, ids: torch.Tensor) -> np.ndarray:
        """Sorted distinct expert ids routed in ``ids``: on CUDA one device->host copy of the ids
        themselves into pinned staging (one launch; a bitmap over E took three), then the wait
        for it, the one host sync of the step's layer."""
        if ids.device.type != "cuda":
            return np.unique(ids.reshape(-1).numpy())
        n = ids.numel()
        st = self._ids_staging.get(ids.dtype)
        if st is None or st.numel() < n:
            st = self._ids_staging[ids.dtype] = torch.empty(max(n, 4096), dtype=ids.dtype, pin_memory=True)
        st[:n].copy_(ids.reshape(-1), non_blocking=True)
        self._sync()
        return np.unique(st[:n].numpy())

    def _sync(self) -> None:
        """Wait until the copies to the host enqueued so far have landed (the layer's one sync)."""
        self._event.record()
        t0 = time.perf_counter()
        self._event.synchronize()
        self.metrics["sync_s"] += time.perf_counter() - t0

    def _routed_with_inputs(self, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor):
        """``_routed`` plus the step's ids, weights and activations on the host, in one sync
        (hybrid: the host computes some experts on these rows)."""
        n, k = ids.shape
        if self._ids_host is None or self._ids_host.shape[1] != k:
            pin = self.device.type == "cuda"
            self._ids_host = torch.empty((self.host.MAX_TOKENS, k), dtype=torch.int64, pin_memory=pin)
            self._w_host = torch.empty((self.host.MAX_TOKENS, k), dtype=torch.float32, pin_memory=pin)
            self._mask_host = torch.empty((self.host.MAX_TOKENS, k), dtype=torch.bool, pin_memory=pin)
        ih, wh, xh = self._ids_host[:n], self._w_host[:n], self.host.staging(x.dtype)[:n]
        cuda = ids.device.type == "cuda"
        ih.copy_(ids, non_blocking=cuda)
        wh.copy_(weights, non_blocking=cuda)
        xh.copy_(x, non_blocking=cuda)
        if cuda:
            self._sync()  # the three copies above; the routed experts come from ih (no fourth copy)
        return np.unique(ih.numpy()), ih.numpy(), wh.numpy(), xh

    def _hybrid_mode(self, t, ids, weights, used, ids_h, w_h, x_h):
        """Expert mode whose misses are split between the host and the copy path (host_experts.py).
        Returns (weights, slot ids): the host's (token, expert) pairs get weight 0 and the slot of
        an expert this call made resident (valid bytes: the kernel computes nothing from them)."""
        ec, host = self.ec, self.host
        row = ec.slot_map(t.layer)
        slots = row[used]
        hits, misses = used[slots >= 0], used[slots < 0]
        if len(misses) == 0:
            return weights, self._expert_mode(t, ids, used)
        tokens = np.array([int((ids_h == e).sum()) for e in misses])
        to_host, to_copy = host.split(misses, tokens)
        if len(to_host) and not len(hits) and not len(to_copy):  # one expert must be resident for the masked pairs
            to_host, to_copy = to_host[1:], to_host[:1]
        if len(to_host):
            self.metrics["hybrid_calls"] += 1
            host.start(t, x_h, ids_h, w_h, to_host)  # runs while the copies below are read and issued
        gpu = np.sort(np.concatenate([hits, to_copy]))
        moved, stalled = ec.metrics["miss_bytes"], ec.metrics["stall_s"]
        slot_ids = self._expert_mode(t, ids, gpu)
        host.note_copy(ec.metrics["miss_bytes"] - moved, ec.metrics["stall_s"] - stalled)  # the model's link
        host.metrics["copied_experts"] += len(to_copy)
        if not len(to_host):  # every miss copied
            return weights, slot_ids
        dummy = int(ec.slot_map(t.layer)[gpu[0]])
        n = ids.shape[0]
        mh = self._mask_host[:n]
        mh.numpy()[:] = np.isin(ids_h, to_host)
        mask = mh.to(ids.device, non_blocking=ids.is_cuda)
        slot_ids = slot_ids.masked_fill(mask, dummy)
        return weights.masked_fill(mask, 0.0), slot_ids

    def _expected_distinct(self, n_tokens: int, top_k: int) -> float:
        E = self.num_experts
        return E * (1.0 - (1.0 - min(top_k, E) / E) ** n_tokens)

    def route(self, t, topk_weights: torch.Tensor, topk_ids: torch.Tensor, x: torch.Tensor | None = None):
        """Make the routed experts of layer ``t`` resident; return (weights, ids) for the kernel."""
        t0, c0 = time.perf_counter(), time.thread_time()
        if self._check_due:  # the last step's add_host never came (its last layer raised): check now, so no
            self._check_due_step()  # read error is lost; it fails this step rather than serve a bad one
        if self._route_end is not None:  # vLLM's own host time since the last route() (see metrics)
            self.metrics["between_s" if t.index else "outside_s"] += t0 - self._route_end
            self.metrics["between_cpu_s" if t.index else "outside_cpu_s"] += c0 - self._route_end_cpu
        fast = self._fast.get(t.index) if x is not None else None
        if fast is not None:  # the layer's steady decode state: one hybrid call on the stream, few checks
            topk_ids = self._served_ids(t, topk_ids)
            got = self._fast_hybrid(t, fast, topk_ids, topk_weights, x)
        if fast is not None and got is not None:
            topk_weights, out = got
        else:
            topk_weights, out = self._route(t, topk_weights, topk_ids, x, traced=fast is not None)
        if t.index == self._last:
            self._step += 1
            if self.ordered or self._async_dirty:  # the step's reads, before anything samples from it
                if self.check_late:
                    self._check_due = True  # in add_host, after this layer's kernel and collect
                else:
                    self._check_step()
            if _RUSAGE_THREAD is not None:
                ru = resource.getrusage(_RUSAGE_THREAD)
                self.metrics["thread_nvcsw"], self.metrics["thread_nivcsw"] = ru.ru_nvcsw, ru.ru_nivcsw
        self._route_end, self._route_end_cpu = time.perf_counter(), time.thread_time()
        self.metrics["route_s"] += self._route_end - t0
        return topk_weights, out

    def _route(self, t, topk_weights: torch.Tensor, topk_ids: torch.Tensor, x, traced: bool = False):
        """route()'s general path: every mode (module docstring), first calls and changes of shape."""
        with torch.inference_mode(False):
            if not traced:
                topk_ids = self._served_ids(t, topk_ids)
            n, k = int(topk_ids.shape[0]), int(topk_ids.shape[-1])
            self._small_step = n * k <= self.async_fits
            if self._expected_distinct(n, k) > self.threshold and not self.async_fits < n * k <= self.sparse_ids:
                out = self._layer_mode(t, topk_ids, ahead=True)
            else:
                t1 = time.perf_counter()
                hybrid = self.host is not None and x is not None and n <= self.host.MAX_TOKENS
                if hybrid and self._hy_sources is not None and n * k <= self.async_fits and not self.hybrid_small:
                    # with hybrid on the stream, a call whose ids fit the pool takes the async step
                    # without the host: its step is the launching thread's, which the Python hybrid
                    # path lengthens (H200, batch 1: 39.3 / 29.2 against 18.2 / 19.5 ms per step, session 11)
                    hybrid = False
                out = used = inputs = got = None  # inputs, hybrid: the step's ids, weights and activations on the host
                if (hybrid and self._hy_sources is not None and n * k <= self.async_step.cap
                        and (self.hybrid_small or self.async_fits < n * k)):
                    got = self._async_hybrid_mode(t, topk_ids, topk_weights, x)
                    if got is None and n * k <= self.async_fits:
                        hybrid = False  # a call that fits the pool, declined: the expert step, as without the option
                if got is not None:
                    topk_weights, out = got
                elif self.async_step is not None and not hybrid and n * k <= self.async_fits:
                    out = self._async_mode(t, topk_ids)
                elif self.async_step is not None and not hybrid and n * k <= self.async_step.cap:
                    out = self._async_sparse_mode(t, topk_ids)
                else:
                    self._async_settle()
                if out is None and self.step is not None and not hybrid:
                    out, used = self._native_mode(t, topk_ids)
                if out is None:
                    if hybrid:
                        used, *inputs = self._routed_with_inputs(topk_ids, topk_weights, x)
                    elif used is None:
                        used = self._routed(topk_ids)
                    self.metrics["ids_s"] += time.perf_counter() - t1
                    if len(used) <= self.slots and inputs:
                        topk_weights, out = self._hybrid_mode(t, topk_ids, topk_weights, used, *inputs)
                    elif len(used) <= self.slots:
                        out = self._expert_mode(t, topk_ids, used)
                    elif len(used) <= self.threshold:
                        out = self._sparse_mode(t, topk_ids, used)
                    else:
                        out = self._layer_mode(t, topk_ids, ahead=False)
        return topk_weights, out

    def _async_mode(self, t, ids: torch.Tensor) -> torch.Tensor | None:
        """Expert mode decided on the stream (async_step.py): the slot ids' device buffer, at once;
        None where the call is not eligible, after waiting for the callbacks in flight (the other
        paths read and write the arrays they mutate)."""
        t0 = time.perf_counter()
        out = self.async_step.run(t.layer, ids)
        if out is None:
            self._async_settle()
            self.metrics["native_s"] += time.perf_counter() - t0
            return None
        self._async_dirty = True
        self.metrics["native_s"] += time.perf_counter() - t0
        self.metrics["expert_calls"] += 1
        self.metrics["async_calls"] += 1
        if not self.async_step.cuda:  # the job ran already: its slots' kernel-layout twins (vLLM-CPU)
            self._transform_slots(t, [s for _, s in self.async_step.pairs])
        self._bind_pool(t)
        return out

    def _async_sparse_mode(self, t, ids: torch.Tensor) -> torch.Tensor | None:
        """Sparse mode decided on the stream (``AsyncStep.run_sparse``): a call of more ids than the
        pool's slots, whose count of distinct experts is not known yet. The layer buffer gets
        exactly the routed experts (even where they would all have fit the pool: that is known
        only on the stream) and the ids pass unchanged; None where the call is not eligible."""
        t0 = time.perf_counter()
        served = False
        if self.async_step.eligible(self.ec._li(t.layer), ids.numel(), ids.dtype, sparse=True):  # before the claim
            tensors, _ = self.off.prefetcher.claim(t.layer, event=False)  # copies on this stream: ordered anyway
            served = self.async_step.run_sparse(t.layer, ids, tensors)
        self.metrics["native_s"] += time.perf_counter() - t0
        if not served:
            self._async_settle()
            return None
        self._async_dirty = True
        self.metrics["sparse_calls"] += 1
        self.metrics["sparse_async_calls"] += 1
        self._bind_sparse(t, tensors, self.async_step.pairs)  # (pairs: the CPU's, where twins are made)
        return ids

    def _async_hybrid_mode(self, t, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor):
        """A sparse call on the stream whose misses are partly computed on the host
        (``AsyncStep.run_hybrid``): (weights, ids) for the kernel, device buffers the stream writes
        (the host's pairs weigh 0 and read a filled row); patch 4b's ``add_host`` adds the host's
        rows. None where the call is not eligible (then the other paths, after a wait)."""
        a, host = self.async_step, self.host
        if x.dtype not in (torch.bfloat16, torch.float16) or weights.dtype != torch.float32:
            return None
        t0 = time.perf_counter()
        li = self.ec._li(t.layer)
        if not a.eligible(li, ids.numel(), ids.dtype, sparse=True):
            self.metrics["native_s"] += time.perf_counter() - t0
            return None
        if a._host is None or a._host["dtype"] != x.dtype:
            self._async_settle()  # the callbacks drive the host kernel: none may be in flight
            from ..host.kernel import _geometry

            names = host._names
            w13, s13, w2, s2 = (self.cache.tensor(t.layer, 0, n) for n in names)
            held = self._hy_share >= 0
            a.set_host(host.kernel, _geometry(w13, s13, w2, s2, host.group, host.hidden, "hybrid"), host.MAX_TOKENS,
                       x.dtype, share=self._hy_share if held else self._initial_share(), adapt=not held)
        src = self._hy_sources.get(t.layer)
        if src is None:
            src = self._hy_sources[t.layer] = np.array(
                [[self.cache.tensor(t.layer, e, n).data_ptr() for n in host._names] for e in range(self.num_experts)],
                dtype=np.uint64)
        if host._pending:  # the Python path's job of a failed step: the kernel is the callback's now
            host._drop_pending()
        tensors, _ = self.off.prefetcher.claim(t.layer, event=False)  # copies on this stream: ordered anyway
        c = a.hybrid_call(t.layer, ids, tensors, weights, x, src, max_admit=self.hybrid_admit)
        got = a.run_prepared(c, ids, weights, x) if c is not None else None
        self.metrics["native_s"] += time.perf_counter() - t0
        if got is None:
            if c is None:
                a.metrics["declined"] += 1
            self._async_settle()
            return None
        if self._fast_on:  # the next calls of this layer and shape take _fast_hybrid (the same call, no look-ups)
            self._fast[t.index] = (c, ids.numel() <= self.async_fits)
        self._hybrid_enqueued(t, tensors)
        return got

    def _hybrid_enqueued(self, t, tensors) -> None:
        """The bookkeeping of a hybrid call on the stream: its collect is owed, its counters, its binding."""
        self._async_dirty = True
        self._hy_collect = t.index
        m = self.metrics
        m["sparse_calls"] += 1
        m["sparse_async_calls"] += 1
        m["hybrid_calls"] += 1
        m["hybrid_async_calls"] += 1
        self._bind_sparse(t, tensors, self.async_step.pairs)

    def _fast_hybrid(self, t, fast, ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor):
        """A decode layer's hybrid call on the stream in its steady state (the layer's last call took
        ``_async_hybrid_mode`` with the same shapes): what route() would decide for it, without its
        branches and look-ups. None where anything differs (route() then takes its general path)."""
        c, small = fast
        a = self.async_step
        if (small and not self.hybrid_small) or self.host._pending or not c.fits(a, ids, weights, x):
            return None
        t0 = time.perf_counter()
        tensors, _ = self.off.prefetcher.claim(t.layer, event=False)
        if tensors is not c.rows:  # another buffer: route()'s path makes its set-up
            return None
        got = a.run_prepared(c, ids, weights, x)
        self.metrics["native_s"] += time.perf_counter() - t0
        if got is None:  # declined (a hint in flight): the general path decides after a wait
            self._async_settle()
            return None
        self._small_step = small
        self.metrics["fast_hybrid_calls"] += 1
        self._hybrid_enqueued(t, tensors)
        return got

    def _initial_share(self) -> float:
        """The share of misses the host starts with: its calibrated rate against the copy path's
        (~38 GB/s measured through the async step's staging on the H200, session 10, until measured
        here); with hybrid_share -1 the stream's collects adapt it from then on."""
        h = self.host.host_rate
        c = self.host.copy_rate or 38e9
        return float(min(1.0, max(0.0, h / (h + c)))) if h > 0 else 0.5

    def add_host(self, t, out: torch.Tensor) -> torch.Tensor:
        """Patch 4b: the host's rows of layer ``t`` into its MoE output (a stream hybrid call's, or
        the Python hybrid path's)."""
        t0 = time.perf_counter()
        try:
            # a stream hybrid call of this layer owes its rows; another layer's index: a call whose output
            # never came here (its step failed), dropped
            streamed, self._hy_collect = self._hy_collect == t.index, None
            out = self.async_step.collect(out) if streamed else self.host.add_to(t, out)
            if self._check_due and t.index == self._last:  # option check_after_experts
                self.metrics["late_checks"] += 1
                self._check_due_step()
        finally:
            self.metrics["collect_s"] += time.perf_counter() - t0
        return out

    def _check_due_step(self) -> None:
        """The end-of-step check that route() of the last layer left to later (check_after_experts)."""
        self._check_due = False
        self._check_step()

    def _async_settle(self) -> None:
        """Wait for the async step's callbacks in flight, if it enqueued any since the last wait
        (they mutate the cache's arrays from CUDA's thread; the other paths read and write them),
        and raise a read they found failed."""
        if self._async_dirty:
            self._async_dirty = False
            self.async_step.wait()

    def _native_mode(self, t, ids: torch.Tensor):
        """Expert mode in one native call (expert_step.py): (slot ids, distinct experts), or (None,
        the distinct experts or None) where the Python path serves the call."""
        t0 = time.perf_counter()
        out, used = self.step.run(t.layer, ids)
        self.metrics["native_s"] += time.perf_counter() - t0
        if out is None:
            return None, used
        self.metrics["expert_calls"] += 1
        self.metrics["native_calls"] += 1
        self._transform_slots(t, [s for _, s in self.step.pairs])
        self._bind_pool(t)
        return out, used

    def _transform_slots(self, t, slots) -> None:
        """CPU prepacked kernels (vLLM-CPU): the kernel-layout twins of the pool slots just filled."""
        if not self.off._transforms:
            return
        pool = self.ec.slots(t.layer)
        for s in slots:
            for name, fn in self.off._transforms.items():
                fn(pool[name][s : s + 1], self._twin(t, name, pool[name])[s : s + 1])

    def _check_step(self) -> None:
        """Wait for the reads of this step's stream-ordered misses (all but the last layer's are
        done by now) and fail the step on a read error: its kernels read stale bytes for the experts
        of the failed batch, which the pool has forgotten (the next step fetches them again)."""
        t0 = time.perf_counter()
        try:
            self._async_settle()  # every callback of the step ran, its reads succeeded
            self.ec.check_ordered()
        finally:
            self.metrics["check_s"] += time.perf_counter() - t0
        if self.hybrid_small_auto:
            self._note_small_misses()

    def _note_small_misses(self) -> None:
        """Option hybrid_small_calls="auto", at the end-of-step check (the async step's counters are
        folded there): the misses per call of a step whose calls fit the pool, hybrid or not (the
        stream counts a call's misses before the host takes its share), averaged over such steps
        (weight 0.1 to the newest, from 0); the hybrid form from the threshold on (hybrid_small_ms of link time
        per call, in bytes), the expert step again below 3/4 of it."""
        calls, misses = self.async_step.decided()
        prev, self._small_seen = self._small_seen, (calls, misses)
        if not self._small_step or calls <= prev[0]:
            return
        per_call = (misses - prev[1]) / (calls - prev[0]) * self.ec.expert_nbytes
        # from 0 (the expert step's side): the first steps, whose pool is still empty, miss every
        # expert and would switch at once; it takes a few steps of many misses to switch
        avg = self._small_miss_bytes = 0.9 * (self._small_miss_bytes or 0.0) + 0.1 * per_call
        was = self.hybrid_small
        self.hybrid_small = avg >= (0.75 if was else 1.0) * self._small_on_bytes
        self.metrics["small_auto_switches"] += int(self.hybrid_small != was)
        self.metrics["small_hybrid_steps"] += int(was)

    def _layer_mode(self, t, ids: torch.Tensor, ahead: bool) -> torch.Tensor:
        """The whole layer in its buffer (the kernel reads the ids as they are). ``ahead`` (a call that
        streams whole layers by the threshold, as prefill's do): the next layer is started too.
        Where this layer is already on its way, the next one's copy is queued before this one is
        waited for, so the copy threads go on to it while this layer's last chunks cross the link
        (queued after the wait they idled until vLLM's thread woke and queued it). Its buffer is an
        earlier layer's, whose kernel is enqueued: the prefetcher's release event orders the copy
        after it. With one buffer for all layers (lookahead 0) nothing is started ahead: the next
        layer's copy would overwrite this one's bytes before its kernel ran."""
        self.metrics["layer_calls"] += 1
        pf = self.off.prefetcher
        nxt = pf.layer_after(t.layer, 1) if ahead and len(self.off.targets) > 1 else None
        if nxt is not None and pf.buffer_index(nxt) == pf.buffer_index(t.layer):
            nxt = None
        if nxt is not None and pf.holds(t.layer):
            pf.start_prefetch(nxt)
            nxt = None
        self._bind_layer(t, self.off._layer_tensors(t))
        if nxt is not None:  # this layer was not on its way: it first (the engine copies in order)
            pf.start_prefetch(nxt)
        return ids

    def _sparse_mode(self, t, ids: torch.Tensor, used: np.ndarray) -> torch.Tensor:
        self.metrics["sparse_calls"] += 1
        off, ec = self.off, self.ec
        tensors, after = off.prefetcher.claim(t.layer)
        admitted = self._native_sparse(t, tensors) if self.step is not None else None
        if admitted is None:
            admitted = self._python_sparse(t, used, tensors, after)
        self._bind_sparse(t, tensors, admitted)
        return ids

    def _bind_sparse(self, t, tensors, admitted) -> None:
        """Bind layer ``t`` to the buffer a sparse call filled (vLLM-CPU's prepacked kernels: the
        kernel-layout twins of the admitted slots and of the buffer first)."""
        off = self.off
        layer_tensors = tensors
        if off._transforms:  # CPU prepacked kernels: the admitted slots' twins, the buffer's twin, whole
            self._transform_slots(t, [s for _, s in admitted])
            b = off.prefetcher.buffer_index(t.layer)
            twin = off._kernel_buffers[b]
            for name, fn in off._transforms.items():
                fn(tensors[name].data, twin[name])
            off._kernel_layer[b] = None  # holds some experts of a layer, not a whole one
            layer_tensors = {**tensors, **twin}
        self._bind_layer(t, layer_tensors)

    def _native_sparse(self, t, tensors) -> list[tuple[int, int]] | None:
        """The sparse call in one native call (``ExpertStep.run_sparse``): the pool's admitted
        (expert, slot) pairs, or None where the Python path must serve it."""
        t0 = time.perf_counter()
        served = self.step.run_sparse(t.layer, tensors)  # the buffer's own dict: its addresses are kept
        self.metrics["native_s"] += time.perf_counter() - t0
        if not served:
            return None
        self.metrics["native_sparse_calls"] += 1
        self.metrics["sparse_miss_bytes"] += self.step.last_misses * self.ec.expert_nbytes
        self.metrics["sparse_hits"] += self.step.last_hits
        self.metrics["sparse_misses"] += self.step.last_misses
        return self.step.pairs

    def _python_sparse(self, t, used: np.ndarray, tensors, after) -> list[tuple[int, int]]:
        off, ec = self.off, self.ec
        row = ec.slot_map(t.layer)
        slots = row[used]
        misses, hits = used[slots < 0], used[slots >= 0]
        if off.options.verify_first_use:  # the experts read from the cache, each once per process
            self.cache.check_experts_once(t.layer, misses)
        if len(misses):
            # stream-ordered: behind the buffer's earlier readers on this stream (``after`` is for
            # other streams); the launching thread does not wait for the reads
            ticket = ec.submit_rows_ordered(t.layer, misses, {n: v.data for n, v in tensors.items()}) \
                if self.ordered else None
            if ticket is None:
                cache, specs = self.cache, self.ec.specs
                copies = [Copy(src=cache.expert_extent(t.layer, int(e)),
                               dst=[(sp.offset, sp.nbytes, tensors[sp.name].data[int(e)]) for sp in specs],
                               label=f"layer {t.layer} expert {int(e)}")
                          for e in misses]
                ticket = off.engine.submit(copies, after=after)
            self.metrics["sparse_miss_bytes"] += len(misses) * ec.expert_nbytes
        self.metrics["sparse_hits"] += len(hits)
        self.metrics["sparse_misses"] += len(misses)
        if len(hits):  # the pool's copies of them are complete (ensure waited for them)
            n = len(hits)
            ih = self._idx_host
            ih[0, :n] = torch.from_numpy(hits)
            ih[1, :n] = torch.from_numpy(row[hits])
            idx = ih[:, :n].to(self.device, non_blocking=True)
            pool = ec.slots(t.layer)
            for name in t.served:
                dst = tensors[name].data
                dst.index_copy_(0, idx[0], pool[name].index_select(0, idx[1]))
        if not len(misses):
            return []
        ordered = ticket.ordered and self.device.type == "cuda"  # on CPU: waited for here
        if not ordered:
            off.engine.wait(ticket)
        # the pool learns from this step too: the hottest misses are copied into it on the
        # device (a pool smaller than a step's experts would otherwise never change here)
        pool = ec.slots(t.layer)
        return ec.admit(t.layer, used, {name: tensors[name].data for name in pool}, misses,
                        read_slots=slots[slots >= 0], ordered_ticket=ticket if ordered else None)

    def _expert_mode(self, t, ids: torch.Tensor, used: np.ndarray) -> torch.Tensor:
        self.metrics["expert_calls"] += 1
        ec = self.ec
        before = ec.slot_map(t.layer)[used].copy() if self.off._transforms else None
        t0 = time.perf_counter()
        ec.ensure(t.layer, used)
        t1 = time.perf_counter()
        self.metrics["ensure_s"] += t1 - t0
        row = ec.slot_map(t.layer)
        if self.off._transforms:
            self._transform_slots(t, [int(row[e]) for e in used[before < 0]])
        self._bind_pool(t)
        m, mh = self._map[t.index], self._map_host[t.index]
        if m.dtype != ids.dtype:  # the map in the router's id dtype: no conversion per call
            pin = m.is_cuda
            m = self._map[t.index] = torch.full_like(m, -1, dtype=ids.dtype)
            mh = self._map_host[t.index] = torch.full(tuple(mh.shape), -1, dtype=ids.dtype, pin_memory=pin)
        if not np.array_equal(mh.numpy(), row):  # the row changes only when this layer's pool did
            # the staging row is rewritten only here, after its previous copy was ordered on the
            # stream; a pending copy of it is waited for first (its event), so it is never torn
            if self._map_event.get(t.index) is not None:
                self._map_event[t.index].synchronize()
            mh.numpy()[:] = row
            m.copy_(mh, non_blocking=m.is_cuda)
            if m.is_cuda:
                ev = self._map_event.get(t.index) or torch.cuda.Event()
                ev.record()
                self._map_event[t.index] = ev
            self.metrics["map_copies"] += 1
        out = torch.index_select(m, 0, ids.reshape(-1)).view(ids.shape)
        self.metrics["map_s"] += time.perf_counter() - t1
        return out

    def _served_ids(self, t, ids: torch.Tensor) -> torch.Tensor:
        """The router's ids as this call serves them: the routing trace's where one is replayed, and
        under piecewise graphs the padding rows on row 0's experts."""
        if self.trace is not None:
            ids = self._trace_ids(t, ids)
        return self._unpadded(ids) if self._unpad else ids

    def _unpadded(self, ids: torch.Tensor) -> torch.Tensor:
        """Under piecewise CUDA graphs vLLM pads a batch to its next capture size (a batch of 5 runs as 8);
        the padding rows hold stale tokens whose routing picks experts of their own: misses, copies and
        host jobs for outputs nobody reads. They take row 0's experts instead (one launch, only when the
        forward is padded: ``patches.unpadded_tokens``); their outputs stay unread."""
        real = unpadded_tokens()
        n = int(ids.shape[0])
        if real is None or not 0 < real < n:
            return ids
        self.metrics["padded_rows"] += n - real
        return torch.cat((ids[:real], ids[:1].expand(n - real, *ids.shape[1:])))

    def _trace_ids(self, t, ids: torch.Tensor) -> torch.Tensor:
        """The trace's ids for (step, layer position), its batch tiled over the step's tokens
        (``traces.DeviceTrace``: on the device, no host sync)."""
        t0 = time.perf_counter()
        out = self.trace.ids(self._step, t.index, int(ids.shape[0]), int(ids.shape[-1]), ids.dtype)
        self.metrics["trace_s"] += time.perf_counter() - t0  # inside route_s: a benchmark's cost, not serving's
        return out

    def summary(self) -> dict[str, Any]:
        out = dict(self.metrics)
        if self.async_step is not None:  # the callbacks' counters into the cache's (no wait), its sparse calls' here
            self.async_step._fold()
            asum = self.async_step.summary()
            out["sparse_miss_bytes"] += self.async_step.sparse_miss_bytes
            out["sparse_hits"] += asum["sparse_hits"]
            out["sparse_misses"] += asum["sparse_misses"]
        out.update({f"pool_{k}": v for k, v in self.ec.summary().items()})
        if self.step is not None:
            out.update({f"step_{k}": v for k, v in self.step.summary().items()})
        if self.async_step is not None:
            out.update({f"async_{k}": v for k, v in asum.items()})
        out["async_off"] = self.async_off
        out["small_calls_hybrid"] = self.hybrid_small  # calls that fit the pool take the hybrid form now
        if self.hybrid_small_auto:  # its threshold (MiB of misses per call) and the link rate it came from
            out["small_on_mib"] = self._small_on_bytes / (1 << 20)
            out["link_h2d_gbps"] = (self.link_bps or 0.0) / 1e9
        if self._small_miss_bytes is not None:
            out["small_miss_mib"] = self._small_miss_bytes / (1 << 20)
        out["pool_slots_per_layer"] = self.slots
        out["pool_bytes"] = self.ec.capacity_bytes
        out["layer_stream_threshold"] = self.threshold
        if self.host is not None:
            out.update({f"host_{k}": v for k, v in self.host.summary().items()})
            out["host_rate_gbps"] = self.host.host_rate / 1e9
            out["copy_rate_gbps"] = self.host.copy_rate / 1e9
        return out

    def close(self) -> None:
        if self.async_step is not None:
            self.async_step.close()
        self.ec.sync()
        if self.host is not None:
            self.host.close()


def kv_one_request_bytes(vcfg) -> int:
    """The KV cache of one request of max_model_len on this rank, as vLLM counts it when it checks at
    start that one fits: the sum of each attention layer's KV cache spec (``static_forward_context``:
    the layers of this rank; layers without a spec, such as the MoE runners, add nothing); 0 without."""
    layers = getattr(getattr(vcfg, "compilation_config", None), "static_forward_context", None) or {}
    kv = 0
    for layer in layers.values():
        get = getattr(layer, "get_kv_cache_spec", None)
        spec = get(vcfg) if callable(get) else None
        if spec is not None:
            kv += int(spec.max_memory_usage_bytes(vcfg))
    return kv


def start_reserve_bytes(vcfg) -> tuple[int, int]:
    """What vLLM needs of the GPU beside the expert pool to start: (the KV cache of one request of
    max_model_len, by vLLM's own count: each attention layer's KV cache spec, as vLLM checks it at start;
    the fixed ``kv_cache_memory_bytes`` where given), (its profile run's activations, an estimate:
    max_num_batched_tokens x hidden x 2 bytes x (top_k + 8): the routed experts' rows per pick and a few
    hidden-sized tensors). 0 for what the config does not say."""
    fixed = getattr(getattr(vcfg, "cache_config", None), "kv_cache_memory_bytes", None)
    kv = int(fixed) if fixed else kv_one_request_bytes(vcfg)
    tokens = getattr(getattr(vcfg, "scheduler_config", None), "max_num_batched_tokens", None) or 0
    model = getattr(vcfg, "model_config", None)
    hidden = model.get_hidden_size() if hasattr(model, "get_hidden_size") else 0
    top_k = getattr(getattr(model, "hf_config", None), "num_experts_per_tok", None) or 8
    return kv, int(tokens * hidden * 2 * (top_k + 8))


def auto_capacity_bytes(off, vcfg) -> int:
    """The default pool: half of what vLLM's memory budget leaves after the weights loaded so far
    (the other half stays for KV cache and activations), but never so much that vLLM's KV cache would
    not hold one request of max_model_len beside its activations (``start_reserve_bytes``: vLLM refuses
    to start then), capped at the rank's expert bytes; 0 on CPU (the "device" is host memory: layer
    streaming). Where that request's KV cache leaves no room for one expert per layer, which the half
    would have held, UnsupportedError names the --max-model-len that leaves the half (decode would
    otherwise stream every expert at every step)."""
    if off.device.type != "cuda":
        return 0
    util = float(getattr(getattr(vcfg, "cache_config", None), "gpu_memory_utilization", 0.9) or 0.9)
    free, total = torch.cuda.mem_get_info(off.device)
    budget = util * total - (total - free)
    expert_bytes = sum(s.nbytes for s in off.cache.expert_specs)
    layer_bytes = off.cache.num_experts * expert_bytes
    budget -= (off.options.lookahead + 1) * layer_bytes  # the layer buffers come first
    experts_bytes = layer_bytes * len(off.targets)
    kv, act = start_reserve_bytes(vcfg)
    half = min(experts_bytes, budget / 2)
    pool = int(max(0.0, min(half, budget - kv - act)))
    if pool >= half:
        return pool
    length = getattr(getattr(vcfg, "model_config", None), "max_model_len", None)
    minimum = expert_bytes * len(off.targets)  # one expert per layer
    if pool < minimum <= half:  # the KV cache took it all: decode would stream every expert at every step
        why = (f"vLLM's KV cache for one request of max_model_len {length} ({kv / 2**30:.2f} GiB) and its activations "
               f"(~{act / 2**30:.2f} GiB) leave no room for the expert pool in the {budget / 2**30:.2f} GiB this GPU has "
               "after the weights and layer buffers (decode would stream every expert at every step)")
        fixed = getattr(getattr(vcfg, "cache_config", None), "kv_cache_memory_bytes", None)
        per_token = kv / length if length and not fixed else 0.0
        fit = int((budget - half - act) / per_token) // 1024 * 1024 if per_token else 0  # KV + act beside the half
        if fit > 0:
            fix = f"pass --max-model-len {fit} or less (a pool of {half / 2**30:.2f} GiB)"
        elif fixed:
            fix = "give vLLM a smaller kv_cache_memory_bytes"
        else:
            fix = "raise --gpu-memory-utilization, or use more GPUs (--tensor-parallel-size)"
        raise UnsupportedError(why, fix + ", or --mmap-expert-cache-gib 0 to stream every layer anyway")
    log.info("mmap-offload: expert pool %.2f GiB, not half of the %.2f GiB left: vLLM's KV cache needs %.2f GiB for "
             "one request of max_model_len %s, its activations ~%.2f GiB (a shorter --max-model-len leaves the "
             "pool more)", pool / 2**30, max(budget, 0) / 2**30, kv / 2**30, length, act / 2**30)
    return pool


__all__ = ["Residency", "auto_capacity_bytes", "kv_one_request_bytes", "start_reserve_bytes"]
