"""The kvikio engine: ``kvikio.CuFile(path).pread`` straight into each destination (GPUDirect
Storage where nvidia-fs runs, else kvikio's POSIX compat mode)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from ..cache_format import repair_command_for
from ..errors import CacheError, MmapOffloadError
from .ticket import Copy, Ticket, TransferEngine

GDS_INSTALL_HINT = "pip install 'mmap-offload[gds]'"

class KvikioEngine(TransferEngine):
    """``kvikio.CuFile(path).pread`` straight into each destination, on kvikio's thread pool.

    ``threads`` and ``task_size`` set kvikio.defaults (process-global). Pinned memory: none of
    ours; in compat mode kvikio keeps its own bounce buffers (reported as an estimate). A read that
    fails or comes back short fails the ticket with one line naming the file and offset.
    ``_kvikio``: the kvikio module to use (tests pass a fake to inject faults)."""

    kind = "kvikio"

    def __init__(self, device: torch.device, *, threads: int = 16, task_size: int = 8 << 20,
                 _kvikio: Any = None):
        super().__init__(device)
        self.kvikio = _kvikio if _kvikio is not None else import_kvikio()
        self.threads = int(threads)
        self.task_size = int(task_size)
        self.kvikio.defaults.set({"num_threads": self.threads, "task_size": self.task_size})
        self._files: dict[Path, Any] = {}
        self._files_lock = threading.Lock()

    def _file(self, path: str) -> Any:
        return self._per_file("_files", self._files_lock, path, lambda: self._open(path))

    def _open(self, path: str) -> Any:
        if not os.path.exists(path):
            raise CacheError(f"cache file {path} is missing", f"rewrite it with {repair_command_for(path)}")
        return self.kvikio.CuFile(path, "r")

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
            ticket.futures.append(_Read(self._file(path).pread(buf, n, start), path, start, n))
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


class _Read:
    """One kvikio read in flight; ``get()`` waits for it. An error or a short read becomes a
    CacheError naming the file (kvikio's own errors do not)."""

    __slots__ = ("future", "path", "offset", "nbytes")

    def __init__(self, future: Any, path: str, offset: int, nbytes: int) -> None:
        self.future, self.path, self.offset, self.nbytes = future, path, offset, nbytes

    def get(self) -> int:
        try:
            got = self.future.get()
        except (OSError, RuntimeError) as e:
            raise CacheError(f"reading cache file {self.path} at offset {self.offset} failed: "
                             f"{getattr(e, 'strerror', None) or e}",
                             "check the disk (dmesg) and the cache: mmap-offload verify DIR") from e
        if got is not None and got != self.nbytes:
            raise CacheError(f"cache file {self.path} ended early: read {got} of {self.nbytes} bytes at "
                             f"offset {self.offset}", "run mmap-offload verify DIR")
        return got


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
