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
mode). The Python path takes a call with a miss the cache has not checked yet (the first-use check
runs there; ``Cache.clean_mask`` says which experts any check found clean, the background one
included), a pool with hints in flight, an engine that refuses the batch. Both paths share the cache's state (its numpy arrays: slot map, owners, policy scores, call
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
(_OUT_USED, _OUT_MISSES, _OUT_HITS, _OUT_EVICTIONS, _OUT_HINT_USED, _OUT_HINT_WASTED, _OUT_PIECES, _OUT_DETAIL,
 _OUT_ADMITTED) = range(9)
_OUT_HEAD = 9
_MAX_EXPERTS = 1024
_POLICY = {"lfu-decay": 0, "lfu": 1, "lru": 2}

_vp, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Step(ctypes.Structure):
    """csrc/route_step.c ``mo_step``: one layer's arrays and staging."""

    _fields_ = [
        ("host_ids", _i64), ("memcpy_async", _vp), ("event_record", _vp), ("event_sync", _vp), ("event", _vp),
        ("E", _i64), ("S", _i64), ("T", _i64), ("policy", _i64), ("window", _i64), ("lam", _f64),
        ("li", _i64), ("now", _vp), ("lut", _vp), ("last", _vp), ("logscore", _vp),
        ("owner_li", _vp), ("owner_e", _vp), ("use_call", _vp), ("used", _vp), ("hinted", _vp),
        ("pinned", _vp), ("verified", _vp), ("src", _vp), ("dst", _vp), ("offs", _vp), ("sizes", _vp),
        ("pieces", _vp), ("pieces_cap", _i64), ("slot_bytes", _i64), ("min_chunk", _i64), ("chunk_div", _i64), ("align", _i64),
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
    lib.mo_step_sparse.restype = _i64
    lib.mo_step_sparse.argtypes = [_vp, _vp, _vp, _i64, _vp, _vp, _vp, _vp, _vp]
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
        self._keep: dict[tuple[int, torch.dtype], Any] = {}  # the arrays a struct points into
        # (layer position, ids dtype) -> (pinned slot ids, device slot ids): made once, kept for the
        # run (a raw copy from them may still be queued when a struct is made anew)
        self._buffers: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
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
        else:  # the sparse step's copies go through the pool's CPU stand-in stream, waited for here
            from .transfer.native_pool import _FakeEvent

            self._api = tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in (
                "mo_fake_memcpy_async", "mo_fake_event_record", "mo_fake_event_sync"))
            self._event = _FakeEvent(lib)
        self._sparse_li: tuple[int, Any] | None = None  # (layer position, struct) of a run() handed back as sparse
        # id(rows) -> (rows, bases, strides): a layer buffer's dict (the prefetcher's, one per buffer)
        self._rows: dict[int, tuple[Any, np.ndarray, np.ndarray]] = {}
        self.last_misses = 0  # experts the last call served read from the cache
        self.last_hits = 0  # ... and found in the pool (run_sparse)
        # runs: calls of run(); served: those it served whole; python / sparse: handed back
        # sparse_served: run_sparse calls it served whole
        self.metrics = dict(runs=0, served=0, python=0, sparse=0, sparse_served=0, seconds=0.0)

    # -- set-up per (layer, ids dtype) ---------------------------------------------------------
    def _struct(self, li: int, dtype: torch.dtype) -> tuple[_Step, torch.Tensor, Any]:
        gen = self.engine.map_generation
        if gen != self._gen:  # the engine's mappings were made anew: addresses from scratch
            self._steps.clear()
            self._gen = gen
        key = (li, dtype)
        got = self._steps.get(key)
        if got is not None:
            return got
        ec = self.ec
        pool = ec._pool_of[li]
        ec._source_addresses(li, np.arange(ec.num_experts))  # every expert's now: no first-use fallbacks
        src, offs, sizes, _ = ec._raw_plan()
        layer = ec.layers[li]
        clean = ec.cache.clean_mask(layer) if ec.verify_first_use else None
        dst = ec._slot_addresses(pool)
        T = int(len(sizes))
        bufs = self._buffers.get(key)
        if bufs is None:
            slot_host = torch.empty(self.cap, dtype=dtype, pin_memory=self.cuda)
            slot_dev = torch.empty(self.cap, dtype=dtype, device=self.device) if self.cuda else slot_host
            bufs = self._buffers[key] = (slot_host, slot_dev)
        slot_host, slot_dev = bufs
        ids_host = self._ids_host(dtype)
        pieces = np.zeros(ec.num_experts * T * 3, dtype=np.uint64)
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
            dst=_addr(dst), offs=_addr(offs), sizes=_addr(sizes), pieces=_addr(pieces), pieces_cap=pieces.size,
            host_ids=0 if self.cuda else 1,
            slot_bytes=eng.ring.slot_bytes, min_chunk=eng.min_chunk_bytes,
            chunk_div=eng.chunks_per_thread * eng.threads, align=4096,
            gates=eng.ordered_gates, min_group=eng.ORDERED_MIN_GROUP,
            ids_host=ids_host.data_ptr() if ids_host is not None else None, slot_host=slot_host.data_ptr(),
            slot_dev=slot_dev.data_ptr(), cap=self.cap,
        )
        st.memcpy_async, st.event_record, st.event_sync = self._api
        st.event = self._event.cuda_event if self.cuda else self._event.handle
        self._keep[key] = rows
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
        rc, ticket, status, ev = self._call(self.lib.mo_step_run, ref, ids.data_ptr(), nk, ids.element_size())
        out = self._out
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
        self._sparse_li = (li, ref) if rc == _SPARSE else None
        if rc >= 0:
            self.metrics["served"] += 1
            self.last_misses = int(out[_OUT_MISSES])
            key = (li, ids.dtype, tuple(ids.shape))  # on CPU the batch was waited for in _account
            v = self._views.get(key)
            if v is None:
                v = self._views[key] = slot_dev[:nk].view(ids.shape)
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

    def row_arrays(self, rows: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """(bases, strides) of a layer buffer's tensors (``ExpertCache._row_addresses``), made once
        per buffer dict and kept (the C calls read them by address)."""
        got = self._rows.get(id(rows))
        if got is None or got[0] is not rows:
            bases, strides = self.ec._row_addresses(rows)
            got = self._rows[id(rows)] = (rows, bases, strides)
        return got[1], got[2]

    def run_sparse(self, layer: int, rows: dict[str, torch.Tensor], max_admit: int = 4) -> bool:
        """Right after ``run(layer, ...)`` handed back more distinct experts than the pool holds:
        fill ``rows`` (the layer's buffer, ``{name: [E, ...]}``) with exactly those experts (misses
        from the cache by one stream-ordered batch, hits from their pool slots on the device) and
        let the pool learn from the call (``ExpertCache.admit`` with ``max_admit``), in one native
        call. False, with nothing changed, where the Python path must do it (a first use, a batch
        the engine refuses, no such run() just before)."""
        pending, self._sparse_li = self._sparse_li, None
        ec = self.ec
        li = ec._li(layer)
        if pending is None or pending[0] != li or ec._pool_of[li].pending:
            return False
        t0 = time.perf_counter()
        ref = pending[1]
        bases, strides = self.row_arrays(rows)
        rc, ticket, status, ev = self._call(self.lib.mo_step_sparse, ref, bases.ctypes.data, strides.ctypes.data,
                                            int(max_admit))
        out = self._out
        nm = int(out[_OUT_MISSES]) if rc >= 0 or rc in (_COPY, _CUDA) else 0
        queued = nm > 0
        if not queued:
            self._spare = (ticket, status, ev)
        else:  # raises the copies' CUDA error (_COPY)
            self.engine.adopt_ordered(ticket, int(out[_OUT_PIECES]), nm * ec.expert_nbytes)
        if rc in (_PYTHON, _INVALID, _CLOSED):
            return False
        self.metrics["sparse_served"] += 1
        self.last_misses, self.last_hits = nm, int(out[_OUT_HITS])
        na = int(out[_OUT_ADMITTED])
        base = _OUT_HEAD + ec.num_experts
        flat = out[base : base + 2 * na].tolist()
        self.pairs = list(zip(flat[0::2], flat[1::2]))
        pool = ec._pool_of[li]
        m = ec.metrics
        m["admitted"] += na
        m["evictions"] += int(out[_OUT_EVICTIONS])
        m["hint_wasted"] += int(out[_OUT_HINT_WASTED])
        if not self.cuda:  # every copy of the call (the batch's, the hits', the admissions') has run
            self._drain_cpu_stream()
        if queued:  # the admitted slots' bytes came from the batch's rows: its failure forgets them
            pend = _Pending(ticket, ordered=True)
            for _, s in self.pairs:
                pool.fill_of[s] = pend
            if ec._defer_checks:
                ec._unchecked.append((pool, pend))
            else:
                try:
                    ec._wait(pend)
                except BaseException:
                    ec._drop_failed(pool, pend)
                    raise
        else:
            for _, s in self.pairs:
                pool.fill_of.pop(s, None)
        self.metrics["seconds"] += time.perf_counter() - t0
        if rc == _CUDA:
            raise RuntimeError(f"a device copy of the sparse step failed with CUDA error {int(out[_OUT_DETAIL])}")
        return True

    def _call(self, fn, *args) -> tuple[int, Ticket, np.ndarray, int]:
        """``fn(*args, pool, stream, status, event, out)`` with a prepared ticket (the spare one left
        by a call that queued nothing, else a new one) and a use of the pool counted: (its result,
        the ticket, its status words, its event handle)."""
        ticket, status, ev = self._spare or self._prepare()
        self._spare = None
        stream = self._stream() if self.cuda else self.pool._fake_stream
        h = self.pool._enter(closing_ok=False)
        if not h:
            self._spare = (ticket, status, ev)
            raise RuntimeError("transfer engine is closed")
        try:
            rc = fn(*args, h, stream, status.ctypes.data, ev, self._out.ctypes.data)
        finally:
            self.pool._leave()
        return rc, ticket, status, ev

    def _stream(self) -> int:
        return (self._stream_of(self._index) if self._stream_of is not None
                else torch.cuda.current_stream(self.device).cuda_stream)

    def _drain_cpu_stream(self) -> None:
        """CPU: wait until the stand-in stream ran every copy queued so far (the CPU kernels read
        the destinations at once)."""
        self.lib.mo_fake_event_record(self._event.handle, self.pool._fake_stream)
        self._event.synchronize()

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

