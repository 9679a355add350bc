"""mmap_offload.host.kernel: W4A16 expert MLPs on the host from Marlin words, against an fp32 reference.

The reference never reads Marlin words: it dequantises the checkpoint-side values (pack-quantized
``weight_packed`` unpacked by tests/marlin_reference.py, ``(u - 8) * weight_scale``) and computes
``down(silu(gate(x)) * up(x))`` in fp32. The kernel reads what the project's layout writes into the cache
(``MarlinW4A16Layout.transform_expert``: repacked words, permuted scales), which test_layout checks
against vLLM's own processing.

Tolerance, and why: the kernel accumulates in fp32 (another order than torch's matmul: relative
differences ~1e-6) and rounds once to the output dtype. One rounding costs at most half an ulp: 2^-9 of
the value in bf16, 2^-11 in fp16. The check is |y - ref| <= rtol * |ref| + atol with rtol = 2^-8 (bf16)
/ 2^-10 (fp16), i.e. twice the rounding, and atol = 2^-12 * max|ref| (bf16) / 2^-14 (fp16) for
elements near zero, where the fp32 sums' cancellation, not the rounding, dominates.

Each ISA path is forced in turn; a path this CPU lacks is skipped with the reason (no test depends on
the CPU's instruction set: ``plain`` always runs).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from mmap_offload.checkpoint import QuantScheme
from mmap_offload.errors import UnsupportedError
from mmap_offload.host import kernel as hk
from mmap_offload.host.kernel import ISAS, HostKernel, available_isas, dequantize_marlin
from mmap_offload.layout import layout_for

from marlin_reference import random_expert, unpack_values, vllm_expert

try:
    AVAILABLE = available_isas()
except UnsupportedError as e:  # no compiler here: the module's tests cannot run
    pytest.skip(f"mo_host library not available: {e}", allow_module_level=True)


def isa_param(isa: str):
    return pytest.param(isa, marks=pytest.mark.skipif(isa not in AVAILABLE, reason=f"this CPU lacks the {isa} "
                                                      f"path (has {', '.join(AVAILABLE)})"), id=isa)


ISA_PARAMS = [isa_param(i) for i in ISAS]


@functools.lru_cache(maxsize=None)
def kernel(threads: int, isa: str) -> HostKernel:
    return HostKernel(threads=threads, isa=isa)


@functools.lru_cache(maxsize=None)
def expert(hidden: int, inter: int, group: int, seed: int = 0, scale_dtype: torch.dtype = torch.bfloat16):
    """(cache tensors of one expert, fp32 reference weights gate [I, H], up [I, H], down [H, I])."""
    gen = torch.Generator().manual_seed(1000 * seed + hidden + inter + group)
    ex = random_expert(hidden, inter, group, False, gen, scale_dtype=scale_dtype)
    quant = QuantScheme.w4a16(group_size=group, scale_dtype=scale_dtype)
    cache = layout_for(quant).transform_expert(ex, quant, 0, 1, "cpu")

    def ref(p):  # checkpoint orientation [N, K]: (u - 8) * scale of (n, k // g)
        u = torch.from_numpy(unpack_values(p["weight_packed"])).float() - 8.0
        s = p["weight_scale"].float()
        return u * s.repeat_interleave(u.shape[1] // s.shape[1], dim=1)

    return cache, (ref(ex["gate"]), ref(ex["up"]), ref(ex["down"]))


def ref_mlp(x: torch.Tensor, weights) -> torch.Tensor:
    gate, up, down = weights
    xf = x.float()
    return (torch.nn.functional.silu(xf @ gate.T) * (xf @ up.T)) @ down.T


def assert_close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = (2.0**-8, 2.0**-12) if dtype == torch.bfloat16 else (2.0**-10, 2.0**-14)
    atol *= float(ref.abs().max())
    err = (y.float() - ref).abs()
    bad = err > rtol * ref.abs() + atol
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off; worst {float(err.max()):.3g} "
                           f"(max |ref| {float(ref.abs().max()):.3g})")


def args(cache):
    return (cache["w13_weight_packed"], cache["w13_weight_scale"], cache["w2_weight_packed"],
            cache["w2_weight_scale"])


def rand_x(m: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


# every layout edge the repack supports: groups, channelwise, I == group (w2's 32-chunk scale
# permutation), H == group (w13's one group, still the grouped permutation: vLLM's size_k = 4I quirk),
# small and non-square shapes
SHAPES = [  # hidden, inter, group
    (256, 128, 32),
    (256, 192, 64),
    (384, 256, 128),
    (256, 128, -1),
    (128, 128, 128),   # I == group and H == group
    (256, 64, 64),     # I == group
    (640, 128, 128),   # I == group, H of 5 tiles
]


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-I{}-g{}".format(*s))
def test_every_layout_edge(isa, shape):
    hidden, inter, group = shape
    cache, weights = expert(hidden, inter, group)
    k = kernel(3, isa)
    for m in (1, 3, 8, 16):
        x = rand_x(m, hidden, torch.bfloat16, seed=m)
        y = k.expert_mlp(x, *args(cache), group=group)
        assert y.dtype == torch.bfloat16 and y.shape == (m, hidden)
        assert_close(y, ref_mlp(x, weights), torch.bfloat16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dtypes_and_many_rows(isa, dtype):
    """fp16 activations with fp16 scales; M = 20 and 33 (more than 16 rows: slower, still right). x is
    scaled down so that the outputs of random 4-bit weights stay inside fp16's range."""
    cache, weights = expert(256, 128, 64, scale_dtype=dtype)
    assert cache["w13_weight_scale"].dtype == dtype
    k = kernel(2, isa)
    for m in (2, 20, 33):
        x = (0.02 * rand_x(m, 256, torch.float32, seed=5 + m)).to(dtype)
        y = k.expert_mlp(x, *args(cache), group=64)
        assert y.dtype == dtype
        assert_close(y, ref_mlp(x, weights), dtype)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_job_of_more_rows_than_1024(isa):
    """M = 1100 rows in one job (prefill-sized): each thread's row pointers live in its scratch, sized when
    the call is prepared (before session 38 a worker malloc'd them past 1024 rows, and a worker whose
    malloc failed skipped its share, so the call waited for ever)."""
    cache, weights = expert(128, 128, 128)
    k = kernel(3, isa)
    x = (0.25 * rand_x(1100, 128, torch.float32, seed=90)).to(torch.bfloat16)
    assert_close(k.expert_mlp(x, *args(cache), group=128), ref_mlp(x, weights), torch.bfloat16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_odd_thread_counts(isa, threads):
    cache, weights = expert(384, 256, 128)
    k = kernel(threads, isa)
    assert k.threads == threads and k.isa == isa
    x = rand_x(5, 384, torch.bfloat16, seed=threads)
    assert_close(k.expert_mlp(x, *args(cache), group=128), ref_mlp(x, weights), torch.bfloat16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("threads", [1, 5])
def test_long_segments_and_partial_tiles(isa, threads):
    """More gate/up pairs (18) and output tiles (6) than one segment holds at M = 1 (16 tiles), so a
    unit's column range is cut into several segments; with 5 threads the ranges narrow (fewer k chunks
    than the units wanted). Channelwise scales too (the other scale permutation)."""
    for group in (128, -1):
        cache, weights = expert(384, 1152, group)
        k = kernel(threads, isa)
        for m in (1, 9, 16):
            x = rand_x(m, 384, torch.bfloat16, seed=60 + m)
            assert_close(k.expert_mlp(x, *args(cache), group=group), ref_mlp(x, weights), torch.bfloat16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_k_chunks(isa, group):
    """K split into chunks (csrc/host_kernel.c, plan_matrix: >= 256 m rows of k each) whose partial sums are
    added in chunk order: w13 of H 1024 in 4 chunks at M = 1 and 2 at M = 2, w2 of I 640 in 2 uneven ones
    (5 blocks of 128) at M = 1; chunk starts on scale-group rows for every group size. The bytes do not
    depend on the thread count (the chunks are the matrix's, not the threads')."""
    cache, weights = expert(1024, 640, group)
    one, five = kernel(1, isa), kernel(5, isa)
    for m in (1, 2, 3):
        x = rand_x(m, 1024, torch.bfloat16, seed=80 + m)
        y = five.expert_mlp(x, *args(cache), group=group)
        assert_close(y, ref_mlp(x, weights), torch.bfloat16)
        assert torch.equal(y, one.expert_mlp(x, *args(cache), group=group))


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_jobs_with_fewer_rows_than_the_largest(isa):
    """Jobs of one call with different row counts (8 and 9, 16 and 33): a job with fewer rows than the
    call's largest takes longer segments, and its scratch must still fit (sized for every m <= the max)."""
    hidden, inter, group = 256, 1152, 128
    experts = [expert(hidden, inter, group, seed=s) for s in range(2)]
    k = kernel(1, isa)
    x = rand_x(40, hidden, torch.bfloat16, seed=70)
    for counts in ((8, 9), (16, 33)):
        rows = [list(range(c)) for c in counts]
        out = torch.zeros_like(x)
        k.experts_mlp(x, [(r, *args(c), group, None) for r, (c, _) in zip(rows, experts)], out)
        ref = torch.zeros(x.shape)
        for r, (_, weights) in zip(rows, experts):
            ref[r] += ref_mlp(x[r], weights)
        assert_close(out, ref, torch.bfloat16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_accumulate_weight(isa):
    cache, weights = expert(256, 128, 32)
    k = kernel(3, isa)
    x = rand_x(4, 256, torch.bfloat16, seed=11)
    base = rand_x(4, 256, torch.bfloat16, seed=12)
    out = base.clone()
    got = k.expert_mlp(x, *args(cache), group=32, out=out, accumulate_weight=0.375)
    assert got is out
    assert_close(out, base.float() + 0.375 * ref_mlp(x, weights), torch.bfloat16)
    with pytest.raises(ValueError, match="accumulate_weight needs out"):
        k.expert_mlp(x, *args(cache), group=32, accumulate_weight=0.5)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_experts_mlp_equals_a_loop_of_expert_mlp(isa):
    """Several jobs of one layer, rows shared between jobs (top-2), a job without rows, list and
    LongTensor rows: one call equals expert_mlp per job summed with its routing weights."""
    hidden, inter, group = 256, 128, 64
    experts = [expert(hidden, inter, group, seed=s) for s in range(4)]
    k = kernel(3, isa)
    x = rand_x(6, hidden, torch.bfloat16, seed=21)
    plan = [([0, 2, 5], [0.5, 0.25, 0.75]), (torch.tensor([1, 2, 3, 4]), [0.5, 0.75, 0.125, 1.0]),
            ([], []), ([0, 1, 5, 3], [0.5, 0.5, 0.25, 0.625])]
    base = rand_x(6, hidden, torch.bfloat16, seed=22)
    out = base.clone()
    jobs = [(rows, *args(c), group, torch.tensor(w)) for (rows, w), (c, _) in zip(plan, experts)]
    k.experts_mlp(x, jobs, out)
    loop = base.clone()
    ref = base.float()
    for (rows, w), (c, weights) in zip(plan, experts):
        rows_t = torch.as_tensor(rows, dtype=torch.int64)
        for r, wr in zip(rows_t.tolist(), w):
            loop[r:r + 1] = k.expert_mlp(x[r:r + 1], *args(c), group=group, out=loop[r:r + 1].clone(),
                                         accumulate_weight=wr)
        if len(rows_t):
            ref[rows_t] += torch.tensor(w)[:, None] * ref_mlp(x[rows_t], weights)
    assert_close(out, ref, torch.bfloat16)  # one rounding per row
    # the loop rounds after every job: up to three roundings on a row
    err = (loop.float() - out.float()).abs()
    assert (err <= 3 * 2.0**-8 * ref.abs() + 2.0**-10 * ref.abs().max()).all()
    untouched = base.clone()
    k.experts_mlp(x, [], untouched)
    assert torch.equal(untouched, base)


def test_isas_agree_closely():
    """Every available path gives the same result up to the accumulation order: a bf16 ulp either way
    (2^-7 relative), or 2^-11 of the largest output near zero."""
    cache, _ = expert(384, 256, 128)
    x = rand_x(8, 384, torch.bfloat16, seed=31)
    ys = {isa: kernel(2, isa).expert_mlp(x, *args(cache), group=128).float() for isa in AVAILABLE}
    for isa, y in ys.items():
        p = ys["plain"]
        assert ((y - p).abs() <= 2.0**-7 * p.abs() + 2.0**-11 * p.abs().max()).all(), isa


@pytest.mark.skipif("avxvnni" not in AVAILABLE, reason="this CPU lacks AVX-VNNI")
def test_avxvnni_is_the_avx2_scheme_bit_for_bit():
    """The avxvnni path is the avx2 one with vpdpbusd in place of vpmaddubsw and its 16-bit sums: the same
    exact integer sums, the same fp32 steps after them, so the same bytes out (M 1 and 3: one and two
    rows per register pass; group 128 and channelwise)."""
    for group in (128, -1):
        cache, _ = expert(384, 256, group)
        for m in (1, 3):
            x = rand_x(m, 384, torch.bfloat16, seed=7 + m)
            a = kernel(2, "avx2").expert_mlp(x, *args(cache), group=group)
            b = kernel(2, "avxvnni").expert_mlp(x, *args(cache), group=group)
            assert torch.equal(a, b), (group, m)


def test_views_of_a_dropped_mapping(tmp_path):
    """The tensors are zero-copy views of a file mapping whose pages were dropped from the page cache
    (posix_fadvise DONTNEED): the kernel faults them in, reads them in place, and the result is right."""
    hidden, inter, group = 384, 256, 128
    cache, weights = expert(hidden, inter, group)
    names = ["w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"]
    path = tmp_path / "expert.bin"
    offsets, off = {}, 0
    with open(path, "wb") as f:
        for n in names:
            raw = cache[n].contiguous().view(torch.uint8).numpy().tobytes()
            offsets[n] = (off, len(raw))
            f.write(raw)
            pad = (-len(raw)) % 4096
            f.write(b"\0" * pad)
            off += len(raw) + pad
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    mm = np.memmap(path, dtype=np.uint8, mode="c")  # private mapping, as cache_reader maps
    views = {}
    for n in names:
        o, nb = offsets[n]
        views[n] = torch.frombuffer(mm, dtype=torch.uint8, offset=o, count=nb).view(cache[n].dtype).view(cache[n].shape)
    assert views["w13_weight_packed"].data_ptr() == mm.ctypes.data  # a view, not a copy
    x = rand_x(3, hidden, torch.bfloat16, seed=41)
    y = kernel(3, AVAILABLE[0]).expert_mlp(x, *(views[n] for n in names), group=group)
    assert_close(y, ref_mlp(x, weights), torch.bfloat16)


def test_dequantize_marlin_matches_the_reference():
    for hidden, inter, group in [(256, 128, 32), (256, 128, -1), (128, 128, 128)]:
        cache, (gate, up, down) = expert(hidden, inter, group)
        w13 = dequantize_marlin(cache["w13_weight_packed"], cache["w13_weight_scale"], hidden, 2 * inter, group,
                                grouped_perm=group != -1)
        assert torch.equal(w13, torch.cat([gate, up]).T)
        w2 = dequantize_marlin(cache["w2_weight_packed"], cache["w2_weight_scale"], inter, hidden, group)
        assert torch.equal(w2, down.T)


def test_layout_words_equal_vllms_model():
    """The words the tests feed the kernel are vLLM's (marlin_reference's slow model of its processing)."""
    gen = torch.Generator().manual_seed(3)
    ex = random_expert(128, 64, 64, False, gen)
    quant = QuantScheme.w4a16(group_size=64)
    ours = layout_for(quant).transform_expert(ex, quant, 0, 1, "cpu")
    theirs = vllm_expert(ex["gate"], ex["up"], ex["down"], 64, False, 0, 1)
    for n in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"):
        assert torch.equal(ours[n], theirs[n]), n


def test_refusals(monkeypatch):
    cache, _ = expert(256, 128, 64)
    k = kernel(1, "plain")
    x = rand_x(2, 256, torch.bfloat16)
    with pytest.raises(UnsupportedError, match="unknown host kernel ISA"):
        HostKernel(threads=1, isa="sse9")
    with pytest.raises(ValueError, match="s13"):  # scales of another group size
        k.expert_mlp(x, *args(cache), group=32)
    with pytest.raises(ValueError, match="does not fit H"):
        k.expert_mlp(rand_x(2, 128, torch.bfloat16), *args(cache), group=64)
    w13, s13, w2, s2 = args(cache)
    with pytest.raises(UnsupportedError, match="act-order"):  # w2 scales whole-I, as act-order + TP keeps them
        k.expert_mlp(x, w13, s13, w2, torch.cat([s2, s2]), group=64)
    with pytest.raises(ValueError, match="rows must index"):
        k.experts_mlp(x, [([0, 2], w13, s13, w2, s2, 64, [1.0, 1.0])], x.clone())

    class Lacking:  # a CPU without the SIMD paths: forcing one is refused with the reason
        def __init__(self, lib):
            self._lib = lib

        def mo_host_isa_available(self, code):
            return int(code == 0)

        def __getattr__(self, name):
            return getattr(self._lib, name)

    monkeypatch.setattr(hk, "library", lambda real=hk.library(): Lacking(real))
    assert available_isas() == ["plain"]
    for isa in ("avx512vnni", "avx512vnni-novbmi", "avx512bw", "avx2"):
        with pytest.raises(UnsupportedError, match=f"{isa} path needs CPU features"):
            HostKernel(threads=1, isa=isa)
    monkeypatch.setenv("MMAP_OFFLOAD_HOST_ISA", "avx2")
    with pytest.raises(UnsupportedError, match="avx2 path"):
        HostKernel(threads=1)
    monkeypatch.setenv("MMAP_OFFLOAD_HOST_ISA", "plain")
    assert HostKernel(threads=1).isa == "plain"
    monkeypatch.delenv("MMAP_OFFLOAD_HOST_ISA")
    assert HostKernel(threads=1).isa == "plain"  # auto: the widest this "CPU" has


def test_calls_from_several_python_threads():
    """One kernel shared by Python threads: calls are serialised inside (one pool), each result right."""
    import threading

    cache, weights = expert(384, 256, 128)
    k = HostKernel(threads=3, isa=AVAILABLE[0])
    xs = [rand_x(m, 384, torch.bfloat16, seed=50 + m) for m in (1, 2, 3, 4)]
    got: dict[int, torch.Tensor] = {}

    def work(i):
        for _ in range(5):
            got[i] = k.expert_mlp(xs[i], *args(cache), group=128)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, x in enumerate(xs):
        assert_close(got[i], ref_mlp(x, weights), torch.bfloat16)
    k.close()
    with pytest.raises(RuntimeError, match="closed"):
        k.expert_mlp(xs[0], *args(cache), group=128)


@pytest.mark.parametrize("spin_us", [0.0, 1000.0], ids=["sleep-at-once", "spin-1ms"])
def test_late_workers_never_touch_a_finished_call(spin_us):
    """A call completes when its work is done, not when every worker has woken (csrc/host_kernel.c,
    pool_finish): workers woken late skip a closed call. More threads than CPUs, with pauses between calls
    so that workers fall asleep and wake late (spin_us=0: asleep after every call), and calls of different
    sizes back to back (a late worker taking a finished call's counters would compute the wrong units or
    write a stale output): every result equals the one-thread kernel's bytes."""
    import time

    shapes = [(384, 256, 128), (256, 128, 32)]
    experts = {s: [expert(*s, seed=i)[0] for i in range(3)] for s in shapes}
    one = HostKernel(threads=1, isa=AVAILABLE[0])
    many = HostKernel(threads=2 * (os.cpu_count() or 2) + 1, isa=AVAILABLE[0], spin_us=spin_us)
    for i in range(120):
        H, I, g = shapes[i % 2]
        n_jobs = 1 + i % 3
        x = rand_x(1 + i % 4, H, torch.bfloat16, seed=i)
        rows = torch.arange(x.shape[0])
        jobs = [(rows, *args(experts[(H, I, g)][j]), g, None) for j in range(n_jobs)]
        want, got = torch.zeros_like(x), torch.zeros_like(x)
        one.experts_mlp(x, jobs, want)
        many.experts_mlp(x, jobs, got)
        assert torch.equal(got, want), f"call {i}"
        if i % 3 == 0:
            time.sleep(0.002)  # the workers' spin (spin_us) ends: they sleep and are woken next call
    one.close()
    many.close()


def test_spin_time_is_set_per_kernel_and_checked(monkeypatch):
    """spin_us (how long idle workers spin before they sleep) reaches the pool: given, from
    $MMAP_OFFLOAD_HOST_SPIN_US, or SPIN_US; a bad value is refused with the fix."""
    lib = hk.library()
    monkeypatch.delenv("MMAP_OFFLOAD_HOST_SPIN_US", raising=False)
    k = HostKernel(threads=2, isa="plain")
    assert k.spin_us == hk.SPIN_US and lib.mo_host_set_spin(k._pool, -1) == int(hk.SPIN_US * 1000)
    k.close()
    k = HostKernel(threads=2, isa="plain", spin_us=250)
    assert lib.mo_host_set_spin(k._pool, -1) == 250_000  # -1 reads it
    k.close()
    monkeypatch.setenv("MMAP_OFFLOAD_HOST_SPIN_US", "40")
    k = HostKernel(threads=2, isa="plain")
    assert k.spin_us == 40.0 and lib.mo_host_set_spin(k._pool, -1) == 40_000
    k.close()
    monkeypatch.setenv("MMAP_OFFLOAD_HOST_SPIN_US", "fast")
    with pytest.raises(UnsupportedError, match="MMAP_OFFLOAD_HOST_SPIN_US='fast' is not a number"):
        HostKernel(threads=2, isa="plain")
    for bad in (-1, float("nan"), 2e6):
        with pytest.raises(UnsupportedError, match=r"spin_us must be in \[0, 1000000\]"):
            HostKernel(threads=2, isa="plain", spin_us=bad)


def test_diag_counts_the_calls_and_their_time_in_c():
    """diag(): the calls since the last read (then zeroed) and where their time in C went; the parts add
    up (prep + run + finish = the time in C); per-thread sums only in a -DDIAG_TIMING build."""
    experts = [expert(384, 256, 128, seed=i)[0] for i in range(2)]
    x = rand_x(2, 384, torch.bfloat16, seed=11)
    k = HostKernel(threads=3, isa=AVAILABLE[0])
    k.diag()
    for _ in range(5):
        k.experts_mlp(x, _jobs_of(experts, x, 128), torch.zeros_like(x))
    k.experts_mlp_start(x, _jobs_of(experts, x, 128), torch.zeros_like(x)).wait()
    k.experts_mlp(x, [], torch.zeros_like(x))  # nothing to compute: not a call of the pool
    d = k.diag()
    assert d["calls"] == 6 and "threads" not in d
    assert d["c_us"] > 0 and min(d["prep_us"], d["run_us"], d["finish_us"]) >= 0
    assert d["prep_us"] + d["run_us"] + d["finish_us"] == pytest.approx(d["c_us"], rel=1e-6, abs=1e-3)
    assert k.diag()["calls"] == 0  # read and zeroed
    call = k.experts_mlp_start(x, _jobs_of(experts, x, 128), torch.zeros_like(x))
    if k.threads > 1:
        with pytest.raises(RuntimeError, match="between calls"):
            k.diag()
    call.wait()
    assert k.diag()["calls"] == 1
    k.close()


def test_a_diag_timing_build_splits_the_threads_time_and_keeps_the_bytes(tmp_path):
    """csrc/host_kernel.c built with -DDIAG_TIMING (scripts/host_kernel_sweep.sh) reports per thread the
    calls it joined, its time in units, sums and waits (parts of it) and the units it took, every call's
    units counted once; its outputs are the default build's bytes."""
    import json
    import shutil
    import subprocess
    import sys

    from mmap_offload import native

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    lib = tmp_path / "mo_host_diag.so"
    cmd = native.compile_command("mo_host", str(lib), cc)
    r = subprocess.run([cmd[0], "-DDIAG_TIMING", *cmd[1:]], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    experts = [expert(384, 256, 128, seed=i)[0] for i in range(3)]
    x = rand_x(3, 384, torch.bfloat16, seed=13)
    want = torch.zeros_like(x)
    k = HostKernel(threads=1, isa="plain")
    k.experts_mlp(x, _jobs_of(experts, x, 128), want)
    k.close()
    torch.save({"experts": experts, "x": x}, tmp_path / "in.pt")
    script = f"""
import json, sys, torch
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from mmap_offload.host.kernel import HostKernel
from test_host_kernel import _jobs_of
d = torch.load({str(tmp_path / "in.pt")!r})
k = HostKernel(threads=3, isa="plain")
k.diag()
outs = []
for _ in range(4):
    out = torch.zeros_like(d["x"])
    k.experts_mlp(d["x"], _jobs_of(d["experts"], d["x"], 128), out)
    outs.append(out)
torch.save(outs, {str(tmp_path / "out.pt")!r})
print(json.dumps(k.diag()))
"""
    env = {**os.environ, "MMAP_OFFLOAD_NATIVE_MO_HOST": str(lib)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout.strip().splitlines()[-1])
    th = d["threads"]
    assert d["calls"] == 4 and len(th) == 3
    # the caller takes part in a call unless spinning workers took all its units first (pool_finish:
    # a 3-expert call on a loaded 2-core box; session 34's CI run saw it join 3 of 4); every call has
    # at least one thread that joined it
    assert 1 <= th[0]["joined"] <= 4 and sum(t["joined"] for t in th) >= 4
    units = sum(t["units"] * t["joined"] for t in th)
    assert units > 0 and units % 4 == 0  # the same units in every call, each taken by one thread
    assert units / 4 >= 2 * len(experts)  # at least one unit per job and phase
    # a thread may join a call after the others took its last unit (busy 0 then: session 34's CI on 2 cores)
    assert sum(t["busy_us"] * t["joined"] for t in th) > 0
    for t in th:
        if t["joined"]:
            assert 0 <= t["red_us"] <= t["busy_us"] and 0 <= t["wait_us"] <= t["busy_us"]
            assert 0 <= t["join_us"] <= t["last_us"]
    for out in torch.load(tmp_path / "out.pt"):
        assert torch.equal(out, want)


def _jobs_of(experts, x, g):
    rows = torch.arange(x.shape[0])
    w = torch.linspace(0.5, 1.5, x.shape[0])
    return [(rows, *args(c), g, w) for c in experts]


@pytest.mark.parametrize("threads", [1, 4])
def test_started_call_equals_the_blocking_one(threads):
    """experts_mlp_start + wait writes the bytes experts_mlp writes; with one thread (no workers) the
    work is done in wait(); one started call at a time, and no blocking call while one is started."""
    experts = [expert(384, 256, 128, seed=i)[0] for i in range(3)]
    x = rand_x(3, 384, torch.bfloat16, seed=7)
    k = HostKernel(threads=threads, isa=AVAILABLE[0])
    want = torch.zeros_like(x)
    k.experts_mlp(x, _jobs_of(experts, x, 128), want)
    got = torch.zeros_like(x)
    call = k.experts_mlp_start(x, _jobs_of(experts, x, 128), got)
    with pytest.raises(RuntimeError, match="not waited for"):
        k.experts_mlp_start(x, _jobs_of(experts, x, 128), torch.zeros_like(x))
    with pytest.raises(RuntimeError, match="not waited for"):
        k.experts_mlp(x, _jobs_of(experts, x, 128), torch.zeros_like(x))
    assert call.wait() is call and call.seconds >= 0
    assert torch.equal(got, want)
    if threads == 1:
        assert call.ready is False  # nobody else could compute it
    again = torch.zeros_like(x)
    k.experts_mlp_start(x, _jobs_of(experts, x, 128), again).wait()  # the next call may start
    assert torch.equal(again, want)
    empty = k.experts_mlp_start(x, [], torch.zeros_like(x)).wait()
    assert empty.seconds == 0.0
    k.close()


def test_started_call_runs_while_the_caller_does_something_else():
    """The point of experts_mlp_start: the pool's workers compute while the calling thread is busy
    elsewhere (in vLLM: launching the layer's GPU work, holding the GIL). The caller sleeps far longer
    than the call takes; by then the workers have written the output (ready: wait() had nothing left)."""
    import time

    experts = [expert(384, 256, 128, seed=i)[0] for i in range(2)]
    x = rand_x(2, 384, torch.bfloat16, seed=3)
    k = HostKernel(threads=3, isa=AVAILABLE[0])
    want = torch.zeros_like(x)
    k.experts_mlp(x, _jobs_of(experts, x, 128), want)
    for _ in range(3):
        got = torch.zeros_like(x)
        call = k.experts_mlp_start(x, _jobs_of(experts, x, 128), got)
        time.sleep(0.3)
        call.wait()
        assert call.ready and torch.equal(got, want)
        assert 0 < call.seconds < 0.3  # the workers' time, not the caller's sleep
    k.close()


def test_close_waits_for_a_started_call():
    experts = [expert(384, 256, 128, seed=i)[0] for i in range(2)]
    x = rand_x(2, 384, torch.bfloat16, seed=5)
    k = HostKernel(threads=2, isa=AVAILABLE[0])
    want = torch.zeros_like(x)
    k.experts_mlp(x, _jobs_of(experts, x, 128), want)
    got = torch.zeros_like(x)
    call = k.experts_mlp_start(x, _jobs_of(experts, x, 128), got)
    k.close()
    assert torch.equal(got, want) and call.wait().seconds is not None


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_a_nan_row_stays_in_its_row(isa):
    """A NaN in one row of x makes that row's output NaN (not finite garbage: the integer path's
    per-block x scale must carry it) and leaves the other rows as they were."""
    cache, weights = expert(256, 128, 64)
    k = kernel(2, isa)
    x = rand_x(3, 256, torch.bfloat16, seed=11)
    x[1, 77] = float("nan")
    y = k.expert_mlp(x, *args(cache), group=64)
    assert torch.isnan(y[1]).all()
    keep = torch.tensor([0, 2])
    assert_close(y[keep], ref_mlp(x[keep], weights), torch.bfloat16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_activation_outliers(isa):
    """LLM activations carry a few channels ~100x the rest; the avx512vnni path scales x per row and k block
    by its largest value (16-bit fixed point), so the small values lose bits there: still within the bf16
    tolerance, at every M the kernel's passes split differently."""
    cache, weights = expert(384, 256, 128)
    k = kernel(3, isa)
    for m in (1, 2, 3, 4, 7):
        x = rand_x(m, 384, torch.float32, seed=20 + m)
        x[:, ::97] *= 100.0
        x = x.to(torch.bfloat16)
        y = k.expert_mlp(x, *args(cache), group=128)
        assert_close(y, ref_mlp(x, weights), torch.bfloat16)


@pytest.mark.parametrize("isa", ISA_PARAMS)
def test_tiny_rows_keep_their_relative_accuracy(isa):
    """A row of x at 1e-20 (its SiLU * up intermediate near 1e-36, where the integer paths' fixed-point
    scale 32639 / max|x| overflows fp32 unless pre-scaled) is as right, relative to its own size, as an
    ordinary row beside it."""
    cache, weights = expert(256, 128, 64)
    k = kernel(2, isa)
    x = rand_x(2, 256, torch.float32, seed=13)
    x[0] *= 1e-20
    x = x.to(torch.bfloat16)
    y = k.expert_mlp(x, *args(cache), group=64)
    ref = ref_mlp(x, weights)
    assert 0 < float(ref[0].abs().max()) < 1e-33
    assert_close(y[:1], ref[:1], torch.bfloat16)
    assert_close(y[1:], ref[1:], torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_truncated_mapping_fails_the_call_not_the_process(tmp_path, threads):
    """The weights are views of a file mapping; the file is truncated under it (as a stray ``truncate``
    or a disk I/O error on a dropped page would make it): the kernel's read raises SIGBUS, which its
    guard turns into HostReadFault with an address inside the mapping, for the blocking and the started
    call, with one thread and with several; the process lives, the pool is not wedged (the next call on
    good weights gives the reference's bytes), and a SIGBUS outside a call still kills the process. Runs
    in a child process: without the guard the child dies of SIGBUS and this test fails, not pytest."""
    import subprocess
    import sys

    hidden, inter, group = 384, 256, 128
    cache, _ = expert(hidden, inter, group)
    torch.save({n: cache[n] for n in ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed",
                                      "w2_weight_scale")}, tmp_path / "expert.pt")
    script = f"""
import os, sys, numpy as np, torch
sys.path.insert(0, {str(os.path.dirname(__file__))!r})
from mmap_offload.host.kernel import HostKernel, HostReadFault, library
from test_host_kernel import _jobs_of
names = ["w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale"]
ex = torch.load({str(tmp_path / "expert.pt")!r})
x = torch.randn(3, {hidden}, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
k = HostKernel(threads={threads}, isa="plain")
assert library().mo_host_sigbus_guarded() == 1
want = torch.zeros_like(x)
k.experts_mlp(x, _jobs_of([ex], x, {group}), want)
for mode in ("blocking", "started"):
    path = {str(tmp_path)!r} + "/" + mode + ".bin"
    with open(path, "wb") as f:
        for n in names:
            f.write(ex[n].contiguous().view(torch.uint8).numpy().tobytes())
    mm = np.memmap(path, dtype=np.uint8, mode="c")
    views, off = {{}}, 0
    for n in names:
        nb = ex[n].numel() * ex[n].element_size()
        views[n] = torch.frombuffer(mm, dtype=torch.uint8, offset=off, count=nb).view(ex[n].dtype).view(ex[n].shape)
        off += nb
    out = torch.zeros_like(x)
    k.experts_mlp(x, _jobs_of([views], x, {group}), out)
    assert torch.equal(out, want), mode  # the mapping reads right while the file is whole
    os.truncate(path, 0)
    out = torch.zeros_like(x)
    try:
        if mode == "blocking":
            k.experts_mlp(x, _jobs_of([views], x, {group}), out)
        else:
            k.experts_mlp_start(x, _jobs_of([views], x, {group}), out).wait()
    except HostReadFault as e:
        base = mm.ctypes.data
        assert base <= e.address < base + mm.nbytes, (hex(e.address), hex(base))
        print(mode, "fault at offset", e.address - base)
    else:
        raise SystemExit(mode + ": no HostReadFault")
    again = torch.zeros_like(x)
    k.experts_mlp(x, _jobs_of([ex], x, {group}), again)  # the pool serves the next call
    assert torch.equal(again, want), mode
    k.experts_mlp_start(x, _jobs_of([ex], x, {group}), again.zero_()).wait()
    assert torch.equal(again, want), mode
print("ok")
sys.stdout.flush()
print(int(mm[0]))  # Python's own read of the truncated mapping, outside a call: passed on, the process dies
print("SURVIVED")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONFAULTHANDLER": ""})
    assert "ok" in r.stdout.splitlines(), (r.returncode, r.stdout, r.stderr[-3000:])
    assert "blocking fault at offset" in r.stdout and "started fault at offset" in r.stdout
    assert "SURVIVED" not in r.stdout and r.returncode == -7, (r.returncode, r.stderr[-2000:])  # SIGBUS
