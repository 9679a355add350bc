"""The mmap engine (warm path): persistent read-only mappings -> pinned ring -> device, by the
native pool (default) or Python threads (fallback). See the package docstring for the contract."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import CacheError, UnsupportedError, mapped_read_error
from ..native import library_status
from ..pinned import Slot, memcpy
from . import native_pool
from .native_pool import _ERR_FAULT, _NATIVE_COPY_KINDS, _has_erms, _NativePool, _pool_error
from .pagecache import _MappedFile
from .ring import MIN_CHUNK_BYTES, _RingEngine, _WorkerStats
from .ticket import Copy, Ticket, _Chunk

NATIVE_MIN_CHUNK_BYTES = 512 << 10  # MIN_CHUNK_BYTES for the native pool (no Python per chunk)
COPY_IMPLS = ("auto", "mixed", "nt4")  # the fill step's copy kernel (docs/TRANSFER.md)


class MmapEngine(_RingEngine):
    """Warm path: persistent read-only mappings -> pinned ring (memcpy, GIL released) -> device.

    The native pool copies where the library ``mo_native`` loads; Python threads are the fallback
    (``native=False`` picks them on purpose, for comparison). Knobs kept because a measured case
    prefers them (docs/TRANSFER.md): ``slot_reuse="oldest"`` (better than "hot" with ``nt4``, the
    kernel of CPUs without ERMS), ``copy_impl="nt4"``; the others are test hooks or switch off a
    default (``populate``, ``hugepage``, ``ring_hugepage``, ``blocking_events``).

    ``ordered_fraction`` (0 by default; the vLLM backend's expert cache uses 0.5) sets that part of
    the ring aside for stream-ordered batches (``submit_ordered``, ``submit_ordered_raw``; the native
    pool only), each cut into up to ``ordered_gates`` groups with a gate each (TRANSFER.md), filled by
    ``ordered_threads`` threads of their own (None: as many as ``threads``, which fill the rest)."""

    kind = "mmap"
    ORDERED_MIN_GROUP = 1 << 20  # submit_ordered: a gate per group of at least this many bytes

    def __init__(self, device: torch.device, *, pinned_bytes: int = 256 << 20,
                 slot_bytes: int = 4 << 20, threads: int = 8, populate: bool = True, hugepage: bool = True,
                 blocking_events: bool = True, copy_impl: str = "auto", native: bool | str = "auto",
                 stream_delay_us: int = 0, chunks_per_thread: int | None = None,
                 min_chunk_bytes: int | None = None, ring_hugepage: bool = True, slot_reuse: str = "auto",
                 ordered_fraction: float = 0.0, ordered_gates: int = 4, ordered_threads: int | None = None):
        if slot_reuse not in ("auto", "oldest", "hot"):
            raise ValueError(f"slot_reuse must be 'auto', 'oldest' or 'hot', got {slot_reuse!r}")
        if copy_impl not in COPY_IMPLS:
            raise UnsupportedError(f"unknown copy_impl {copy_impl!r}", f"choose one of {', '.join(COPY_IMPLS)}")
        if native not in (True, False, "auto"):
            raise ValueError(f"native must be True, False or 'auto', got {native!r}")
        if not 0.0 <= ordered_fraction < 1.0:
            raise ValueError(f"ordered_fraction must be in [0, 1), got {ordered_fraction!r}")
        if ordered_threads is not None and not 1 <= ordered_threads <= 64:
            raise ValueError(f"ordered_threads must be in 1..64, got {ordered_threads}")
        # submit_ordered cuts a batch into up to this many groups, each behind its own gate
        self.ordered_gates = max(1, int(ordered_gates))
        self.populate = populate
        self.hugepage = hugepage
        self._maps: dict[Path, _MappedFile] = {}
        self.map_generation = 0  # + 1 at each unmap_all: addresses from mapped_address are stale then
        self._maps_lock = threading.Lock()
        lib = native_pool.native_copy_lib()
        if lib is None and (native is True or copy_impl != "auto"):
            raise UnsupportedError(f"{'native=True' if native is True else f'copy_impl {copy_impl!r}'} needs "
                                   "the native library mo_native, which is " + library_status("mo_native"),
                                   "pip install the package where cc runs, on an AVX2 CPU; or leave the "
                                   "option at its default (Python copy threads with libc memcpy)")
        pool = lib is not None and native is not False
        # "hot": the pool reuses the newest free slot whose copy completed, so the ring's working
        # set stays in the CPU caches and the DMA reads it from there (the Python workers cannot)
        self.slot_reuse = ("hot" if slot_reuse == "auto" else slot_reuse) if pool else "oldest"
        if copy_impl == "auto":
            # rep movsb for whole-slot chunks (it leaves the lines in the cache, where the DMA
            # reads them: 6-15 points of H2D over non-temporal stores with hot slots), nt4 for
            # small ones (csrc/copy_pool.c, run_chunk; TRANSFER.md); nt4 where ERMS is missing
            copy_impl = "mixed" if pool and self.slot_reuse == "hot" and _has_erms() else "nt4"
        # the Python threads copy with nt4 (the pool's "mixed" picks per chunk), libc without it
        self.copy_impl = copy_impl if lib is not None else "libc"
        self._copy = memcpy if lib is None else (lambda d, s, n: lib.mo_copy_nt4(d, s, n, 1024))
        super().__init__(device, pinned_bytes=pinned_bytes, slot_bytes=slot_bytes,
                         threads=threads, blocking_events=blocking_events, python_workers=not pool,
                         # the pool's per-chunk cost is a few microseconds: finer chunks pay off
                         chunks_per_thread=chunks_per_thread or (4 if pool else 2),
                         min_chunk_bytes=min_chunk_bytes or (NATIVE_MIN_CHUNK_BYTES if pool else MIN_CHUNK_BYTES),
                         ring_hugepage=ring_hugepage)
        self.native = pool
        self._pool: _NativePool | None = None
        if pool:
            try:
                n = self.ring.num_slots  # at least one slot each side when asked for
                ordered = min(max(int(n * ordered_fraction), 1), n - 1) if ordered_fraction else 0
                self._pool = _NativePool(lib, device, self.stream, self.ring, self.threads,
                                         _NATIVE_COPY_KINDS[self.copy_impl], stream_delay_us,
                                         hot_slots=self.slot_reuse == "hot", ordered_slots=ordered,
                                         ordered_threads=ordered_threads)
            except BaseException:
                self.ring.close()
                self.stream.close()
                raise
        self._populate_ok = populate

    def _submit(self, copies: list[Copy], after: Any) -> Ticket:
        if self._pool is None:
            return super()._submit(copies, after)
        triples, total, npieces = self._triples(copies)
        ticket = Ticket(total, 1)
        if after is not None:
            self.stream.wait_event(after)
        nchunks = self._pool.submit(triples, self._chunk_bytes(total), ticket,
                                    describe_fault=lambda addr: self._fault_error(addr, copies))
        # after the submit (``copies`` holds the destinations meanwhile): a refused batch, never
        # issued, would otherwise stay at the head of _inflight and pin everything behind it
        self._retain(ticket, copies)
        self._count(npieces, nchunks)
        return ticket

    @property
    def ordered_bytes(self) -> int:
        """Bytes of the ring set aside for ``submit_ordered`` (``ordered_fraction``); 0: none."""
        return self._pool.ordered_bytes if self._pool is not None else 0

    def submit_ordered(self, copies: Sequence[Copy], stream: Any = None) -> Ticket | None:
        """Start copying, ordered on ``stream`` (CUDA: default the current stream; CPU: the engine's
        own stand-in stream) without waiting for anything: the copies are enqueued on that stream at
        once, behind a gate that opens when the pool's threads have read the bytes into the ring's
        ordered part (csrc/copy_pool.c, "Stream-ordered batches"). Work enqueued on ``stream`` later
        sees the bytes; ``wait(ticket)`` waits only for the reads and raises a read error, which must
        be checked before the destinations' results are used (a failed read lets the stream copy
        stale bytes). Returns None, having queued nothing, where it cannot (no ordered part of the
        ring, a batch larger than it, a second stream): use ``submit``. Destinations must not be in
        use by work on other streams."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        if not self.ordered_bytes:
            return None
        copies = list(copies)
        triples, total, _ = self._triples(copies)
        return self._ordered(triples, total, copies, stream)

    def mapped_address(self, path: str | os.PathLike) -> int:
        """The address of ``path``'s read-only mapping (made now if there is none), for callers that
        plan their own pieces (``submit_ordered_raw``); valid while ``map_generation`` is unchanged."""
        path = os.fspath(path)
        return (self._maps.get(path) or self._map(path)).addr

    def submit_ordered_raw(self, triples: np.ndarray, stream: Any = None) -> Ticket | None:
        """``submit_ordered`` for pieces the caller planned: ``triples`` is uint64 ``[n, 3]`` (an
        address inside a mapping of this engine, ``mapped_address`` + file offset; a device address;
        nbytes). Nothing is checked or pre-faulted here (the fill threads fault pages in; a read past
        a file's end fails the batch through the SIGBUS guard, as a truncation does), which saves the
        launching thread the per-piece work of ``submit_ordered`` (its Copy objects, destination
        checks, file sizes, page-table runs). The destinations must stay alive until the batch ran
        (an expert pool's slots do). None where ``submit_ordered`` would return None."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        if not self.ordered_bytes:
            return None
        flat = np.ascontiguousarray(triples, dtype=np.uint64).reshape(-1)
        return self._ordered(flat, int(flat[2::3].sum()), (), stream)

    def _ordered(self, flat: np.ndarray, total: int, copies: Sequence[Copy], stream: Any) -> Ticket | None:
        """Queue flat (src, dst, nbytes) triples as one stream-ordered batch; None if the pool cannot."""
        pool = self._pool
        if total > pool.ordered_bytes:
            return None
        if self.device.type == "cuda":
            handle = (stream or torch.cuda.current_stream(self.device)).cuda_stream
        else:
            handle = pool._fake_stream
        ticket = Ticket(total, 1)
        try:
            if not pool.submit_ordered(flat, self._chunk_bytes(total), handle, ticket,
                                       describe_fault=lambda addr: self._fault_error(addr, copies),
                                       group_bytes=self._ordered_group_bytes(total)):
                return None
        except RuntimeError:
            if ticket._status is not None:  # a failed copy: those issued before it still write
                self._retain(ticket, copies)  # their destinations, which must outlive them
            raise
        self._retain(ticket, copies)  # the destinations (Copy objects) and the status words live on
        self._count(len(flat) // 3, 0)
        return ticket

    def native_ordered(self) -> Any:
        """The native pool, for a native caller that queues stream-ordered batches itself
        (mmap_offload/expert_step.py: ``enter`` / ``leave`` around the call, ``prepare_ordered``
        before it, ``adopt_ordered`` after); None without an ordered part of the ring."""
        return self._pool if not self._closed and self.ordered_bytes else None

    def adopt_ordered(self, ticket: Ticket, npieces: int, nbytes: int) -> None:
        """A native caller queued ``ticket``'s batch (prepared by ``native_ordered().prepare_ordered``):
        the engine keeps it as its own (``_ordered``'s bookkeeping); raises its copies' CUDA error."""
        ticket.nbytes = nbytes
        try:
            self._pool.queued_ordered(ticket)
        finally:
            self._retain(ticket, ())  # issued copies still write their destinations, failed or not
        self._count(npieces, 0)

    def _ordered_group_bytes(self, total: int) -> int:
        """Groups of a stream-ordered batch (one gate each): the stream copies one while the
        threads fill the next."""
        return max(self.ORDERED_MIN_GROUP, -(-total // self.ordered_gates)) if self.ordered_gates > 1 else 0

    def _count(self, npieces: int, nchunks: int) -> None:
        with self._lock:
            self._counters["tickets"] += 1
            self._counters["copies"] += npieces
            self._counters["chunks"] = self._counters.get("chunks", 0) + nchunks

    def _triples(self, copies: list[Copy]) -> tuple[np.ndarray, int, int]:
        """(flat uint64 src address, dst address, nbytes per piece; total bytes; pieces) of
        ``copies``, the files checked and the read ranges populated."""
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
        return np.array(flat, dtype=np.uint64), total, len(pieces)

    def _fault_error(self, addr: int, copies: Sequence[Copy]) -> CacheError:
        """The one-line error of a read of the mapping that raised SIGBUS at ``addr``: the file,
        the offset, and the label of the Copy it belongs to. Later submits re-read the file's size."""
        for path, m in list(self._maps.items()):
            if m.addr <= addr < m.addr + m.length:
                m.faulted = True
                off = addr - m.addr
                label = next((c.label for c in copies if c.label and os.fspath(c.src.path) == path
                              and c.src.offset <= off < c.src.offset + c.src.nbytes), None)
                return mapped_read_error(path, off, label, "run mmap-offload verify DIR; the pread engine "
                                         "reads without a mapping (engine 'pread')")
        return _pool_error(_ERR_FAULT, addr, None)

    def _populate(self, m: _MappedFile, start: int, end: int) -> None:
        """Pre-fault [start, end) of ``m`` once; stop trying where the kernel refuses."""
        if self._populate_ok and not m.populate(start, end) and ctypes.get_errno() != errno.EFAULT:
            self._populate_ok = False  # kernel < 5.14: plain faults (EFAULT: past the file's end)

    def _wait_native(self, ticket: Ticket) -> None:
        self._pool.wait(ticket)

    def _map(self, path: str) -> _MappedFile:
        return self._per_file("_maps", self._maps_lock, path, lambda: _MappedFile(Path(path), self.hugepage))

    def _file_size(self, path: Path) -> int:
        m = self._maps.get(path) or self._map(path)
        return m.current_size() if m.faulted else m.size

    def _fill(self, chunk: _Chunk, slot: Slot, stats: _WorkerStats) -> None:
        for p in chunk.parts:
            m = self._map(p.path)
            if self._populate_ok:
                t0 = time.perf_counter()
                self._populate(m, p.start, p.end)
                stats.populate_s += time.perf_counter() - t0
            m.check(p.end)  # the Python copy is not guarded against SIGBUS: see _MappedFile
            self._copy(slot.ptr + p.slot_off + (p.start - p.window), m.addr + p.start,
                       p.end - p.start)

    @property
    def metrics(self) -> dict[str, Any]:
        m = super().metrics
        m["populate_seconds"] = sum(s.populate_s for s in self._stats)
        m["mapped_files"] = len(self._maps)
        m["mapped_bytes"] = sum(x.length for x in self._maps.values())
        m["copy_impl"] = self.copy_impl
        m["native"] = self.native
        m["slot_reuse"] = self.slot_reuse
        if self._pool is not None:
            m.update(self._pool.stats())
            if self._pool.ordered_bytes:
                m.update(self._pool.ordered_stats())
            m["sigbus_guarded"] = self._sigbus_guarded()
        return m

    def _sigbus_guarded(self) -> bool:
        """Whether a SIGBUS in the pool's copies reaches its guard (csrc/copy_pool.c): its handler is the
        process's, or the host kernel's guard is, installed after it and passing other faults on to it."""
        lib = self._pool.lib
        if lib.mo_sigbus_guarded():
            return True
        from ..host.kernel import sigbus_guard_prev

        prev = sigbus_guard_prev()
        return prev is not None and prev == (lib.mo_sigbus_handler() or 0)

    def close(self) -> None:
        """Cancel chunks not started, finish those in flight, free the ring. Idempotent."""
        if not self._closed and self._pool is not None:
            self._pool.close()  # before the ring and the mappings it reads go
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
            self.map_generation += 1
        for m in maps.values():
            m.close()

    def _close_files(self) -> None:
        self.unmap_all()
