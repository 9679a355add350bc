"""Copy completion signalled on the device, so that a compute stream can wait for copies the host
has not finished issuing.

A batch of copies gets an event only once its last chunk was read and its H2D copy issued, and a
stream can only wait for an event already recorded: a caller that needs the bytes on the GPU
(the expert cache at decode) blocks until the copy threads are through. With CUDA stream memory
operations the order moves to the device: the copy pool, after a batch's last copy, enqueues
``cuStreamWriteValue32(copy stream, word, value)``; the caller enqueues at once
``cuStreamWaitValue32(compute stream, word, value, GEQ)`` and goes on launching. The kernel runs
once the bytes have landed; the host never waited. A batch writes its word whatever its outcome
(a waiting stream never hangs); read errors reach the host through the ticket, which the caller
checks later (``TransferEngine.wait_on_device``).

Each batch takes its own word of a small device array (value = a running count, word = value mod
``words``), so batches finishing out of order never lower a word another waiter looks at; the
comparison is CUDA's cyclic ``(int32)(*word - value) >= 0``.

The driver entry points come from ``libcuda.so.1`` (``cuStreamWaitValue32_v2`` /
``cuStreamWriteValue32_v2``, CUDA >= 11.7, always available there). Without them,
``StreamSignals.for_device`` returns None and callers block as before. On the CPU the native pool's
own CPU stream provides the write (``mo_fake_write_value``) so tests can check the ordering."""

from __future__ import annotations

import ctypes
import functools
import itertools
import threading
from typing import Any

import torch

CU_STREAM_WAIT_VALUE_GEQ = 0x0


@functools.lru_cache(maxsize=None)
def _driver_functions() -> tuple[Any, int] | None:
    """(cuStreamWaitValue32 callable, cuStreamWriteValue32 address) from libcuda, or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    for suffix in ("_v2", ""):
        try:
            wait = getattr(lib, "cuStreamWaitValue32" + suffix)
            write = getattr(lib, "cuStreamWriteValue32" + suffix)
        except AttributeError:
            continue
        wait.restype = ctypes.c_int
        wait.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        return wait, ctypes.cast(write, ctypes.c_void_p).value
    return None


class StreamSignals:
    """Device words batches of copies set when done, and the waits on them (module docstring)."""

    def __init__(self, words: torch.Tensor, write_fn: int, wait_fn: Any = None):
        self.words = words  # int32 [n], zeroed
        self.write_fn = write_fn  # address of the write-value function the copy pool calls
        self._wait = wait_fn
        self._count = itertools.count(1)
        self._lock = threading.Lock()
        self.waits = 0  # device waits enqueued (metrics)

    @classmethod
    def for_device(cls, device: torch.device, words: int = 4096) -> "StreamSignals | None":
        """Signals on CUDA ``device``, or None where the driver lacks stream memory operations."""
        if device.type != "cuda":
            return None
        fns = _driver_functions()
        if fns is None:
            return None
        wait, write = fns
        return cls(torch.zeros(words, dtype=torch.int32, device=device), write, wait)

    @classmethod
    def for_cpu_stream(cls, lib: Any, words: int = 64) -> "StreamSignals":
        """Host words the native pool's CPU stream writes (tests: ``mo_fake_write_value``)."""
        return cls(torch.zeros(words, dtype=torch.int32), ctypes.cast(lib.mo_fake_write_value, ctypes.c_void_p).value)

    def next(self) -> tuple[int, int]:
        """(address, value) for one batch: the word its stream sets to value when it is done."""
        with self._lock:
            value = next(self._count) & 0x7FFFFFFF or next(self._count)
        word = value % self.words.numel()
        return self.words.data_ptr() + 4 * word, value

    def value_at(self, addr: int) -> int:
        """The word's current value (host words only; tests)."""
        return int(self.words[(addr - self.words.data_ptr()) // 4])

    def wait(self, stream: Any, addr: int, value: int) -> None:
        """Make ``stream`` (a torch.cuda.Stream) wait until the word at ``addr`` reaches ``value``."""
        rc = self._wait(ctypes.c_void_p(stream.cuda_stream), addr, value, CU_STREAM_WAIT_VALUE_GEQ)
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUDA driver error {rc}")
        self.waits += 1


__all__ = ["StreamSignals"]
