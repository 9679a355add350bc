"""The host half of the vLLM hybrid step (vllm_backend/host_experts.py) outside vLLM: experts of a
real W4A16 cache computed on the host from the mapped Marlin words, added to a kernel's output,
against an fp32 reference built from the checkpoint's own packed values; the host rows alone within
one rounding of the activations' dtype (bf16 and fp16), route weights and rows checked one by one;
and the split of the one cost model (host/cost.py) on given rates, its updates from observed jobs
and copies, its calibration, and the exploration of a side not measured in service."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from marlin_reference import unpack_values
from mmap_offload.cache_reader import open_cache
from mmap_offload.checkpoint import open_checkpoint
from mmap_offload.host.cost import CostModel, Rates, calibrate_host
from mmap_offload.synth import PRESETS, make_checkpoint
from mmap_offload.warmup import warmup

pytest.importorskip("mmap_offload.host.kernel")
from mmap_offload.host.kernel import library  # noqa: E402

try:
    library()
except Exception as e:  # noqa: BLE001 - no compiler here: the kernel cannot be built
    pytest.skip(f"host kernel unavailable: {e}", allow_module_level=True)


def _dequant(parts: dict, group: int) -> torch.Tensor:
    """fp32 [N, K] from the checkpoint's compressed-tensors tensors (u = q + 8, per-group scales)."""
    u = torch.from_numpy(unpack_values(parts["weight_packed"]).astype(np.float32))  # [N, K]
    s = parts["weight_scale"].float()  # [N, K/group]
    return (u - 8.0) * s.repeat_interleave(u.shape[1] // s.shape[1], dim=1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("host_experts")
    ckpt_dir = make_checkpoint(tmp / "ckpt", **PRESETS["tiny-mixtral-w4a16"])
    warmup(ckpt_dir, tmp / "cache", device="cpu")
    cache = open_cache(tmp / "cache", tp_rank=0, tp_size=1)
    with open_checkpoint(ckpt_dir) as ckpt:
        layer = ckpt.moe.layers[0]
        ref = {}
        for e in range(ckpt.moe.num_experts):
            parts = {p: {s: ckpt.read(r) for s, r in d.items()} for p, d in ckpt.expert_refs(layer, e).items()}
            ref[e] = {p: _dequant(parts[p], ckpt.quant.group_size) for p in ("gate", "up", "down")}
    yield cache, layer, ref
    cache.close()


def test_host_rows_equal_the_fp32_reference(setup):
    from mmap_offload.vllm_backend.host_experts import HostExperts

    cache, layer, ref = setup
    off = SimpleNamespace(cache=cache, device=torch.device("cpu"))
    he = HostExperts(off, threads=3)
    H = he.hidden
    gen = torch.Generator().manual_seed(0)
    n = 3
    x = he.staging(torch.bfloat16)[:n]
    x.copy_((torch.randn(n, H, generator=gen) * 0.5).to(torch.bfloat16))
    ids = np.array([[0, 1], [2, 3], [1, 2]])
    w = np.array([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]], dtype=np.float32)
    t = SimpleNamespace(index=0, layer=layer)
    he.start(t, x, ids, w, host=np.array([1, 2]))
    base = torch.full((n, H), 0.25, dtype=torch.bfloat16)  # what the GPU kernel returned
    out = he.add_to(t, base.clone())
    want = base.float().clone()
    for i in range(n):
        for j in range(2):
            e = int(ids[i, j])
            if e not in (1, 2):
                continue
            xf = x[i].float()
            h = torch.nn.functional.silu(ref[e]["gate"] @ xf) * (ref[e]["up"] @ xf)
            want[i] += float(w[i, j]) * (ref[e]["down"] @ h)
    # fp32 accumulation, one bf16 rounding of the host rows and one of the sum: bf16 tolerance
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
    assert he.metrics["host_experts"] == 2 and he.host_rate > 0
    assert he.add_to(t, base) is base  # nothing pending: the output is untouched
    he.close()


def _reference_rows(x, ids, w, host, ref):
    """fp32 sum over (token, expert in host) of w * down(silu(gate x) * up x), from the checkpoint."""
    want = torch.zeros(x.shape[0], x.shape[1])
    for i in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            if e in host:
                xf = x[i].float()
                h = torch.nn.functional.silu(ref[e]["gate"] @ xf) * (ref[e]["up"] @ xf)
                want[i] += float(w[i, j]) * (ref[e]["down"] @ h)
    return want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_host_rows_alone_are_one_rounding_from_the_reference(setup, dtype):
    """The host rows by themselves (the GPU kernel's output 0), each (token, expert) weight distinct and
    one token routed to two host experts: every element within the kernel's accuracy of the fp32
    reference: the intermediate's ~16 significant bits (the bf16 hi + lo split) through w2, then one
    rounding to the activations' dtype. A wrong route weight, row, scale or a double add would be off
    by far more (checked: swapping two weights fails)."""
    from mmap_offload.vllm_backend.host_experts import HostExperts

    cache, layer, ref = setup
    he = HostExperts(SimpleNamespace(cache=cache, device=torch.device("cpu")), threads=2)
    H = he.hidden
    gen = torch.Generator().manual_seed(1)
    n = 4
    x = he.staging(dtype)[:n]
    x.copy_((torch.randn(n, H, generator=gen) * 0.5).to(dtype))
    ids = np.array([[0, 1], [2, 3], [1, 2], [3, 0]])
    w = np.array([[0.9, 0.1], [0.7, 0.3], [0.65, 0.35], [0.2, 0.8]], dtype=np.float32)
    host = np.array([0, 1, 2])
    t = SimpleNamespace(index=3, layer=layer)
    he.start(t, x, ids, w, host)
    got = he.add_to(t, torch.zeros(n, H, dtype=dtype)).float()
    want = _reference_rows(x, ids, w, set(host.tolist()), ref)
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # half an ulp, relative
    scale = want.abs().amax(dim=1, keepdim=True)  # per row: the sums' cancellation is bounded by it
    bound = eps * want.abs() + 2.0 ** -14 * scale + 1e-30
    assert ((got - want).abs() <= bound).all(), float(((got - want).abs() / bound).max())
    # the same check catches a swapped route weight (token 2: 0.65 / 0.35 on experts 1 and 2)
    w_swapped = w.copy()
    w_swapped[2] = w[2, ::-1]
    wrong = _reference_rows(x, ids, w_swapped, set(host.tolist()), ref)
    assert not ((got - wrong).abs() <= bound).all()
    # rows of tokens with no host expert stay exactly 0 (nothing added twice or to the wrong row)
    he.start(t, x, ids, w, np.array([3]))
    only3 = he.add_to(t, torch.zeros(n, H, dtype=dtype))
    assert only3[0].abs().sum() == 0 and only3[2].abs().sum() == 0
    he.close()


def _rates(host_s=1e-3, copy_s=1e-3, call_s=0.0, row_s=0.0, copy_lat_s=0.0, nb=1 << 20, th=4):
    return Rates(expert_bytes=nb, host_base_s={th: host_s}, host_row_s={th: row_s}, host_call_s={th: call_s},
                 threads_split=th, threads_all=th, copy_bw=nb / copy_s, copy_lat_s=copy_lat_s, max_host_rows=64)


def test_split_finishes_both_sides_together():
    ones = np.ones(4, dtype=np.int64)
    # host 3x faster per expert than the link: 3 on the host (3 ms), 1 copied (3 ms)
    p = CostModel(_rates(host_s=1e-3, copy_s=3e-3)).plan(ones, hits=1)
    assert p.host.size == 3 and p.copy.size == 1 and p.est_s == pytest.approx(3e-3)
    # equal rates: half and half; a fixed host cost of 2 experts' time moves one to the copy
    assert CostModel(_rates()).plan(ones, hits=1).host.size == 2
    assert CostModel(_rates(call_s=2e-3)).plan(ones, hits=1).host.size == 1
    # a host slower than the link gets nothing while one expert on it takes longer than copying all
    assert CostModel(_rates(host_s=9e-3, copy_s=1e-3)).plan(ones, hits=1).host.size == 0
    assert CostModel(_rates(host_s=1e-3, call_s=3e-3)).plan(ones, hits=1).host.size == 0
    # slower per expert but many misses: both work at once, the host its share h / (h + c) = 1/3
    assert CostModel(_rates(host_s=2e-3, copy_s=1e-3)).plan(np.ones(15, dtype=np.int64), hits=1).host.size == 5
    # prefill / large batches: the per-row cost makes the host lose; beyond max_host_rows never
    rows = np.array([40, 50, 64, 200])
    assert CostModel(_rates(host_s=1e-4, row_s=1e-4, copy_s=1e-3)).plan(rows, hits=1).host.size == 0
    assert 3 not in CostModel(_rates(host_s=1e-6, copy_s=1e-3)).plan(rows, hits=1).host.tolist()
    # fewest rows first: the host takes the cheap ones
    p = CostModel(_rates(host_s=1e-3, copy_s=1e-3, row_s=1e-4)).plan(np.array([9, 1, 5, 1]), hits=1)
    assert sorted(p.host.tolist()) == [1, 3]
    # a side not measured (no copy rate yet): nothing is weighed, everything copied
    r = _rates()
    r.copy_bw = 0.0
    assert CostModel(r).plan(ones, hits=1).host.size == 0


def test_model_learns_fixed_and_per_expert_costs_from_jobs_and_copies():
    m = CostModel(_rates(host_s=1e-3, copy_s=1e-3))  # calibrated: no fixed cost, 1 ms per expert
    rng = np.random.default_rng(0)
    for _ in range(200):  # in service: 0.4 ms per call + 0.6 ms per expert on the host
        k = int(rng.integers(1, 4))
        m.observe_host(4, k, k, 4e-4 + 6e-4 * k)
        m.observe_copy(k, 1e-4 + 2e-4 * k)  # the link: 0.1 ms + 0.2 ms per expert
    r = m.rates
    assert r.host_call_s[4] == pytest.approx(4e-4, rel=0.05) and r.host_base_s[4] == pytest.approx(6e-4, rel=0.05)
    assert r.copy_lat_s == pytest.approx(1e-4, rel=0.05) and r.copy_bw == pytest.approx(r.expert_bytes / 2e-4, rel=0.05)
    # now the link is 3x the host per expert: the host gets (almost) nothing at decode
    assert m.plan(np.ones(3, dtype=np.int64), hits=1).host.size == 0
    # an upper bound that says "slower" is no information; one that says "faster" is used
    before = m.rates.host_s(np.ones(2), 4, False)
    m.observe_host(4, 2, 2, 1.0, upper_bound=True)
    assert m.rates.host_s(np.ones(2), 4, False) == before and m.observed["host_bounds_used"] == 0
    m.observe_host(4, 2, 2, 1e-4, upper_bound=True)
    assert m.rates.host_s(np.ones(2), 4, False) < before and m.observed["host_bounds_used"] == 1


def he_bytes(cache) -> int:
    return sum(s.nbytes for s in cache.expert_specs)


def test_calibration_measures_the_host_at_its_thread_count(setup):
    from mmap_offload.host.kernel import HostKernel

    cache, _, _ = setup
    k = HostKernel(threads=2)
    cal = calibrate_host(cache, {2: k}, group=int(cache.manifest.identity.quantization["group_size"]),
                         hidden=int(cache.spec("w2_weight_packed").shape[-1] // 2), llc=1 << 20)
    assert cal["base"][2] > 0 and cal["call"][2] >= 0 and cal["row"][2] >= 0
    n = cal["notes"]
    total = len(cache.layers) * cache.num_experts
    assert n["pool_experts"] == min(total, max(10, -(-4 * (1 << 20) // he_bytes(cache))))
    assert n["host"][2]["gbps_streamed"] > 0
    k.close()


def test_split_explores_a_side_not_measured_then_follows_the_model(setup):
    from mmap_offload.vllm_backend.host_experts import HostExperts

    cache, _, _ = setup
    he = HostExperts(SimpleNamespace(cache=cache, device=torch.device("cpu")), threads=1)
    assert he.threads in he.model.rates.host_base_s  # calibrated when made
    misses, tokens = np.array([3, 5, 7, 9]), np.array([4, 1, 1, 2])
    host, copy = he.split(misses, tokens)  # the link not measured yet: the cheapest miss is tried
    assert host.tolist() == [5] and copy.tolist() == [3, 7, 9] and he.metrics["explored"] == 1
    # both sides seen; a link 9x the host: nothing to the host until EXPLORE_EVERY idle calls
    r = he.model.rates
    nb = he.expert_nbytes
    r.host_base_s[1], r.host_row_s[1], r.host_call_s[1] = 9e-3, 0.0, 0.0
    he.model = CostModel(r)
    he.model.observed.update(host=1, copy=1)
    r.copy_bw, r.copy_lat_s = nb / 1e-3, 0.0
    for _ in range(he.EXPLORE_EVERY - 1):
        assert he.split(misses, tokens)[0].size == 0
    assert he.split(misses, tokens)[0].tolist() == [5] and he.metrics["explored"] == 2
    # a host 3x the link: three quarters of the misses
    r.host_base_s[1] = 1e-3 / 3
    host, copy = he.split(misses, tokens)
    assert len(host) == 3 and copy.tolist() == [3]
    he.close()


def test_default_threads_leave_the_copy_engine_its_cores(monkeypatch, tmp_path):
    from mmap_offload.vllm_backend import host_experts

    from mmap_offload import cpus

    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    monkeypatch.setattr(cpus, "SYSFS", tmp_path)  # no topology: each CPU a core
    assert host_experts.default_threads(1) == 16
    assert host_experts.default_threads(1, engine_threads=8) == 7  # 16 - 8 copy threads - 1 launching
    assert host_experts.default_threads(2, engine_threads=4) == 3
    assert host_experts.default_threads(4, engine_threads=8) == 1


def test_the_stream_paths_kernel_counts_the_callback_thread_that_joins(setup, monkeypatch, tmp_path):
    """Python path: the kernel has one thread more than the computing count (the launching thread
    joins at add_to, when it has nothing to launch). Stream path: CUDA's callback thread joins while
    vLLM's thread launches on, so the count is the kernel's whole. 16 cores, 6 copy threads (hybrid's
    default): with ``hybrid_share`` 1 (the default) the stream path's copy threads copy only the pool's
    admissions, so at most 3 of them are counted -> 12 computing threads; with the share adapted (-1)
    or held below 1 -> 9, the 16th core left to the launching thread; 8 copy threads -> 7 (3 counted at
    share 1 -> 12); 2 copy threads -> 13. The Python path never reads the share: 9 / 7 / 13.
    ``host_spin_us`` (how long idle threads spin) reaches the kernel's pool."""
    from mmap_offload.vllm_backend import host_experts
    from mmap_offload.vllm_backend.options import MmapOptions

    from mmap_offload import cpus

    cache, _, _ = setup
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    monkeypatch.setattr(cpus, "SYSFS", tmp_path)  # no topology: each CPU a core
    cases = ((dict(), 9, 12), (dict(hybrid_share=-1), 9, 9), (dict(hybrid_share=0.5), 9, 9),
             (dict(threads=8), 7, 12), (dict(threads=8, hybrid_share=-1), 7, 7), (dict(threads=2), 13, 13))
    for kw, python_path, stream_path in cases:
        off = SimpleNamespace(cache=cache, device=torch.device("cpu"), tp_size=1, options=MmapOptions(hybrid=True, **kw))
        for stream, computing, kernel_threads in ((False, python_path, python_path + 1), (True, stream_path, stream_path)):
            he = host_experts.HostExperts(off, calibrate=False, populate=False, stream=stream)
            assert (he.threads, he.kernel.threads) == (computing, kernel_threads), (kw, stream)
            assert he.kernel.spin_us == 1000.0  # the option's default reaches the pool
            he.close()
    off = SimpleNamespace(cache=cache, device=torch.device("cpu"), tp_size=1,
                          options=MmapOptions(hybrid=True, host_threads=5))
    he = host_experts.HostExperts(off, threads=5, calibrate=False, populate=False, stream=True)  # as residency.py passes it
    assert he.threads == 5  # an explicit count is kept whatever the share
    he.close()
    off = SimpleNamespace(cache=cache, device=torch.device("cpu"), tp_size=1,
                          options=MmapOptions(hybrid=True, host_spin_us=40.0))
    he = host_experts.HostExperts(off, calibrate=False, populate=False, stream=True)
    assert he.kernel.spin_us == 40.0 and he.kernel._lib.mo_host_set_spin(he.kernel._pool, -1) == 40_000
    he.close()


def _mapped_bytes(arr: np.ndarray) -> int:
    """Rss of the mapping that holds ``arr`` (/proc/self/smaps): its pages with page tables set up."""
    addr = arr.ctypes.data
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    return -1


def test_mappings_are_populated_in_the_background_or_by_the_job(setup):
    """Page tables (the mapping's Rss in /proc/self/smaps): the whole layer after the background
    pass; without it, the pages of the one expert a job used."""
    from mmap_offload.vllm_backend.host_experts import HostExperts

    layer = setup[1]
    cache = open_cache(setup[0].dir, tp_rank=0, tp_size=1)  # fresh mappings
    lazy_cache = open_cache(setup[0].dir, tp_rank=0, tp_size=1)
    if _mapped_bytes(cache.layer_buffer(layer)) < 0:
        pytest.skip("no /proc/self/smaps")
    nbytes = int(cache.layer_buffer(layer).nbytes)
    off = SimpleNamespace(cache=cache, device=torch.device("cpu"))
    he = HostExperts(off, threads=1, calibrate=False)
    he._populator.join()
    assert he.metrics["populated_layers"] == len(cache.layers)
    assert _mapped_bytes(cache.layer_buffer(layer)) >= nbytes - 4096
    he.close()
    # without the background pass the job maps the pages of the experts it uses, and only those
    lazy = HostExperts(SimpleNamespace(cache=lazy_cache, device=torch.device("cpu")), threads=1, calibrate=False,
                       populate=False)
    assert _mapped_bytes(lazy_cache.layer_buffer(layer)) < nbytes // 2
    x = lazy.staging(torch.bfloat16)[:1]
    x.zero_()
    t = SimpleNamespace(index=0, layer=layer)
    lazy.start(t, x, np.array([[1, 2]]), np.array([[0.5, 0.5]], dtype=np.float32), np.array([1]))
    lazy.add_to(t, torch.zeros(1, lazy.hidden, dtype=torch.bfloat16))
    assert lazy.metrics["populated_experts"] == 1
    ext = lazy_cache.expert_extent(layer, 1)
    assert _mapped_bytes(lazy_cache.layer_buffer(layer)) >= ext.nbytes - 4096
    lazy.close()
    cache.close()
    lazy_cache.close()


def test_every_job_and_copy_updates_the_model(setup):
    """As the backend drives it: start (host job), note_copy (the call's copies), add_to (the rows):
    the model sees the copy (the link, through the origin at first), the gap between the copies' end
    and the add (vLLM's launches), and the host job (exact when add_to waited, else a bound)."""
    from mmap_offload.vllm_backend.host_experts import HostExperts

    cache, layer, _ = setup
    he = HostExperts(SimpleNamespace(cache=cache, device=torch.device("cpu")), threads=1)
    nb = he.expert_nbytes
    x = he.staging(torch.bfloat16)[:2]
    x.normal_()
    t = SimpleNamespace(index=1, layer=layer)
    he.start(t, x, np.array([[0, 1], [1, 2]]), np.full((2, 2), 0.5, dtype=np.float32), np.array([1]))
    he.note_copy(2 * nb, 1e-3)
    he.add_to(t, torch.zeros(2, he.hidden, dtype=torch.bfloat16))
    seen = he.model.observed
    assert seen["copy"] == 1 and seen["gap"] == 1 and seen["host"] + seen["host_bounds"] == 1
    assert he.copy_rate == pytest.approx(2 * nb / 1e-3)
    assert he.summary()["observed"] == seen and he.summary()["threads"] == 1
    # a copy noted with no job of this call pending gives no gap to the next job's add
    he.note_copy(nb, 1e-3)
    he.start(t, x, np.array([[0, 1], [1, 2]]), np.full((2, 2), 0.5, dtype=np.float32), np.array([2]))
    he.add_to(t, torch.zeros(2, he.hidden, dtype=torch.bfloat16))
    assert he.model.observed["gap"] == 1
    he.close()


def test_host_job_runs_on_the_kernels_threads_while_the_caller_works(setup):
    """W4A16: the job starts on the kernel's own threads (HostKernel.experts_mlp_start), not in a Python
    thread that would need the GIL the caller holds while it launches the layer's GPU work. The caller
    here spins in Python (holding the GIL) far longer than the job takes; the job was done without it
    (ready), and the rows equal those of a job collected at once. A job left pending by a failed step
    is dropped by the next start."""
    import time

    from mmap_offload.vllm_backend.host_experts import HostExperts

    cache, layer, _ = setup
    off = SimpleNamespace(cache=cache, device=torch.device("cpu"))
    he = HostExperts(off, threads=3, calibrate=False, populate=False)
    H = he.hidden
    x = he.staging(torch.bfloat16)[:2]
    x.copy_((torch.randn(2, H, generator=torch.Generator().manual_seed(1)) * 0.5).to(torch.bfloat16))
    ids, w = np.array([[0, 1], [1, 2]]), np.full((2, 2), 0.5, dtype=np.float32)
    t = SimpleNamespace(index=0, layer=layer)
    he.start(t, x, ids, w, np.array([1]))
    want = he.add_to(t, torch.zeros(2, H, dtype=torch.bfloat16))
    he.start(t, x, ids, w, np.array([1]))
    job = he._pending[0]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:  # Python holding the GIL, as vLLM's launches do
        pass
    got = he.add_to(t, torch.zeros(2, H, dtype=torch.bfloat16))
    assert job.call.ready and job.call.seconds < 0.3
    assert torch.equal(got, want)
    he.start(SimpleNamespace(index=1, layer=layer), x, ids, w, np.array([1]))  # its add_to never comes
    he.start(t, x, ids, w, np.array([1]))
    assert list(he._pending) == [0] and torch.equal(he.add_to(t, torch.zeros(2, H, dtype=torch.bfloat16)), want)
    he.close()


@pytest.mark.parametrize("preset,kind", [("tiny-mixtral-w4a16", "w4a16"), ("tiny-mixtral", "unquantized")])
def test_a_layer_file_truncated_under_the_host_job_is_one_cache_error(tmp_path, preset, kind):
    """The Python hybrid path: a host job whose experts' file was truncated while mapped fails in add_to with
    one CacheError line naming the file, the layer, the expert (and the tensor); the process lives and the
    next job computes. W4A16: the kernel's threads read inside its SIGBUS guard. bf16 (torch on the mapped
    views): each job first reads a byte of every page of its experts inside the same guard."""
    import os

    from mmap_offload.errors import CacheError
    from mmap_offload.vllm_backend.host_experts import HostExperts

    ckpt_dir = make_checkpoint(tmp_path / "ckpt", **PRESETS[preset])
    warmup(ckpt_dir, tmp_path / "cache", device="cpu")
    cache = open_cache(tmp_path / "cache", tp_rank=0, tp_size=1)
    he = HostExperts(SimpleNamespace(cache=cache, device=torch.device("cpu")), threads=2, calibrate=False,
                     populate=False)
    try:
        assert he.kind == kind
        layer = cache.layers[0]
        t = SimpleNamespace(index=0, layer=layer)
        x = he.staging(torch.bfloat16)[:2]
        x.copy_(torch.randn(2, he.hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
        ids, w = np.array([[0, 1], [1, 2]]), np.full((2, 2), 0.5, dtype=np.float32)
        he.start(t, x, ids, w, host=np.array([1, 2]))
        assert he.add_to(t, torch.zeros(2, he.hidden, dtype=torch.bfloat16)).abs().sum() > 0
        os.truncate(cache.layer_file(layer), 0)
        he.start(t, x, ids, w, host=np.array([1, 2]))
        with pytest.raises(CacheError) as err:
            he.add_to(t, torch.zeros(2, he.hidden, dtype=torch.bfloat16))
        msg = str(err.value)
        assert str(cache.layer_file(layer)) in msg and f"(layer {layer} expert " in msg and "SIGBUS" in msg, msg
        assert "\n" not in msg and "--repair" in msg
        t1 = SimpleNamespace(index=1, layer=cache.layers[1])  # the next job, on a whole file, computes
        he.start(t1, x, ids, w, host=np.array([1, 2]))
        assert he.add_to(t1, torch.zeros(2, he.hidden, dtype=torch.bfloat16)).abs().sum() > 0
    finally:
        he.close()
        cache.close()
