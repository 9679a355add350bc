"""vLLM backend: ``--offload-backend mmap`` (docs/VLLM.md).

    options.py    MmapOptions: what a user sets (additional_config / MMAP_OFFLOAD_* / defaults)
    patches.py    every change to vLLM internals, each named with the versions it was checked on
    offloader.py  MmapOffloader: vLLM's BaseOffloader lifecycle over the cache
    residency.py  routing-aware residency: routed experts into a VRAM pool, slot ids to the kernel
    probe.py      proves vLLM's processed layout equals the cache layout before serving
    launcher.py   ``mmap-offload vllm ...``

``register`` is the ``vllm.general_plugins`` entry point (pyproject.toml).
"""

from ..errors import MmapOffloadError
from .launcher import launcher_argv, vllm_main
from .offloader import MmapOffloader
from .options import CONFIG_KEY, MmapOptions
from .patches import BACKEND_NAME, TESTED_VLLM, register, skipped_checkpoint_names

__all__ = [
    "BACKEND_NAME", "CONFIG_KEY", "TESTED_VLLM", "MmapOptions", "MmapOffloader", "register", "launcher_argv",
    "vllm_main", "skipped_checkpoint_names", "MmapOffloadError",
]
