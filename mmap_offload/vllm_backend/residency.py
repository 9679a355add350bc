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
              Bytes over PCIe = the routed misses, as UVA's; the pool is not changed.
    layer     the step routes more than ``layer_stream_fraction`` of the layer's experts
              (prefill, large batches): the whole layer comes through the ``LayerPrefetcher``
              buffers (the next layer is started ahead), ids pass unchanged.

The host learns the routed experts with one small device->host copy per layer (a bincount over
the ids, E integers), the price of fetching only what is routed. Per call nothing else is
allocated but the slot ids (and the bincount) from vLLM's caching allocator: the pools, maps and
pinned staging are made once.

``routing_trace`` (a benchmark option) replaces the router's ids by a CSV trace's, to measure real
routing on a random model; outputs then differ from the model's own (clearly labelled in metrics).
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedError
from ..expert_cache import ExpertCache
from ..transfer import Copy


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
        )
        self.slots = self.ec.slots_per_pool
        # above this many distinct experts a layer is streamed whole
        self.threshold = max(1, int(opts.layer_stream_fraction * self.num_experts))
        E = self.num_experts
        pin = self.device.type == "cuda"
        self._map = {t.index: torch.full((E,), -1, dtype=torch.int32, device=self.device) for t in off.targets}
        self._map_host = {t.index: torch.empty((E,), dtype=torch.int32, pin_memory=pin) for t in off.targets}
        self._counts_host = torch.empty((E,), dtype=torch.int8, pin_memory=pin)
        self._used_dev = torch.zeros((E,), dtype=torch.int8, device=self.device)
        self._event = torch.cuda.Event() if pin else None
        self._bound: dict[int, str] = {}  # target index -> "pool" | "layer"
        self._twins: dict[str, torch.Tensor] = {}  # CPU platform transform: kernel layout of the pool
        self.trace = None
        if opts.routing_trace:
            from .. import traces

            self.trace = traces.read_csv(opts.routing_trace)  # [steps, layers, batch, top_k]
        self._step = 0
        self._idx_host = torch.empty((2, E), dtype=torch.int64, pin_memory=pin)  # sparse: rows, slots
        self.metrics: dict[str, Any] = dict(expert_calls=0, sparse_calls=0, layer_calls=0, route_s=0.0,
                                            sparse_miss_bytes=0, trace=bool(self.trace is not None))

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
        for name in t.served:
            buf = tensors[name]
            getattr(t.experts, name).data = buf.data if isinstance(buf, torch.nn.Parameter) else buf
        self._bound[t.index] = "layer"

    # -- the step -------------------------------------------------------------------------------
    def _routed(self, ids: torch.Tensor) -> np.ndarray:
        """Sorted distinct expert ids routed in ``ids`` (one E-byte device->host copy on CUDA)."""
        if ids.device.type != "cuda":
            return np.unique(ids.reshape(-1).numpy())
        used = self._used_dev
        used.zero_()
        used.index_fill_(0, ids.reshape(-1).long(), 1)  # no sync (bincount syncs for its size)
        self._counts_host.copy_(used, non_blocking=True)
        self._event.record()
        self._event.synchronize()
        return np.flatnonzero(self._counts_host.numpy())

    def _expected_distinct(self, n_tokens: int, top_k: int) -> float:
        E = self.num_experts
        return E * (1.0 - (1.0 - min(top_k, E) / E) ** n_tokens)

    def route(self, t, topk_weights: torch.Tensor, topk_ids: torch.Tensor):
        """Make the routed experts of layer ``t`` resident; return (weights, ids) for the kernel."""
        t0 = time.perf_counter()
        with torch.inference_mode(False):
            if self.trace is not None:
                topk_ids = self._trace_ids(t, topk_ids)
            n, k = int(topk_ids.shape[0]), int(topk_ids.shape[-1])
            if self._expected_distinct(n, k) > self.threshold:
                out = self._layer_mode(t, topk_ids, ahead=True)
            else:
                used = self._routed(topk_ids)
                if len(used) <= self.slots:
                    out = self._expert_mode(t, topk_ids, used)
                elif len(used) <= self.threshold:
                    out = self._sparse_mode(t, topk_ids, used)
                else:
                    out = self._layer_mode(t, topk_ids, ahead=False)
        if t.index == len(self.off.targets) - 1:
            self._step += 1
        self.metrics["route_s"] += time.perf_counter() - t0
        return topk_weights, out

    def _layer_mode(self, t, ids: torch.Tensor, ahead: bool) -> torch.Tensor:
        self.metrics["layer_calls"] += 1
        self._bind_layer(t, self.off._layer_tensors(t))
        if ahead and len(self.off.targets) > 1:
            pf = self.off.prefetcher
            pf.start_prefetch(pf.layer_after(t.layer, 1))  # a distinct buffer (any 2 consecutive are)
        return ids

    def _sparse_mode(self, t, ids: torch.Tensor, used: np.ndarray) -> torch.Tensor:
        self.metrics["sparse_calls"] += 1
        off, ec = self.off, self.ec
        if off.options.verify_first_use:
            self.cache.check_layer_once(t.layer)
        tensors, after = off.prefetcher.claim(t.layer)
        row = ec.slot_map(t.layer)
        slots = row[used]
        misses, hits = used[slots < 0], used[slots >= 0]
        if len(misses):
            cache, specs = self.cache, self.ec.specs
            copies = [Copy(src=cache.expert_extent(t.layer, int(e)),
                           dst=[(sp.offset, sp.nbytes, tensors[sp.name].data[int(e)]) for sp in specs])
                      for e in misses]
            ticket = off.engine.submit(copies, after=after) if after is not None else off.engine.submit(copies)
            self.metrics["sparse_miss_bytes"] += len(misses) * ec.expert_nbytes
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
        if len(misses):
            off.engine.wait(ticket)
        layer_tensors = tensors
        if off._transforms:  # CPU prepacked kernels: the buffer's kernel-layout twin, whole
            b = off.prefetcher.buffer_index(t.layer)
            twin = off._kernel_buffers[b]
            for name, fn in off._transforms.items():
                fn(tensors[name].data, twin[name])
            off._kernel_layer[b] = None  # holds some experts of a layer, not a whole one
            layer_tensors = {**tensors, **twin}
        self._bind_layer(t, layer_tensors)
        return ids

    def _expert_mode(self, t, ids: torch.Tensor, used: np.ndarray) -> torch.Tensor:
        self.metrics["expert_calls"] += 1
        ec = self.ec
        before = ec.slot_map(t.layer)[used].copy() if self.off._transforms else None
        ec.ensure(t.layer, used)
        row = ec.slot_map(t.layer)
        if self.off._transforms:  # CPU prepacked kernels: transform the slots just filled
            pool = ec.slots(t.layer)
            for e in used[before < 0]:
                s = int(row[e])
                for name, fn in self.off._transforms.items():
                    fn(pool[name][s : s + 1], self._twin(t, name, pool[name])[s : s + 1])
        self._bind_pool(t)
        m, mh = self._map[t.index], self._map_host[t.index]
        mh.numpy()[:] = row
        m.copy_(mh, non_blocking=m.is_cuda)
        slot_ids = torch.index_select(m, 0, ids.reshape(-1)).view(ids.shape)
        return slot_ids if slot_ids.dtype == ids.dtype else slot_ids.to(ids.dtype)

    def _trace_ids(self, t, ids: torch.Tensor) -> torch.Tensor:
        """The trace's ids for (step, layer position), its batch tiled over the step's tokens."""
        tr = self.trace
        row = tr[self._step % tr.shape[0], t.index % tr.shape[1]]  # [batch, top_k]
        k = ids.shape[-1]
        if row.shape[-1] < k or int(row.max()) >= self.num_experts:
            raise UnsupportedError(
                f"routing trace {self.off.options.routing_trace} has top-{row.shape[-1]} over experts up to "
                f"{int(row.max())}; the model routes top-{k} of {self.num_experts}",
                "use a trace made for this model",
            )
        n = ids.shape[0]
        full = np.tile(row[:, :k], (math.ceil(n / row.shape[0]), 1))[:n]
        return torch.from_numpy(np.ascontiguousarray(full)).to(device=ids.device, dtype=ids.dtype)

    def summary(self) -> dict[str, Any]:
        out = dict(self.metrics)
        out.update({f"pool_{k}": v for k, v in self.ec.summary().items()})
        out["pool_slots_per_layer"] = self.slots
        out["pool_bytes"] = self.ec.capacity_bytes
        out["layer_stream_threshold"] = self.threshold
        return out


def auto_capacity_bytes(off, vcfg) -> int:
    """The default pool: half of what vLLM's memory budget leaves after the weights loaded so far
    (the other half stays for KV cache and activations), capped at the rank's expert bytes; 0 on
    CPU (the "device" is host memory: layer streaming)."""
    if off.device.type != "cuda":
        return 0
    util = float(getattr(getattr(vcfg, "cache_config", None), "gpu_memory_utilization", 0.9) or 0.9)
    free, total = torch.cuda.mem_get_info(off.device)
    budget = util * total - (total - free)
    layer_bytes = off.cache.num_experts * sum(s.nbytes for s in off.cache.expert_specs)
    budget -= (off.options.lookahead + 1) * layer_bytes  # the layer buffers come first
    experts_bytes = layer_bytes * len(off.targets)
    return int(max(0.0, min(experts_bytes, budget / 2)))


__all__ = ["Residency", "auto_capacity_bytes"]
