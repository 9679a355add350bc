"""The pluggable layout step of the warm-up: one expert's checkpoint tensors -> its cache tensors, per TP rank.

    layout = layout_for(quant)                     # UnquantizedLayout | MarlinW4A16Layout
    specs = layout.expert_tensor_specs(moe, quant, tp_rank, tp_size)   # [(name, dtype_name, shape)]
    out = layout.transform_expert(tensors, quant, tp_rank, tp_size, device)  # {name: CPU tensor}

``tensors`` is ``{"gate": {...}, "up": {...}, "down": {...}}`` with ONE expert's checkpoint tensors
(``weight`` when unquantized; ``weight_packed``, ``weight_scale``, ``weight_shape`` and, with act-order,
``weight_g_idx`` for W4A16). The result holds exactly what vLLM's fused-MoE layer holds for that expert on
that rank after ``process_weights_after_loading``, in spec order, CPU and contiguous.
``expert_tensor_specs`` checks every shape rule, so a warm-up refuses before it writes anything.

Layouts (docs/LAYOUTS.md says the same in a table):
- "unquantized" v1: ``w13_weight [2*I_r, H]`` (gate rows then up rows of this rank's shard),
  ``w2_weight [H, I_r]``; the checkpoint's dtype.
- "marlin-w4a16" v1: ``w13_weight_packed [H/16, 4*I_r]`` int32, ``w2_weight_packed [I_r/16, 2*H]`` int32,
  ``w13_weight_scale [G13, 2*I_r]``, ``w2_weight_scale [G2, H]`` (Marlin-permuted), and with act-order
  ``w13_weight_g_idx``, ``w13_g_idx_sort_indices`` [H] and ``w2_weight_g_idx``, ``w2_g_idx_sort_indices``
  [I_r] (int32; g_idx sorted).

TP follows vLLM's FusedMoE loader: w13 is split along the intermediate dim (rank r takes rows
``[r*I_r, (r+1)*I_r)`` of gate and of up), w2 along its input dim (columns of down); the shard is taken
before repacking. w2 scales are not split when channelwise, nor with act-order and groups (vLLM's
``load_full_w2``); w13's g_idx is whole, w2's is split like w2.
"""

from __future__ import annotations

from typing import Any

import torch

from .cache_format import DTYPE_NAMES
from .errors import CheckpointError, UnsupportedError
from .repack import (PACK_FACTOR, TILE_K, check_group_size, check_repack_shape, check_symmetric,
                     marlin_repack, permute_scales, sort_g_idx)

Spec = tuple[str, str, tuple[int, ...]]
PROJS = ("gate", "up", "down")


def _dtype_name(dtype: torch.dtype, what: str) -> str:
    if dtype not in DTYPE_NAMES:
        raise UnsupportedError(f"{what} has dtype {dtype}, which the cache cannot hold",
                               f"use one of {', '.join(sorted(DTYPE_NAMES.values()))}")
    return DTYPE_NAMES[dtype]


def _shard_size(intermediate: int, tp_rank: int, tp_size: int) -> int:
    """This rank's share I_r of the intermediate size, as vLLM splits it (evenly)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise UnsupportedError(f"TP rank {tp_rank} of size {tp_size} is invalid", "pass 0 <= rank < size")
    if intermediate % tp_size:
        raise UnsupportedError(f"intermediate size {intermediate} does not split evenly into TP size {tp_size}",
                               "pick a TP size that divides it")
    return intermediate // tp_size


def _require(t: dict[str, torch.Tensor], proj: str, key: str) -> torch.Tensor:
    if key not in t:
        raise CheckpointError(f"expert {proj} projection has no {key!r} tensor", "check the checkpoint's tensors")
    return t[key]


def _check_shape(proj: str, key: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"expert {proj}.{key} has shape {tuple(t.shape)}, expected {tuple(shape)}",
                              "the checkpoint's expert tensors disagree with its config")


def _tensor_name(moe: Any, proj: str) -> str:
    """``<prefix of the first MoE layer>.*.<checkpoint projection name>`` for messages, e.g.
    ``model.layers.0.block_sparse_moe.experts.*.w1``; ``experts.*.gate`` without that information."""
    prefixes = getattr(moe, "prefixes", None) or {}
    names = getattr(moe, "proj_names", None) or {}
    layers = list(getattr(moe, "layers", None) or [])
    prefix = prefixes.get(layers[0], "experts") if layers else "experts"
    return f"{prefix}.*.{names.get(proj, proj)}"


class Layout:
    """Base of the layouts: ``name``, ``version`` and the two methods of the contract."""

    name = ""
    version = 0

    def expert_tensor_specs(self, moe: Any, quant: Any, tp_rank: int, tp_size: int) -> list[Spec]:
        raise NotImplementedError

    def transform_expert(self, tensors: dict[str, dict[str, torch.Tensor]], quant: Any, tp_rank: int,
                         tp_size: int, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<layout {self.name} v{self.version}>"


class UnquantizedLayout(Layout):
    """bf16/fp16/fp32 experts as vLLM's unquantized FusedMoE holds them."""

    name = "unquantized"
    version = 1

    def expert_tensor_specs(self, moe, quant, tp_rank, tp_size):
        i_r = _shard_size(int(moe.intermediate), tp_rank, tp_size)
        h = int(moe.hidden)
        dt = _dtype_name(quant.weight_dtype, "expert weights")
        return [("w13_weight", dt, (2 * i_r, h)), ("w2_weight", dt, (h, i_r))]

    def transform_expert(self, tensors, quant, tp_rank, tp_size, device="cpu"):
        gate, up, down = (_require(tensors.get(p, {}), p, "weight") for p in PROJS)
        inter, hidden = gate.shape
        _check_shape("up", "weight", up, (inter, hidden))
        _check_shape("down", "weight", down, (hidden, inter))
        i_r = _shard_size(int(inter), tp_rank, tp_size)
        rows = slice(tp_rank * i_r, (tp_rank + 1) * i_r)
        w13 = torch.cat([gate[rows], up[rows]], dim=0).to(quant.weight_dtype)
        w2 = down[:, rows].to(quant.weight_dtype)
        return {"w13_weight": w13.cpu().contiguous(), "w2_weight": w2.cpu().contiguous()}


def w13_scale_size_k(i_r: int) -> int:
    """The ``size_k`` vLLM passes to ``marlin_moe_permute_scales`` for w13 (the quirk).

    vLLM's compressed-tensors WNA16 Marlin MoE method permutes w13 scales after w13 has been repacked and
    passes ``size_k=layer.w13_weight_packed.shape[2]``, i.e. 4*I_r (the repacked width), not H. So w13
    group scales always take the grouped 64-chunk permutation (group_size <= 128 < 4*I_r); channelwise ones
    the 32-chunk one. (The 2026 int_wna16 oracle passes I_r instead; the two differ only when
    I_r == group_size, where the grouped permutation is what the kernel reads for H/g > 1 groups.)"""
    return 4 * i_r


def w2_scale_size_k(num_groups: int, group_size: int) -> int:
    """vLLM: ``size_k = w2_scale.shape[1] * (group_size if group_size != -1 else pack_factor)``."""
    return num_groups * (group_size if group_size != -1 else PACK_FACTOR)


class MarlinW4A16Layout(Layout):
    """compressed-tensors pack-quantized symmetric W4A16 experts, Marlin-repacked as vLLM holds them."""

    name = "marlin-w4a16"
    version = 1

    @staticmethod
    def check(hidden: int, intermediate: int, quant: Any, tp_rank: int, tp_size: int, moe: Any = None) -> int:
        """Every rule the layout needs; returns I_r. Raises UnsupportedError naming tensor and rule
        (with the checkpoint's own names when ``moe`` carries ``prefixes`` / ``proj_names``)."""
        gate, up, down = (_tensor_name(moe, p) for p in PROJS)
        if quant.kind != "w4a16" or int(getattr(quant, "num_bits", 4)) != 4:
            raise UnsupportedError(f"the marlin-w4a16 layout takes 4-bit pack-quantized experts, not "
                                   f"{quant.kind} ({getattr(quant, 'num_bits', '?')}-bit)",
                                   "use a W4A16 compressed-tensors checkpoint")
        check_symmetric(f"{gate}.weight_packed", quant.symmetric)
        g = int(quant.group_size)
        check_group_size(f"{gate}.weight_scale", g)
        i_r = _shard_size(intermediate, tp_rank, tp_size)
        # vLLM's MoE Marlin rules (check_moe_marlin_supports_layer): otherwise vLLM would not use Marlin.
        if hidden % 128:
            raise UnsupportedError(f"{gate}.weight_packed: hidden size {hidden} is not a multiple of 128, "
                                   "which vLLM's MoE Marlin kernel needs", "use a model with hidden % 128 == 0")
        need = max(64, g)
        if i_r % need:
            raise UnsupportedError(
                f"{down}.weight_packed: intermediate size per TP rank {i_r} is not a multiple of {need} "
                f"(max(64, group_size)), which vLLM's MoE Marlin kernel needs",
                "use a smaller TP size or a model whose intermediate size allows it")
        if g != -1 and hidden % g:
            raise UnsupportedError(f"{gate}.weight_scale: hidden size {hidden} is not a multiple of group "
                                   f"size {g}", "Marlin needs whole groups")
        # Tile rules of the repack itself (w13: K=H, N=I_r per half; w2: K=I_r, N=H); implied by the above.
        check_repack_shape(f"{gate}.weight_packed and {up}.weight_packed (this rank's shard)", hidden, i_r)
        check_repack_shape(f"{down}.weight_packed (this rank's shard)", i_r, hidden)
        return i_r

    @staticmethod
    def num_groups(hidden: int, intermediate: int, i_r: int, quant: Any) -> tuple[int, int]:
        """(G13, G2): scale rows of w13 and w2 on one rank."""
        g = int(quant.group_size)
        if g == -1:
            return 1, 1
        load_full_w2 = bool(quant.actorder)
        return hidden // g, (intermediate if load_full_w2 else i_r) // g

    def expert_tensor_specs(self, moe, quant, tp_rank, tp_size):
        h, inter = int(moe.hidden), int(moe.intermediate)
        i_r = self.check(h, inter, quant, tp_rank, tp_size, moe)
        g13, g2 = self.num_groups(h, inter, i_r, quant)
        sd = _dtype_name(quant.scale_dtype, "expert weight_scale")
        specs: list[Spec] = [
            ("w13_weight_packed", "int32", (h // TILE_K, 4 * i_r)),
            ("w2_weight_packed", "int32", (i_r // TILE_K, 2 * h)),
            ("w13_weight_scale", sd, (g13, 2 * i_r)),
            ("w2_weight_scale", sd, (g2, h)),
        ]
        if quant.actorder:
            specs += [("w13_weight_g_idx", "int32", (h,)), ("w13_g_idx_sort_indices", "int32", (h,)),
                      ("w2_weight_g_idx", "int32", (i_r,)), ("w2_g_idx_sort_indices", "int32", (i_r,))]
        return specs

    def transform_expert(self, tensors, quant, tp_rank, tp_size, device="cpu"):
        dev = torch.device(device)
        t = {p: {k: v.to(dev, non_blocking=True) for k, v in tensors.get(p, {}).items()} for p in PROJS}
        gate_p, up_p, down_p = (_require(t[p], p, "weight_packed") for p in PROJS)
        inter, hw = gate_p.shape
        hidden = hw * PACK_FACTOR
        i_r = self.check(int(hidden), int(inter), quant, tp_rank, tp_size)
        g = int(quant.group_size)
        g13, g2 = self.num_groups(hidden, inter, i_r, quant)
        for p, (n, k) in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))):
            _check_shape(p, "weight_packed", t[p]["weight_packed"], (n, k // PACK_FACTOR))
            _check_shape(p, "weight_scale", _require(t[p], p, "weight_scale"),
                         (n, 1 if g == -1 else k // g))
            if "weight_shape" in t[p] and [int(v) for v in t[p]["weight_shape"].reshape(-1).tolist()] != [n, k]:
                raise CheckpointError(f"expert {p}.weight_shape is {t[p]['weight_shape'].tolist()}, the "
                                      f"packed weight says {[n, k]}", "the checkpoint is inconsistent")
            if quant.actorder:
                _check_shape(p, "weight_g_idx", _require(t[p], p, "weight_g_idx"), (k,))
        rows = slice(tp_rank * i_r, (tp_rank + 1) * i_r)

        # w13: gate columns [0, 2*I_r) then up columns [2*I_r, 4*I_r) of the repacked [H/16, 4*I_r].
        perm13 = perm2 = None
        out: dict[str, torch.Tensor] = {}
        if quant.actorder:
            gi, ui = t["gate"]["weight_g_idx"], t["up"]["weight_g_idx"]
            if not torch.equal(gi, ui):
                raise UnsupportedError("expert gate_proj.weight_g_idx differs from up_proj.weight_g_idx; "
                                       "vLLM keeps one w13 g_idx per expert", "quantize gate and up with "
                                       "the same act-order (they share their input, so GPTQ gives the same)")
            sorted13, perm13 = sort_g_idx(gi)
            sorted2, perm2 = sort_g_idx(t["down"]["weight_g_idx"][rows])
        w13 = torch.empty((hidden // TILE_K, 4 * i_r), dtype=torch.int32, device=dev)
        marlin_repack(t["gate"]["weight_packed"][rows], perm13, out=w13[:, : 2 * i_r],
                      name="gate_proj.weight_packed")
        marlin_repack(t["up"]["weight_packed"][rows], perm13, out=w13[:, 2 * i_r:], name="up_proj.weight_packed")
        kcols = slice(tp_rank * i_r // PACK_FACTOR, (tp_rank + 1) * i_r // PACK_FACTOR)
        w2 = marlin_repack(t["down"]["weight_packed"][:, kcols], perm2, name="down_proj.weight_packed")

        sd = quant.scale_dtype
        s13 = torch.cat([t["gate"]["weight_scale"][rows].t(), t["up"]["weight_scale"][rows].t()], dim=1)
        s13 = permute_scales(s13.to(sd), w13_scale_size_k(i_r), g)
        s2 = t["down"]["weight_scale"].t()  # [G2_full, H]
        if g != -1 and not quant.actorder:  # grouped without act-order: this rank's groups only
            s2 = s2[tp_rank * g2: (tp_rank + 1) * g2]
        s2 = permute_scales(s2.to(sd), w2_scale_size_k(g2, g), g)

        out["w13_weight_packed"] = w13
        out["w2_weight_packed"] = w2
        out["w13_weight_scale"] = s13
        out["w2_weight_scale"] = s2
        if quant.actorder:
            out["w13_weight_g_idx"] = sorted13
            out["w13_g_idx_sort_indices"] = perm13
            out["w2_weight_g_idx"] = sorted2
            out["w2_g_idx_sort_indices"] = perm2
        return {k: v.cpu().contiguous() for k, v in out.items()}


def checkpoint_view(loaded: dict[str, torch.Tensor], quant: Any) -> dict[str, dict[str, torch.Tensor]]:
    """One expert's tensors as vLLM's weight loader left them on one rank (names as vLLM's parameters,
    without the expert dim, before ``process_weights_after_loading``) -> the ``tensors`` argument of
    ``transform_expert(tensors, quant, 0, 1)``, which then equals what vLLM's processing makes of them.

    For the plugin's probe. Marlin params are in GPTQ orientation (w13 ``[H/8, 2*I_r]``, w2
    ``[I_r/8, H]``, scales ``[G, N]``); the checkpoint view transposes back. Not for act-order with TP > 1,
    where vLLM keeps w2's scales whole while w2 itself is sharded (no checkpoint has that shape)."""
    if quant.kind == "unquantized":
        w13 = loaded["w13_weight"]
        half = w13.shape[0] // 2
        return {"gate": {"weight": w13[:half]}, "up": {"weight": w13[half:]}, "down": {"weight": loaded["w2_weight"]}}
    w13, w2 = loaded["w13_weight_packed"], loaded["w2_weight_packed"]
    s13, s2 = loaded["w13_weight_scale"], loaded["w2_weight_scale"]
    i_r = w13.shape[1] // 2
    if quant.actorder and int(quant.group_size) != -1 and s2.shape[0] * int(quant.group_size) != w2.shape[0] * PACK_FACTOR:
        raise ValueError("act-order with TP > 1: w2 scales are whole while w2 is sharded; no checkpoint view")
    out = {"gate": {"weight_packed": w13[:, :i_r].t().contiguous(), "weight_scale": s13[:, :i_r].t().contiguous()},
           "up": {"weight_packed": w13[:, i_r:].t().contiguous(), "weight_scale": s13[:, i_r:].t().contiguous()},
           "down": {"weight_packed": w2.t().contiguous(), "weight_scale": s2.t().contiguous()}}
    if quant.actorder:
        out["gate"]["weight_g_idx"] = out["up"]["weight_g_idx"] = loaded["w13_weight_g_idx"]
        out["down"]["weight_g_idx"] = loaded["w2_weight_g_idx"]
    return out


_LAYOUTS: dict[str, Layout] = {"unquantized": UnquantizedLayout(), "w4a16": MarlinW4A16Layout()}
LAYOUT_VERSIONS: dict[str, int] = {layout.name: layout.version for layout in _LAYOUTS.values()}


def layout_for(quant: Any) -> Layout:
    """The layout for a checkpoint's QuantScheme (``quant.kind`` "unquantized" or "w4a16")."""
    layout = _LAYOUTS.get(getattr(quant, "kind", None))
    if layout is None:
        raise UnsupportedError(f"no cache layout for quantization {getattr(quant, 'kind', quant)!r}",
                               "use bf16/fp16 or compressed-tensors W4A16 (pack-quantized) experts")
    return layout


def layout_by_name(name: str) -> Layout:
    """The layout called ``name`` ("unquantized" | "marlin-w4a16"), e.g. to read a manifest back."""
    for layout in _LAYOUTS.values():
        if layout.name == name:
            return layout
    raise UnsupportedError(f"unknown cache layout {name!r}", "rebuild the cache with this version")
