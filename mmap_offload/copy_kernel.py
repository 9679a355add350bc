"""The async step's device copy kernel (csrc/async_step.c launches it): CUDA C compiled at run time
with NVRTC, the runtime compiler that ships with torch's CUDA wheels, and loaded with the driver API.
No CUDA toolkit is needed at install; where NVRTC or the driver cannot be found, ``load()`` says why
and the backend keeps the synchronous native step.

One launch per MoE layer: the kernel reads the descriptors the stream callback wrote into pinned
memory (staging offset, slot address, bytes per piece; then the slot ids), copies each piece from
the pinned staging buffer into its pool slot (16-byte loads of host memory over PCIe, as UVA reads
weights) and writes the kernel's slot ids. A sparse call's kernels copy into the layer buffer's rows
instead, hits from their pool slots too (device to device), and write no slot ids; a hybrid call's last
part also brings the kernel's weights and ids (written by its callback into mapped memory) to the device.

Two more kernels in the same module serve hybrid calls (session 30: each replaced copies or torch launches
on vLLM's thread): ``mo_async_gather`` writes a call's ids, router weights and token rows into mapped
host memory in one launch, and ``mo_async_add_rows`` adds the host's rows, read in place, to the MoE
output (bf16/fp16 in float, rounded to nearest even as torch's ``add_``)."""

from __future__ import annotations

import ctypes
import glob
import os
import re
from dataclasses import dataclass

import torch

__all__ = ["CopyKernel", "load", "compile_for", "forced_arch", "SOURCE"]

# MMO_COPY_KERNEL_ARCH=sm_86 / compute_86 builds for that target instead of the device's own (a cubin, or PTX
# that the driver compiles for the device): what the tests use to run the kernels as built for another GPU
ARCH_ENV = "MMO_COPY_KERNEL_ARCH"
_ARCH_RE = re.compile(r"(sm|compute)_[0-9]{2,3}[af]?")

# a job's words: csrc/async_step.c (D_NPIECES, D_NK, D_IDSIZE, D_SLOTDEV (0: no slot ids), D_MAXPIECES, D_CAP,
# D_KERR; items of 4 words from word 8, then the slot ids, then one flag per item). An item is one fill chunk
# (source: a staging offset) or a piece of a hit's slot (source: a device address, top bit set; flagged at
# once), copied to its destination and, where the second one is not 0, there too (a sparse call's miss
# admitted into the pool). The kernel waits for each item's flag (stored by the copy pool's fill threads once
# the bytes are in staging: 1 filled, 2 failed), so the copy of an item overlaps the fill of the next ones.
# A flag not set within 60 s: D_KERR, skip.
SOURCE = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 ld_acquire_sys(const u64 *p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
/* n bytes from s to d by the threads of one block row (16 bytes at a time where all three allow) */
__device__ __forceinline__ void copy_bytes(char *d, const char *s, u64 n, u64 tid, u64 nt) {
    if ((((u64)s | (u64)d | n) & 15) == 0) {
        const uint4 *s4 = (const uint4 *)s;
        uint4 *d4 = (uint4 *)d;
        for (u64 k = tid; k < n / 16; k += nt) d4[k] = s4[k];
    } else if ((((u64)s | (u64)d | n) & 3) == 0) {
        const unsigned *s4 = (const unsigned *)s;
        unsigned *d4 = (unsigned *)d;
        for (u64 k = tid; k < n / 4; k += nt) d4[k] = s4[k];
    } else {
        for (u64 k = tid; k < n; k += nt) d[k] = s[k];
    }
}
/* blk_n > 0 (a hybrid call's last part): block 0 also copies the kernel's weights and ids, which part 0's
   callback wrote into the mapped area at blk_src, to blk_dst */
extern "C" __global__ void mo_async_copy(u64 *desc, const char *staging, const char *blk_src, char *blk_dst,
                                         u64 blk_n) {
    __shared__ u64 item[5];
    const u64 np = desc[0], nk = desc[1], isz = desc[2], maxp = desc[4], cap = desc[5];
    const u64 *items = desc + 8, *ids = desc + 8 + 4 * maxp, *flags = ids + cap;
    if (blockIdx.x == 0 && desc[3]) {
        void *out = (void *)desc[3];
        for (u64 i = threadIdx.x; i < nk; i += blockDim.x) {
            if (isz == 4) ((int *)out)[i] = (int)ids[i];
            else ((long long *)out)[i] = (long long)ids[i];
        }
    }
    if (blockIdx.x == gridDim.x - 1 && blk_n) copy_bytes(blk_dst, blk_src, blk_n, threadIdx.x, blockDim.x);
    for (u64 i = blockIdx.x; i < np; i += gridDim.x) {
        if (threadIdx.x == 0) {
            u64 f = ld_acquire_sys(flags + i);
            if (!f) {  /* poll with backoff, 0.25 to 4 us: each poll is a read over PCIe, sharing the
                          link and the host's memory with the pieces themselves (a piece takes tens of us) */
                const u64 t0 = now_ns();
                unsigned ns = 256;
                while (!(f = ld_acquire_sys(flags + i))) {
                    if (now_ns() - t0 > 60000000000ull) { f = 3; desc[6] = i + 1; __threadfence_system(); break; }
                    __nanosleep(ns);
                    if (ns < 4096) ns *= 2;
                }
            }
            item[0] = f; item[1] = items[4 * i]; item[2] = items[4 * i + 1]; item[3] = items[4 * i + 2];
            item[4] = items[4 * i + 3];
        }
        __syncthreads();
        const u64 f = item[0], off = item[1], dst = item[2], n = item[3], dst2 = item[4];
        if (f == 1) {
            ld_acquire_sys(flags + i);  /* this thread's own acquire of the fill's bytes */
            const char *s = (off >> 63) ? (const char *)(off & ~(1ull << 63)) : staging + off;
            char *d = (char *)dst, *d2 = (char *)dst2;
            if ((((u64)s | dst | dst2 | n) & 15) == 0) {
                const uint4 *s4 = (const uint4 *)s;
                uint4 *d4 = (uint4 *)d, *e4 = (uint4 *)d2;
                const u64 nv = n / 16, bd = blockDim.x;
                u64 k = threadIdx.x;
                for (; k + 3 * bd < nv; k += 4 * bd) {
                    uint4 a = s4[k], b = s4[k + bd], c = s4[k + 2 * bd], e = s4[k + 3 * bd];
                    d4[k] = a; d4[k + bd] = b; d4[k + 2 * bd] = c; d4[k + 3 * bd] = e;
                    if (e4) { e4[k] = a; e4[k + bd] = b; e4[k + 2 * bd] = c; e4[k + 3 * bd] = e; }
                }
                for (; k < nv; k += bd) {
                    const uint4 a = s4[k];
                    d4[k] = a;
                    if (e4) e4[k] = a;
                }
            } else {
                for (u64 k = threadIdx.x; k < n; k += blockDim.x) {
                    const char c = s[k];
                    d[k] = c;
                    if (d2) d2[k] = c;
                }
            }
        }
        __syncthreads();
    }
}
/* a hybrid call's inputs to the host in one launch: triple blockIdx.y of (dst, src, bytes), dst in mapped
   host memory (the job's ids, the router weights, the token rows), each cut over gridDim.x blocks */
extern "C" __global__ void mo_async_gather(char *d0, const char *s0, u64 n0, char *d1, const char *s1, u64 n1,
                                           char *d2, const char *s2, u64 n2) {
    char *d = blockIdx.y == 0 ? d0 : blockIdx.y == 1 ? d1 : d2;
    const char *s = blockIdx.y == 0 ? s0 : blockIdx.y == 1 ? s1 : s2;
    const u64 n = blockIdx.y == 0 ? n0 : blockIdx.y == 1 ? n1 : n2;
    const u64 per = ((n + gridDim.x - 1) / gridDim.x + 15) & ~15ull, at = per * blockIdx.x;
    if (at < n) copy_bytes(d + at, s + at, n - at < per ? n - at : per, threadIdx.x, blockDim.x);
}
__device__ __forceinline__ float bf16_f(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ __forceinline__ unsigned short f_bf16(float f) {  /* round to nearest even, NaN kept quiet */
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ float f16_f(unsigned short h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f_f16(float f) {
    unsigned short h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(f));
    return h;
}
/* out[r, c] += rows[r, c] (bf16 dt 0, fp16 dt 1) in float, rounded to nearest even as torch's add_:
   the host's rows of a hybrid call, read in place from the mapped area; row blockIdx.y, 8 values a thread */
extern "C" __global__ void mo_async_add_rows(unsigned short *out, const unsigned short *rows, u64 n, u64 H,
                                             u64 stride, u64 dt) {
    const u64 r = blockIdx.y, c0 = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (r >= n || c0 >= H) return;
    unsigned short *o = out + r * stride + c0;
    const unsigned short *s = rows + r * H + c0;
    const u64 m = H - c0 < 8 ? H - c0 : 8;
    unsigned short a[8], b[8];
    if (m == 8 && (((u64)o | (u64)s) & 15) == 0) {
        *(uint4 *)a = *(const uint4 *)o;
        *(uint4 *)b = *(const uint4 *)s;
    } else {
        for (u64 k = 0; k < m; k++) { a[k] = o[k]; b[k] = s[k]; }
    }
    for (u64 k = 0; k < m; k++)
        a[k] = dt ? f_f16(f16_f(a[k]) + f16_f(b[k])) : f_bf16(bf16_f(a[k]) + bf16_f(b[k]));
    if (m == 8 && ((u64)o & 15) == 0) *(uint4 *)o = *(uint4 *)a;
    else for (u64 k = 0; k < m; k++) o[k] = a[k];
}
"""

_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")


@dataclass
class CopyKernel:
    """A loaded kernel: ``function`` (CUfunction) and ``launch`` (the address of cuLaunchKernel)."""

    function: int
    launch: int
    gather: int  # mo_async_gather (a hybrid call's inputs to the host in one launch)
    add: int  # mo_async_add_rows (the host's rows added in place)
    module: int
    source: str  # how it was built: "cubin sm_90" / "ptx compute_90"


def _nvrtc() -> ctypes.CDLL | None:
    for name in _NVRTC_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    roots = [os.path.dirname(torch.__file__)]
    roots += [os.path.join(p, "nvidia") for p in __import__("site").getsitepackages() if os.path.isdir(p)]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libnvrtc*.so*"), recursive=True), reverse=True):
            if "builtins" in os.path.basename(path):
                continue
            try:
                return ctypes.CDLL(path)
            except OSError:
                pass
    return None


def _compile(nvrtc: ctypes.CDLL, arch: str) -> bytes:
    """NVRTC's image for ``arch``: a cubin for ``sm_XY``, PTX for ``compute_XY``."""
    binary = arch.startswith("sm_")
    prog = ctypes.c_void_p()
    cp = ctypes.c_char_p
    if nvrtc.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.encode(), b"mo_async_copy.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
        arr = (cp * len(opts))(*opts)
        rc = nvrtc.nvrtcCompileProgram(prog, len(opts), arr)
        if rc:
            n = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC could not compile the copy kernel for {arch}: {log.value.decode()[:300]}")
        n = ctypes.c_size_t()
        size_fn, get_fn = (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if binary else (
            nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        if size_fn(prog, ctypes.byref(n)):
            raise RuntimeError("NVRTC gave no output")
        buf = ctypes.create_string_buffer(n.value)
        if get_fn(prog, buf):
            raise RuntimeError("NVRTC gave no output")
        return buf.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def forced_arch() -> str:
    """The target that ``MMO_COPY_KERNEL_ARCH`` forces ("" when unset); a malformed value raises ValueError."""
    arch = os.environ.get(ARCH_ENV, "").strip()
    if arch and not _ARCH_RE.fullmatch(arch):
        raise ValueError(f"{ARCH_ENV}={arch!r} is not an NVRTC target: set it to sm_XY (a cubin) or compute_XY "
                         "(PTX the driver compiles), e.g. compute_86, or unset it to build for the GPU itself")
    return arch


def compile_for(arch: str) -> bytes:
    """The kernels built by NVRTC for ``arch`` (``sm_86``: a cubin, ``compute_86``: PTX); no GPU needed.
    RuntimeError with NVRTC's log when it cannot, or when NVRTC is not found."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        raise RuntimeError("NVRTC (libnvrtc) was not found next to torch")
    return _compile(nvrtc, arch)


_cache: dict[tuple[int, str], CopyKernel | str] = {}


def load(device: torch.device) -> CopyKernel | str:
    """The kernel for ``device`` (made once per process, device and forced target), or one line saying why
    not."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        arch = forced_arch()
    except ValueError as e:
        return f"the async step's copy kernel is not available: {e}"
    got = _cache.get((index, arch))
    if got is not None:
        return got
    try:
        got = _load(index, arch)
    except (OSError, RuntimeError, AttributeError) as e:
        got = f"the async step's copy kernel is not available: {e}"
    _cache[(index, arch)] = got
    return got


def _load(index: int, forced: str = "") -> CopyKernel:
    nvrtc = _nvrtc()
    if nvrtc is None:
        raise RuntimeError("NVRTC (libnvrtc) was not found next to torch")
    with torch.cuda.device(index):
        torch.zeros(1, device=f"cuda:{index}")  # the primary context is current on this thread
        major, minor = torch.cuda.get_device_capability(index)
        cuda = ctypes.CDLL("libcuda.so.1")
        module = ctypes.c_void_p()
        image, how, why = None, "", ""
        targets = [forced] if forced else [f"sm_{major}{minor}", f"compute_{major}{minor}"]
        for arch in targets:
            try:
                image = _compile(nvrtc, arch)
                how = f"{'cubin' if arch.startswith('sm_') else 'ptx'} {arch}"
            except RuntimeError as e:
                why = str(e)
                continue
            rc = cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image))
            if rc == 0:
                break
            why = f"the driver refused the {how} image (CUresult {rc})"
            image = None
        if image is None:
            raise RuntimeError(f"the copy kernel could not be built or loaded for sm_{major}{minor}"
                               f"{f' as {forced} ({ARCH_ENV})' if forced else ''}: {why}")
        fns = []
        for name in (b"mo_async_copy", b"mo_async_gather", b"mo_async_add_rows"):
            fn = ctypes.c_void_p()
            if cuda.cuModuleGetFunction(ctypes.byref(fn), module, name):
                raise RuntimeError(f"cuModuleGetFunction failed for {name.decode()}")
            fns.append(fn.value)
    launch = ctypes.cast(cuda.cuLaunchKernel, ctypes.c_void_p).value
    return CopyKernel(function=fns[0], launch=launch, module=module.value, source=how, gather=fns[1], add=fns[2])
