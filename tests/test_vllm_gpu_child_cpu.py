"""The GPU test's child (tests/vllm_gpu_child.py) on vLLM-CPU, bf16: every case it runs on the H200
(no offload, uva, mmap cold / warm, expert cache, hybrid, default pool, sparse, hybrid sparse) runs
here too, through the same harness (tests/child_runner.py), with tokens equal to no offload. So a
break in the child or its harness shows in CI, not in a GPU call (session 13: a debugging run of the
child crashed on an unset pool size); and its GLM-4.5-layout model (``glm-bf16``, the GPU's ``glm-w4a16``
in bf16). W4A16 needs the GPU (vLLM-CPU refuses it). ~1.5 min each on 2 cores.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runner import run_child  # noqa: E402

CHILD = Path(__file__).with_name("vllm_gpu_child.py")


@pytest.mark.parametrize("model", ["bf16", "glm-bf16"])  # glm: GLM-4.5's layout (the GPU's glm-w4a16 in bf16)
def test_the_gpu_childs_cases_give_no_offloads_tokens_on_cpu(tmp_path, model):
    out = tmp_path / "result.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    res = run_child([sys.executable, str(CHILD), model, str(tmp_path), str(out)], env, tmp_path, out,
                    tmp_path / "child.log", hang_s=600, what=f"vLLM GPU child on CPU ({model})")
    cases = res["cases"]
    assert res["returncode"] == 0 and res["complete"], cases.why[-4000:]
    assert res["arch"] == ("glm4_moe" if model.startswith("glm-") else "mixtral")
    ref = cases["ref"]["tokens"]
    assert len(cases) == 11
    for case in ("mmap_not_eager", "mmap_compiled"):  # vLLM-CPU compiles without enforce_eager: refused
        got = cases.pop(case)
        assert "does not run under torch.compile" in got.get("refused", "") and "--enforce-eager" in got["refused"], got
    for case in cases:
        assert cases[case]["tokens"] == ref, case
    s = cases["mmap_experts"]["summary"]
    assert s["residency_expert_calls"] > 0 and s["residency_layer_calls"] > 0  # prefill: the threshold (sparse_max_ids 0)
    assert cases["mmap_sparse"]["summary"]["residency_sparse_async_calls"] > 0
    assert cases["mmap_hybrid"]["summary"]["residency_hybrid_calls"] > 0
    runners = cases["mmap_experts"]["runners_found"]  # patch 6's target (CUDA graphs) in vLLM 0.32's layers
    assert runners and all(runners), runners
    for case in ("mmap_cold", "mmap_warm", "mmap_experts"):  # vLLM's loader read no expert byte...
        assert cases[case]["loader_expert_bytes"] == 0, case
    if model.startswith("glm-"):  # ... nor the MTP layer's, which it reads and drops without offload
        assert cases["ref"]["loader_expert_bytes"] > res["expert_bytes"]
        assert cases["mmap_warm"]["summary"]["skipped_mtp_tensors"] > 0
