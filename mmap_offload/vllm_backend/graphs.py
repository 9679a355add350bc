"""Serving under vLLM's piecewise CUDA graphs: every part of a forward replayed from graphs except the
MoE layers, which run eagerly between them (docs/VLLM.md, "CUDA graphs").

Eager vLLM's launching thread bounds decode at batch 1 (BENCHMARKS.md): each layer's attention,
norms and projections cost it launches whatever holds the experts. vLLM's piecewise mode replays
the pieces between its splitting ops (attention) from CUDA graphs; the MoE op
(``vllm::moe_forward`` / ``vllm::moe_forward_shared``, opaque to torch.compile on the GPU) is added
to those splitting ops, so the backend's routing, copies and host jobs run per call as in eager
mode, and only they.

Three things make that correct:

- ``check_graph_mode`` (at ``wrap_modules``): which modes are served. ``FULL_AND_PIECEWISE``
  (vLLM's default without ``--enforce-eager``) becomes ``PIECEWISE`` with one warning line: a FULL
  graph would capture a decode step's MoE layers, their expert placement included, and replay it for
  every later step. ``FULL`` / ``FULL_DECODE_ONLY`` asked for by name are refused, and so is layer
  streaming (its per-layer waits run in the decoder's forward, inside a graph piece).
- ``StaticOutputs``: a graph piece reads its inputs at the addresses seen at capture; the MoE op
  returns a fresh tensor per call, so in piecewise runs its outputs are copied into fixed buffers
  (the rows of vLLM's largest captured batch; a ring of three, by MoE layer position, since a layer's
  output is read before the next-but-one MoE layer runs).
- Quiet while vLLM captures (``MmapOffloader.sync_prev_onload``, which vLLM calls before each piece's
  capture and replay): CUDA graph capture in vLLM's (global) mode forbids other threads' CUDA calls, and
  the copy threads make them; in the capture phase the device, the layer prefetches (a large captured
  batch streams whole layers, the next one started ahead) and the copies are waited for before each
  piece is captured; before a replay nothing is.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from .patches import log

EAGER, PIECEWISE, COMPILED = "eager", "piecewise", "compiled"  # what check_graph_mode returns
MOE_OPS = ("vllm::moe_forward", "vllm::moe_forward_shared")
FIX = "pass --enforce-eager, or -cc.cudagraph_mode=PIECEWISE (the MoE layers run eagerly between graphs)"


def _name(v) -> str:
    return str(getattr(v, "name", v)).upper()


def check_graph_mode(vcfg, layer_streaming: bool) -> str:
    """EAGER, PIECEWISE (compiled, CUDA graphs between the MoE layers) or COMPILED (no graphs); refuse
    the rest in one line. Adjusts ``vcfg.compilation_config`` in place (the model runner resolves its
    graph mode and torch.compile splits the model after the model is built, i.e. after this call).

    ``layer_streaming``: the expert cache is off (``expert_cache_gib=0``)."""
    cc = vcfg.compilation_config
    dev = str(getattr(vcfg.device_config, "device_type", getattr(vcfg.device_config, "device", "")))
    graphs = _name(getattr(cc, "cudagraph_mode", None) or "NONE")
    mode = _name(getattr(cc, "mode", None) or "NONE")  # an IntEnum in 0.26 and 0.32: NONE = 0, VLLM_COMPILE = 3
    compiled = mode not in ("NONE", "0")
    if dev != "cuda":
        if compiled:  # vLLM's CPU backend calls the MoE layer's Python directly: routing compiled into a graph
            raise UnsupportedError(
                f"--offload-backend mmap does not run under torch.compile (mode {mode}) on {dev or 'this device'}: "
                "vLLM's CPU backend would compile the MoE layer's routing, where the backend places each call's "
                "experts, into a fixed graph", "pass --enforce-eager")
        return EAGER
    if not compiled and graphs == "NONE":
        return EAGER
    if graphs in ("FULL", "FULL_DECODE_ONLY") or (not compiled and graphs != "NONE"):
        raise UnsupportedError(
            f"--offload-backend mmap cannot serve cudagraph_mode {graphs}: a full CUDA graph would replay one "
            "step's expert placement (the MoE layers' copies and host jobs) for every later step", FIX)
    if mode not in ("VLLM_COMPILE", "3"):
        raise UnsupportedError(
            f"--offload-backend mmap runs under torch.compile mode VLLM_COMPILE only (this start asks for {mode}): "
            "its graph split is what keeps the MoE layers eager", FIX)
    if layer_streaming:
        raise UnsupportedError(
            "--offload-backend mmap streams whole layers here (expert_cache_gib=0), whose waits run in the decoder's "
            "forward, inside what torch.compile and CUDA graphs capture",
            "pass --enforce-eager, or leave the expert cache on (--mmap-expert-cache-gib unset or > 0)")
    if getattr(cc, "use_inductor_graph_partition", False):
        raise UnsupportedError(
            "--offload-backend mmap was not tested with use_inductor_graph_partition",
            "drop use_inductor_graph_partition from the compilation config, or pass --enforce-eager")
    ops = cc.splitting_ops
    if ops is None:
        ops = cc.splitting_ops = []
    for op in MOE_OPS:
        if op not in ops:
            ops.append(op)
    if graphs == "NONE":
        return COMPILED
    if graphs == "FULL_AND_PIECEWISE":
        cc.cudagraph_mode = type(cc.cudagraph_mode)["PIECEWISE"]  # vLLM's CUDAGraphMode
        log.warning("mmap-offload: cudagraph_mode FULL_AND_PIECEWISE -> PIECEWISE: the MoE layers run eagerly "
                    "between CUDA graphs (a full graph would replay one step's expert placement)")
    return PIECEWISE


def capture_rows(vcfg) -> int:
    """The most tokens a piecewise CUDA graph of this engine holds (its largest capture size)."""
    cc = vcfg.compilation_config
    sizes = list(getattr(cc, "cudagraph_capture_sizes", None) or ())
    rows = getattr(cc, "max_cudagraph_capture_size", None) or (max(sizes) if sizes else 0)
    return int(rows) or 512


class StaticOutputs:
    """Fixed buffers for MoE outputs that a CUDA graph piece reads after the eager MoE op (module doc).

    ``put(pos, out)``: ``out`` (a tensor or a tuple of tensors / None) copied into the buffers of MoE
    layer position ``pos``; returns views of ``rows_n`` rows that start where they did at capture."""

    RING = 3

    def __init__(self, rows: int):
        self.rows = int(rows)
        self._bufs: dict[tuple, torch.Tensor] = {}
        self.copies = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def put(self, pos: int, out):
        if isinstance(out, tuple):
            return tuple(self._one(pos, i, t) for i, t in enumerate(out))
        return self._one(pos, 0, out)

    def _one(self, pos: int, i: int, t):
        if not isinstance(t, torch.Tensor):
            return t
        n = int(t.shape[0]) if t.dim() else 1
        if n > self.rows:
            raise UnsupportedError(
                f"a CUDA-graph batch of {n} tokens is larger than the {self.rows} rows kept for the MoE outputs",
                "pass --enforce-eager (and report this: vLLM pads graph batches to its largest capture size)")
        key = (pos % self.RING, i, t.dtype, tuple(t.shape[1:]), str(t.device))
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty((self.rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
        view = buf[:n]
        view.copy_(t)
        self.copies += 1
        return view


__all__ = ["EAGER", "PIECEWISE", "COMPILED", "MOE_OPS", "check_graph_mode", "capture_rows", "StaticOutputs"]
