"""W4A16 expert MLPs on the host, straight from the Marlin words of the cache (csrc/host_kernel.c).

    k = HostKernel(threads=0, isa="auto")     # its own pthread pool; isa auto or a path (ISAS, below)
    y = k.expert_mlp(x, w13, s13, w2, s2, group=128)            # [M, H] = down(silu(gate(x)) * up(x))
    k.expert_mlp(x, w13, s13, w2, s2, group=128, out=y, accumulate_weight=0.3)   # y += 0.3 * ...
    k.experts_mlp(x, [(rows, w13, s13, w2, s2, group, weights), ...], out)       # one call per layer

Tensors, per expert, as the cache (``cache.tensor``) and vLLM's Marlin MoE layer hold them
(docs/LAYOUTS.md, "marlin-w4a16"): ``w13`` int32 ``[H/16, 4*I]`` (gate columns then up columns, one
Marlin matrix with K = H, N = 2I), ``s13`` ``[H/g, 2I]`` (``[1, 2I]`` channelwise), ``w2`` int32
``[I/16, 2*H]`` (K = I, N = H), ``s2`` ``[I/g, H]`` (``[1, H]``), scales Marlin-permuted, in bf16, fp16
or fp32. ``group`` is the quantization group size (32, 64, 128) or -1 (channelwise), as in the
manifest's ``group_size``; the scale permutation follows vLLM's choice for each matrix (w13 always the
grouped one unless channelwise: vLLM passes size_k = 4I; w2 the grouped one iff group < I). Act-order
caches are not supported (their words would need x gathered by ``w13_g_idx_sort_indices``): callers
must not pass them (``HostExperts`` refuses them from the manifest); the kernel refuses the case its
tensors show (w2 scales whole-I, act-order with TP > 1). x and out: bf16 / fp16 (fp32 also
accepted), C-contiguous rows of H. The weights are read in place (zero-copy views of a mapping are
fine), never copied; the C call releases the GIL.

Accuracy: fp32 accumulation throughout (w13, the SiLU * up intermediate kept in fp32, w2), one rounding
to x's dtype at the end (per call: ``experts_mlp`` sums every job of a row in fp32 before rounding). K is
summed in chunks fixed by the matrix and M (not by the thread count), in order: the bytes out do not
depend on ``threads``. The SIMD paths (``avx512vnni``, ``-novbmi``, ``avx512bw``, ``avxvnni``, ``avx2``) take x (and the intermediate) as 16-bit
fixed point per row and k block of <= 128: the error per element is at most 1/65278 of the block's
largest |x|, about bf16's own rounding of x at values 1/128 of that largest; integer sums are exact, then
scaled in fp32. Every path meets the tests' bf16 tolerance (rtol 2^-8, atol 2^-12 of the largest
output), outlier channels included.

Faults: the weights are usually views of the cache's mapping; a page that cannot be read (the file
truncated under it, a disk I/O error) raises SIGBUS in whichever thread reads it. Every thread computes
inside a guard (csrc/host_kernel.c) that ends the call with ``HostReadFault`` (its ``address``;
``Cache.fault_error`` names the file) instead of killing the process; the pool serves the next call.

Threads: ``threads=0`` takes the physical cores of the CPUs this process may run on (``cpus.core_count``:
hardware threads of one core count once). The pool is
this object's; its workers spin for ``spin_us`` after a call (default ``SPIN_US``, 1 ms, or
``$MMAP_OFFLOAD_HOST_SPIN_US``), then sleep; ``diag()`` says where the calls' time went. ISA paths, fastest first:
``avx512vnni`` (AVX-512 VNNI + VBMI, vpdpbusd: one column's four nibbles of a word are one lane's four
bytes after one vpmultishiftqb, x as two signed bytes),
``avx512vnni-novbmi`` (the same without VBMI, a shift, a select and an AND in the shuffle's place:
Cascade Lake, Cooper Lake),
``avx512bw`` (the integer scheme without VNNI: vpmaddubsw
and 16-bit sums per block; Skylake-SP), ``avxvnni`` (the avx2 path with AVX-VNNI's 256-bit vpdpbusd in place
of vpmaddubsw and its 16-bit sums: Alder Lake and later client cores, Sierra Forest), ``avx2`` (the avx512bw
scheme at 256 bits), ``plain`` (C). (An
fp32 FMA path for AVX-512, ``avx512``, was removed in session 15: ``avx512bw`` is at or ahead of it at
every M; a vdpbf16ps path, ``avx512bf16``, in session 16: ``avx512vnni`` is ahead of it at every shape,
thread count and M on the H200's Intel host.) ``auto`` takes the first the CPU has (the order measured on
the build box's Zen 4 and the H200's host: docs/BENCHMARKS.md, "Host compute", sessions 15 and 16); ``MMAP_OFFLOAD_HOST_ISA=<path>`` (or ``isa=``) forces one, and a forced one
the CPU lacks raises UnsupportedError.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import threading
from typing import Any, Sequence

import torch

from ..cpus import core_count
from ..errors import CacheError, UnsupportedError

__all__ = ["HostCall", "HostKernel", "HostReadFault", "ISAS", "available_isas", "dequantize_marlin", "guarded_touch",
           "library", "sigbus_guard_prev"]

# fastest first (the build box and the H200's host; BENCHMARKS.md "Host compute", sessions 15 and 16)
ISAS = ("avx512vnni", "avx512vnni-novbmi", "avx512bw", "avxvnni", "avx2", "plain")
_ISA_CODE = {"plain": 0, "avx2": 1, "avx512vnni": 4, "avx512vnni-novbmi": 5, "avx512bw": 6, "avxvnni": 7}
_DT_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
ABI = 2  # 2: mo_host_mlp_start / mo_host_mlp_wait
# How long (us) an idle pool thread spins before it sleeps: a sleeping thread joins the next call late.
# Session 28 on the H200's host (16 threads, the user's shape, 6 experts per call, ~110 us between
# calls): threads that spun ~0.1 ms joined 121 us after the open on average, 3 us when they spun ~1 ms;
# 763 -> 384 us per call in C (BENCHMARKS.md "Host compute", session 28). In vLLM a layer's host job
# starts a layer after the last one: ~1.9 ms (batch 1) to ~3 ms (batch 8) in bench_vllm's 8-layer model,
# the jobs taking 0.4-2.3 ms of it; in real vLLM 1 ms was ahead of 0.1 ms at batch 1 and split at batch 8
# (BENCHMARKS.md "Real vLLM", session 28).
SPIN_US = 1000.0
MAX_SPIN_US = 1e6  # a second: beyond any gap between a step's calls


if sys.byteorder != "little":  # pragma: no cover - the job words pack int32 pairs little-endian
    raise ImportError("mmap_offload.host.kernel packs its job records little-endian")


class _Job(ctypes.Structure):  # mo_job_t; _run writes it as 10 int64 words
    _fields_ = [("rows", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("m", ctypes.c_int64),
                ("w13", ctypes.c_void_p), ("s13", ctypes.c_void_p), ("w2", ctypes.c_void_p),
                ("s2", ctypes.c_void_p), ("gs13", ctypes.c_int32), ("gs2", ctypes.c_int32),
                ("grouped13", ctypes.c_int32), ("grouped2", ctypes.c_int32), ("sdtype", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library() -> ctypes.CDLL:
    """The loaded ``mo_host`` library (``mmap_offload.native``), prototypes set; UnsupportedError if
    it cannot be had (the reason from ``library_status``)."""
    global _lib
    with _lib_lock:
        if _lib is None:
            from ..native import library_status, load_library

            lib = load_library("mo_host")
            if lib is None:
                raise UnsupportedError(f"the host expert kernel is not available ({library_status('mo_host')})",
                                       "install a C compiler (cc) or pip install the package where one is")
            lib.mo_host_abi.restype = ctypes.c_int
            if lib.mo_host_abi() != ABI:
                raise UnsupportedError(f"the mo_host library has ABI {lib.mo_host_abi()}, this package needs {ABI}",
                                       "rebuild it (pip install -e . or remove the stale build)")
            lib.mo_host_isa_available.argtypes = [ctypes.c_int]
            lib.mo_host_isa_available.restype = ctypes.c_int
            lib.mo_host_create.argtypes = [ctypes.c_int]
            lib.mo_host_create.restype = ctypes.c_void_p
            lib.mo_host_destroy.argtypes = [ctypes.c_void_p]
            lib.mo_host_destroy.restype = None
            lib.mo_host_threads.argtypes = [ctypes.c_void_p]
            lib.mo_host_threads.restype = ctypes.c_int
            lib.mo_host_mlp.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(_Job), ctypes.c_int,
                                        ctypes.c_void_p, ctypes.c_int]
            lib.mo_host_mlp.restype = ctypes.c_int
            lib.mo_host_mlp_start.argtypes = lib.mo_host_mlp.argtypes
            lib.mo_host_mlp_start.restype = ctypes.c_int
            lib.mo_host_mlp_wait.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64),
                                             ctypes.POINTER(ctypes.c_int)]
            lib.mo_host_mlp_wait.restype = ctypes.c_int
            if not hasattr(lib, "mo_host_set_spin") or not hasattr(lib, "mo_host_diag"):
                raise UnsupportedError("the mo_host library predates mo_host_set_spin / mo_host_diag (a stale build)",
                                       "rebuild it (pip install -e . or remove the stale build)")
            lib.mo_host_set_spin.argtypes = [ctypes.c_void_p, ctypes.c_int64]
            lib.mo_host_set_spin.restype = ctypes.c_int64
            lib.mo_host_diag.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]
            lib.mo_host_diag.restype = ctypes.c_int
            if not hasattr(lib, "mo_host_last_fault"):
                raise UnsupportedError("the mo_host library predates its SIGBUS guard (a stale build)",
                                       "rebuild it (pip install -e . or remove the stale build)")
            lib.mo_host_last_fault.argtypes = [ctypes.c_void_p]
            lib.mo_host_last_fault.restype = ctypes.c_int64
            lib.mo_host_sigbus_guarded.argtypes = []
            lib.mo_host_sigbus_guarded.restype = ctypes.c_int
            lib.mo_host_sigbus_prev.argtypes = []
            lib.mo_host_sigbus_prev.restype = ctypes.c_void_p
            lib.mo_host_touch.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
            lib.mo_host_touch.restype = ctypes.c_int
            _lib = lib
        return _lib


def sigbus_guard_prev() -> int | None:
    """The SIGBUS handler that the host kernel's guard passes faults outside its calls on to, or None
    where that guard is not installed (the host kernel never loaded in this process: not hybrid)."""
    with _lib_lock:
        lib = _lib
    if lib is None or not lib.mo_host_sigbus_guarded():
        return None
    return int(lib.mo_host_sigbus_prev() or 0)


def available_isas() -> list[str]:
    """The paths this CPU can run, widest first (``plain`` always)."""
    lib = library()
    return [i for i in ISAS if lib.mo_host_isa_available(_ISA_CODE[i])]


class HostKernel:
    """A pthread pool and the ISA path that computes W4A16 expert MLPs from Marlin words (module docstring)."""

    def __init__(self, threads: int = 0, isa: str = "auto", spin_us: float | None = None):
        lib = library()
        env = os.environ.get("MMAP_OFFLOAD_HOST_ISA", "").strip().lower()
        want = (isa or "auto").lower()
        if want == "auto" and env:
            want = env
        if want == "auto":
            want = available_isas()[0]
        elif want not in _ISA_CODE:
            raise UnsupportedError(f"unknown host kernel ISA {want!r}",
                                   f"use auto or one of {', '.join(ISAS)} (isa= or MMAP_OFFLOAD_HOST_ISA)")
        elif not lib.mo_host_isa_available(_ISA_CODE[want]):
            raise UnsupportedError(f"the host kernel's {want} path needs CPU features this CPU lacks "
                                   f"(it has: {', '.join(available_isas())})",
                                   "use isa='auto' or one of those (MMAP_OFFLOAD_HOST_ISA)")
        self.isa: str = want
        self.threads: int = int(threads) if threads and threads > 0 else core_count()
        self._lib = lib
        self._geo: dict[tuple, tuple] = {}  # tensor geometry checked once per (shapes, dtypes, group)
        self._started: HostCall | None = None  # experts_mlp_start's call not yet waited for
        if spin_us is None:
            env_spin = os.environ.get("MMAP_OFFLOAD_HOST_SPIN_US", "").strip()
            try:
                spin_us = float(env_spin) if env_spin else SPIN_US
            except ValueError:
                raise UnsupportedError(f"MMAP_OFFLOAD_HOST_SPIN_US={env_spin!r} is not a number",
                                       "set it to the microseconds an idle host thread spins, e.g. 1000") from None
        if not 0 <= spin_us <= MAX_SPIN_US:
            raise UnsupportedError(f"host kernel spin_us must be in [0, {MAX_SPIN_US:.0f}], got {spin_us}",
                                   "pass the microseconds an idle host thread spins before it sleeps, e.g. 1000")
        self.spin_us: float = float(spin_us)
        self._pool = lib.mo_host_create(self.threads)
        if not self._pool:
            raise MemoryError(f"mo_host_create({self.threads}) failed (threads or memory)")
        lib.mo_host_set_spin(self._pool, int(self.spin_us * 1e3))

    def last_fault(self) -> int:
        """The address whose read failed the last call that raised HostReadFault (1: unknown; 0: none)."""
        return int(self._lib.mo_host_last_fault(self._pool)) if self._pool else 0

    def close(self) -> None:
        started = getattr(self, "_started", None)
        if started is not None and getattr(self, "_pool", None):
            started.wait()  # its output is written and its tensors released before the pool goes
        pool, self._pool = getattr(self, "_pool", None), None
        if pool:
            self._lib.mo_host_destroy(pool)  # waits for a started call first
            self._started = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"HostKernel(threads={self.threads}, isa={self.isa!r})"

    def diag(self) -> dict:
        """Where the calls' time went since the last ``diag()`` (then zeroed), per call in microseconds:
        ``calls``; ``c_us`` (in C, entry to return; for ``experts_mlp_start`` from the start to ``wait()``'s
        return, the caller's own time between them included), ``prep_us`` (checks and plan, before the work opens),
        ``run_us`` (open to the end of the last unit), ``finish_us`` (closing, waiting for the threads
        inside). In a build with ``-DDIAG_TIMING`` (``scripts/host_kernel_sweep.sh``) also ``threads``:
        per thread the calls it ``joined`` and its ``join_us`` (open to its first unit), ``busy_us``
        (inside units), ``red_us`` (chunk sums, within busy), ``wait_us`` (phase 2 waiting for its job's
        phase 1, within busy), ``last_us`` (open to leaving), ``units`` (per call). Read between calls."""
        if self._pool is None:
            raise RuntimeError("HostKernel is closed")
        n = 6 + 8 * self.threads
        buf = (ctypes.c_int64 * n)()
        rc = self._lib.mo_host_diag(self._pool, buf, n)
        if rc < 0:
            raise RuntimeError(f"mo_host_diag failed ({os.strerror(-rc)}): read it between calls")
        calls = buf[0]
        per = max(1, calls)
        out: dict = {"calls": calls, "c_us": buf[1] / per / 1e3, "prep_us": buf[2] / per / 1e3,
                     "run_us": buf[3] / per / 1e3, "finish_us": buf[4] / per / 1e3}
        if rc == 1:
            times = ("join_us", "busy_us", "red_us", "wait_us", "last_us")  # diag_thread_t's ns fields 1-5
            threads = []
            for t in range(buf[5]):
                v = buf[6 + 8 * t: 6 + 8 * t + 7]
                per_join = max(1, v[0])
                threads.append({"joined": v[0], **{k: ns / per_join / 1e3 for k, ns in zip(times, v[1:6])},
                                "units": v[6] / per_join})
            out["threads"] = threads
        return out

    # -- the API ------------------------------------------------------------------------------------
    def expert_mlp(self, x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                   s2: torch.Tensor, *, group: int, out: torch.Tensor | None = None,
                   accumulate_weight: float | None = None) -> torch.Tensor:
        """``out [M, H] = down(silu(gate(x)) * up(x))`` for one expert, in x's dtype; with
        ``accumulate_weight`` w, ``out += w * that`` (``out`` must be given)."""
        x = _rows(x, "x")
        if accumulate_weight is not None and out is None:
            raise ValueError("accumulate_weight needs out (the tensor to add to)")
        if out is None:
            out = torch.empty_like(x)
        m = x.shape[0]
        rows = torch.arange(m, dtype=torch.int64)
        w = None if accumulate_weight is None else torch.full((m,), float(accumulate_weight), dtype=torch.float32)
        self._run(x, [(rows, w13, s13, w2, s2, group, w)], out, mode=0 if accumulate_weight is None else 1)
        return out

    def experts_mlp(self, x: torch.Tensor, jobs: Sequence[tuple], out: torch.Tensor) -> None:
        """One GIL-free call for many jobs of one layer: each job ``(rows, w13, s13, w2, s2, group,
        weights)`` adds ``weights[:, None] * expert(x[rows])`` to ``out[rows]`` (rows: LongTensor or list
        of row indices of x; weights: ``[len(rows)]``, or None for 1). Rows shared by several jobs are
        summed in fp32 and rounded once."""
        self._run(_rows(x, "x"), list(jobs), out, mode=1)

    def experts_mlp_start(self, x: torch.Tensor, jobs: Sequence[tuple], out: torch.Tensor) -> "HostCall":
        """``experts_mlp`` started on the pool's threads; returns at once with a ``HostCall`` whose
        ``wait()`` collects it (the calling thread takes part in what is left). Meanwhile the caller
        runs on, and no Python thread or GIL stands between it and the kernel. x, out and the jobs'
        tensors are kept alive by the HostCall; do not change them before ``wait()``. One started
        call at a time: starting another (or a blocking call) before waiting raises RuntimeError."""
        if self._started is not None:
            raise RuntimeError("HostKernel: the previous experts_mlp_start call was not waited for (call its wait())")
        call = HostCall(self)
        self._run(_rows(x, "x"), list(jobs), out, mode=1, call=call)
        self._started = call
        return call

    # -- the call -----------------------------------------------------------------------------------
    def _run(self, x: torch.Tensor, jobs: list, out: torch.Tensor, mode: int, call: "HostCall | None" = None) -> None:
        if call is None and self._started is not None:
            raise RuntimeError("HostKernel: an experts_mlp_start call is not waited for (call its wait() first)")
        if self._pool is None:
            raise RuntimeError("HostKernel is closed")
        if out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out must be a contiguous CPU {x.dtype} tensor of shape {tuple(x.shape)}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        n, hidden = x.shape
        vals: list[int] = []  # _Job fields as int64 words (little-endian: the int32 pairs packed), one array
        keep: list[Any] = []
        inter = None
        geo_cache = self._geo
        for i, job in enumerate(jobs):
            if len(job) != 7:
                raise ValueError(f"job {i}: expected (rows, w13, s13, w2, s2, group, weights), got {len(job)} items")
            rows, w13, s13, w2, s2, group, weights = job
            if isinstance(rows, torch.Tensor) and rows.dtype == torch.int64 and rows.is_contiguous():
                rows_t = rows  # the usual case: no conversion (C checks every row against x's rows)
            else:
                rows_t = torch.as_tensor(rows, dtype=torch.int64).reshape(-1).contiguous()
            m = rows_t.numel()
            if weights is None:
                w_t = None
            else:
                if isinstance(weights, torch.Tensor) and weights.dtype == torch.float32 and weights.is_contiguous():
                    w_t = weights
                else:
                    w_t = torch.as_tensor(weights).to(torch.float32).reshape(-1).contiguous()
                if w_t.numel() != m:
                    raise ValueError(f"job {i}: {w_t.numel()} weights for {m} rows")
            if not (w13.is_cpu and s13.is_cpu and w2.is_cpu and s2.is_cpu and w13.is_contiguous()
                    and s13.is_contiguous() and w2.is_contiguous() and s2.is_contiguous()):
                raise ValueError(f"job {i}: w13, s13, w2, s2 must be contiguous CPU tensors (views of the cache are)")
            key = (w13.shape, s13.shape, w2.shape, s2.shape, w13.dtype, s13.dtype, w2.dtype, s2.dtype, group, hidden)
            geo = geo_cache.get(key)
            if geo is None:
                geo = _geometry(w13, s13, w2, s2, int(group), hidden, f"job {i}")
                if len(geo_cache) > 64:
                    geo_cache.clear()
                geo_cache[key] = geo
            if inter is None:
                inter = geo[0]
            elif geo[0] != inter:
                raise ValueError(f"job {i}: intermediate size {geo[0]} differs from job 0's {inter}")
            keep.append((rows_t, w_t))
            vals += (rows_t.data_ptr(), 0 if w_t is None else w_t.data_ptr(), m, w13.data_ptr(), s13.data_ptr(),
                     w2.data_ptr(), s2.data_ptr(), geo[1] | geo[2] << 32, geo[3] | geo[4] << 32, geo[5])
        if not jobs:
            if mode == 0:
                out.zero_()
            if call is not None:
                call._empty = True
            return
        arr = (ctypes.c_int64 * len(vals))(*vals)
        fn = self._lib.mo_host_mlp if call is None else self._lib.mo_host_mlp_start
        rc = fn(self._pool, _ISA_CODE[self.isa], x.data_ptr(), _DT_CODE[x.dtype], n, hidden,
                inter, ctypes.cast(arr, ctypes.POINTER(_Job)), len(jobs), out.data_ptr(), mode)
        if rc == -errno.EINVAL:
            raise ValueError(f"a job's rows must index x's {n} rows (or its group sizes are invalid)")
        if rc == -errno.EFAULT:
            raise HostReadFault(self.last_fault())
        if rc != 0:
            raise RuntimeError(f"mo_host_mlp failed ({os.strerror(-rc) if rc < 0 else rc})")
        if call is not None:  # the C call reads all of these until it is waited for
            call._keep = (x, out, jobs, keep, arr)
        del keep


class HostReadFault(CacheError):
    """A host kernel call whose read of an expert's mapped bytes raised SIGBUS (the cache file was
    truncated, or the disk returned an I/O error, while it was mapped): the call was stopped, its output
    rows are not the experts' and must not be used; the process and the kernel's pool go on.
    ``address``: where the read failed (1: unknown). ``Cache.fault_error`` names the file and offset."""

    def __init__(self, address: int):
        super().__init__(f"the host kernel's read of mapped expert bytes at address {address:#x} failed (SIGBUS: "
                         "a cache file was truncated, or the disk returned an I/O error, while it was mapped)",
                         "run mmap-offload verify DIR")
        self.address = address


def guarded_touch(t: torch.Tensor) -> None:
    """Read a byte of every page of ``t`` (a view of a mapping) inside the host library's SIGBUS guard:
    HostReadFault where a page cannot be read, instead of a SIGBUS in the code that reads it next (torch,
    on the bf16 host path). Without the library (no compiler) it does nothing: that path is unguarded."""
    try:
        lib = library()
    except UnsupportedError:
        return
    fault = ctypes.c_int64(0)
    if lib.mo_host_touch(t.data_ptr(), t.numel() * t.element_size(), ctypes.byref(fault)) == -errno.EFAULT:
        raise HostReadFault(int(fault.value))


class HostCall:
    """A started ``HostKernel.experts_mlp_start`` call (one per kernel at a time)."""

    def __init__(self, kernel: HostKernel):
        self._kernel = kernel
        self._keep: Any = None
        self._empty = False
        self.seconds: float | None = None  # from the start to the end of the work
        self.ready: bool | None = None  # the work was complete when wait() was called

    def wait(self) -> "HostCall":
        """Block (the GIL released) until the call's output is written; returns self. Idempotent."""
        if self.seconds is not None:
            return self
        k = self._kernel
        if self._empty:
            self.seconds, self.ready = 0.0, True
        else:
            if k._pool is None:
                raise RuntimeError("HostKernel is closed")
            ns, ready = ctypes.c_int64(0), ctypes.c_int(0)
            rc = k._lib.mo_host_mlp_wait(k._pool, ctypes.byref(ns), ctypes.byref(ready))
            if rc not in (0, -errno.EFAULT):
                raise RuntimeError(f"mo_host_mlp_wait failed ({os.strerror(-rc) if rc < 0 else rc})")
            self.seconds, self.ready = ns.value / 1e9, bool(ready.value)
            if rc:  # -EFAULT: collected all the same, so the pool is free again
                self._done(k)
                raise HostReadFault(k.last_fault())
        self._done(k)
        return self

    def _done(self, k: HostKernel) -> None:
        self._keep = None
        if k._started is self:
            k._started = None


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.dtype not in _DT_CODE or x.device.type != "cpu":
        raise ValueError(f"{name} must be a 2-D CPU bf16/fp16/fp32 tensor [M, H], got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    return x.contiguous()


def _geometry(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, group: int,
              hidden: int, what: str) -> tuple[int, int, int, int, int, int]:
    """Check one expert's tensors against x's H; return I, the k per scale group of each matrix and
    vLLM's scale permutation of each (grouped = 64-chunks)."""
    for name, t in (("w13", w13), ("w2", w2)):
        if t.dtype != torch.int32 or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be a contiguous CPU int32 [K/16, 2N] Marlin tensor, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")
    for name, t in (("s13", s13), ("s2", s2)):
        if t.dtype not in _DT_CODE or t.dim() != 2 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{what}: {name} must be contiguous CPU bf16/fp16/fp32 scales [G, N], got "
                             f"{t.dtype} {tuple(t.shape)}")
    if s13.dtype != s2.dtype:
        raise ValueError(f"{what}: s13 is {s13.dtype}, s2 is {s2.dtype}")
    if w13.shape[0] * 16 != hidden or w13.shape[1] % 256:
        raise ValueError(f"{what}: w13 {tuple(w13.shape)} does not fit H={hidden} ([H/16, 4*I], I % 64 == 0)")
    inter = w13.shape[1] // 4
    if tuple(w2.shape) != (inter // 16, 2 * hidden):
        raise ValueError(f"{what}: w2 {tuple(w2.shape)} is not [I/16, 2*H] = {(inter // 16, 2 * hidden)}")
    if hidden % 64:
        raise ValueError(f"{what}: H={hidden} is not a multiple of 64 (Marlin tiles)")
    channelwise = group in (-1, 0)
    if not channelwise and (group < 16 or group % 16):
        raise UnsupportedError(f"{what}: group size {group} is not supported by the host kernel",
                               "use 32, 64, 128 or -1 (channelwise)")
    g13 = 1 if channelwise or group >= hidden else hidden // group
    g2 = 1 if channelwise or group >= inter else inter // group
    if not channelwise and (hidden % min(group, hidden) or inter % min(group, inter)):
        raise UnsupportedError(f"{what}: H={hidden} or I={inter} is not a whole number of groups of {group}",
                               "Marlin needs whole groups")
    if tuple(s13.shape) != (g13, 2 * inter):
        raise ValueError(f"{what}: s13 {tuple(s13.shape)} is not {(g13, 2 * inter)} for group {group}")
    if tuple(s2.shape) != (g2, hidden):
        if s2.shape[1] == hidden and s2.shape[0] > g2:
            raise UnsupportedError(f"{what}: s2 holds {s2.shape[0]} groups for I={inter} (act-order keeps w2's "
                                   "scales whole): act-order is not supported by the host kernel",
                                   "use the copy path for act-order caches (hybrid=false)")
        raise ValueError(f"{what}: s2 {tuple(s2.shape)} is not {(g2, hidden)} for group {group}")
    # (I, gs13, gs2, grouped13, grouped2, sdtype)
    return (inter, hidden // g13, inter // g2, int(not channelwise), int(not channelwise and group < inter),
            _DT_CODE[s13.dtype])


# ------------------------------------------------------------------------------- reference

_GROUPED = [i + 8 * j for i in range(8) for j in range(8)]
_SINGLE = [2 * i + o for i in range(4) for o in (0, 1, 8, 9, 16, 17, 24, 25)]


def dequantize_marlin(words: torch.Tensor, scales: torch.Tensor, K: int, N: int, group: int,
                      grouped_perm: bool | None = None) -> torch.Tensor:
    """fp32 ``[K, N]`` weight from Marlin words ``[K/16, 2N]`` and Marlin-permuted scales ``[G, N]``:
    ``(u - 8) * scale``. ``group``: 32/64/128, or -1 (channelwise). ``grouped_perm``: which scale
    permutation the scales carry (default vLLM's rule for a lone matrix, ``0 < group < K``; for w13
    vLLM uses the grouped one whenever ``group > 0``). Plain torch: a reference and a slow fallback."""
    if words.shape != (K // 16, 2 * N):
        raise ValueError(f"words {tuple(words.shape)} is not [K/16, 2N] = {(K // 16, 2 * N)}")
    w = words.to(torch.int64) & 0xFFFFFFFF
    nib = torch.stack([(w >> (4 * t)) & 15 for t in range(8)], dim=-1)  # [KT, 2N, t]
    # word = nt*128 + 16b + 4a + j, nibble t = 4l + 2g + h -> W[kt*16 + 8h + 2a + l, nt*64 + 16j + 8g + b]
    nib = nib.reshape(K // 16, N // 64, 8, 4, 4, 2, 2, 2)  # kt, nt, b, a, j, l, g, h
    u = nib.permute(0, 7, 3, 5, 1, 4, 6, 2).reshape(K, N)  # [kt, h, a, l] x [nt, j, g, b]
    if grouped_perm is None:
        grouped_perm = 0 < group < K
    perm = torch.tensor(_GROUPED if grouped_perm else _SINGLE)
    flat = scales.reshape(-1, perm.numel()).float()
    s = torch.empty_like(flat)
    s[:, perm] = flat
    s = s.reshape(scales.shape)
    gs = K if group in (-1, 0) or group >= K else group
    return (u.float() - 8.0) * s.repeat_interleave(gs, dim=0)
