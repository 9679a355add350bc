"""The native decode step (mmap_offload/expert_step.py, csrc/route_step.c): on the same trace it
makes exactly the Python path's decisions (slots, evictions, policy scores, counters), every slot it
hands out holds the asked expert's bytes, and it hands back to the Python path what it does not
serve (first uses, hints in flight, more experts than slots) without changing anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fakes import cuda_engine, expert_matches, make_cache, real_engines, run_child
from mmap_offload.expert_cache import POLICIES, ExpertCache
from mmap_offload.expert_step import ExpertStep
from mmap_offload.traces import skewed_trace

LAYERS = (0, 2, 5)
E = 8


def _ordered_engine():
    reals = [f for f in real_engines() if getattr(f, "name", "") == "real-mmap-ordered"]
    if not reals:
        pytest.skip("the native pool is unavailable")
    return reals[0]()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("cache"), layers=LAYERS, num_experts=E)


def _state(ec: ExpertCache):
    pools = [(p.owner_li.copy(), p.owner_e.copy(), p.used.copy(), p.hinted.copy(), p.use_call.copy(), p.pinned.copy())
             for p in ec._pools]
    keys = ("calls", "hits", "misses", "evictions", "routed_bytes", "miss_bytes", "bytes_moved", "ordered_fills",
            "admitted")
    return (ec._lut.copy(), ec._last.copy(), ec._logscore.copy(), ec._now, pools, {k: ec.metrics[k] for k in keys})


def _same(a, b) -> None:
    lut_a, last_a, ls_a, now_a, pools_a, m_a = a
    lut_b, last_b, ls_b, now_b, pools_b, m_b = b
    assert np.array_equal(lut_a, lut_b)
    assert np.array_equal(last_a, last_b)
    assert np.array_equal(ls_a, ls_b)  # bit for bit: the C step follows numpy's logaddexp
    assert now_a == now_b and m_a == m_b
    for pa, pb in zip(pools_a, pools_b):
        for x, y in zip(pa, pb):
            assert np.array_equal(x, y)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_native_step_makes_the_python_paths_decisions(cache, policy, dtype):
    """Two caches on one skewed trace, one served by ExpertStep (its Python fallback where it
    declines), one by ensure only: after every call the slot maps, owners, use marks, policy scores,
    clock and counters are identical, the slot ids equal, and every slot holds its expert's bytes."""
    eng_n, eng_p = _ordered_engine(), _ordered_engine()
    try:
        kw = dict(capacity_experts=3 * len(LAYERS), policy=policy, stream_ordered=True)
        native, python = ExpertCache(cache, eng_n, "cpu", **kw), ExpertCache(cache, eng_p, "cpu", **kw)
        step = ExpertStep.create(native)
        assert step is not None
        tr = skewed_trace(40, len(LAYERS), E, top_k=2, batch=1, seed=3)
        served = 0
        for t in range(tr.shape[0]):
            for li, layer in enumerate(LAYERS):
                ids = torch.from_numpy(tr[t, li]).to(dtype)
                out, used = step.run(layer, ids)
                assert used is not None and np.array_equal(used, np.unique(tr[t, li]))
                if out is None:
                    out = native.ensure(layer, ids)
                else:
                    served += 1
                    assert out.dtype == dtype and tuple(out.shape) == tuple(ids.shape)
                ref = python.ensure(layer, ids)
                assert torch.equal(out.to(torch.int64), ref.to(torch.int64))
                slots = native.slots(layer)
                for e, s in zip(ids.reshape(-1).tolist(), out.reshape(-1).tolist()):
                    assert expert_matches(cache, layer, e, slots, s)
                _same(_state(native), _state(python))
        # the first fetch of each expert is the Python path's (its first-use check)
        assert step.metrics["python"] <= len(LAYERS) * E  # (none once an earlier case checked them all)
        assert served > tr.shape[0] * len(LAYERS) // 2
        assert native.metrics["ordered_fills"] > 0
    finally:
        eng_n.close()
        eng_p.close()


def _python_sparse(ec: ExpertCache, layer: int, used: np.ndarray, rows: dict) -> None:
    """vllm_backend/residency.py ``_sparse_mode`` on the CPU, without vLLM: the reference."""
    row = ec.slot_map(layer)
    slots = row[used]
    misses, hits = used[slots < 0], used[slots >= 0]
    if len(misses):
        ec.cache.check_experts_once(layer, misses)
        ticket = ec.submit_rows_ordered(layer, misses, rows)
        ec.engine.wait(ticket)
        ec.engine.synchronize(ticket)
    pool = ec.slots(layer)
    for name in pool:
        rows[name][torch.from_numpy(hits)] = pool[name][torch.from_numpy(row[hits])]
    if len(misses):
        ec.admit(layer, used, rows, misses, read_slots=slots[slots >= 0])


@pytest.mark.parametrize("policy", POLICIES)
def test_native_sparse_step_makes_the_python_paths_decisions(cache, policy):
    """Calls with more distinct experts than the pool's slots (vLLM's sparse mode): the native
    step fills exactly the routed rows of the layer buffer (misses from the cache, hits from the
    pool) and admits the same experts into the same slots as the Python path; after every call the
    caches' state is identical and every resident slot holds its expert's bytes."""
    eng_n, eng_p = _ordered_engine(), _ordered_engine()
    try:
        kw = dict(capacity_experts=3 * len(LAYERS), policy=policy, stream_ordered=True)
        native, python = ExpertCache(cache, eng_n, "cpu", **kw), ExpertCache(cache, eng_p, "cpu", **kw)
        step = ExpertStep.create(native)
        bufs = [{s.name: torch.zeros((E, *s.shape), dtype=s.torch_dtype) for s in cache.expert_specs} for _ in range(2)]
        tr = skewed_trace(40, len(LAYERS), E, top_k=2, batch=3, seed=5)
        sparse = 0
        for t in range(tr.shape[0]):
            for li, layer in enumerate(LAYERS):
                ids = torch.from_numpy(tr[t, li])
                used = np.unique(tr[t, li])
                out, got = step.run(layer, ids)
                if len(used) > 3:
                    assert out is None and np.array_equal(got, used)
                    rows_n, rows_p = bufs[0], bufs[1]
                    if step.run_sparse(layer, rows_n):
                        sparse += 1
                    else:
                        _python_sparse(native, layer, used, rows_n)
                    _python_sparse(python, layer, used, rows_p)
                    for e in used.tolist():
                        assert expert_matches(cache, layer, e, rows_n, e)
                else:
                    if out is None:
                        native.ensure(layer, ids)
                    python.ensure(layer, ids)
                _same(_state(native), _state(python))
                for e, s in native.resident(layer).items():
                    assert expert_matches(cache, layer, e, native.slots(layer), s)
        assert sparse > 10 and native.metrics["admitted"] > 0
    finally:
        eng_n.close()
        eng_p.close()


def test_native_step_declines_without_changing_anything(cache):
    """More distinct experts than slots: the distinct ids come back, nothing moved; a pool with a
    hint in flight: the ids are not even read; an id out of range: one clear error."""
    eng = _ordered_engine()
    try:
        ec = ExpertCache(cache, eng, "cpu", capacity_experts=2 * len(LAYERS), stream_ordered=True)
        step = ExpertStep.create(ec)
        before = _state(ec)
        out, used = step.run(LAYERS[0], torch.tensor([[1, 4], [6, 4]]))
        assert out is None and used.tolist() == [1, 4, 6]
        _same(_state(ec), before)
        with pytest.raises(IndexError, match=r"\[0, 8\)"):
            step.run(LAYERS[0], torch.tensor([[1, 9]]))
        _same(_state(ec), before)
        ec.ensure(LAYERS[1], [0, 1])
        ec.ensure(LAYERS[1], [2, 3])
        ec.prefetch_hint(LAYERS[1], [0])  # an ordinary batch: the pool has a copy in flight
        if ec._pool_of[1].pending:
            assert step.run(LAYERS[1], torch.tensor([[2, 3]])) == (None, None)
        ec.sync()
    finally:
        eng.close()


def test_native_step_follows_the_engine_remapping_its_files(cache):
    """After the engine dropped its mappings (a new map generation) the step looks the source
    addresses up again, so the bytes stay right."""
    eng = _ordered_engine()
    try:
        ec = ExpertCache(cache, eng, "cpu", capacity_experts=2 * len(LAYERS), stream_ordered=True)
        step = ExpertStep.create(ec)
        for i in range(16):
            layer = LAYERS[0]
            ids = torch.tensor([(2 * i) % E, (2 * i + 1) % E])
            out, _ = step.run(layer, ids)
            if out is None:
                out = ec.ensure(layer, ids)
            for e, s in zip(ids.tolist(), out.tolist()):
                assert expert_matches(cache, layer, e, ec.slots(layer), s)
            if i == 7:
                eng.unmap_all()
        assert step.metrics["runs"] == 16 and step.metrics["served"] >= 8
    finally:
        eng.close()


def test_a_failed_native_read_is_raised_and_its_slots_forgotten(tmp_path):
    """A layer file truncated under its mapping: the native step's batch fails with the CacheError
    naming the file (SIGBUS caught in a fill thread; on CPU the step waits at once), the pool
    forgets the experts it was filling, and the other layer is still served exactly. In a child
    process (a SIGBUS)."""
    import textwrap

    code = textwrap.dedent("""
        import os, sys
        sys.path.insert(0, "tests")
        import torch
        from fakes import expert_matches, make_cache
        from mmap_offload.errors import CacheError
        from mmap_offload.expert_cache import ExpertCache
        from mmap_offload.expert_step import ExpertStep
        from mmap_offload.transfer import make_engine
        c = make_cache(__import__("pathlib").Path(sys.argv[1]), layers=(0, 1), num_experts=8,
                       specs=[("w13_weight", "bfloat16", (512, 256)), ("w2_weight", "bfloat16", (256, 256))])
        eng = make_engine("mmap", "cpu", pinned_bytes=8 << 20, slot_bytes=1 << 20, threads=2, native=True,
                          ordered_fraction=0.5)
        ec = ExpertCache(c, eng, "cpu", capacity_experts=4, stream_ordered=True)
        step = ExpertStep.create(ec)
        def serve(layer, ids):
            ids = torch.tensor(ids)
            out, _ = step.run(layer, ids)
            if out is None:
                out = ec.ensure(layer, ids)
            return all(expert_matches(c, layer, e, ec.slots(layer), s) for e, s in zip(ids.tolist(), out.tolist()))
        for ids in ([6, 7], [0, 1], [2, 3]):
            assert serve(0, ids) and serve(1, ids)
        os.truncate(c.layer_file(0), c.record_nbytes)  # experts 1.. of layer 0 are past the end now
        try:
            serve(0, [6, 7])
            print("NO ERROR")
        except CacheError as e:
            print("ERR", str(e).splitlines()[0])
        print("FORGOTTEN", ec.slot_map(0)[6] < 0 and ec.slot_map(0)[7] < 0)
        print("OTHER", serve(1, [6, 7]) and step.metrics["python"] == 6)
        eng.close()
    """)
    lines, err = run_child(code, str(tmp_path))
    assert err.startswith("ERR") and "SIGBUS" in err, lines
    assert "FORGOTTEN True" in lines and "OTHER True" in lines, lines


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_gpu_native_step_exact_under_a_busy_stream(tmp_path, dtype):
    """CUDA: the step reads device ids, queues its misses on the current (busy) stream and writes
    slot ids on the device; calls with more experts than the pool's 3 slots fill a layer buffer's
    rows natively (misses from the cache, hits from the pool, admissions into it). Gathered bytes,
    in stream order, equal the cache, for the slots and rows handed out and, at the end, for every
    resident slot; the deferred check finds no error; the native step served most calls."""
    c = make_cache(tmp_path, layers=(0, 1, 2, 3), num_experts=16,
                   specs=[("w13_weight", "bfloat16", (256, 128)), ("w2_weight", "bfloat16", (128, 128))])
    assert c.check_in_background(nice=0).wait(60)  # every expert checked: no first-use fallbacks
    eng = cuda_engine("ordered")
    dev = torch.device("cuda")
    want = {(l, e): {s.name: c.tensor(l, e, s.name).contiguous().view(-1).view(torch.uint8).sum().item()
                     for s in c.expert_specs} for l in c.layers for e in range(16)}
    stream = torch.cuda.Stream(dev)
    tr = skewed_trace(30, 4, 16, top_k=2, batch=2, seed=0)  # 66 of its 120 calls route > 3 experts
    got = []

    def sums(tensors, i):
        return {n: v[i].view(-1).view(torch.uint8).sum() for n, v in tensors.items()}

    try:
        with torch.cuda.stream(stream):
            ec = ExpertCache(c, eng, dev, capacity_experts=3 * 4, stream_ordered=True)
            step = ExpertStep.create(ec)
            assert step is not None
            rows = {s.name: torch.zeros((16, *s.shape), dtype=s.torch_dtype, device=dev) for s in c.expert_specs}
            for t in range(tr.shape[0]):
                for li, layer in enumerate(c.layers):
                    ids = torch.from_numpy(tr[t, li]).to(dev, dtype)
                    x = torch.randn(1024, 1024, device=dev)
                    x = x @ x  # the ids come after work the step must wait for
                    out, used = step.run(layer, ids)
                    if out is None and len(used) > 3:
                        if not step.run_sparse(layer, rows):
                            _python_sparse(ec, layer, used, rows)
                        for e in used.tolist():
                            got.append(((layer, e), sums(rows, e)))
                        continue
                    if out is None:
                        out = ec.ensure(layer, ids)
                    slots = ec.slots(layer)
                    flat = out.reshape(-1).to(torch.int64)
                    for i, e in enumerate(tr[t, li].reshape(-1).tolist()):
                        got.append(((layer, e), sums(slots, flat[i])))
                ec.check_ordered()
            for layer in c.layers:
                for e, s in ec.resident(layer).items():
                    got.append(((layer, e), sums(ec.slots(layer), s)))
        torch.cuda.synchronize()
        for key, sm in got:
            assert {n: v.item() for n, v in sm.items()} == want[key], key
        assert step.metrics["served"] == 54 and step.metrics["sparse_served"] == 66 and ec.metrics["admitted"] > 0
    finally:
        eng.close()


def test_experts_checked_in_the_background_are_served_natively(tmp_path):
    """The first-use check is the cache's: experts it found clean (here by a background check,
    before any fetch) are served by the native step from their first fetch on; an expert whose
    check failed is never marked clean, so its fetch goes to the Python path, which refuses it."""
    from fakes import flip_byte
    from mmap_offload.errors import CorruptCacheError

    c = make_cache(tmp_path, layers=(0, 1), num_experts=E)
    flip_byte(c.layer_file(1), 5 * c.record_nbytes + c.expert_specs[0].offset)  # layer 1, expert 5
    assert c.check_in_background(nice=0).wait(60)
    eng = _ordered_engine()
    try:
        ec = ExpertCache(c, eng, "cpu", capacity_experts=2 * 3, stream_ordered=True)
        step = ExpertStep.create(ec)
        assert c.clean_mask(0).all() and c.clean_mask(1)[5] == 0 and c.clean_mask(1).sum() == E - 1
        for ids in ([0, 1], [2, 3], [4, 6]):
            out, _ = step.run(1, torch.tensor(ids))
            assert out is not None
            assert all(expert_matches(c, 1, e, ec.slots(1), s) for e, s in zip(ids, out.tolist()))
        out, used = step.run(1, torch.tensor([5, 6]))
        assert out is None and used.tolist() == [5, 6] and step.metrics["python"] == 1
        with pytest.raises(CorruptCacheError):
            ec.ensure(1, [5, 6])
        assert ec.slot_map(1)[5] < 0
    finally:
        eng.close()
