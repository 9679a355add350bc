"""The layout probe: prove, once per process, that vLLM's MoE backend stores the expert tensors in
exactly our cache layout before any cache byte is served.

The first MoE layer's served parameters are shrunk to one expert holding deterministic probe data;
vLLM's ``process_weights_after_loading`` (its Marlin repack for W4A16) runs on them; ``post_init``
compares the result with ``layout.transform_expert`` of the same data. A known platform transform
(vLLM CPU's prepacked unquantized MoE) is accepted where it maps our layout onto vLLM's exactly.

vLLM builds layers inside ``with torch.device(<target device>):``; every tensor here is made on the
CPU explicitly (a CPU ``torch.Generator`` under a CUDA default device fails) and moved after.
"""

from __future__ import annotations

import torch

def probe_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Deterministic values valid for the tensor's role (scales positive, packed words any bits)."""
    cpu = torch.device("cpu")
    g = torch.Generator(device=cpu).manual_seed(1234 + len(name))
    if dtype.is_floating_point:
        t = torch.rand(shape, generator=g, dtype=torch.float32, device=cpu)
        t = (t * 0.01 + 0.002) if "scale" in name else (t - 0.5) * 0.05
        return t.to(dtype).to(device)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64, device=cpu).to(dtype).to(device)


def expected_layout(placeholders: dict[str, torch.Tensor], ckpt) -> dict[str, torch.Tensor]:
    """Our layout of the probe data: split vLLM's pre-processing tensors back into checkpoint
    projections (w13 = [gate; up] along N), run layout.transform_expert (one rank, no TP split)."""
    from ..layout import layout_for

    layout = layout_for(ckpt.quant)
    tensors: dict[str, dict[str, torch.Tensor]] = {"gate": {}, "up": {}, "down": {}}
    # vLLM's WNA16 MoE methods (0.26, 0.32; not FlashInfer) create the packed weights and scales
    # transposed, GPTQ-style: w13 [H/8, 2I], w2 [I/8, H] (scales [G, N]); the checkpoint is [N, K/8]
    w2p = placeholders.get("w2_weight_packed")
    transposed = w2p is not None and int(w2p.shape[-1]) == int(ckpt.moe.hidden)
    for name, t in placeholders.items():
        stem, suffix = name.split("_", 1)
        x = t[0].detach().cpu()
        if transposed and x.dim() == 2:
            x = x.t()
        if stem == "w13":
            half = x.shape[0] // 2
            tensors["gate"][suffix], tensors["up"][suffix] = x[:half].contiguous(), x[half:].contiguous()
        else:
            tensors["down"][suffix] = x.contiguous()
    if "weight_packed" in tensors["down"]:  # compressed-tensors also stores [N, K]
        pack = 32 // int(getattr(ckpt.quant, "num_bits", 4))
        for proj in tensors:
            n, kp = tensors[proj]["weight_packed"].shape
            tensors[proj]["weight_shape"] = torch.tensor([n, kp * pack], dtype=torch.int64)
    out = layout.transform_expert(tensors, ckpt.quant, 0, 1, torch.device("cpu"))
    return {k: v for k, v in out.items() if k in placeholders}


def platform_transform(experts: torch.nn.Module, got: torch.Tensor, want: torch.Tensor):
    """A vLLM platform transform that maps the cache layout to ``got`` exactly, or None.

    Known: vLLM CPU's unquantized MoE prepacks weights (``torch.ops._C.prepack_moe_weight``)."""
    kernel = getattr(getattr(experts, "quant_method", None), "moe_kernel", None)
    fused = getattr(kernel, "fused_experts", None)
    isa = getattr(fused, "isa", None)
    op = getattr(getattr(torch.ops, "_C", None), "prepack_moe_weight", None)
    if isa is None or op is None or got.device.type != "cpu" or tuple(got.shape[1:]) != tuple(want.shape):
        return None

    def prepack(src: torch.Tensor, dst: torch.Tensor) -> None:
        op(src, dst, isa)

    trial = torch.empty_like(got)
    try:
        prepack(want.unsqueeze(0).to(got.dtype).contiguous(), trial)
    except Exception:  # noqa: BLE001 - a transform that does not apply is simply not this one
        return None
    return prepack if torch.equal(trial, got) else None



__all__ = ["probe_tensor", "expected_layout", "platform_transform"]
