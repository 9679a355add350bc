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
            workers are a pthread pool in C (csrc/copy_pool.c with the copy kernels of
            csrc/fastcopy.c, the library mo_native: built at pip install, else at run time, by
            ``mmap_offload.native``): one GIL-free call per batch
            cuts it into chunks, fills slots and issues cudaMemcpyAsync with torch's libcudart
            (on the CPU: the library's own stand-in stream). The pool reuses the newest idle slot
            (``slot_reuse="hot"``) and copies whole-slot chunks with ``rep movsb``, smaller ones
            with non-temporal AVX2 stores (``copy_impl="mixed"``): the slot's lines are still in
            the CPU caches when the DMA reads them (93% of pinned H2D with 8 threads against 75-86%
            for non-temporal stores into the oldest slot: docs/TRANSFER.md). Where the library is
            unavailable (or ``native=False``), Python threads copy instead, with the non-temporal
            kernel or libc memcpy. A region is pre-faulted once per engine (MADV_POPULATE_READ) so
            later passes copy at memory speed.
    pread   cold path. Same ring, filled by parallel ``os.preadv`` of the covering 4096-aligned
            range with O_DIRECT (no page-cache pollution, queue depth = threads); buffered
            ``preadv`` where the file system refuses O_DIRECT (metrics say which).
    kvikio  ``kvikio.CuFile(path).pread`` straight into the destination (GPUDirect Storage where
            the nvidia-fs driver runs, else kvikio's POSIX compat mode with its own bounce
            buffers). Needs ``pip install 'mmap-offload[gds]'``.
    auto    kvikio where GPUDirect Storage is active (nvidia-fs loaded) and kvikio imports; else
            mmap (kvikio's compat mode is pread into bounce buffers: with 16 threads it reached
            88-89% of pinned H2D warm where mmap with 8 reached 91-93%). docs/TRANSFER.md has numbers.

Files, one job each: ``ticket.py`` (Copy, Ticket, the TransferEngine contract and planning),
``streams.py`` (the copy stream of a device and its CPU model), ``pagecache.py`` (residency,
eviction, the aligned file mapping), ``native_pool.py`` (the ctypes wrapper of csrc/copy_pool.c;
the library itself is found or built by ``mmap_offload/native.py``), ``ring.py`` (the ring engine
base and its Python workers), and one file per engine: ``mmap_engine.py``, ``pread_engine.py``,
``kvikio_engine.py``. This file: ``make_engine`` and the public names.

Completion. ``wait(ticket)`` blocks the host until every chunk of the ticket has been read from
the file and its device copy issued; on CUDA it then makes the caller's current stream (or
``stream=``) wait on ``ticket.event``, an event recorded on the copy stream after the ticket's
last copy: no host sync with the GPU, kernels queued after ``wait`` see the bytes. On CPU (and for
kvikio) the bytes are in place when ``wait`` returns. ``synchronize(ticket)`` also waits for the
device. Destinations must not be read or written by pending kernels when the ticket starts:
``submit(..., after=event)`` makes the copy stream wait on ``event`` first.

Stream-ordered batches (mmap engine with ``ordered_fraction`` > 0): ``submit_ordered(copies)`` enqueues
the copies on the current stream at once, behind a host-function gate that opens when the pool's own
threads have read the bytes; the host never waits, and ``wait(ticket)`` only waits for the reads and
raises their error, which must be checked before results computed from the destinations are used
(docs/TRANSFER.md, "Stream-ordered batches").
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import MmapOffloadError, UnsupportedError
from .kvikio_engine import GDS_INSTALL_HINT, KvikioEngine, gds_active, import_kvikio
from .mmap_engine import COPY_IMPLS, NATIVE_MIN_CHUNK_BYTES, MmapEngine
from .native_pool import NATIVE_POOL_ABI, native_copy_lib
from .pagecache import evict_page_cache, resident_fraction
from .pread_engine import PreadEngine
from .ring import MIN_CHUNK_BYTES
from .streams import copy_stream
from .ticket import Copy, Ticket, TransferEngine, _normalize_device

__all__ = [
    "COPY_IMPLS", "ENGINE_KINDS", "GDS_INSTALL_HINT", "MIN_CHUNK_BYTES", "NATIVE_MIN_CHUNK_BYTES",
    "NATIVE_POOL_ABI", "Copy", "KvikioEngine", "MmapEngine", "PreadEngine", "Ticket", "TransferEngine",
    "copy_stream", "evict_page_cache", "gds_active", "import_kvikio", "make_engine", "native_copy_lib",
    "resident_fraction",
]

ENGINE_KINDS = ("auto", "mmap", "pread", "kvikio")


def make_engine(kind: str = "auto", device: torch.device | str | None = None, *,
                pinned_bytes: int = 256 << 20, slot_bytes: int | None = None, threads: int = 8,
                **options: Any) -> TransferEngine:
    """Build a transfer engine. ``options`` go to the engine class (e.g. ``slot_reuse`` for
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
    options.pop("ordered_fraction", None)  # stream-ordered batches: the mmap engine's only
    options.pop("ordered_threads", None)
    if kind == "pread":
        return PreadEngine(dev, pinned_bytes=pinned_bytes, threads=threads, **options)
    options.pop("slot_bytes", None)
    return KvikioEngine(dev, threads=options.pop("kvikio_threads", 16),
                        **{k: v for k, v in options.items() if k == "task_size"})
