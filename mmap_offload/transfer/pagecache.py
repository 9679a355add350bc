"""Cache files in the page cache: residency (``resident_fraction``), eviction (``evict_page_cache``),
and the engine's persistent read-only mapping of a file (``_MappedFile``, 2 MiB-aligned)."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

from ..errors import CacheError

from ..pinned import (
    MADV_HUGEPAGE, MADV_POPULATE_READ, MAP_ANONYMOUS, MAP_FIXED, MAP_NORESERVE, MAP_PRIVATE,
    MAP_SHARED, PAGE, PROT_READ, madvise, mincore_count, os_mmap, os_munmap, page_align_up,
)

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


class _MappedFile:
    """A read-only shared mapping of a whole file, kept for the engine's lifetime.

    The mapping starts on a 2 MiB boundary so the kernel can map large page-cache folios with
    one PMD entry each (``FilePmdMapped`` in /proc/self/smaps) instead of 512 PTEs.

    A page of the mapping that cannot be read (the file truncated after it was mapped, or a disk
    I/O error) raises SIGBUS in the reader. The native pool's copies are guarded against it
    (csrc/copy_pool.c); Python code reading the mapping calls ``check(end)`` first, which catches a
    truncation that happened before the call but not one racing with the copy (nothing can, from
    Python: that SIGBUS still kills the process), nor an I/O error. ``fd`` stays open for it."""

    GRANULE = 2 << 20

    def __init__(self, path: Path, hugepage: bool):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.size = os.fstat(self.fd).st_size
            self.length = max(PAGE, page_align_up(self.size))
            self.addr = _map_aligned(self.fd, self.length, self.GRANULE)
        except BaseException:
            os.close(self.fd)
            raise
        self.faulted = False  # a read of the mapping raised SIGBUS: sizes are re-read from now on
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

    def current_size(self) -> int:
        """The file's size now (it may have changed since it was mapped)."""
        return os.fstat(self.fd).st_size

    def check(self, end: int) -> None:
        """Raise CacheError if the file now ends before ``end`` (reading past it would SIGBUS)."""
        size = self.current_size()
        if size < end:
            raise CacheError(f"cache file {self.path} ends at {size} bytes, a read needs {end} (truncated "
                             "while mapped?)", "run mmap-offload verify DIR")

    def close(self) -> None:
        if self.addr:
            os_munmap(self.addr, self.length)
            self.addr = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


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
    from ..pinned import _libc

    got = _libc.mmap(addr, length, PROT_READ, MAP_SHARED | MAP_FIXED, fd, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap of a cache file failed")
    return int(got)
