"""The benchmark's W4A16 MoE compute: routing alignment, weight views, torch path, Triton kernel, UVA.

CPU tests check the host-side pieces and the torch path against an independent fp32 reference; the
Triton kernel runs in Triton's interpreter on CPU where Triton is installed, and for real on CUDA in
the ``gpu`` tests (bf16, relative error against the fp32 reference; UVA reads of pinned memory give
the same bits as device-resident weights).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe_kernel as mk  # noqa: E402

from mmap_offload.cache_format import layout_specs  # noqa: E402


def _routing(t: int, k: int, e: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.stack([rng.choice(e, k, replace=False) for _ in range(t)])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().cpu() - b.float().cpu()).norm() / b.float().cpu().norm())


# -------------------------------------------------------------------------------------- host side


@pytest.mark.parametrize("t,k,e,bm", [(1, 8, 64, 16), (5, 2, 6, 4), (64, 8, 16, 16), (300, 4, 8, 64)])
def test_align_routing_groups_every_pair_once(t, k, e, bm):
    ids = _routing(t, k, e, seed=t)
    sp, bs = mk.align_routing(ids, e, bm)
    p = t * k
    assert sp.size == bs.size * bm
    real = sp[sp < p]
    assert sorted(real.tolist()) == list(range(p))  # each pair exactly once
    flat = ids.reshape(-1)
    for b, slot in enumerate(bs):  # a block holds pairs of its slot only, padding after them
        blk = sp[b * bm : (b + 1) * bm]
        assert (flat[blk[blk < p]] == slot).all()
    assert sorted(set(bs.tolist())) == sorted(set(flat.tolist()))  # only routed slots get blocks


def test_align_routing_rejects_out_of_range():
    with pytest.raises(ValueError):
        mk.align_routing(np.array([[0, 9]]), 4, 16)


def _marlin_specs(h: int, i: int, g: int):
    specs, rec = layout_specs([
        ("w13_weight_packed", "int32", (h // 16, 4 * i)),
        ("w2_weight_packed", "int32", (i // 16, 2 * h)),
        ("w13_weight_scale", "bfloat16", (h // g, 2 * i)),
        ("w2_weight_scale", "bfloat16", (i // g, h)),
    ])
    return specs, rec


def test_weight_views_alias_the_same_bytes():
    h, i, g, s = 256, 128, 64, 3
    specs, rec = _marlin_specs(h, i, g)
    buf = torch.randint(0, 256, (s, rec), dtype=torch.uint8)
    w = mk.weights_from_records(buf, specs, h, i)
    assert w.hidden == h and w.inter == i and w.group13 == g and w.group2 == g and w.num_slots == s
    for spec, t in zip(specs, (w.w13_q, w.w2_q, w.w13_s, w.w2_s)):
        for slot in range(s):
            raw = buf[slot, spec.offset : spec.offset + spec.nbytes]
            assert torch.equal(t[slot].contiguous().view(-1).view(torch.uint8), raw)
            assert t[slot].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, no copy
    tensors = {spec.name: buf[:, spec.offset : spec.offset + spec.nbytes].contiguous().view(spec.torch_dtype)
               .view(s, *spec.shape) for spec in specs}
    w2 = mk.weights_from_tensors(tensors, h, i)
    for a, b in zip((w.w13_q, w.w13_s, w.w2_q, w.w2_s), (w2.w13_q, w2.w13_s, w2.w2_q, w2.w2_s)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))  # bits (NaNs too)
    assert w.expert_nbytes() == sum(sp.nbytes for sp in specs)


def test_unpack_nibble_order():
    q = torch.tensor([[0x76543210, 0x0FEDCBA9 - (1 << 32) + (1 << 32)]], dtype=torch.int64).to(torch.int32)
    u = mk._unpack(q) + 8
    assert u[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert u[:, 1].tolist() == [9, 10, 11, 12, 13, 14, 15, 0]


@pytest.mark.parametrize("t,k", [(1, 4), (7, 2)])
def test_torch_path_matches_reference(t, k):
    e, h, i = 6, 128, 64
    w = mk.random_weights(e, h, i, group=64, seed=1)
    ids = _routing(t, k, e, seed=2)
    x = torch.randn(t, h)
    rw = torch.softmax(torch.randn(t, k), -1)
    ref = mk.reference_moe(x, ids, rw, w)
    out = mk.moe_forward(x, ids, rw, w, impl="torch")
    assert rel_err(out, ref) < 1e-5
    assert ref.abs().max() > 0.05  # not a vacuous comparison


def test_torch_path_reads_only_routed_slots():
    e, h, i = 4, 128, 64
    w = mk.random_weights(e, h, i, group=64, seed=3)
    ids = np.array([[0, 2]])
    x = torch.randn(1, h)
    rw = torch.tensor([[0.5, 0.5]])
    before = mk.moe_forward(x, ids, rw, w, impl="torch")
    for t in (w.w13_q, w.w2_q):  # garbage in unrouted slots must not matter
        t[1].fill_(-1)
        t[3].fill_(0x12345678)
    assert torch.equal(mk.moe_forward(x, ids, rw, w, impl="torch"), before)


def test_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    code = textwrap.dedent(f"""
        import sys, numpy as np, torch
        sys.path.insert(0, {str(ROOT / 'benchmarks')!r})
        import moe_kernel as mk
        w = mk.random_weights(5, 128, 64, group=64, seed=4)
        rng = np.random.default_rng(0)
        ids = np.stack([rng.choice(5, 2, replace=False) for _ in range(3)])
        x = torch.randn(3, 128)   # fp32: the interpreter mis-casts bf16
        rw = torch.softmax(torch.randn(3, 2), -1)
        ref = mk.reference_moe(x, ids, rw, w)
        out = mk.moe_forward(x, ids, rw, w, impl="triton")
        print(float((out - ref).norm() / ref.norm()))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip().splitlines()[-1]) < 1e-5


# -------------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available() or not mk.HAVE_TRITON, reason="needs CUDA and Triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t,k,e,h,i", [(1, 8, 32, 1024, 512), (8, 8, 32, 1024, 512), (300, 4, 16, 512, 256)])
def test_triton_bf16_matches_fp32_reference(t, k, e, h, i):
    w = mk.random_weights(e, h, i, group=128, seed=5, device="cuda")
    ids = _routing(t, k, e, seed=6)
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
    rw = torch.softmax(torch.randn(t, k, device="cuda"), -1)
    out = mk.moe_forward(x, ids, rw, w, impl="triton")
    ref = mk.reference_moe(x, ids, rw.cpu(), w)
    assert out.dtype == torch.bfloat16 and out.shape == (t, h)
    assert rel_err(out, ref) < 2e-2
    tor = mk.moe_forward(x, ids, rw, w, impl="torch")
    assert rel_err(tor, ref) < 2e-2


@pytest.mark.gpu
@gpu
def test_uva_alias_reads_pinned_memory_in_place():
    e, h, i = 16, 1024, 512
    w_dev = mk.random_weights(e, h, i, group=128, seed=7, device="cuda")
    aliases, hosts = [], []
    for t in (w_dev.w13_q, w_dev.w13_s, w_dev.w2_q, w_dev.w2_s):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.cpu())
        alias, method = mk.uva_alias(host)
        assert alias.data_ptr() != 0 and (alias.is_cuda or method.startswith("pinned-tensor"))
        aliases.append(alias)
        hosts.append(host)
    w_uva = mk.ExpertWeights(*aliases)
    ids = _routing(4, 8, e, seed=8)
    x = torch.randn(4, h, device="cuda").to(torch.bfloat16)
    rw = torch.softmax(torch.randn(4, 8, device="cuda"), -1)
    a = mk.moe_forward(x, ids, rw, w_dev, impl="triton")
    b = mk.moe_forward(x, ids, rw, w_uva, impl="triton")
    assert torch.equal(a, b)
    hosts[0][ids[0, 0]].zero_()  # a write on the host is seen by the next kernel: no copy was made
    torch.cuda.synchronize()
    c = mk.moe_forward(x, ids, rw, w_uva, impl="triton")
    assert not torch.equal(c[0], a[0])


# ------------------------------------------------------------------------------ benchmark smoke


def test_bench_moe_runs_end_to_end_on_cpu(tmp_path):
    """bench_moe.py at toy size: a cache is built, two variants run, the report is written, and the
    expert-cache variant computes what the all-resident variant computes (same bytes delivered)."""
    import json

    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_moe.py"), "--device", "cpu", "--tiny", "--no-tune",
         "--variants", "vram,mmap-cache", "--workloads", "decode-8", "--traces", "skewed", "--steps", "2",
         "--out", str(out)],
        capture_output=True, text=True, timeout=170,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    rows = {row["variant"]: row for row in res["rows"]}
    assert set(rows) == {"vram", "mmap-cache"}
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["routed_bytes_per_step"] > 0
    assert rows["vram"]["pcie_bytes_per_step"] == 0
    assert 0 < rows["mmap-cache"]["pcie_bytes_per_step"] <= rows["mmap-cache"]["routed_bytes_per_step"]
    assert rows["mmap-cache"]["max_rel_diff_vs_first_variant"] < 1e-4
    assert (out / "results.md").read_text().count("| mmap-cache |") == 1
    assert (out / "tokens_per_s.png").stat().st_size > 0
