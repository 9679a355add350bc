"""LayerPrefetcher: bytes in the slot buffers equal the cache, buffers are never handed out stale
or overwritten while in use, addresses never change, parameter mode aliases the buffers."""

from __future__ import annotations

import random

import pytest
import torch

from fakes import (DeferredEngine, cuda_engine, FailingEngine, SyncEngine, as_bytes, engine_factories, flip_byte,
                   layer_matches, make_cache, real_engines)
from mmap_offload.errors import CacheError
from mmap_offload.prefetch import LayerPrefetcher, assign_buffers

LAYERS = (0, 1, 3, 4, 7)  # not contiguous on purpose


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return make_cache(tmp_path_factory.mktemp("cache"), layers=LAYERS, num_experts=5)


def _ptrs(pf: LayerPrefetcher) -> list[int]:
    return [t.data_ptr() for b in pf._buffers for t in b.tensors.values()]


@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("make_engine", engine_factories(), ids=lambda f: getattr(f, "name", f.__name__))
def test_schedule_hands_out_cache_bytes(cache, lookahead, make_engine):
    eng = make_engine()
    try:
        _run_schedule(cache, lookahead, eng)
    finally:
        eng.close()


def _run_schedule(cache, lookahead, eng):
    pf = LayerPrefetcher(cache, eng, "cpu", lookahead=lookahead)
    ptrs = _ptrs(pf)
    for l in cache.layers[:lookahead]:
        pf.start_prefetch(l)
    for _ in range(2):  # two forward passes: wrap-around included
        for l in cache.layers:
            w = pf.wait_for_layer(l)
            assert set(w) == {s.name for s in cache.expert_specs}
            assert all(t.shape[0] == cache.num_experts for t in w.values())
            if lookahead:
                pf.start_prefetch(pf.layer_after(l))
            assert layer_matches(cache, l, w)
    assert _ptrs(pf) == ptrs  # fixed addresses
    m = pf.metrics
    # with lookahead >= 1 every wait was prefetched: no demand loads after the pipeline filled
    assert m["demand_loads"] == (2 * len(LAYERS) if lookahead == 0 else 0)
    assert m["bytes_moved"] == m["loads"] * pf.layer_nbytes
    if isinstance(eng, SyncEngine):
        assert eng.bytes == m["bytes_moved"]


def test_all_layers_resident_loads_once(cache):
    pf = LayerPrefetcher(cache, SyncEngine(), "cpu", lookahead=1, num_buffers=len(LAYERS) + 3)
    assert pf.num_buffers == len(LAYERS)  # never more buffers than layers
    assert LayerPrefetcher(cache, SyncEngine(), "cpu", lookahead=3, num_buffers=2).lookahead == 1
    for _ in range(3):
        for l in cache.layers:
            pf.start_prefetch(pf.layer_after(l))
            assert layer_matches(cache, l, pf.wait_for_layer(l))
    assert pf.metrics["loads"] == len(LAYERS)


def test_assign_buffers_keeps_cyclic_windows_distinct():
    for num_layers in range(1, 40):
        for nb in range(1, 7):
            for window in range(1, nb + 1):
                _check_assignment(num_layers, nb, window)


def _check_assignment(num_layers, nb, window):
    idx, used = assign_buffers(num_layers, nb, window)
    assert len(idx) == num_layers and used == max(idx) + 1
    w = min(window, num_layers)
    for p in range(num_layers):
        assert len({idx[(p + j) % num_layers] for j in range(w)}) == w
    if nb >= num_layers:
        assert used == num_layers
    elif any(q * w <= num_layers <= q * nb for q in range(1, num_layers + 1)):
        assert used <= nb  # never more than asked when a split exists
    else:  # the least count that works
        assert used == -(-num_layers // (num_layers // w))


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("num_buffers", [1, 2, 3])
@pytest.mark.parametrize("inner", ["sync", "real"])
def test_random_interleavings_never_stale(cache, seed, num_buffers, inner):
    """Random start/wait across layers with an engine that poisons at submit and copies late
    (doing the copies with the stand-in or with the real mmap engine): what wait_for_layer returns
    equals the cache, and stays so until its buffer is released."""
    rng = random.Random(seed)
    reals = real_engines()
    if inner == "real" and not reals:
        pytest.skip("transfer.make_engine not available")
    eng = DeferredEngine(inner=reals[0]() if inner == "real" else None, seed=seed)
    pf = LayerPrefetcher(cache, eng, "cpu", lookahead=1, num_buffers=num_buffers)
    live: dict[int, tuple[int, dict]] = {}  # buffer index -> (layer handed out, tensors)
    for _ in range(60):
        l = rng.choice(cache.layers)
        b = pf.buffer_index(l)
        if rng.random() < 0.5:
            pf.start_prefetch(l)
            if b in live and live[b][0] != l:
                del live[b]  # released by the rule: starting another layer on its buffer
        else:
            w = pf.wait_for_layer(l)
            assert layer_matches(cache, l, w), f"stale buffer for layer {l}"
            live[b] = (l, w)
        for held_layer, w in live.values():  # a consumer still reading: never overwritten early
            assert layer_matches(cache, held_layer, w)
    pf.sync()
    eng.close()


def test_parameter_mode_aliases_module_params(cache):
    pf = LayerPrefetcher(cache, SyncEngine(), "cpu", lookahead=1, as_parameters=True)
    mods = []
    for l in cache.layers:
        m = torch.nn.Module()
        spec = cache.expert_specs[0]
        m.w13_weight = torch.nn.Parameter(
            torch.zeros((cache.num_experts, *spec.shape), dtype=spec.torch_dtype), requires_grad=False
        )
        before = m.w13_weight
        pf.attach(l, m)
        assert m.w13_weight is before  # vLLM keeps references to its Parameters
        assert all(isinstance(getattr(m, s.name), torch.nn.Parameter) for s in cache.expert_specs)
        mods.append(m)
    pf.start_prefetch(cache.layers[0])
    for l, m in zip(cache.layers, mods):
        pf.wait_for_layer(l)
        pf.start_prefetch(pf.layer_after(l))
        got = {s.name: getattr(m, s.name) for s in cache.expert_specs}
        assert layer_matches(cache, l, got)
        assert got["w13_weight"].data_ptr() == pf.buffer_tensors(l)["w13_weight"].data_ptr()


def test_failed_copy_is_never_handed_out(cache):
    """A read error surfaces from wait_for_layer; the buffer is not reused as if loaded: the next
    wait reloads the layer."""
    pf = LayerPrefetcher(cache, FailingEngine(fail={2}), "cpu", lookahead=1)
    l0, l1 = cache.layers[:2]
    pf.start_prefetch(l0)
    assert layer_matches(cache, l0, pf.wait_for_layer(l0))
    pf.start_prefetch(l1)  # submit 2 fails
    with pytest.raises(CacheError, match="injected"):
        pf.wait_for_layer(l1)
    assert layer_matches(cache, l1, pf.wait_for_layer(l1))
    assert pf.metrics["demand_loads"] == 1


def test_attach_shape_mismatch_is_a_clear_error(cache):
    pf = LayerPrefetcher(cache, SyncEngine(), "cpu")
    m = torch.nn.Module()
    m.w2_weight = torch.nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    with pytest.raises(CacheError, match="w2_weight .* rebuild the cache"):
        pf.attach(cache.layers[0], m)


def test_unknown_layer(cache):
    pf = LayerPrefetcher(cache, SyncEngine(), "cpu")
    with pytest.raises(KeyError, match="not an MoE layer"):
        pf.wait_for_layer(2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("engine_kind", ["sync", "real"])
def test_gpu_prefetch_overlaps_compute_and_stays_exact(tmp_path, engine_kind):
    """CUDA: compute on a side stream reads buffer i while layer i+1 copies; every buffer read on
    the GPU equals the cache bytes, and nothing is overwritten while a kernel still reads it."""
    cache = make_cache(tmp_path, layers=tuple(range(6)), num_experts=8,
                       specs=[("w13_weight", "bfloat16", (512, 256)), ("w2_weight", "bfloat16", (256, 256)),
                              ("w13_weight_scale", "float32", (3, 5))])
    eng = cuda_engine(engine_kind)
    dev = torch.device("cuda")
    compute = torch.cuda.Stream(dev)
    pf = LayerPrefetcher(cache, eng, dev, lookahead=2, as_parameters=True)
    want = {l: {s.name: as_bytes(cache.tensor(l, 0, s.name)).sum().item() for s in cache.expert_specs}
            for l in cache.layers}
    with torch.cuda.stream(compute):
        for l in cache.layers[:2]:
            pf.start_prefetch(l)
        sums = []
        for _ in range(2):
            for l in cache.layers:
                w = pf.wait_for_layer(l)
                pf.start_prefetch(pf.layer_after(l))
                # a slow kernel reading the buffer, then a checksum of expert 0, both on `compute`
                x = torch.randn(2048, 2048, device=dev)
                for _ in range(4):
                    x = x @ x.tanh()
                sums.append((l, {n: t[0].view(-1).view(torch.uint8).sum() for n, t in w.items()}))
        torch.cuda.synchronize()
    for l, s in sums:
        assert {n: v.item() for n, v in s.items()} == want[l]
    eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_claim_makes_the_release_event_only_when_asked(tmp_path):
    """CUDA: claiming a buffer that was handed out returns the release event a copy from another
    stream must wait for; ``event=False`` (the caller copies on the current stream) makes none. Either
    way the buffer holds no layer afterwards: the next wait reloads the cache's bytes."""
    cache = make_cache(tmp_path, layers=(0, 1), num_experts=3)
    eng = cuda_engine("sync")
    pf = LayerPrefetcher(cache, eng, torch.device("cuda"), lookahead=0, num_buffers=2)
    try:
        for event in (True, False):
            pf.wait_for_layer(0)  # handed out
            tensors, after = pf.claim(0, event=event)
            assert isinstance(after, torch.cuda.Event) if event else after is None
            for t in tensors.values():
                t.data.zero_()  # the claimer's bytes
            assert layer_matches(cache, 0, pf.wait_for_layer(0))  # reloaded, not the claimer's zeros
    finally:
        eng.close()


def test_verify_first_use_never_serves_a_flipped_bit(tmp_path):
    from mmap_offload.errors import CorruptCacheError

    cache = make_cache(tmp_path, layers=(0, 1), num_experts=4)
    flip_byte(cache.layer_file(1), 2 * cache.record_nbytes + cache.expert_specs[0].offset)
    eng = SyncEngine()
    pf = LayerPrefetcher(cache, eng, "cpu", lookahead=0, verify_first_use=True)
    assert layer_matches(cache, 0, pf.wait_for_layer(0))
    with pytest.raises(CorruptCacheError, match="layer 1 expert 2"):
        pf.wait_for_layer(1)
    unchecked = LayerPrefetcher(cache, SyncEngine(), "cpu", lookahead=0, verify_first_use=False)  # opted out
    unchecked.wait_for_layer(1)
