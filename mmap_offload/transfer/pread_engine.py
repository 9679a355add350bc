"""The pread engine (cold path): parallel O_DIRECT ``preadv`` of aligned ranges into ring slots."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import torch

from ..cache_format import ALIGNMENT
from ..errors import CacheError
from ..pinned import Slot
from .ring import _RingEngine, _WorkerStats
from .ticket import _align_up, _Chunk

class PreadEngine(_RingEngine):
    """Cold path: parallel O_DIRECT ``preadv`` of aligned ranges into ring slots -> device.

    Read errors (EIO, a file that ends early) fail the ticket with one line naming the file and
    offset. ``_preadv`` is the reader (``os.preadv``); tests replace it to inject faults."""

    kind = "pread"
    _preadv = staticmethod(os.preadv)

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

    def _fd(self, path: str) -> tuple[int, bool]:
        return self._per_file("_fds", self._fds_lock, path, lambda: self._open(path, self.direct_io))

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
            try:
                got, direct = self._read_full(fd, buf, w0, need, direct, p.path)
            except OSError as e:
                raise CacheError(f"reading cache file {p.path} at offset {w0} failed: {e.strerror or e}",
                                 "check the disk (dmesg) and the cache: mmap-offload verify DIR") from e
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
                n = self._preadv(fd, [buf[got:]], offset + got)
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
