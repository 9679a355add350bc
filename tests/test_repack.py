"""mmap_offload.repack against the slow closed-form reference and the exact inverse (tests/marlin_reference.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmap_offload import repack
from mmap_offload.errors import UnsupportedError
from mmap_offload.repack import (SCALE_PERM, SCALE_PERM_SINGLE, check_group_size, check_repack_shape,
                                 check_symmetric, gather_k, marlin_repack, permute_scales,
                                 scale_perm_is_grouped, sort_g_idx)

from marlin_reference import (GROUPED_CHUNK, SINGLE_CHUNK, inverse_permute_scales, inverse_repack,
                              random_packed, ref_permute_scales, ref_repack, unpack_values, unpermute_k)

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _perm(k: int, seed: int, actorder: bool) -> torch.Tensor | None:
    return torch.randperm(k, generator=_gen(seed + 1)).to(torch.int32) if actorder else None


@pytest.fixture
def small_blocks(monkeypatch):
    """Force the CPU path through many small blocks (and partial last blocks)."""
    monkeypatch.setattr(repack, "CPU_KT_BLOCK", 3)
    monkeypatch.setattr(repack, "CPU_BLOCK_BYTES", 3 * 64 * 8 * 2)


# ------------------------------------------------------------------ weights

METHODS = st.sampled_from(["bits", "nibbles"])


@SLOW
@given(kt=st.integers(1, 4), nt=st.integers(1, 3), actorder=st.booleans(), seed=st.integers(0, 2**16))
def test_fast_equals_slow_reference(kt, nt, actorder, seed):
    k, n = 16 * kt, 64 * nt
    packed = random_packed(n, k, _gen(seed))
    perm = _perm(k, seed, actorder)
    want = ref_repack(packed, perm)
    assert torch.equal(marlin_repack(packed, perm), want)
    assert torch.equal(marlin_repack(packed, perm, method="bits"), want)
    assert torch.equal(marlin_repack(packed, perm, method="nibbles"), want)


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kt=st.integers(1, 7), nt=st.integers(1, 4), actorder=st.booleans(), seed=st.integers(0, 2**16))
def test_blocked_cpu_path_equals_reference(small_blocks, kt, nt, actorder, seed):
    # the fixture only patches constants, which no example changes
    k, n = 16 * kt, 64 * nt
    packed = random_packed(n, k, _gen(seed))
    perm = _perm(k, seed, actorder)
    assert torch.equal(marlin_repack(packed, perm), ref_repack(packed, perm))


@FAST
@given(kt=st.integers(1, 24), nt=st.integers(1, 6), actorder=st.booleans(), seed=st.integers(0, 2**16),
       method=METHODS)
def test_inverse_of_repack_is_identity(kt, nt, actorder, seed, method):
    k, n = 16 * kt, 64 * nt
    packed = random_packed(n, k, _gen(seed))
    perm = _perm(k, seed, actorder)
    back = inverse_repack(marlin_repack(packed, perm, method=method))
    if perm is not None:
        back = unpermute_k(back, perm)
    assert torch.equal(back, packed)


@FAST
@given(kt=st.integers(2, 16), nt=st.integers(1, 4), actorder=st.booleans(), method=METHODS, data=st.data())
def test_k_slice_equals_rows_of_full_repack(kt, nt, actorder, method, data):
    k, n = 16 * kt, 64 * nt
    seed = data.draw(st.integers(0, 2**16))
    t0 = data.draw(st.integers(0, kt - 1))
    t1 = data.draw(st.integers(t0 + 1, kt))
    packed = random_packed(n, k, _gen(seed))
    perm = _perm(k, seed, actorder)
    full = marlin_repack(packed, perm)
    part = marlin_repack(packed, perm, k_start=16 * t0, k_stop=16 * t1, method=method)
    assert torch.equal(part, full[t0:t1])
    # without act-order a K-slice needs only the matching columns of the input
    if perm is None:
        alone = marlin_repack(packed[:, 2 * t0: 2 * t1].contiguous(), method=method)
        assert torch.equal(alone, full[t0:t1])


@FAST
@given(kt=st.integers(1, 8), nt_gate=st.integers(1, 3), actorder=st.booleans(), seed=st.integers(0, 2**16),
       method=METHODS)
def test_gate_and_up_halves_repack_independently(kt, nt_gate, actorder, seed, method):
    k, i = 16 * kt, 64 * nt_gate
    gate, up = random_packed(i, k, _gen(seed)), random_packed(i, k, _gen(seed + 7))
    perm = _perm(k, seed, actorder)
    whole = marlin_repack(torch.cat([gate, up]), perm)  # N = 2I: gate columns first
    out = torch.empty(k // 16, 4 * i, dtype=torch.int32)
    marlin_repack(gate, perm, out=out[:, : 2 * i], method=method)
    marlin_repack(up, perm, out=out[:, 2 * i:], method=method)
    assert torch.equal(out, whole)
    assert torch.equal(out[:, : 2 * i], marlin_repack(gate, perm))


def test_known_word_layout():
    """One hand-checked word: u[n, k] = (k + n) % 16; word 0 of tile 0 has nibble t from
    k = 8h + 2a + l, n = 16j + 8g + b with a = b = j = 0."""
    n, k = 64, 16
    u = ((torch.arange(k)[None, :] + torch.arange(n)[:, None]) % 16).numpy().astype("uint8")
    from marlin_reference import pack_values
    m = marlin_repack(pack_values(u))
    word = int(m[0, 0]) & 0xFFFFFFFF
    want = 0
    for t in range(8):
        l, g, h = t >> 2, (t >> 1) & 1, t & 1
        want |= (((8 * h + l) + (8 * g)) % 16) << (4 * t)
    assert word == want


@pytest.mark.parametrize("rows,k,lo,hi", [(64, 64, 0, 64), (128, 256, 16, 48), (192, 512, 0, 8)])
def test_gather_k_moves_nibbles(rows, k, lo, hi, small_blocks):
    packed = random_packed(rows, k, _gen(3))
    perm = torch.randperm(k, generator=_gen(4))
    got = unpack_values(gather_k(packed, perm[lo:hi]))
    assert (got == unpack_values(packed)[:, perm[lo:hi].numpy()]).all()


def test_non_contiguous_input_is_accepted():
    packed = random_packed(128, 64, _gen(5))
    view = packed.t().contiguous().t()  # same values, column-major
    for method in ("bits", "nibbles"):
        assert torch.equal(marlin_repack(view, method=method), marlin_repack(packed))
    with pytest.raises(ValueError, match="unknown repack method"):
        marlin_repack(packed, method="magic")


# ------------------------------------------------------------------ scales and g_idx

def test_scale_permutations_match_vllm_tables():
    assert SCALE_PERM == GROUPED_CHUNK and SCALE_PERM_SINGLE == SINGLE_CHUNK
    assert sorted(SCALE_PERM) == list(range(64)) and sorted(SCALE_PERM_SINGLE) == list(range(32))


@FAST
@given(groups=st.integers(1, 6), nt=st.integers(1, 4), group_size=st.sampled_from([-1, 32, 64, 128]),
       size_k=st.sampled_from([8, 64, 128, 256, 1024]), seed=st.integers(0, 2**16))
def test_permute_scales_equals_reference_and_inverts(groups, nt, group_size, size_k, seed):
    s = torch.randn(groups, 64 * nt, generator=_gen(seed)).to(torch.bfloat16)
    grouped = scale_perm_is_grouped(size_k, group_size)
    assert grouped == (group_size != -1 and group_size < size_k)
    got = permute_scales(s, size_k, group_size)
    assert got.shape == s.shape and got.dtype == s.dtype
    assert torch.equal(got, ref_permute_scales(s, grouped))
    assert torch.equal(inverse_permute_scales(got, grouped), s)


def test_scale_permutation_is_row_local_so_column_halves_are_independent():
    s = torch.randn(3, 256)
    whole = permute_scales(s, 4096, 128)
    halves = torch.cat([permute_scales(s[:, :128].contiguous(), 4096, 128),
                        permute_scales(s[:, 128:].contiguous(), 4096, 128)], dim=1)
    assert torch.equal(whole, halves)


def test_sort_g_idx_is_a_stable_argsort():
    g = torch.tensor([2, 0, 1, 0, 2, 1, 0, 1], dtype=torch.int32)
    sorted_g, idx = sort_g_idx(g)
    assert sorted_g.dtype == idx.dtype == torch.int32
    assert sorted_g.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert idx.tolist() == [1, 3, 6, 2, 5, 7, 0, 4]  # ties keep ascending k


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("k,n,rule", [(24, 64, "multiple of 16"), (0, 64, "multiple of 16"),
                                      (32, 96, "multiple of 64"), (32, 32, "multiple of 64")])
def test_refuses_shapes_marlin_cannot_take(k, n, rule):
    with pytest.raises(UnsupportedError, match=rule) as err:
        check_repack_shape("layers.0.experts.3.down_proj.weight_packed", k, n)
    assert "layers.0.experts.3.down_proj.weight_packed" in str(err.value)


def test_marlin_repack_refuses_bad_packed_shapes():
    with pytest.raises(UnsupportedError, match="multiple of 64") as err:
        marlin_repack(torch.zeros(96, 4, dtype=torch.int32), name="gate_proj.weight_packed")
    assert "gate_proj.weight_packed" in str(err.value)
    with pytest.raises(UnsupportedError, match="multiple of 16"):
        marlin_repack(torch.zeros(64, 3, dtype=torch.int32))
    with pytest.raises(UnsupportedError, match="int32"):
        marlin_repack(torch.zeros(64, 4, dtype=torch.int64))


@pytest.mark.parametrize("g", [16, 256, 0, 100])
def test_refuses_group_sizes(g):
    with pytest.raises(UnsupportedError, match="group size"):
        check_group_size("x.weight_scale", g)


def test_accepts_supported_group_sizes():
    for g in (-1, 32, 64, 128):
        check_group_size("x.weight_scale", g)


def test_refuses_asymmetric():
    with pytest.raises(UnsupportedError, match="asymmetric"):
        check_symmetric("x.weight_packed", False)


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("actorder", [False, True])
def test_cuda_output_equals_cpu(actorder):
    for k, n in [(16, 64), (128, 192), (4096, 1024), (1024, 4096)]:
        packed = random_packed(n, k, _gen(k + n))
        perm = _perm(k, 11, actorder)
        cpu = marlin_repack(packed, perm)
        for method in ("auto", "bits", "nibbles"):
            gpu = marlin_repack(packed.cuda(), None if perm is None else perm.cuda(), method=method)
            assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu), method
        if k <= 128:
            assert torch.equal(cpu, ref_repack(packed, perm))
    s = torch.randn(32, 1024).to(torch.bfloat16)
    for g, size_k in [(128, 4096), (-1, 8)]:
        assert torch.equal(permute_scales(s.cuda(), size_k, g).cpu(), permute_scales(s, size_k, g))


def _vllm_ops():
    try:
        from vllm import _custom_ops as ops  # wraps torch.ops._C.gptq_marlin_repack (+ is_a_8bit=False)
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_permute_scales
        return ops.gptq_marlin_repack, marlin_permute_scales
    except Exception:  # noqa: BLE001 - any import problem means: not available here
        return None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_matches_vllm_kernels_bit_for_bit():
    ops = _vllm_ops()
    if ops is None:
        pytest.skip("vllm with its CUDA ops is not importable here")
    vllm_repack, vllm_permute_scales = ops
    for k, n, actorder in [(128, 256, False), (4096, 1024, False), (1024, 2048, True), (2048, 768 * 2, True)]:
        packed = random_packed(n, k, _gen(k * 3 + n))
        perm = _perm(k, 5, actorder)
        vperm = (perm if perm is not None else torch.empty(0, dtype=torch.int32)).cuda()
        theirs = vllm_repack(packed.t().contiguous().cuda(), vperm, k, n, 4)
        ours = marlin_repack(packed.cuda(), None if perm is None else perm.cuda())
        assert torch.equal(ours, theirs)
    for g in (-1, 32, 64, 128):
        for size_k, size_n in [(4096, 1024), (128, 256), (1024, 4096)]:
            groups = 1 if g == -1 else size_k // g
            s = torch.randn(groups, size_n, dtype=torch.float16, device="cuda")
            assert torch.equal(permute_scales(s, size_k, g), vllm_permute_scales(s, size_k, size_n, g))
