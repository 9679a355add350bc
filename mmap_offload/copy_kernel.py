"""The async step's device copy kernel (csrc/async_step.c launches it): CUDA C compiled at run time
with NVRTC, the runtime compiler that ships with torch's CUDA wheels, and loaded with the driver API.
No CUDA toolkit is needed at install; where NVRTC or the driver cannot be found, ``load()`` says why
and the backend keeps the synchronous native step.

One launch per MoE layer: the kernel reads the descriptors the stream callback wrote into pinned
memory (staging offset, slot address, bytes per piece; then the slot ids), copies each piece from
the pinned staging buffer into its pool slot (16-byte loads of host memory over PCIe, as UVA reads
weights) and writes the kernel's slot ids."""

from __future__ import annotations

import ctypes
import glob
import os
from dataclasses import dataclass

import torch

__all__ = ["CopyKernel", "load", "SOURCE"]

# desc words: csrc/async_step.c D_NPIECES, D_NK, D_IDSIZE, D_SLOTDEV, D_MAXPIECES; pieces from D_HEAD
SOURCE = r"""
typedef unsigned long long u64;
extern "C" __global__ void mo_async_copy(const u64 *desc, const char *staging) {
    extern __shared__ u64 sh[];
    const u64 maxp = desc[4];
    const u64 np = desc[0];
    for (u64 i = threadIdx.x; i < 8 + 3 * np; i += blockDim.x) sh[i] = desc[i];
    __syncthreads();
    const u64 nk = sh[1], isz = sh[2];
    if (blockIdx.x == 0) {
        const u64 *ids = desc + 8 + 3 * maxp;
        for (u64 i = threadIdx.x; i < nk; i += blockDim.x) {
            if (isz == 4) ((int *)sh[3])[i] = (int)ids[i];
            else ((long long *)sh[3])[i] = (long long)ids[i];
        }
    }
    const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
    for (u64 p = 0; p < np; p++) {
        const u64 off = sh[8 + 3 * p], dst = sh[8 + 3 * p + 1], n = sh[8 + 3 * p + 2];
        const char *s = staging + off;
        char *d = (char *)dst;
        if ((((u64)s | dst | n) & 15) == 0) {
            const uint4 *s4 = (const uint4 *)s;
            uint4 *d4 = (uint4 *)d;
            for (u64 i = tid; i < n / 16; i += nth) d4[i] = s4[i];
        } else {
            for (u64 i = tid; i < n; i += nth) d[i] = s[i];
        }
    }
}
"""

_NVRTC_NAMES = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2", "libnvrtc.so")


@dataclass
class CopyKernel:
    """A loaded kernel: ``function`` (CUfunction) and ``launch`` (the address of cuLaunchKernel)."""

    function: int
    launch: int
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


def _compile(nvrtc: ctypes.CDLL, arch: str, binary: bool) -> bytes:
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


_cache: dict[int, CopyKernel | str] = {}


def load(device: torch.device) -> CopyKernel | str:
    """The kernel for ``device`` (made once per process and device), or one line saying why not."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    got = _cache.get(index)
    if got is not None:
        return got
    try:
        got = _load(index)
    except (OSError, RuntimeError, AttributeError) as e:
        got = f"the async step's copy kernel is not available: {e}"
    _cache[index] = got
    return got


def _load(index: int) -> CopyKernel:
    nvrtc = _nvrtc()
    if nvrtc is None:
        raise RuntimeError("NVRTC (libnvrtc) was not found next to torch")
    with torch.cuda.device(index):
        torch.zeros(1, device=f"cuda:{index}")  # the primary context is current on this thread
        major, minor = torch.cuda.get_device_capability(index)
        cuda = ctypes.CDLL("libcuda.so.1")
        module = ctypes.c_void_p()
        image, how = None, ""
        for binary, arch in ((True, f"sm_{major}{minor}"), (False, f"compute_{major}{minor}")):
            try:
                image = _compile(nvrtc, arch, binary)
                how = f"{'cubin' if binary else 'ptx'} {arch}"
            except RuntimeError:
                continue
            if cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(image)) == 0:
                break
            image = None
        if image is None:
            raise RuntimeError(f"the copy kernel could not be built or loaded for sm_{major}{minor}")
        fn = ctypes.c_void_p()
        if cuda.cuModuleGetFunction(ctypes.byref(fn), module, b"mo_async_copy"):
            raise RuntimeError("cuModuleGetFunction failed")
    launch = ctypes.cast(cuda.cuLaunchKernel, ctypes.c_void_p).value
    return CopyKernel(function=fn.value, launch=launch, module=module.value, source=how)
