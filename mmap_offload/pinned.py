"""The one owner of pinned (page-locked) host memory: exact-size buffers and a ring of slots.

    PinnedBuffer(nbytes)          anonymous mmap of exactly ``nbytes`` (rounded up to the 4096-byte
                                  page), registered with ``cudaHostRegister``; ``pinned_bytes`` is
                                  what is locked, to the byte. Never ``Tensor.pin_memory()``: torch's
                                  caching host allocator rounds big blocks up to a power of two.
    PinnedRing(slots, slot_bytes) one PinnedBuffer cut into equal, 4096-aligned slots. ``acquire()``
                                  hands out a slot only once the event of its last use completed;
                                  ``release(slot, event)`` gives it back with the event of the copy
                                  that still reads it (the H2D of a transfer engine).

Events are anything with ``query() -> bool`` and ``synchronize()``: ``torch.cuda.Event`` on a GPU,
the CPU stand-in of ``transfer/streams.py`` without one, or a test's fake. Without CUDA the same classes
hand out ordinary (pageable) memory and ``pinned_bytes`` is 0.

``total_pinned_bytes()`` is the process-wide sum of what this module holds locked right now.
Closing a buffer invalidates every view of it: close only after every copy from it completed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

PAGE = 4096

# Linux constants (x86-64 and aarch64 share these values).
PROT_READ, PROT_WRITE = 0x1, 0x2
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS = 0x1, 0x2, 0x10, 0x20
MAP_NORESERVE, MAP_POPULATE = 0x4000, 0x8000
MADV_SEQUENTIAL, MADV_WILLNEED, MADV_DONTNEED, MADV_HUGEPAGE = 2, 3, 4, 14
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23

CUDA_HOST_REGISTER_PORTABLE = 0x1
CUDA_HOST_REGISTER_MAPPED = 0x2  # a device address for the memory (cudaHostGetDevicePointer)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
# A CDLL call releases the GIL for its duration: this is the copy primitive of the engines.
_libc.memcpy.restype = ctypes.c_void_p
_libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def page_align_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def os_mmap(nbytes: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    """libc ``mmap``; returns the address. Raises OSError with errno on failure."""
    addr = _libc.mmap(None, nbytes, prot, flags, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes failed")
    return int(addr)


def os_munmap(addr: int, nbytes: int) -> None:
    if _libc.munmap(addr, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "munmap failed")


def madvise(addr: int, nbytes: int, advice: int) -> bool:
    """libc ``madvise``; ``addr`` must be page-aligned. Returns False where the kernel refuses."""
    return _libc.madvise(addr, nbytes, advice) == 0


def memcpy(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` between raw addresses with the GIL released."""
    _libc.memcpy(dst, src, nbytes)


def mincore_count(addr: int, nbytes: int) -> int:
    """Pages of the page-aligned range [addr, addr+nbytes) resident in memory (``mincore``)."""
    pages = (nbytes + PAGE - 1) // PAGE
    vec = np.zeros(pages, dtype=np.uint8)
    if _libc.mincore(addr, nbytes, vec.ctypes.data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, "mincore failed")
    return int(np.count_nonzero(vec & 1))


def address_tensor(addr: int, nbytes: int) -> torch.Tensor:
    """A 1-D uint8 CPU tensor viewing raw memory (no copy, no ownership)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


# --- CUDA host registration ------------------------------------------------------------------

def cuda_usable() -> bool:
    """True where torch has CUDA and a device is present."""
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken driver installs
        return False


def loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library torch already loaded, or None. Looked up with RTLD_NOLOAD: never
    a second copy of the runtime (its own context state) in the process."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL | 0x4)  # 0x4 = RTLD_NOLOAD
        except OSError:
            continue
    return None


def _clear_cuda_error() -> None:
    """Reset this thread's sticky-free CUDA 'last error' after a handled failure (best effort)."""
    lib = loaded_cudart()
    try:
        if lib is not None:
            lib.cudaGetLastError()
    except AttributeError:
        pass


def cuda_host_register(addr: int, nbytes: int, flags: int = CUDA_HOST_REGISTER_PORTABLE) -> bool:
    """``cudaHostRegister``; True on success, False (error cleared) on failure. GIL released."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(addr, nbytes, flags)
    if int(err) != 0:
        _clear_cuda_error()
        return False
    return True


def cuda_host_unregister(addr: int) -> None:
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostUnregister(addr)) != 0:
        _clear_cuda_error()


_total_lock = threading.Lock()
_total_pinned = 0


def _account(delta: int) -> None:
    global _total_pinned
    with _total_lock:
        _total_pinned += delta


def total_pinned_bytes() -> int:
    """Bytes this process holds page-locked through this module right now."""
    return _total_pinned


class PinnedBuffer:
    """Exactly ``nbytes`` (rounded up to 4096) of page-aligned host memory, pinned where CUDA exists.

    ``ptr`` is the address, ``tensor`` a uint8 view of all of it, ``pinned_bytes`` the bytes locked
    (== ``nbytes`` when pinned, else 0). ``close()`` unregisters and unmaps; it is idempotent, and
    every view becomes invalid after it.
    """

    def __init__(self, nbytes: int, *, pin: bool | None = None, hugepage: bool = True,
                 register_flags: int = CUDA_HOST_REGISTER_PORTABLE):
        if nbytes <= 0:
            raise ValueError(f"PinnedBuffer needs a positive size, got {nbytes}")
        self.nbytes = page_align_up(int(nbytes))
        if hugepage:  # 2 MiB pages where THP allows: fewer TLB misses for the copies into it
            self.ptr = os_mmap(self.nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS)
            madvise(self.ptr, self.nbytes, MADV_HUGEPAGE)
            if not madvise(self.ptr, self.nbytes, MADV_POPULATE_WRITE):  # kernel < 5.14
                ctypes.memset(self.ptr, 0, self.nbytes)
        else:
            self.ptr = os_mmap(self.nbytes, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE)
        self.pinned_bytes = 0
        self._closed = False
        want = cuda_usable() if pin is None else pin
        if want:
            torch.cuda.init()
            if not cuda_host_register(self.ptr, self.nbytes, register_flags):
                os_munmap(self.ptr, self.nbytes)
                raise MemoryError(f"cudaHostRegister of {self.nbytes} bytes failed "
                                  "(RLIMIT_MEMLOCK or host memory exhausted)")
            self.pinned_bytes = self.nbytes
            _account(self.nbytes)
        self.tensor = address_tensor(self.ptr, self.nbytes)

    @property
    def pinned(self) -> bool:
        return self.pinned_bytes > 0

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.pinned_bytes:
            cuda_host_unregister(self.ptr)
            _account(-self.pinned_bytes)
            self.pinned_bytes = 0
        os_munmap(self.ptr, self.nbytes)

    def __enter__(self) -> "PinnedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # last resort; engines close explicitly
        try:
            self.close()
        except Exception:
            pass


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(eq=False)
class Slot:
    """One ring slot: ``ptr`` (4096-aligned), ``nbytes``, ``tensor`` (uint8 view), ``index``."""

    index: int
    ptr: int
    nbytes: int
    tensor: torch.Tensor


class RingClosedError(RuntimeError):
    pass


class PinnedRing:
    """``num_slots`` slots of ``slot_bytes`` (rounded up to 4096) in one exact PinnedBuffer.

    Thread-safe. ``acquire()`` returns a free slot, else the oldest released one after waiting for
    its event (so a slot is never handed out while a copy still reads it); ``release(slot, event)``
    gives a slot back; ``event=None`` means nothing reads it any more.
    ``wait_seconds`` counts the time acquirers spent waiting for a slot.
    """

    def __init__(self, num_slots: int, slot_bytes: int, *, pin: bool | None = None, hugepage: bool = True):
        if num_slots < 1:
            raise ValueError("PinnedRing needs at least one slot")
        self.slot_bytes = page_align_up(int(slot_bytes))
        self.num_slots = int(num_slots)
        self.buffer = PinnedBuffer(self.num_slots * self.slot_bytes, pin=pin, hugepage=hugepage)
        self.slots = [
            Slot(i, self.buffer.ptr + i * self.slot_bytes, self.slot_bytes,
                 self.buffer.tensor[i * self.slot_bytes:(i + 1) * self.slot_bytes])
            for i in range(self.num_slots)
        ]
        self._free: deque[Slot] = deque(self.slots)
        self._busy: deque[tuple[Slot, Event]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.wait_seconds = 0.0

    @property
    def pinned_bytes(self) -> int:
        return self.buffer.pinned_bytes

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def acquire(self, timeout: float | None = None) -> Slot:
        """A slot nothing reads any more. Raises TimeoutError, or RingClosedError after close()."""
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        with self._cond:
            while True:
                if self._closed:
                    raise RingClosedError("ring closed")
                if self._free:
                    return self._free.popleft()
                for i, (slot, ev) in enumerate(self._busy):
                    if ev.query():
                        del self._busy[i]
                        return slot
                if self._busy:
                    slot, ev = self._busy.popleft()
                    break
                # every slot is held by an acquirer that has not released it yet
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError("no ring slot became free in time")
                self._cond.wait(left)
        try:
            ev.synchronize()  # oldest in-flight use; outside the lock, we own this slot now
        except BaseException:
            self.release(slot, ev)
            raise
        self.wait_seconds += time.perf_counter() - t0
        return slot

    def release(self, slot: Slot, event: Event | None = None) -> None:
        with self._cond:
            if event is None:
                self._free.append(slot)
            else:
                self._busy.append((slot, event))
            self._cond.notify()

    def drain(self) -> None:
        """Wait until no released slot is still being read."""
        with self._cond:
            busy = list(self._busy)
        for _, ev in busy:
            ev.synchronize()

    def close(self) -> None:
        """Wait for in-flight reads of the slots, then free the memory. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            busy = list(self._busy)
            self._busy.clear()
            self._cond.notify_all()
        for _, ev in busy:
            try:
                ev.synchronize()
            except Exception:
                pass
        self.buffer.close()

    def __enter__(self) -> "PinnedRing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
