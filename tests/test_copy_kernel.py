"""The async step's device kernels (mmap_offload/copy_kernel.py), as NVRTC builds them.

- ``MMO_COPY_KERNEL_ARCH``: a malformed target is refused in one line naming the variable and the fix,
  before anything touches CUDA (CPU, in CI).
- GPU (where NVRTC is found, next to torch's CUDA wheels): the same source compiles to a cubin for every
  architecture the project can meet, the user's RTX 3090 (sm_86) among them, and to PTX naming the three
  kernels; a target the GPU cannot load comes back as one line, so the backend keeps its synchronous step.
  That the kernels built for compute_86 compute the right bytes is checked by the GPU tests of
  tests/test_async_hybrid.py (parametrized over the target).
"""

from __future__ import annotations

import pytest
import torch

from mmap_offload import copy_kernel


@pytest.mark.parametrize("bad", ["86", "sm86", "sm_8", "sm_86;rm", "gfx90a"])
def test_a_malformed_forced_target_is_refused_in_one_line(monkeypatch, bad):
    monkeypatch.setenv(copy_kernel.ARCH_ENV, bad)
    with pytest.raises(ValueError) as e:
        copy_kernel.forced_arch()
    line = str(e.value)
    assert "\n" not in line and copy_kernel.ARCH_ENV in line and "compute_86" in line
    got = copy_kernel.load(torch.device("cuda", 0))  # refused before any CUDA call: fine without a GPU
    assert isinstance(got, str) and copy_kernel.ARCH_ENV in got


@pytest.mark.parametrize("good", ["", "sm_86", "compute_80", "sm_90a", "sm_120", " compute_86 "])
def test_well_formed_targets_pass(monkeypatch, good):
    monkeypatch.setenv(copy_kernel.ARCH_ENV, good)
    assert copy_kernel.forced_arch() == good.strip()  # surrounding blanks dropped


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and NVRTC beside torch)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90"])
def test_the_kernels_compile_to_a_cubin_for_each_architecture(arch):
    image = copy_kernel.compile_for(arch)
    assert image[:4] == b"\x7fELF" and len(image) > 4096
    for name in (b"mo_async_copy", b"mo_async_gather", b"mo_async_add_rows"):
        assert name in image


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and NVRTC beside torch)")
def test_ptx_for_the_users_gpu_names_its_target_and_the_kernels():
    ptx = copy_kernel.compile_for("compute_86").rstrip(b"\0").decode()
    assert ".target sm_86" in ptx
    for name in ("mo_async_copy", "mo_async_gather", "mo_async_add_rows"):
        assert f".entry {name}(" in ptx


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and NVRTC beside torch)")
def test_a_cubin_the_gpu_cannot_load_is_one_line_and_no_kernel(monkeypatch):
    major, minor = torch.cuda.get_device_capability(0)
    other = "sm_86" if (major, minor) != (8, 6) else "sm_90"
    monkeypatch.setenv(copy_kernel.ARCH_ENV, other)
    got = copy_kernel.load(torch.device("cuda", 0))
    assert isinstance(got, str) and "\n" not in got and other in got and copy_kernel.ARCH_ENV in got
