"""Hybrid calls on the stream (``AsyncStep.run_hybrid``, csrc/async_step.c): a sparse call whose misses
that are not admitted into the pool are partly computed on the host (the native W4A16 kernel, started
from the stream's callback) while the others are copied into the layer buffer.

- Outputs: the MoE kernel's part (the returned weights and ids over the layer buffer, computed here by
  the independent Marlin reference of tests/marlin_reference.py) plus ``collect``'s host rows equals
  every pair computed by the reference from the cache, within test_hybrid's tolerance (bf16 rounding
  of fp32 sums taken in another order).
- Decisions: the pool admits exactly what a plain sparse call admits (bit for bit, against a twin
  cache): what goes to the host is chosen among the misses not admitted.
- Bytes: every routed expert that is not the host's is in its row; the host's rows are not written;
  the returned weights are 0 exactly at the host's pairs, whose ids point at a filled row.
- A call whose collect never comes (its step failed) does not block the next one or ``wait()``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmap_offload.async_step import AsyncStep
from mmap_offload.expert_cache import ExpertCache
from mmap_offload.expert_step import ExpertStep
from mmap_offload.host.cost import EXPERT_TENSORS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakes import expert_matches  # noqa: E402
from test_expert_step import _ordered_engine, _same, _state  # noqa: E402
from test_hybrid import TOL, make_marlin_cache, ref_expert  # noqa: E402

H, INTER, GROUP, E, LAYERS, K = 256, 128, 64, 12, (0, 1), 4
SLOTS = 3  # per layer: every call below has more ids than slots (the sparse form)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    c = make_marlin_cache(tmp_path_factory.mktemp("hy"), hidden=H, inter=INTER, group=GROUP, experts=E, layers=LAYERS)
    for layer in LAYERS:
        c.check_experts_once(layer, list(range(E)))
    return c


@pytest.fixture(scope="module")
def kernel():
    from mmap_offload.host.kernel import HostKernel

    k = HostKernel(threads=3)
    yield k
    k.close()


def _geometry(cache):
    from mmap_offload.host.kernel import _geometry

    w13, s13, w2, s2 = (cache.tensor(LAYERS[0], 0, n) for n in EXPERT_TENSORS)
    return _geometry(w13, s13, w2, s2, GROUP, H, "test")


def _sources(cache) -> dict[int, np.ndarray]:
    return {l: np.array([[cache.tensor(l, e, n).data_ptr() for n in EXPERT_TENSORS] for e in range(E)], dtype=np.uint64)
            for l in LAYERS}


def _calls(steps: int, n: int, seed: int):
    """Per step and layer: ids [n, K] (distinct per token, skewed), weights f32 [n, K], x bf16 [n, H]."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.1
    p /= p.sum()
    out = []
    for _ in range(steps):
        row = []
        for _ in LAYERS:
            ids = np.stack([rng.choice(E, size=K, replace=False, p=p) for _ in range(n)])
            w = rng.random((n, K)).astype(np.float32)
            x = torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32)).to(torch.bfloat16)
            row.append((torch.from_numpy(ids), torch.from_numpy(w / w.sum(1, keepdims=True)), x))
        out.append(row)
    return out


def _buffer(cache):
    return _buffer_of(cache, E)


def _buffer_of(cache, n: int):
    return {s.name: torch.zeros((n, *s.shape), dtype=s.torch_dtype) for s in cache.expert_specs}


def _mlp(x, t: dict, e: int):
    return ref_expert(x, t["w13_weight_packed"][e], t["w13_weight_scale"][e], t["w2_weight_packed"][e],
                      t["w2_weight_scale"][e], GROUP)


def _moe(x, ids, w, tensors) -> torch.Tensor:
    """sum over pairs of w * expert(x) over ``tensors`` ({name: [E, ...]}), fp32."""
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            if float(w[t, c]) != 0.0:
                out[t] += float(w[t, c]) * _mlp(x[t: t + 1], tensors, int(ids[t, c]))[0]
    return out


def _cache_tensors(cache, layer):
    return {n: torch.stack([cache.tensor(layer, e, n) for e in range(E)]) for n in EXPERT_TENSORS}


def _route_exact(res, t, ids, w, x, bufs, ref) -> torch.Tensor:
    """One layer call through the vLLM backend's wiring (Residency.route, the kernel's part over the
    tensors the route bound to the layer, add_host; the layer buffer ``bufs`` zeroed first): its output,
    asserted equal to every pair computed from the cache's tensors ``ref`` within test_hybrid's tolerance."""
    for b in bufs.values():
        b.zero_()
    wk, ik = res.route(t, w, ids, x)
    bound = {n: getattr(t.experts, n).data for n in t.served}  # what the kernel reads, as the route bound it
    out = res.add_host(t, _moe(x, ik, wk, bound).to(torch.bfloat16))
    want = _moe(x, ids, w, ref)
    assert (out.float() - want).abs().max().item() <= TOL * want.abs().max().item()
    return out


def _single(cache):
    """One cache (no twin) and its async step: (engine, cache, step)."""
    ea, es, ac, _ = _pair(cache)
    es.close()
    return ea, ac, AsyncStep.create(ExpertStep.create(ac), max_experts=3)


def _pair(cache):
    ea, es = _ordered_engine(), _ordered_engine()
    kw = dict(capacity_experts=SLOTS * len(LAYERS), stream_ordered=True)
    return ea, es, ExpertCache(cache, ea, "cpu", **kw), ExpertCache(cache, es, "cpu", **kw)


# parts -1: every call enqueued as a plain sparse call's 4 parts (12 ids, 3 misses per staging load),
# the share alone decides the host's misses; parts 0 (the default): 2 parts, the fewest that hold the
# call's admissions (max_admit 4), the misses beyond their 6 copies go to the host whatever the share
@pytest.mark.parametrize("share,parts", [(0.0, -1), (0.5, -1), (1.0, -1), (0.0, 0), (0.5, 0)])
def test_hybrid_call_equals_every_pair_on_the_gpu_and_admits_as_a_plain_sparse_call(cache, kernel, share, parts):
    ea, es, ac, sc = _pair(cache)
    a = AsyncStep.create(ExpertStep.create(ac), max_experts=3)
    p = AsyncStep.create(ExpertStep.create(sc), max_experts=3)
    assert isinstance(a, AsyncStep) and isinstance(p, AsyncStep)
    try:
        a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.bfloat16, share=share, adapt=False)
        assert a.hybrid_parts == 0
        a.hybrid_parts = parts
        assert a.hybrid_parts == parts
        copies = 3 * (4 if parts == -1 else 2)  # what the call's parts can copy
        src = _sources(cache)
        refs = {l: _cache_tensors(cache, l) for l in LAYERS}
        host_pairs = forced = 0
        for step in _calls(6, 3, seed=1):
            for li, layer in enumerate(LAYERS):
                ids, w, x = step[li]
                buf, twin = _buffer(cache), _buffer(cache)
                resident = {e for e in range(E) if ac._lut[ac._li(layer), e] >= 0}  # before the call
                got = a.run_hybrid(layer, ids, buf, w, x, src[layer])
                assert got is not None
                wk, ik = got
                assert p.run_sparse(layer, ids, twin)
                mask = wk == 0
                host = set(ids[mask].tolist())
                host_pairs += int(mask.sum())
                misses = set(ids.flatten().tolist()) - resident
                assert len(misses - host) <= copies  # never more copies than the parts hold
                if share == 0.0:  # the host gets exactly what the parts cannot copy
                    assert len(host) == max(0, len(misses) - copies)
                forced += max(0, len(misses) - copies)
                # weights kept, or 0 exactly at the host's pairs (all of an expert's pairs), whose ids
                # point at a routed expert the call filled
                assert torch.equal(wk[~mask], w[~mask]) and torch.equal(ik[~mask], ids[~mask])
                assert not (set(ids[~mask].tolist()) & host)
                filled = set(ids.flatten().tolist()) - host
                assert set(ik[mask].tolist()) <= filled
                for e in range(E):
                    if e in filled:
                        assert expert_matches(cache, layer, e, buf, e) and expert_matches(cache, layer, e, twin, e)
                    elif e in host:
                        assert all(int(v[e].count_nonzero()) == 0 for v in buf.values())
                out = _moe(x, ik, wk, buf).to(torch.bfloat16)
                a.collect(out)
                want = _moe(x, ids, w, refs[layer])
                err = (out.float() - want).abs().max().item()
                assert err <= TOL * want.abs().max().item(), (share, err)
            a.wait()
            p.wait()
            _same(_state(ac), _state(sc))  # the host's share changes no admission
        s = a.summary()
        assert s["hybrid_calls"] == 6 * len(LAYERS)
        assert s["sparse_parts"] == 6 * len(LAYERS) * copies // 3  # every call's parts, none more
        if share > 0:
            assert s["host_experts"] > 0 and s["host_rows"] == host_pairs
        else:
            assert s["host_experts"] == forced and (forced > 0) == (parts == 0)  # these calls do overflow 2 parts
    finally:
        a.close()
        p.close()
        ea.close()
        es.close()


def test_hybrid_keeps_one_expert_on_the_device_and_survives_a_missing_collect(cache, kernel):
    """share 1 with an empty pool: every miss but one goes to the host (the host's pairs need a filled
    row); a call whose collect never came is waited for by the next call and by wait()."""
    ea, ac, a = _single(cache)
    try:
        a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.bfloat16, share=1.0, adapt=False)
        src = _sources(cache)
        ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
        w = torch.full((2, K), 0.25)
        x = torch.randn(2, H).to(torch.bfloat16)
        wk, ik = a.run_hybrid(LAYERS[0], ids, _buffer(cache), w, x, src[LAYERS[0]], max_admit=0)
        assert int((wk != 0).sum()) == 1  # one pair stays on the device: its expert's row is the dummy
        # no collect: the next call and wait() end the orphaned host job
        got = a.run_hybrid(LAYERS[1], ids, _buffer(cache), w, x, src[LAYERS[1]], max_admit=0)
        assert got is not None
        a.wait()
        assert a.summary()["host_calls"] == 2
        e0 = a.summary()["enqueue_s"]  # the caller's time in the C enqueues: both runs so far
        out = torch.zeros(2, H, dtype=torch.bfloat16)
        a.collect(out)  # the second call's rows
        assert out.abs().sum() > 0
        assert 0 < e0 < a.summary()["enqueue_s"]  # the collect's enqueue counts too
        a.wait()
    finally:
        a.close()
        ea.close()


def test_hybrid_share_adapts_to_which_side_finishes_first(cache, kernel):
    """Each collect moves the share by 1/32: up where the host job was done before it (the host could
    take more) or where the call gave the host none of the misses it could have taken, down where
    the collect waited for the job."""
    ea, ac, a = _single(cache)
    try:
        a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.bfloat16, share=0.3, adapt=True)
        src = _sources(cache)
        moves = set()
        for step in _calls(6, 3, seed=3):
            for li, layer in enumerate(LAYERS):
                ids, w, x = step[li]
                before, s0 = a.host_share, a.summary()
                a.run_hybrid(layer, ids, _buffer(cache), w, x, src[layer])
                a.collect(torch.zeros(3, H, dtype=torch.bfloat16))
                a.wait()
                s1 = a.summary()
                jobs, ready = s1["host_calls"] - s0["host_calls"], s1["host_ready"] - s0["host_ready"]
                delta = round((a.host_share - before) * 32)
                if jobs:
                    assert delta == (1 if ready else -1) or (delta == 0 and before in (0.0, 1.0))
                    moves.add("ready" if ready else "waited")
                else:
                    assert delta in (0, 1)  # idle (misses the host could have taken) or nothing to take
                    moves.add("idle" if delta else "none")
        assert a.summary()["host_calls"] > 0 and moves & {"ready", "waited"}
    finally:
        a.close()
        ea.close()


def test_hybrid_parts_hold_the_admissions_and_never_fewer(cache, kernel):
    """A call's parts hold at least its admissions (max_admit 5, 3 misses per staging load: 2 parts,
    even when 1 is asked for); max_admit 0 needs 1; -1 is the plain call's ids / 3; n caps at the
    plain count. Every call stays exact (its copied experts in their rows, the host's pairs at 0)."""
    ea, ac, a = _single(cache)
    try:
        a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.bfloat16, share=0.0, adapt=False)
        src = _sources(cache)
        x = torch.randn(3, H).to(torch.bfloat16)
        w = torch.full((3, K), 0.25)
        ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])  # 12 distinct: plain 4 parts
        with pytest.raises(ValueError, match="hybrid_parts"):
            a.hybrid_parts = -2
        for parts, admit, want in ((1, 5, 2), (0, 5, 2), (0, 0, 1), (1, 0, 1), (-1, 0, 4), (9, 0, 4), (3, 0, 3)):
            a.hybrid_parts = parts
            before = a.summary()["sparse_parts"]
            buf = _buffer(cache)
            resident = {e for e in range(E) if ac._lut[ac._li(LAYERS[0]), e] >= 0}
            wk, ik = a.run_hybrid(LAYERS[0], ids, buf, w, x, src[LAYERS[0]], max_admit=admit)
            a.collect(torch.zeros(3, H, dtype=torch.bfloat16))
            a.wait()
            assert a.summary()["sparse_parts"] - before == want, (parts, admit)
            host = set(ids[wk == 0].tolist())
            copied = set(range(12)) - host - resident
            assert len(copied) <= 3 * want and len(host) == max(0, 12 - len(resident) - 3 * want), (parts, admit)
            for e in set(range(12)) - host:
                assert expert_matches(cache, LAYERS[0], e, buf, e)
    finally:
        a.close()
        ea.close()


def test_hybrid_declines_what_it_cannot_take(cache, kernel):
    ea, ac, a = _single(cache)
    try:
        src = _sources(cache)
        ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
        w, x = torch.full((2, K), 0.25), torch.randn(2, H).to(torch.bfloat16)
        assert a.run_hybrid(LAYERS[0], ids, _buffer(cache), w, x, src[LAYERS[0]]) is None  # no set_host
        a.set_host(kernel, _geometry(cache), max_rows=1, dtype=torch.bfloat16)
        assert a.run_hybrid(LAYERS[0], ids, _buffer(cache), w, x, src[LAYERS[0]]) is None  # rows > max_rows
        a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.bfloat16)
        assert a.run_hybrid(LAYERS[0], ids, _buffer(cache), w.double(), x, src[LAYERS[0]]) is None  # weights not f32
        assert a.run_hybrid(LAYERS[0], ids, _buffer(cache), w, x.half(), src[LAYERS[0]]) is None  # other dtype
        with pytest.raises(ValueError, match="bf16 or fp16"):
            a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.float32)
        assert a.metrics["declined"] == 4
    finally:
        a.close()
        ea.close()


def test_hybrid_calls_reuse_their_views_until_a_new_set_host(cache, kernel):
    """run_hybrid keeps what a (buffer, sources, shape) needs from one call to the next (the same
    weight and id views back), and a new set_host (new device buffers) makes them anew: the views
    handed back always lie in the current host set-up's buffer, and collect adds its rows."""
    ea, ac, a = _single(cache)
    try:
        src, buf = _sources(cache), _buffer(cache)
        ids = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
        w, x = torch.full((2, K), 0.25), torch.randn(2, H).to(torch.bfloat16)
        a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.bfloat16, share=1.0, adapt=False)
        got = [a.run_hybrid(LAYERS[0], ids, buf, w, x, src[LAYERS[0]]) for _ in range(2)]
        for g in got:
            a.collect(torch.zeros(2, H, dtype=torch.bfloat16))
        assert got[0][0] is got[1][0] and got[0][1] is got[1][1]
        old_blk = a._host["blk"]
        a.wait()
        a.set_host(kernel, _geometry(cache), max_rows=8, dtype=torch.bfloat16, share=1.0, adapt=False)
        wk, ik = a.run_hybrid(LAYERS[0], ids, buf, w, x, src[LAYERS[0]])
        blk = a._host["blk"]
        assert wk.data_ptr() == blk.data_ptr() and ik.untyped_storage().data_ptr() == blk.untyped_storage().data_ptr()
        out = a.collect(torch.zeros(2, H, dtype=torch.bfloat16))
        a.wait()
        assert torch.equal(out, a._host["out"][:2])  # the host's rows, added to zeros
        assert out.abs().sum() > 0
    finally:
        a.close()
        ea.close()


def _expert_nbytes(tmp_path) -> int:
    """One expert's bytes in the caches these tests make (H, INTER, GROUP)."""
    c = make_marlin_cache(tmp_path, hidden=H, inter=INTER, group=GROUP, experts=1, layers=(0,))
    return sum(s.nbytes for s in c.expert_specs)


def _hybrid_residency(tmp_path, seed: int, experts: int = E, layers: tuple = LAYERS, slots: int = SLOTS,
                      host_threads: int = 2, **options):
    """The vLLM backend's Residency over a Marlin cache (every expert checked) with a stand-in
    offloader, hybrid with ``host_threads`` host threads, ``slots`` slots per layer:
    (res, engine, cache, bufs, targets)."""
    from types import SimpleNamespace

    from mmap_offload.vllm_backend.options import MmapOptions
    from mmap_offload.vllm_backend.residency import Residency

    cache = make_marlin_cache(tmp_path, hidden=H, inter=INTER, group=GROUP, experts=experts, layers=layers, seed=seed)
    for layer in layers:
        cache.check_experts_once(layer, list(range(experts)))
    eng = _ordered_engine()
    bufs = {l: _buffer_of(cache, experts) for l in layers}
    # each target serves the expert tensors of a stand-in module: the residency binds to its parameters'
    # .data the tensors the MoE kernel would read (the pool or the layer buffer), as vLLM's
    names = tuple(s.name for s in cache.expert_specs)
    targets = [SimpleNamespace(layer=l, index=i, served=names,
                               experts=SimpleNamespace(**{n: SimpleNamespace(data=None) for n in names}))
               for i, l in enumerate(layers)]
    opts = MmapOptions(hybrid=True, host_threads=host_threads, layer_stream_fraction=1.0, **options)
    off = SimpleNamespace(options=opts, device=torch.device("cpu"), cache=cache, engine=eng, targets=targets,
                          tp_size=1, _transforms={}, prefetcher=SimpleNamespace(claim=lambda layer, event=True: (bufs[layer], None)))
    nbytes = sum(s.nbytes for s in cache.expert_specs)
    return Residency(off, capacity_bytes=slots * len(layers) * nbytes), eng, cache, bufs, targets


def test_residency_routes_a_sparse_hybrid_call_on_the_stream(tmp_path, monkeypatch):
    """The vLLM backend's wiring (Residency.route -> AsyncStep.run_hybrid, patch 4b's add_host ->
    collect) on the CPU with a stand-in offloader: the returned weights and ids over the layer buffer,
    plus the host's rows, equal every pair from the cache."""
    res, eng, cache, bufs, targets = _hybrid_residency(tmp_path, seed=5)
    try:
        assert res.async_step is not None and res._hy_sources is not None, res.async_off
        assert res.host.kernel.threads == 2  # host_threads=2 in all: the callback thread is one of them
        refs = {l: _cache_tensors(cache, l) for l in LAYERS}
        for step in _calls(12, 3, seed=9):  # the share starts from the calibrated rates and adapts
            for t in targets:
                ids, w, x = step[t.index]
                _route_exact(res, t, ids, w, x, bufs[t.layer], refs[t.layer])
        s = res.summary()
        assert s["hybrid_async_calls"] == 12 * len(LAYERS) and s["async_host_experts"] > 0, s
        assert s["async_hybrid_calls"] == s["hybrid_async_calls"]
        # a call whose ids fit the pool (1 token x 3 ids, 3 slots) takes the async expert step, no host
        host_before, calls_before = s["async_host_calls"], s["async_calls"]
        for step in _calls(3, 1, seed=11):
            for t in targets:
                ids, w, x = step[t.index]
                ids, w = ids[:, :SLOTS], w[:, :SLOTS]
                wk, slots = res.route(t, w, ids, x)
                assert wk is w  # the router's weights, as they are
                out = res.add_host(t, _moe(x, slots, w, res.ec.slots(t.layer)).to(torch.bfloat16))
                want = _moe(x, ids, w, refs[t.layer])
                assert (out.float() - want).abs().max().item() <= TOL * want.abs().max().item()
        s = res.summary()
        assert s["async_calls"] == calls_before + 3 * len(LAYERS) and s["async_host_calls"] == host_before, s
        assert s["host_host_experts"] == 0, s  # the Python hybrid path never ran
    finally:
        res.close()
        eng.close()


def test_hybrid_share_option_holds_the_hosts_share(tmp_path):
    """Option hybrid_share: a value in [0, 1] holds the share of the misses not admitted into the pool
    that the host computes (no adaptation). 1: every such miss goes to the host (but for the one a call
    with no hit keeps copied, its dummy row); 0: only what the call's part cannot copy. Outputs equal
    every pair from the cache either way, and with -1 (adapted from the calibrated start; the default
    until session 32)."""
    got = {}
    for share in (1.0, 0.0, -1.0):
        res, eng, cache, bufs, targets = _hybrid_residency(tmp_path / str(share), seed=5, hybrid_share=share)
        try:
            refs = {l: _cache_tensors(cache, l) for l in LAYERS}
            for step in _calls(10, 3, seed=9):
                for t in targets:
                    ids, w, x = step[t.index]
                    _route_exact(res, t, ids, w, x, bufs[t.layer], refs[t.layer])
            s = res.summary()
            got[share] = s
            assert s["hybrid_async_calls"] == 10 * len(LAYERS), s
            if share >= 0:
                assert s["async_host_share"] == share, s  # held: no adaptation
        finally:
            res.close()
            eng.close()
    one, zero = got[1.0], got[0.0]
    # share 1: each call copies its admissions and at most one more miss (its dummy row when it has no hit)
    assert one["async_host_experts"] + one["async_admitted"] + one["hybrid_async_calls"] >= one["async_sparse_misses"]
    assert one["async_host_experts"] > zero["async_host_experts"], (one, zero)
    assert one["async_sparse_misses"] > one["async_admitted"]  # there were misses the host could take


def test_hybrid_share_option_refuses_values_outside_its_range():
    from mmap_offload.errors import UnsupportedError
    from mmap_offload.vllm_backend.options import MmapOptions

    for bad in (-0.5, 1.5, -2.0):
        with pytest.raises(UnsupportedError) as e:
            MmapOptions(hybrid=True, hybrid_share=bad).check()
        assert "hybrid_share" in str(e.value) and "\n" not in str(e.value)
    for good in (-1.0, 0.0, 0.25, 1.0):
        MmapOptions(hybrid=True, hybrid_share=good).check()


def test_steady_hybrid_calls_take_the_fast_path_with_the_general_paths_decisions(tmp_path, monkeypatch):
    """Residency._fast_hybrid: a layer's hybrid calls after its first one of a shape skip route()'s
    general path. Against a twin whose fast path is off, over the same calls: the same pool decisions
    (slot maps after every step, the same admissions and hits), outputs equal to every pair from the
    cache; a change of shape takes the general path once and the fast one again after; a hint in
    flight (a pending pool) makes the fast path decline to the general one, which waits for it."""
    fast, ef, cache, bf, targets = _hybrid_residency(tmp_path / "f", seed=5)
    monkeypatch.setenv("MMO_FAST_HYBRID", "0")  # the twin takes the general path only
    slow, es, _, bs, ts = _hybrid_residency(tmp_path / "s", seed=5)
    try:
        refs = {l: _cache_tensors(cache, l) for l in LAYERS}
        shapes = [3] * 5 + [2] * 3 + [3] * 4  # tokens per step: a change of shape and back
        calls = [_calls(1, n, seed=20 + i)[0] for i, n in enumerate(shapes)]
        for step in calls:
            for t, u in zip(targets, ts):  # (each residency binds its own targets' parameters)
                ids, w, x = step[t.index]
                for res, bufs, tt in ((fast, bf, t), (slow, bs, u)):
                    _route_exact(res, tt, ids, w, x, bufs[t.layer], refs[t.layer])
                assert np.array_equal(fast.ec.slot_map(t.layer), slow.ec.slot_map(t.layer))
        f, s = fast.summary(), slow.summary()
        n = len(calls) * len(LAYERS)
        assert f["hybrid_async_calls"] == s["hybrid_async_calls"] == n, (f, s)
        # general path: each layer's first call, the first of the 2-token shape, the first back at 3
        assert f["fast_hybrid_calls"] == n - 3 * len(LAYERS) and s["fast_hybrid_calls"] == 0, f
        for k in ("sparse_hits", "sparse_misses", "async_admitted", "pool_evictions"):
            assert f[k] == s[k], (k, f[k], s[k])
        # a call the stream declines at enqueue (a hint in flight): nothing enqueued, the general path serves it
        t = targets[0]
        a, c = fast.async_step, fast._fast[t.index][0]
        ids, w, x = calls[-1][0]
        pool, saved = c.pool, c.pool.pending
        pool.pending = {0: None}  # (only read for truth by run_prepared)
        try:
            declined = a.metrics["declined"]
            assert a.run_prepared(c, ids, w, x) is None and a.metrics["declined"] == declined + 1
        finally:
            pool.pending = saved
        before = fast.metrics["fast_hybrid_calls"]
        real, first = a.run_prepared, [True]

        def once(*args):  # the fast path's call declines; the general path's goes through
            if first.pop() if first else False:
                return None
            return real(*args)

        a.run_prepared = once
        try:
            _route_exact(fast, t, ids, w, x, bf[t.layer], refs[t.layer])
        finally:
            del a.run_prepared
        assert fast.metrics["fast_hybrid_calls"] == before and not first
        assert fast.metrics["hybrid_async_calls"] == n + 1
        # the stream declining every call: the Python paths serve them (the hybrid expert mode where the
        # call's experts fit the pool, else the sparse form over the layer buffer, its hits from the pool)
        a.run_prepared = lambda *args: None
        try:
            m0 = dict(fast.metrics)
            for step in calls[:4]:
                for t in targets:
                    ids, w, x = step[t.index]
                    _route_exact(fast, t, ids, w, x, bf[t.layer], refs[t.layer])
        finally:
            del a.run_prepared
        m = fast.metrics
        assert m["hybrid_async_calls"] == n + 1 and m["sparse_calls"] > m0["sparse_calls"], m
        assert m["sparse_hits"] > m0["sparse_hits"], m  # hits copied from the pool into the buffer
    finally:
        for res, eng in ((fast, ef), (slow, es)):
            res.close()
            eng.close()


@pytest.mark.parametrize("late", [False, True])
def test_check_after_experts_moves_the_end_of_step_check_into_the_last_layers_add_host(tmp_path, late):
    """Option check_after_experts: the end-of-step check (the step's reads and the last layer's host
    job) runs in patch 4b of the last layer, after its kernel and collect are enqueued, instead of in
    that layer's route() before the kernel is launched; still once per step, before the step's output
    leaves the layer, and the outputs are the same. A read error found there raises from add_host; a
    check whose add_host never came (the layer raised) runs at the next route() and raises there."""
    res, eng, cache, bufs, targets = _hybrid_residency(tmp_path, seed=5, check_after_experts=late)
    phase, where = ["-"], []
    check, real_ordered = res._check_step, res.ec.check_ordered

    def recording_check():
        where.append(phase[0])
        check()

    def route(t, call):
        ids, w, x = call
        phase[0] = f"route {t.index}"
        return res.route(t, w, ids, x)

    def add_host(t, call, routed):
        (wk, ik), x = routed, call[2]
        phase[0] = f"add_host {t.index}"
        return res.add_host(t, _moe(x, ik, wk, bufs[t.layer]).to(torch.bfloat16))

    res._check_step = recording_check
    last = targets[-1]
    try:
        assert res.check_late is late
        refs = {l: _cache_tensors(cache, l) for l in LAYERS}
        steps = _calls(7, 3, seed=9)
        for step in steps[:4]:
            for t in targets:
                for b in bufs[t.layer].values():
                    b.zero_()
                out = add_host(t, step[t.index], route(t, step[t.index]))
                ids, w, x = step[t.index]
                want = _moe(x, ids, w, refs[t.layer])
                assert (out.float() - want).abs().max().item() <= TOL * want.abs().max().item()
        assert where == [f"{'add_host' if late else 'route'} {last.index}"] * 4
        assert res.metrics["late_checks"] == (4 if late else 0) and res.metrics["collect_s"] > 0

        def failing():  # the step's reads checked, one found failed
            real_ordered()
            raise RuntimeError("read failed")

        res.ec.check_ordered = failing
        step = steps[4]
        for t in targets[:-1]:
            add_host(t, step[t.index], route(t, step[t.index]))
        if not late:
            with pytest.raises(RuntimeError, match="read failed"):
                route(last, step[last.index])
            return
        routed = route(last, step[last.index])  # no check here
        assert res._check_due
        with pytest.raises(RuntimeError, match="read failed"):
            add_host(last, step[last.index], routed)
        assert not res._check_due
        # the last layer raises before its add_host: the next route() runs the check, failing that step
        step = steps[5]
        for t in targets[:-1]:
            add_host(t, step[t.index], route(t, step[t.index]))
        route(last, step[last.index])
        with pytest.raises(RuntimeError, match="read failed"):
            route(targets[0], steps[6][0])
        assert not res._check_due and where[-2:] == [f"add_host {last.index}", "route 0"]
    finally:
        res.ec.check_ordered = real_ordered
        res.close()
        eng.close()


def test_hybrid_small_calls_send_misses_of_calls_that_fit_the_pool_to_the_host(tmp_path):
    """Option hybrid_small_calls: a call whose ids fit the pool (1 token x 3 ids, 3 slots: decode batch
    1) takes the hybrid sparse form on the stream instead of the async expert step, so its misses
    that are not admitted can be computed on the host; the output (kernel over the layer buffer plus
    the host's rows) equals every pair from the cache. Without the option the same calls never reach
    the host (test above)."""
    res, eng, cache, bufs, targets = _hybrid_residency(tmp_path, seed=7, hybrid_small_calls=True)
    try:
        assert res.hybrid_small and res.async_fits == SLOTS
        refs = {l: _cache_tensors(cache, l) for l in LAYERS}
        for step in _calls(12, 1, seed=13):
            for t in targets:
                ids, w, x = step[t.index]
                ids, w = ids[:, :SLOTS], w[:, :SLOTS]
                _route_exact(res, t, ids, w, x, bufs[t.layer], refs[t.layer])
        s = res.summary()
        assert s["hybrid_async_calls"] == 12 * len(LAYERS) and s["async_calls"] == 0, s
        assert s["async_host_experts"] > 0 and s["host_host_experts"] == 0, s  # on the stream, not the Python path
    finally:
        res.close()
        eng.close()


def test_hybrid_small_calls_auto_follows_the_misses_per_call(tmp_path):
    """hybrid_small_calls="auto" (the default): calls that fit the pool take the async expert step until
    the end-of-step check has seen them miss hybrid_small_ms of link time per call on average, then the hybrid
    form (misses to the host); once they hit (the same experts step after step) and the average falls
    under 3/4 of it, the expert step again. The output equals every pair from the cache throughout."""
    from mmap_offload.vllm_backend.residency import REFERENCE_LINK_BPS

    nbytes = _expert_nbytes(tmp_path / "size")
    res, eng, cache, bufs, targets = _hybrid_residency(tmp_path, seed=8, hybrid_small_ms=0.5 * nbytes / REFERENCE_LINK_BPS * 1e3)
    try:
        # the CPU has no link to time: the threshold is hybrid_small_ms at the reference rate (half an expert)
        assert res.hybrid_small_auto and res.ec.expert_nbytes == nbytes and res.link_bps is None
        assert abs(res._small_on_bytes - 0.5 * nbytes) < 1e-6 * nbytes
        assert not res.hybrid_small
        refs = {l: _cache_tensors(cache, l) for l in LAYERS}
        rng = np.random.default_rng(21)
        fixed = torch.tensor([[0, 1, 2]])
        modes = []
        for i in range(40):
            step = []
            for t in targets:
                ids = torch.from_numpy(rng.choice(E, size=(1, SLOTS), replace=False)) if i < 6 else fixed
                w = torch.full((1, SLOTS), 1.0 / SLOTS)
                x = torch.from_numpy(rng.standard_normal((1, H)).astype(np.float32)).to(torch.bfloat16)
                for b in bufs[t.layer].values():
                    b.zero_()
                hy0 = res.metrics["hybrid_async_calls"]
                wk, ik = res.route(t, w, ids, x)
                hybrid = res.metrics["hybrid_async_calls"] > hy0  # the kernel reads the layer buffer, else the pool
                step.append(hybrid)
                out = _moe(x, ik, wk, bufs[t.layer] if hybrid else res.ec.slots(t.layer))
                out = res.add_host(t, out.to(torch.bfloat16))
                want = _moe(x, ids, w, refs[t.layer])
                assert (out.float() - want).abs().max().item() <= TOL * want.abs().max().item(), (i, hybrid)
            assert len(set(step)) == 1, (i, step)  # decided per step
            modes.append("hybrid" if step[0] else "expert")
        s = res.summary()
        # the average starts from 0 (the expert step's side): a few steps of random picks (~2.5 misses
        # per call) take it over half an expert and the calls go hybrid; then the fixed ids become
        # hits and the average decays under 3/4 of the threshold: the expert step again, and it stays
        on = modes.index("hybrid")
        assert 1 <= on <= 5 and all(m == "expert" for m in modes[:on]), modes
        back = modes.index("expert", on)
        assert back < 30, modes
        assert all(m == "hybrid" for m in modes[on:back]) and all(m == "expert" for m in modes[back:]), modes
        assert s["small_auto_switches"] == 2 and s["small_hybrid_steps"] == back - on, s
        assert not s["small_calls_hybrid"] and s["small_miss_mib"] < 0.75 * 0.5 * nbytes / (1 << 20), s
        assert abs(s["small_on_mib"] - 0.5 * nbytes / (1 << 20)) < 1e-6 and s["link_h2d_gbps"] == 0.0, s
    finally:
        res.close()
        eng.close()


def test_hybrid_small_calls_auto_threshold_scales_with_the_timed_link(tmp_path, monkeypatch):
    """The auto mode's threshold is hybrid_small_ms of link time at the rate timed at start: a link half
    the H200's (PCIe Gen4) halves the MiB per call from which small calls go hybrid; an untimed link
    (the CPU, or a timing that failed) takes the reference rate. "on" / "off" time nothing."""
    from mmap_offload.vllm_backend.residency import REFERENCE_LINK_BPS

    timed = []
    monkeypatch.setattr(AsyncStep, "link_h2d_bps", lambda self: timed.append(1) or REFERENCE_LINK_BPS / 2)
    res, eng, *_ = _hybrid_residency(tmp_path / "auto", seed=3, hybrid_small_ms=0.6)
    try:
        assert timed == [1] and res.link_bps == REFERENCE_LINK_BPS / 2
        assert abs(res._small_on_bytes - 0.6e-3 * REFERENCE_LINK_BPS / 2) < 1.0  # ~15.7 MiB, not 31.5
        s = res.summary()
        assert abs(s["small_on_mib"] - 0.3e-3 * REFERENCE_LINK_BPS / (1 << 20)) < 1e-6 and s["link_h2d_gbps"] == 27.5, s
    finally:
        res.close()
        eng.close()
    res, eng, *_ = _hybrid_residency(tmp_path / "on", seed=3, hybrid_small_calls="on")
    try:
        assert timed == [1] and res.hybrid_small and not res.hybrid_small_auto and "small_on_mib" not in res.summary()
    finally:
        res.close()
        eng.close()


@pytest.mark.parametrize("shapes,routing,want", [
    ("default", "uniform-trace", "hybrid"),  # ~56 MiB per call: "on" won (sessions 23, 24)
    ("user", "uniform-trace", "hybrid"),  # ~35 MiB: a tie ("on" ahead in sessions 23 and 26, behind in 25)
    ("user", "skewed", "expert"),  # ~11 MiB: "on" lost (sessions 14, 17)
    ("default", "skewed", "hybrid"),  # ~26 MiB: "on" won (session 26: 0.990x uva against 0.839x)
])
def test_hybrid_small_calls_auto_on_the_bench_traces_picks_the_measured_winners(tmp_path, shapes, routing, want):
    """bench_vllm's batch-1 traces (8 layers, top-8; default shapes 64 experts of 9.3 MiB, the user's 160
    of 5.8 MiB; a pool of a quarter of the experts, as the bench gives it) replayed through the
    backend's Residency on the CPU, with tiny experts and hybrid_small_ms scaled so that the threshold
    is the default hybrid_small_ms at the H200's 55 GB/s (0.4 ms: 21 MiB) in experts of those shapes: the
    auto mode ends on the side that won on the H200 for each measured case. Its first steps (an empty
    pool: every expert a miss) do not switch it."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import bench_vllm

    from mmap_offload import traces
    from mmap_offload.vllm_backend.options import MmapOptions
    from mmap_offload.vllm_backend.residency import REFERENCE_LINK_BPS

    n_exp, mib = {"default": (64, 9.3), "user": (160, 5.8)}[shapes]
    layers, steps = tuple(range(8)), 150
    nb = _expert_nbytes(tmp_path / "size")
    thr_experts = MmapOptions().hybrid_small_ms * 1e-3 * REFERENCE_LINK_BPS / (mib * (1 << 20))  # in experts of these shapes
    res, eng, cache, bufs, targets = _hybrid_residency(
        tmp_path / "c", seed=1, experts=n_exp, layers=layers, slots=n_exp // 4, host_threads=1,
        hybrid_small_ms=thr_experts * nb / REFERENCE_LINK_BPS * 1e3)
    assert res.ec.expert_nbytes == nb
    make = bench_vllm.make_trace if routing == "skewed" else bench_vllm.make_uniform_trace
    make(tmp_path / "t.csv", steps=steps, layers=len(layers), num_experts=n_exp, top_k=8, batch=64, seed=0)
    tr = traces.read_csv(tmp_path / "t.csv")
    modes = []
    try:
        for st in range(steps):
            for t in targets:  # decode batch 1 takes the trace's first sequence
                res.route(t, torch.full((1, 8), 1 / 8), torch.from_numpy(tr[st, t.index, :1, :8].astype(np.int64)),
                          torch.zeros(1, H, dtype=torch.bfloat16))
                res.add_host(t, torch.zeros(1, H, dtype=torch.bfloat16))
            modes.append("hybrid" if res.hybrid_small else "expert")
        s = res.summary()
    finally:
        res.close()
        eng.close()
    assert modes[0] == "expert" and modes[-1] == want, "".join(m[0] for m in modes)
    assert s["small_auto_switches"] <= 1, s  # one switch at most: no flapping
    assert (s["small_miss_mib"] / (nb / (1 << 20)) >= thr_experts) == (want == "hybrid"), s


def test_hybrid_small_calls_off_and_a_high_threshold_keep_the_expert_step(tmp_path):
    """hybrid_small_calls="off", and "auto" whose calls miss less than hybrid_small_ms of link time: every call that
    fits the pool takes the async expert step, whatever it misses."""
    for opts in (dict(hybrid_small_calls="off"), dict(hybrid_small_ms=1000.0)):
        res, eng, cache, bufs, targets = _hybrid_residency(tmp_path / str(len(opts)) / next(iter(opts)), seed=9, **opts)
        try:
            refs = {l: _cache_tensors(cache, l) for l in LAYERS}
            for step in _calls(6, 1, seed=23):
                for t in targets:
                    ids, w, x = step[t.index]
                    ids, w = ids[:, :SLOTS], w[:, :SLOTS]
                    wk, slots = res.route(t, w, ids, x)
                    out = res.add_host(t, _moe(x, slots, wk, res.ec.slots(t.layer)).to(torch.bfloat16))
                    want = _moe(x, ids, w, refs[t.layer])
                    assert (out.float() - want).abs().max().item() <= TOL * want.abs().max().item()
            s = res.summary()
            assert s["async_calls"] == 6 * len(LAYERS) and s["hybrid_async_calls"] == 0, (opts, s)
            assert s["small_auto_switches"] == 0 and not s["small_calls_hybrid"], (opts, s)
        finally:
            res.close()
            eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("launches,arch", [("fused", ""), ("copies", ""), ("fused", "compute_86")])
def test_gpu_hybrid_calls_exact_under_a_busy_stream(tmp_path, kernel, launches, arch, monkeypatch):
    """CUDA: hybrid calls enqueued behind device work with no host wait. The stream copies x and the
    weights to the host, the callback starts the host job, the copy kernel fills the copied rows, the
    kernel's weights and ids land on the device, and the collect brings the host's rows up: read in
    stream order, the kernel's part over the layer buffer plus the host's rows equal every pair from
    the cache (test_hybrid's tolerance), and the host computed experts. ``fused``: the inputs go down in
    one gather launch, the kernel's weights and ids come up in the copy kernel, the host's rows are added
    by one launch (the default); ``copies``: cudaMemcpy and torch's add_ (MMO_ASYNC_LAUNCHES=copies).
    ``compute_86``: the kernels as PTX for the user's RTX 3090's architecture (MMO_COPY_KERNEL_ARCH), which
    the driver compiles for this GPU: the same source built for sm_86's feature set."""
    from fakes import cuda_engine

    monkeypatch.setenv("MMO_ASYNC_LAUNCHES", launches)
    monkeypatch.setenv("MMO_COPY_KERNEL_ARCH", arch)
    c = make_marlin_cache(tmp_path, hidden=H, inter=INTER, group=GROUP, experts=E, layers=LAYERS, seed=2)
    for layer in LAYERS:
        c.check_experts_once(layer, list(range(E)))
    dev = torch.device("cuda")
    eng = cuda_engine("ordered")
    stream = torch.cuda.Stream(dev)
    snaps = []
    try:
        with torch.cuda.stream(stream):
            ec = ExpertCache(c, eng, dev, capacity_experts=SLOTS * len(LAYERS), stream_ordered=True)
            a = AsyncStep.create(ExpertStep.create(ec), max_experts=3)
            assert isinstance(a, AsyncStep), a
            assert a.fused_launches == (launches == "fused")
            assert a.kernel_source.endswith(arch) and (not arch or a.kernel_source == f"ptx {arch}"), a.kernel_source
            a.set_host(kernel, _geometry(c), max_rows=8, dtype=torch.bfloat16, share=0.6, adapt=True)
            src = _sources(c)
            for step in _calls(8, 3, seed=6):
                for li, layer in enumerate(LAYERS):
                    ids, w, x = step[li]
                    buf = {k: v.to(dev) for k, v in _buffer(c).items()}
                    busy = torch.randn(1024, 1024, device=dev)
                    busy = busy @ busy  # the call comes after work it must not wait for
                    wk, ik = a.run_hybrid(layer, ids.to(dev), buf, w.to(dev), x.to(dev), src[layer])
                    out = torch.zeros(3, H, dtype=torch.bfloat16, device=dev)
                    a.collect(out)
                    snaps.append((layer, ids, w, x, wk.clone(), ik.clone(), {k: v.clone() for k, v in buf.items()}, out))
                a.wait()
        torch.cuda.synchronize()
        refs = {l: _cache_tensors(c, l) for l in LAYERS}
        for layer, ids, w, x, wk, ik, buf, out in snaps:
            got = _moe(x, ik.cpu(), wk.cpu(), {k: v.cpu() for k, v in buf.items()}) + out.cpu().float()
            want = _moe(x, ids, w, refs[layer])
            assert (got - want).abs().max().item() <= TOL * want.abs().max().item()
        s = a.summary()
        assert s["hybrid_calls"] == len(snaps) and s["host_experts"] > 0, s
    finally:
        a.close()
        eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,arch", [(torch.bfloat16, ""), (torch.float16, ""), (torch.bfloat16, "compute_86"),
                                        (torch.float16, "compute_86")])
def test_gpu_collect_adds_the_host_rows_in_place_as_torchs_add(tmp_path, kernel, dtype, arch, monkeypatch):
    """CUDA, the fused collect (mo_async_collect_add): the host's rows, read in place from the mapped
    area, are added to a non-zero MoE output whose rows are strided (a view of a wider tensor) with
    torch's rounding: bit for bit equal to torch's own add of the same rows; the columns past H and
    the rows past the call's tokens are not touched. ``compute_86``: as built for the user's RTX 3090
    (PTX of its architecture, compiled by the driver here)."""
    from fakes import cuda_engine

    monkeypatch.setenv("MMO_COPY_KERNEL_ARCH", arch)
    c = make_marlin_cache(tmp_path, hidden=H, inter=INTER, group=GROUP, experts=E, layers=LAYERS, seed=4)
    for layer in LAYERS:
        c.check_experts_once(layer, list(range(E)))
    dev = torch.device("cuda")
    eng = cuda_engine("ordered")
    a = None
    try:
        ec = ExpertCache(c, eng, dev, capacity_experts=SLOTS * len(LAYERS), stream_ordered=True)
        a = AsyncStep.create(ExpertStep.create(ec), max_experts=3)
        assert isinstance(a, AsyncStep) and a.fused_launches, a
        assert not arch or a.kernel_source == f"ptx {arch}", a.kernel_source
        a.set_host(kernel, _geometry(c), max_rows=8, dtype=dtype, share=1.0, adapt=False)
        lay = np.zeros(6, dtype=np.int64)
        a.lib.mo_async_host_layout(a.cap, 8, H, 2, lay.ctypes.data)
        area = a._host["area"].tensor
        src = _sources(c)
        g = torch.Generator().manual_seed(3)
        checked = 0
        for step in _calls(6, 3, seed=8):
            for li, layer in enumerate(LAYERS):
                ids, w, x = step[li]
                buf = {k: v.to(dev) for k, v in _buffer(c).items()}
                assert a.run_hybrid(layer, ids.to(dev), buf, w.to(dev), x.to(dtype).to(dev), src[layer]) is not None
                wide = (torch.randn(4, H + 40, generator=g) * 4).to(dtype).to(dev)
                before = wide.cpu()
                out = wide[:, :H]  # rows H + 40 apart; 4 rows, the call's 3 get the host's
                assert a.collect(out) is out
                torch.cuda.synchronize()
                rows = area[int(lay[1]): int(lay[1]) + 3 * H * 2].view(dtype).view(3, H).clone()
                got = wide.cpu()
                assert torch.equal(got[:3, :H], before[:3, :H] + rows), (layer, dtype)
                assert torch.equal(got[:3, H:], before[:3, H:]) and torch.equal(got[3], before[3])
                checked += int(bool(rows.abs().sum() > 0))
            a.wait()
        assert checked > 0  # the host computed rows (share 1: every miss it may take)
    finally:
        if a is not None:
            a.close()
        eng.close()


def test_a_cache_file_truncated_while_serving_fails_the_step_not_the_process(tmp_path):
    """A layer file truncated under the serving mappings (a stray ``truncate``; a disk I/O error on a page
    the page cache dropped looks the same to a reader): the host kernel's reads of it raise SIGBUS in its
    threads, which its guard turns into a failed host job; the end-of-step check raises one CacheError
    line naming the file, the process lives, and the other layer keeps serving exact rows."""
    import os

    from mmap_offload.errors import CacheError

    res, eng, cache, bufs, targets = _hybrid_residency(tmp_path, seed=5)
    try:
        refs = {l: _cache_tensors(cache, l) for l in LAYERS}
        calls = _calls(8, 3, seed=9)
        for step in calls[:3]:
            for t in targets:
                ids, w, x = step[t.index]
                _route_exact(res, t, ids, w, x, bufs[t.layer], refs[t.layer])
        assert res.summary()["async_host_experts"] > 0
        k = res.host.kernel
        # (the process's SIGBUS handler may be the copy pool's, installed after the kernel's by another
        # test: it passes faults outside its copies on to the kernel's)
        assert k.last_fault() == 0
        path = cache.layer_file(LAYERS[0])
        os.truncate(path, 0)
        with pytest.raises(CacheError) as err:
            for step in calls[3:]:
                for t in targets:
                    ids, w, x = step[t.index]
                    wk, ik = res.route(t, w, ids, x)
                    res.add_host(t, torch.zeros(x.shape, dtype=torch.bfloat16))
        msg = str(err.value)
        assert str(path) in msg and "SIGBUS" in msg and "\n" not in msg, msg
        assert k.last_fault() != 0  # the host kernel's read faulted, under its guard
        # the process and the pool go on: the whole layer still computes exact rows on the host
        t = targets[1]
        ids, w, x = calls[-1][t.index]
        out = torch.zeros(x.shape, dtype=torch.bfloat16)
        k.experts_mlp(x, [(torch.arange(3), *(refs[t.layer][n][e] for n in EXPERT_TENSORS), GROUP,
                           torch.ones(3)) for e in range(2)], out)
        want = sum(_mlp(x, refs[t.layer], e) for e in range(2))
        assert (out.float() - want).abs().max().item() <= TOL * want.abs().max().item()
    finally:
        res.close()
        eng.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_truncated_cache_file_fails_the_hybrid_step_not_the_process(tmp_path, kernel, device):
    """The host job is started and collected from the stream's callbacks (CUDA's callback thread on the
    GPU); a layer file truncated under the mapping makes its reads raise SIGBUS there and in the kernel's
    threads, which the host kernel's guard turns into a failed job: ``wait()`` raises one CacheError line
    naming the file, the process lives, and the next calls of the other layer are exact."""
    import contextlib
    import os

    from mmap_offload.errors import CacheError

    c = make_marlin_cache(tmp_path, hidden=H, inter=INTER, group=GROUP, experts=E, layers=LAYERS, seed=2)
    for layer in LAYERS:
        c.check_experts_once(layer, list(range(E)))
    refs = {l: _cache_tensors(c, l) for l in LAYERS}
    dev = torch.device(device)
    if device == "cuda":
        from fakes import cuda_engine

        eng = cuda_engine("ordered")
        ctx = torch.cuda.stream(torch.cuda.Stream(dev))
    else:
        eng, ctx = _ordered_engine(), contextlib.nullcontext()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a = None
    try:
        with ctx:
            ec = ExpertCache(c, eng, dev, capacity_experts=SLOTS * len(LAYERS), stream_ordered=True)
            a = AsyncStep.create(ExpertStep.create(ec), max_experts=3)
            assert isinstance(a, AsyncStep), a
            a.set_host(kernel, _geometry(c), max_rows=8, dtype=torch.bfloat16, share=1.0, adapt=False)
            src = _sources(c)
            calls = _calls(6, 3, seed=6)

            def step(layers, s):
                got = []
                for li, layer in enumerate(LAYERS):
                    if layer in layers:
                        ids, w, x = calls[s][li]
                        buf = {k: v.to(dev) for k, v in _buffer(c).items()}
                        wk, ik = a.run_hybrid(layer, ids.to(dev), buf, w.to(dev), x.to(dev), src[layer])
                        out = torch.zeros(3, H, dtype=torch.bfloat16, device=dev)
                        a.collect(out)
                        got.append((layer, ids, w, x, wk, ik, buf, out))
                a.wait()
                return got

            step(LAYERS, 0)
            os.truncate(c.layer_file(LAYERS[0]), 0)
            with pytest.raises(CacheError) as err:
                for s in (1, 2, 3):
                    step(LAYERS, s)
            msg = str(err.value)
            assert str(c.layer_file(LAYERS[0])) in msg and "SIGBUS" in msg and "\n" not in msg, msg
            assert kernel.last_fault() != 0
            assert a.summary()["host_experts"] > 0
            for layer, ids, w, x, wk, ik, buf, out in step(LAYERS[1:], 4):  # the other layer: exact
                sync()
                got = _moe(x, ik.cpu(), wk.cpu(), {k: v.cpu() for k, v in buf.items()}) + out.cpu().float()
                want = _moe(x, ids, w, refs[layer])
                assert (got - want).abs().max().item() <= TOL * want.abs().max().item()
    finally:
        if a is not None:
            a.close()
        eng.close()


def test_hybrid_admit_zero_computes_every_routed_expert_on_the_host(tmp_path):
    """Option hybrid_admit 0 (experts on the CPU, the llama.cpp / KTransformers way, inside vLLM): the pool
    admits nothing from hybrid calls, so nothing hits and, with hybrid_share 1, the host computes every
    routed expert but the one a call without a hit copies (the row its host pairs point at); outputs equal
    every pair from the cache. The default (4) admits and hits."""
    got = {}
    for admit in (4, 0):
        res, eng, cache, bufs, targets = _hybrid_residency(tmp_path / str(admit), seed=5, hybrid_admit=admit)
        try:
            refs = {l: _cache_tensors(cache, l) for l in LAYERS}
            steps = _calls(12, 3, seed=9)
            for step in steps:
                for t in targets:
                    ids, w, x = step[t.index]
                    _route_exact(res, t, ids, w, x, bufs[t.layer], refs[t.layer])
            got[admit] = s = res.summary()
            assert s["hybrid_async_calls"] == len(steps) * len(LAYERS), s
        finally:
            res.close()
            eng.close()
    assert got[4]["async_admitted"] > 0 and got[4]["async_sparse_hits"] > 0
    s = got[0]
    assert s["async_admitted"] == 0 and s["async_sparse_hits"] == 0, s
    assert s["async_host_experts"] == s["async_sparse_misses"] - s["hybrid_async_calls"], s


def test_hybrid_admit_option_is_checked():
    from mmap_offload.errors import UnsupportedError
    from mmap_offload.vllm_backend.options import MmapOptions

    assert MmapOptions.resolve({"hybrid_admit": "0"}).hybrid_admit == 0
    for bad in (-1, 65):
        with pytest.raises(UnsupportedError, match="hybrid_admit must be in"):
            MmapOptions.resolve({"hybrid_admit": bad})
