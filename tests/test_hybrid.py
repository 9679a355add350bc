"""Hybrid MoE execution (mmap_offload/host/hybrid.py) and routing traces from CSV files (traces.py).

- Outputs: hybrid (hits + copied misses on the "GPU" path, the other misses on the real host kernel)
  equals the all-GPU path. On CPU the "GPU" path is an independent torch reference over the expert
  cache's slots (tests/marlin_reference.py inverts the Marlin layout); the host part is the native
  kernel (or the torch stand-in, both tested). Tolerance: x is bf16; the host kernel accumulates in
  fp32 and rounds once per row to bf16, the reference rounds its fp32 sum to bf16 at the end, and the
  w2 input is rounded to bf16 on both sides, so the two differ by bf16 rounding of terms summed in a
  different order: max |diff| <= 2e-2 x max |reference| (bf16 has 8 bits of mantissa, ~4e-3 per rounding).
- The planner on synthetic rates: prefill / large batches copy everything, decode over a slow link
  computes on the host, equal rates split the misses, popular misses are copied.
- Calibration runs on a real cache and gives finite rates; the PCIe model caps the link.
- Traces: CSV round trip with and without weights, malformed files give one-line errors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmap_offload import traces
from mmap_offload.cache_format import CacheIdentity
from mmap_offload.errors import UnsupportedError
from mmap_offload.expert_cache import ExpertCache
from mmap_offload.host import hybrid

sys.path.insert(0, str(Path(__file__).resolve().parent))
import marlin_reference as mr  # noqa: E402
from fakes import SyncEngine, make_cache  # noqa: E402

TOL = 2e-2


# -- a small Marlin W4A16 cache -----------------------------------------------------------------------


def make_marlin_cache(directory: Path, hidden=256, inter=128, group=64, experts=12, layers=(0, 1), seed=0):
    g13 = 1 if group <= 0 else hidden // group
    g2 = 1 if group <= 0 else max(1, inter // group)
    specs = [("w13_weight_packed", "int32", (hidden // 16, 4 * inter)),
             ("w2_weight_packed", "int32", (inter // 16, 2 * hidden)),
             ("w13_weight_scale", "bfloat16", (g13, 2 * inter)),
             ("w2_weight_scale", "bfloat16", (g2, hidden))]
    ident = CacheIdentity("sha256:hybrid-test", {"kind": "w4a16", "group_size": group}, "test-raw", 1, 0, 1)
    gen = torch.Generator().manual_seed(seed)

    def fill(s):
        if s.name.endswith("packed"):
            return torch.randint(-2**31, 2**31, s.shape, generator=gen, dtype=torch.int64).to(torch.int32)
        k = hidden if s.name.startswith("w13") else inter
        return ((torch.rand(s.shape, generator=gen) * 0.5 + 0.75) / (4.6 * k**0.5)).to(torch.bfloat16)

    return make_cache(directory, layers, experts, specs, identity=ident, fill=fill)


def ref_weight(words, scales, K, N, group, grouped):
    """fp32 [K, N] through the test-only inverse of the repack (independent of the package)."""
    u = mr.unpack_values(mr.inverse_repack(words)).astype(np.float32)  # [N, K] values 0..15
    s = mr.inverse_permute_scales(scales.float(), grouped)  # [G, N]
    gs = K if group <= 0 else min(group, K)
    return torch.from_numpy(u.T - 8.0) * s.repeat_interleave(gs, dim=0)


def ref_expert(x, w13, s13, w2, s2, group):
    H = x.shape[1]
    I = w13.shape[1] // 4
    W13 = ref_weight(w13, s13, H, 2 * I, group, grouped=group > 0)
    W2 = ref_weight(w2, s2, I, H, group, grouped=0 < group < I)
    h = x.float() @ W13
    a = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]).to(x.dtype).float()
    return a @ W2


def ref_gpu_forward(ec, group):
    """The all-"GPU" path on CPU: every pair over the expert cache's slots, fp32, rounded once."""

    def fwd(layer, x, slot_ids, route_w):  # on CUDA: the slots' bytes are read back (a reference, not fast)
        slots = {k: v.cpu() for k, v in ec.slots(layer).items()} if x.is_cuda else ec.slots(layer)
        xc, rc = x.cpu(), route_w.cpu()
        out = torch.zeros(x.shape[0], x.shape[1])
        for s in np.unique(slot_ids).tolist():
            t, j = np.nonzero(slot_ids == s)
            y = ref_expert(xc[torch.from_numpy(t)], slots["w13_weight_packed"][s], slots["w13_weight_scale"][s],
                           slots["w2_weight_packed"][s], slots["w2_weight_scale"][s], group)
            out.index_add_(0, torch.from_numpy(t), y * rc[torch.from_numpy(t), torch.from_numpy(j)].float()[:, None])
        return out.to(x.dtype).to(x.device)

    return fwd


def synthetic_rates(expert_bytes=1 << 20, host_gbps=20.0, copy_gbps=20.0, per_row_frac=0.05, split=8, all_=16,
                    gpu_call_s=1e-4, xfer_s=2e-5):
    base = expert_bytes / (host_gbps * 1e9)
    return hybrid.Rates(expert_bytes=expert_bytes,
                        host_base_s={split: base, all_: base * 0.8},
                        host_row_s={split: base * per_row_frac, all_: base * 0.8 * per_row_frac},
                        threads_split=split, threads_all=all_, copy_bw=copy_gbps * 1e9, copy_lat_s=2e-5,
                        gpu_call_s=gpu_call_s, xfer_s=xfer_s)


# -- the host kernel stand-in and the Marlin reading ----------------------------------------------------


@pytest.mark.parametrize("hidden, inter, group", [(256, 128, 64), (256, 64, 64), (128, 128, -1), (256, 128, 32)])
def test_host_kernels_match_the_independent_reference(tmp_path, hidden, inter, group):
    cache = make_marlin_cache(tmp_path / "c", hidden, inter, group, experts=3, layers=(0,))
    v = [cache.tensor(0, 1, n) for n in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")]
    x = torch.randn(5, hidden).to(torch.bfloat16)
    ref = ref_expert(x, *v, group)
    for impl in ("torch", "auto"):
        k, _ = hybrid.make_host_kernel(impl, threads=2)
        y = k.expert_mlp(x, *v, group=group).float()
        assert (y - ref).abs().max() <= TOL * ref.abs().max(), impl
    cache.close()


# -- hybrid == all-GPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["auto", "torch"])
@pytest.mark.parametrize("hidden, inter, group", [(256, 128, 64), (256, 64, 64)])
def test_hybrid_equals_all_gpu(tmp_path, impl, hidden, inter, group):
    E, k, L = 12, 4, (0, 1)
    cache = make_marlin_cache(tmp_path / "c", hidden, inter, group, experts=E, layers=L)
    nb = sum(s.nbytes for s in cache.expert_specs)
    # host and copy equally fast: the planner splits misses between the two
    rates = synthetic_rates(expert_bytes=nb, host_gbps=1.0, copy_gbps=1.0, per_row_frac=0.0, split=1, all_=1)
    kern, _ = hybrid.make_host_kernel(impl, threads=2)
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=8, shared=True)
    fixed = hybrid.Planner(hybrid.CostModel(rates, learn=False))  # the split of these rates, not learned ones
    hy = hybrid.HybridMoE(cache, ec, {1: kern}, fixed, ref_gpu_forward(ec, group), "cpu", group=group)
    ec_ref = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=2 * E, shared=True)  # everything resident
    gpu = ref_gpu_forward(ec_ref, group)
    tr = traces.skewed_trace(6, len(L), E, k, batch=3, seed=1)
    g = torch.Generator().manual_seed(0)
    for s in range(tr.shape[0]):
        x = torch.randn(3, hidden, generator=g).to(torch.bfloat16)
        rw = torch.softmax(torch.randn(3, k, generator=g), -1)
        for li, layer in enumerate(L):
            ids = tr[s, li]
            y = hy.forward(layer, x, ids, rw)
            want = gpu(layer, x, np.asarray(ec_ref.ensure(layer, ids)), rw)
            assert y.dtype == x.dtype and y.shape == x.shape
            err = (y.float() - want.float()).abs().max()
            assert err <= TOL * want.float().abs().max(), (s, li, float(err))
    m = hy.metrics
    assert m["hits"] > 0 and m["host_experts"] > 0 and m["copied_experts"] > 0, m
    assert m["host_experts"] + m["copied_experts"] == m["misses"]
    hy.close()
    cache.close()


def test_host_forward_equals_all_gpu(tmp_path):
    E, k, H, I, group = 10, 3, 256, 128, 64
    cache = make_marlin_cache(tmp_path / "c", H, I, group, experts=E, layers=(0,))
    kern, _ = hybrid.make_host_kernel("auto", threads=2)
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=E)
    gpu = ref_gpu_forward(ec, group)
    ids = traces.uniform_trace(1, 1, E, k, batch=4, seed=2)[0, 0]
    x = torch.randn(4, H).to(torch.bfloat16)
    rw = torch.softmax(torch.randn(4, k), -1)
    y = hybrid.host_forward(cache, kern, 0, x, ids, rw, group)
    want = gpu(0, x, np.asarray(ec.ensure(0, ids)), rw).float()
    assert (y.float() - want).abs().max() <= TOL * want.abs().max()
    cache.close()


def test_hybrid_without_host_is_the_expert_cache(tmp_path):
    """host_allowed=False copies every miss (the plain expert cache); the host kernel is never called."""
    cache = make_marlin_cache(tmp_path / "c", experts=8, layers=(0,))
    nb = sum(s.nbytes for s in cache.expert_specs)

    class NoHost:
        def experts_mlp(self, *a):
            raise AssertionError("host kernel called")

    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=8)
    hy = hybrid.HybridMoE(cache, ec, {1: NoHost()}, hybrid.Planner(synthetic_rates(nb, split=1, all_=1)),
                          ref_gpu_forward(ec, 64), "cpu", group=64)
    hy.host_allowed = False
    hy.forward(0, torch.randn(2, 256).to(torch.bfloat16), np.array([[0, 1], [2, 3]]), torch.full((2, 2), 0.5))
    assert hy.metrics["copied_experts"] == 4 and hy.metrics["host_experts"] == 0
    hy.close()
    cache.close()


# -- the planner on synthetic rates ----------------------------------------------------------------------


def _misses(tokens, E, k, resident_frac, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)])
    uniq, counts = np.unique(ids, return_counts=True)
    return counts[rng.random(uniq.size) >= resident_frac]


def test_planner_copies_at_prefill():
    """2048 tokens over 64 experts: ~256 rows per expert; the host's per-row cost makes the GPU win."""
    rates = synthetic_rates(expert_bytes=9 << 20, host_gbps=60, copy_gbps=30)
    p = hybrid.Planner(rates).plan(_misses(2048, 64, 8, 0.25))
    assert p.host.size == 0 and p.copy.size > 40 and p.threads == 0


def test_planner_computes_on_the_host_at_decode_over_a_slow_link():
    rates = synthetic_rates(expert_bytes=9 << 20, host_gbps=60, copy_gbps=5)
    rows = _misses(1, 64, 8, 0.25)
    p = hybrid.Planner(rates).plan(rows)
    assert p.host.size == rows.size and p.copy.size == 0
    assert p.threads == rates.threads_all  # nothing copied: every host thread


def test_planner_balances_equal_rates_and_finishes_together():
    rates = synthetic_rates(expert_bytes=9 << 20, host_gbps=30, copy_gbps=30, per_row_frac=0.0, gpu_call_s=0.0,
                            xfer_s=0.0)
    rates.copy_lat_s = 0.0
    rows = np.ones(8, dtype=np.int64)
    p = hybrid.Planner(rates).plan(rows)
    assert p.host.size == 4 and p.copy.size == 4 and p.threads == rates.threads_split
    assert abs(p.est_host_s - p.est_copy_s) <= 0.2 * p.est_s
    assert sorted(np.concatenate([p.host, p.copy]).tolist()) == list(range(8))


def test_planner_sends_rare_experts_to_the_host_and_popular_ones_to_the_copy():
    rates = synthetic_rates(expert_bytes=9 << 20, host_gbps=30, copy_gbps=30, per_row_frac=0.0)
    pl = hybrid.Planner(rates)
    for _ in range(20):
        pl.note_routed(0, np.array([5, 6]))  # experts 5 and 6 are popular
    misses = np.array([3, 5, 6, 7])
    p = pl.plan(np.ones(4, dtype=np.int64), pl.popularity(0, misses))
    assert set(misses[p.copy].tolist()) >= {5, 6} or set(misses[p.host].tolist()) <= {3, 7}
    assert not ({5, 6} & set(misses[p.host].tolist()))


def test_planner_respects_max_host_rows():
    rates = synthetic_rates(host_gbps=100, copy_gbps=1, per_row_frac=0.0)
    rates.max_host_rows = 4
    p = hybrid.Planner(rates).plan(np.array([1, 2, 5, 9]))
    assert sorted(p.host.tolist()) == [0, 1]


def test_crossover_table_moves_from_host_to_copy():
    rates = synthetic_rates(expert_bytes=9 << 20, host_gbps=60, copy_gbps=30, per_row_frac=0.05)
    tab = hybrid.crossover_table(rates, 64, 8, 0.25, tokens=(1, 8, 64, 512, 2048))
    share = [r["host"] / max(r["misses"], 1e-9) for r in tab]
    assert share[0] > 0.5 and share[-1] == 0.0
    assert all(a >= b - 0.1 for a, b in zip(share, share[1:]))  # non-increasing up to sampling noise
    assert all(r["est_ms"] <= r["copy_all_ms"] + 1e-9 for r in tab)  # copying all is a candidate


def test_pcie_model_caps_the_link():
    rates = synthetic_rates(expert_bytes=9 << 20, copy_gbps=30)
    gen4 = hybrid.pcie_model_rates(rates, h2d_gbps=25.0, measured_h2d_gbps=55.0, cores=32, label="model")
    assert gen4.copy_bw == pytest.approx(0.9 * 25e9) and gen4.label == "model"
    slow = hybrid.pcie_model_rates(synthetic_rates(copy_gbps=10), 25.0, 55.0, 32, "m")
    assert slow.copy_bw == pytest.approx(10e9)  # the CPU side stays the limit where it was
    assert gen4.host_base_s == rates.host_base_s and gen4.threads_all == 16


# -- calibration on a real cache ------------------------------------------------------------------------


def test_calibrate_gives_finite_positive_rates(tmp_path):
    cache = make_marlin_cache(tmp_path / "c", experts=6, layers=(0, 1))
    kern, _ = hybrid.make_host_kernel("auto", threads=1)
    calls = []
    r = hybrid.calibrate(cache, SyncEngine(), "cpu", {1: kern}, group=64, hidden=256, threads_split=1,
                         threads_all=1, gpu_call=lambda: calls.append(1), n_experts=4, rows_hi=4, reps=2)
    assert r.expert_bytes == sum(s.nbytes for s in cache.expert_specs)
    assert r.host_base_s[1] > 0 and r.host_row_s[1] >= 0 and r.copy_bw > 0 and r.gpu_call_s >= 0
    assert r.slow_host >= 1.0 and r.slow_copy >= 1.0 and calls
    assert np.isfinite(r.host_gbps(1)) and r.to_dict()["copy_gbps"] > 0
    # the host side is cost.calibrate_host's: a fixed cost per call, a pool of every expert here (the
    # cache is far smaller than 4x any LLC, which the notes say), and the dict survives JSON
    cal = r.notes["calibration"]
    assert r.host_call_s[1] >= 0 and cal["pool_experts"] == 12 and cal["pool_within_4x_llc"]
    import json

    back = hybrid.Rates.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.host_base_s == r.host_base_s and back.host_call_s == r.host_call_s
    assert hybrid.populate(cache)["bytes"] == sum(cache.layer_buffer(l).nbytes for l in (0, 1))
    ext = cache.expert_extent(0, 1).nbytes
    assert hybrid.populate(cache, layers=[0], experts=[1, 2])["bytes"] == 2 * ext
    cache.close()


# -- traces: CSV with weights, malformed files -----------------------------------------------------------


def test_trace_csv_round_trip_with_weights(tmp_path):
    tr = traces.skewed_trace(4, 2, 16, 3, batch=2, seed=0)
    w = np.random.default_rng(0).random(tr.shape).astype(np.float32)
    p = traces.write_csv(tr, tmp_path / "w.csv", weights=w)
    assert p.read_text().splitlines()[0] == "step,layer,e0,e1,e2,w0,w1,w2"
    ids, back_w = traces.read_csv(p, with_weights=True)
    assert (ids == tr).all() and back_w.dtype == np.float32 and np.array_equal(back_w, w)
    assert (traces.read_csv(p) == tr).all()  # weights ignored when not asked for
    ids2, none = traces.read_csv(traces.write_csv(tr, tmp_path / "n.csv"), with_weights=True)
    assert none is None and (ids2 == tr).all()
    # no header: weights recognised by their decimal point
    (tmp_path / "h.csv").write_text("0,0,1,2,0.75,0.25\n0,1,3,4,0.5,0.5\n")
    ids3, w3 = traces.read_csv(tmp_path / "h.csv", with_weights=True)
    assert ids3.tolist() == [[[[1, 2]], [[3, 4]]]] and w3[0, 0, 0].tolist() == [0.75, 0.25]


@pytest.mark.parametrize("body, what", [
    ("0,0,1,2\n0,0,3\n", "fields"),
    ("0,0,1,2\n0,1,1,2\n1,0,1,2\n", "step 1 layer 1 has 0 rows"),
    ("0,0,1,2\n0,0,3,4\n0,1,1,2\n", "step 0 layer 1 has 1 rows, expected 2"),
    ("0,0,1,x\n", "not integers"),
    ("0,0,1,-2\n", "negative"),
    ("# nothing\n", "no rows"),
    ("0,0,1,1\n", "repeats an expert id"),
    ("0,0,1,2,0.5\n", "fields"),
    ("0,0,1,2,0.5,-1.0\n", "negative or non-finite weight"),
    ("0,0,1,2,0.5,nan\n", "negative or non-finite weight"),
    ("0,0,1,2,0.5,0.5\n0,1,1,2\n", "fields"),
    ("step,layer,e0,e1,w0,w1\n0,0,1,2,0.5,abc\n", "weight that is not a number"),
    ("0,0,1.5,2,0.5,0.5\n", "not integers"),
])
def test_trace_csv_errors_are_one_line_naming_file_and_problem(tmp_path, body, what):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(UnsupportedError, match=what) as ei:
        traces.read_csv(p, with_weights=True)
    assert "\n" not in str(ei.value) and str(p) in str(ei.value)


def test_check_trace_against_the_model():
    tr = traces.uniform_trace(2, 2, 16, 4, batch=1)
    traces.check_trace(tr, 16, 4)
    with pytest.raises(UnsupportedError, match="model has 8 experts"):
        traces.check_trace(tr, 8, 4)
    with pytest.raises(UnsupportedError, match="top_k=8"):
        traces.check_trace(tr, 16, 8)


def test_admission_keeps_the_cache_learning_when_the_host_is_faster():
    """Host 10x faster than the link: without admission every miss would go to the host and the pool
    would stay empty. Free slots are filled with the most popular misses; once full, only experts much
    hotter than the layer's resident ones are forced to the copy path."""
    rates = synthetic_rates(expert_bytes=9 << 20, host_gbps=100, copy_gbps=10, per_row_frac=0.0)
    pl = hybrid.Planner(rates)
    for _ in range(10):
        pl.note_routed(0, np.array([1, 2, 3]))
    misses = np.array([1, 2, 9])
    assert pl.admit(0, misses, np.array([], dtype=np.int64), free_slots=2).tolist() == [True, True, False]
    # full pool: resident experts 4, 5 used as often as 1 and 2; 3 is hot against them, 9 is not
    for _ in range(10):
        pl.note_routed(0, np.array([4, 5, 3]))
    forced = pl.admit(0, np.array([3, 9]), np.array([4, 5]), free_slots=0)
    assert forced.tolist() == [False, False]  # 3 is used as often as the resident ones: not forced
    for _ in range(40):
        pl.note_routed(0, np.array([3]))
    assert pl.admit(0, np.array([3, 9]), np.array([4, 5]), free_slots=0).tolist() == [True, False]
    p = pl.plan(np.ones(2, dtype=np.int64), forced_copy=np.array([True, False]))
    assert p.copy.tolist() == [0] and p.host.tolist() == [1]


def test_hybrid_fills_the_pool_although_the_host_is_faster(tmp_path):
    E, k = 12, 4
    cache = make_marlin_cache(tmp_path / "c", experts=E, layers=(0,))
    nb = sum(s.nbytes for s in cache.expert_specs)
    rates = synthetic_rates(expert_bytes=nb, host_gbps=100.0, copy_gbps=1.0, per_row_frac=0.0, split=1, all_=1)
    kern, _ = hybrid.make_host_kernel("auto", threads=1)
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=6)
    fixed = hybrid.Planner(hybrid.CostModel(rates, learn=False))  # the split of these rates, not learned ones
    hy = hybrid.HybridMoE(cache, ec, {1: kern}, fixed, ref_gpu_forward(ec, 64), "cpu", group=64)
    tr = traces.skewed_trace(20, 1, E, k, batch=1, zipf_s=1.5, seed=3)
    for s in range(tr.shape[0]):
        hy.forward(0, torch.randn(1, 256).to(torch.bfloat16), tr[s, 0], torch.full((1, k), 0.25))
    assert (ec.slot_map(0) >= 0).sum() == 6  # the pool filled up
    assert hy.metrics["hits"] > 0 and hy.metrics["host_experts"] > 0
    hy.close()
    cache.close()


# -- the benchmark's wiring (CPU toy size) ---------------------------------------------------------------


def test_bench_moe_hybrid_and_host_only_run_on_cpu(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import json

    import bench_moe

    tr = traces.skewed_trace(4, 4, 16, 4, batch=2, seed=0)
    w = np.full(tr.shape, 0.25, dtype=np.float32)
    trace = traces.write_csv(tr, tmp_path / "t.csv", weights=w)
    out = tmp_path / "out"
    rc = bench_moe.main(["--device", "cpu", "--tiny", "--no-tune", "--out", str(out), "--variants",
                         "vram,mmap-hybrid,host-only", "--workloads", "decode-1,prefill-2k", "--traces", "uniform",
                         "--trace", str(trace), "--run-seconds", "0.05", "--steps", "2",
                         "--host-max-rows", "32"])  # toy prefill: ~64 rows per expert, so the model copies
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    got = {(r["variant"], r["trace"], r["workload"]): r for r in res["rows"]}
    for v in ("mmap-hybrid", "host-only"):
        for t in ("uniform", "file:t"):
            assert got[(v, t, "decode-1")]["tokens_per_s"] > 0, (v, t)
    assert got[("mmap-hybrid", "uniform", "prefill-2k")]["mode"] == "layer"  # the model copies at prefill
    assert "skipped" in got[("host-only", "uniform", "prefill-2k")]
    md = (out / "results.md").read_text()
    assert "## Hybrid (mmap-hybrid)" in md and "Crossover" in md and "Model, not a measurement" in md
    assert res["hybrid_model"]["rows"]


def test_bench_moe_bad_trace_is_one_line(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_moe

    bad = tmp_path / "bad.csv"
    bad.write_text("0,0,1,99,2,3\n")
    assert bench_moe.main(["--device", "cpu", "--tiny", "--out", str(tmp_path / "o"), "--trace", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "routes expert 99" in err and "16 experts" in err


@pytest.mark.gpu
def test_hybrid_equals_all_gpu_on_cuda(tmp_path):
    """On the GPU machine: device slots filled by the real mmap engine, pinned activations down and rows
    up, hits first, copies ordered on the stream; the same tolerance as on CPU. Then a calibration."""
    from mmap_offload.transfer import make_engine

    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    E, k, L, group = 16, 4, (0, 1, 2), 64
    cache = make_marlin_cache(tmp_path / "c", 512, 128, group, experts=E, layers=L)
    nb = sum(s.nbytes for s in cache.expert_specs)
    rates = synthetic_rates(expert_bytes=nb, host_gbps=1.0, copy_gbps=1.0, per_row_frac=0.0, split=4, all_=4)
    kern, _ = hybrid.make_host_kernel("auto", threads=4)
    eng = make_engine("mmap", "cuda", pinned_bytes=16 << 20)
    ec = ExpertCache(cache, eng, "cuda", capacity_experts=10, shared=True)
    fixed = hybrid.Planner(hybrid.CostModel(rates, learn=False))  # the split of these rates, not learned ones
    hy = hybrid.HybridMoE(cache, ec, {4: kern}, fixed, ref_gpu_forward(ec, group), "cuda", group=group)
    ec_ref = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=len(L) * E, shared=True)
    ref = ref_gpu_forward(ec_ref, group)
    tr = traces.skewed_trace(5, len(L), E, k, batch=4, seed=2)
    for s in range(tr.shape[0]):
        x = torch.randn(4, 512, device="cuda").to(torch.bfloat16)
        rw = torch.softmax(torch.randn(4, k, device="cuda"), -1)
        for li, layer in enumerate(L):
            y = hy.forward(layer, x, tr[s, li], rw)
            want = ref(layer, x.cpu(), np.asarray(ec_ref.ensure(layer, tr[s, li])), rw.cpu()).float()
            assert y.is_cuda and (y.float().cpu() - want).abs().max() <= TOL * want.abs().max()
    assert hy.metrics["host_experts"] > 0 and hy.metrics["copied_experts"] > 0 and hy.metrics["hits"] > 0
    r = hybrid.calibrate(cache, eng, "cuda", {4: kern}, group=group, hidden=512, threads_split=4, threads_all=4,
                         n_experts=4, rows_hi=4, reps=2)
    assert r.copy_bw > 0 and r.xfer_s > 0 and r.host_base_s[4] > 0
    hy.close()
    eng.close()
    cache.close()
