"""ExpertCache: remapped ids point at slots holding exactly the asked experts, capacity is kept,
no needed expert is evicted, counters add up, bytes moved stay within the bar; plus the traces."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from fakes import (
    DeferredEngine, FailingEngine, SyncEngine, cuda_engine, engine_factories, expert_matches, flip_byte, make_cache,
    real_engines,
)
from mmap_offload.errors import CacheError, UnsupportedError
from mmap_offload.expert_cache import POLICIES, ExpertCache
from mmap_offload.traces import skewed_trace, trace_stats, uniform_trace

LAYERS = (0, 2, 5)
E = 8


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("cache"), layers=LAYERS, num_experts=E)


def check_call(ec: ExpertCache, cache, layer: int, ids, out) -> None:
    """The contract of ensure(): same shape, and every slot holds the expert asked for."""
    ids_t = torch.as_tensor(ids)
    assert tuple(out.shape) == tuple(ids_t.shape)
    slots = ec.slots(layer)
    for e, s in zip(ids_t.reshape(-1).tolist(), out.reshape(-1).tolist()):
        assert 0 <= s < ec.slots_per_pool
        assert expert_matches(cache, layer, e, slots, s), f"slot {s} does not hold expert {e} of layer {layer}"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("make_engine", engine_factories(), ids=lambda f: getattr(f, "name", f.__name__))
def test_remap_points_at_the_asked_experts(cache, policy, shared, make_engine):
    eng = make_engine()
    ordered = getattr(eng, "ordered_bytes", 0) > 0
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=4 * len(LAYERS), policy=policy, shared=shared,
                     stream_ordered=ordered)
    rng = np.random.default_rng(1)
    ptrs = {l: [t.data_ptr() for t in ec.slots(l).values()] for l in LAYERS}
    for step in range(25):
        for layer in LAYERS:
            ids = torch.from_numpy(rng.integers(0, E, size=(2, 2))).to(torch.int32)  # batch 2, top-2
            out = ec.ensure(layer, ids)
            assert out.dtype == torch.int32
            check_call(ec, cache, layer, ids, out)
    assert {l: [t.data_ptr() for t in ec.slots(l).values()] for l in LAYERS} == ptrs
    assert (ec.metrics["ordered_fills"] > 0) == ordered  # the ordered engine took its own path
    eng.close()


def test_capacity_and_no_eviction_of_needed(cache):
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=3 * len(LAYERS), policy="lru")
    assert ec.slots_per_pool == 3
    assert all(t.shape[0] == 3 for t in ec.slots(0).values())
    assert ec.capacity_bytes == 3 * len(LAYERS) * sum(s.nbytes for s in cache.expert_specs)
    rng = random.Random(0)
    for _ in range(200):
        layer = rng.choice(LAYERS)
        ids = rng.sample(range(E), rng.randint(1, 3))  # up to a full pool in one call
        out = ec.ensure(layer, ids)
        assert len(set(out.tolist())) == len(ids)  # distinct experts, distinct slots
        check_call(ec, cache, layer, ids, out)
        res = ec.resident(layer)
        assert len(res) <= 3 and all(res[e] == s for e, s in zip(ids, out.tolist()))
    with pytest.raises(UnsupportedError, match="routes 4 distinct experts .* 3 slots"):
        ec.ensure(0, [0, 1, 2, 3])


def test_capacity_in_bytes(cache):
    nbytes = sum(s.nbytes for s in cache.expert_specs)
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_bytes=7 * nbytes * len(LAYERS) + nbytes - 1)
    assert ec.slots_per_pool == 7
    with pytest.raises(UnsupportedError, match="fewer than one per pool"):
        ExpertCache(cache, SyncEngine(), "cpu", capacity_bytes=nbytes)
    shared = ExpertCache(cache, SyncEngine(), "cpu", capacity_bytes=nbytes * 5, shared=True)
    assert shared.slots_per_pool == 5


@pytest.mark.parametrize("policy", POLICIES)
def test_counters_add_up(cache, policy):
    eng = SyncEngine()
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=4 * len(LAYERS), policy=policy)
    tr = skewed_trace(40, len(LAYERS), E, top_k=2, batch=2, seed=3)
    distinct = 0
    for t in range(tr.shape[0]):
        for li, layer in enumerate(LAYERS):
            ec.ensure(layer, tr[t, li])
            distinct += len(np.unique(tr[t, li]))
    m = ec.metrics
    nb = ec.expert_nbytes
    assert m["calls"] == 40 * len(LAYERS)
    assert m["hits"] + m["misses"] == distinct
    assert m["routed_bytes"] == distinct * nb
    assert m["miss_bytes"] == m["misses"] * nb == m["bytes_moved"] == eng.bytes  # no hints: only misses move
    assert m["evictions"] == m["misses"] - 4 * len(LAYERS)  # every miss after the pools filled evicts one
    s = ec.summary()
    assert s["hit_rate"] == m["hits"] / distinct and s["moved_over_needed"] == 1.0


def test_hints_fetch_ahead_and_bytes_stay_within_bar(cache):
    """Hints for the next layer from the previous step's routing: moved bytes <= 1.25x the routed
    experts that had to be fetched, hinted experts arrive intact, counters stay consistent."""
    eng = DeferredEngine(seed=5)
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=4 * len(LAYERS), policy="lfu-decay")
    tr = skewed_trace(80, len(LAYERS), E, top_k=2, batch=1, sticky_p=0.3, seed=4)
    rng = np.random.default_rng(0)
    for t in range(tr.shape[0]):
        for li, layer in enumerate(LAYERS):
            out = ec.ensure(layer, tr[t, li])
            check_call(ec, cache, layer, tr[t, li], out)
            if li + 1 < len(LAYERS):  # a predictor: the next layer's true experts plus a wrong guess
                guess = np.concatenate([tr[t, li + 1].ravel(), rng.integers(0, E, 2)])
                ec.prefetch_hint(LAYERS[li + 1], guess)
    ec.sync()
    s = ec.summary()
    assert s["hint_fetches"] > 0 and s["hint_used"] > 0
    assert s["hint_used"] + s["hint_wasted"] <= s["hint_fetches"]
    assert s["bytes_moved"] == (s["misses"] + s["hint_fetches"]) * ec.expert_nbytes
    assert s["moved_over_needed"] <= 1.25, s


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("shared", [False, True])
def test_random_interleavings_with_late_copies(cache, seed, shared):
    """ensure / prefetch_hint in random order against an engine that poisons at submit and copies
    late: every ensure hands out intact experts, and they stay intact until the pool's next call."""
    rng = random.Random(seed)
    reals = real_engines()
    eng = DeferredEngine(inner=reals[0]() if reals and seed % 2 else None, seed=seed)
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=3 * len(LAYERS), shared=shared,
                     policy=rng.choice(POLICIES), half_life_steps=rng.choice([1, 8, 64]))
    live = None
    for _ in range(120):
        layer = rng.choice(LAYERS)
        ids = [rng.randrange(E) for _ in range(rng.randint(1, 3))]
        if rng.random() < 0.35:
            ec.prefetch_hint(layer, ids)
            if live and (shared or live[0] == layer):
                check_call(ec, cache, *live)  # hints never touch the slots of the latest ensure
        else:
            out = ec.ensure(layer, ids)
            check_call(ec, cache, layer, ids, out)
            live = (layer, ids, out)
    ec.sync()
    eng.close()


@pytest.mark.parametrize("shared", [False, True])
def test_lfu_decay_beats_lru_on_a_skewed_trace(tmp_path, shared):
    """The claim of the benchmark, small: on a Zipf + sticky trace with a small cache, lfu-decay
    gets a higher hit rate than LRU (the same trace, the same capacity), per-layer or shared."""
    c = make_cache(tmp_path, layers=(0, 1, 2, 3), num_experts=32, specs=[("w", "uint8", (16,))])
    tr = skewed_trace(300, 4, 32, top_k=2, batch=1, zipf_s=1.0, sticky_p=0.3, seed=0)
    rates = {}
    for policy in ("lru", "lfu-decay"):
        ec = ExpertCache(c, SyncEngine(), "cpu", capacity_experts=4 * 8, policy=policy, shared=shared)
        for t in range(tr.shape[0]):
            for li in range(4):
                ec.ensure(li, tr[t, li])
        rates[policy] = ec.summary()["hit_rate"]
    assert rates["lfu-decay"] > rates["lru"] + 0.02, rates


def test_failed_copy_is_never_served(cache):
    """A read error surfaces as the engine's CacheError; the experts of the failed copy (a miss
    fetch, or a hint) are not left looking resident: the next call fetches them again."""
    eng = FailingEngine(fail={1, 3})
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=4 * len(LAYERS))
    with pytest.raises(CacheError, match="injected"):
        ec.ensure(0, [1, 2])
    assert ec.resident(0) == {}
    check_call(ec, cache, 0, [1, 2], ec.ensure(0, [1, 2]))  # submit 2: refetched, intact
    assert ec.prefetch_hint(0, [3, 4]) == 1  # budget: 0.25 x 4 misses so far; submit 3 fails
    with pytest.raises(CacheError, match="injected"):
        ec.ensure(0, [3, 1])
    assert 3 not in ec.resident(0)
    check_call(ec, cache, 0, [3, 1], ec.ensure(0, [3, 1]))


def test_admit_copies_hot_misses_of_a_call_served_without_the_pool(cache):
    """admit (the vLLM backend's sparse path: more distinct experts than slots, misses copied into a
    layer buffer): the hottest fetched experts whose use beats a slot's holder are copied into the
    pool from the rows (bytes exact, later ensure calls hit them); the slots the call read are
    never taken; a cold expert does not displace a hot one."""
    eng = SyncEngine()
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=2 * len(LAYERS))
    layer = LAYERS[0]
    ec.ensure(layer, [1, 2])
    rows = {s.name: torch.stack([cache.tensor(layer, e, s.name) for e in range(E)]) for s in cache.expert_specs}
    s1 = ec.resident(layer)[1]
    for _ in range(3):  # experts 3 and 4 routed often in calls the pool could not serve
        pairs = ec.admit(layer, [1, 3, 4, 5], rows, fetched=[3, 4, 5], read_slots=[s1])
    assert ec.resident(layer)[1] == s1  # read by the call: kept
    assert len(ec.resident(layer)) == 2 and ec.metrics["admitted"] >= 1
    got = [e for e in ec.resident(layer) if e != 1]
    assert got and got[0] in (3, 4, 5)
    check_call(ec, cache, layer, [1, got[0]], ec.ensure(layer, [1, got[0]]))  # bytes exact, no fetch
    submits = eng.submits
    ec.ensure(layer, [got[0]])
    assert eng.submits == submits  # a hit
    for _ in range(20):  # make both residents hot
        ec.ensure(layer, [1, got[0]])
    assert ec.admit(layer, [6], rows, fetched=[6]) == []  # a cold one does not displace them
    assert 6 not in ec.resident(layer)
    fresh = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=2 * len(LAYERS))
    assert len(fresh.admit(layer, [3, 4], rows, fetched=[3, 4], max_admit=1)) == 1  # the per-call cap
    assert len(fresh.resident(layer)) == 1


def test_bad_ids_and_layers(cache):
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=3 * len(LAYERS))
    with pytest.raises(IndexError):
        ec.ensure(0, [E])
    with pytest.raises(KeyError, match="not an MoE layer"):
        ec.ensure(1, [0])
    with pytest.raises(ValueError):
        ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=3, policy="fifo")
    assert ec.ensure(0, torch.empty(0, 2, dtype=torch.int64)).shape == (0, 2)


def test_expert_map_matches_remap(cache):
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=4 * len(LAYERS))
    out = ec.ensure(2, [[1, 5], [5, 7]])
    emap = ec.expert_map(2)
    assert emap.shape == (E,) and emap.dtype == torch.int32
    assert emap[torch.tensor([[1, 5], [5, 7]])].tolist() == out.tolist()
    assert (emap >= 0).sum().item() == 3


# -- traces ---------------------------------------------------------------------------------------

def test_traces_shape_range_and_skew():
    u = uniform_trace(200, 4, 16, top_k=2, batch=3, seed=0)
    s = skewed_trace(200, 4, 16, top_k=2, batch=3, zipf_s=1.2, sticky_p=0.4, seed=0)
    for tr in (u, s):
        assert tr.shape == (200, 4, 3, 2) and tr.dtype == np.int64
        assert tr.min() >= 0 and tr.max() < 16
        assert (tr[..., 0] != tr[..., 1]).all()  # top-k picks are distinct
    su, ss = trace_stats(u, 16), trace_stats(s, 16)
    assert abs(su["first_choice_repeat"] - 1 / 16) < 0.03
    assert ss["first_choice_repeat"] > 2.5 * su["first_choice_repeat"]
    assert ss["top_expert_share"] > 2 * su["top_expert_share"]
    assert np.array_equal(s, skewed_trace(200, 4, 16, top_k=2, batch=3, zipf_s=1.2, sticky_p=0.4, seed=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine_kind", ["sync", "real", "ordered"])
def test_gpu_expert_cache_exact_under_stream_reuse(tmp_path, engine_kind):
    """CUDA: a kernel on the current stream reads the remapped slots while later calls refill
    other slots; gathered bytes (checked on the GPU, in stream order) equal the cache. "ordered":
    the misses are stream-ordered (no host wait in ensure; hints still on the copy stream)."""
    c = make_cache(tmp_path, layers=(0, 1, 2, 3), num_experts=16,
                   specs=[("w13_weight", "bfloat16", (256, 128)), ("w2_weight", "bfloat16", (128, 128))])
    eng = cuda_engine(engine_kind)
    dev = torch.device("cuda")
    want = {(l, e): {s.name: c.tensor(l, e, s.name).contiguous().view(-1).view(torch.uint8).sum().item()
                     for s in c.expert_specs} for l in c.layers for e in range(16)}
    stream = torch.cuda.Stream(dev)
    tr = skewed_trace(30, 4, 16, top_k=2, batch=2, seed=0)
    got = []
    with torch.cuda.stream(stream):
        for shared in (False, True):
            ec = ExpertCache(c, eng, dev, capacity_experts=16 if shared else 4 * 4, shared=shared,
                             stream_ordered=engine_kind == "ordered")
            for t in range(tr.shape[0]):
                for li, layer in enumerate(c.layers):
                    ids = torch.from_numpy(tr[t, li]).to(dev)
                    out = ec.ensure(layer, ids)
                    x = torch.randn(1024, 1024, device=dev)
                    x = x @ x  # keep the stream busy so refills would race a careless cache
                    slots = ec.slots(layer)
                    for e, s in zip(tr[t, li].reshape(-1).tolist(), out.reshape(-1).tolist()):
                        sums = {n: v[s].view(-1).view(torch.uint8).sum() for n, v in slots.items()}
                        got.append(((layer, e), sums))
                    if li + 1 < 4:
                        ec.prefetch_hint(c.layers[li + 1], tr[t - 1, li + 1] if t else [])
            ec.sync()
            if engine_kind == "ordered":
                assert ec.metrics["ordered_fills"] > 0
        torch.cuda.synchronize()
    for key, sums in got:
        assert {n: v.item() for n, v in sums.items()} == want[key]
    eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine_kind", ["real", "ordered"])
def test_gpu_admit_between_ensures_keeps_every_slot_exact(tmp_path, engine_kind):
    """CUDA: sparse-style calls (rows of a device layer buffer admitted into the pool, on the
    current stream) between ensure calls whose refills run on the copy stream, the stream kept
    busy: every slot a later call hands out holds its expert (checked in stream order)."""
    c = make_cache(tmp_path, layers=(0, 1), num_experts=16,
                   specs=[("w13_weight", "bfloat16", (256, 128)), ("w2_weight", "bfloat16", (128, 128))])
    eng = cuda_engine(engine_kind)
    dev = torch.device("cuda")
    want = {(l, e): {s.name: c.tensor(l, e, s.name).contiguous().view(-1).view(torch.uint8).sum().item()
                     for s in c.expert_specs} for l in c.layers for e in range(16)}
    rows = {l: {s.name: torch.stack([c.tensor(l, e, s.name) for e in range(16)]).to(dev) for s in c.expert_specs}
            for l in c.layers}
    tr = skewed_trace(40, 2, 16, top_k=2, batch=4, seed=3)
    stream = torch.cuda.Stream(dev)
    got = []
    with torch.cuda.stream(stream):
        ec = ExpertCache(c, eng, dev, capacity_experts=4 * 2, stream_ordered=engine_kind == "ordered")
        for t in range(tr.shape[0]):
            for li, layer in enumerate(c.layers):
                ids = np.unique(tr[t, li])
                x = torch.randn(1024, 1024, device=dev)
                x = x @ x  # keep the stream busy
                if len(ids) > 4 or t % 3 == 2:  # served from the rows: admit the hot ones
                    ec.admit(layer, ids, rows[layer], fetched=ids)
                    continue
                out = ec.ensure(layer, torch.from_numpy(ids).to(dev))
                slots = ec.slots(layer)
                for e, s in zip(ids.tolist(), out.reshape(-1).tolist()):
                    got.append(((layer, e), {n: v[s].view(-1).view(torch.uint8).sum() for n, v in slots.items()}))
        ec.sync()
        torch.cuda.synchronize()
    assert ec.metrics["admitted"] > 0 and got
    for key, sums in got:
        assert {n: v.item() for n, v in sums.items()} == want[key]
    eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_ordered_read_fault_is_raised_by_the_check(tmp_path):
    """CUDA, stream-ordered misses: a layer file truncated under its mapping makes the fill of the
    next misses fail (SIGBUS in a fill thread); ensure returns anyway (it does not wait), the gate
    opens, check_ordered raises the CacheError naming the file and forgets those experts; the other
    layer's experts stay exact."""
    import os

    c = make_cache(tmp_path, layers=(0, 1), num_experts=16,
                   specs=[("w13_weight", "bfloat16", (256, 128)), ("w2_weight", "bfloat16", (128, 128))])
    eng = cuda_engine("ordered")
    dev = torch.device("cuda")
    ec = ExpertCache(c, eng, dev, capacity_experts=8 * 2, stream_ordered=True, verify_first_use=False)
    ec.ensure(0, torch.tensor([0, 1], device=dev))
    ec.ensure(1, torch.tensor([0], device=dev))  # maps layer 1's file
    ec.check_ordered()
    os.truncate(c.layer_file(1), 4096)
    out = ec.ensure(1, torch.tensor([5, 6], device=dev))  # returns: the fill fails later
    assert out.shape == (2,)
    with pytest.raises(CacheError, match="SIGBUS"):
        ec.check_ordered()
    assert 5 not in ec.resident(1) and 6 not in ec.resident(1)
    out = ec.ensure(0, torch.tensor([0, 1, 2], device=dev))
    ec.check_ordered()
    torch.cuda.synchronize()
    slots = {n: v.cpu() for n, v in ec.slots(0).items()}
    for e, s in zip([0, 1, 2], out.tolist()):
        assert expert_matches(c, 0, e, slots, s)
    assert ec.metrics["ordered_fills"] >= 4
    eng.close()


def test_verify_first_use_refuses_a_corrupt_layer_before_evicting_anything(tmp_path):
    cache = make_cache(tmp_path, layers=(0, 1), num_experts=4)
    flip_byte(cache.layer_file(1), 3 * cache.record_nbytes + cache.expert_specs[-1].offset)
    from mmap_offload.errors import CorruptCacheError

    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=4, shared=True, verify_first_use=True)
    def resident_right(ids):
        return all(expert_matches(cache, 0, e, ec.slots(0), int(s)) for e, s in zip([0, 1], ids))

    assert resident_right(ec.ensure(0, [0, 1]))
    with pytest.raises(CorruptCacheError, match="layer 1 expert 3"):
        ec.ensure(1, [0, 3])
    hits = ec.metrics["hits"]
    assert resident_right(ec.ensure(0, [0, 1]))  # still resident (hits), still right
    assert ec.metrics["hits"] == hits + 2


def test_verify_first_use_checks_only_the_experts_it_fetches(tmp_path):
    """The first-use check reads the experts being fetched, not the whole layer (a seed-size layer is
    ~680 MiB: checking it whole at a decode step's first miss would stall the first tokens)."""
    cache = make_cache(tmp_path, layers=(0, 1), num_experts=4)
    flip_byte(cache.layer_file(1), 3 * cache.record_nbytes + cache.expert_specs[0].offset)
    from mmap_offload.errors import CorruptCacheError

    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=8, verify_first_use=True)
    ids = ec.ensure(1, [0, 2])  # expert 3 is corrupt but not routed: served
    assert all(expert_matches(cache, 1, e, ec.slots(1), int(s)) for e, s in zip([0, 2], ids))
    assert sorted(cache._checked_experts[1]) == [0, 2] and 1 not in cache._checked
    for _ in range(2):  # and stays refused
        with pytest.raises(CorruptCacheError, match="layer 1 expert 3"):
            ec.ensure(1, [3])


class _OrderedTicket:
    def __init__(self, n: int, fail: bool):
        self.n, self.fail, self.ordered = n, fail, True

    def issued(self) -> bool:
        return True


class OrderedEngine(SyncEngine):
    """A stand-in for the mmap engine's stream-ordered batches as seen on CUDA: ``submit_ordered``
    copies at once (the stream would), and the read error of the numbered ones comes only from
    ``wait`` (the deferred check), after the caller already used the slots."""

    def __init__(self, fail=()):
        super().__init__()
        self.fail, self.ordered_submits = set(fail), 0

    def submit_ordered(self, copies, stream=None):
        self.ordered_submits += 1
        bad = self.ordered_submits in self.fail
        for c in copies:
            for _, _, dst in c.dst:
                dst.data.view(-1).view(torch.uint8).fill_(0x5A)
            if not bad:
                from fakes import _do_copy
                _do_copy(c)
        return _OrderedTicket(self.ordered_submits, bad)

    def wait(self, ticket) -> None:
        if isinstance(ticket, _OrderedTicket):
            if ticket.fail:
                raise CacheError("reading the cache failed: injected (ordered)", "check the cache files")
            return
        super().wait(ticket)


def test_ordered_misses_are_checked_later_and_a_failed_one_is_forgotten(cache):
    """Deferred checking (CUDA's path, forced here): ensure returns without waiting for ordered
    fills; check_ordered raises the failed one's error once, forgets exactly the slots it filled
    (not those of good fills, nor a slot refilled since), and the next ensure fetches them again."""
    eng = OrderedEngine(fail={2})
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=4 * len(LAYERS), stream_ordered=True)
    ec._defer_checks = True  # as on CUDA
    ec.ensure(0, [1, 2])  # ordered submit 1: fine
    ec.ensure(0, [3, 4])  # ordered submit 2: fails, unnoticed so far
    assert ec.metrics["ordered_fills"] == 2 and len(ec._unchecked) == 2
    assert set(ec.resident(0)) == {1, 2, 3, 4}
    with pytest.raises(CacheError, match="injected"):
        ec.check_ordered()
    assert set(ec.resident(0)) == {1, 2}  # 3 and 4 forgotten, 1 and 2 kept
    ec.check_ordered()  # raised once; nothing left to check
    ec._defer_checks = False
    check_call(ec, cache, 0, [3, 4, 1], ec.ensure(0, [3, 4, 1]))  # refetched (submit 3), intact
    ec.sync()


def test_ordered_admit_from_failed_rows_is_forgotten(cache):
    """admit of rows filled by a stream-ordered batch not yet checked: if that batch failed, the
    slots admitted from its rows are forgotten at the check (their bytes came from stale rows)."""
    eng = OrderedEngine()
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=2 * len(LAYERS), stream_ordered=True)
    rows = {s.name: torch.stack([cache.tensor(0, e, s.name) for e in range(E)]) for s in cache.expert_specs}
    bad = _OrderedTicket(99, fail=True)
    for _ in range(3):  # hot enough to be admitted
        pairs = ec.admit(0, [5, 6, 7], rows, fetched=[5, 6, 7], ordered_ticket=bad)
        if pairs:
            break
    assert pairs and all(ec.resident(0).get(e) == s for e, s in pairs)
    with pytest.raises(CacheError, match="injected"):
        ec.check_ordered()
    assert not any(e in ec.resident(0) for e, _ in pairs)


def test_ordered_fills_follow_the_engine_remapping_its_files(cache):
    """The ordered fast path keeps each expert's address in the engine's mapping; after the engine
    dropped its mappings (unmap_all: a new map generation) it asks again, so the bytes stay right."""
    reals = [f for f in real_engines() if getattr(f, "name", "") == "real-mmap-ordered"]
    if not reals:
        pytest.skip("the native pool is unavailable")
    eng = reals[0]()
    ec = ExpertCache(cache, eng, "cpu", capacity_experts=2 * len(LAYERS), stream_ordered=True)
    try:
        for i in range(8):
            ids = [(2 * i) % E, (2 * i + 1) % E]
            check_call(ec, cache, LAYERS[i % 2], ids, ec.ensure(LAYERS[i % 2], ids))
            if i == 3:
                gen = eng.map_generation
                eng.unmap_all()
                assert eng.map_generation == gen + 1
        assert ec.metrics["ordered_fills"] == 8 and eng.metrics["ordered_batches"] == 8
    finally:
        eng.close()


def test_submit_rows_ordered_fills_exactly_the_routed_rows(cache):
    """The sparse path's ordered copy (numpy-planned): the routed experts' rows of a layer buffer
    hold their cache bytes, every other row is untouched; a pool without stream_ordered declines."""
    reals = [f for f in real_engines() if getattr(f, "name", "") == "real-mmap-ordered"]
    if not reals:
        pytest.skip("the native pool is unavailable")
    eng = reals[0]()
    try:
        ec = ExpertCache(cache, eng, "cpu", capacity_experts=2 * len(LAYERS), stream_ordered=True)
        rows = {s.name: torch.full((E, *s.shape), 7, dtype=s.torch_dtype) for s in cache.expert_specs}
        before = {n: v.clone() for n, v in rows.items()}
        routed = [6, 1, 3]
        t = ec.submit_rows_ordered(LAYERS[1], routed, rows)
        assert t is not None and t.ordered
        eng.wait(t)
        for e in range(E):
            if e in routed:
                assert expert_matches(cache, LAYERS[1], e, rows, e)
            else:
                assert all(torch.equal(rows[n][e], before[n][e]) for n in rows)
        plain = ExpertCache(cache, eng, "cpu", capacity_experts=2 * len(LAYERS))
        assert plain.submit_rows_ordered(LAYERS[1], routed, rows) is None
    finally:
        eng.close()
