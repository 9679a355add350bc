"""Real vLLM on a GPU (the lent H200 with the vllm 0.26 bundle: scripts/gpu_vllm.sh): bf16 and
compressed-tensors W4A16 (Marlin MoE) synthetic Mixtral-style models, and a W4A16 model of GLM-4.5's
layout (``glm-w4a16``: the user's model class; added in session 34, first run on the H200 in session 35; its
multi-token-prediction layer added after that run), greedy tokens of
``--offload-backend mmap`` (cold cache, warm cache; layer streaming and the expert cache) equal to
no offload and to vLLM's own ``uva``; a warm start reads no expert byte from the checkpoint; pinned
host memory of the backend <= 0.5 GiB. One child process per quantization (tests/vllm_gpu_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

CHILD = Path(__file__).with_name("vllm_gpu_child.py")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runner import run_child  # noqa: E402
from mmap_offload.cpus import allowed_cpus, core_count  # noqa: E402


# MMO_GPU_QUANTS=w4a16 runs one child only (-k cannot: "w4a16" is also in a test's name, session 11)
@pytest.fixture(scope="module", params=os.environ.get("MMO_GPU_QUANTS", "bf16,w4a16,glm-w4a16").split(","))
def run(request, tmp_path_factory):
    quant = request.param
    work = tmp_path_factory.mktemp(f"vllm_gpu_{quant}")
    out = work / "result.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    keep = os.environ.get("OUT")
    # the child's output goes to a file ($OUT/vllm_gpu_<quant>.log when set): a run cut short by
    # the caller's time limit still shows how far each case got; a case that runs MMO_CHILD_HANG_S
    # seconds dumps every thread's stack and ends the child (tests/child_runner.py)
    log_path = Path(keep, f"vllm_gpu_{quant}.log") if keep else work / "child.log"
    env.setdefault("MMO_CHILD_HANG_S", "400")
    res = run_child([sys.executable, str(CHILD), quant, str(work), str(out)], env, work, out, log_path,
                    hang_s=float(env["MMO_CHILD_HANG_S"]), what=f"vLLM GPU child ({quant})")
    if keep and out.exists():
        Path(keep, f"vllm_gpu_{quant}.json").write_text(out.read_text())
    return res


def test_child_ran_every_case(run):
    """The child ended by itself (rc 0) after its last case; the tests below read the cases it ran
    and fail one by one for those it did not."""
    assert run["returncode"] == 0 and run.get("complete"), run["cases"].why[-8000:]


def test_mmap_tokens_equal_no_offload_and_uva(run):
    cases = run["cases"]
    ref = cases["ref"]["tokens"]
    assert cases["uva"]["tokens"] == ref
    for case in ("mmap_cold", "mmap_warm", "mmap_experts", "mmap_auto"):
        assert cases[case]["offloader"] == "MmapOffloader", case
        assert cases[case]["tokens"] == ref, case


def test_hybrid_tokens_equal_no_offload(run):
    """Host compute of some misses: the tokens equal no offload up to the first near-tie of no offload's
    logprobs (tests/token_match.py), and exactly when no position is that close. H200: session 5 equal
    (60 hybrid calls, 125 experts on the host); session 6 call 2 parted at the 8th token of one prompt,
    between two tokens no offload itself repeats in alternation (gap not recorded then)."""
    from token_match import assert_equal_up_to_a_near_tie

    hy, ref = run["cases"]["mmap_hybrid"], run["cases"]["ref"]
    s = hy["summary"]
    assert s["residency_hybrid_calls"] > 0 and s["residency_host_host_experts"] > 0
    assert s["residency_late_checks"] > 0  # the default check_after_experts: the checks in patch 4b
    assert_equal_up_to_a_near_tie(hy["tokens"], ref["tokens"], ref["top2_gap"])


def test_default_pool_follows_free_memory(run):
    s = run["cases"]["mmap_auto"]["summary"]
    assert s["residency_pool_bytes"] > 0  # vLLM leaves plenty free at gpu_memory_utilization 0.3
    assert s["residency_expert_calls"] > 0
    # what the default pool leaves vLLM (session 38): one request of max_model_len in KV, by the layers' specs
    assert s["kv_reserve_bytes"] == s["kv_one_request_bytes"] > 0 and s["act_reserve_bytes"] > 0


def test_w4a16_runs_through_vllms_marlin_moe(run):
    if run["quant"] != "w4a16":
        pytest.skip("bf16 runs vLLM's unquantized MoE")
    for case in ("ref", "mmap_warm", "mmap_experts"):
        assert "Marlin" in json.dumps(run["cases"][case]["kernel"]), run["cases"][case]["kernel"]


def test_warm_start_reads_no_expert_byte(run):
    cold, warm = run["cases"]["mmap_cold"], run["cases"]["mmap_warm"]
    assert cold["loader_expert_bytes"] == 0 and cold["warmup_bytes"] == run["expert_bytes"]
    for case in ("mmap_warm", "mmap_experts"):
        assert run["cases"][case]["loader_expert_bytes"] == 0 and run["cases"][case]["warmup_bytes"] == 0, case
    assert warm["summary"]["skipped_bytes"] == run["expert_bytes"]
    if run["arch"] == "glm4_moe":  # its MTP layer: read and dropped without offload, skipped unread with it
        assert run["cases"]["ref"]["loader_expert_bytes"] > run["expert_bytes"]
        assert warm["summary"]["skipped_mtp_tensors"] > 0 and warm["summary"]["skipped_mtp_bytes"] > 0


def test_expert_cache_fetches_routed_experts_and_streams_prefill(run):
    s = run["cases"]["mmap_experts"]["summary"]
    assert s["residency_pool_slots_per_layer"] == 6
    assert s["residency_expert_calls"] > 0 and s["residency_layer_calls"] > 0
    assert s["residency_pool_misses"] > 0
    # misses stream-ordered on vLLM's stream behind gates (one per group of a batch; no host wait
    # for their reads), every gate launched
    assert s["residency_pool_ordered_fills"] > 0 and s["engine_ordered_gates"] >= s["engine_ordered_batches"]
    assert s.get("engine_ordered_ungated", 0) == 0
    # decode calls whose 4 ids fit the 6 slots are decided on the stream once every expert is
    # checked (async_step.py: no host wait for the router); before that the native step serves them
    assert s["residency_async_calls"] > 0 and s["residency_async_kernel"].startswith(("cubin", "ptx")), s
    forced = os.environ.get("MMO_COPY_KERNEL_ARCH", "").strip()  # e.g. compute_86: as built for an RTX 3090
    assert not forced or s["residency_async_kernel"].endswith(f" {forced}"), s["residency_async_kernel"]
    assert s["residency_async_calls"] + s["residency_native_calls"] >= s["residency_expert_calls"] // 2, s


def test_sparse_calls_on_the_stream_give_the_same_tokens(run):
    """2 slots per layer, 4 routed ids per decode call: each call is a sparse one decided on the
    stream (AsyncStep.run_sparse: hits copied from the pool on the device, misses from the cache
    into the layer buffer's rows, hot misses admitted into the pool); the tokens equal no offload."""
    sp = run["cases"]["mmap_sparse"]
    assert sp["tokens"] == run["cases"]["ref"]["tokens"]
    s = sp["summary"]
    assert s["residency_pool_slots_per_layer"] == 2, s
    assert s["residency_sparse_async_calls"] > 0 and s["residency_sparse_miss_bytes"] > 0, s
    assert s["residency_async_admitted"] > 0 and s["residency_async_sparse_hits"] > 0, s


def test_hybrid_sparse_calls_on_the_stream_give_the_same_tokens(run):
    """mmap_sparse with hybrid: W4A16 sparse calls on the stream send a share of the misses they do
    not admit to the host kernel, started from the stream's callback (AsyncStep.run_hybrid); the
    kernel gets those pairs at weight 0 and the host's rows are added after it. Tokens as
    test_hybrid_tokens_equal_no_offload's rule (bf16 takes the Python hybrid path here)."""
    from token_match import assert_equal_up_to_a_near_tie

    hy, ref = run["cases"]["mmap_hybrid_sparse"], run["cases"]["ref"]
    s = hy["summary"]
    if run["quant"] == "w4a16":
        assert s["hybrid_auto"] == "on", s  # option hybrid "auto" (session 38): on for W4A16 on CUDA
        assert s["residency_hybrid_async_calls"] > 0 and s["residency_async_host_experts"] > 0, s
        assert s["residency_async_hybrid_calls"] == s["residency_hybrid_async_calls"], s
        # a layer's steady calls took the fast path (session 30: 56 of 64 in this case on the H200)
        assert 0 < s["residency_fast_hybrid_calls"] < s["residency_hybrid_async_calls"], s
        # hybrid_share's default holds every miss the pool does not admit on the host (no adaptation),
        # and the host's default threads count at most 3 of the copy threads (session 32)
        assert s["residency_async_host_share"] == 1.0, s
        # this rank's CPUs less the launching thread and 3 copy threads, at most one per core but the
        # launching thread's (cpus.py; the H200 VM has one thread per core: 12 of 16)
        cpus = len(allowed_cpus())
        assert s["residency_host_threads"] == max(1, min(cpus - 1 - 3, core_count() - 1)), s
    assert_equal_up_to_a_near_tie(hy["tokens"], ref["tokens"], ref["top2_gap"])


def test_hybrid_small_calls_auto_switches_and_keeps_the_tokens(run):
    """hybrid_small_calls=auto (the default) at hybrid_small_ms 0: after the first decode step's check
    the calls that fit the pool take the hybrid form on the stream (AsyncStep.run_hybrid) instead of
    the async expert step, once for the run; tokens as test_hybrid_tokens_equal_no_offload's rule.
    W4A16 only (bf16 has no stream hybrid path)."""
    from token_match import assert_equal_up_to_a_near_tie

    if run["quant"] != "w4a16":
        pytest.skip("the stream hybrid path is W4A16's")
    hy, ref = run["cases"]["mmap_hybrid_small"], run["cases"]["ref"]
    s = hy["summary"]
    assert s["residency_small_auto_switches"] == 1 and s["residency_small_calls_hybrid"] is True, s
    assert s["residency_small_hybrid_steps"] > 0 and s["residency_hybrid_async_calls"] > 0, s
    assert s["residency_async_calls"] > 0, s  # the steps before the switch: the async expert step
    assert 1.0 < s["residency_link_h2d_gbps"] < 200.0, s  # the link timed at start (the threshold's scale)
    assert_equal_up_to_a_near_tie(hy["tokens"], ref["tokens"], ref["top2_gap"])


def test_host_only_decode_keeps_the_tokens(run):
    """hybrid_admit 0 with hybrid_small_calls on (experts on the host, llama.cpp's --cpu-moe way inside
    vLLM): decode calls admit nothing into the pool and never hit it, the host computes experts, and the
    tokens follow test_hybrid_tokens_equal_no_offload's rule. W4A16 only."""
    from token_match import assert_equal_up_to_a_near_tie

    if run["quant"] != "w4a16":
        pytest.skip("the stream hybrid path is W4A16's")
    hy, ref = run["cases"]["mmap_host_only"], run["cases"]["ref"]
    s = hy["summary"]
    assert s["residency_hybrid_async_calls"] > 0 and s["residency_async_host_experts"] > 0, s
    assert s["residency_async_admitted"] == 0 and s["residency_async_sparse_hits"] == 0, s
    assert_equal_up_to_a_near_tie(hy["tokens"], ref["tokens"], ref["top2_gap"])


def test_graph_starts_that_cannot_serve_are_refused(run):
    """Without enforce_eager: layer streaming (its waits in the decoder's forward, inside what torch.compile
    and CUDA graphs capture) and full CUDA graphs (one step's expert placement replayed) are refused at
    start with one line naming the fix, serving nothing."""
    cases = run["cases"]
    streaming, full = cases["mmap_not_eager"], cases["mmap_compiled"]
    assert "streams whole layers here (expert_cache_gib=0)" in streaming.get("refused", ""), streaming
    assert "cannot serve cudagraph_mode FULL" in full.get("refused", ""), full
    assert all("pass --enforce-eager" in c["refused"] for c in (streaming, full))


def test_piecewise_cuda_graphs_keep_the_tokens(run):
    """Compiled with piecewise CUDA graphs (vLLM's default graph mode made PIECEWISE, capture sizes 1, 2, 4):
    graphs were captured, decode batches of 2 replayed them with the MoE layers eager between them (our
    route() on every call, the outputs through the fixed buffers), and the tokens equal no offload's up to a
    near tie (Inductor's fused kernels round bf16 differently from eager's); a batch of 3, padded to the
    size-4 graphs, gave its padding rows row 0's experts (session 40, not yet run) and the same tokens."""
    if run["quant"] != "w4a16":
        pytest.skip("the piecewise case runs in the W4A16 children (Marlin MoE, hybrid auto)")
    from token_match import assert_equal_up_to_a_near_tie

    cases = run["cases"]
    g, ref = cases["mmap_graphs"], cases["ref"]
    assert "tokens" in g, g
    s = g["summary"]
    assert s["graph_mode"] == "piecewise" and g["graphs_captured"] > 0, (s.get("graph_mode"), g["graphs_captured"])
    assert s["graph_capture_waits"] > 0 and s["graph_output_copies"] > 0, s
    assert s["graph_output_bytes"] > 0 and s.get("hybrid_auto") == "on", s
    assert s["residency_expert_calls"] + s.get("residency_sparse_async_calls", 0) > 0, s
    assert_equal_up_to_a_near_tie(g["tokens"], ref["tokens"], ref["top2_gap"])
    # a batch of 3 ran as the size-4 graphs: its padding rows took row 0's experts, the real rows' tokens unchanged
    assert s["residency_padded_rows"] > 0, s
    assert_equal_up_to_a_near_tie(g["padded_tokens"][:2], ref["tokens"], ref["top2_gap"])


def test_pinned_host_memory_is_small(run):
    for case in ("mmap_cold", "mmap_warm", "mmap_experts", "mmap_hybrid", "mmap_auto", "mmap_sparse",
                 "mmap_hybrid_sparse"):
        s = run["cases"][case]["summary"]  # the ring, and the async step's staging and job areas
        assert s["engine_pinned_bytes"] + s.get("residency_async_pinned_bytes", 0) <= 0.5 * 2**30, case


TP2_CHILD = r'''
import json, os, sys
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")

def _rank_summary(worker):
    """On each rank's worker: what its residency sent to the host (the parent cannot reach it)."""
    from vllm.model_executor.offloader import get_offloader
    s = get_offloader().summary()
    keys = ("residency_hybrid_async_calls", "residency_async_host_experts", "residency_host_threads",
            "residency_late_checks", "graph_output_copies")
    return {k: int(s.get(k, 0) or 0) for k in keys} | {"graph_mode": s.get("graph_mode")}

def main():
    from mmap_offload.synth import make_checkpoint
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    work, case, out = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path.insert(0, sys.argv[4])  # tests/: token_match
    from token_match import top2_gaps
    ckpt = make_checkpoint(os.path.join(work, "ckpt"), arch="mixtral", quant="w4a16", num_layers=4, num_experts=8,
                           hidden=1024, intermediate=1024, top_k=2, vocab_size=2048, num_heads=8, num_kv_heads=2,
                           group_size=128)
    kw = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
              gpu_memory_utilization=0.3, seed=0, tensor_parallel_size=2, attention_config={"backend": "TRITON_ATTN"})
    mm = {"cache_dir": os.path.join(work, "cache")}
    if case == "mmap_layer":
        kw.update(offload_backend="mmap", additional_config={"mmap_offload": {**mm, "expert_cache_gib": 0}})
    elif case == "mmap_experts":
        kw.update(offload_backend="mmap", additional_config={"mmap_offload": {**mm, "expert_cache_gib": 0.01}})
    elif case in ("mmap_hybrid", "mmap_hybrid_graphs"):  # the user's set-up in small: TP=2, hybrid on the stream,
        # 2 slots of 8 per layer; _graphs: with piecewise CUDA graphs between the eager MoE layers (graphs.py)
        from mmap_offload.cache_reader import open_cache
        c = open_cache(mm["cache_dir"], tp_rank=0, tp_size=2)
        gib = 2 * len(c.layers) * sum(s.nbytes for s in c.expert_specs) / 2**30
        c.close()
        kw.update(offload_backend="mmap", additional_config={"mmap_offload": {
            **mm, "expert_cache_gib": gib, "layer_stream_fraction": 1.0, "hybrid": True}})
        if case == "mmap_hybrid_graphs":
            kw.update(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})
    llm = LLM(model=str(ckpt), **kw)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, detokenize=False, logprobs=2)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ([1, 5, 9, 200, 33], [7, 8, 9, 10, 11, 12])], sp,
                        use_tqdm=False)
    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "top2_gap": top2_gaps(outs)}
    if case.startswith("mmap_hybrid"):
        res["ranks"] = llm.collective_rpc(_rank_summary)
    open(out, "w").write(json.dumps(res))
    os._exit(0)

if __name__ == "__main__":  # spawned engine processes re-import this file: only the parent runs it
    main()
'''


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP=2 needs two GPUs (the two-H200 machine)")
def test_tensor_parallel_2_mmap_tokens_equal_no_offload(tmp_path):
    """TP=2 (spawned workers: the plugin comes in through its vllm.general_plugins entry point),
    W4A16: each rank builds rank-r-of-2 while loading; layer streaming and the expert cache give
    the tokens of TP=2 without offload; hybrid on the stream (the user's set-up) gives them up to a
    near-tie (tests/token_match.py), each rank's host computing experts of its own shard, and so does hybrid
    with piecewise CUDA graphs between the MoE layers (``mmap_hybrid_graphs``, session 40). Never run:
    two GPUs were not lent in sessions 6-40 (the CPU twin, tests/test_vllm_e2e.py, runs in CI)."""
    script = tmp_path / "tp2.py"
    script.write_text(TP2_CHILD)
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # collective_rpc of the child's function
    from importlib.metadata import entry_points

    if not any(ep.value.startswith("mmap_offload") for ep in entry_points(group="vllm.general_plugins")):
        # a checkout on PYTHONPATH (the GPU machine) is not pip-installed: give the spawned workers
        # the entry point vLLM loads plugins from, as an installed package would
        di = tmp_path / "plugin_site" / "mmap_offload_checkout-0.0.dist-info"
        di.mkdir(parents=True)
        (di / "METADATA").write_text("Metadata-Version: 2.1\nName: mmap-offload-checkout\nVersion: 0.0\n")
        (di / "entry_points.txt").write_text("[vllm.general_plugins]\nmmap_offload = mmap_offload.vllm_backend:register\n")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(di.parent), env.get("PYTHONPATH")]))
    # every process of a case (the parent and vLLM's spawned workers) logs to one file ($OUT/vllm_gpu_tp2.log
    # when set) and, through a sitecustomize on PYTHONPATH, dumps its threads' stacks after MMO_CHILD_HANG_S
    # seconds: a hang at TP=2 (session 6, call 2: 5 minutes, nothing captured) shows where each rank waits
    hook = tmp_path / "hang_hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import faulthandler, os, sys\n"
        "if os.environ.get('MMO_CHILD_HANG_S'):\n"
        "    faulthandler.dump_traceback_later(float(os.environ['MMO_CHILD_HANG_S']), exit=False, file=sys.stderr)\n")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    env.setdefault("MMO_CHILD_HANG_S", "240")
    keep = os.environ.get("OUT")
    log_path = Path(keep, "vllm_gpu_tp2.log") if keep else tmp_path / "tp2.log"
    toks = {}
    # each case starts vLLM at TP=2 anew (> 180 s for the first on a fresh machine): MMO_TP2_CASES picks the
    # offload cases of one device call (default all three; the reference always runs)
    all_cases = ("mmap_layer", "mmap_experts", "mmap_hybrid", "mmap_hybrid_graphs")
    picked = os.environ.get("MMO_TP2_CASES", ",".join(all_cases)).split(",")
    cases = ["ref"] + [c for c in all_cases if c in picked]
    for case in cases:
        out = tmp_path / f"{case}.json"
        with open(log_path, "a") as log:
            log.write(f"==== TP=2 case {case}\n")
            log.flush()
            try:
                proc = subprocess.run([sys.executable, str(script), str(tmp_path), case, str(out),
                                       str(Path(__file__).resolve().parent)], stdout=log,
                                      stderr=subprocess.STDOUT, text=True, timeout=float(env["MMO_CHILD_HANG_S"]) + 60,
                                      env=env)
            except subprocess.TimeoutExpired:
                pytest.fail(f"TP=2 {case} hung; every process's stacks are in {log_path}")
        if proc.returncode != 0 or not out.exists():
            text = log_path.read_text(errors="replace")
            pytest.fail(f"TP=2 {case} failed with {proc.returncode}:\n{text[-8000:]}")
        toks[case] = json.loads(out.read_text())
    ref = toks["ref"]
    for case in ("mmap_layer", "mmap_experts"):
        assert case not in toks or toks[case]["tokens"] == ref["tokens"], case
    from token_match import assert_equal_up_to_a_near_tie

    for case in ("mmap_hybrid", "mmap_hybrid_graphs"):
        hy = toks.get(case)
        if hy is None:
            continue
        assert_equal_up_to_a_near_tie(hy["tokens"], ref["tokens"], ref["top2_gap"])
        assert len(hy["ranks"]) == 2
        for r in hy["ranks"]:
            assert r["residency_hybrid_async_calls"] > 0 and r["residency_async_host_experts"] > 0, hy["ranks"]
            assert r["residency_late_checks"] > 0, hy["ranks"]  # check_after_experts on each rank
            if case == "mmap_hybrid_graphs":  # each rank's MoE outputs through the fixed buffers graphs read
                assert r["graph_mode"] == "piecewise" and r["graph_output_copies"] > 0, hy["ranks"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
