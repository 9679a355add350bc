"""One W4A16 grouped MoE expert compute for every benchmark variant, so only weight delivery differs.

Weight orientation (say it once): the kernel reads each expert in the **pre-Marlin GPTQ orientation**,
per slot ``s``::

    w13_q [S, H/8, 2I] int32   packed along K=H: nibble j of word [r, n] is u[8r + j, n], u = q + 8
    w13_s [S, H/G, 2I] bf16    group scales (G = group size; G = H for channelwise)
    w2_q  [S, I/8, H]  int32
    w2_s  [S, I/G, H]  bf16

and computes ``y = sum_k route_w[t, k] * W2_e(silu(gate) * up)`` with ``[gate | up] = x @ W13_e``,
``W[k, n] = (u[k, n] - 8) * scale[k // G, n]``. A Marlin cache record of one expert
(``w13_weight_packed [H/16, 4I]`` ...) holds exactly the same number of bytes per tensor, so the
benchmark reinterprets the served Marlin bytes in this orientation: the work per byte and the bytes read
per routed expert are identical to a Marlin kernel, the numbers it computes from Marlin bytes are not the
model's (kernel correctness is tested on GPTQ-orientation data against :func:`reference_moe`).

The kernel reads only the routed experts' bytes: tokens are grouped by slot on the host
(:func:`align_routing`, like vLLM's ``moe_align_block_size``) and each program multiplies one block of
rows of one slot by one column tile, unpacking int4 in registers. Weights can be a device tensor or a
UVA alias of pinned host memory (:func:`uva_alias`): then the kernel reads host memory in place over
PCIe, as vLLM's UVA offload does.

    ExpertWeights   four [S, ...] views (device, UVA alias, or CPU)
    moe_forward     align routing -> w13 GEMM -> silu*up -> w2 GEMM -> weighted sum ("triton" | "torch")
    reference_moe   independent fp32 dequant reference (tests)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

try:  # Triton is optional: the CPU benchmark and the CI tests use the torch path.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover - depends on the install
    HAVE_TRITON = False


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


@dataclass
class ExpertWeights:
    """Per-slot expert weights in GPTQ orientation (see module docstring). Views may be strided in dim 0."""

    w13_q: torch.Tensor  # [S, H/8, 2I] int32
    w13_s: torch.Tensor  # [S, H/G, 2I]
    w2_q: torch.Tensor  # [S, I/8, H] int32
    w2_s: torch.Tensor  # [S, I/G, H]

    @property
    def hidden(self) -> int:
        return self.w13_q.shape[1] * 8

    @property
    def inter(self) -> int:
        return self.w13_q.shape[2] // 2

    @property
    def num_slots(self) -> int:
        return self.w13_q.shape[0]

    @property
    def group13(self) -> int:
        return self.hidden // self.w13_s.shape[1]

    @property
    def group2(self) -> int:
        return self.inter // self.w2_s.shape[1]

    @property
    def device(self) -> torch.device:
        return self.w13_q.device

    def expert_nbytes(self) -> int:
        """Bytes one routed expert costs to read (all four tensors)."""
        return sum(t[0].numel() * t.element_size() for t in (self.w13_q, self.w13_s, self.w2_q, self.w2_s))


# Marlin cache tensor name -> (field, GPTQ-orientation shape as a function of H, I, G13, G2)
_MARLIN_TO_GPTQ = {
    "w13_weight_packed": ("w13_q", lambda H, I, g13, g2: (H // 8, 2 * I)),
    "w13_weight_scale": ("w13_s", lambda H, I, g13, g2: (H // g13, 2 * I)),
    "w2_weight_packed": ("w2_q", lambda H, I, g13, g2: (I // 8, H)),
    "w2_weight_scale": ("w2_s", lambda H, I, g13, g2: (I // g2, H)),
}


def weights_from_records(buf: torch.Tensor, specs, hidden: int, inter: int) -> ExpertWeights:
    """Views over ``buf`` ([S, record_nbytes] uint8, one cache record per row) in GPTQ orientation.

    ``specs`` are the cache's TensorSpecs (name, dtype, shape, offset, nbytes). Each Marlin tensor is
    reinterpreted with the same byte count (checked); act-order index tensors are ignored."""
    if buf.dtype != torch.uint8 or buf.dim() != 2:
        raise ValueError("buf must be [S, record_nbytes] uint8")
    by_name = {s.name: s for s in specs}
    g13 = hidden // by_name["w13_weight_scale"].shape[0] if by_name["w13_weight_scale"].shape[0] else hidden
    g2 = inter // by_name["w2_weight_scale"].shape[0] if by_name["w2_weight_scale"].shape[0] else inter
    out = {}
    for name, (field, shape_fn) in _MARLIN_TO_GPTQ.items():
        spec = by_name[name]
        dt = spec.torch_dtype
        shape = shape_fn(hidden, inter, g13, g2)
        want = int(np.prod(shape)) * dt.itemsize
        if want != spec.nbytes:
            raise ValueError(f"{name}: {spec.nbytes} bytes in the cache, {want} in GPTQ orientation {shape}")
        raw = buf[:, spec.offset : spec.offset + spec.nbytes]
        out[field] = raw.view(dt).unflatten(1, shape)
    return ExpertWeights(**out)


def weights_from_tensors(tensors: dict, hidden: int, inter: int) -> ExpertWeights:
    """Views over per-name slot tensors ``{name: [S, *marlin_shape]}`` (ExpertCache / LayerPrefetcher
    buffers, or per-layer ``[E, ...]`` parameters) in GPTQ orientation, same bytes per slot."""
    sc13 = tensors["w13_weight_scale"]
    sc2 = tensors["w2_weight_scale"]
    g13 = hidden // (sc13[0].numel() // (2 * inter))
    g2 = inter // (sc2[0].numel() // hidden)
    out = {}
    for name, (field, shape_fn) in _MARLIN_TO_GPTQ.items():
        t = tensors[name]
        shape = shape_fn(hidden, inter, g13, g2)
        if t[0].numel() != int(np.prod(shape)):
            raise ValueError(f"{name}: {tuple(t.shape[1:])} does not hold GPTQ orientation {shape}")
        if not t.is_contiguous():
            t = t.contiguous()
        out[field] = t.reshape(t.shape[0], *shape)
    return ExpertWeights(**out)


def random_weights(
    num_experts: int, hidden: int, inter: int, group: int = 128, device="cpu", seed: int = 0
) -> ExpertWeights:
    """Random GPTQ-orientation W4A16 experts (scales ~ 1/sqrt(K) so activations stay O(1))."""
    g = torch.Generator().manual_seed(seed)

    def packed(k: int, n: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, (num_experts, k // 8, n), generator=g, dtype=torch.int64).to(
            torch.int32
        )

    def scales(k: int, n: int, grp: int) -> torch.Tensor:
        s = (torch.rand(num_experts, k // grp, n, generator=g) * 0.5 + 0.75) / (4.6 * k**0.5)
        return s.to(torch.bfloat16)

    w = ExpertWeights(
        packed(hidden, 2 * inter), scales(hidden, 2 * inter, group), packed(inter, hidden), scales(inter, hidden, group)
    )
    return ExpertWeights(*(t.to(device) for t in (w.w13_q, w.w13_s, w.w2_q, w.w2_s)))


# --------------------------------------------------------------------------------------------
# UVA: a CUDA tensor aliasing pinned host memory (read in place over PCIe)
# --------------------------------------------------------------------------------------------


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` owner so torch can wrap a raw device address."""

    def __init__(self, ptr: int, nbytes: int, owner):
        self._owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def _host_device_pointer(ptr: int) -> int:
    """cudaHostGetDevicePointer through the CUDA runtime that torch loaded (ctypes)."""
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            lib = None
    if lib is None:
        import glob
        import os

        hits = glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "*", "lib", "libcudart.so*"))
        if not hits:
            raise OSError("libcudart not found")
        lib = ctypes.CDLL(hits[0])
    dev = ctypes.c_void_p()
    rc = lib.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(ptr), ctypes.c_uint(0))
    if rc != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer returned {rc}")
    return int(dev.value)


def uva_alias(host: torch.Tensor, device: torch.device | str = "cuda") -> tuple[torch.Tensor, str]:
    """A tensor (same shape/dtype) that CUDA kernels read *in place* from the pinned host tensor ``host``.

    Kernels reading it read host memory over PCIe (zero copy). Returns (alias, method). Tries, in
    order: a CUDA tensor at the host address itself (UVA: equal for cudaHostAlloc'd memory), one at
    ``cudaHostGetDevicePointer``'s address (each checked by an elementwise kernel reading a few bytes
    back), and last the pinned CPU tensor itself ("pinned-tensor": Triton maps it to its device
    address with cuPointerGetAttribute; torch ops would treat it as a CPU tensor)."""
    if not host.is_pinned():
        raise ValueError("uva_alias needs pinned host memory")
    if not host.is_contiguous():
        raise ValueError("uva_alias needs a contiguous tensor")
    flat = host.view(-1).view(torch.uint8)
    n = flat.numel()
    errors = []
    for method in ("host-pointer", "cudaHostGetDevicePointer"):
        try:
            ptr = flat.data_ptr() if method == "host-pointer" else _host_device_pointer(flat.data_ptr())
            alias = torch.as_tensor(_CudaArray(ptr, n, host), device=device)
            probe = min(n, 4096)
            if probe:
                got = (alias[:probe].to(torch.int32) + 0).cpu()  # a kernel reads the host bytes
                if not torch.equal(got, flat[:probe].to(torch.int32)):
                    raise RuntimeError("read-back mismatch")
            return alias.view(host.dtype).view(host.shape), method
        except Exception as exc:  # try the next method
            errors.append(f"{method}: {exc}")
    if HAVE_TRITON:
        return host, "pinned-tensor (" + "; ".join(errors) + ")"
    raise RuntimeError("no UVA alias of pinned memory worked: " + "; ".join(errors))


# --------------------------------------------------------------------------------------------
# Routing alignment (host side)
# --------------------------------------------------------------------------------------------


def align_routing(slot_ids: np.ndarray, num_slots: int, block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """Group (token, k) pairs by slot, each group padded to a multiple of ``block_m``.

    slot_ids: [T, k] ints in [0, num_slots). Returns (sorted_pairs int32 [B*block_m], padded with T*k,
    block_slot int32 [B]) where pair p = t*k + j. Only used slots get blocks."""
    flat = np.asarray(slot_ids, dtype=np.int64).reshape(-1)
    p = flat.size
    if p and (flat.min() < 0 or flat.max() >= num_slots):
        raise ValueError("slot id out of range")
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=num_slots)
    used = np.nonzero(counts)[0]
    blocks = (counts[used] + block_m - 1) // block_m
    block_slot = np.repeat(used, blocks).astype(np.int32)
    starts_padded = np.zeros(num_slots, dtype=np.int64)
    starts_padded[used] = np.concatenate(([0], np.cumsum(blocks)[:-1])) * block_m
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    e_sorted = flat[order]
    dest = starts_padded[e_sorted] + (np.arange(p) - starts[e_sorted])
    sorted_pairs = np.full(int(blocks.sum()) * block_m, p, dtype=np.int32)
    sorted_pairs[dest] = order
    return sorted_pairs, block_slot


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit(do_not_specialize=["num_pairs"])
    def _w4a16_grouped_gemm(
        a_ptr,
        b_ptr,
        s_ptr,
        c_ptr,
        sorted_ptr,
        block_slot_ptr,
        num_pairs,
        N,
        stride_am,
        stride_ak,
        stride_be,
        stride_bk,
        stride_bn,
        stride_se,
        stride_sk,
        stride_sn,
        stride_cm,
        stride_cn,
        K: tl.constexpr,
        A_ROW_DIV: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """C[pair, n] = sum_k A[pair // A_ROW_DIV, k] * (u[k, n] - 8) * s[k // GROUP, n] for one slot block."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        slot = tl.load(block_slot_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + offs_m)
        m_mask = pair < num_pairs
        a_row = (pair // A_ROW_DIV).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        offs_kp = tl.arange(0, BLOCK_K // 8)
        shifts = tl.arange(0, 8) * 4
        b_base = b_ptr + slot * stride_be
        s_base = s_ptr + slot * stride_se
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(
                a_ptr + a_row[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                mask=m_mask[:, None],
                other=0.0,
            )
            bq = tl.load(
                b_base + (k0 // 8 + offs_kp)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=n_mask[None, :],
                other=0,
            )
            q = (bq[:, None, :] >> shifts[None, :, None]) & 0xF
            w = tl.reshape(q - 8, (BLOCK_K, BLOCK_N)).to(tl.float32).to(a_ptr.dtype.element_ty)
            part = tl.dot(a, w)
            sc = tl.load(s_base + (k0 // GROUP) * stride_sk + offs_n * stride_sn, mask=n_mask, other=0.0)
            acc += part * sc.to(tl.float32)[None, :]
        tl.store(
            c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=m_mask[:, None] & n_mask[None, :],
        )


# Tile config for the decode regime (<= 16 rows per slot). bench_moe.py times candidates on a UVA
# layer and sets the winner here, for every variant alike; the default is the H200 winner
# (48 GB/s reading pinned host memory in place, pinned H2D copy 55 GB/s in the same run).
DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=6)


def _pick_config(pairs_per_slot: float, k: int, group: int) -> dict:
    if pairs_per_slot <= 16:
        cfg = dict(DECODE_CONFIG)
    elif pairs_per_slot <= 64:
        cfg = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    while cfg["BLOCK_K"] > 16 and (group % cfg["BLOCK_K"] or k % cfg["BLOCK_K"]):
        cfg["BLOCK_K"] //= 2
    if group % cfg["BLOCK_K"] or k % cfg["BLOCK_K"]:
        raise ValueError(f"K={k}, group={group}: need multiples of 16")
    return cfg


def _grouped_gemm(a, bq, bs, sorted_pairs, block_slot, num_pairs, a_row_div, group, cfg, out_dtype):
    n = bq.shape[2]
    k = bq.shape[1] * 8
    c = torch.empty((num_pairs, n), dtype=out_dtype, device=a.device)
    grid = (block_slot.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    _w4a16_grouped_gemm[grid](
        a, bq, bs, c, sorted_pairs, block_slot, num_pairs, n,
        a.stride(0), a.stride(1),
        bq.stride(0), bq.stride(1), bq.stride(2),
        bs.stride(0), bs.stride(1), bs.stride(2),
        c.stride(0), c.stride(1),
        K=k, A_ROW_DIV=a_row_div, GROUP=group, **cfg,
    )  # fmt: skip
    return c


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def _unpack(q: torch.Tensor) -> torch.Tensor:
    """[K/8, N] int32 -> [K, N] int in [-8, 7] (nibble j of row r is k = 8r + j)."""
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int32)
    u = (q.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF
    return u.reshape(q.shape[0] * 8, q.shape[1]) - 8


def _dequant(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    w = _unpack(q).to(dtype)
    group = w.shape[0] // s.shape[0]
    return w * s.to(dtype).repeat_interleave(group, dim=0)


def moe_forward(
    x: torch.Tensor,
    slot_ids: np.ndarray,
    route_w: torch.Tensor,
    w: ExpertWeights,
    impl: str = "triton",
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One MoE layer: x [T, H], slot_ids [T, k] (host ints indexing w's slots), route_w [T, k] -> [T, H].

    ``impl="triton"`` runs the W4A16 kernel (CUDA); ``"torch"`` dequantizes each routed slot and uses
    matmul (CPU benchmark). Both touch only routed slots' bytes."""
    slot_ids = np.asarray(slot_ids)
    t, topk = slot_ids.shape
    if impl == "triton":
        if not HAVE_TRITON:
            raise RuntimeError("triton is not installed: use impl='torch'")
        p = t * topk
        cfg13 = _pick_config(p / max(1, len(np.unique(slot_ids))), w.hidden, w.group13)
        sp, bs = align_routing(slot_ids, w.num_slots, cfg13["BLOCK_M"])
        dev = x.device
        # one copy from pinned memory: from pageable memory the copy may wait for the stream to
        # reach it, i.e. for every copy the stream was told to wait for (serialising host and GPU)
        host = torch.empty(sp.size + bs.size, dtype=torch.int32, pin_memory=dev.type == "cuda")
        hn = host.numpy()
        hn[:sp.size] = sp
        hn[sp.size:] = bs
        dev_buf = host.to(dev, non_blocking=True)
        sp_t, bs_t = dev_buf[:sp.size], dev_buf[sp.size:]
        h = _grouped_gemm(x, w.w13_q, w.w13_s, sp_t, bs_t, p, topk, w.group13, cfg13, x.dtype)
        inter = w.inter
        act = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
        cfg2 = dict(cfg13)
        while cfg2["BLOCK_K"] > 16 and (w.group2 % cfg2["BLOCK_K"] or inter % cfg2["BLOCK_K"]):
            cfg2["BLOCK_K"] //= 2
        y = _grouped_gemm(act, w.w2_q, w.w2_s, sp_t, bs_t, p, 1, w.group2, cfg2, torch.float32)
        out = (y.view(t, topk, -1) * route_w.to(torch.float32).unsqueeze(-1)).sum(1)
        return out.to(x.dtype)
    if impl != "torch":
        raise ValueError(f"impl must be 'triton' or 'torch', not {impl!r}")
    cdt = compute_dtype or (torch.float32 if x.device.type == "cpu" else x.dtype)
    out = torch.zeros(t, w.hidden, dtype=torch.float32, device=x.device)
    xf = x.to(cdt)
    rw = route_w.to(torch.float32)
    inter = w.inter
    for s in np.unique(slot_ids):
        tok, j = np.nonzero(slot_ids == s)
        tok_t = torch.from_numpy(tok).to(x.device)
        j_t = torch.from_numpy(j).to(x.device)
        w13 = _dequant(w.w13_q[int(s)], w.w13_s[int(s)], cdt)
        h = xf[tok_t] @ w13
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        y = (act @ _dequant(w.w2_q[int(s)], w.w2_s[int(s)], cdt)).float()
        out.index_add_(0, tok_t, y * rw[tok_t, j_t].unsqueeze(1))
    return out.to(x.dtype)


def reference_moe(x: torch.Tensor, slot_ids: np.ndarray, route_w: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """fp32 reference with an independent nibble loop; returns [T, H] float32 on CPU."""

    def deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        q = q.cpu().to(torch.int64)
        k8, n = q.shape
        wt = torch.empty(k8 * 8, n, dtype=torch.float32)
        for j in range(8):
            wt[j::8] = (((q >> (4 * j)) & 15) - 8).float()
        grp = (k8 * 8) // s.shape[0]
        return wt * s.cpu().float()[torch.arange(k8 * 8) // grp]

    xf = x.cpu().float()
    out = torch.zeros(x.shape[0], w.hidden)
    slot_ids = np.asarray(slot_ids)
    for t in range(slot_ids.shape[0]):
        for j in range(slot_ids.shape[1]):
            s = int(slot_ids[t, j])
            h = xf[t] @ deq(w.w13_q[s], w.w13_s[s])
            a = torch.nn.functional.silu(h[: w.inter]) * h[w.inter :]
            if x.dtype == torch.bfloat16:  # the kernel feeds w2 bf16 activations
                a = a.to(torch.bfloat16).float()
            out[t] += float(route_w[t, j]) * (a @ deq(w.w2_q[s], w.w2_s[s]))
    return out
