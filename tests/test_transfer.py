"""transfer.py: every engine copies file bytes verbatim, slots are never reused early, lifecycles
are safe. CPU runs the whole pipeline ("H2D" is the CPU copy stream); GPU tests are marked gpu."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mmap_offload.cache_format import Extent
from mmap_offload.errors import CacheError, MmapOffloadError, UnsupportedError
import mmap_offload.transfer as transfer
from mmap_offload.transfer import (
    Copy, evict_page_cache, make_engine, native_copy_lib, resident_fraction,
)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DTYPES = [torch.uint8, torch.int32, torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[Path, np.ndarray]:
    d = tmp_path_factory.mktemp("xfer")
    rng = np.random.default_rng(1)
    out = {}
    for i, size in enumerate([3 << 20, (1 << 20) + 4097, 12345]):
        data = rng.integers(0, 256, size=size, dtype=np.uint8)
        p = d / f"f{i}.bin"
        p.write_bytes(data.tobytes())
        out[p] = data
    return out


def random_copies(files, rng: random.Random, device, n: int, max_len: int = 700_000):
    """Random extents (aligned and not) and sub-ranges; returns copies and expectations."""
    copies, expect = [], []
    paths = list(files)
    for _ in range(n):
        p = rng.choice(paths)
        size = len(files[p])
        if rng.random() < 0.5:
            off = rng.randrange(0, size // 4096) * 4096
        else:
            off = rng.randrange(0, size - 1)
        length = rng.randint(1, min(max_len, size - off))
        ext = Extent(p, off, length)
        dsts = []
        for _ in range(rng.randint(1, 3)):
            o = rng.randrange(0, length)
            m = rng.randint(1, length - o)
            dt = rng.choice(DTYPES)
            elems = (m + dt.itemsize - 1) // dt.itemsize + rng.randint(0, 3)
            t = torch.zeros(elems, dtype=dt, device=device)
            dsts.append((o, m, t))
            expect.append((t, files[p][off + o:off + o + m]))
        copies.append(Copy(ext, dsts))
    return copies, expect


def check(expect) -> None:
    for t, want in expect:
        got = t.view(-1).view(torch.uint8)[:len(want)].cpu().numpy()
        assert np.array_equal(got, want)


# the Python copy threads (the hooks of these tests live on their CPU stream)
PY_WORKERS = {"mmap": {"native": False}, "pread": {}}

ENGINES = [
    ("mmap", {}),
    ("mmap", {"native": False}),
    ("mmap", {"native": True, "slot_reuse": "oldest"}),
    ("mmap", {"native": True, "copy_impl": "nt4", "populate": False}),
    ("mmap", {"native": True, "copy_impl": "mixed", "ring_hugepage": False}),
    ("mmap", {"populate": False, "hugepage": False}),
    ("mmap", {"copy_impl": "nt4"}),
    ("mmap", {"copy_impl": "mixed", "native": False}),
    ("pread", {}),
    ("pread", {"direct_io": False}),
]


@pytest.mark.parametrize("kind,opts", ENGINES)
def test_random_extents_bytes_equal(files, kind, opts):
    if (opts.get("copy_impl", "")[:2] in ("nt", "mo", "mi") or opts.get("native")) and native_copy_lib() is None:
        pytest.skip("no C compiler / AVX2: the native copy kernels are unavailable")
    rng = random.Random(hash((kind, tuple(opts))) & 0xFFFF)
    eng = make_engine(kind, "cpu", pinned_bytes=1 << 20, slot_bytes=256 << 10, threads=4, **opts)
    try:
        copies, expect = random_copies(files, rng, "cpu", 40)
        t = eng.submit(copies)
        eng.wait(t)
        check(expect)
        m = eng.metrics
        assert m["bytes_moved"] == sum(len(w) for _, w in expect)
        assert m["copies"] == len(expect)
        assert m["pinned_bytes"] == 0  # no CUDA here: ordinary memory
        assert m["ring_bytes"] == 4 * (256 << 10)
        if kind == "pread" and opts.get("direct_io", True):
            assert m["odirect_bytes"] + m["buffered_bytes"] == m["bytes_moved"]
    finally:
        eng.close()


@pytest.mark.parametrize("kind", ["mmap", "pread"])
def test_slots_not_overwritten_while_in_flight(files, kind):
    """Poisoning: the CPU copy stream is slowed down; while each 'H2D' is pending, its slot must
    keep the bytes it was filled with (a reused slot would change them under the copy)."""
    eng = make_engine(kind, "cpu", pinned_bytes=2 * 8192, slot_bytes=8192, threads=6, **PY_WORKERS[kind])
    bad: list[str] = []

    def hook(dst, src):
        before = src.clone()
        time.sleep(0.001)
        if not torch.equal(before, src):
            bad.append("slot overwritten before its copy ran")

    eng.stream.before_copy = hook
    try:
        rng = random.Random(5)
        copies, expect = random_copies(files, rng, "cpu", 20, max_len=40_000)
        t = eng.submit(copies)
        eng.wait(t)
        check(expect)
        assert not bad
        assert eng.metrics["ring_slots"] == 2
    finally:
        eng.close()


def test_random_interleavings_of_submit_and_wait(files):
    rng = random.Random(11)
    eng = make_engine("mmap", "cpu", pinned_bytes=3 * 65536, slot_bytes=65536, threads=3)
    try:
        pending = []
        for step in range(60):
            if pending and rng.random() < 0.45:
                t, expect = pending.pop(rng.randrange(len(pending)))
                (eng.wait if rng.random() < 0.5 else eng.synchronize)(t)
                check(expect)
            else:
                copies, expect = random_copies(files, rng, "cpu", rng.randint(0, 4), 200_000)
                pending.append((eng.submit(copies), expect))
        for t, expect in pending:
            eng.wait(t)
            check(expect)
        assert eng.metrics["stall_seconds"] >= 0
    finally:
        eng.close()


def test_concurrent_submitters(files):
    eng = make_engine("pread", "cpu", pinned_bytes=4 * 65536, slot_bytes=65536, threads=4)
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        try:
            rng = random.Random(seed)
            for _ in range(10):
                copies, expect = random_copies(files, rng, "cpu", 3, 150_000)
                eng.wait(eng.submit(copies))
                check(expect)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    eng.close()
    assert not errors


def test_empty_ticket_and_zero_length(files):
    eng = make_engine("mmap", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18)
    p = next(iter(files))
    eng.wait(eng.submit([]))
    t = torch.zeros(4, dtype=torch.uint8)
    eng.wait(eng.submit([Copy(Extent(p, 0, 0), [(0, 0, t)])]))
    assert t.sum() == 0
    eng.close()


def test_close_twice_and_submit_after_close(files):
    for kind in ("mmap", "pread"):
        eng = make_engine(kind, "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18)
        eng.close()
        eng.close()
        with pytest.raises(RuntimeError):
            eng.submit([])


def test_close_with_work_queued_cancels_or_finishes(files):
    p, data = next(iter(files.items()))
    eng = make_engine("mmap", "cpu", pinned_bytes=2 * 4096, slot_bytes=4096, threads=1, native=False)
    eng.stream.before_copy = lambda d, s: time.sleep(0.0005)
    dst = torch.zeros(len(data), dtype=torch.uint8)
    t = eng.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), dst)])])
    eng.close()
    try:
        eng.wait(t)
    except MmapOffloadError as e:
        assert "closed" in str(e)
    else:
        assert np.array_equal(dst.numpy(), data)


def test_user_errors(files, tmp_path):
    p, data = next(iter(files.items()))
    eng = make_engine("mmap", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18)
    try:
        with pytest.raises(CacheError, match="truncated"):
            eng.submit([Copy(Extent(p, len(data) - 10, 20), [(0, 20, torch.zeros(20, dtype=torch.uint8))])])
        with pytest.raises(CacheError, match="missing"):
            eng.submit([Copy(Extent(tmp_path / "nope.bin", 0, 4),
                             [(0, 4, torch.zeros(4, dtype=torch.uint8))])])
        with pytest.raises(ValueError, match="outside the extent"):
            eng.submit([Copy(Extent(p, 0, 4), [(2, 4, torch.zeros(4, dtype=torch.uint8))])])
        with pytest.raises(ValueError, match="contiguous"):
            eng.submit([Copy(Extent(p, 0, 8), [(0, 8, torch.zeros(4, 4, dtype=torch.uint8).t())])])
        with pytest.raises(ValueError, match="holds"):
            eng.submit([Copy(Extent(p, 0, 8), [(0, 8, torch.zeros(4, dtype=torch.uint8))])])
    finally:
        eng.close()
    with pytest.raises(UnsupportedError):
        make_engine("nvme-magic", "cpu")


def test_kvikio_missing_gives_install_hint():
    try:
        import kvikio  # noqa: F401
        pytest.skip("kvikio is installed here")
    except ImportError:
        pass
    with pytest.raises(MmapOffloadError, match=r"mmap-offload\[gds\]"):
        make_engine("kvikio", "cpu")
    eng = make_engine("auto", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18)
    assert eng.kind == "mmap"
    eng.close()


def test_copy_impl_auto_falls_back_to_libc(monkeypatch, files):
    monkeypatch.setattr(transfer.native_pool, "native_copy_lib", lambda build=True: None)
    eng = make_engine("mmap", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18)
    assert eng.copy_impl == "libc" and eng.metrics["copy_impl"] == "libc"
    p, data = next(iter(files.items()))
    dst = torch.zeros(len(data), dtype=torch.uint8)
    eng.wait(eng.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), dst)])]))
    assert np.array_equal(dst.numpy(), data)
    eng.close()
    with pytest.raises(UnsupportedError, match="native library"):
        make_engine("mmap", "cpu", copy_impl="nt4")


def test_resident_fraction_and_evict(tmp_path):
    p = tmp_path / "r.bin"
    p.write_bytes(np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes())
    p.read_bytes()
    assert resident_fraction(p) == 1.0
    assert resident_fraction(p, 4096, 8192) == 1.0
    evict_page_cache(p)
    assert resident_fraction(p) < 0.5


# --- GPU ------------------------------------------------------------------------------------

GPU_ENGINES = [("mmap", {}), ("mmap", {"native": False}), ("mmap", {"slot_reuse": "oldest", "copy_impl": "nt4"}),
               ("pread", {}), ("kvikio", {})]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind,opts", GPU_ENGINES)
def test_gpu_engines_bytes_equal(files, kind, opts):
    if kind == "kvikio":
        pytest.importorskip("kvikio")
    rng = random.Random(21)
    dev = torch.device("cuda", 0)
    opts = {"threads": 4, **opts}
    eng = make_engine(kind, dev, pinned_bytes=12 << 20, slot_bytes=1 << 20, **opts)
    try:
        for _ in range(3):
            copies, expect = random_copies(files, rng, dev, 30)
            t = eng.submit(copies)
            eng.wait(t)  # the current stream waits on the ticket's event; .cpu() runs after it
            check(expect)
        p, data = next(iter(files.items()))  # whole-slot chunks
        for _ in range(10):
            whole = torch.zeros(len(data), dtype=torch.uint8, device=dev)
            eng.wait(eng.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), whole)])]))
            check([(whole, data)])
        m = eng.metrics
        if kind != "kvikio":
            assert m["pinned_bytes"] == m["ring_bytes"]
    finally:
        eng.close()
        eng.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("native,reuse", [(True, "oldest"), (True, "hot"), (False, "oldest")])
def test_gpu_poisoned_slots_stay_intact(files, native, reuse):
    """Many chunks through a 2-slot ring while the GPU is kept busy: bytes still equal."""
    if native and native_copy_lib() is None:
        pytest.skip("no C compiler / AVX2: the native pool is unavailable")
    dev = torch.device("cuda", 0)
    eng = make_engine("mmap", dev, pinned_bytes=2 * 65536, slot_bytes=65536, threads=8, native=native,
                      slot_reuse=reuse)
    assert eng.native == native
    try:
        p, data = next(iter(files.items()))
        dst = torch.zeros(len(data), dtype=torch.uint8, device=dev)
        t = eng.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), dst)])])
        eng.synchronize(t)
        assert np.array_equal(dst.cpu().numpy(), data)
    finally:
        eng.close()


needs_native = pytest.mark.skipif(native_copy_lib() is None,
                                  reason="no C compiler / AVX2: the native library (copy kernels, pool) is unavailable")


@needs_native
def test_native_copy_kernels_edges():
    lib = native_copy_lib()
    rng = np.random.default_rng(7)
    for n in [0, 1, 31, 32, 127, 128, 4095, 4096, 65536 * 4 + 123, (1 << 20) + 77]:
        for so, do in [(0, 0), (1, 0), (0, 1), (64, 32), (3, 5)]:
            src = rng.integers(0, 256, n + 256, dtype=np.uint8)
            for fn in (lambda d, s: lib.mo_copy_nt4(d, s, n, 4096),
                       lambda d, s: lib.mo_copy_movsb(d, s, n)):
                dst = np.zeros(n + 256, dtype=np.uint8)
                fn(dst.ctypes.data + do, src.ctypes.data + so)
                assert np.array_equal(dst[do:do + n], src[so:so + n])
                assert not dst[:do].any() and not dst[do + n:].any()  # no overrun


def test_submit_after_event_orders_the_copies(files):
    """``after``: the copies start only once the given event completed (CPU: host waits)."""
    p, data = next(iter(files.items()))
    eng = make_engine("mmap", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18)
    gate = threading.Event()

    class Ev:
        def query(self) -> bool:
            return gate.is_set()

        def synchronize(self) -> None:
            gate.wait()

    threading.Timer(0.05, gate.set).start()
    dst = torch.zeros(8192, dtype=torch.uint8)
    t = eng.submit([Copy(Extent(p, 0, 8192), [(0, 8192, dst)])], after=Ev())
    assert gate.is_set()
    eng.wait(t)
    assert np.array_equal(dst.numpy(), data[:8192])
    assert t.issued()
    eng.close()


def test_prefault_sets_up_resident_granules_only_and_bytes_stay_right(tmp_path):
    import os

    data = np.random.default_rng(5).integers(0, 256, 6 << 20, dtype=np.uint8)
    warm, cold = tmp_path / "warm.bin", tmp_path / "cold.bin"
    warm.write_bytes(data.tobytes())
    cold.write_bytes(data.tobytes())
    os.sync()
    evict_page_cache(cold)
    with make_engine("mmap", torch.device("cpu"), pinned_bytes=8 << 20, slot_bytes=1 << 20, threads=2) as eng:
        done = eng.prefault([warm, cold])
        assert done >= 6 << 20  # every granule of the warm file (3 x 2 MiB)
        assert done < 12 << 20  # not all of the evicted one: prefault never reads from disk
        assert resident_fraction(cold) < 0.5
        out = torch.empty(len(data), dtype=torch.uint8)
        eng.wait(eng.submit([Copy(src=Extent(warm, 0, len(data)), dst=[(0, len(data), out)])]))
        assert np.array_equal(out.numpy(), data)


def test_a_failing_cpu_stream_copy_is_raised_not_hung(tmp_path):
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 64)
    with make_engine("mmap", torch.device("cpu"), pinned_bytes=1 << 20, slot_bytes=64 << 10, threads=1,
                     native=False) as eng:
        def boom(dst, src):
            raise RuntimeError("copy failed")

        eng.stream.before_copy = boom
        out = torch.empty(4096, dtype=torch.uint8)
        t = eng.submit([Copy(src=Extent(p, 0, 4096), dst=[(0, 4096, out)])])
        with pytest.raises(RuntimeError, match="copy failed"):
            eng.wait(t)
        eng.stream.before_copy = None
        eng.wait(eng.submit([Copy(src=Extent(p, 0, 4096), dst=[(0, 4096, out)])]))  # stream still alive
        assert out.numpy().tobytes() == p.read_bytes()[:4096]


def test_destinations_stay_alive_until_their_copies_ran(tmp_path):
    """Workers and the copy stream hold raw addresses: the engine keeps a dropped dst alive (no
    use-after-free) until its ticket completed, and lets it go after."""
    import gc
    import weakref

    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 256)
    with make_engine("mmap", torch.device("cpu"), pinned_bytes=1 << 20, slot_bytes=64 << 10, threads=1,
                     native=False) as eng:
        eng.stream.before_copy = lambda dst, src: time.sleep(0.2)
        dst = torch.empty(1 << 16, dtype=torch.uint8)
        alive = weakref.ref(dst)
        t = eng.submit([Copy(src=Extent(p, 0, 1 << 16), dst=[(0, 1 << 16, dst)])])
        del dst
        gc.collect()
        assert alive() is not None  # the copy is still pending: retained
        eng.wait(t)
        eng.stream.before_copy = None
        other = torch.empty(4096, dtype=torch.uint8)
        eng.wait(eng.submit([Copy(src=Extent(p, 0, 4096), dst=[(0, 4096, other)])]))
        gc.collect()
        assert alive() is None  # completed tickets are released


# --- the native copy pool (csrc/copy_pool.c) over its CPU stream --------------------------------



@needs_native
@pytest.mark.parametrize("reuse,slots", [("oldest", 2), ("hot", 2), ("hot", 5)])
def test_native_pool_never_refills_a_slot_before_its_copy_ran(files, reuse, slots):
    """Poisoning for the native pool: its CPU stream runs each 'H2D' 2 ms late, 6 threads share 2
    (or 5) slots. A slot refilled before its event completed would hand later bytes to earlier
    copies. "hot" reuse takes the newest slot whose copy completed, so it must check, not assume."""
    eng = make_engine("mmap", "cpu", pinned_bytes=slots * 8192, slot_bytes=8192, threads=6, native=True,
                      stream_delay_us=2000, slot_reuse=reuse)
    try:
        assert eng.native
        copies, expect = random_copies(files, random.Random(7), "cpu", 20, max_len=40_000)
        eng.wait(eng.submit(copies))
        check(expect)
        m = eng.metrics
        assert m["ring_slots"] == slots and m["bytes_moved"] == sum(len(w) for _, w in expect)
        assert m["chunks"] > 4 * m["ring_slots"]  # cut into slot-sized chunks, far more than the slots
    finally:
        eng.close()


@needs_native
@pytest.mark.parametrize("reuse", ["oldest", "hot"])
def test_native_pool_random_interleavings(files, reuse):
    rng = random.Random(3)
    eng = make_engine("mmap", "cpu", pinned_bytes=3 * 65536, slot_bytes=65536, threads=4, native=True,
                      stream_delay_us=50, slot_reuse=reuse)
    try:
        pending = []
        for _ in range(60):
            if pending and rng.random() < 0.45:
                t, expect = pending.pop(rng.randrange(len(pending)))
                eng.wait(t)
                check(expect)
            else:
                copies, expect = random_copies(files, rng, "cpu", rng.randint(0, 6), max_len=150_000)
                pending.append((eng.submit(copies), expect))
        for t, expect in pending:
            eng.wait(t)
            check(expect)
        t = eng.submit([])
        assert t.issued()
    finally:
        eng.close()


@needs_native
def test_native_pool_close_cancels_queued_work_and_keeps_dsts_alive(files):
    import gc
    import weakref

    p, data = max(files.items(), key=lambda kv: len(kv[1]))
    eng = make_engine("mmap", "cpu", pinned_bytes=2 * 4096, slot_bytes=4096, threads=1, native=True,
                      stream_delay_us=20_000)
    dst = torch.zeros(len(data), dtype=torch.uint8)
    alive = weakref.ref(dst)
    t = eng.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), dst)])])
    del dst
    gc.collect()
    assert alive() is not None  # the pool writes through a raw address: the engine holds it
    eng.close()
    with pytest.raises(MmapOffloadError, match="closed"):
        eng.wait(t)  # len(data) / 4096 chunks at 20 ms each: most were still queued
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit([])


@needs_native
def test_native_pool_wait_during_close_returns(files):
    """A wait that starts while another thread closes the engine returns (cancelled or done); it
    used to find the pool's handle already cleared, skip the native wait and block forever on a
    ticket that nothing would mark issued."""
    p, data = max(files.items(), key=lambda kv: len(kv[1]))
    eng = make_engine("mmap", "cpu", pinned_bytes=2 * 4096, slot_bytes=4096, threads=1, native=True,
                      stream_delay_us=20_000)
    dst = torch.zeros(len(data), dtype=torch.uint8)
    t = eng.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), dst)])])
    pool = eng._pool
    closers = [threading.Thread(target=eng.close, daemon=True) for _ in range(2)]  # two at once
    closers[0].start()
    deadline = time.monotonic() + 5
    while not (getattr(pool, "_closing", False) or pool.handle is None) and time.monotonic() < deadline:
        time.sleep(0.0002)
    closers[1].start()
    outcome = []

    def waiter():
        try:
            eng.wait(t)
            outcome.append("done")
        except MmapOffloadError as e:
            outcome.append(str(e))

    w = threading.Thread(target=waiter, daemon=True)
    w.start()
    w.join(10)
    assert not w.is_alive(), "wait() hung on a ticket of an engine being closed"
    assert outcome == ["done"] or "closed" in outcome[0]
    for c in closers:
        c.join(10)
        assert not c.is_alive()
    assert pool.handle is None and eng.closed
    assert "ring_wait_seconds" in eng.metrics  # the final stats survive the pool


@needs_native
def test_native_ticket_event_outlives_the_engine(tmp_path):
    """On the CPU a ticket's event lives on the pool's CPU stream, which close destroys. Querying
    or synchronizing the event afterwards must not touch freed memory: handed out again (here at
    once, zeroed, as the next allocations would), a stale event reads 'not done' and its
    synchronize() waits forever. Events now hold a reference to their stream."""
    import ctypes

    lib = native_copy_lib()
    vp = ctypes.c_void_p
    lib.mo_fake_memcpy_async.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
    lib.mo_fake_event_record.argtypes = [vp, vp]
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = vp, [ctypes.c_size_t]
    libc.free.argtypes = [vp]
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, dtype=np.uint8)
    stream = lib.mo_fake_stream_create(0)
    ev = transfer.native_pool._FakeEvent(lib)
    assert lib.mo_fake_memcpy_async(dst.ctypes.data, src.ctypes.data, 64, 1, stream) == 0
    assert lib.mo_fake_event_record(ev.handle, stream) == 0
    ev.synchronize()
    lib.mo_fake_stream_destroy(stream)
    sizes = [n for n in range(128, 321, 8) for _ in range(32)]
    blocks = [libc.malloc(n) for n in sizes]
    try:
        for b, n in zip(blocks, sizes):
            ctypes.memset(b, 0, n)
        assert ev.query()
        done = threading.Thread(target=ev.synchronize, daemon=True)
        done.start()
        done.join(10)
        assert not done.is_alive(), "synchronize() of a completed event hung after its stream went"
    finally:
        for b in blocks:
            libc.free(b)
    del ev  # the last reference frees the stream
    assert np.array_equal(dst, src)

    # the same through an engine: wait / synchronize / query after close
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 256)
    eng = make_engine("mmap", "cpu", pinned_bytes=2 * 65536, slot_bytes=65536, threads=2, native=True)
    out = torch.zeros(1 << 16, dtype=torch.uint8)
    t = eng.submit([Copy(Extent(p, 0, 1 << 16), [(0, 1 << 16, out)])])
    eng.wait(t)
    eng.close()
    eng.wait(t)
    eng.synchronize(t)
    assert t.event.query()
    assert out.numpy().tobytes() == p.read_bytes()


@needs_native
def test_native_pool_refused_batch_does_not_pin_later_destinations(files, monkeypatch):
    """A batch the pool refuses raises (not 'closed': the engine works on) and is not retained: a
    never-issued ticket at the head of the in-flight list kept every later destination alive."""
    import gc
    import weakref

    p, data = next(iter(files.items()))
    eng = make_engine("mmap", "cpu", pinned_bytes=2 * 65536, slot_bytes=65536, threads=2, native=True)
    try:
        with monkeypatch.context() as m:
            m.setattr(eng, "_chunk_bytes", lambda total: 2 * eng.slot_bytes)  # > slot_bytes: refused
            with pytest.raises(MemoryError):
                eng.submit([Copy(Extent(p, 0, 4096), [(0, 4096, torch.zeros(4096, dtype=torch.uint8))])])
        dst = torch.zeros(4096, dtype=torch.uint8)
        alive = weakref.ref(dst)
        eng.wait(eng.submit([Copy(Extent(p, 0, 4096), [(0, 4096, dst)])]))
        assert np.array_equal(dst.numpy(), data[:4096])
        del dst
        eng.wait(eng.submit([]))  # the next submit lets completed tickets go
        gc.collect()
        assert alive() is None
    finally:
        eng.close()


def _fake_api(lib):
    """mo_pool_create's 8 CUDA entry points, from the library's CPU stand-ins (no set_device; no
    event_query: no hot slots; no launch_host_func: no stream-ordered batches)."""
    import ctypes

    names = ("mo_fake_memcpy_async", "mo_fake_event_create", "mo_fake_event_record",
             "mo_fake_event_sync", "mo_fake_event_destroy", None, None, None)
    return (ctypes.c_void_p * 8)(*[ctypes.cast(getattr(lib, n), ctypes.c_void_p).value if n else None
                                   for n in names])


def _raw_pool(lib, ring: np.ndarray, slot_bytes: int, threads: int, delay_us: int = 0):
    stream = lib.mo_fake_stream_create(delay_us)
    api = _fake_api(lib)
    pool = lib.mo_pool_create(api, -1, stream, ring.ctypes.data, slot_bytes, len(ring) // slot_bytes,
                              threads, 0, 0)
    assert pool
    return pool, stream, api


@needs_native
def test_native_pool_planning_edges():
    """Direct calls: zero-length pieces, pieces larger than a chunk, chunk sizes that are not a
    multiple of 64 or below it, many tiny pieces; bad arguments refused; after shutdown submit
    says closed and wait (also without a pool) does not block."""
    import ctypes

    lib = native_copy_lib()
    rng = np.random.default_rng(5)
    slot = 4096
    ring = np.zeros(3 * slot, dtype=np.uint8)
    pool, stream, api = _raw_pool(lib, ring, slot, threads=3, delay_us=20)
    src = rng.integers(0, 256, size=1 << 18, dtype=np.uint8)
    try:
        for chunk_bytes in (1, 63, 64, 100, 4000, 4096):
            lens = [0, 1, 5, 0, 64, 65, 3 * slot + 17, 200, 0, 9000] + list(rng.integers(0, 300, 40))
            dst = np.zeros(sum(lens) + 1, dtype=np.uint8)
            trip, s0, d0 = [], 0, 0
            for n in lens:
                trip += [src.ctypes.data + s0, dst.ctypes.data + d0, int(n)]
                s0 += int(n) + 7
                d0 += int(n)
            want = np.concatenate([src[s: s + int(n)] for s, n in
                                   zip(np.cumsum([0] + [int(n) + 7 for n in lens[:-1]]), lens)])
            trip = np.array(trip, dtype=np.uint64)
            status = np.zeros(5, dtype=np.int64)
            n = lib.mo_pool_submit(pool, trip.ctypes.data, len(lens), chunk_bytes, status.ctypes.data, None)
            assert n == status[0] >= sum(lens) // chunk_bytes
            assert lib.mo_pool_wait(pool, status.ctypes.data) == 0 and status[2] == 1
            ev = ctypes.c_void_p()
            lib.mo_fake_event_create(ctypes.byref(ev), 0)
            status2 = np.zeros(5, dtype=np.int64)  # nothing to copy: issued at once, event marks now
            assert lib.mo_pool_submit(pool, None, 0, chunk_bytes, status2.ctypes.data, ev) == 0
            assert status2[2] == 1
            lib.mo_fake_event_sync(ev)
            lib.mo_fake_event_destroy(ev)
            assert np.array_equal(dst[:-1], want) and dst[-1] == 0
        status = np.zeros(5, dtype=np.int64)
        one = np.array([src.ctypes.data, ring.ctypes.data, 1], dtype=np.uint64)
        assert lib.mo_pool_submit(pool, one.ctypes.data, 1, slot + 1, status.ctypes.data, None) == -2
        assert lib.mo_pool_submit(pool, one.ctypes.data, 1, 0, status.ctypes.data, None) == -2
        assert lib.mo_pool_submit(None, one.ctypes.data, 1, 64, status.ctypes.data, None) == -2
        assert lib.mo_pool_wait(None, status.ctypes.data) == -1  # no pool will ever issue it
        lib.mo_pool_shutdown(pool)
        lib.mo_pool_shutdown(pool)  # idempotent
        assert lib.mo_pool_submit(pool, one.ctypes.data, 1, 64, status.ctypes.data, None) == -1
    finally:
        lib.mo_pool_destroy(pool)
        lib.mo_fake_stream_destroy(stream)


@needs_native
def test_native_pool_refuses_plans_whose_size_would_wrap():
    """A piece count whose capacity estimate wraps (or exceeds the uint32 indices) is refused; it
    used to under-allocate the piece array and write past it. In a subprocess: a crash stays there."""
    import subprocess
    import sys

    code = """if 1:
        import ctypes, numpy as np
        from mmap_offload.transfer import native_copy_lib
        lib = native_copy_lib()
        stream = lib.mo_fake_stream_create(0)
        api = (ctypes.c_void_p * 8)(*[ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in (
            "mo_fake_memcpy_async", "mo_fake_event_create", "mo_fake_event_record",
            "mo_fake_event_sync", "mo_fake_event_destroy")], None, None, None)
        ring = np.zeros(2 * 4096, dtype=np.uint8)
        pool = lib.mo_pool_create(api, -1, stream, ring.ctypes.data, 4096, 2, 1, 0, 0)
        status = np.zeros(5, dtype=np.int64)
        for n, cb in ((1 << 63, 1), ((1 << 64) - 1, 1), (1 << 40, 64)):  # never read: refused first
            trip = np.array([ring.ctypes.data, ring.ctypes.data, n], dtype=np.uint64)
            print(lib.mo_pool_submit(pool, trip.ctypes.data, 1, cb, status.ctypes.data, None))
        lib.mo_pool_destroy(pool)
        lib.mo_fake_stream_destroy(stream)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(transfer.__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]
    assert [int(x) for x in r.stdout.split()][:3] == [-2, -2, -2]


@needs_native
@pytest.mark.parametrize("what,nth", [(0, 1), (0, 5), (1, 1), (1, 4)])
def test_native_pool_cuda_errors_are_raised_not_hung(files, what, nth):
    """A failing cudaMemcpyAsync (what 0) or cudaEventRecord (what 1: a slot's or the batch's
    event) fails its ticket with the CUDA error; later tickets copy right."""
    p, data = max(files.items(), key=lambda kv: len(kv[1]))
    eng = make_engine("mmap", "cpu", pinned_bytes=2 * 65536, slot_bytes=65536, threads=2, native=True,
                      stream_delay_us=100)
    try:
        n = 16 * 65536
        eng._pool.lib.mo_fake_stream_fail(eng._pool._fake_stream, what, nth, 719)
        dst = torch.zeros(n, dtype=torch.uint8)
        t = eng.submit([Copy(Extent(p, 0, n), [(0, n, dst)])])
        with pytest.raises(RuntimeError, match="CUDA error 719"):
            eng.wait(t)
        for _ in range(3):
            dst = torch.zeros(n, dtype=torch.uint8)
            eng.wait(eng.submit([Copy(Extent(p, 0, n), [(0, n, dst)])]))
            assert np.array_equal(dst.numpy(), data[:n])
    finally:
        eng.close()


@needs_native
@pytest.mark.parametrize("reuse", ["hot", "oldest"])
def test_native_mixed_copy_whole_slot_and_small_chunks_bytes_equal(tmp_path, reuse):
    """copy_impl "mixed" (the default with hot slots where the CPU has ERMS): whole 4 MiB slots go
    through rep movsb, smaller chunks through the non-temporal kernel; both land the file's bytes."""
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, size=(13 << 20) + 777, dtype=np.uint8)
    p = tmp_path / "big.bin"
    p.write_bytes(data.tobytes())
    eng = make_engine("mmap", "cpu", pinned_bytes=16 << 20, slot_bytes=4 << 20, threads=2, native=True,
                      copy_impl="mixed", slot_reuse=reuse)
    try:
        assert eng.copy_impl == "mixed"
        for off, n in ((0, len(data)), (4095, (9 << 20) + 3), (100, 5000), (len(data) - 70000, 70000)):
            dst = torch.zeros(n, dtype=torch.uint8)
            eng.wait(eng.submit([Copy(Extent(p, off, n), [(0, n, dst)])]))
            check([(dst, data[off:off + n])])
        assert eng.metrics["chunks"] >= 4
    finally:
        eng.close()


@needs_native
def test_native_engine_starts_no_python_stream_thread(files):
    """The native pool runs its own CPU stream: the Python stand-in stream's thread stays unstarted
    (it used to idle for the engine's lifetime); the Python workers still start it on first use."""
    def streams() -> int:
        return sum(t.name == "mmap-offload-cpu-stream" and t.is_alive() for t in threading.enumerate())

    before = streams()
    p, data = next(iter(files.items()))
    eng = make_engine("mmap", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18, threads=2, native=True)
    try:
        dst = torch.zeros(len(data), dtype=torch.uint8)
        eng.wait(eng.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), dst)])]))
        check([(dst, data)])
        assert streams() == before
    finally:
        eng.close()
    py = make_engine("mmap", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18, threads=2, native=False)
    try:
        dst = torch.zeros(len(data), dtype=torch.uint8)
        py.wait(py.submit([Copy(Extent(p, 0, len(data)), [(0, len(data), dst)])]))
        check([(dst, data)])
        assert streams() == before + 1
    finally:
        py.close()
    assert streams() == before


@pytest.mark.gpu
@needs_cuda
def test_gpu_auto_picks_kvikio_only_with_gds(monkeypatch):
    """On CUDA "auto" is mmap unless GPUDirect Storage is active (then kvikio, where it imports):
    kvikio's compat mode lost to the mmap engine warm and cold on the machine measured."""
    monkeypatch.setattr(transfer, "gds_active", lambda: False)
    eng = make_engine("auto", "cuda")
    try:
        assert eng.kind == "mmap" and eng.slot_bytes == 4 << 20
    finally:
        eng.close()
    try:
        import kvikio  # noqa: F401
    except ImportError:
        return
    monkeypatch.setattr(transfer, "gds_active", lambda: True)
    eng = make_engine("auto", "cuda")
    try:
        assert eng.kind == "kvikio"
    finally:
        eng.close()


def test_cpu_stream_close_then_reuse_does_not_hang():
    """The CPU stand-in stream: closing joins its thread; a copy after close starts a new thread with
    a queue of its own (the old thread's stop marker cannot be taken by the new one)."""
    st = transfer.streams._CpuCopyStream()
    st.close()  # never started: nothing to join
    a, b = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    for _ in range(3):
        st.copy(b, a)
        st.record(ticket=True).synchronize()
        assert torch.equal(a, b)
        b.zero_()
        st.close()
    assert st._thread is None
