"""The host half of the vLLM hybrid step (vllm_backend/host_experts.py) outside vLLM: experts of a
real W4A16 cache computed on the host from the mapped Marlin words, added to a kernel's output,
against an fp32 reference built from the checkpoint's own packed values; and the split's choices."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from marlin_reference import unpack_values
from mmap_offload.cache_reader import open_cache
from mmap_offload.checkpoint import open_checkpoint
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


def test_split_follows_the_measured_rates(setup):
    from mmap_offload.vllm_backend.host_experts import HostExperts

    cache, _, _ = setup
    he = HostExperts(SimpleNamespace(cache=cache, device=torch.device("cpu")), threads=1)
    misses = np.array([3, 5, 7, 9])
    tokens = np.array([4, 1, 1, 2])
    host, copy = he.split(misses, tokens)  # no rates yet: half and half, fewest tokens to the host
    assert sorted(host.tolist()) == [5, 7] and sorted(copy.tolist()) == [3, 9]
    he.host_rate, he.copy_rate = 3e9, 1e9  # host 3x the link: 3/4 of the misses
    host, copy = he.split(misses, tokens)
    assert len(host) == 3 and copy.tolist() == [3]
    he.host_rate, he.copy_rate = 1e9, 9e9
    host, copy = he.split(misses, tokens)
    assert len(host) == 0 and len(copy) == 4
    he.close()
