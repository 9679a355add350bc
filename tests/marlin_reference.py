"""Test-only ground truth for the Marlin repack: a slow reference written straight from the closed form,
an exact inverse (Marlin -> pack-quantized), and a model of what vLLM's loader holds per TP rank.

Nothing here imports mmap_offload.repack: it is the independent side of every comparison.

Closed form (docs/LAYOUTS.md): for lane i = 4b + a (a < 4, b < 8) and j < 4, word
M[kt, nt*128 + 4i + j] holds in nibble t = 4l + 2g + h (l, g, h in {0, 1}) the value
W'[kt*16 + 8h + 2a + l, nt*64 + 16j + 8g + b], W'[k, n] = u[n, perm[k]].
"""

from __future__ import annotations

import numpy as np
import torch

GROUPED_CHUNK = [i + 8 * j for i in range(8) for j in range(8)]  # out[64c + 8i + j] = in[64c + i + 8j]
SINGLE_CHUNK = [2 * i + o for i in range(4) for o in (0, 1, 8, 9, 16, 17, 24, 25)]


# ------------------------------------------------------------------ pack-quantized <-> values

def unpack_values(packed: torch.Tensor) -> np.ndarray:
    """pack-quantized int32 [N, K/8] -> uint8 values u[n, k] in [0, 15] (nibble k % 8 of word k // 8)."""
    words = packed.cpu().numpy().astype(np.int64) & 0xFFFFFFFF
    n, kw = words.shape
    u = np.zeros((n, kw * 8), dtype=np.uint8)
    for j in range(8):
        u[:, j::8] = (words >> (4 * j)) & 0xF
    return u


def pack_values(u: np.ndarray) -> torch.Tensor:
    """uint8 values u[n, k] in [0, 15] -> pack-quantized int32 [N, K/8]."""
    n, k = u.shape
    words = np.zeros((n, k // 8), dtype=np.int64)
    for j in range(8):
        words |= u[:, j::8].astype(np.int64) << (4 * j)
    return torch.from_numpy(np.where(words >= 2**31, words - 2**32, words).astype(np.int32))


def random_packed(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random pack-quantized weights [n, k/8] (every bit pattern allowed)."""
    return torch.randint(-2**31, 2**31, (n, k // 8), dtype=torch.int64, generator=gen).to(torch.int32)


# ------------------------------------------------------------------ the slow reference

def ref_repack(packed: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Marlin words [K/16, 2N] from pack-quantized [N, K/8], looping over tiles, lanes, words, nibbles."""
    u = unpack_values(packed)  # [N, K]
    n_size, k_size = u.shape
    src_k = list(range(k_size)) if perm is None else [int(p) for p in perm.reshape(-1).tolist()]
    out = np.zeros((k_size // 16, 2 * n_size), dtype=np.int64)
    for kt in range(k_size // 16):
        for nt in range(n_size // 64):
            for i in range(32):  # lane
                a, b = i % 4, i // 4
                for j in range(4):  # word of the lane
                    word = 0
                    for t in range(8):  # nibble
                        l, g, h = t >> 2, (t >> 1) & 1, t & 1
                        k = kt * 16 + 8 * h + 2 * a + l
                        n = nt * 64 + 16 * j + 8 * g + b
                        word |= int(u[n, src_k[k]]) << (4 * t)
                    out[kt, nt * 128 + 4 * i + j] = word
    return torch.from_numpy(np.where(out >= 2**31, out - 2**32, out).astype(np.int32))


def ref_permute_scales(s: torch.Tensor, grouped: bool) -> torch.Tensor:
    """marlin_permute_scales by loops: chunks of 64 (grouped) or 32 (channelwise) of the flattened [G, N]."""
    flat = s.reshape(-1)
    chunk = GROUPED_CHUNK if grouped else SINGLE_CHUNK
    size = len(chunk)
    out = torch.empty_like(flat)
    for c in range(flat.numel() // size):
        for pos in range(size):
            out[c * size + pos] = flat[c * size + chunk[pos]]
    return out.reshape(s.shape)


# ------------------------------------------------------------------ the exact inverse

def inverse_repack(marlin: torch.Tensor) -> torch.Tensor:
    """Marlin words [K/16, 2N] -> the pack-quantized [N, K/8] they came from (rows in repack order,
    i.e. W' = W with act-order's perm applied; see ``unpermute_k``). Vectorised over nibbles."""
    kt_n, two_n = marlin.shape
    n_size = two_n // 2
    w = marlin.cpu().to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * t)) & 0xF for t in range(8)], dim=-1)  # [KT, 2N, t]
    # word index inside a K-tile row: nt*128 + 4*(4b + a) + j; nibble t = 4l + 2g + h
    nib = nib.reshape(kt_n, n_size // 64, 8, 4, 4, 2, 2, 2)  # kt, nt, b, a, j, l, g, h
    # value at n = nt*64 + 16j + 8g + b, k = kt*16 + 8h + 2a + l
    vals = nib.permute(1, 4, 6, 2, 0, 7, 3, 5).reshape(n_size, kt_n * 16)  # [nt, j, g, b] x [kt, h, a, l]
    return pack_values(vals.numpy().astype(np.uint8))


def unpermute_k(packed_perm: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Undo act-order: column k of the input held source column perm[k]."""
    u = unpack_values(packed_perm)
    out = np.empty_like(u)
    out[:, perm.cpu().numpy().astype(np.int64)] = u
    return pack_values(out)


def inverse_permute_scales(s: torch.Tensor, grouped: bool) -> torch.Tensor:
    chunk = torch.tensor(GROUPED_CHUNK if grouped else SINGLE_CHUNK)
    flat = s.reshape(-1, chunk.numel())
    out = torch.empty_like(flat)
    out[:, chunk] = flat
    return out.reshape(s.shape)


# ------------------------------------------------------------------ vLLM's per-rank view, modelled

def vllm_loaded(gate: dict, up: dict, down: dict, group_size: int, actorder: bool, tp_rank: int,
                tp_size: int) -> dict[str, torch.Tensor]:
    """What FusedMoE.weight_loader puts in vLLM's compressed-tensors WNA16 Marlin MoE parameters for one
    expert on one rank, before processing: weights transposed to GPTQ orientation, w1/w3 sharded along N,
    w2 along K; w2 scales whole when ``load_full_w2`` (act-order with groups) or channelwise; w13 g_idx
    whole (w1's then w3's copied into one), w2 g_idx sharded."""
    inter, hw = gate["weight_packed"].shape
    i_r = inter // tp_size
    r0, r1 = tp_rank * i_r, (tp_rank + 1) * i_r
    load_full_w2 = actorder and group_size != -1
    out = {
        "w13_weight_packed": torch.cat([gate["weight_packed"].t()[:, r0:r1], up["weight_packed"].t()[:, r0:r1]], 1),
        "w2_weight_packed": down["weight_packed"].t()[r0 // 8: r1 // 8],  # [I_r/8, H]
        "w13_weight_scale": torch.cat([gate["weight_scale"].t()[:, r0:r1], up["weight_scale"].t()[:, r0:r1]], 1),
        "w2_weight_scale": down["weight_scale"].t(),
    }
    if group_size != -1 and not load_full_w2:
        out["w2_weight_scale"] = out["w2_weight_scale"][r0 // group_size: r1 // group_size]
    if actorder:
        out["w13_weight_g_idx"] = up["weight_g_idx"]  # the last one copied in (they must agree)
        out["w2_weight_g_idx"] = down["weight_g_idx"][r0:r1]
    return {k: v.contiguous() for k, v in out.items()}


def vllm_expert(gate: dict, up: dict, down: dict, group_size: int, actorder: bool, tp_rank: int,
                tp_size: int) -> dict[str, torch.Tensor]:
    """What vLLM's compressed-tensors WNA16 Marlin MoE layer holds for one expert on one rank.

    ``vllm_loaded`` then process_weights_after_loading: argsort of g_idx, gptq_marlin_moe_repack,
    marlin_moe_permute_scales with size_k = repacked w13.shape[2] for w13 and num_groups * (g or 8) for
    w2. Slow reference repack."""
    loaded = vllm_loaded(gate, up, down, group_size, actorder, tp_rank, tp_size)
    w13, w2 = loaded["w13_weight_packed"], loaded["w2_weight_packed"]
    s13, s2 = loaded["w13_weight_scale"], loaded["w2_weight_scale"]
    out = {}
    perm13 = perm2 = None
    if actorder:
        g13, g2 = loaded["w13_weight_g_idx"], loaded["w2_weight_g_idx"]
        perm13 = torch.argsort(g13, stable=True).to(torch.int32)
        perm2 = torch.argsort(g2, stable=True).to(torch.int32)
        out_g = {"w13_weight_g_idx": g13[perm13.long()].to(torch.int32), "w13_g_idx_sort_indices": perm13,
                 "w2_weight_g_idx": g2[perm2.long()].to(torch.int32), "w2_g_idx_sort_indices": perm2}
    # the reference repack takes pack-quantized orientation [N, K/8]
    m13 = ref_repack(w13.t().contiguous(), perm13)
    m2 = ref_repack(w2.t().contiguous(), perm2)
    size_k13 = m13.shape[1]  # w13_weight_packed.shape[2] after the repack: 4 * I_r
    size_k2 = s2.shape[0] * (group_size if group_size != -1 else 8)
    grouped13 = group_size != -1 and group_size < size_k13
    grouped2 = group_size != -1 and group_size < size_k2
    out["w13_weight_packed"] = m13
    out["w2_weight_packed"] = m2
    out["w13_weight_scale"] = ref_permute_scales(s13.contiguous(), grouped13)
    out["w2_weight_scale"] = ref_permute_scales(s2.contiguous(), grouped2)
    if actorder:
        out.update(out_g)
    return out


def random_expert(hidden: int, inter: int, group_size: int, actorder: bool, gen: torch.Generator,
                  scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, torch.Tensor]]:
    """One expert's compressed-tensors tensors: gate/up [I, H], down [H, I] (N, K orientation)."""
    def proj(n: int, k: int, g_idx: torch.Tensor | None) -> dict[str, torch.Tensor]:
        groups = 1 if group_size == -1 else k // group_size
        d = {"weight_packed": random_packed(n, k, gen),
             "weight_scale": (torch.rand((n, groups), generator=gen) + 0.5).to(scale_dtype),
             "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        if g_idx is not None:
            d["weight_g_idx"] = g_idx
        return d

    def g_idx(k: int) -> torch.Tensor | None:
        if not actorder:
            return None
        gs = k if group_size == -1 else group_size
        return (torch.arange(k) // gs)[torch.randperm(k, generator=gen)].to(torch.int32)

    g13 = g_idx(hidden)
    return {"gate": proj(inter, hidden, g13), "up": proj(inter, hidden, None if g13 is None else g13.clone()),
            "down": proj(hidden, inter, g_idx(inter))}
