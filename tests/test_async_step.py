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
