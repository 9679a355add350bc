"""mmap_offload.layout: specs, bytes against a model of vLLM's per-rank tensors, TP shards, refusals.

What "the rank outputs concatenate to the whole" means, per tensor (rank r of tp, I_r = I / tp; "whole" is
the tp = 1 output):
- w13_weight_packed [H/16, 4*I_r]: whole[:, :2I] = cat_r(rank_r[:, :2I_r]) and whole[:, 2I:] =
  cat_r(rank_r[:, 2I_r:]) along dim 1 (gate columns of all ranks, then up columns), bit for bit.
- w13_weight_scale [G13, 2*I_r]: the same along dim 1, bit for bit.
- w2_weight_packed [I_r/16, 2H], no act-order: whole = cat_r(rank_r) along dim 0, bit for bit. With act-order
  each rank sorts its own slice of g_idx, so: unpermute(inverse_repack(rank_r)) = down's K-columns of rank r.
- w2_weight_scale [G2, H]: grouped without act-order, cat_r(unpermuted rank_r) along dim 0 = unpermuted whole
  (the grouped/single choice depends on I_r, as in vLLM); channelwise, or grouped with act-order: every rank
  holds the whole.
- w13 g_idx / sort_indices (act-order): every rank holds the whole. w2 g_idx: rank r holds
  sorted(g_idx[r*I_r:(r+1)*I_r]) and sort indices local to that slice.
- unquantized: w13_weight [2*I_r, H]: whole[:I] = cat_r(rank_r[:I_r]), whole[I:] = cat_r(rank_r[I_r:])
  along dim 0; w2_weight [H, I_r]: whole = cat_r(rank_r) along dim 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from mmap_offload.cache_format import DTYPES, layout_specs
from mmap_offload.errors import CheckpointError, UnsupportedError
from mmap_offload.checkpoint import QuantScheme  # noqa: E402
from mmap_offload.layout import (LAYOUT_VERSIONS, MarlinW4A16Layout, UnquantizedLayout, checkpoint_view,
                                  layout_by_name, layout_for)

from marlin_reference import (inverse_permute_scales, inverse_repack, random_expert, unpermute_k,
                              vllm_expert, vllm_loaded)


Quant = QuantScheme.w4a16  # the real scheme; keyword overrides as the tests need


@dataclass(frozen=True)
class MoE:  # stand-in for checkpoint.MoEInfo
    num_experts: int
    hidden: int
    intermediate: int
    top_k: int = 2
    layers: list = field(default_factory=lambda: [0])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _grouped(size_k: int, g: int) -> bool:
    return g != -1 and g < size_k


CONFIGS = [  # hidden, intermediate, group_size, actorder, tp sizes
    (128, 256, 64, False, (1, 2, 4)),
    (256, 512, 128, False, (1, 2, 4)),
    (128, 256, -1, False, (1, 2, 4)),
    (256, 256, 32, True, (1, 2, 4)),
    (128, 512, 128, True, (1, 2, 4)),
    (128, 256, -1, True, (1, 2)),
]


def _run(hidden, inter, g, actorder, tp, seed=0):
    quant = Quant(group_size=g, actorder=actorder)
    expert = random_expert(hidden, inter, g, actorder, _gen(seed))
    layout = layout_for(quant)
    outs = [layout.transform_expert(expert, quant, r, tp, "cpu") for r in range(tp)]
    return quant, expert, layout, outs


@pytest.mark.parametrize("hidden,inter,g,actorder,tps", CONFIGS)
def test_marlin_specs_match_outputs_and_vllm_model(hidden, inter, g, actorder, tps):
    for tp in tps:
        quant, expert, layout, outs = _run(hidden, inter, g, actorder, tp, seed=tp)
        for r, out in enumerate(outs):
            specs = layout.expert_tensor_specs(MoE(8, hidden, inter), quant, r, tp)
            assert list(out) == [name for name, _, _ in specs]
            for name, dtype, shape in specs:
                t = out[name]
                assert t.device.type == "cpu" and t.is_contiguous()
                assert t.dtype == DTYPES[dtype] and tuple(t.shape) == shape, name
            layout_specs(specs)  # the cache writer can place them
            want = vllm_expert(expert["gate"], expert["up"], expert["down"], g, actorder, r, tp)
            assert set(want) == set(out)
            for name in want:
                assert torch.equal(out[name], want[name].to(out[name].dtype)), (tp, r, name)


@pytest.mark.parametrize("hidden,inter,g,actorder,tps", CONFIGS)
def test_marlin_tp_shards_concatenate_to_the_whole(hidden, inter, g, actorder, tps):
    _, expert, _, (whole,) = _run(hidden, inter, g, actorder, 1, seed=9)
    for tp in tps:
        _, _, _, ranks = _run(hidden, inter, g, actorder, tp, seed=9)
        i_r = inter // tp
        for name in ("w13_weight_packed", "w13_weight_scale"):
            half = whole[name].shape[1] // 2
            cols = [rk[name] for rk in ranks]
            assert torch.equal(whole[name][:, :half], torch.cat([c[:, : c.shape[1] // 2] for c in cols], 1))
            assert torch.equal(whole[name][:, half:], torch.cat([c[:, c.shape[1] // 2:] for c in cols], 1))
        if not actorder:
            assert torch.equal(whole["w2_weight_packed"], torch.cat([rk["w2_weight_packed"] for rk in ranks]))
        else:
            down = expert["down"]["weight_packed"]
            for r, rk in enumerate(ranks):
                back = unpermute_k(inverse_repack(rk["w2_weight_packed"]), rk["w2_g_idx_sort_indices"])
                assert torch.equal(back, down[:, r * i_r // 8: (r + 1) * i_r // 8])
                assert torch.equal(rk["w13_weight_g_idx"], whole["w13_weight_g_idx"])
                assert torch.equal(rk["w13_g_idx_sort_indices"], whole["w13_g_idx_sort_indices"])
                g_slice = expert["down"]["weight_g_idx"][r * i_r: (r + 1) * i_r]
                assert torch.equal(rk["w2_weight_g_idx"], torch.sort(g_slice, stable=True).values)
                assert torch.equal(g_slice[rk["w2_g_idx_sort_indices"].long()], rk["w2_weight_g_idx"])
        s2 = [rk["w2_weight_scale"] for rk in ranks]
        if g == -1 or actorder:
            assert all(torch.equal(s, whole["w2_weight_scale"]) for s in s2)
        else:
            un = [inverse_permute_scales(s, _grouped(s.shape[0] * g, g)) for s in s2]
            want = inverse_permute_scales(whole["w2_weight_scale"], _grouped(inter, g))
            assert torch.equal(torch.cat(un), want)


@pytest.mark.parametrize("g,actorder,tp,rank", [(64, False, 1, 0), (64, False, 2, 1), (-1, False, 4, 3),
                                                 (128, True, 1, 0), (-1, True, 2, 1)])
def test_checkpoint_view_of_vllm_loaded_params(g, actorder, tp, rank):
    """The plugin's probe: vLLM's loaded (pre-processing) params of one rank -> checkpoint view ->
    transform_expert(tp = 1) == what vLLM's processing makes of them."""
    quant = Quant(group_size=g, actorder=actorder)
    ex = random_expert(128, 512, g, actorder, _gen(6))
    loaded = vllm_loaded(ex["gate"], ex["up"], ex["down"], g, actorder, rank, tp)
    got = layout_for(quant).transform_expert(checkpoint_view(loaded, quant), quant, 0, 1, "cpu")
    want = vllm_expert(ex["gate"], ex["up"], ex["down"], g, actorder, rank, tp)
    assert list(got) == list(want) or set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name].to(got[name].dtype)), name
    if actorder and g != -1:
        with pytest.raises(ValueError, match="act-order with TP > 1"):
            checkpoint_view(vllm_loaded(ex["gate"], ex["up"], ex["down"], g, actorder, 0, 2), quant)


def test_marlin_round_trip_to_checkpoint_tensors():
    """inverse(transform(x)) == x for weights and scales (tp = 1, no act-order)."""
    quant, expert, _, (out,) = _run(256, 256, 64, False, 1, seed=3)
    w13 = out["w13_weight_packed"]
    assert torch.equal(inverse_repack(w13[:, :512]), expert["gate"]["weight_packed"])
    assert torch.equal(inverse_repack(w13[:, 512:]), expert["up"]["weight_packed"])
    assert torch.equal(inverse_repack(out["w2_weight_packed"]), expert["down"]["weight_packed"])
    s13 = inverse_permute_scales(out["w13_weight_scale"], True)
    assert torch.equal(s13[:, :256].t(), expert["gate"]["weight_scale"])
    assert torch.equal(s13[:, 256:].t(), expert["up"]["weight_scale"])
    assert torch.equal(inverse_permute_scales(out["w2_weight_scale"], True).t(), expert["down"]["weight_scale"])


def test_w13_scales_take_the_grouped_permutation_even_when_i_r_equals_group_size():
    """vLLM passes size_k = 4*I_r for w13 scales (the repacked width), so I_r == group_size stays grouped."""
    quant, expert, _, outs = _run(256, 256, 128, False, 2, seed=4)
    for r, out in enumerate(outs):
        s13 = torch.cat([expert["gate"]["weight_scale"][r * 128:(r + 1) * 128].t(),
                         expert["up"]["weight_scale"][r * 128:(r + 1) * 128].t()], 1)
        assert torch.equal(inverse_permute_scales(out["w13_weight_scale"], True), s13)
        # w2: size_k = I_r = 128 = group_size -> vLLM's single (32-chunk) permutation
        s2 = expert["down"]["weight_scale"].t()[r:r + 1]
        assert torch.equal(inverse_permute_scales(out["w2_weight_scale"], False), s2)


def test_unquantized_layout_and_tp():
    h, inter = 64, 96
    gen = _gen(1)
    ex = {"gate": {"weight": torch.randn(inter, h, generator=gen).to(torch.bfloat16)},
          "up": {"weight": torch.randn(inter, h, generator=gen).to(torch.bfloat16)},
          "down": {"weight": torch.randn(h, inter, generator=gen).to(torch.bfloat16)}}
    quant = Quant(kind="unquantized", group_size=0, num_bits=16, weight_dtype=torch.bfloat16, scale_dtype=None)
    layout = layout_for(quant)
    assert isinstance(layout, UnquantizedLayout) and (layout.name, layout.version) == ("unquantized", 1)
    whole = layout.transform_expert(ex, quant, 0, 1, "cpu")
    assert torch.equal(whole["w13_weight"], torch.cat([ex["gate"]["weight"], ex["up"]["weight"]]))
    assert torch.equal(whole["w2_weight"], ex["down"]["weight"])
    for tp in (1, 2, 3, 4):
        ranks = [layout.transform_expert(ex, quant, r, tp, "cpu") for r in range(tp)]
        i_r = inter // tp
        for r, out in enumerate(ranks):
            specs = layout.expert_tensor_specs(MoE(4, h, inter), quant, r, tp)
            assert [(n, d, s) for n, d, s in specs] == [("w13_weight", "bfloat16", (2 * i_r, h)),
                                                        ("w2_weight", "bfloat16", (h, i_r))]
            assert list(out) == ["w13_weight", "w2_weight"]
            assert all(tuple(out[n].shape) == s and out[n].is_contiguous() for n, _, s in specs)
        assert torch.equal(whole["w13_weight"][:inter], torch.cat([o["w13_weight"][:i_r] for o in ranks]))
        assert torch.equal(whole["w13_weight"][inter:], torch.cat([o["w13_weight"][i_r:] for o in ranks]))
        assert torch.equal(whole["w2_weight"], torch.cat([o["w2_weight"] for o in ranks], 1))
        for out in ranks:  # the probe view: a rank's (loaded == processed) params give themselves back
            again = layout.transform_expert(checkpoint_view(out, quant), quant, 0, 1, "cpu")
            assert all(torch.equal(again[n], out[n]) for n in out)


def test_layout_names():
    assert isinstance(layout_for(Quant()), MarlinW4A16Layout)
    assert (layout_for(Quant()).name, layout_for(Quant()).version) == ("marlin-w4a16", 1)
    assert layout_by_name("marlin-w4a16") is layout_for(Quant())
    assert LAYOUT_VERSIONS == {"unquantized": 1, "marlin-w4a16": 1}
    with pytest.raises(UnsupportedError, match="no cache layout"):
        layout_for(Quant(kind="fp8"))
    with pytest.raises(UnsupportedError):
        layout_by_name("nope")


# ------------------------------------------------------------------ refusals

@pytest.mark.parametrize("hidden,inter,tp,quant,match", [
    (192, 256, 1, Quant(), "hidden size 192 is not a multiple of 128"),
    (136, 256, 1, Quant(), "multiple of 16|multiple of 64|128"),
    (128, 192, 2, Quant(group_size=64), "per TP rank 96 is not a multiple of 64"),
    (128, 256, 4, Quant(group_size=128), "per TP rank 64 is not a multiple of 128"),
    (128, 256, 3, Quant(), "does not split evenly into TP size 3"),
    (128, 256, 1, Quant(group_size=16), "group size 16"),
    (128, 256, 1, Quant(group_size=256), "group size 256"),
    (128, 256, 1, Quant(symmetric=False), "asymmetric"),
    (128, 256, 1, Quant(num_bits=8), "4-bit"),
])
def test_specs_refuse_what_marlin_cannot_take(hidden, inter, tp, quant, match):
    with pytest.raises(UnsupportedError, match=match):
        MarlinW4A16Layout().expert_tensor_specs(MoE(4, hidden, inter), quant, 0, tp)


def test_refusals_name_the_checkpoint_tensor():
    moe = MoE(4, 128, 192, layers=[3, 5])
    object.__setattr__(moe, "prefixes", {3: "model.layers.3.block_sparse_moe.experts"})
    object.__setattr__(moe, "proj_names", {"gate": "w1", "up": "w3", "down": "w2"})
    with pytest.raises(UnsupportedError, match=r"model\.layers\.3\.block_sparse_moe\.experts\.\*\.w2\.weight_packed"):
        MarlinW4A16Layout().expert_tensor_specs(moe, Quant(group_size=64), 0, 2)
    with pytest.raises(UnsupportedError, match=r"experts\.\*\.w1\.weight_scale: group size 16"):
        MarlinW4A16Layout().expert_tensor_specs(moe, Quant(group_size=16), 0, 1)


def test_transform_refuses_before_computing_and_names_tensors():
    quant = Quant(group_size=64, actorder=True)
    ex = random_expert(128, 256, 64, True, _gen(2))
    ex["up"]["weight_g_idx"] = ex["up"]["weight_g_idx"].flip(0)
    with pytest.raises(UnsupportedError, match="gate_proj.weight_g_idx differs from up_proj"):
        layout_for(quant).transform_expert(ex, quant, 0, 1, "cpu")

    ex = random_expert(128, 256, 64, False, _gen(2))
    ex["down"]["weight_scale"] = ex["down"]["weight_scale"][:, :1]
    with pytest.raises(CheckpointError, match="down.weight_scale has shape"):
        layout_for(Quant(group_size=64)).transform_expert(ex, Quant(group_size=64), 0, 1, "cpu")

    ex = random_expert(128, 256, 64, False, _gen(2))
    ex["gate"]["weight_shape"] = torch.tensor([256, 120])
    with pytest.raises(CheckpointError, match="gate.weight_shape"):
        layout_for(Quant(group_size=64)).transform_expert(ex, Quant(group_size=64), 0, 1, "cpu")

    ex = random_expert(128, 256, 64, False, _gen(2))
    del ex["down"]["weight_scale"]
    with pytest.raises(CheckpointError, match="no 'weight_scale'"):
        layout_for(Quant(group_size=64)).transform_expert(ex, Quant(group_size=64), 0, 1, "cpu")

    ex = random_expert(128, 256, 64, True, _gen(2))
    del ex["down"]["weight_g_idx"]
    with pytest.raises(CheckpointError, match="no 'weight_g_idx'"):
        layout_for(Quant(group_size=64, actorder=True)).transform_expert(
            ex, Quant(group_size=64, actorder=True), 0, 1, "cpu")


# ------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("actorder", [False, True])
def test_transform_on_cuda_equals_cpu(actorder):
    quant = Quant(group_size=128, actorder=actorder)
    ex = random_expert(1024, 2048, 128, actorder, _gen(8))
    layout = layout_for(quant)
    for tp in (1, 2):
        for r in range(tp):
            cpu = layout.transform_expert(ex, quant, r, tp, "cpu")
            ex_gpu = {p: {k: v.cuda() for k, v in d.items()} for p, d in ex.items()}
            gpu = layout.transform_expert(ex_gpu, quant, r, tp, "cuda")
            assert list(cpu) == list(gpu)
            for name in cpu:
                assert gpu[name].device.type == "cpu" and torch.equal(gpu[name], cpu[name]), name
