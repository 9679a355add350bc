"""pinned.py: exact-size buffers and a ring that never hands out a slot still being read."""

from __future__ import annotations

import threading
import time

from pathlib import Path

import pytest
import torch

from mmap_offload.pinned import PAGE, PinnedBuffer, PinnedRing, total_pinned_bytes

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class FakeEvent:
    """An event the test completes by hand."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    def query(self) -> bool:
        return self.flag.is_set()

    def synchronize(self) -> None:
        self.flag.wait()

    def complete(self) -> None:
        self.flag.set()


def test_buffer_size_is_exact_page_multiple_and_writable():
    with PinnedBuffer(10_000, pin=False) as b:
        assert b.nbytes == 3 * PAGE
        assert b.ptr % PAGE == 0
        assert b.tensor.numel() == b.nbytes and b.tensor.dtype == torch.uint8
        b.tensor.fill_(7)
        assert int(b.tensor.sum()) == 7 * b.nbytes
        assert b.pinned_bytes == 0 and not b.pinned
    assert b.closed
    b.close()  # twice is safe


def test_buffer_rejects_nonpositive():
    with pytest.raises(ValueError):
        PinnedBuffer(0)


def test_ring_slots_are_aligned_and_disjoint():
    with PinnedRing(4, 5000, pin=False) as r:
        assert r.slot_bytes == 2 * PAGE and r.nbytes == 8 * PAGE
        ptrs = [s.ptr for s in r.slots]
        assert all(p % PAGE == 0 for p in ptrs)
        assert sorted(ptrs) == [ptrs[0] + i * r.slot_bytes for i in range(4)]
        for i, s in enumerate(r.slots):
            s.tensor.fill_(i)
        assert [int(s.tensor[0]) for s in r.slots] == [0, 1, 2, 3]


def test_ring_never_hands_out_a_slot_before_its_event_completed():
    r = PinnedRing(2, PAGE, pin=False)
    a, b = r.acquire(), r.acquire()
    ea, eb = FakeEvent(), FakeEvent()
    a.tensor.fill_(0xAA)
    r.release(a, ea)
    r.release(b, eb)
    got: list = []
    t = threading.Thread(target=lambda: got.append(r.acquire()))
    t.start()
    time.sleep(0.1)
    assert not got, "a slot was handed out while its copy was still in flight"
    assert int(a.tensor.min()) == 0xAA  # untouched
    ea.complete()  # the oldest in-flight slot completes: it is the one handed out
    t.join(2)
    assert got == [a]
    # the only slot left is `b`, still in flight: acquire must wait for eb
    got.clear()
    t = threading.Thread(target=lambda: got.append(r.acquire()))
    t.start()
    time.sleep(0.1)
    assert not got
    eb.complete()
    t.join(2)
    assert got == [b]
    r.close()
    r.close()


def test_ring_timeout_and_release_without_event():
    r = PinnedRing(1, PAGE, pin=False)
    s = r.acquire()
    with pytest.raises(TimeoutError):
        r.acquire(timeout=0.05)
    r.release(s)
    assert r.acquire(timeout=0.05) is s
    r.close()


def test_ring_stress_many_threads():
    r = PinnedRing(3, PAGE, pin=False)
    in_use: set[int] = set()
    lock = threading.Lock()
    errors: list[str] = []

    def work() -> None:
        for _ in range(200):
            s = r.acquire()
            with lock:
                if s.index in in_use:
                    errors.append(f"slot {s.index} handed out twice")
                in_use.add(s.index)
            ev = FakeEvent()
            with lock:
                in_use.discard(s.index)
            threading.Timer(0.0005, ev.complete).start()
            r.release(s, ev)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r.close()
    assert not errors


@pytest.mark.gpu
@needs_cuda
def test_pinned_buffer_is_exact_and_registered():
    before = total_pinned_bytes()
    b = PinnedBuffer(3 * PAGE + 1)
    assert b.pinned_bytes == 4 * PAGE == b.nbytes
    assert total_pinned_bytes() == before + 4 * PAGE
    assert b.tensor.is_pinned()
    b.close()
    assert total_pinned_bytes() == before


def test_ring_close_wakes_a_blocked_acquire():
    from mmap_offload.pinned import RingClosedError

    r = PinnedRing(1, PAGE, pin=False)
    r.acquire()
    errors: list = []

    def blocked() -> None:
        try:
            r.acquire()
        except RingClosedError as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.05)
    r.close()
    t.join(2)
    assert not t.is_alive() and len(errors) == 1


def test_no_pinned_memory_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with PinnedRing(2, PAGE) as r:
        assert r.pinned_bytes == 0 and total_pinned_bytes() == 0


def _anon_huge_kib(addr: int) -> int | None:
    """AnonHugePages of the mapping holding ``addr`` (/proc/self/smaps), None if not found."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= addr < hi:
                for rest in lines[i + 1:]:
                    if rest.startswith("AnonHugePages:"):
                        return int(rest.split()[1])
                return None
    return None


def test_buffer_asks_for_huge_pages_and_stays_exact():
    """The ring's memory is backed by 2 MiB pages where THP allows (fewer TLB misses for the copy
    threads); the size stays exact and the memory zeroed."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    with PinnedBuffer(16 << 20, pin=False) as b, PinnedBuffer(16 << 20, pin=False, hugepage=False) as small:
        assert b.nbytes == 16 << 20
        assert not b.tensor.any()
        huge = _anon_huge_kib(b.ptr)
        assert huge is not None and huge >= 2048, huge
        assert (_anon_huge_kib(small.ptr) or 0) == 0 or "[always]" in thp.read_text()
