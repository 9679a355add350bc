"""Copy streams: the ONE host-to-device copy stream of each device (``copy_stream``), used from
worker threads through ``_CudaCopyStream`` (ctypes ``cudaMemcpyAsync`` of torch's libcudart), and
its CPU model ``_CpuCopyStream`` (a FIFO run by one thread, events included) for tests and CPU runs."""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import Any, Callable

import torch

from ..pinned import Slot, address_tensor, loaded_cudart

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
