"""Transfer engines: byte ranges of cache files -> tensors on a device. Knows nothing of layers.

    engine = make_engine("auto" | "mmap" | "pread" | "kvikio", device,
                         pinned_bytes=256 << 20, slot_bytes=16 << 20, threads=8)
    ticket = engine.submit([Copy(src=Extent(path, offset, nbytes),
                                 dst=[(offset_in_extent, nbytes, dst_tensor), ...]), ...])
    engine.wait(ticket)     # see "Completion" below
    engine.metrics          # dict: bytes_moved, pinned_bytes (exact), copies, stall_seconds, ...
    engine.close()          # idempotent

``dst_tensor`` is any contiguous tensor on ``device`` (any dtype); the bytes of the extent range
are copied into its first ``nbytes`` bytes verbatim. Cache extents start at 4096-aligned offsets;
other offsets and lengths work too (the O_DIRECT engine reads the covering aligned range).

Engines (class relation: TransferEngine <- _RingEngine <- MmapEngine, PreadEngine;
TransferEngine <- KvikioEngine):

    mmap    warm path. Each file is mapped once per engine, read-only, 2 MiB-aligned (large
            page-cache folios map as PMDs); ``threads`` workers copy from the mapping into free
            slots of an exact-size PinnedRing (4 MiB slots), the GIL released, so it does not
            depend on OMP_NUM_THREADS; each filled slot goes to the device on the ONE copy stream
            of that device (``copy_stream()``), and the event recorded after it frees the slot: a
            slot is never refilled before its H2D completed. By default (``native=`` "auto") the
            workers are a pthread pool in C (csrc/copy_pool.c, built with the copy kernels of
            csrc/fastcopy.c by ``native_copy_lib()`` on first use): one GIL-free call per batch
            cuts it into chunks, fills slots and issues cudaMemcpyAsync with torch's libcudart
            (on the CPU: the library's own stand-in stream). The pool reuses the newest idle slot
            (``slot_reuse="hot"``) and copies whole-slot chunks with ``rep movsb``, smaller ones
            with non-temporal AVX2 stores (``copy_impl="mixed"``): the slot's lines are still in
            the CPU caches when the DMA reads them (93% of pinned H2D with 8 threads against 75-86%
            for non-temporal stores into the oldest slot: docs/TRANSFER.md). ``native=False``
            keeps Python threads with the non-temporal kernel (libc memcpy where it cannot be
            built). A region is pre-faulted once per engine (MADV_POPULATE_READ) so later passes
            copy at memory speed. Optional ``direct_threads``: workers that register a read-only
            window of the mapping with ``cudaHostRegister`` and DMA straight from the page cache
            (no CPU copy); their windows count in ``pinned_bytes`` (off by default: registration
            holds a driver lock the copy workers wait on; measured slower).
    pread   cold path. Same ring, filled by parallel ``os.preadv`` of the covering 4096-aligned
            range with O_DIRECT (no page-cache pollution, queue depth = threads); buffered
            ``preadv`` where the file system refuses O_DIRECT (metrics say which).
    kvikio  ``kvikio.CuFile(path).pread`` straight into the destination (GPUDirect Storage where
            the nvidia-fs driver runs, else kvikio's POSIX compat mode with its own bounce
            buffers). Needs ``pip install 'mmap-offload[gds]'``.
    auto    kvikio where GPUDirect Storage is active (nvidia-fs loaded) and kvikio imports; else
            mmap (kvikio's compat mode is pread into bounce buffers: with 16 threads it reached
            88-89% of pinned H2D warm where mmap with 8 reached 91-93%). docs/TRANSFER.md has numbers.

Completion. ``wait(ticket)`` blocks the host until every chunk of the ticket has been read from
the file and its device copy issued; on CUDA it then makes the caller's current stream (or
``stream=``) wait on ``ticket.event``, an event recorded on the copy stream after the ticket's
last copy: no host sync with the GPU, kernels queued after ``wait`` see the bytes. On CPU (and for
kvikio) the bytes are in place when ``wait`` returns. ``synchronize(ticket)`` also waits for the
device. Destinations must not be read or written by pending kernels when the ticket starts:
``submit(..., after=event)`` makes the copy stream wait on ``event`` first.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .cache_format import ALIGNMENT, Extent
from .errors import CacheError, MmapOffloadError, UnsupportedError
from .native import cpu_flag, library_status, load_library
from .pinned import (
    CUDA_HOST_REGISTER_READ_ONLY, MADV_COLLAPSE, MADV_HUGEPAGE, MADV_POPULATE_READ, MAP_ANONYMOUS,
    MAP_FIXED, MAP_NORESERVE, MAP_PRIVATE, MAP_SHARED, PAGE, PROT_READ,
    PinnedRing, RingClosedError, Slot, account_window, address_tensor, cuda_host_register,
    cuda_host_unregister, loaded_cudart, madvise, memcpy, mincore_count, os_mmap, os_munmap, page_align_up,
)

ENGINE_KINDS = ("auto", "mmap", "pread", "kvikio")
MIN_CHUNK_BYTES = 1 << 20  # below this, per-chunk overhead outweighs the parallelism gained
NATIVE_MIN_CHUNK_BYTES = 512 << 10  # the same for the native pool (no Python per chunk)
GDS_INSTALL_HINT = "pip install 'mmap-offload[gds]'"


def _align_down(n: int) -> int:
    return n // ALIGNMENT * ALIGNMENT


def _align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Copy:
    """Copy ranges of one extent: each ``(offset_in_extent, nbytes, dst_tensor)`` fills the first
    ``nbytes`` bytes of ``dst_tensor`` with bytes ``[offset, offset + nbytes)`` of ``src``."""

    src: Extent
    dst: Sequence[tuple[int, int, torch.Tensor]]


# --- page cache helpers ----------------------------------------------------------------------

def resident_fraction(path: str | os.PathLike, offset: int = 0, nbytes: int | None = None) -> float:
    """Fraction (0..1) of the file's pages (or of a byte range) in the page cache (``mincore``).

    Maps the file read-only just for the query; reading residency faults nothing in."""
    path = Path(path)
    size = path.stat().st_size
    end = size if nbytes is None else min(size, offset + nbytes)
    start = offset // PAGE * PAGE
    if end <= start:
        return 1.0
    fd = os.open(path, os.O_RDONLY)
    try:
        length = page_align_up(end - start)
        addr = os_mmap(length, PROT_READ, MAP_SHARED, fd, start)
        try:
            resident = mincore_count(addr, length)
        finally:
            os_munmap(addr, length)
    finally:
        os.close(fd)
    return resident / (length // PAGE)


def evict_page_cache(path: str | os.PathLike) -> None:
    """Ask the kernel to drop the file's clean cached pages (POSIX_FADV_DONTNEED).

    Pages some process still maps stay resident: close engines (their mappings) first."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# --- copy streams and events -----------------------------------------------------------------

_streams_lock = threading.Lock()
_copy_streams: dict[int, "torch.cuda.Stream"] = {}


def copy_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one dedicated host-to-device copy stream of ``device`` in this process."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        s = _copy_streams.get(index)
        if s is None:
            s = torch.cuda.Stream(device=torch.device("cuda", index))
            _copy_streams[index] = s
        return s


class _CpuEvent:
    """CPU stand-in for a CUDA event: set when the CPU copy stream reaches it."""

    __slots__ = ("_flag", "error", "ticket")

    def __init__(self, ticket: bool = False) -> None:
        self._flag = threading.Event()
        self.ticket = ticket
        self.error: BaseException | None = None  # a copy before this (ticket) event failed

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self._flag.wait()
        if self.error is not None:
            raise self.error


class _CpuCopyStream:
    """A FIFO of copies run by one thread: the CPU model of a CUDA copy stream (async, ordered).
    The thread starts with the first copy or event (an engine whose native pool has its own stream
    never starts it).

    ``before_copy`` is a test hook called with (dst, src) before each copy runs."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.before_copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def _put(self, item: Any) -> None:
        if self._thread is None:
            with self._start_lock:
                if self._thread is None:
                    t = threading.Thread(target=self._run, args=(self._q,), name="mmap-offload-cpu-stream",
                                         daemon=True)
                    t.start()
                    self._thread = t
        self._q.put(item)

    def _run(self, q: queue.SimpleQueue) -> None:
        error: BaseException | None = None  # reported at the next event, like a CUDA stream error
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, _CpuEvent):
                if item.ticket:  # a ticket's event reports every copy failure since the last one
                    item.error, error = error, None
                item._flag.set()
                continue
            dst, src = item
            try:
                hook = self.before_copy
                if hook is not None:
                    hook(dst, src)
                dst.copy_(src)
            except BaseException as e:  # never let the stream thread die: waiters would hang
                error = error or e

    def enter_thread(self) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._put((dst, src))

    def copy_part(self, dst: int, slot: Slot, offset: int, nbytes: int) -> None:
        self.copy(address_tensor(dst, nbytes), slot.tensor[offset:offset + nbytes])

    def copy_ptr(self, dst: int, src: int, nbytes: int) -> None:
        self.copy(address_tensor(dst, nbytes), address_tensor(src, nbytes))

    def record(self, ticket: bool = False) -> _CpuEvent:
        ev = _CpuEvent(ticket)
        self._put(ev)
        return ev

    def wait_event(self, event: Any) -> None:
        event.synchronize()

    def close(self) -> None:
        with self._start_lock:
            t, self._thread = self._thread, None
            if t is None:  # never started
                return
            # the stop marker goes to this thread's queue; a copy after close gets a new thread
            # with a queue of its own, which cannot take the marker
            q, self._q = self._q, queue.SimpleQueue()
            q.put(None)
        t.join()


def _device_view(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 device tensor over raw device memory (fallback path only)."""

    class _Holder:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}

    return torch.as_tensor(_Holder(), device=device)


def _load_memcpy_async() -> Any:
    """ctypes ``cudaMemcpyAsync`` of the CUDA runtime torch already loaded (None if not found)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    fn = getattr(loaded_cudart(), "cudaMemcpyAsync", None)
    if fn is not None:
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return fn


_MEMCPY_ASYNC: Any = None


class _CudaCopyStream:
    """The device's copy stream, used from worker threads (each calls ``enter_thread`` once)."""

    def __init__(self, device: torch.device, blocking_events: bool = True) -> None:
        global _MEMCPY_ASYNC
        if _MEMCPY_ASYNC is None and os.environ.get("MMAP_OFFLOAD_TORCH_COPY") != "1":
            _MEMCPY_ASYNC = _load_memcpy_async()
        self.device = device
        self.stream = copy_stream(device)
        self.handle = self.stream.cuda_stream
        # blocking: a waiting worker sleeps instead of spinning on a core the copiers need
        self.blocking = blocking_events

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.stream)

    def copy_ptr(self, dst: int, src: int, nbytes: int) -> None:
        """``cudaMemcpyAsync`` host -> device on the copy stream, straight through ctypes (GIL
        released, ~2 us) instead of a torch ``copy_`` (~30-60 us of GIL-held dispatch per call,
        which serialised 8 workers on expert-sized chunks)."""
        if _MEMCPY_ASYNC is None:  # no ctypes runtime: torch's copy on raw device/host views
            with torch.cuda.stream(self.stream):
                _device_view(dst, nbytes, self.device).copy_(address_tensor(src, nbytes), non_blocking=True)
            return
        err = _MEMCPY_ASYNC(dst, src, nbytes, 1, self.handle)  # 1 = cudaMemcpyHostToDevice
        if err != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {err}")

    def copy_part(self, dst: int, slot: Slot, offset: int, nbytes: int) -> None:
        self.copy_ptr(dst, slot.ptr + offset, nbytes)

    def record(self, ticket: bool = False) -> "torch.cuda.Event":
        ev = torch.cuda.Event(blocking=self.blocking)
        ev.record(self.stream)
        return ev

    def wait_event(self, event: Any) -> None:
        self.stream.wait_event(event)

    def close(self) -> None:
        pass


# --- tickets ---------------------------------------------------------------------------------

_ST_CHUNKS, _ST_DONE, _ST_ISSUED, _ST_ERROR, _ST_LEN = 0, 1, 2, 3, 4  # csrc/copy_pool.c


class Ticket:
    """A submitted batch. ``event`` (after issue) is recorded after its last device copy."""

    _ids = itertools.count(1)

    def __init__(self, nbytes: int, nchunks: int):
        self.id = next(Ticket._ids)
        self.nbytes = nbytes
        self.event: Any = None
        self.error: BaseException | None = None
        self._remaining = nchunks
        self._lock = threading.Lock()
        self._issued = threading.Event()
        self.futures: list[Any] = []  # kvikio
        # native pool (csrc/copy_pool.c): status words it writes, and the event it records last
        self._status: np.ndarray | None = None
        self._native_event: Any = None
        self._native_lib: Any = None
        if nchunks == 0:
            self._issued.set()

    def issued(self) -> bool:
        """True once every chunk was read and its device copy issued (or the ticket failed)."""
        if not self._issued.is_set() and self._status is not None:
            err = ctypes.c_int64(0)  # read through C: acquire order, not a plain numpy read
            if self._native_lib.mo_status_issued(self._status.ctypes.data, ctypes.byref(err)):
                self._native_issued(err.value)
        return self._issued.is_set()

    def _native_issued(self, err: int) -> None:
        if err and self.error is None:
            self.error = (MmapOffloadError("transfer cancelled: the engine was closed") if err < 0
                          else RuntimeError(f"the copy pool's cudaMemcpyAsync / cudaEventRecord "
                                            f"failed with CUDA error {err}"))
        self.event = self._native_event
        self._issued.set()

    def _chunk_done(self, stream: Any, error: BaseException | None = None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= 1
            last = self._remaining == 0
            if last:
                # every other chunk issued its copies before decrementing: this event follows them
                self.event = stream.record(ticket=True)
        if last:
            self._issued.set()


def _check_dst(dst: Any, device: torch.device) -> int:
    """Check one destination tensor; return its size in bytes (no torch op: this runs per piece)."""
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"dst must be a torch.Tensor, got {type(dst).__name__}")
    if not dst.is_contiguous():
        raise ValueError("dst tensor must be contiguous (call .contiguous() on a copy)")
    index = dst.get_device()  # -1 on the CPU
    if (index >= 0) != (device.type == "cuda") or (device.index is not None and index >= 0 and index != device.index):
        raise ValueError(f"dst tensor is on {dst.device}, the engine copies to {device}")
    return dst.numel() * dst.element_size()


def _normalize_device(device: torch.device | str | None) -> torch.device:
    device = torch.device(device if device is not None else "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UnsupportedError(f"device {device} requested but CUDA is not available",
                                   "use device='cpu' or a CUDA build of torch")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise UnsupportedError(f"device {device} is not supported", "use a cuda or cpu device")
    return device


# --- engines ---------------------------------------------------------------------------------

class TransferEngine:
    """Base: the submit / wait / metrics / close contract. Subclasses implement ``_submit``."""

    kind = "base"

    def __init__(self, device: torch.device):
        self.device = device
        self._closed = False
        self._stall = 0.0
        self._stall_lock = threading.Lock()
        self._counters: dict[str, float] = {"bytes_moved": 0, "copies": 0, "tickets": 0}
        # (ticket, copies) until the ticket's copies completed: the workers and the copy stream hold
        # raw destination addresses, so the engine keeps the destination tensors alive meanwhile
        self._inflight: deque = deque()
        self._inflight_lock = threading.Lock()

    def _retain(self, ticket: "Ticket", copies: Sequence[Copy]) -> None:
        with self._inflight_lock:
            q = self._inflight
            while q and q[0][0].issued() and q[0][0].event is not None and q[0][0].event.query():
                q.popleft()
            q.append((ticket, copies))

    # planning shared by every engine
    def _checked_pieces(self, copies: Sequence[Copy]) -> list[tuple[Path, int, int, torch.Tensor]]:
        """(path, file_offset, nbytes, dst) of every non-empty range, each checked."""
        pieces = []
        for c in copies:
            ext = c.src
            path, base = os.fspath(ext.path), int(ext.offset)  # str keys: Path hashing cost ~40% of a submit
            for off, n, dst in c.dst:
                off, n = int(off), int(n)
                if off < 0 or n < 0 or off + n > ext.nbytes:
                    raise ValueError(f"range [{off}, {off + n}) is outside the extent of "
                                     f"{ext.nbytes} bytes of {ext.path}")
                held = _check_dst(dst, self.device)
                if n > held:
                    raise ValueError(f"dst holds {held} bytes, {n} were asked for")
                if n:
                    pieces.append((path, base + off, n, dst))
        return pieces

    def _pieces(self, copies: Sequence[Copy]) -> list[tuple[Path, int, int, torch.Tensor]]:
        """Pieces whose destination is a uint8 view of exactly its bytes (kvikio reads into it)."""
        return [(p, o, n, d.reshape(-1).view(torch.uint8)[:n]) for p, o, n, d in self._checked_pieces(copies)]

    def _pointer_pieces(self, copies: Sequence[Copy]) -> list[tuple[Path, int, int, int]]:
        """Pieces whose destination is a raw address: no torch op per piece (a layer of 64
        experts x 4 tensors cost ~8 ms of GIL-held slicing as views)."""
        return [(p, o, n, d.data_ptr()) for p, o, n, d in self._checked_pieces(copies)]

    def prefault(self, paths: Sequence[str | os.PathLike]) -> int:
        """Prepare to read ``paths`` fast (the mmap engine sets up page tables); 0 elsewhere."""
        return 0

    def submit(self, copies: Sequence[Copy], *, after: Any = None) -> Ticket:
        """Start copying; returns at once. ``after``: an event the copies must wait for."""
        if self._closed:
            raise RuntimeError("transfer engine is closed")
        return self._submit(list(copies), after)

    def _submit(self, copies: list[Copy], after: Any) -> Ticket:  # pragma: no cover
        raise NotImplementedError

    def _wait_issued(self, ticket: Ticket) -> None:
        t0 = time.perf_counter()
        if ticket._status is not None and not ticket.issued():
            self._wait_native(ticket)  # GIL released while it blocks
            ticket.issued()
        ticket._issued.wait()
        futures, ticket.futures = ticket.futures, []
        for fut in futures:
            try:
                fut.get()
            except BaseException as e:  # kvikio read error: reported like the ring engines'
                if ticket.error is None:
                    ticket.error = e
        with self._stall_lock:
            self._stall += time.perf_counter() - t0
        if ticket.error is not None:
            err = ticket.error
            if isinstance(err, MmapOffloadError):
                raise err
            if isinstance(err, OSError):
                raise CacheError(f"reading the cache failed: {err}",
                                 "check the cache files (mmap-offload verify DIR)") from err
            raise err

    def _wait_native(self, ticket: Ticket) -> None:  # pragma: no cover - MmapEngine's
        raise NotImplementedError

    def wait(self, ticket: Ticket, stream: Any = None) -> None:
        """Block until the ticket is issued; then the current (or given) stream waits on its event
        (CUDA), or the copies are complete (CPU). Raises the read error, if any."""
        self._wait_issued(ticket)
        ev = ticket.event
        if ev is None:
            return
        if self.device.type == "cuda":
            (stream or torch.cuda.current_stream(self.device)).wait_event(ev)
        else:
            t0 = time.perf_counter()
            ev.synchronize()
            with self._stall_lock:
                self._stall += time.perf_counter() - t0

    def synchronize(self, ticket: Ticket) -> None:
        """Block the host until every byte of the ticket is on the device."""
        self._wait_issued(ticket)
        if ticket.event is not None:
            t0 = time.perf_counter()
            ticket.event.synchronize()
            with self._stall_lock:
                self._stall += time.perf_counter() - t0

    @property
    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = {"engine": self.kind, "device": str(self.device)}
        m.update(self._counters)
        m["stall_seconds"] = self._stall
        m.setdefault("pinned_bytes", 0)
        return m

    def close(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class _Part:
    path: Path
    start: int  # file offset of the first byte wanted
    end: int  # file offset past the last byte wanted
    slot_off: int  # 4096-aligned offset in the slot of the aligned window start
    dst: int  # address of the destination of byte ``start`` (end - start bytes follow)

    @property
    def window(self) -> int:
        return _align_down(self.start)


@dataclass
class _Chunk:
    ticket: Ticket
    parts: list[_Part]


class _WorkerStats:
    __slots__ = ("fill_s", "issue_s", "chunks", "direct_bytes", "direct_fallbacks", "odirect_bytes",
                 "buffered_bytes", "populate_s")

    def __init__(self) -> None:
        for k in self.__slots__:
            setattr(self, k, 0)


class _MappedFile:
    """A read-only shared mapping of a whole file, kept for the engine's lifetime.

    The mapping starts on a 2 MiB boundary so the kernel can map large page-cache folios with
    one PMD entry each (``FilePmdMapped`` in /proc/self/smaps) instead of 512 PTEs."""

    GRANULE = 2 << 20

    def __init__(self, path: Path, hugepage: bool, collapse: bool = False):
        self.path = path
        self.collapse = collapse
        fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(fd).st_size
            self.length = max(PAGE, page_align_up(self.size))
            self.addr = _map_aligned(fd, self.length, self.GRANULE)
        finally:
            os.close(fd)
        if hugepage:
            madvise(self.addr, self.length, MADV_HUGEPAGE)
        self.populated = np.zeros((self.length + self.GRANULE - 1) // self.GRANULE, dtype=bool)

    def populate(self, start: int, end: int) -> bool:
        """Pre-fault the page tables of [start, end) once (MADV_POPULATE_READ). False if refused."""
        g0, g1 = start // self.GRANULE, (end - 1) // self.GRANULE + 1
        todo = np.flatnonzero(~self.populated[g0:g1])
        if todo.size == 0:
            return True
        a = (g0 + int(todo[0])) * self.GRANULE
        b = min(self.length, (g0 + int(todo[-1]) + 1) * self.GRANULE)
        ok = madvise(self.addr + a, b - a, MADV_POPULATE_READ)
        if self.collapse:
            madvise(self.addr + a, b - a, MADV_COLLAPSE)  # best effort: 2 MiB folios
        self.populated[g0:g1] = True
        return ok

    def populate_resident(self) -> int:
        """Pre-fault every 2 MiB granule whose pages are all in the page cache; returns bytes.

        Granules not fully resident are left alone, so this never reads from disk (populating them
        would pull the whole file into memory, evicting what the page cache chose to keep)."""
        done = 0
        for g in np.flatnonzero(~self.populated):
            a = int(g) * self.GRANULE
            n = min(self.GRANULE, self.length - a)
            if mincore_count(self.addr + a, n) * PAGE >= n:
                if not madvise(self.addr + a, n, MADV_POPULATE_READ):
                    return done
                self.populated[g] = True
                done += n
        return done

    def close(self) -> None:
        if self.addr:
            os_munmap(self.addr, self.length)
            self.addr = 0


def spread_cpus() -> list[int]:
    """The allowed logical CPUs ordered one per physical core first (SMT siblings last)."""
    allowed = sorted(os.sched_getaffinity(0))
    first, rest, seen = [], [], set()
    for cpu in allowed:
        try:
            sib = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text()
        except OSError:
            sib = str(cpu)
        key = sib.strip()
        (rest if key in seen else first).append(cpu)
        seen.add(key)
    return first + rest


def _map_aligned(fd: int, length: int, align: int) -> int:
    """Map ``length`` bytes of ``fd`` read-only at an address that is a multiple of ``align``."""
    if length < align:
        return os_mmap(length, PROT_READ, MAP_SHARED, fd, 0)
    base = os_mmap(length + align, 0, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)  # reserve
    addr = (base + align - 1) // align * align
    try:
        got = _libc_mmap_fixed(addr, length, fd)
    except OSError:
        os_munmap(base, length + align)
        raise
    assert got == addr
    if addr > base:
        os_munmap(base, addr - base)
    tail = base + length + align - (addr + length)
    if tail:
        os_munmap(addr + length, tail)
    return addr


def _libc_mmap_fixed(addr: int, length: int, fd: int) -> int:
    from .pinned import _libc

    got = _libc.mmap(addr, length, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap of a cache file failed")
    return int(got)


# --- copy kernels of the fill step -------------------------------------------------------------

COPY_IMPLS = ("auto", "libc", "torch", "numpy", "movsb", "nt", "nt4", "tc", "mixed")  # +"-pf<bytes>"
NATIVE_POOL_ABI = 4  # csrc/copy_pool.c MO_POOL_ABI
_native_lock = threading.Lock()


def _has_erms() -> bool:
    """The CPU has fast ``rep movsb`` (ERMS; Intel since 2012, AMD Zen 3+)."""
    return cpu_flag("erms")


def native_copy_lib(build: bool = True) -> Any:
    """The native library of csrc/ (copy kernels + batch copy pool) with its entry points typed, or
    None (then libc memcpy and Python copy threads are used). Found by ``mmap_offload.native``
    (installed extension, run-time build, ...; ``library_status("mo_native")`` says which)."""
    lib = load_library("mo_native", build)
    if lib is None:
        return None
    with _native_lock:
        return lib if _typed(lib) else None


@functools.lru_cache(maxsize=None)
def _typed(lib: Any) -> bool:
    """Declare the entry points' types once; False if the library is of another pool ABI."""
    try:
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.mo_copy_movsb.argtypes = [vp, vp, sz]
        lib.mo_copy_nt.argtypes = [vp, vp, sz, sz]
        lib.mo_copy_nt4.argtypes = lib.mo_copy_nt.argtypes
        lib.mo_copy_tc.argtypes = lib.mo_copy_nt.argtypes
        if lib.mo_pool_abi() != NATIVE_POOL_ABI:
            return False
        lib.mo_pool_create.restype = vp
        lib.mo_pool_create.argtypes = [vp, ctypes.c_int, vp, vp, sz, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_int, sz, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.mo_pool_submit.restype = ctypes.c_int64
        lib.mo_pool_submit.argtypes = [vp, vp, sz, sz, vp, vp]
        lib.mo_pool_wait.restype = ctypes.c_int64
        lib.mo_pool_wait.argtypes = [vp, vp]
        lib.mo_pool_stats.argtypes = [vp, vp]
        lib.mo_status_issued.argtypes = [vp, vp]
        lib.mo_pool_shutdown.argtypes = [vp]
        lib.mo_pool_destroy.argtypes = [vp]
        lib.mo_fake_stream_create.restype = vp
        lib.mo_fake_stream_create.argtypes = [ctypes.c_uint]
        lib.mo_fake_stream_destroy.argtypes = [vp]
        lib.mo_fake_stream_fail.argtypes = [vp, ctypes.c_int, ctypes.c_uint, ctypes.c_int]
        lib.mo_fake_event_create.argtypes = [vp, ctypes.c_uint]
        lib.mo_fake_event_done.argtypes = [vp]
        lib.mo_fake_event_sync.argtypes = [vp]
        lib.mo_fake_event_destroy.argtypes = [vp]
        lib.mo_fake_host_register.argtypes = [vp, sz, ctypes.c_uint]
        lib.mo_fake_host_unregister.argtypes = [vp]
        lib.mo_fake_registry_stats.argtypes = [vp]
        lib.mo_fake_host_register_fail.argtypes = [ctypes.c_uint, ctypes.c_int]
    except AttributeError:
        return False
    return True


def _copier(impl: str) -> tuple[str, Callable[[int, int, int], None]]:
    """(name, function (dst_addr, src_addr, nbytes)) that copies with the GIL released.
    "auto": the 4-stream non-temporal AVX2 kernel where it builds (measured fastest, TRANSFER.md),
    else libc memcpy."""
    if impl == "auto":
        impl = "nt4" if native_copy_lib() is not None else "libc"
    return impl, _copier_fn(impl)


def _copier_fn(impl: str) -> Callable[[int, int, int], None]:
    if impl == "libc":
        return memcpy
    if impl == "torch":
        return lambda d, s, n: address_tensor(d, n).copy_(address_tensor(s, n))
    if impl == "numpy":
        return lambda d, s, n: np.copyto(address_tensor(d, n).numpy(), address_tensor(s, n).numpy())
    lib = native_copy_lib()
    if lib is None:
        raise UnsupportedError(f"copy_impl {impl!r} needs the native library mo_native, which is "
                               + library_status("mo_native"), "pip install the package where cc runs, on an AVX2 CPU")
    if impl == "movsb":
        return lib.mo_copy_movsb
    if impl.startswith("mixed"):  # the pool picks per chunk (rep movsb >= 4 MiB); Python threads: nt4
        impl = "nt4" + impl[len("mixed"):]
    base, _, pf = impl.partition("-pf")  # "nt", "nt4", or with a prefetch distance: "nt-pf4096"
    dist = int(pf) if pf.isdigit() else 1024
    if base == "nt":
        return lambda d, s, n: lib.mo_copy_nt(d, s, n, dist)
    if base == "nt4":
        return lambda d, s, n: lib.mo_copy_nt4(d, s, n, dist)
    if base == "tc":
        return lambda d, s, n: lib.mo_copy_tc(d, s, n, dist)
    raise UnsupportedError(f"unknown copy_impl {impl!r}", f"choose one of {', '.join(COPY_IMPLS)}")


class _RingEngine(TransferEngine):
    """Shared machinery of mmap and pread: planning into slot-sized chunks, worker threads, ring,
    copy stream, ticket bookkeeping. Subclasses implement ``_fill(chunk, slot, stats)``."""

    def __init__(self, device: torch.device, *, pinned_bytes: int, slot_bytes: int, threads: int,
                 reserve_bytes: int = 0, blocking_events: bool = True, python_workers: bool = True,
                 chunks_per_thread: int = 2, min_chunk_bytes: int = MIN_CHUNK_BYTES,
                 ring_hugepage: bool = True):
        super().__init__(device)
        if threads < 1 or threads > 64:
            raise ValueError(f"threads must be in 1..64, got {threads}")
        self.slot_bytes = page_align_up(max(ALIGNMENT, int(slot_bytes)))
        ring_bytes = int(pinned_bytes) - int(reserve_bytes)
        if reserve_bytes and ring_bytes < 2 * self.slot_bytes:
            raise ValueError(f"pinned_bytes={pinned_bytes} leaves no room for a ring of 2 slots of "
                             f"{self.slot_bytes} besides the direct windows ({reserve_bytes} bytes): "
                             "raise pinned_bytes or lower direct_threads / direct_depth")
        num_slots = max(2, ring_bytes // self.slot_bytes)
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
                                     "rebuild the cache (mmap-offload warmup)") from e
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
        if getattr(self, "affinity", None) == "spread":
            cpus = spread_cpus()
            if cpus:
                os.sched_setaffinity(0, {cpus[index % len(cpus)]})
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


_NATIVE_COPY_KINDS = {"libc": 0, "nt": 1, "nt4": 2, "movsb": 3, "tc": 4, "mixed": 5}


def _cuda_runtime_api() -> list[int] | None:
    """Addresses of the CUDA runtime functions the native pool calls, from the libcudart torch
    loaded (``pinned.loaded_cudart``); None if it is not found."""
    torch.cuda.init()
    lib = loaded_cudart()
    names = ("cudaMemcpyAsync", "cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventSynchronize",
             "cudaEventDestroy", "cudaSetDevice", "cudaHostRegister", "cudaHostUnregister",
             "cudaEventQuery")
    try:
        return [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names] if lib else None
    except AttributeError:
        return None


class _FakeEvent:
    """A CPU event of the native pool's CPU stream (csrc/copy_pool.c, mo_fake_*)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        h = ctypes.c_void_p()
        if lib.mo_fake_event_create(ctypes.byref(h), 0) != 0:
            raise MemoryError("could not create a CPU event")
        self.handle = h.value

    def query(self) -> bool:
        return bool(self._lib.mo_fake_event_done(self.handle))

    def synchronize(self) -> None:
        self._lib.mo_fake_event_sync(self.handle)

    def __del__(self) -> None:
        h, self.handle = getattr(self, "handle", None), None
        if h:
            self._lib.mo_fake_event_destroy(h)


class _NativePool:
    """csrc/copy_pool.c: a pthread pool that fills ring slots and issues the H2D copies, one C call
    per batch. On CUDA it uses torch's libcudart and the device's copy stream; on CPU, the
    library's own CPU stream (``stream_delay_us`` delays each of its copies: a test hook).

    Calls into the pool may run in any thread, also during ``close``: each holds a use count, and
    ``close`` frees the pool only after shutting it down (every batch issued, so waiters return)
    and after the last user left. ``handle`` stays set until then."""

    def __init__(self, lib: Any, device: torch.device, stream: Any, ring: PinnedRing, threads: int,
                 copy_kind: int, prefetch: int, stream_delay_us: int = 0, direct_threads: int = 0,
                 direct_depth: int = 2, hot_slots: bool = False) -> None:
        self.lib = lib
        self.device = device
        self._fake_stream = None
        self._cv = threading.Condition()
        self._users = 0
        self._closing = False
        self._close_lock = threading.Lock()
        self._final: dict[str, float] = {}
        if device.type == "cuda":
            api = _cuda_runtime_api()
            if api is None:
                raise UnsupportedError("the CUDA runtime torch uses was not found", "use native=False")
            handle, index = stream.handle, device.index
        else:
            self._fake_stream = lib.mo_fake_stream_create(int(stream_delay_us))
            if not self._fake_stream:
                raise MemoryError("the native copy pool's CPU stream could not start")
            api = [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value if n else None for n in (
                "mo_fake_memcpy_async", "mo_fake_event_create", "mo_fake_event_record",
                "mo_fake_event_sync", "mo_fake_event_destroy", None, "mo_fake_host_register",
                "mo_fake_host_unregister", "mo_fake_event_query")]
            handle, index = self._fake_stream, -1
        self._api = (ctypes.c_void_p * 9)(*api)
        self.stream = stream
        self.handle = lib.mo_pool_create(self._api, index, handle, ring.buffer.ptr, ring.slot_bytes,
                                         ring.num_slots, threads, copy_kind, prefetch,
                                         direct_threads, direct_depth, 1 if hot_slots else 0)
        if not self.handle:
            self._destroy_stream()
            raise MemoryError("the native copy pool could not start (threads or CUDA events)")

    def new_event(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(blocking=self.stream.blocking)
            ev.record(self.stream.stream)  # creates the handle; the pool records it again
            return ev, ev.cuda_event
        ev = _FakeEvent(self.lib)
        return ev, ev.handle

    def _enter(self, closing_ok: bool) -> int:
        """The pool's handle with a use counted (release with ``_leave``), or 0: freed, or closing
        and not ``closing_ok``."""
        with self._cv:
            if not self.handle or (self._closing and not closing_ok):
                return 0
            self._users += 1
            return self.handle

    def _leave(self) -> None:
        with self._cv:
            self._users -= 1
            if not self._users:
                self._cv.notify_all()

    def submit(self, triples: np.ndarray, chunk_bytes: int, ticket: Ticket) -> int:
        """``triples``: flat uint64 (src address, dst address, nbytes) per piece."""
        status = np.zeros(_ST_LEN, dtype=np.int64)
        ev, handle = self.new_event()
        ticket._status, ticket._native_event = status, ev  # alive (with the ticket) until issued
        ticket._native_lib = self.lib
        h = self._enter(closing_ok=False)
        try:
            n = self.lib.mo_pool_submit(h, triples.ctypes.data, len(triples) // 3, chunk_bytes,
                                        status.ctypes.data, handle) if h else -1
        finally:
            if h:
                self._leave()
        if n < 0:
            ticket._status = None
            if n == -1:
                raise RuntimeError("transfer engine is closed")
            raise MemoryError(f"the native copy pool refused a batch of {len(triples) // 3} pieces "
                              f"(chunk_bytes {chunk_bytes}): too many pieces or no memory")
        return int(n)

    def wait(self, ticket: Ticket) -> None:
        # closing_ok: shutdown issues every batch, so a waiter in there returns, then close frees
        h = self._enter(closing_ok=True)
        if not h:  # freed: shut down first, so every batch is issued
            return
        try:
            self.lib.mo_pool_wait(h, ticket._status.ctypes.data)
        finally:
            self._leave()

    def stats(self) -> dict[str, float]:
        h = self._enter(closing_ok=True)
        if not h:
            return dict(self._final)
        out = np.zeros(8, dtype=np.uint64)
        try:
            self.lib.mo_pool_stats(h, out.ctypes.data)
        finally:
            self._leave()
        return dict(bytes_moved=int(out[0]), chunks=int(out[1]), fill_seconds=int(out[2]) / 1e9,
                    issue_seconds=int(out[3]) / 1e9, ring_wait_seconds=int(out[4]) / 1e9,
                    direct_bytes=int(out[5]), direct_fallbacks=int(out[6]),
                    register_seconds=int(out[7]) / 1e9)

    def close(self) -> None:
        """Cancel what is queued, finish what runs, wait for the slots' copies. Idempotent; a
        second caller returns once the first is done (the ring must outlive the workers)."""
        with self._close_lock:
            with self._cv:
                h = self.handle
                self._closing = True
            if h:
                self.lib.mo_pool_shutdown(h)  # every batch issued: waiters in the pool return
                self._final = self.stats()
                with self._cv:
                    while self._users:
                        self._cv.wait()
                    self.handle = None
                self.lib.mo_pool_destroy(h)
            self._destroy_stream()

    def _destroy_stream(self) -> None:
        if self._fake_stream:
            s, self._fake_stream = self._fake_stream, None
            self.lib.mo_fake_stream_destroy(s)


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
        lib = native_copy_lib() if fits else None
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


class PreadEngine(_RingEngine):
    """Cold path: parallel O_DIRECT ``preadv`` of aligned ranges into ring slots -> device."""

    kind = "pread"

    def __init__(self, device: torch.device, *, pinned_bytes: int = 256 << 20,
                 slot_bytes: int = 16 << 20, threads: int = 8, direct_io: bool = True,
                 blocking_events: bool = True):
        self.direct_io = direct_io
        self._fds: dict[Path, tuple[int, bool]] = {}
        self._fds_lock = threading.Lock()
        self.odirect_refused = 0
        self._stale_fds: list[int] = []
        super().__init__(device, pinned_bytes=pinned_bytes, slot_bytes=slot_bytes,
                         threads=threads, blocking_events=blocking_events)

    def _fd(self, path: Path) -> tuple[int, bool]:
        ent = self._fds.get(path)
        if ent is None:
            with self._fds_lock:
                ent = self._fds.get(path)
                if ent is None:
                    ent = self._open(path, self.direct_io)
                    self._fds[path] = ent
        return ent

    def _open(self, path: Path, direct: bool) -> tuple[int, bool]:
        if direct and hasattr(os, "O_DIRECT"):
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT), True
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self.odirect_refused += 1
        return os.open(path, os.O_RDONLY), False

    def _buffered_fallback(self, path: Path) -> tuple[int, bool]:
        with self._fds_lock:
            fd, direct = self._fds[path]
            if direct:
                self.odirect_refused += 1
                self._fds[path] = (os.open(path, os.O_RDONLY), False)
                # the O_DIRECT fd may still be used by another worker; closed with the engine
                self._stale_fds.append(fd)
            return self._fds[path]

    def _file_size(self, path: Path) -> int:
        return os.fstat(self._fd(path)[0]).st_size

    def _fill(self, chunk: _Chunk, slot: Slot, stats: _WorkerStats) -> None:
        for p in chunk.parts:
            w0 = p.window
            length = _align_up(p.end) - w0
            need = p.end - w0
            fd, direct = self._fd(p.path)
            buf = memoryview(slot.tensor.numpy())[p.slot_off:p.slot_off + length]
            got, direct = self._read_full(fd, buf, w0, need, direct, p.path)
            if direct:
                stats.odirect_bytes += p.end - p.start
            else:
                stats.buffered_bytes += p.end - p.start
            if got < need:
                raise CacheError(f"cache file {p.path} ended early: read {got} of {need} bytes at "
                                 f"offset {w0}", "run mmap-offload verify DIR")

    def _read_full(self, fd: int, buf: memoryview, offset: int, need: int, direct: bool,
                   path: Path) -> tuple[int, bool]:
        """Read at least ``need`` bytes (or to EOF); returns (bytes read, O_DIRECT used)."""
        got = 0
        while got < need:
            try:
                n = os.preadv(fd, [buf[got:]], offset + got)
            except OSError as e:
                if direct and e.errno == errno.EINVAL:
                    fd, direct = self._buffered_fallback(path)
                    continue
                raise
            if n == 0:
                break
            got += n
            if direct and got % ALIGNMENT:  # short O_DIRECT read mid-file: finish buffered
                if got >= need:
                    break
                fd, direct = os.open(path, os.O_RDONLY), False
                try:
                    got += self._read_full(fd, buf[got:], offset + got, need - got, False, path)[0]
                finally:
                    os.close(fd)
                break
        return got, direct

    @property
    def metrics(self) -> dict[str, Any]:
        m = super().metrics
        m["odirect_bytes"] = sum(s.odirect_bytes for s in self._stats)
        m["buffered_bytes"] = sum(s.buffered_bytes for s in self._stats)
        m["odirect_refused"] = self.odirect_refused
        return m

    def _close_files(self) -> None:
        with self._fds_lock:
            fds = [fd for fd, _ in self._fds.values()] + list(self._stale_fds)
            self._fds.clear()
            self._stale_fds.clear()
        for fd in fds:
            os.close(fd)


class KvikioEngine(TransferEngine):
    """``kvikio.CuFile(path).pread`` straight into each destination, on kvikio's thread pool.

    ``threads`` and ``task_size`` set kvikio.defaults (process-global). Pinned memory: none of
    ours; in compat mode kvikio keeps its own bounce buffers (reported as an estimate)."""

    kind = "kvikio"

    def __init__(self, device: torch.device, *, threads: int = 16, task_size: int = 8 << 20):
        super().__init__(device)
        self.kvikio = import_kvikio()
        self.threads = int(threads)
        self.task_size = int(task_size)
        self.kvikio.defaults.set({"num_threads": self.threads, "task_size": self.task_size})
        self._files: dict[Path, Any] = {}
        self._files_lock = threading.Lock()

    def _file(self, path: Path) -> Any:
        f = self._files.get(path)
        if f is None:
            with self._files_lock:
                f = self._files.get(path)
                if f is None:
                    if not os.path.exists(path):
                        raise CacheError(f"cache file {path} is missing",
                                         "rebuild the cache (mmap-offload warmup)")
                    f = self.kvikio.CuFile(path, "r")
                    self._files[path] = f
        return f

    def _submit(self, copies: list[Copy], after: Any) -> Ticket:
        pieces = self._pieces(copies)
        sizes: dict[str, int] = {}
        for path, start, n, _ in pieces:
            size = sizes.get(path)
            if size is None:
                size = sizes[path] = os.stat(path).st_size if os.path.exists(path) else 0
            if start + n > size:
                raise CacheError(f"cache file {path} ends at {size} bytes, a read needs "
                                 f"{start + n} (missing or truncated?)", "run mmap-offload verify DIR")
        if after is not None:
            after.synchronize()  # kvikio copies on its own streams: order on the host
        ticket = Ticket(sum(p[2] for p in pieces), 0)
        for path, start, n, dst in pieces:
            buf = dst if self.device.type == "cuda" else dst.numpy()
            ticket.futures.append(self._file(path).pread(buf, n, start))
        self._counters["tickets"] += 1
        self._counters["copies"] += len(pieces)
        self._counters["bytes_moved"] += ticket.nbytes
        return ticket

    @property
    def metrics(self) -> dict[str, Any]:
        m = super().metrics
        m["pinned_bytes"] = 0
        m["kvikio_threads"] = self.threads
        m["kvikio_task_size"] = self.task_size
        try:
            m["kvikio_compat_mode"] = str(self.kvikio.defaults.get("compat_mode"))
            m["kvikio_bounce_bytes_estimate"] = int(
                self.kvikio.defaults.get("bounce_buffer_size")) * self.threads
        except Exception:
            pass
        return m

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._files_lock:
            files, self._files = self._files, {}
        for f in files.values():
            f.close()


def import_kvikio() -> Any:
    """Import kvikio or raise the one-line install hint."""
    try:
        import kvikio  # type: ignore[import-not-found]
        import kvikio.defaults  # noqa: F401
    except Exception as e:
        raise MmapOffloadError(f"the kvikio engine needs kvikio ({type(e).__name__}: {e})",
                               GDS_INSTALL_HINT) from None
    return kvikio


def gds_active() -> bool:
    """True where the nvidia-fs kernel module (GPUDirect Storage) is loaded."""
    return os.path.exists("/sys/module/nvidia_fs") or os.path.exists("/proc/driver/nvidia-fs")


def make_engine(kind: str = "auto", device: torch.device | str | None = None, *,
                pinned_bytes: int = 256 << 20, slot_bytes: int | None = None, threads: int = 8,
                **options: Any) -> TransferEngine:
    """Build a transfer engine. ``options`` go to the engine class (e.g. ``direct_threads`` for
    mmap, ``direct_io`` for pread, ``task_size`` for kvikio). ``slot_bytes`` None: the engine's
    own default (mmap 4 MiB, pread 16 MiB)."""
    if kind not in ENGINE_KINDS:
        raise UnsupportedError(f"unknown transfer engine {kind!r}",
                               f"choose one of {', '.join(ENGINE_KINDS)}")
    dev = _normalize_device(device)
    if kind == "auto":
        kind = "mmap"
        if dev.type == "cuda" and gds_active():
            try:
                import_kvikio()
                kind = "kvikio"  # GPUDirect Storage: disk -> GPU with no bounce buffer
            except MmapOffloadError:
                pass
        # without nvidia-fs kvikio reads through its own bounce buffers (compat mode): the mmap
        # engine with 8 threads matched its 16 warm and beat it cold (TRANSFER.md)
    if slot_bytes is not None:
        options["slot_bytes"] = slot_bytes
    if kind == "mmap":
        return MmapEngine(dev, pinned_bytes=pinned_bytes, threads=threads, **options)
    if kind == "pread":
        return PreadEngine(dev, pinned_bytes=pinned_bytes, threads=threads, **options)
    options.pop("slot_bytes", None)
    return KvikioEngine(dev, threads=options.pop("kvikio_threads", 16),
                        **{k: v for k, v in options.items() if k == "task_size"})
