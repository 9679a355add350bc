"""Stream-ordered batches of the native copy pool (csrc/copy_pool.c, "Stream-ordered batches";
``MmapEngine.submit_ordered``), over the library's CPU stand-in stream: the copies are enqueued at
submit behind a host-function gate, the caller never waits, and the bytes that land are exact
however far the stream lags behind the fills (arena reuse), mixed with ordinary batches, with
failed reads, failed gate launches, failed copies and a close with batches in flight. The same
path on CUDA: tests/test_expert_cache.py (``ordered``), run on the GPU machine."""

from __future__ import annotations

import ctypes
import random
import threading
import time

import numpy as np
import pytest
import torch

from fakes import run_child
from mmap_offload.cache_format import Extent
from mmap_offload.errors import MmapOffloadError
from mmap_offload.transfer import Copy, make_engine, native_copy_lib

needs_native = pytest.mark.skipif(native_copy_lib() is None,
                                  reason="no C compiler / AVX2: the native pool is unavailable")
pytestmark = needs_native
FILE = 6 << 20


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = np.random.default_rng(11).integers(0, 256, FILE, dtype=np.uint8)
    path = tmp_path_factory.mktemp("ordered") / "f.bin"
    data.tofile(path)
    return str(path), data


def engine(slot=64 << 10, slots=8, threads=3, delay_us=0, fraction=0.5, ordered_threads=None):
    return make_engine("mmap", "cpu", pinned_bytes=slots * slot, slot_bytes=slot, threads=threads, native=True,
                       stream_delay_us=delay_us, ordered_fraction=fraction, ordered_threads=ordered_threads)


def random_batch(path, rng: random.Random, max_bytes: int, pieces: int | None = None):
    copies, want = [], []
    for _ in range(pieces or rng.randint(1, 4)):
        n = rng.randint(1, max(1, max_bytes // 3))
        off = rng.randrange(0, FILE - n)
        dst = torch.zeros(n + 8, dtype=torch.uint8)  # 8 guard bytes must stay 0
        copies.append(Copy(Extent(path, off, n), [(0, n, dst)], label=f"piece at {off}"))
        want.append((off, n, dst))
    return copies, want


def check(data, want):
    for off, n, dst in want:
        got = dst.numpy()
        assert np.array_equal(got[:n], data[off:off + n]), f"bytes of the piece at {off} differ"
        assert not got[n:].any(), "a copy wrote past its destination"


def stream_event(eng):
    """A CPU event recorded now on the engine's stand-in stream (its order point)."""
    lib = eng._pool.lib
    ev = ctypes.c_void_p()
    assert lib.mo_fake_event_create(ctypes.byref(ev), 0) == 0
    assert lib.mo_fake_event_record(ev, eng._pool._fake_stream) == 0
    return ev


def hold_stream(eng):
    """Block the engine's stand-in stream with a host function of our own until the returned
    event is set: work enqueued behind it waits, deterministically (no timing)."""
    release = threading.Event()
    entered = threading.Event()

    @ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    def blocker(_):
        entered.set()
        release.wait(60)

    assert eng._pool.lib.mo_fake_launch_host_func(eng._pool._fake_stream, blocker, None) == 0
    assert entered.wait(10)
    release.keep = blocker  # the callback must outlive its run
    return release


@pytest.mark.parametrize("grouped", [False, True])
def test_back_to_back_batches_reuse_the_arena_only_after_their_copies_ran(data_file, grouped):
    """Batches submitted with no wait in between, each up to the whole arena, while the stream is
    held behind a host function of the test, then runs each copy 3 ms late: every submit returns
    while the stream has run none of its gates (the caller never waits for fills or for the
    stream), and the arena wraps many times, so a fill that overwrote bytes whose copy had not run
    yet would hand later bytes to an earlier batch: every byte lands exact. ``grouped``: batches cut
    into groups with a gate each (the stream copies one while the next fills)."""
    path, data = data_file
    eng = engine(delay_us=3000)
    if grouped:
        eng.ORDERED_MIN_GROUP = 4096
    try:
        arena = eng.ordered_bytes
        assert arena == 4 * (64 << 10)
        rng = random.Random(5)
        release = hold_stream(eng)
        pending = []
        for i in range(40):
            copies, want = random_batch(path, rng, arena if i % 5 else arena - 1024)
            t = eng.submit_ordered(copies)
            assert t is not None and t.ordered
            pending.append((t, want))
        assert eng.metrics["ordered_gates"] == 0  # all 40 submitted; the stream has not moved
        release.set()
        lib = eng._pool.lib
        ev = stream_event(eng)
        lib.mo_fake_event_sync(ev)  # everything enqueued so far has run on the stream
        lib.mo_fake_event_destroy(ev)
        for t, want in pending:
            eng.wait(t)
            check(data, want)
        m = eng.metrics
        assert m["ordered_batches"] == 40
        if grouped:  # 1-4 pieces per batch, up to 4 groups: more gates than batches
            assert 40 < m["ordered_gates"] <= 160, m["ordered_gates"]
        else:
            assert m["ordered_gates"] == 40
    finally:
        eng.close()


@pytest.mark.parametrize("seed,threads,ordered_threads", [(0, 2, None), (1, 2, None), (2, 2, None), (3, 4, 1)])
def test_ordered_and_ordinary_batches_interleave(data_file, seed, threads, ordered_threads):
    """submit and submit_ordered in random order, waits in random order, a lagging stream: all exact;
    ordinary batches keep the ring's other slots (their own chunks, their own workers: as many as
    ``ordered_threads`` for the ordered ones, as the vLLM backend sets with hybrid)."""
    path, data = data_file
    rng = random.Random(seed)
    eng = engine(delay_us=200, threads=threads, ordered_threads=ordered_threads)
    try:
        assert eng.metrics["threads"] == threads
        assert eng.metrics["ordered_threads"] == (ordered_threads or threads)
        pending = []
        for _ in range(80):
            if pending and rng.random() < 0.3:
                t, want = pending.pop(rng.randrange(len(pending)))
                eng.wait(t)
                if not t.ordered:
                    check(data, want)
                else:  # ordered: the bytes are in once the stream passed them
                    ev = stream_event(eng)
                    eng._pool.lib.mo_fake_event_sync(ev)
                    eng._pool.lib.mo_fake_event_destroy(ev)
                    check(data, want)
                continue
            copies, want = random_batch(path, rng, 200 << 10)
            if rng.random() < 0.5:
                t = eng.submit_ordered(copies)
                assert t is not None
            else:
                t = eng.submit(copies)
            pending.append((t, want))
        for t, want in pending:
            eng.wait(t)
        ev = stream_event(eng)
        eng._pool.lib.mo_fake_event_sync(ev)
        eng._pool.lib.mo_fake_event_destroy(ev)
        for t, want in pending:
            check(data, want)
        assert eng.metrics["ordered_batches"] > 10 and eng.metrics["bytes_moved"] > 0
    finally:
        eng.close()


def test_refusals_leave_nothing_queued(data_file):
    """A batch larger than the arena, an engine without an ordered part and a second stream are
    refused with None (the caller takes submit); an empty batch is done at once."""
    path, data = data_file
    eng = engine()
    plain = engine(fraction=0.0)
    try:
        big = torch.zeros(eng.ordered_bytes + 1, dtype=torch.uint8)
        assert eng.submit_ordered([Copy(Extent(path, 0, big.numel()), [(0, big.numel(), big)])]) is None
        assert plain.ordered_bytes == 0
        copies, want = random_batch(path, random.Random(1), 1000)
        assert plain.submit_ordered(copies) is None
        t = eng.submit_ordered([])
        assert t is not None
        eng.wait(t)
        # a second stream: refused by the pool (its gates could block the first's copies)
        lib = eng._pool.lib
        other = lib.mo_fake_stream_create(0)
        try:
            copies, want = random_batch(path, random.Random(2), 1000)
            t = eng.submit_ordered(copies)  # fixes the pool's stream
            eng.wait(t)
            trip = np.array([0, 0, 0], dtype=np.uint64)
            status = np.zeros(6, dtype=np.int64)
            src = np.zeros(16, dtype=np.uint8)
            dst = np.zeros(16, dtype=np.uint8)
            trip[:] = [src.ctypes.data, dst.ctypes.data, 16]
            assert lib.mo_gate_submit(eng._pool.handle, trip.ctypes.data, 1, 4096, 0, other,
                                      status.ctypes.data, None) == -5
        finally:
            lib.mo_fake_stream_destroy(other)
        assert eng.metrics["ordered_batches"] == 1
        assert not big.any()
    finally:
        eng.close()
        plain.close()


def test_a_failed_gate_launch_waits_for_the_fill_instead(data_file):
    """cudaLaunchHostFunc failing (stand-in hook): the submit waits for the fill (and for the
    earlier batches, so arena reuse cannot wait for a gate that never comes), then issues the
    copies: still exact; later batches take the gated path again."""
    path, data = data_file
    eng = engine(delay_us=500)
    try:
        lib = eng._pool.lib
        lib.mo_fake_stream_fail(eng._pool._fake_stream, 2, 3, 700)  # the 3rd launch fails
        rng = random.Random(9)
        pending = []
        for _ in range(12):
            copies, want = random_batch(path, rng, eng.ordered_bytes)
            pending.append((eng.submit_ordered(copies), want))
        ev = stream_event(eng)
        lib.mo_fake_event_sync(ev)
        lib.mo_fake_event_destroy(ev)
        for t, want in pending:
            eng.wait(t)
            check(data, want)
        m = eng.metrics
        assert m["ordered_gates"] == 11 and m["ordered_ungated"] == 1  # one ran without its gate
    finally:
        eng.close()


@pytest.mark.parametrize("nth", [1, 2])
def test_a_failed_copy_raises_and_the_engine_goes_on(data_file, nth):
    """cudaMemcpyAsync failing for an ordered batch (its 1st or 2nd copy; the batch cut into one
    group per piece, so the 2nd stops the launches before the last group's gate): submit_ordered
    raises (after the fills ended), naming the CUDA error; a copy issued before the failed one
    still writes its destination when the stream gets there, so the engine keeps that destination
    alive until then (it was freed under the stream's write: heap corruption, seen as an abort);
    the next batch is exact and close does not wait for a gate that was never launched."""
    import gc
    import weakref

    path, data = data_file
    eng = engine()
    eng.ORDERED_MIN_GROUP = 1
    try:
        lib = eng._pool.lib
        lib.mo_fake_stream_fail(eng._pool._fake_stream, 0, nth, 700)
        copies, want = random_batch(path, random.Random(3), 5000, pieces=2)
        first = weakref.ref(copies[0].dst[0][2])
        release = hold_stream(eng)  # the issued copy stays pending behind the held stream
        try:
            with pytest.raises(RuntimeError, match="CUDA error 700"):
                eng.submit_ordered(copies)
            del copies, want
            gc.collect()
            if nth == 2:  # the first piece's copy was issued: its destination must still be alive
                assert first() is not None
        finally:
            release.set()
        copies, want = random_batch(path, random.Random(4), 5000)
        t = eng.submit_ordered(copies)
        eng.wait(t)
        ev = stream_event(eng)
        lib.mo_fake_event_sync(ev)
        lib.mo_fake_event_destroy(ev)
        check(data, want)
    finally:
        t0 = time.perf_counter()
        eng.close()
        assert time.perf_counter() - t0 < 20  # no gate left pending (one would hold close for 30 s)


def test_close_with_ordered_batches_in_flight(data_file):
    """close() right after many ordered submits against a slow stream: returns (gates run, the
    arena's last copies are waited for before the ring goes), nothing crashes; waiting for a
    ticket afterwards returns or says it was cancelled, never hangs."""
    path, data = data_file
    eng = engine(delay_us=2000)
    rng = random.Random(7)
    tickets = []
    for _ in range(10):
        copies, _ = random_batch(path, rng, eng.ordered_bytes)
        tickets.append(eng.submit_ordered(copies))
    t0 = time.perf_counter()
    eng.close()
    assert time.perf_counter() - t0 < 30
    for t in tickets:
        try:
            eng.wait(t)
        except MmapOffloadError as e:
            assert "cancelled" in str(e)
    with pytest.raises(RuntimeError, match="closed"):
        eng.submit_ordered([])


def test_a_read_fault_fails_only_its_batch(tmp_path):
    """A file truncated under its mapping: the ordered batch that reads past the new end fails with
    the CacheError naming file and label (SIGBUS caught in the fill thread); its gate still opened,
    the process lives, and a later batch of the other file is exact. In a child process."""
    import textwrap

    code = textwrap.dedent("""
        import os, sys
        import numpy as np, torch
        from mmap_offload.cache_format import Extent
        from mmap_offload.errors import CacheError
        from mmap_offload.transfer import Copy, make_engine
        d = sys.argv[1]
        rng = np.random.default_rng(3)
        n = 4 << 20
        data = {}
        for name in ("a.bin", "b.bin"):
            data[name] = rng.integers(0, 256, n, dtype=np.uint8)
            data[name].tofile(os.path.join(d, name))
        a, b = os.path.join(d, "a.bin"), os.path.join(d, "b.bin")
        eng = make_engine("mmap", "cpu", pinned_bytes=16 << 20, slot_bytes=1 << 20, threads=2, native=True,
                          ordered_fraction=0.5)
        dst = torch.zeros(n, dtype=torch.uint8)
        eng.wait(eng.submit_ordered([Copy(Extent(a, 0, n), [(0, n, dst)], label="layer 3 expert 5")]))
        os.truncate(a, 1 << 20)
        t = eng.submit_ordered([Copy(Extent(a, 0, n), [(0, n, dst)], label="layer 3 expert 5")])
        try:
            eng.wait(t)
            print("NO ERROR")
        except CacheError as e:
            print("ERR", str(e).splitlines()[0])
        dst2 = torch.zeros(n, dtype=torch.uint8)
        t = eng.submit_ordered([Copy(Extent(b, 0, n), [(0, n, dst2)])])
        eng.wait(t)
        eng.synchronize(t)
        print("B", bool(np.array_equal(dst2.numpy(), data["b.bin"])))
        eng.close()
    """)
    lines, err = run_child(code, str(tmp_path))
    assert err.startswith("ERR") and "a.bin" in err and "layer 3 expert 5" in err and "SIGBUS" in err, lines
    assert "B True" in lines
