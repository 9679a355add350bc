"""The ring engine base of mmap and pread: plan pieces into slot-sized chunks, fill a slot of the
exact-size ``PinnedRing``, issue its H2D on the copy stream, free the slot on its event; the Python
worker threads that do it (the pread engine's workers; the mmap engine's fallback where the native
pool is unavailable)."""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch

from ..cache_format import ALIGNMENT, repair_command_for
from ..errors import CacheError, MmapOffloadError
from ..pinned import PinnedRing, RingClosedError, Slot, page_align_up
from .streams import _CpuCopyStream, _CudaCopyStream
from .ticket import Copy, Ticket, TransferEngine, _align_down, _align_up, _Chunk, _Part

MIN_CHUNK_BYTES = 1 << 20  # below this, per-chunk overhead outweighs the parallelism gained



class _WorkerStats:
    __slots__ = ("fill_s", "issue_s", "chunks", "odirect_bytes", "buffered_bytes", "populate_s")

    def __init__(self) -> None:
        for k in self.__slots__:
            setattr(self, k, 0)


class _RingEngine(TransferEngine):
    """Shared machinery of mmap and pread: planning into slot-sized chunks, worker threads, ring,
    copy stream, ticket bookkeeping. Subclasses implement ``_fill(chunk, slot, stats)``."""

    def __init__(self, device: torch.device, *, pinned_bytes: int, slot_bytes: int, threads: int,
                 blocking_events: bool = True, python_workers: bool = True,
                 chunks_per_thread: int = 2, min_chunk_bytes: int = MIN_CHUNK_BYTES,
                 ring_hugepage: bool = True):
        super().__init__(device)
        if threads < 1 or threads > 64:
            raise ValueError(f"threads must be in 1..64, got {threads}")
        self.slot_bytes = page_align_up(max(ALIGNMENT, int(slot_bytes)))
        num_slots = max(2, int(pinned_bytes) // self.slot_bytes)
        self.threads = int(threads)
        self.chunks_per_thread = max(1, int(chunks_per_thread))
        self.min_chunk_bytes = _align_up(max(ALIGNMENT, int(min_chunk_bytes)))
        self.ring = PinnedRing(num_slots, self.slot_bytes, pin=device.type == "cuda", hugepage=ring_hugepage)
        self.stream: Any = (_CudaCopyStream(device, blocking_events) if device.type == "cuda"
                            else _CpuCopyStream())
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stats: list[_WorkerStats] = []
        self._lock = threading.Lock()
        self._workers = [self._start_worker(i) for i in range(self.threads)] if python_workers else []

    def _chunk_bytes(self, total: int) -> int:
        """Small batches (a few experts at decode) are cut into ``chunks_per_thread`` chunks per
        worker so every worker copies, a late-waking one delays the batch less, and the first H2D
        starts early; big ones use whole slots."""
        per = _align_up(-(-total // (self.chunks_per_thread * self.threads)))
        return min(self.slot_bytes, max(self.min_chunk_bytes, per))

    # -- planning
    def _plan(self, pieces: list[tuple[Path, int, int, int]]) -> list[list[_Part]]:
        """Cut pieces into slot-sized chunks; every part starts at a 4096-aligned slot offset."""
        chunks: list[list[_Part]] = []
        cur: list[_Part] = []
        used = 0
        S = self._chunk_bytes(sum(n for _, _, n, _ in pieces))
        for path, start, n, dst in pieces:
            end = start + n
            s = start
            while s < end:
                w = _align_down(s)
                e = min(end, w + S)
                foot = _align_up(e) - w
                if cur and used + foot > S:
                    chunks.append(cur)
                    cur, used = [], 0
                cur.append(_Part(path, s, e, used, dst + (s - start)))
                used += foot
                s = e
        if cur:
            chunks.append(cur)
        return chunks

    def _check_files(self, pieces: list[tuple[Path, int, int, Any]]) -> None:
        sizes: dict[str, int] = {}
        for path, start, n, _ in pieces:
            if path not in sizes:
                try:
                    sizes[path] = self._file_size(path)
                except FileNotFoundError as e:
                    raise CacheError(f"cache file {path} is missing",
                                     f"rewrite it with {repair_command_for(path)}") from e
            if start + n > sizes[path]:
                raise CacheError(f"cache file {path} ends at {sizes[path]} bytes, a read needs "
                                 f"{start + n} (truncated?)", "run mmap-offload verify DIR")

    def _file_size(self, path: str) -> int:
        return os.stat(path).st_size

    def _submit(self, copies: list[Copy], after: Any) -> Ticket:
        pieces = self._pointer_pieces(copies)
        self._check_files(pieces)
        nbytes = sum(p[2] for p in pieces)
        chunks = self._plan(pieces)
        ticket = Ticket(nbytes, len(chunks))
        self._retain(ticket, copies)
        if after is not None:
            self.stream.wait_event(after)
        with self._lock:
            self._counters["tickets"] += 1
            self._counters["copies"] += len(pieces)
            self._counters["chunks"] = self._counters.get("chunks", 0) + len(chunks)
        for parts in chunks:
            self._q.put(_Chunk(ticket, parts))
        return ticket

    # -- workers
    def _start_worker(self, i: int) -> threading.Thread:
        stats = _WorkerStats()
        self._stats.append(stats)
        t = threading.Thread(target=self._worker, args=(stats, i), daemon=True,
                             name=f"mmap-offload-{self.kind}-{i}")
        t.start()
        return t

    def _worker(self, stats: _WorkerStats, index: int) -> None:
        self.stream.enter_thread()
        while True:
            chunk = self._q.get()
            if chunk is None:
                return
            self._run_chunk(chunk, stats)

    def _run_chunk(self, chunk: _Chunk, stats: _WorkerStats) -> None:
        if self._closed:
            chunk.ticket._chunk_done(self.stream, MmapOffloadError(
                "transfer cancelled: the engine was closed"))
            return
        err: BaseException | None = None
        try:
            self._ring_chunk(chunk, stats)
        except RingClosedError:
            err = MmapOffloadError("transfer cancelled: the engine was closed")
        except BaseException as e:  # reported to the waiter
            err = e
        chunk.ticket._chunk_done(self.stream, err)

    def _ring_chunk(self, chunk: _Chunk, stats: _WorkerStats) -> None:
        slot = self.ring.acquire()
        try:
            t0 = time.perf_counter()
            self._fill(chunk, slot, stats)
            t1 = time.perf_counter()
            for p in chunk.parts:
                o = p.slot_off + (p.start - p.window)
                self.stream.copy_part(p.dst, slot, o, p.end - p.start)
            ev = self.stream.record()
            stats.issue_s += time.perf_counter() - t1
            stats.fill_s += t1 - t0
        except BaseException:
            self.ring.release(slot, None)
            raise
        self.ring.release(slot, ev)
        stats.chunks += 1
        n = sum(p.end - p.start for p in chunk.parts)
        with self._lock:
            self._counters["bytes_moved"] += n

    def _fill(self, chunk: _Chunk, slot: Slot, stats: _WorkerStats) -> None:  # pragma: no cover
        raise NotImplementedError

    @property
    def metrics(self) -> dict[str, Any]:
        m = super().metrics
        m["pinned_bytes"] = self.ring.pinned_bytes
        m["ring_bytes"] = self.ring.nbytes
        m["ring_slots"] = self.ring.num_slots
        m["slot_bytes"] = self.slot_bytes
        m["threads"] = self.threads
        m["ring_wait_seconds"] = self.ring.wait_seconds
        m["fill_seconds"] = sum(s.fill_s for s in self._stats)
        m["issue_seconds"] = sum(s.issue_s for s in self._stats)
        m.setdefault("chunks", 0)
        return m

    def close(self) -> None:
        """Cancel chunks not started, finish those in flight, free the ring. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._q.put(None)
        for t in self._workers:
            t.join()
        self.ring.close()  # synchronizes the events of in-flight copies first
        self.stream.close()
        self._inflight.clear()  # every copy precedes a slot event the ring waited for: all done
        self._close_files()

    def _close_files(self) -> None:
        pass
