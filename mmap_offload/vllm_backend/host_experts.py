"""Host compute of missed experts inside vLLM's MoE forward (``hybrid`` option of the mmap backend).

At decode a layer's misses are known only after its router ran; copying them moves every missed
byte through DRAM three times (page cache -> ring -> DMA) while UVA's kernel reads it once. The
host can instead compute those experts where their bytes already are, straight from the cache's
Marlin words (``host.kernel.HostKernel``, W4A16) or bf16 rows (torch), and send back only the few
output rows. Per layer, with the expert cache (residency.py):

    route (after the router)   hits stay on the GPU; misses are split between the host and the
                               copy path so that both finish together (``split``: the calibrated
                               host and copy rates); the (token, expert) pairs given to the host
                               get weight 0 and a resident slot in the GPU kernel's ids (they add
                               nothing there); the host job starts in a thread (the C kernel
                               releases the GIL and runs its own pthreads)
    forward_modular (patch 4b) the GPU kernel runs hits + copied misses; then the host rows are
                               waited for, copied up (pinned) and added to the kernel's output,
                               before vLLM's top-k reduce / all-reduce sees it (TP ranks each add
                               their own shard's partial sums, as the kernel does)

Tolerance: the host kernel accumulates in fp32 and rounds once to bf16 per expert, the GPU kernel
in its own order: outputs agree to bf16 rounding (relative ~1e-2 per element), not bit for bit;
greedy tokens of a model agree unless two logits are within that rounding (tests state where).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedError


class HostExperts:
    """The host half of the hybrid step for one offloader (module docstring)."""

    MAX_TOKENS = 64  # beyond this the GPU wins (prefill, large batches): no host compute

    def __init__(self, off, threads: int = 0):
        self.cache = off.cache
        self.device = off.device
        q = self.cache.manifest.identity.quantization
        self.kind = q.get("kind", "unquantized")
        self.group = int(q.get("group_size", 0) or 0)
        if q.get("actorder"):
            raise UnsupportedError("hybrid host compute does not support act-order (g_idx) W4A16 caches",
                                   "pass hybrid=false (the expert cache still serves it)")
        self.kernel = None
        if self.kind == "w4a16":
            from ..host.kernel import HostKernel

            self.kernel = HostKernel(threads=threads)
        elif threads:
            torch.set_num_threads(threads)  # the torch path: this process's intra-op threads
        self.expert_nbytes = sum(s.nbytes for s in self.cache.expert_specs)
        spec = {s.name: s for s in self.cache.expert_specs}
        # w2: Marlin words [I/16, 2H] (8 nibbles per int32, 16 rows per tile row), or [H, I] bf16
        self.hidden = int(spec["w2_weight_packed"].shape[-1] // 2 if self.kind == "w4a16" else spec["w2_weight"].shape[0])
        self._x = self._out = None  # pinned [MAX_TOKENS, H] in the model's dtype, made on first use
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmap-offload-host")
        self._pending: dict[int, tuple[Future, int]] = {}  # target index -> (job, rows)
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        # calibrated rates (bytes/s), updated from every host job and every copy: EMA
        self.host_rate = 0.0
        self.copy_rate = 0.0
        self.metrics: dict[str, Any] = dict(host_experts=0, host_bytes=0, host_s=0.0, host_wait_s=0.0, copied_experts=0)

    # -- planning -------------------------------------------------------------------------------
    def split(self, misses: np.ndarray, tokens_per_expert: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(host, copy) partition of ``misses`` so that both finish together.

        Host time of an expert ~ its bytes / host_rate (a GEMV reads every weight once whatever
        the few rows), copy time ~ bytes / copy_rate: the host takes the share
        host_rate / (host_rate + copy_rate) of the misses, the experts with fewest tokens first
        (they cost the host least per byte). Before any rate is measured: half and half."""
        if len(misses) == 0:
            return misses, misses
        h, c = self.host_rate, self.copy_rate
        share = 0.5 if h <= 0 or c <= 0 else h / (h + c)
        n_host = int(round(share * len(misses)))
        order = np.argsort(tokens_per_expert, kind="stable")
        return misses[order[:n_host]], misses[order[n_host:]]

    def note_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            r = nbytes / seconds
            self.copy_rate = r if self.copy_rate <= 0 else 0.8 * self.copy_rate + 0.2 * r

    # -- the host job ---------------------------------------------------------------------------
    def _expert(self, layer: int, e: int) -> dict[str, torch.Tensor]:
        key = (layer, e)
        v = self._views.get(key)
        if v is None:  # zero-copy views of the mapped cache (populated once, kept)
            v = {s.name: self.cache.tensor(layer, e, s.name) for s in self.cache.expert_specs}
            self._views[key] = v
        return v

    def staging(self, dtype: torch.dtype) -> torch.Tensor:
        """The pinned ``[MAX_TOKENS, H]`` buffer the caller copies the step's activations into."""
        if self._x is None or self._x.dtype != dtype:
            pin = self.device.type == "cuda"
            self._x = torch.empty((self.MAX_TOKENS, self.hidden), dtype=dtype, pin_memory=pin)
            self._out = torch.empty((self.MAX_TOKENS, self.hidden), dtype=dtype, pin_memory=pin)
        return self._x

    def start(self, t, x_host: torch.Tensor, ids_host: np.ndarray, w_host: np.ndarray, host: np.ndarray) -> None:
        """Run experts ``host`` of layer ``t`` on the tokens routed to them, in the background."""
        n = x_host.shape[0]
        jobs = []
        for e in host:
            rows, cols = np.nonzero(ids_host == e)
            jobs.append((int(e), rows, w_host[rows, cols]))
        self.metrics["host_experts"] += len(jobs)
        self.metrics["host_bytes"] += len(jobs) * self.expert_nbytes
        fut = self._pool.submit(self._run, t.layer, x_host, jobs)
        self._pending[t.index] = (fut, n)

    def _run(self, layer: int, x: torch.Tensor, jobs) -> torch.Tensor:
        t0 = time.perf_counter()
        n = x.shape[0]
        out = self._out[:n]
        out.zero_()
        if self.kernel is not None:
            kjobs = []
            for e, rows, w in jobs:
                v = self._expert(layer, e)
                kjobs.append((torch.from_numpy(rows), v["w13_weight_packed"], v["w13_weight_scale"],
                              v["w2_weight_packed"], v["w2_weight_scale"], self.group,
                              torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))))
            self.kernel.experts_mlp(x, kjobs, out)
        else:
            for e, rows, w in jobs:
                v = self._expert(layer, e)
                xr = x[torch.from_numpy(rows)].float()
                h = xr @ v["w13_weight"].float().t()
                i = h.shape[1] // 2
                y = (torch.nn.functional.silu(h[:, :i]) * h[:, i:]) @ v["w2_weight"].float().t()
                out[torch.from_numpy(rows)] += (y * torch.from_numpy(np.asarray(w, dtype=np.float32))[:, None]).to(out.dtype)
        dt = time.perf_counter() - t0
        nb = len(jobs) * self.expert_nbytes
        self.metrics["host_s"] += dt
        if nb and dt > 0:
            r = nb / dt
            self.host_rate = r if self.host_rate <= 0 else 0.8 * self.host_rate + 0.2 * r
        return out

    def add_to(self, t, out: torch.Tensor) -> torch.Tensor:
        """Patch 4b: add layer ``t``'s host rows to the GPU kernel's output (if a job is pending)."""
        job = self._pending.pop(t.index, None)
        if job is None:
            return out
        if not isinstance(out, torch.Tensor):
            raise UnsupportedError("this MoE kernel returns an unfinalized output, which hybrid cannot add to",
                                   "pass hybrid=false")
        fut, n = job
        t0 = time.perf_counter()
        host = fut.result()
        self.metrics["host_wait_s"] += time.perf_counter() - t0
        add = host.to(self.device, non_blocking=True) if out.is_cuda else host
        out[:n] += add.to(out.dtype)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._pending.clear()
        self._views.clear()


def default_threads(tp_size: int) -> int:
    """Host compute threads per rank: the cores this process may use, shared among the ranks."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, tp_size))


__all__ = ["HostExperts", "default_threads"]
