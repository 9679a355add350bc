"""The native copy pool (csrc/copy_pool.c + the copy kernels of csrc/fastcopy.c, library
``mo_native`` found or built by ``mmap_offload.native``): its ctypes entry points (``native_copy_lib``),
the CUDA runtime functions it calls, and ``_NativePool``, one C call per batch that fills ring slots
and issues the H2D copies. Without a GPU it runs over the library's own CPU stand-in stream. Its
reads of the mapping are guarded: a SIGBUS there (file truncated, disk I/O error) fails that batch
with ``_ERR_FAULT`` and the address instead of killing the process (csrc/copy_pool.c)."""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any, Callable

import numpy as np
import torch

from ..errors import CacheError, MmapOffloadError, UnsupportedError
from ..native import cpu_flag, load_library
from ..pinned import PinnedRing, loaded_cudart
from .ticket import Ticket

_ST_CHUNKS, _ST_DONE, _ST_ISSUED, _ST_ERROR, _ST_FAULT, _ST_LEN = 0, 1, 2, 3, 4, 5  # csrc/copy_pool.c
_ST_CUDA, _ST_GATED_LEN = 5, 6  # a stream-ordered batch's extra word: its copies' CUDA error
_ERR_CANCELLED, _ERR_FAULT = -1, -2  # status[_ST_ERROR] below 0; above 0 it is a CUDA error code
# mo_gate_submit refusals (nothing queued; the caller takes the ordinary path)
_GATE_UNSUPPORTED, _GATE_TOO_BIG, _GATE_OTHER_STREAM = -3, -4, -5

NATIVE_POOL_ABI = 7  # csrc/copy_pool.c MO_POOL_ABI
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
        lib.mo_copy_nt4.argtypes = [vp, vp, sz, sz]
        if lib.mo_pool_abi() != NATIVE_POOL_ABI:
            return False
        lib.mo_pool_create.restype = vp
        lib.mo_pool_create.argtypes = [vp, ctypes.c_int, vp, vp, sz, ctypes.c_int, ctypes.c_int,
                                       ctypes.c_int, ctypes.c_int]
        lib.mo_pool_submit.restype = ctypes.c_int64
        lib.mo_pool_submit.argtypes = [vp, vp, sz, sz, vp, vp]
        lib.mo_pool_wait.restype = ctypes.c_int64
        lib.mo_pool_wait.argtypes = [vp, vp]
        lib.mo_pool_stats.argtypes = [vp, vp]
        lib.mo_gate_init.restype = ctypes.c_int
        lib.mo_gate_init.argtypes = [vp, ctypes.c_int, ctypes.c_int]
        lib.mo_gate_submit.restype = ctypes.c_int64
        lib.mo_gate_submit.argtypes = [vp, vp, sz, sz, sz, vp, vp, vp]
        lib.mo_gate_stats.argtypes = [vp, vp]
        lib.mo_status_issued.argtypes = [vp, vp]
        lib.mo_sigbus_guarded.restype = ctypes.c_int
        lib.mo_sigbus_handler.restype = vp
        lib.mo_pool_shutdown.argtypes = [vp]
        lib.mo_pool_destroy.argtypes = [vp]
        lib.mo_fake_stream_create.restype = vp
        lib.mo_fake_stream_create.argtypes = [ctypes.c_uint]
        lib.mo_fake_stream_destroy.argtypes = [vp]
        lib.mo_fake_stream_fail.argtypes = [vp, ctypes.c_int, ctypes.c_uint, ctypes.c_int]
        lib.mo_fake_event_create.argtypes = [vp, ctypes.c_uint]
        lib.mo_fake_event_record.argtypes = [vp, vp]
        lib.mo_fake_event_done.argtypes = [vp]
        lib.mo_fake_event_sync.argtypes = [vp]
        lib.mo_fake_event_destroy.argtypes = [vp]
        lib.mo_fake_launch_host_func.argtypes = [vp, vp, vp]
    except AttributeError:
        return False
    return True


_NATIVE_COPY_KINDS = {"nt4": 0, "mixed": 1}  # csrc/copy_pool.c COPY_NT4, COPY_MIXED


def _cuda_runtime_api() -> list[int] | None:
    """Addresses of the CUDA runtime functions the native pool calls, from the libcudart torch
    loaded (``pinned.loaded_cudart``); None if it is not found."""
    torch.cuda.init()
    lib = loaded_cudart()
    names = ("cudaMemcpyAsync", "cudaEventCreateWithFlags", "cudaEventRecord", "cudaEventSynchronize",
             "cudaEventDestroy", "cudaSetDevice", "cudaEventQuery")
    if not lib:
        return None
    try:
        api = [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names]
    except AttributeError:
        return None
    fn = getattr(lib, "cudaLaunchHostFunc", None)  # CUDA 10+; without it no stream-ordered batches
    return api + [ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None]


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


def _pool_error(err: int, fault: int, describe_fault: Callable[[int], BaseException] | None) -> BaseException:
    """The exception of a batch the pool finished with error code ``err`` (``fault``: the address
    whose read raised SIGBUS, with ``_ERR_FAULT``)."""
    if err == _ERR_CANCELLED:
        return MmapOffloadError("transfer cancelled: the engine was closed")
    if err == _ERR_FAULT:
        if describe_fault is not None:
            return describe_fault(fault)
        return CacheError(f"reading a mapped cache file failed at address {fault:#x} (SIGBUS: truncated "
                          "or an I/O error)", "run mmap-offload verify DIR")
    return RuntimeError(f"the copy pool's cudaMemcpyAsync / cudaEventRecord failed with CUDA error {err}")


class _NativePool:
    """csrc/copy_pool.c: a pthread pool that fills ring slots and issues the H2D copies, one C call
    per batch. On CUDA it uses torch's libcudart and the device's copy stream; on CPU, the
    library's own CPU stream (``stream_delay_us`` delays each of its copies: a test hook).

    Calls into the pool may run in any thread, also during ``close``: each holds a use count, and
    ``close`` frees the pool only after shutting it down (every batch issued, so waiters return)
    and after the last user left. ``handle`` stays set until then."""

    def __init__(self, lib: Any, device: torch.device, stream: Any, ring: PinnedRing, threads: int,
                 copy_kind: int, stream_delay_us: int = 0, hot_slots: bool = False,
                 ordered_slots: int = 0, ordered_threads: int | None = None) -> None:
        self.lib = lib
        self.device = device
        self._fake_stream = None
        self._ordered_ring: list = []  # CUDA: the events of stream-ordered tickets (_ordered_event)
        self._ordered_next = 0
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
                "mo_fake_event_sync", "mo_fake_event_destroy", None, "mo_fake_event_query",
                "mo_fake_launch_host_func")]
            handle, index = self._fake_stream, -1
        self._api = (ctypes.c_void_p * len(api))(*api)
        self.stream = stream
        self.handle = lib.mo_pool_create(self._api, index, handle, ring.buffer.ptr, ring.slot_bytes,
                                         ring.num_slots, threads, copy_kind, 1 if hot_slots else 0)
        if not self.handle:
            self._destroy_stream()
            raise MemoryError("the native copy pool could not start (threads or CUDA events)")
        # stream-ordered batches (submit_ordered): the ring's last ``ordered_slots`` slots, filled
        # by ``ordered_threads`` threads of their own (None: as many as ``threads``); ordered_bytes 0
        # when not asked for or not possible (no cudaLaunchHostFunc)
        self.ordered_bytes = 0
        if 0 < ordered_slots < ring.num_slots:
            if lib.mo_gate_init(self.handle, ring.num_slots - ordered_slots, ordered_threads or threads) == 0:
                self.ordered_bytes = ordered_slots * ring.slot_bytes

    def new_event(self) -> Any:
        if self.device.type == "cuda":
            ev = torch.cuda.Event(blocking=self.stream.blocking)
            ev.record(self.stream.stream)  # creates the handle; the pool records it again
            return ev, ev.cuda_event
        ev = _FakeEvent(self.lib)
        return ev, ev.handle

    ORDERED_EVENTS = 64

    def _ordered_event(self) -> Any:
        """The event a stream-ordered ticket gets (recorded after its copies). On CUDA one of a
        ring of ``ORDERED_EVENTS`` made once (an event made per batch cost a cudaEventCreate on the
        decode path): a later batch may record it again, which only makes a query or a wait of the
        older ticket later (conservative); ``wait`` of an ordered ticket does not use it."""
        if self.device.type != "cuda":
            return self.new_event()
        ring = self._ordered_ring
        if len(ring) < self.ORDERED_EVENTS:
            ring.append(self.new_event())
            return ring[-1]
        self._ordered_next = (self._ordered_next + 1) % len(ring)
        return ring[self._ordered_next]

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

    def submit(self, triples: np.ndarray, chunk_bytes: int, ticket: Ticket,
               describe_fault: Callable[[int], BaseException] | None = None) -> int:
        """``triples``: flat uint64 (src address, dst address, nbytes) per piece. A chunk whose read
        of the mapping raised SIGBUS fails the ticket with ``describe_fault(address)``."""
        status = np.zeros(_ST_LEN, dtype=np.int64)
        ev, handle = self.new_event()
        n = self._queue(ticket, status, ev, describe_fault, lambda h: self.lib.mo_pool_submit(
            h, triples.ctypes.data, len(triples) // 3, chunk_bytes, status.ctypes.data, handle))
        if n < 0:
            self._refused(ticket, n, "a batch", len(triples) // 3, chunk_bytes)
        return int(n)

    def _queue(self, ticket: Ticket, status: np.ndarray, ev: Any,
               describe_fault: Callable[[int], BaseException] | None, call: Callable[[int], int]) -> int:
        """Give ``ticket`` its status words and event (alive with it until issued), then run
        ``call(handle)`` with a use of the pool counted; -1 if the pool is closing."""
        self._attach(ticket, status, ev, describe_fault)
        h = self._enter(closing_ok=False)
        try:
            return call(h) if h else -1
        finally:
            if h:
                self._leave()

    def _attach(self, ticket: Ticket, status: np.ndarray, ev: Any,
                describe_fault: Callable[[int], BaseException] | None) -> None:
        ticket._status, ticket._native_event = status, ev
        ticket._native_lib = self.lib
        ticket._native_error = lambda err: _pool_error(err, int(status[_ST_FAULT]), describe_fault)

    @staticmethod
    def _refused(ticket: Ticket, n: int, what: str, pieces: int, chunk_bytes: int) -> None:
        ticket._status = None
        if n == -1:
            raise RuntimeError("transfer engine is closed")
        raise MemoryError(f"the native copy pool refused {what} of {pieces} pieces (chunk_bytes {chunk_bytes}): "
                          "too many pieces or no memory")

    def submit_ordered(self, triples: np.ndarray, chunk_bytes: int, stream_handle: int, ticket: Ticket,
                       describe_fault: Callable[[int], BaseException] | None = None,
                       group_bytes: int = 0) -> bool:
        """Queue a stream-ordered batch (csrc/copy_pool.c, "Stream-ordered batches"): its copies are
        enqueued on ``stream_handle`` behind a host-function gate that opens once the pool's own
        threads have filled the batch's arena bytes (``group_bytes`` > 0: one gate per group of at
        least that many bytes, so the stream copies a group while the threads fill the next); the
        caller does not wait. False, with nothing
        queued, where the pool cannot (no arena, a batch larger than it, another stream than the
        first): the caller takes the ordinary path. A CUDA error of the copies raises after the
        fill finished (the destinations must not be used); a gate that could not be launched makes
        the pool wait for the fill instead (``ordered_ungated``). Read errors arrive like ordinary
        ones (``wait`` raises them)."""
        if not self.ordered_bytes:
            return False
        status, handle = self.prepare_ordered(ticket, describe_fault)
        n = self._queue(ticket, status, ticket._native_event, describe_fault, lambda h: self.lib.mo_gate_submit(
            h, triples.ctypes.data, len(triples) // 3, chunk_bytes, group_bytes, stream_handle,
            status.ctypes.data, handle))
        if n in (_GATE_UNSUPPORTED, _GATE_TOO_BIG, _GATE_OTHER_STREAM):
            ticket._status = ticket._native_event = None
            return False
        if n < 0:
            self._refused(ticket, n, "a stream-ordered batch", len(triples) // 3, chunk_bytes)
        self.queued_ordered(ticket)
        return True

    def prepare_ordered(self, ticket: Ticket, describe_fault: Callable[[int], BaseException] | None = None
                        ) -> tuple[np.ndarray, int]:
        """Give ``ticket`` the status words and event of a stream-ordered batch before it is queued
        (here, or by a native caller of mo_gate_submit: csrc/route_step.c); returns (status, the
        event's handle to record after the batch's copies)."""
        status = np.zeros(_ST_GATED_LEN, dtype=np.int64)
        ev, handle = self._ordered_event()
        self._attach(ticket, status, ev, describe_fault)
        return status, handle

    def queued_ordered(self, ticket: Ticket) -> None:
        """``ticket``'s batch was queued: mark it ordered; raise its copies' CUDA error, once its
        fill (which reads into the arena) finished."""
        ticket.ordered = True
        err = int(ticket._status[_ST_CUDA])
        if err:
            self.wait(ticket)
            raise RuntimeError(f"cudaMemcpyAsync / cudaEventRecord of a stream-ordered batch failed "
                               f"with CUDA error {err}")

    def ordered_stats(self) -> dict[str, float]:
        h = self._enter(closing_ok=True)
        if not h:
            return {k: v for k, v in self._final.items() if k.startswith("ordered_")}
        out = np.zeros(10, dtype=np.uint64)
        try:
            self.lib.mo_gate_stats(h, out.ctypes.data)
        finally:
            self._leave()
        return dict(ordered_batches=int(out[0]), ordered_bytes_filled=int(out[1]),
                    ordered_fill_seconds=int(out[2]) / 1e9, ordered_gates=int(out[3]),
                    ordered_gates_waited=int(out[4]), ordered_gate_wait_seconds=int(out[5]) / 1e9,
                    ordered_arena_bytes=int(out[6]), ordered_threads=int(out[7]), ordered_ungated=int(out[8]),
                    ordered_submit_seconds=int(out[9]) / 1e9)

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
        out = np.zeros(5, dtype=np.uint64)
        try:
            self.lib.mo_pool_stats(h, out.ctypes.data)
        finally:
            self._leave()
        return dict(bytes_moved=int(out[0]), chunks=int(out[1]), fill_seconds=int(out[2]) / 1e9,
                    issue_seconds=int(out[3]) / 1e9, ring_wait_seconds=int(out[4]) / 1e9)

    def close(self) -> None:
        """Cancel what is queued, finish what runs, wait for the slots' copies. Idempotent; a
        second caller returns once the first is done (the ring must outlive the workers)."""
        with self._close_lock:
            with self._cv:
                h = self.handle
                self._closing = True
            if h:
                self.lib.mo_pool_shutdown(h)  # every batch issued: waiters in the pool return
                self._final = {**self.stats(), **self.ordered_stats()}
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
