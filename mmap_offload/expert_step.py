"""The expert cache's decode step for one layer in one native call (csrc/route_step.c).

``ExpertStep.run(layer, ids)`` does what the vLLM backend's expert mode did in Python per MoE
layer (``Residency._routed`` + ``ExpertCache.ensure`` + the slot map): the routed ids to the host,
their distinct experts, hits and misses against the layer's pool, the misses' slots by the cache's
eviction policy, one stream-ordered batch of their copies, and the kernel's slot ids, written to a
device buffer of the layer's own. On the H200's host the Python version cost ~1.1 ms per layer
(docs/BENCHMARKS.md, session 7); this is one ctypes call plus the ticket's bookkeeping.

It serves the common case only and says so instead of guessing: ``run`` returns ``(slot_ids,
used)`` with ``slot_ids`` None where the Python path must serve the call, ``used`` (the distinct
experts, sorted) then telling the caller which path (more than the pool's slots: sparse or layer
mode). The Python path takes a call whose misses were never fetched before (the first-use check
and the source addresses are made there), a pool with hints in flight, an engine that refuses the
batch. Both paths share the cache's state (its numpy arrays: slot map, owners, policy scores, call
clock), so they may alternate freely; tests/test_expert_step.py runs both on the same trace and
compares slots, counters and bytes.

Requirements (``ExpertStep.create`` returns None otherwise): the mmap engine's native pool with an
ordered part of its ring, a cache with ``stream_ordered``, per-layer pools, at most 1024 experts.
On CUDA the ids and slot ids go through pinned staging on the current stream; on CPU they are read
and written in place and the batch is waited for at once (as ``ensure`` does there)."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import torch

from .expert_cache import _Pending
from .transfer.native_pool import native_copy_lib
from .transfer.ticket import Ticket

__all__ = ["ExpertStep"]

# csrc/route_step.c
_SPARSE, _PYTHON, _RANGE, _CUDA, _COPY, _CLOSED, _INVALID = -10, -11, -12, -13, -14, -15, -16
_OUT_USED, _OUT_MISSES, _OUT_HITS, _OUT_EVICTIONS, _OUT_HINT_USED, _OUT_HINT_WASTED, _OUT_PIECES, _OUT_DETAIL = range(8)
_OUT_HEAD = 8
_MAX_EXPERTS = 1024
_POLICY = {"lfu-decay": 0, "lfu": 1, "lru": 2}

_vp, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Step(ctypes.Structure):
    """csrc/route_step.c ``mo_step``: one layer's arrays and staging."""

    _fields_ = [
        ("memcpy_async", _vp), ("event_record", _vp), ("event_sync", _vp), ("event", _vp),
        ("E", _i64), ("S", _i64), ("T", _i64), ("policy", _i64), ("window", _i64), ("lam", _f64),
        ("li", _i64), ("now", _vp), ("lut", _vp), ("last", _vp), ("logscore", _vp),
        ("owner_li", _vp), ("owner_e", _vp), ("use_call", _vp), ("used", _vp), ("hinted", _vp),
        ("pinned", _vp), ("verified", _vp), ("src", _vp), ("dst", _vp), ("offs", _vp), ("sizes", _vp),
        ("pieces", _vp), ("slot_bytes", _i64), ("min_chunk", _i64), ("chunk_div", _i64), ("align", _i64),
        ("gates", _i64), ("min_group", _i64), ("ids_host", _vp), ("slot_host", _vp), ("slot_dev", _vp),
        ("cap", _i64),
    ]


def _typed_lib() -> Any:
    lib = native_copy_lib()
    if lib is None or not hasattr(lib, "mo_step_run"):
        return None
    lib.mo_step_abi.restype = _i64
    if lib.mo_step_abi() != ctypes.sizeof(_Step):
        return None
    lib.mo_step_run.restype = _i64
    lib.mo_step_run.argtypes = [_vp, _vp, _i64, _i64, _vp, _vp, _vp, _vp, _vp]
    return lib


def _addr(a: np.ndarray) -> int:
    return a.ctypes.data


class ExpertStep:
    """The native decode step over one ``ExpertCache`` (module docstring). ``max_ids``: the most
    routed ids (tokens x top_k) a call may carry; larger calls take the Python path."""

    @classmethod
    def create(cls, ec, max_ids: int = 4096) -> "ExpertStep | None":
        """An ExpertStep for ``ec``, or None where its requirements do not hold (module docstring)."""
        engine = ec.engine
        pool = engine.native_ordered() if hasattr(engine, "native_ordered") else None
        if (pool is None or not ec.stream_ordered or len(ec._pools) != len(ec.layers)
                or ec.num_experts > _MAX_EXPERTS or getattr(engine, "submit_ordered_raw", None) is None
                or (ec.verify_first_use and not hasattr(ec.cache, "clean_mask"))):
            return None
        lib = _typed_lib()
        return cls(ec, lib, pool, max_ids) if lib is not None else None

    def __init__(self, ec, lib, pool, max_ids: int):
        self.ec, self.lib, self.pool, self.engine = ec, lib, pool, ec.engine
        self.device = ec.device
        self.cuda = self.device.type == "cuda"
        self.cap = int(max_ids)
        self._out = np.zeros(_OUT_HEAD + ec.num_experts + 2 * ec.slots_per_pool, dtype=np.int64)
        self._steps: dict[tuple[int, torch.dtype], tuple[_Step, torch.Tensor, Any]] = {}
        self._keep: list[Any] = []  # arrays and tensors the structs point into
        self._gen = None
        self._spare: tuple[Ticket, np.ndarray, int] | None = None
        self._views: dict[tuple, torch.Tensor] = {}
        self._ids_staging: dict[torch.dtype, torch.Tensor] = {}
        self.pairs: list[tuple[int, int]] = []  # (expert, slot) filled by the last call it served
        self._event = None
        self._api = None
        if self.cuda:
            from .transfer.native_pool import _cuda_runtime_api

            api = _cuda_runtime_api()
            if api is None:
                raise RuntimeError("the CUDA runtime torch uses was not found")
            self._api = (api[0], api[2], api[3])  # cudaMemcpyAsync, cudaEventRecord, cudaEventSynchronize
            self._event = torch.cuda.Event()
            self._event.record()  # makes the handle
            self._stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        # runs: calls of run(); served: those it served whole; python / sparse: handed back
        self.metrics = dict(runs=0, served=0, python=0, sparse=0, seconds=0.0)

    # -- set-up per (layer, ids dtype) ---------------------------------------------------------
    def _struct(self, li: int, dtype: torch.dtype) -> tuple[_Step, torch.Tensor, Any]:
        gen = self.engine.map_generation
        if gen != self._gen:  # the engine's mappings were made anew: addresses from scratch
            self._steps.clear()
            self._views.clear()
            self._gen = gen
        key = (li, dtype)
        got = self._steps.get(key)
        if got is not None:
            return got
        ec = self.ec
        pool = ec._pool_of[li]
        src, offs, sizes, _ = ec._raw_plan()
        layer = ec.layers[li]
        for e in np.flatnonzero(src[li] == 0).tolist():  # every expert's address now: no first-use fallbacks
            ext = ec._extent(li, e)
            src[li, e] = self.engine.mapped_address(ext.path) + int(ext.offset)
        clean = ec.cache.clean_mask(layer) if ec.verify_first_use else None
        dst = ec._slot_addresses(pool)
        T = int(len(sizes))
        pin = self.cuda
        slot_host = torch.empty(self.cap, dtype=dtype, pin_memory=pin)
        slot_dev = torch.empty(self.cap, dtype=dtype, device=self.device) if self.cuda else slot_host
        ids_host = self._ids_host(dtype)
        pieces = np.zeros(pool.size * T * 3, dtype=np.uint64)
        rows = (ec._lut[li], ec._last[li], ec._logscore[li], src[li], offs, sizes, pieces, dst) + (
            (clean,) if clean is not None else ())
        if not all(a.flags.c_contiguous for a in rows):  # the C step reads them as flat arrays
            raise AssertionError("the expert cache's arrays must be C-contiguous")
        eng = self.engine
        st = _Step(
            E=ec.num_experts, S=pool.size, T=T, policy=_POLICY[ec.policy], window=len(ec.layers), lam=ec._lam,
            li=li, now=_addr(ec._clock), lut=_addr(ec._lut[li]), last=_addr(ec._last[li]),
            logscore=_addr(ec._logscore[li]), owner_li=_addr(pool.owner_li), owner_e=_addr(pool.owner_e),
            use_call=_addr(pool.use_call), used=_addr(pool.used), hinted=_addr(pool.hinted), pinned=_addr(pool.pinned),
            verified=_addr(clean) if clean is not None else None, src=_addr(src[li]),
            dst=_addr(dst), offs=_addr(offs), sizes=_addr(sizes), pieces=_addr(pieces),
            slot_bytes=eng.ring.slot_bytes, min_chunk=eng.min_chunk_bytes,
            chunk_div=eng.chunks_per_thread * eng.threads, align=4096,
            gates=eng.ordered_gates, min_group=eng.ORDERED_MIN_GROUP,
            ids_host=ids_host.data_ptr() if ids_host is not None else None, slot_host=slot_host.data_ptr(),
            slot_dev=slot_dev.data_ptr(), cap=self.cap,
        )
        if self.cuda:
            st.memcpy_async, st.event_record, st.event_sync = self._api
            st.event = self._event.cuda_event
        self._keep.append((rows, slot_host, slot_dev, ids_host))
        got = self._steps[key] = (st, slot_dev, ctypes.byref(st))
        return got

    def _ids_host(self, dtype: torch.dtype) -> torch.Tensor | None:
        """CUDA: the pinned staging the ids are copied into (one per dtype: a call copies, waits and
        reads it before returning)."""
        if not self.cuda:
            return None
        t = self._ids_staging.get(dtype)
        if t is None:
            t = self._ids_staging[dtype] = torch.empty(self.cap, dtype=dtype, pin_memory=True)
        return t

    # -- the step ------------------------------------------------------------------------------
    def run(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor | None, np.ndarray]:
        """Serve layer ``layer``'s routed ``ids`` (device tensor, int32 or int64): returns
        (slot ids shaped like ``ids``, the distinct experts) or (None, the distinct experts) where
        the Python path must serve the call (module docstring); (None, None) where the ids were not
        even read (too many, or hints in flight: the caller reads them itself)."""
        t0 = time.perf_counter()
        ec = self.ec
        li = ec._li(layer)
        nk = ids.numel()
        if nk > self.cap or ec._pool_of[li].pending or ids.dtype not in (torch.int32, torch.int64):
            return None, None
        if not ids.is_contiguous():
            ids = ids.contiguous()
        st, slot_dev, ref = self._struct(li, ids.dtype)
        ticket, status, ev = self._spare or self._prepare()
        self._spare = None
        if self.cuda:
            stream = (self._stream_of(self._index) if self._stream_of is not None
                      else torch.cuda.current_stream(self.device).cuda_stream)
        else:
            stream = self.pool._fake_stream
        out = self._out
        h = self.pool._enter(closing_ok=False)
        if not h:
            raise RuntimeError("transfer engine is closed")
        try:
            rc = self.lib.mo_step_run(ref, ids.data_ptr(), nk, ids.element_size(), h, stream,
                                      status.ctypes.data, ev, out.ctypes.data)
        finally:
            self.pool._leave()
        self.metrics["runs"] += 1
        queued = rc > 0 or rc == _COPY
        if not queued:
            self._spare = (ticket, status, ev)
        else:  # raises the copies' CUDA error (_COPY: the slots were emptied, not filled)
            self.engine.adopt_ordered(ticket, int(out[_OUT_PIECES]), int(out[_OUT_MISSES]) * ec.expert_nbytes)
        if rc >= 0:
            self._account(li, ticket if queued else None)
        used = out[_OUT_HEAD : _OUT_HEAD + int(out[_OUT_USED])].copy() if rc not in (_RANGE, _CUDA) else None
        self.metrics["seconds"] += time.perf_counter() - t0
        if rc >= 0:
            self.metrics["served"] += 1
            v = self._views.get((li, nk, tuple(ids.shape)))
            if v is None:
                v = self._views[(li, nk, tuple(ids.shape))] = slot_dev[:nk].view(ids.shape)
            return v, used
        if rc == _SPARSE:
            self.metrics["sparse"] += 1
            return None, used
        if rc == _PYTHON:
            self.metrics["python"] += 1
            return None, used
        if rc == _RANGE:
            raise IndexError(f"expert ids must be in [0, {ec.num_experts}), got {int(out[_OUT_DETAIL])}")
        if rc == _CUDA:
            raise RuntimeError(f"copying the routed ids or slot ids failed with CUDA error {int(out[_OUT_DETAIL])}")
        if rc == _CLOSED:
            raise RuntimeError("transfer engine is closed")
        raise MemoryError(f"the native expert step refused a call of {nk} ids (rc {rc})")  # _INVALID

    def _prepare(self) -> tuple[Ticket, np.ndarray, int]:
        ticket = Ticket(0, 1)
        status, ev = self.pool.prepare_ordered(ticket, lambda addr: self.engine._fault_error(addr, ()))
        return ticket, status, ev

    def _account(self, li: int, ticket: Ticket | None) -> None:
        """The cache's counters and ticket bookkeeping for a call the C step served."""
        ec, out = self.ec, self._out
        m, nb = ec.metrics, ec.expert_nbytes
        nu, nm = int(out[_OUT_USED]), int(out[_OUT_MISSES])
        m["calls"] += 1
        m["routed_bytes"] += nu * nb
        m["hits"] += int(out[_OUT_HITS])
        m["misses"] += nm
        m["miss_bytes"] += nm * nb
        m["evictions"] += int(out[_OUT_EVICTIONS])
        m["hint_used"] += int(out[_OUT_HINT_USED])
        m["hint_wasted"] += int(out[_OUT_HINT_WASTED])
        base = _OUT_HEAD + ec.num_experts
        flat = out[base : base + 2 * nm].tolist()
        self.pairs = list(zip(flat[0::2], flat[1::2]))
        if ticket is None:
            return
        m["bytes_moved"] += nm * nb
        m["ordered_fills"] += 1
        pool = ec._pool_of[li]
        pend = _Pending(ticket, ordered=True)
        for _, s in self.pairs:
            pool.fill_of[s] = pend
        if ec._defer_checks:  # the stream waits for it; its reads are checked later (check_ordered)
            ec._unchecked.append((pool, pend))
            return
        try:  # CPU: waited for at once, as ensure does there
            ec._wait(pend)
        except BaseException:
            ec._drop_failed(pool, pend)
            raise

    def summary(self) -> dict[str, float]:
        return dict(self.metrics)

