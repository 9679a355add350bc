"""The stream-decided decode step (mmap_offload/async_step.py, csrc/async_step.c): enqueued without
any wait, it makes exactly the synchronous step's decisions (slots, evictions, policy scores,
counters) once its callbacks ran, every slot id it writes points at the routed expert's bytes, and a
read that fails empties the victims' slots and fails the step at ``wait()``. On the CPU the stream is
the copy pool's stand-in and the kernel a host function; the CUDA kernel has its own GPU test."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fakes import expert_matches, make_cache
from mmap_offload.async_step import AsyncStep
from mmap_offload.expert_cache import POLICIES, ExpertCache
from mmap_offload.expert_step import ExpertStep
from mmap_offload.traces import skewed_trace
from test_expert_step import LAYERS, E, _ordered_engine, _same, _state

# slots per layer (capacity_experts / layers) and the ids per call: every call fits the pool
SLOTS, TOP_K = 3, 2


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    c = make_cache(tmp_path_factory.mktemp("cache"), layers=LAYERS, num_experts=E)
    for layer in LAYERS:  # every expert checked: the async step's promise (AsyncStep.eligible)
        c.check_experts_once(layer, list(range(E)))
    return c


def _pair(cache, policy, **kw):
    eng_a, eng_s = _ordered_engine(), _ordered_engine()
    kw = dict(capacity_experts=SLOTS * len(LAYERS), policy=policy, stream_ordered=True, **kw)
    return eng_a, eng_s, ExpertCache(cache, eng_a, "cpu", **kw), ExpertCache(cache, eng_s, "cpu", **kw)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_async_step_makes_the_synchronous_steps_decisions(cache, policy, dtype):
    """A whole step (every layer) is enqueued before anything is waited for; after wait() the
    cache's state and counters equal those of the synchronous step on a twin cache, and each
    layer's slot ids (written by the stand-in kernel) point at slots holding the routed experts."""
    eng_a, eng_s, ac, sc = _pair(cache, policy)
    a = AsyncStep.create(ExpertStep.create(ac), max_experts=4, cpu_drain=False)
    assert isinstance(a, AsyncStep), a
    sync = ExpertStep.create(sc)
    try:
        tr = skewed_trace(30, len(LAYERS), E, top_k=TOP_K, batch=1, seed=11)
        for t in range(tr.shape[0]):
            outs = []
            for li, layer in enumerate(LAYERS):
                ids = torch.from_numpy(tr[t, li]).to(dtype)
                out = a.run(layer, ids)
                assert out is not None and out.dtype == dtype and tuple(out.shape) == tuple(ids.shape)
                outs.append((layer, ids, out))
            a.wait()
            a.step._drain_cpu_stream()  # the stand-in kernels ran (each waited for its items' flags)
            for layer, ids, out in outs:
                ref, _ = sync.run(layer, ids)
                if ref is None:  # the sync step's first use of an expert: its Python path
                    ref = sc.ensure(layer, ids)
                # each layer's slot ids as of its call (later layers do not touch this pool)
                assert torch.equal(out.to(torch.int64), ref.to(torch.int64))
                slots = ac.slots(layer)
                for e, s in zip(ids.reshape(-1).tolist(), out.reshape(-1).tolist()):
                    assert expert_matches(cache, layer, e, slots, s)
            _same(_state(ac), _state(sc))
        assert a.summary()["calls"] == tr.shape[0] * len(LAYERS)
        assert ac.metrics["misses"] > 0 and ac.metrics["hits"] > 0
    finally:
        a.close()
        eng_a.close()
        eng_s.close()


def test_async_step_refuses_an_unknown_fill_store_rule(cache, monkeypatch):
    monkeypatch.setenv("MMO_ASYNC_FILL_STORES", "fast")
    eng, eng_s, ec, _ = _pair(cache, "lfu-decay")
    try:
        with pytest.raises(ValueError, match="MMO_ASYNC_FILL_STORES='fast': use auto, cached or streaming"):
            AsyncStep.create(ExpertStep.create(ec))
    finally:
        eng.close()
        eng_s.close()


def test_async_step_declines_what_it_cannot_promise(cache, tmp_path):
    """More ids than the pool's slots, unchecked experts, hints in flight: run() enqueues nothing and
    returns None (the caller takes the synchronous path)."""
    eng, eng_s, ec, _ = _pair(cache, "lfu-decay")
    a = AsyncStep.create(ExpertStep.create(ec), max_experts=4)
    try:
        assert a.run(LAYERS[0], torch.arange(SLOTS + 1)) is None  # more ids than slots
        fresh = make_cache(tmp_path / "fresh", layers=LAYERS, num_experts=E, seed=3)  # nothing checked
        eng2 = _ordered_engine()
        try:
            b = AsyncStep.create(ExpertStep.create(ExpertCache(fresh, eng2, "cpu", capacity_experts=9,
                                                               stream_ordered=True)))
            assert b.run(LAYERS[0], torch.tensor([0, 1])) is None
            b.close()
        finally:
            eng2.close()
        assert a.pending() == 0 and a.metrics["declined"] == 1 and b.metrics["declined"] == 1
        assert ec.metrics["calls"] == 0  # nothing was decided
    finally:
        a.close()
        eng.close()
        eng_s.close()


def test_async_step_failed_read_empties_the_slots_and_fails_the_step(tmp_path):
    """A miss whose read of the mapping raises SIGBUS (the file truncated under the mapping): the
    callback still returns (the stream goes on), the victims' slots are emptied, nothing is
    committed for the failed experts, and wait() raises the engine's read error naming the cache."""
    from fakes import run_child

    code = r"""
import os, sys, numpy as np, torch
sys.path.insert(0, "tests")
from fakes import make_cache, real_engines
from pathlib import Path
from mmap_offload.expert_cache import ExpertCache
from mmap_offload.expert_step import ExpertStep
from mmap_offload.async_step import AsyncStep
d = Path(sys.argv[1])
cache = make_cache(d, layers=(0,), num_experts=4)
cache.check_experts_once(0, [0, 1, 2, 3])
eng = [f for f in real_engines() if getattr(f, "name", "") == "real-mmap-ordered"][0]()
ec = ExpertCache(cache, eng, "cpu", capacity_experts=2, stream_ordered=True)
a = AsyncStep.create(ExpertStep.create(ec), max_experts=2)
a.run(0, torch.tensor([0, 1])); a.wait()
print("RESIDENT", sorted(ec.resident(0).items()))
f = [p for p in d.rglob("*") if p.is_file() and p.stat().st_size > 1 << 12][0]
os.truncate(f, 0)
a.run(0, torch.tensor([2, 3]))
try:
    a.wait()
    print("NO ERROR")
except Exception as e:
    print("ERR", type(e).__name__, str(e)[:200])
print("RESIDENT", sorted(ec.resident(0).items()))
a.close(); eng.close()
"""
    lines, err = run_child(code, str(tmp_path / "c"))
    assert err.startswith("ERR"), lines
    before, after = [l for l in lines if l.startswith("RESIDENT")]
    assert before == "RESIDENT [(0, 0), (1, 1)]" or before.startswith("RESIDENT [(0,")
    assert after == "RESIDENT []"  # both victims emptied, neither new expert committed


def _sparse_trace(steps: int, layers: int, n_ids: int, min_distinct: int, seed: int) -> np.ndarray:
    """[steps, layers, n_ids] skewed ids with at least ``min_distinct`` distinct experts per call
    (more than the pool's slots: the synchronous step's sparse mode takes every call)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.2
    p = p[rng.permutation(E)] / p.sum()
    out = np.empty((steps, layers, n_ids), dtype=np.int64)
    for t in range(steps):
        for li in range(layers):
            while True:
                ids = rng.choice(E, size=n_ids, p=p)
                if len(np.unique(ids)) >= min_distinct:
                    break
            out[t, li] = ids
    return out


def _buffers(cache, n: int) -> list[dict[str, torch.Tensor]]:
    return [{s.name: torch.zeros((E, *s.shape), dtype=s.torch_dtype) for s in cache.expert_specs} for _ in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("max_experts", [1, 2, 8])
def test_async_sparse_call_makes_the_synchronous_sparse_steps_decisions(cache, policy, max_experts):
    """Sparse calls (more ids and distinct experts than the pool's slots), a whole step enqueued
    before any wait, cut into parts of ``max_experts`` misses (one staging load each): after wait()
    each layer's buffer holds exactly the routed experts' bytes, the pool admitted the same experts
    into the same slots, and the cache's state and counters equal those of ExpertStep.run_sparse
    (mo_step_sparse) on a twin cache; every resident slot holds its expert's bytes."""
    eng_a, eng_s, ac, sc = _pair(cache, policy)
    a = AsyncStep.create(ExpertStep.create(ac), max_experts=max_experts, cpu_drain=False)
    assert isinstance(a, AsyncStep), a
    sync = ExpertStep.create(sc)
    bufs_a, bufs_s = _buffers(cache, len(LAYERS)), _buffers(cache, 1)
    try:
        tr = _sparse_trace(25, len(LAYERS), 6, SLOTS + 1, seed=7)
        for t in range(tr.shape[0]):
            for li, layer in enumerate(LAYERS):
                for b in bufs_a[li].values():
                    b.zero_()
                assert a.run_sparse(layer, torch.from_numpy(tr[t, li]), bufs_a[li])
            a.wait()
            a.step._drain_cpu_stream()
            for li, layer in enumerate(LAYERS):
                ids = torch.from_numpy(tr[t, li])
                out, used = sync.run(layer, ids)
                assert out is None and np.array_equal(used, np.unique(tr[t, li]))
                assert sync.run_sparse(layer, bufs_s[0])
                for e in range(E):  # the routed rows hold their experts, the others were not written
                    if e in used:
                        assert expert_matches(cache, layer, e, bufs_a[li], e)
                    else:
                        assert all(int(v[e].count_nonzero()) == 0 for v in bufs_a[li].values())
            _same(_state(ac), _state(sc))
            for li, layer in enumerate(LAYERS):
                for e, s in ac.resident(layer).items():
                    assert expert_matches(cache, layer, e, ac.slots(layer), s)
        summ = a.summary()
        assert summ["sparse_calls"] == tr.shape[0] * len(LAYERS) and summ["calls"] == 0
        assert summ["admitted"] == ac.metrics["admitted"] > 0 and summ["sparse_hits"] > 0
        if max_experts < 6:
            assert summ["sparse_parts"] > summ["sparse_calls"]  # calls were cut into parts
        assert a.sparse_miss_bytes == summ["sparse_misses"] * ac.expert_nbytes > 0
    finally:
        a.close()
        eng_a.close()
        eng_s.close()


@pytest.mark.parametrize("stores", ["auto", "cached", "streaming"])
def test_async_expert_and_sparse_calls_interleave(cache, stores, monkeypatch):
    """Expert-mode and sparse calls of the same layers queued back to back (decode at batch 1 and 8
    in one stream), with each rule for the fills' stores: every slot id points at its expert, every
    buffer row holds its expert, the pool stays consistent."""
    monkeypatch.setenv("MMO_ASYNC_FILL_STORES", stores)
    eng, eng_s, ec, _ = _pair(cache, "lfu-decay")
    a = AsyncStep.create(ExpertStep.create(ec), max_experts=2, cpu_drain=False)
    bufs = _buffers(cache, len(LAYERS))
    try:
        small = skewed_trace(20, len(LAYERS), E, top_k=TOP_K, batch=1, seed=2)
        big = _sparse_trace(20, len(LAYERS), 7, 1, seed=9)  # some calls fit the pool, some do not
        for t in range(20):
            outs = []
            for li, layer in enumerate(LAYERS):
                if (t + li) % 2:
                    ids = torch.from_numpy(small[t, li])
                    outs.append((layer, ids, a.run(layer, ids)))
                else:
                    assert a.run_sparse(layer, torch.from_numpy(big[t, li]), bufs[li])
                    outs.append((layer, big[t, li], None))
            a.wait()
            a.step._drain_cpu_stream()
            for li, (layer, ids, out) in enumerate(outs):
                if out is None:
                    for e in np.unique(ids).tolist():
                        assert expert_matches(cache, layer, e, bufs[li], e)
                else:
                    for e, s in zip(ids.reshape(-1).tolist(), out.reshape(-1).tolist()):
                        assert expert_matches(cache, layer, e, ec.slots(layer), s)
            for layer in LAYERS:
                for e, s in ec.resident(layer).items():
                    assert expert_matches(cache, layer, e, ec.slots(layer), s)
        assert a.summary()["sparse_calls"] == 30 and a.summary()["calls"] == 30
        assert a.summary()["fill_stores"] == stores
    finally:
        a.close()
        eng.close()
        eng_s.close()


def test_async_sparse_call_declines_past_its_cap_and_fails_whole_on_a_failed_launch(cache):
    """More ids than the step's cap: nothing enqueued. A part whose callback cannot be launched
    (the fake stream fails the 3rd launch: part 1's callback): run_sparse raises at once, naming the
    CUDA error; the layer's pool is emptied (part 0's callback committed admissions for parts that
    will never copy), nothing else changes, and the next calls are served exactly."""
    eng, eng_s, ec, _ = _pair(cache, "lfu-decay")
    a = AsyncStep.create(ExpertStep.create(ec), max_experts=1, max_ids=6)
    bufs = _buffers(cache, 1)
    try:
        assert a.run_sparse(LAYERS[0], torch.arange(7) % E, bufs[0]) is False  # 7 ids > cap 6
        assert a.pending() == 0 and a.metrics["declined"] == 1
        for layer in LAYERS:  # every pool holds something
            assert a.run_sparse(layer, torch.tensor([0, 1, 2, 3, 4, 5]), bufs[0])
        a.wait()
        assert all(ec.resident(layer) for layer in LAYERS)
        before = {layer: dict(ec.resident(layer)) for layer in LAYERS[1:]}
        a.step.lib.mo_fake_stream_fail(a.step.pool._fake_stream, 2, 3, 700)
        with pytest.raises(RuntimeError, match="CUDA error 700; layer position 0's pool was emptied"):
            a.run_sparse(LAYERS[0], torch.tensor([1, 4, 5, 6, 7, 1]), bufs[0])
        assert ec.resident(LAYERS[0]) == {}
        assert {layer: dict(ec.resident(layer)) for layer in LAYERS[1:]} == before
        for b in bufs[0].values():
            b.zero_()
        ids = torch.tensor([6, 7, 1, 4, 6, 2])
        assert a.run_sparse(LAYERS[0], ids, bufs[0])
        a.wait()
        for e in np.unique(ids.numpy()).tolist():
            assert expert_matches(cache, LAYERS[0], e, bufs[0], e)
        for e, s in ec.resident(LAYERS[0]).items():
            assert expert_matches(cache, LAYERS[0], e, ec.slots(LAYERS[0]), s)
    finally:
        a.close()
        eng.close()
        eng_s.close()


def test_async_sparse_call_of_many_ids_has_a_part_per_staging_load_of_experts(cache):
    """A call's parts hold its distinct experts, at most E of them, not one per id: 40 ids over 8
    experts with one expert per staging load are 8 parts (one per id would be 40, past the 32 a call
    may take: declined), and every routed expert lands in its row."""
    eng, eng_s, ec, _ = _pair(cache, "lfu-decay")
    a = AsyncStep.create(ExpertStep.create(ec), max_experts=1, max_ids=64)
    bufs = _buffers(cache, 1)
    try:
        ids = torch.arange(40) % E
        assert a.run_sparse(LAYERS[0], ids, bufs[0])
        a.wait()
        assert a.summary()["sparse_parts"] == E
        for e in range(E):
            assert expert_matches(cache, LAYERS[0], e, bufs[0], e)
    finally:
        a.close()
        eng.close()
        eng_s.close()


def test_async_sparse_failed_read_forgets_its_admissions_and_fails_the_step(tmp_path):
    """A sparse call whose misses' reads raise SIGBUS: wait() raises the read error, the slots it
    admitted those experts into are forgotten, the hits' slots stay."""
    from fakes import run_child

    code = r"""
import os, sys, numpy as np, torch
sys.path.insert(0, "tests")
from fakes import make_cache, real_engines
from pathlib import Path
from mmap_offload.expert_cache import ExpertCache
from mmap_offload.expert_step import ExpertStep
from mmap_offload.async_step import AsyncStep
d = Path(sys.argv[1])
cache = make_cache(d, layers=(0,), num_experts=6)
cache.check_experts_once(0, list(range(6)))
eng = [f for f in real_engines() if getattr(f, "name", "") == "real-mmap-ordered"][0]()
ec = ExpertCache(cache, eng, "cpu", capacity_experts=3, stream_ordered=True)
a = AsyncStep.create(ExpertStep.create(ec), max_experts=1)  # a sparse call of 5 ids: 5 parts
a.run(0, torch.tensor([0])); a.run(0, torch.tensor([1])); a.wait()
print("RESIDENT", sorted(ec.resident(0).items()))
rows = {s.name: torch.zeros((6, *s.shape), dtype=s.torch_dtype) for s in cache.expert_specs}
f = [p for p in d.rglob("*") if p.is_file() and p.stat().st_size > 1 << 12][0]
os.truncate(f, 0)
print("ENQ", a.run_sparse(0, torch.tensor([0, 1, 2, 3, 2]), rows))
try:
    a.wait()
    print("NO ERROR")
except Exception as e:
    print("ERR", type(e).__name__, str(e)[:200])
print("RESIDENT", sorted(ec.resident(0).items()))
print("ADMITTED", a.summary()["admitted"])
a.close(); eng.close()
"""
    lines, err = run_child(code, str(tmp_path / "c"))
    assert err.startswith("ERR"), lines
    res = [l for l in lines if l.startswith("RESIDENT")]
    assert res[0] == "RESIDENT [(0, 0), (1, 1)]", lines
    assert "ENQ True" in lines and "ADMITTED 1" in lines, lines  # a free slot: one miss admitted
    assert res[1] == "RESIDENT [(0, 0), (1, 1)]", lines  # ... and forgotten: its bytes never came


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_async_step_exact_under_a_busy_stream(tmp_path, dtype):
    """CUDA: a whole step of 4 layers is enqueued behind device work (a matmul before each layer's
    ids) with no host wait; the copy kernel (NVRTC, copy_kernel.py) moves the misses from pinned
    staging into the slots and writes the slot ids. Gathered in stream order right after each call,
    the slots the ids point at hold the routed experts' bytes; the decisions equal the synchronous
    step's on a twin cache; the launching thread never waited (the kernel is the real one)."""
    from fakes import cuda_engine

    specs = [("w13_weight", "bfloat16", (256, 128)), ("w2_weight", "bfloat16", (128, 136))]  # 34816 B: % 16
    c = make_cache(tmp_path, layers=(0, 1, 2, 3), num_experts=16, specs=specs)
    assert c.check_in_background(nice=0).wait(60)
    dev = torch.device("cuda")
    want = {(l, e): {s.name: c.tensor(l, e, s.name).contiguous().view(-1).view(torch.uint8).sum().item()
                     for s in c.expert_specs} for l in c.layers for e in range(16)}
    eng, eng_s = cuda_engine("ordered"), cuda_engine("ordered")
    stream = torch.cuda.Stream(dev)
    tr = skewed_trace(30, 4, 16, top_k=2, batch=2, seed=0)  # 4 ids per call, 4 slots per layer
    got = []
    try:
        with torch.cuda.stream(stream):
            ec = ExpertCache(c, eng, dev, capacity_experts=4 * 4, stream_ordered=True)
            sc = ExpertCache(c, eng_s, dev, capacity_experts=4 * 4, stream_ordered=True)
            a = AsyncStep.create(ExpertStep.create(ec), max_experts=4)
            assert isinstance(a, AsyncStep), a
            assert a.kernel_source.startswith(("cubin", "ptx"))
            sync = ExpertStep.create(sc)
            for t in range(tr.shape[0]):
                for li, layer in enumerate(c.layers):
                    ids = torch.from_numpy(tr[t, li]).to(dev, dtype)
                    x = torch.randn(1024, 1024, device=dev)
                    x = x @ x  # the ids come after work the step must not wait for
                    out = a.run(layer, ids)
                    assert out is not None
                    slots = ec.slots(layer)
                    flat = out.reshape(-1).to(torch.int64)  # ordered after the copy kernel
                    for i, e in enumerate(tr[t, li].reshape(-1).tolist()):
                        got.append(((layer, e), {n: v[flat[i]].view(-1).view(torch.uint8).sum() for n, v in slots.items()}))
                    ref, _ = sync.run(layer, ids)
                    if ref is None:
                        ref = sc.ensure(layer, ids)
                    got.append(("ids", out.to(torch.int64).clone(), ref.to(torch.int64).clone()))
                a.wait()
                sc.check_ordered()
            assert a.metrics["waits"] == tr.shape[0] and a.summary()["job_waits"] == 0
        torch.cuda.synchronize()
        for item in got:
            if item[0] == "ids":
                assert torch.equal(item[1], item[2])
            else:
                key, sm = item
                assert {n: v.item() for n, v in sm.items()} == want[key], key
        _same(_state(ec), _state(sc))
        assert ec.metrics["misses"] > 0 and ec.metrics["hits"] > 0
    finally:
        a.close()
        eng.close()
        eng_s.close()


def test_async_step_reports_after_close(cache):
    """vLLM's offloader asks for a summary after closing: the last counters, no call into freed C."""
    eng, eng_s, ec, _ = _pair(cache, "lfu")
    a = AsyncStep.create(ExpertStep.create(ec), max_experts=4)
    try:
        a.run(LAYERS[0], torch.tensor([1, 2]))
        a.close()
        a._fold()
        assert a.summary()["calls"] == 1 and a.pending() == 0
        a.wait()  # nothing to wait for
        from mmap_offload.errors import MmapOffloadError

        with pytest.raises(MmapOffloadError):
            a.run(LAYERS[0], torch.tensor([1, 2]))
    finally:
        a.close()
        eng.close()
        eng_s.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_link_rate_is_timed_out_of_the_staging(tmp_path):
    """CUDA: ``link_h2d_bps`` (hybrid_small_calls="auto"'s threshold scales with it) times host -> device
    copies out of the async step's pinned staging: a rate a PCIe link can have (1-200 GB/s), with no
    more pinned memory than the step had, and the staging's bytes as they were. On the CPU: None."""
    from fakes import cuda_engine

    specs = [("w13_weight", "bfloat16", (256, 128)), ("w2_weight", "bfloat16", (128, 136))]
    c = make_cache(tmp_path, layers=(0, 1), num_experts=16, specs=specs)
    eng = cuda_engine("ordered")
    try:
        ec = ExpertCache(c, eng, torch.device("cuda"), capacity_experts=8, stream_ordered=True)
        a = AsyncStep.create(ExpertStep.create(ec), max_experts=4)
        assert isinstance(a, AsyncStep), a
        a._staging.random_(0, 256)
        before, pinned = a._staging.clone(), a.pinned_bytes
        bps = a.link_h2d_bps()
        assert bps is not None and 1e9 < bps < 200e9, bps
        assert a.pinned_bytes == pinned and torch.equal(a._staging, before)
        a.close()
    finally:
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_async_sparse_calls_exact_under_a_busy_stream(tmp_path):
    """CUDA: sparse calls (8 ids, at least 5 distinct experts, 4 slots per layer) of 4 layers
    enqueued behind device work with no host wait, cut into parts of 2 misses: the kernels copy the
    hits from their slots (device to device) and the misses from staging into the layer buffers'
    rows, admitted ones into their slots too. Read in stream order right after each call, every
    routed row holds its expert's bytes; after the step's wait the decisions equal the synchronous
    sparse step's on a twin cache and every resident slot holds its expert."""
    from fakes import cuda_engine

    specs = [("w13_weight", "bfloat16", (256, 128)), ("w2_weight", "bfloat16", (128, 136))]
    n_exp = 16
    c = make_cache(tmp_path, layers=(0, 1, 2, 3), num_experts=n_exp, specs=specs)
    assert c.check_in_background(nice=0).wait(60)
    dev = torch.device("cuda")
    want = {(l, e): {s.name: c.tensor(l, e, s.name).contiguous().view(-1).view(torch.uint8).sum().item()
                     for s in c.expert_specs} for l in c.layers for e in range(n_exp)}
    rng = np.random.default_rng(4)
    p = 1.0 / np.arange(1, n_exp + 1) ** 1.1
    p /= p.sum()
    tr = np.empty((20, 4, 8), dtype=np.int64)
    for t in range(20):
        for li in range(4):
            while True:
                tr[t, li] = rng.choice(n_exp, size=8, p=p)
                if len(np.unique(tr[t, li])) >= 5:
                    break
    eng, eng_s = cuda_engine("ordered"), cuda_engine("ordered")
    stream = torch.cuda.Stream(dev)
    got = []
    try:
        with torch.cuda.stream(stream):
            ec = ExpertCache(c, eng, dev, capacity_experts=4 * 4, stream_ordered=True)
            sc = ExpertCache(c, eng_s, dev, capacity_experts=4 * 4, stream_ordered=True)
            a = AsyncStep.create(ExpertStep.create(ec), max_experts=2)
            assert isinstance(a, AsyncStep), a
            sync = ExpertStep.create(sc)
            bufs = [{s.name: torch.zeros((n_exp, *s.shape), dtype=s.torch_dtype, device=dev) for s in c.expert_specs}
                    for _ in range(2)]
            ref_rows = {s.name: torch.zeros((n_exp, *s.shape), dtype=s.torch_dtype, device=dev) for s in c.expert_specs}
            for t in range(tr.shape[0]):
                for li, layer in enumerate(c.layers):
                    ids = torch.from_numpy(tr[t, li]).to(dev)
                    x = torch.randn(1024, 1024, device=dev)
                    x = x @ x  # the ids come after work the step must not wait for
                    rows = bufs[li % 2]  # two buffers in turn, as the prefetcher's
                    assert a.run_sparse(layer, ids, rows)
                    for e in np.unique(tr[t, li]).tolist():
                        got.append(((layer, e), {n: v[e].view(-1).view(torch.uint8).sum() for n, v in rows.items()}))
                    out, used = sync.run(layer, ids)
                    assert out is None
                    assert sync.run_sparse(layer, ref_rows)
                a.wait()
                sc.check_ordered()
            assert a.summary()["sparse_parts"] > a.summary()["sparse_calls"] == tr.size // 8
        torch.cuda.synchronize()
        for key, sm in got:
            assert {n: v.item() for n, v in sm.items()} == want[key], key
        _same(_state(ec), _state(sc))
        assert ec.metrics["admitted"] > 0
        for layer in c.layers:
            slots = ec.slots(layer)
            for e, s in ec.resident(layer).items():
                assert {n: v[s].view(-1).view(torch.uint8).sum().item() for n, v in slots.items()} == want[(layer, e)]
    finally:
        a.close()
        eng.close()
        eng_s.close()


@pytest.mark.parametrize("sparse_max_ids", [0, 16, None])
def test_residency_serves_large_calls_sparse_with_sparse_max_ids(tmp_path, sparse_max_ids):
    """The vLLM backend's routing (Residency.route) with a stand-in offloader: 4 tokens x top-3 = 12 ids
    over 8 experts expect more distinct experts than layer_stream_fraction 0.5 allows, so with
    sparse_max_ids 0 each call streams the whole layer; with sparse_max_ids >= 12 (the default, None
    here, is 512) the same calls are sparse on the stream (the routed experts only, exact in their
    rows; the pool learns from them)."""
    from types import SimpleNamespace

    from mmap_offload.vllm_backend.options import MmapOptions
    from mmap_offload.vllm_backend.residency import Residency

    c = make_cache(tmp_path, layers=LAYERS, num_experts=E)
    for layer in LAYERS:
        c.check_experts_once(layer, list(range(E)))
    eng = _ordered_engine()
    bufs = {l: {s.name: torch.zeros((E, *s.shape), dtype=s.torch_dtype) for s in c.expert_specs} for l in LAYERS}
    whole = {l: {s.name: torch.stack([c.tensor(l, e, s.name) for e in range(E)]) for s in c.expert_specs}
             for l in LAYERS}
    targets = [SimpleNamespace(layer=l, index=i, served=(), experts=None) for i, l in enumerate(LAYERS)]
    prefetched = []
    pf = SimpleNamespace(claim=lambda layer, event=True: (bufs[layer], None), start_prefetch=prefetched.append,
                         layer_after=lambda layer, n: LAYERS[(LAYERS.index(layer) + n) % len(LAYERS)],
                         buffer_index=LAYERS.index, holds=lambda layer: False)
    opts = MmapOptions(layer_stream_fraction=0.5, hybrid_parts=2)
    if sparse_max_ids is not None:
        opts.sparse_max_ids = sparse_max_ids
    else:  # the default serves decode up to batch 64 at top-8 sparse (H200, session 13: options.py)
        assert opts.sparse_max_ids == 512
    off = SimpleNamespace(options=opts, device=torch.device("cpu"), cache=c, engine=eng, targets=targets,
                          tp_size=1, _transforms={}, prefetcher=pf, _layer_tensors=lambda t: whole[t.layer])
    nbytes = sum(s.nbytes for s in c.expert_specs)
    res = Residency(off, capacity_bytes=SLOTS * len(LAYERS) * nbytes)
    rng = np.random.default_rng(3)
    try:
        assert res.async_step is not None, res.async_off
        assert res.async_step.hybrid_parts == 2  # the option reaches the step once, at its creation
        assert res._expected_distinct(4, 3) > res.threshold  # the layer threshold alone streams these
        calls = 0
        for _ in range(5):
            for t in targets:
                ids = torch.from_numpy(np.stack([rng.choice(E, size=3, replace=False) for _ in range(4)]))
                for b in bufs[t.layer].values():
                    b.zero_()
                w = torch.rand(4, 3)
                wk, out = res.route(t, w, ids, None)
                calls += 1
                assert wk is w and torch.equal(out, ids)  # ids index the layer's buffer as they are
                if opts.sparse_max_ids:
                    for e in set(ids.flatten().tolist()):  # every routed expert in its row, exact
                        assert expert_matches(c, t.layer, e, bufs[t.layer], e), (t.layer, e)
        res._async_settle()
        m = res.metrics
        if opts.sparse_max_ids:
            assert m["sparse_async_calls"] == calls and m["layer_calls"] == 0 and not prefetched
            assert res.ec.metrics["admitted"] > 0  # the pool learns from sparse calls
        else:
            assert m["layer_calls"] == calls and m["sparse_async_calls"] == 0 and prefetched
    finally:
        res.close()
        eng.close()
