"""The mmap engine (warm path): persistent read-only mappings -> pinned ring -> device, by the
native pool (default) or Python threads (fallback). See the package docstring for the contract."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..cache_format import ALIGNMENT
from ..errors import MmapOffloadError, UnsupportedError
from ..pinned import (
    CUDA_HOST_REGISTER_READ_ONLY, RingClosedError, Slot, account_window, cuda_host_register,
    cuda_host_unregister, page_align_up,
)
from . import native_pool
from .native_pool import _NATIVE_COPY_KINDS, _has_erms, _NativePool
from .pagecache import _MappedFile
from .ring import MIN_CHUNK_BYTES, _copier, _RingEngine, _WorkerStats
from .ticket import Copy, Ticket, _Chunk

NATIVE_MIN_CHUNK_BYTES = 512 << 10  # MIN_CHUNK_BYTES for the native pool (no Python per chunk)

class MmapEngine(_RingEngine):
    """Warm path: persistent read-only mappings -> pinned ring (memcpy, GIL released) -> device."""

    kind = "mmap"

    def __init__(self, device: torch.device, *, pinned_bytes: int = 256 << 20,
                 slot_bytes: int = 4 << 20, threads: int = 8, direct_threads: int = 0,
                 direct_depth: int = 2, populate: bool = True, hugepage: bool = True,
                 blocking_events: bool = True, copy_impl: str = "auto", collapse: bool = False,
                 affinity: str | None = None, native: bool | str = "auto", stream_delay_us: int = 0,
                 chunks_per_thread: int | None = None, min_chunk_bytes: int | None = None,
                 ring_hugepage: bool = True, slot_reuse: str = "auto"):
        if slot_reuse not in ("auto", "oldest", "hot"):
            raise ValueError(f"slot_reuse must be 'auto', 'oldest' or 'hot', got {slot_reuse!r}")
        self.affinity = affinity
        self.populate = populate
        self.hugepage = hugepage
        self.collapse = collapse
        self.copy_impl, self._copy = _copier(copy_impl)
        self.direct_depth = max(1, int(direct_depth))
        self._maps: dict[Path, _MappedFile] = {}
        self._maps_lock = threading.Lock()
        self._window_peak = 0
        self._window_now = 0
        lib = self._native_lib(native, copy_impl, affinity)
        # "hot": the pool reuses the newest free slot whose copy completed, so the ring's working
        # set stays in the CPU caches and the DMA reads it from there (the Python workers cannot)
        self.slot_reuse = ("hot" if slot_reuse == "auto" else slot_reuse) if lib is not None else "oldest"
        if copy_impl == "auto" and self.slot_reuse == "hot" and _has_erms():
            # rep movsb for whole-slot chunks (it leaves the lines in the cache, where the DMA
            # reads them: 6-15 points of H2D over non-temporal stores with hot slots), nt4 for
            # small ones (csrc/copy_pool.c, cpu_copy; TRANSFER.md)
            self.copy_impl, self._copy = _copier("mixed")
        # register-window workers need CUDA, or the native pool (its CPU stand-in registry)
        self.direct_threads = int(direct_threads) if device.type == "cuda" or lib is not None else 0
        slot = page_align_up(max(ALIGNMENT, int(slot_bytes)))
        # a window is a chunk (<= one slot) plus the partial pages at both ends
        reserve = self.direct_threads * self.direct_depth * (slot + 2 * ALIGNMENT)
        # pinned only on CUDA (the CPU stand-in registers nothing with the OS)
        self._window_reserve = reserve if device.type == "cuda" else 0
        super().__init__(device, pinned_bytes=pinned_bytes, slot_bytes=slot_bytes,
                         threads=threads, reserve_bytes=reserve, blocking_events=blocking_events,
                         python_workers=lib is None,
                         # the pool's per-chunk cost is a few microseconds: finer chunks pay off
                         chunks_per_thread=chunks_per_thread or (4 if lib is not None else 2),
                         min_chunk_bytes=min_chunk_bytes or (NATIVE_MIN_CHUNK_BYTES if lib is not None
                                                             else MIN_CHUNK_BYTES),
                         ring_hugepage=ring_hugepage)
        self.native = lib is not None
        self._pool: _NativePool | None = None
        if lib is not None:
            base, _, pf = self.copy_impl.partition("-pf")
            try:
                self._pool = _NativePool(lib, device, self.stream, self.ring, self.threads,
                                         _NATIVE_COPY_KINDS[base], int(pf) if pf.isdigit() else 1024,
                                         stream_delay_us, self.direct_threads, self.direct_depth,
                                         hot_slots=self.slot_reuse == "hot")
            except BaseException:
                self.ring.close()
                self.stream.close()
                raise
            if self._window_reserve:  # the pool's windows, counted at their bound while it runs
                account_window(self._window_reserve)
        self._populate_ok = populate
        if self._pool is None:
            for i in range(self.direct_threads):
                self._workers.append(self._start_direct_worker(i))

    def _native_lib(self, native: bool | str, copy_impl: str, affinity: str | None) -> Any:
        """The native library if the pool should copy: ``native`` True (required) or "auto" (when
        it builds, for the copy kernels it has, without the register-window workers)."""
        if native not in (True, False, "auto"):
            raise ValueError(f"native must be True, False or 'auto', got {native!r}")
        if native is False:
            return None
        fits = self.copy_impl.partition("-pf")[0] in _NATIVE_COPY_KINDS and affinity is None
        lib = native_pool.native_copy_lib() if fits else None
        if lib is None and native is True:
            raise UnsupportedError(
                "the native copy pool is not available for these options" if not fits else
                "the native copy pool could not be built (needs a C compiler and an AVX2 CPU)",
                "use native='auto' or native=False (Python copy threads)")
        return lib

    def _submit(self, copies: list[Copy], after: Any) -> Ticket:
        if self._pool is None:
            return super()._submit(copies, after)
        pieces = self._pointer_pieces(copies)
        self._check_files(pieces)
        flat: list[int] = []  # src, dst, nbytes per piece
        total = 0
        populate = self._populate_ok
        last: tuple[Any, int, int] | None = None  # populate runs of neighbouring pieces at once
        maps = self._maps
        for path, start, n, dst in pieces:
            m = maps.get(path) or self._map(path)
            flat += (m.addr + start, dst, n)
            total += n
            if populate:
                if last is not None and last[0] is m and start - last[2] < _MappedFile.GRANULE:
                    last = (m, last[1], max(last[2], start + n))
                else:
                    if last is not None:
                        self._populate(*last)
                    last = (m, start, start + n)
        if last is not None:
            self._populate(*last)
        triples = np.array(flat, dtype=np.uint64)
        ticket = Ticket(total, 1)
        if after is not None:
            self.stream.wait_event(after)
        nchunks = self._pool.submit(triples, self._chunk_bytes(total), ticket)
        # after the submit (``copies`` holds the destinations meanwhile): a refused batch, never
        # issued, would otherwise stay at the head of _inflight and pin everything behind it
        self._retain(ticket, copies)
        with self._lock:
            self._counters["tickets"] += 1
            self._counters["copies"] += len(pieces)
            self._counters["chunks"] = self._counters.get("chunks", 0) + nchunks
        return ticket

    def _populate(self, m: _MappedFile, start: int, end: int) -> None:
        """Pre-fault [start, end) of ``m`` once; stop trying where the kernel refuses."""
        if self._populate_ok and not m.populate(start, end):
            self._populate_ok = False  # kernel < 5.14: plain faults

    def _wait_native(self, ticket: Ticket) -> None:
        self._pool.wait(ticket)

    def _map(self, path: Path) -> _MappedFile:
        m = self._maps.get(path)
        if m is None:
            with self._maps_lock:
                m = self._maps.get(path)
                if m is None:
                    m = _MappedFile(Path(path), self.hugepage, self.collapse)
                    self._maps[path] = m
        return m

    def _file_size(self, path: Path) -> int:
        m = self._maps.get(path)
        return m.size if m is not None else self._map(path).size

    def _fill(self, chunk: _Chunk, slot: Slot, stats: _WorkerStats) -> None:
        for p in chunk.parts:
            m = self._map(p.path)
            if self._populate_ok:
                t0 = time.perf_counter()
                self._populate(m, p.start, p.end)
                stats.populate_s += time.perf_counter() - t0
            self._copy(slot.ptr + p.slot_off + (p.start - p.window), m.addr + p.start,
                       p.end - p.start)

    # -- direct (registered window) workers: DMA from the page cache, no CPU copy
    def _start_direct_worker(self, i: int) -> threading.Thread:
        stats = _WorkerStats()
        self._stats.append(stats)
        t = threading.Thread(target=self._direct_worker, args=(stats,), daemon=True,
                             name=f"mmap-offload-direct-{i}")
        t.start()
        return t

    def _direct_worker(self, stats: _WorkerStats) -> None:
        self.stream.enter_thread()
        pending: deque[tuple[int, int, Any]] = deque()
        try:
            while True:
                chunk = self._q.get()
                if chunk is None:
                    return
                if self._closed or len(chunk.parts) != 1:
                    self._run_chunk(chunk, stats)
                    continue
                err = None
                try:
                    if not self._direct_chunk(chunk, stats, pending):
                        stats.direct_fallbacks += 1
                        self._ring_chunk(chunk, stats)
                except RingClosedError:
                    err = MmapOffloadError("transfer cancelled: the engine was closed")
                except BaseException as e:
                    err = e
                chunk.ticket._chunk_done(self.stream, err)
        finally:
            while pending:
                self._unregister_window(pending.popleft())

    def _unregister_window(self, item: tuple[int, int, Any]) -> None:
        addr, length, ev = item
        ev.synchronize()
        cuda_host_unregister(addr)
        account_window(-length)
        with self._maps_lock:
            self._window_now -= length

    def _direct_chunk(self, chunk: _Chunk, stats: _WorkerStats, pending: deque) -> bool:
        p = chunk.parts[0]
        m = self._map(p.path)
        while len(pending) >= self.direct_depth:
            self._unregister_window(pending.popleft())
        t0 = time.perf_counter()
        w0 = p.window
        w1 = min(m.length, page_align_up(p.end))
        if not cuda_host_register(m.addr + w0, w1 - w0, CUDA_HOST_REGISTER_READ_ONLY):
            return False
        account_window(w1 - w0)
        with self._maps_lock:
            self._window_now += w1 - w0
            self._window_peak = max(self._window_peak, self._window_now)
        t1 = time.perf_counter()
        self.stream.copy_ptr(p.dst, m.addr + p.start, p.end - p.start)
        ev = self.stream.record()
        pending.append((m.addr + w0, w1 - w0, ev))
        stats.fill_s += t1 - t0
        stats.issue_s += time.perf_counter() - t1
        stats.direct_bytes += p.end - p.start
        stats.chunks += 1
        with self._lock:
            self._counters["bytes_moved"] += p.end - p.start
        return True

    @property
    def metrics(self) -> dict[str, Any]:
        m = super().metrics
        m["direct_threads"] = self.direct_threads
        m["direct_bytes"] = sum(s.direct_bytes for s in self._stats)
        m["direct_fallbacks"] = sum(s.direct_fallbacks for s in self._stats)
        m["window_pinned_peak_bytes"] = self._window_peak
        m["pinned_bytes"] = self.ring.pinned_bytes + self._window_reserve
        m["populate_seconds"] = sum(s.populate_s for s in self._stats)
        m["mapped_files"] = len(self._maps)
        m["mapped_bytes"] = sum(x.length for x in self._maps.values())
        m["copy_impl"] = self.copy_impl
        m["native"] = self.native
        m["slot_reuse"] = self.slot_reuse
        if self._pool is not None:
            m.update(self._pool.stats())
        return m

    def close(self) -> None:
        """Cancel chunks not started, finish those in flight, free the ring. Idempotent."""
        if not self._closed and self._pool is not None:
            self._pool.close()  # before the ring and the mappings it reads go
            with self._lock:  # two closers: released once
                reserve, self._window_reserve = self._window_reserve, 0
            if reserve:
                account_window(-reserve)
        super().close()

    def prefault(self, paths: Sequence[str | os.PathLike]) -> int:
        """Map ``paths`` now and set up the page tables of their page-cache-resident parts.

        A fresh mapping faults once per page on first touch; for random per-expert reads at decode
        that first-touch cost is as large as the copy itself. Call this once at start-up (a
        background thread is fine) so later copies run at memory speed. Never reads from disk.
        Returns the bytes whose page tables were set up."""
        done = 0
        for path in paths:
            m = self._map(os.fspath(path))
            if self._populate_ok:
                done += m.populate_resident()
        return done

    def unmap_all(self) -> None:
        """Drop every file mapping (e.g. before evicting the page cache); remapped on next use.
        Only call while no ticket is in flight."""
        with self._maps_lock:
            maps, self._maps = self._maps, {}
        for m in maps.values():
            m.close()

    def _close_files(self) -> None:
        self.unmap_all()
