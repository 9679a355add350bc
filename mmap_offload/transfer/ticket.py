"""The core every engine shares: ``Copy`` (what to copy), ``Ticket`` (a submitted batch),
``TransferEngine`` (the submit / wait / metrics / close contract, destination checks, planning of
copies into (file, offset, nbytes, destination) pieces), and the chunk records of the ring engines."""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..cache_format import ALIGNMENT, Extent
from ..errors import CacheError, MmapOffloadError, UnsupportedError

def _align_down(n: int) -> int:
    return n // ALIGNMENT * ALIGNMENT


def _align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class Copy:
    """Copy ranges of one extent: each ``(offset_in_extent, nbytes, dst_tensor)`` fills the first
    ``nbytes`` bytes of ``dst_tensor`` with bytes ``[offset, offset + nbytes)`` of ``src``.
    ``label`` (optional, e.g. "layer 3 expert 5") names the bytes in a read error's message."""

    src: Extent
    dst: Sequence[tuple[int, int, torch.Tensor]]
    label: str | None = None


# --- tickets ---------------------------------------------------------------------------------


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
        # stream-ordered (MmapEngine.submit_ordered): the copies are already ordered on the stream
        # it was given; ``wait`` only waits for the fill and raises its read error
        self.ordered = False
        # native pool (csrc/copy_pool.c): status words it writes, the event it records last, and
        # what turns its error code into the exception (native_pool._NativePool.submit sets them)
        self._status: np.ndarray | None = None
        self._native_event: Any = None
        self._native_lib: Any = None
        self._native_error: Callable[[int], BaseException] | None = None
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
            self.error = self._native_error(err)
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

    def _per_file(self, attr: str, lock: threading.Lock, key: str, make: Callable[[], Any]) -> Any:
        """``getattr(self, attr)[key]`` (a file's mapping, descriptor, handle), made by ``make()``
        once: worker threads race for it."""
        v = getattr(self, attr).get(key)
        if v is None:
            with lock:
                table = getattr(self, attr)
                v = table.get(key)
                if v is None:
                    v = table[key] = make()
        return v

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
        (CUDA), or the copies are complete (CPU). Raises the read error, if any. A stream-ordered
        ticket (``submit_ordered``): only its reads are waited for (its stream waits already)."""
        self._wait_issued(ticket)
        ev = ticket.event
        if ev is None or (ticket.ordered and self.device.type == "cuda" and stream is None):
            return  # stream-ordered: the stream it was submitted on waits for it already
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
