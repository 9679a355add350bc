"""Marlin repack of compressed-tensors ``pack-quantized`` symmetric W4A16 weights, in plain torch.

The same code runs on CPU and CUDA tensors and is bit-exact with what vLLM's
``gptq_marlin_repack`` kernel and ``marlin_permute_scales`` produce (docs/LAYOUTS.md has the mapping).

Input layout (compressed-tensors, per projection): ``weight_packed`` int32 ``[N, K/8]``, output channels N in
rows, nibble j (bits 4j..4j+3) of word ``P[n, c]`` holds ``u[n, 8c + j] = q + 8``. This is the transpose of
GPTQ's ``[K/8, N]`` (same words), which is what vLLM feeds the kernel after loading.

Output (Marlin): int32 ``[K/16, 2N]``. Each 16 (k) x 64 (n) tile is 128 consecutive words; tile (kt, nt)
starts at word ``(kt * N/64 + nt) * 128``. For lane ``i = 4b + a`` (a < 4, b < 8) and ``j < 4``, word
``M[kt, nt*128 + 4i + j]`` holds in nibble ``t = 4l + 2g + h`` the value
``W'[kt*16 + 8h + 2a + l, nt*64 + 16j + 8g + b]``, where ``W'[k, n] = u[n, perm[k]]`` (``perm`` is the
act-order ``sort_indices``, the identity without act-order).

Everything here is separable, so the warm-up can stream: a 16-row-aligned K-slice of the output only reads
the matching K-slice of the input (without act-order), and 64-column-aligned N-slices (w13's gate and up
halves) repack independently. Functions take one projection of one expert (or a K-slice of it).

How the CPU path works (no per-element Python): the input is viewed as int64 words (the two int32 words,
``h`` = 0/1, of one row and one K-tile), blocked so a block fits in cache, and regrouped by one int64
permute so that the four rows feeding one output word pair are four aligned arrays. Four exchanges
(6 bit operations on each pair of arrays) then trade the row bits (g, and j's low bit) for the nibble
index bits (a) and put h and l in place. Each output int64 is two consecutive Marlin words, written
straight into the result. Act-order first gathers K (``gather_k``, whole words, see there). The CUDA
path unpacks to one value per byte and writes each Marlin byte from two strided views (fewest kernel
launches).
"""

from __future__ import annotations

import torch

from .errors import UnsupportedError

TILE_K = 16  # Marlin tile: 16 input rows (k) ...
TILE_N = 64  # ... by 64 output columns (n)
PACK_FACTOR = 8  # 4-bit values per int32 word
SUPPORTED_GROUP_SIZES = (-1, 32, 64, 128)

# "bits" method, CPU blocking: a block of CPU_KT_BLOCK K-tiles by as many 64-row N-tiles as fit in
# CPU_BLOCK_BYTES of input, so the working set (input block, scratch arrays) stays in cache; tuned with
# benchmarks/bench_repack.py on a 2-core build machine.
CPU_KT_BLOCK = 128
CPU_BLOCK_BYTES = 1 << 20


_M_LO32 = 0x00000000FFFFFFFF  # element positions whose bit 3 is 0 (16 nibbles, 4 index bits)
_M_LO_HALVES = 0x0000FFFF0000FFFF  # ... bit 2 is 0
_M_EVEN_BYTES = 0x00FF00FF00FF00FF  # ... bit 1 is 0
_M_LO_NIBBLES = 0x0F0F0F0F0F0F0F0F  # ... bit 0 is 0

# marlin_permute_scales: grouped scales permute within 64-chunks, channelwise within 32-chunks.
SCALE_PERM = [i + 8 * j for i in range(8) for j in range(8)]
SCALE_PERM_SINGLE = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]


# ---------------------------------------------------------------------------------------------
# Refusals: what Marlin cannot take
# ---------------------------------------------------------------------------------------------

def check_repack_shape(name: str, size_k: int, size_n: int) -> None:
    """Raise UnsupportedError unless a [N=size_n, K=size_k] weight fits Marlin's 16 x 64 tiles."""
    if size_k <= 0 or size_k % TILE_K:
        raise UnsupportedError(
            f"{name}: input size K={size_k} is not a positive multiple of {TILE_K}, which the Marlin "
            f"repack needs", "use a checkpoint (or a TP size) whose K is a multiple of 16")
    if size_n <= 0 or size_n % TILE_N:
        raise UnsupportedError(
            f"{name}: output size N={size_n} is not a positive multiple of {TILE_N}, which the Marlin "
            f"repack needs", "use a checkpoint (or a TP size) whose N is a multiple of 64")


def check_group_size(name: str, group_size: int) -> None:
    """Raise UnsupportedError unless ``group_size`` is one Marlin supports (-1 = channelwise)."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise UnsupportedError(
            f"{name}: group size {group_size} is not supported by Marlin (supported: -1 channelwise, "
            f"32, 64, 128)", "re-quantize with group_size 32, 64, 128 or channelwise")


def check_symmetric(name: str, symmetric: bool) -> None:
    """Raise UnsupportedError for asymmetric (zero-point) quantization."""
    if not symmetric:
        raise UnsupportedError(
            f"{name}: asymmetric W4A16 (zero points) is not supported by the marlin-w4a16 layout",
            "use a symmetric pack-quantized checkpoint")


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

def _exchange_(a: torch.Tensor, b: torch.Tensor, shift: int, low: int, tmp: torch.Tensor,
               out_a: torch.Tensor | None = None, out_b: torch.Tensor | None = None) -> None:
    """Exchange an array-selector bit with an in-element bit, in place (or into ``out_a`` / ``out_b``).

    ``a`` / ``b`` are the arrays with selector 0 / 1; ``low`` masks the element positions whose bit is 0,
    ``shift`` is the distance to their partners. Afterwards ``a`` holds the old ``a[low]`` and
    ``b[low] << shift``, ``b`` holds ``a[high] >> shift`` and the old ``b[high]``: the element bit now
    says which array a value came from, and the selector says what the element bit was."""
    torch.bitwise_right_shift(a, shift, out=tmp)
    tmp.bitwise_xor_(b)
    tmp.bitwise_and_(low)
    if out_b is None:
        b.bitwise_xor_(tmp)
    else:
        torch.bitwise_xor(b, tmp, out=out_b)
    tmp.bitwise_left_shift_(shift)
    if out_a is None:
        a.bitwise_xor_(tmp)
    else:
        torch.bitwise_xor(a, tmp, out=out_a)


def _repack_block(q: torch.Tensor, out: torch.Tensor, x: torch.Tensor, tmp: torch.Tensor) -> None:
    """Repack one block. ``q``: int64 view ``[nt, j1, j0, g, b, kt]`` of the input rows
    (row = nt*64 + 16*(2*j1 + j0) + 8*g + b, kt = K-tile, each int64 = words h=0,1 of that K-tile);
    ``out``: int64 view ``[kt, nt, b, a, j1]`` of the result (each int64 = Marlin words j = 2*j1 + 0, 1).
    ``x``: scratch ``[2, 2, kt, nt, 8, 2]``, ``tmp``: scratch ``[kt, nt, 8, 2]`` (int64).

    An input int64 has nibble index bits (h, a1, a0, l) (bit 3 = which word); a Marlin int64 has
    (j0, l, g, h) (bit 3 = which word, then t = 4l + 2g + h). Four exchanges between the two array
    selectors (s1, s2) = (j0, g) and element bits get there."""
    x.copy_(q.permute(2, 3, 5, 0, 4, 1))  # x[j0, g] indexed [kt, nt, b, j1]
    for s2 in range(2):  # bit 3 <-> s1: element (j0, a1, a0, l), s1 = h
        _exchange_(x[0, s2], x[1, s2], 32, _M_LO32, tmp)
    for s2 in range(2):  # bit 0 <-> s1: element (j0, a1, a0, h), s1 = l
        _exchange_(x[0, s2], x[1, s2], 4, _M_LO_NIBBLES, tmp)
    for s2 in range(2):  # bit 2 <-> s1: element (j0, l, a0, h), s1 = a1
        _exchange_(x[0, s2], x[1, s2], 16, _M_LO_HALVES, tmp)
    for a1 in range(2):  # bit 1 <-> s2: element (j0, l, g, h), s2 = a0; write Marlin words
        _exchange_(x[a1, 0], x[a1, 1], 8, _M_EVEN_BYTES, tmp,
                   out_a=out[:, :, :, 2 * a1], out_b=out[:, :, :, 2 * a1 + 1])


def _as_int64_rows(packed: torch.Tensor) -> torch.Tensor:
    """``packed`` [N, K/8] int32 as an int64 [N, K/16] view (copying only if it cannot be viewed)."""
    try:
        return packed.view(torch.int64)
    except RuntimeError:
        return packed.contiguous().view(torch.int64)


def _repack_identity(packed: torch.Tensor, out: torch.Tensor) -> None:
    """Marlin-repack ``packed`` [N, K/8] (no act-order) into ``out`` [K/16, 2N] int32."""
    n, kw = packed.shape
    k_tiles, n_tiles = kw // 2, n // TILE_N
    q = _as_int64_rows(packed).unflatten(0, (n_tiles, 2, 2, 2, 8))  # [nt, j1, j0, g, b, kt]
    o = out.view(torch.int64).unflatten(1, (n_tiles, 8, 4, 2))  # [kt, nt, b, a, j1]
    dev = packed.device
    if dev.type == "cpu":
        ktb = min(CPU_KT_BLOCK, k_tiles)
        ntb = max(1, min(n_tiles, CPU_BLOCK_BYTES // (TILE_N * ktb * 8)))
    else:
        ktb, ntb = k_tiles, n_tiles
    x_buf = torch.empty(4 * ktb * ntb * 16, dtype=torch.int64, device=dev)
    t_buf = torch.empty(ktb * ntb * 16, dtype=torch.int64, device=dev)
    for k0 in range(0, k_tiles, ktb):
        k1 = min(k_tiles, k0 + ktb)
        for n0 in range(0, n_tiles, ntb):
            n1 = min(n_tiles, n0 + ntb)
            shape = (k1 - k0, n1 - n0, 8, 2)
            numel = shape[0] * shape[1] * 16
            _repack_block(q[n0:n1, ..., k0:k1], o[k0:k1, n0:n1], x_buf[: 4 * numel].view(2, 2, *shape),
                          t_buf[:numel].view(shape))


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack-quantized int32 [N, K/8] -> uint8 [N, K], one value (0..15) per byte."""
    data = packed.contiguous().view(torch.uint8)  # [N, K/2]: byte c holds k = 2c (low), 2c + 1 (high)
    nib = torch.empty((*data.shape, 2), dtype=torch.uint8, device=data.device)
    torch.bitwise_and(data, 15, out=nib[..., 0])
    torch.bitwise_right_shift(data, 4, out=nib[..., 1])
    return nib.view(data.shape[0], -1)


def _repack_nibbles(nib: torch.Tensor, out: torch.Tensor) -> None:
    """Marlin-repack one value per byte ``nib`` [N, K] (uint8) into ``out`` [K/16, 2N] int32, with two
    element-wise kernels over strided views (few launches: the method for CUDA)."""
    n, k = nib.shape
    # value (n, k) with n = (nt, j, g, b), k = (kt, h, a, l); Marlin byte = (kt, nt, b, a, j, l, g),
    # its low nibble h = 0, high nibble h = 1.
    v = nib.view(n // TILE_N, 4, 2, 8, k // TILE_K, 2, 4, 2).permute(4, 0, 3, 6, 1, 7, 2, 5)
    dst = out.view(torch.uint8).view(k // TILE_K, n // TILE_N, 8, 4, 4, 2, 2)
    high = torch.bitwise_left_shift(v[..., 1], 4)
    torch.bitwise_or(v[..., 0], high, out=dst)


def gather_k(packed: torch.Tensor, src_k: torch.Tensor) -> torch.Tensor:
    """Pack-quantized ``[N, len(src_k)/8]`` whose input column k is column ``src_k[k]`` of ``packed``
    (act-order). ``len(src_k)`` must be a multiple of 8.

    One ``index_select`` of whole words instead of one per nibble: rows are taken 8 at a time and three
    exchanges turn each group's 8 words of one K-octet into 8 words of one k each (nibble = row); the
    words are gathered by k, and three exchanges turn them back."""
    n, kw = packed.shape
    kc = src_k.numel()
    src_k = src_k.to(device=packed.device, dtype=torch.int64)
    # word of (k, row group) after the forward exchanges: k % 8 selects the array, k // 8 the column
    idx = ((src_k % 8) * kw + src_k // 8).view(kc // 8, 8).t().reshape(-1)  # output order (k % 8, k // 8)
    out = torch.empty((n, kc // 8), dtype=torch.int32, device=packed.device)
    groups = n // 8
    if packed.device.type == "cpu":
        gb = max(1, min(groups, CPU_BLOCK_BYTES // max(1, 8 * kw * 4)))
    else:
        gb = groups
    src = packed.view(groups, 8, kw)
    dst = out.view(groups, 8, kc // 8)
    for g0 in range(0, groups, gb):
        g1 = min(groups, g0 + gb)
        y = src[g0:g1].clone()  # [m, r, c]: r = row % 8
        tmp = torch.empty_like(y[:, 0])
        for bit in range(3):  # row bit <-> nibble bit: y[m, k % 8, c] holds nibbles of rows 8m .. 8m+7
            _octet_exchange_(y, bit, tmp)
        z = y.view(g1 - g0, 8 * kw).index_select(1, idx).view(g1 - g0, 8, kc // 8)
        tmp = torch.empty_like(z[:, 0])
        for bit in range(3):  # and back: z[m, row % 8, c'] holds nibbles k' = 8c' .. 8c'+7
            _octet_exchange_(z, bit, tmp)
        dst[g0:g1] = z
    return out


_OCTET_LOW = (0x0F0F0F0F, 0x00FF00FF, 0x0000FFFF)  # int32 nibble positions whose index bit 0/1/2 is 0


def _octet_exchange_(y: torch.Tensor, bit: int, tmp: torch.Tensor) -> None:
    """In place on ``y`` [m, 8, c] int32: exchange bit ``bit`` of the middle index with nibble-index bit
    ``bit`` of every word."""
    step = 1 << bit
    for r in range(8):
        if r & step:
            continue
        _exchange_(y[:, r], y[:, r + step], 4 * step, _OCTET_LOW[bit], tmp)


def marlin_repack(packed: torch.Tensor, perm: torch.Tensor | None = None, *, k_start: int = 0,
                  k_stop: int | None = None, out: torch.Tensor | None = None,
                  name: str = "weight_packed", method: str = "auto") -> torch.Tensor:
    """Marlin-repack one projection (or the K-slice ``[k_start, k_stop)`` of it), on ``packed``'s device.

    ``packed``: compressed-tensors ``weight_packed`` int32 ``[N, K/8]``. ``perm``: act-order
    ``sort_indices`` (length K) or None. Returns ``[(k_stop - k_start)/16, 2N]`` int32: exactly rows
    ``k_start/16 .. k_stop/16`` of vLLM's ``gptq_marlin_repack(packed.t(), perm, K, N, 4)``. ``out``, if
    given, receives the result (it may be a column slice of a wider tensor, e.g. w13's gate half).
    ``method``: "bits" (int64 bit operations in cache-sized blocks: fastest on CPU), "nibbles" (one byte
    per value, two strided kernels: fewest launches, fastest on CUDA) or "auto" (by device). Both give
    the same bytes on every device. Raises UnsupportedError (naming ``name``) for shapes Marlin cannot
    take."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise UnsupportedError(f"{name}: expected int32 [N, K/8] packed weights, got {packed.dtype} "
                               f"{tuple(packed.shape)}", "pass compressed-tensors pack-quantized weight_packed")
    n, kw = packed.shape
    size_k = kw * PACK_FACTOR
    check_repack_shape(name, size_k, n)
    k_stop = size_k if k_stop is None else k_stop
    if not (0 <= k_start < k_stop <= size_k) or k_start % TILE_K or k_stop % TILE_K:
        raise ValueError(f"{name}: K-slice [{k_start}, {k_stop}) must be 16-aligned within [0, {size_k}]")
    if perm is not None and perm.numel() != size_k:
        raise UnsupportedError(f"{name}: act-order permutation has {perm.numel()} entries, K is {size_k}",
                               "pass weight_g_idx of length K")
    rows = (k_stop - k_start) // TILE_K
    if out is None:
        out = torch.empty((rows, 2 * n), dtype=torch.int32, device=packed.device)
    elif out.shape != (rows, 2 * n) or out.dtype != torch.int32:
        raise ValueError(f"{name}: out must be int32 {(rows, 2 * n)}, got {out.dtype} {tuple(out.shape)}")
    if method == "auto":
        method = "bits" if packed.device.type == "cpu" else "nibbles"
    if method == "nibbles":
        if perm is None:
            nib = _unpack_nibbles(packed[:, k_start // PACK_FACTOR: k_stop // PACK_FACTOR])
        else:
            nib = _unpack_nibbles(packed).index_select(
                1, perm.reshape(-1)[k_start:k_stop].to(device=packed.device, dtype=torch.int64))
        _repack_nibbles(nib, out)
    elif method == "bits":
        if perm is None:
            src = packed[:, k_start // PACK_FACTOR: k_stop // PACK_FACTOR]
        else:
            src = gather_k(packed, perm.reshape(-1)[k_start:k_stop])
        _repack_identity(src, out)
    else:
        raise ValueError(f"unknown repack method {method!r}")
    return out


# ---------------------------------------------------------------------------------------------
# Scales and act-order indices
# ---------------------------------------------------------------------------------------------

_PERM_CACHE: dict[tuple[str, bool], torch.Tensor] = {}


def _scale_perm(device: torch.device, grouped: bool) -> torch.Tensor:
    key = (str(device), grouped)
    if key not in _PERM_CACHE:
        _PERM_CACHE[key] = torch.tensor(SCALE_PERM if grouped else SCALE_PERM_SINGLE, dtype=torch.int64,
                                        device=device)
    return _PERM_CACHE[key]


def scale_perm_is_grouped(size_k: int, group_size: int) -> bool:
    """vLLM's choice in ``marlin_permute_scales``: the 64-chunk permutation iff
    ``group_size != -1 and group_size < size_k``, else the 32-chunk "single" one."""
    return group_size != -1 and group_size < size_k


def permute_scales(scales: torch.Tensor, size_k: int, group_size: int) -> torch.Tensor:
    """``marlin_permute_scales``: ``scales`` ``[G, N]`` (GPTQ orientation: groups in rows) flattened
    row-major and permuted within 64-chunks (grouped) or 32-chunks (channelwise), same shape back.

    ``size_k`` only selects grouped vs single (see ``scale_perm_is_grouped``); pass what vLLM passes."""
    grouped = scale_perm_is_grouped(size_k, group_size)
    perm = _scale_perm(scales.device, grouped)
    if scales.numel() % perm.numel():
        raise UnsupportedError(f"scales of shape {tuple(scales.shape)} do not split into {perm.numel()}-chunks",
                               "N must be a multiple of 64")
    return scales.reshape(-1, perm.numel()).index_select(1, perm).reshape(scales.shape)


def sort_g_idx(g_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Act-order: ``(g_idx[sort_indices], sort_indices)`` with ``sort_indices = argsort(g_idx)``, both int32.

    A stable sort, so ties (every group has ``group_size`` members) keep ascending k; CPU and CUDA agree.
    """
    idx = torch.argsort(g_idx.to(torch.int64), stable=True)
    return g_idx[idx].to(torch.int32), idx.to(torch.int32)
