"""End to end with the real vLLM CPU build: greedy tokens with ``offload_backend="mmap"`` equal
the tokens without offload, on a cold cache (built while loading) and on the warm cache it left;
the warm start reads no routed-expert byte from the checkpoint.

Two vLLM processes in all (each start is ~15-30 s here): one without offload, one that starts
vLLM twice in a row (cold, then warm) with the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
so the byte counters below see every read of the model loader and of our warm-up.
Run: ``.venv-vllm/bin/python -m pytest tests/test_vllm_e2e.py -m vllm -q``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")

PROMPTS = [[1, 5, 9, 200, 33], [7, 8, 9], [42] * 12]
MAX_TOKENS = 12

CHILD = textwrap.dedent(
    r'''
    import gc, json, os, sys
    from pathlib import Path
    mode, ckpt, cache, out = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    prompts, max_tokens = json.loads(sys.argv[5]), int(sys.argv[6])

    # count what vLLM's safetensors loader reads (names and bytes) and what our warm-up reads
    import vllm.model_executor.model_loader.weight_utils as wu
    import mmap_offload.checkpoint as mc
    counts = {"loader_expert_bytes": 0, "loader_expert_tensors": 0, "loader_bytes": 0, "warmup_bytes": 0}
    _open = wu.safe_open
    from fakes import SafeOpenTap  # tests/ is on PYTHONPATH (_run_child)

    def _count(name, t):
        n = t.numel() * t.element_size()
        counts["loader_bytes"] += n
        if ".experts." in name:
            counts["loader_expert_bytes"] += n
            counts["loader_expert_tensors"] += 1

    wu.safe_open = lambda *a, **k: SafeOpenTap(_open(*a, **k), _count)
    _read = mc.Checkpoint.read
    def _counting_read(self, ref, out=None):
        counts["warmup_bytes"] += ref.nbytes
        return _read(self, ref, out)
    mc.Checkpoint.read = _counting_read

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.distributed import cleanup_dist_env_and_memory

    def run(sequential=False, eager=True, **kw):
        for k in counts:
            counts[k] = 0
        llm = LLM(model=ckpt, skip_tokenizer_init=True, enforce_eager=eager, dtype="bfloat16",
                  max_model_len=128, max_num_seqs=4, seed=0, **kw)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True, logprobs=2)
        todo = [[TokensPrompt(prompt_token_ids=p)] for p in prompts] if sequential else [[TokensPrompt(prompt_token_ids=p) for p in prompts]]
        outs = [o for batch in todo for o in llm.generate(batch, sp, use_tqdm=False)]
        from vllm.model_executor.offloader import get_offloader
        from token_match import top2_gaps  # tests/ is on PYTHONPATH (_run_child)
        off = get_offloader()
        info = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "top2_gap": top2_gaps(outs),
                "offloader": type(off).__name__, **counts}
        vc = llm.llm_engine.vllm_config  # one request's KV cache by the toy's shapes (test_a_pool_leaves_...)
        hf, blk = vc.model_config.hf_config, vc.cache_config.block_size
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        info["kv_expect"] = hf.num_hidden_layers * -(-vc.model_config.max_model_len // blk) * 2 * blk * hf.num_key_value_heads * head * 2
        if hasattr(off, "summary"):
            info["summary"] = off.summary()
            info["transforms"] = sorted(getattr(off, "_transforms", {}))
            from mmap_offload.vllm_backend import skipped_checkpoint_names
            info["skipped_names"] = len(skipped_checkpoint_names())
            off.close()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        return info

    def cache_layers_and_slot_gib():
        """The cache's MoE layers (built by the first offloaded run) and GiB of one slot per layer."""
        from mmap_offload.cache_reader import open_cache
        c = open_cache(cache, tp_rank=0, tp_size=1)
        try:
            return list(c.layers), len(c.layers) * sum(s.nbytes for s in c.expert_specs) / 2**30
        finally:
            c.close()

    result = {}
    if mode == "ref":
        result["ref"] = run()
        result["ref_seq"] = run(sequential=True)  # decode batch 1: the expert cache's run below
        out.write_text(json.dumps(result))
        # W4A16 on vLLM's CPU backend: its MoE layout is not Marlin; the probe must refuse it
        from mmap_offload.synth import PRESETS, make_checkpoint
        ckpt = str(make_checkpoint(Path(cache).parent / "ckpt-w4a16", **PRESETS["tiny-mixtral-w4a16"]))
        try:
            run(offload_backend="mmap", additional_config={"mmap_offload": {"cache_dir": cache + "-w4a16"}})
            result["w4a16"] = "served"
        except Exception as e:  # noqa: BLE001 - the engine wraps the error; keep its text
            result["w4a16"] = f"{type(e).__name__}: {e}"
    elif mode == "glm":
        # GLM-4.5's layout in small (synth "tiny-glm4-moe"): layer 0 dense, experts from layer 1,
        # sigmoid + correction-bias routing, a shared expert beside the routed ones
        result["ref"] = run()
        result["ref_seq"] = run(sequential=True)
        result["cold"] = run(offload_backend="mmap", additional_config={"mmap_offload": {"cache_dir": cache, "lookahead": 0}})
        result["cache_layers"], slot_gib = cache_layers_and_slot_gib()
        # 3 slots per layer for 8 experts: misses, evictions; prefill streams whole layers
        result["experts"] = run(sequential=True, offload_backend="mmap", additional_config={"mmap_offload": {
            "cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "layer_stream_fraction": 0.75, "sparse_max_ids": 0}})
        # hybrid with its defaults but one host thread (check_after_experts on: the check in patch 4b)
        result["hybrid"] = run(sequential=True, offload_backend="mmap", additional_config={"mmap_offload": {
            "cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "layer_stream_fraction": 0.75, "hybrid": True,
            "host_threads": 1}})
        # speculative decoding with the checkpoint's own MTP layer (vLLM loads it, experts included, for the
        # drafter): each decode step verifies 2 tokens per sequence through the expert pool, then with hybrid
        spec = {"method": "mtp", "num_speculative_tokens": 1}
        result["spec_pool"] = run(sequential=True, speculative_config=spec, offload_backend="mmap", additional_config={
            "mmap_offload": {"cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "layer_stream_fraction": 0.75}})
        result["spec_hybrid"] = run(sequential=True, speculative_config=spec, offload_backend="mmap", additional_config={
            "mmap_offload": {"cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "layer_stream_fraction": 0.75,
                             "hybrid": True, "host_threads": 1}})
    else:
        # cold: one slot buffer for two layers, so every layer is copied at every step;
        # warm: lookahead 1, both layers stay resident after the first pass
        result["cold"] = run(offload_backend="mmap", additional_config={"mmap_offload": {"cache_dir": cache, "lookahead": 0}})
        result["warm"] = run(offload_backend="mmap", additional_config={"mmap_offload": {"cache_dir": cache, "lookahead": 1}})
        # expert cache: 3 slots per layer for 4 experts (decode batch 1 routes 2: fetched, evicted),
        # prefill is expected to route more than 3 of 4 (layer_stream_fraction 0.75): whole layers
        # (sparse_max_ids 0: the threshold alone decides; by default calls of up to 512 ids are sparse)
        _, slot_gib = cache_layers_and_slot_gib()
        result["experts"] = run(sequential=True, offload_backend="mmap", additional_config={"mmap_offload": {
            "cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "layer_stream_fraction": 0.75,
            "sparse_max_ids": 0}})
        # 2 slots per layer, batch of 3: more routed experts than slots: only those rows of the
        # layer buffer are filled (hits from the pool, misses from the cache)
        result["sparse"] = run(offload_backend="mmap", additional_config={"mmap_offload": {
            "cache_dir": cache, "expert_cache_gib": 2 * slot_gib, "layer_stream_fraction": 1.0}})
        # the same pool, where layer_stream_fraction 0.5 (2 of 4 experts) would stream whole layers at
        # every decode step of the batch of 3: sparse_max_ids (its default, 512 ids) serves those calls
        # sparse on the stream
        result["sparse_ids"] = run(offload_backend="mmap", additional_config={"mmap_offload": {
            "cache_dir": cache, "expert_cache_gib": 2 * slot_gib, "layer_stream_fraction": 0.5}})
        # hybrid: decode misses split between host compute (torch on the mapped bf16 rows) and copies;
        # the end-of-step check in the last layer's route() (check_after_experts off; the TP=2 test
        # below runs hybrid with the default, the check in the last layer's patch 4b)
        result["hybrid"] = run(sequential=True, offload_backend="mmap", additional_config={"mmap_offload": {
            "cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "layer_stream_fraction": 0.75, "hybrid": True,
            "host_threads": 1, "check_after_experts": False}})
        # a routing trace that always routes experts 1 and 3: decode fetches those two per layer, once
        import numpy as np
        from mmap_offload.traces import write_csv
        trace = write_csv(np.array([[[[1, 3]]] * 2]), Path(cache).parent / "trace.csv", comment="experts 1, 3")
        # (sparse_max_ids 0: prefill's calls stream whole layers, so the pool's own misses count the fetches)
        result["trace"] = run(sequential=True, offload_backend="mmap", additional_config={"mmap_offload": {
            "cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "routing_trace": str(trace), "sparse_max_ids": 0}})
        # without --enforce-eager vLLM's CPU backend compiles the MoE layer's Python (routing hook included)
        # into its graph: the expert cache served wrong tokens there (session 36); refused at start
        try:
            result["compiled"] = run(sequential=True, eager=False, offload_backend="mmap", additional_config={
                "mmap_offload": {"cache_dir": cache, "expert_cache_gib": 3 * slot_gib, "layer_stream_fraction": 0.75}})
        except Exception as e:  # noqa: BLE001 - the engine may wrap the error; keep its text
            result["compiled"] = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(result))
    '''
)


def _run_child(tmp: Path, mode: str, ckpt: Path, cache: Path) -> dict:
    script = tmp / "child.py"
    script.write_text(CHILD)
    out = tmp / f"{mode}.json"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    tests_dir = str(Path(__file__).resolve().parent)  # the child imports fakes.SafeOpenTap
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests_dir, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(ckpt), str(cache), str(out), json.dumps(PROMPTS), str(MAX_TOKENS)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode != 0:
        pytest.fail(f"vLLM child ({mode}) failed with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mmap_offload.synth import PRESETS, make_checkpoint

    tmp = tmp_path_factory.mktemp("vllm_e2e")
    ckpt = make_checkpoint(tmp / "ckpt", **PRESETS["tiny-mixtral"])
    cache = tmp / "cache"
    ref = _run_child(tmp, "ref", ckpt, cache)
    off = _run_child(tmp, "offload", ckpt, cache)
    return {"ckpt": ckpt, "cache": cache, **ref, **off}


def _expert_bytes(ckpt: Path) -> int:
    from mmap_offload.checkpoint import open_checkpoint

    with open_checkpoint(ckpt) as c:
        return sum(
            r.nbytes for l in c.moe.layers for e in range(c.moe.num_experts)
            for parts in c.expert_refs(l, e).values() for r in parts.values()
        )


def test_reference_runs_without_offload(runs):
    assert runs["ref"]["offloader"] == "NoopOffloader"
    assert runs["ref"]["loader_expert_bytes"] == _expert_bytes(runs["ckpt"])


def test_cold_cache_same_tokens_and_built_while_loading(runs):
    cold = runs["cold"]
    assert cold["offloader"] == "MmapOffloader"
    assert cold["tokens"] == runs["ref"]["tokens"]
    # vLLM's loader read no expert tensor; our warm-up read each expert byte exactly once
    assert cold["loader_expert_bytes"] == 0 and cold["loader_expert_tensors"] == 0
    assert cold["warmup_bytes"] == _expert_bytes(runs["ckpt"])
    assert (runs["cache"] / "rank-0-of-1" / "manifest.json").exists()
    s = cold["summary"]  # lookahead 0 with 2 layers: each layer streamed at every forward
    assert s["prefetch_loads"] >= 2 * MAX_TOKENS
    # vLLM's CPU MoE kernel prepacks weights: the offloader applies the same transform after each copy
    assert cold["transforms"] == ["w13_weight", "w2_weight"]


def test_warm_cache_same_tokens_and_reads_no_expert_bytes(runs):
    warm = runs["warm"]
    assert warm["tokens"] == runs["ref"]["tokens"]
    assert warm["loader_expert_bytes"] == 0 and warm["warmup_bytes"] == 0
    # the non-expert weights are still loaded by vLLM
    assert 0 < warm["loader_bytes"] == runs["ref"]["loader_bytes"] - _expert_bytes(runs["ckpt"])
    s = warm["summary"]
    assert s["skipped_bytes"] == _expert_bytes(runs["ckpt"])
    assert s["prefetch_loads"] >= 1 and s["prefetch_bytes_moved"] > 0


def test_expert_cache_routes_through_the_pool_with_the_same_tokens(runs):
    """Residency (patch 4): decode steps fetch only routed experts into 3 slots per layer (4
    experts: misses and evictions), prefill streams whole layers; tokens equal no offload."""
    ex = runs["experts"]
    assert ex["tokens"] == runs["ref_seq"]["tokens"]
    s = ex["summary"]
    assert s["residency_pool_slots_per_layer"] == 3
    assert s["residency_expert_calls"] >= 2 * (MAX_TOKENS - 1)  # every decode step of both layers
    assert s["residency_layer_calls"] >= 2 * len(PROMPTS)  # prefill: whole layers
    assert s["residency_pool_misses"] > 0 and s["residency_pool_evictions"] > 0 and s["residency_pool_hits"] > 0
    assert ex["loader_expert_bytes"] == 0 and ex["warmup_bytes"] == 0
    # the misses took the stream-ordered path (on CPU waited for at once: the same bytes)
    assert s["residency_pool_ordered_fills"] > 0 and s["engine_ordered_gates"] >= s["engine_ordered_batches"]
    # most decode calls were served whole natively: decided in a stream callback once every expert
    # of the layer is checked (async_step.py; on CPU each job runs before route() returns, and
    # vLLM-CPU's kernel-layout twins of its new slots are made after it), else by the native step
    # (expert_step.py), the first fetch of each expert by the Python path
    assert s["residency_async_calls"] > 0 and s["residency_async_kernel"] == "cpu stand-in", s
    assert s["residency_async_calls"] + s["residency_native_calls"] > s["residency_expert_calls"] // 2, s
    # vLLM's own host time between the MoE layers' route() calls and around them is timed too
    assert s["residency_between_s"] > 0 and s["residency_outside_s"] > 0
    # and the launching thread's CPU time over the same spans (at most the wall time), its switches
    assert 0 < s["residency_between_cpu_s"] <= s["residency_between_s"] * 1.05 + 1e-3
    assert 0 < s["residency_outside_cpu_s"] <= s["residency_outside_s"] * 1.05 + 1e-3
    assert s["residency_thread_nvcsw"] + s["residency_thread_nivcsw"] > 0


def test_expert_cache_fills_only_routed_rows_when_the_pool_is_too_small(runs):
    sp = runs["sparse"]
    assert sp["tokens"] == runs["ref"]["tokens"]
    s = sp["summary"]
    assert s["residency_pool_slots_per_layer"] == 2 and s["residency_layer_calls"] == 0
    assert s["residency_sparse_calls"] > 0 and s["residency_sparse_miss_bytes"] > 0
    # the routed experts of sparse calls found in the pool or not, whichever path served them
    assert s["residency_sparse_hits"] > 0 and s["residency_sparse_misses"] > 0, s
    # the pool learns from sparse steps (ExpertCache.admit: hot misses copied in from the rows),
    # and the tokens above say the slots it filled that way hold the right bytes
    assert s["residency_pool_admitted"] > 0, s
    # the rows' misses were stream-ordered: read by the async step's callbacks into its staging, or
    # by ordered batches of the engine (the native and Python sparse paths)
    assert s["residency_sparse_async_calls"] == s["residency_sparse_calls"] or s["engine_ordered_batches"] > 0, s
    # and sparse calls were served whole natively: decided in a stream callback once every expert
    # of the layer is checked (AsyncStep.run_sparse; on CPU run before route() returns), else by
    # the native step (expert_step.py); vLLM-CPU's kernel-layout twins made after either
    assert s["residency_sparse_async_calls"] > 0, s
    assert s["residency_sparse_async_calls"] + s["residency_native_sparse_calls"] >= s["residency_sparse_calls"] // 2, s
    assert s["residency_async_admitted"] > 0 or s["residency_pool_admitted"] > 0, s


def test_sparse_max_ids_serves_calls_the_layer_threshold_would_stream(runs):
    sp = runs["sparse_ids"]
    assert sp["tokens"] == runs["ref"]["tokens"]
    s = sp["summary"]
    # decode at batch 3 (6 ids, 3.5 distinct of 4 expected > 2): sparse on the stream, not whole layers
    assert s["residency_sparse_async_calls"] > 0 and s["residency_sparse_misses"] > 0, s
    assert s["residency_layer_calls"] < s["residency_sparse_async_calls"], s


def test_hybrid_computes_misses_on_the_host_with_the_same_tokens(runs):
    """Patches 4 + 4b: some decode misses run on the host (fp32 accumulation on the cache's bf16
    rows, rounded once), their pairs masked out of the kernel, rows added to its output. Tokens
    equal no offload up to a near-tie of its logprobs (tests/token_match.py): which misses go to the
    host follows measured times, so under load another split can flip a near-tie (session 6's CI run
    parted at the third token while other tests shared its 2 cores; alone, the same build matched)."""
    from token_match import assert_equal_up_to_a_near_tie

    hy = runs["hybrid"]
    assert_equal_up_to_a_near_tie(hy["tokens"], runs["ref_seq"]["tokens"], runs["ref_seq"]["top2_gap"])
    s = hy["summary"]
    assert s["residency_hybrid_calls"] > 0 and s["residency_host_host_experts"] > 0
    assert s["residency_host_copied_experts"] + s["residency_pool_misses"] > 0
    assert s["residency_late_checks"] == 0  # check_after_experts off here: the check in route()
    # whole layers (prefill) by 8 copy threads; decode's stream-ordered misses by 6 of their own, the
    # count the host's threads leave room for (options.layer_copy_threads, copy_threads; the ordered
    # part needs the native pool, which a CPU without AVX2 lacks)
    assert s["engine_threads"] == 8, s
    if "engine_ordered_threads" in s:
        assert s["engine_ordered_threads"] == 6, s


def test_the_default_pool_knows_what_one_request_of_max_model_len_needs(runs):
    """start_reserve_bytes on real vLLM: one request's KV cache as the attention layers' specs count it equals
    the toy's shapes (layers x 2 x block-rounded length x KV heads x head size x bf16), and vLLM-CPU's fixed
    KV space (VLLM_CPU_KVCACHE_SPACE=1) is what the pool leaves (on CUDA; the CPU has no pool)."""
    s = runs["cold"]["summary"]
    assert s["kv_one_request_bytes"] == runs["cold"]["kv_expect"] > 0
    assert s["kv_reserve_bytes"] == 1 << 30 and s["act_reserve_bytes"] > 0


def test_routing_trace_replaces_the_routers_choice(runs):
    s = runs["trace"]["summary"]
    assert s["residency_trace"] is True
    assert 0 < s["residency_trace_s"] <= s["residency_route_s"]  # the replay's own time, inside route()'s
    assert s["residency_pool_misses"] == 2 * 2  # experts 1 and 3, in each of the 2 layers, fetched once
    assert s["residency_pool_hits"] > 0 and s["residency_pool_evictions"] == 0


# Who refuses W4A16 on vLLM-CPU depends on the CPU: where vLLM-CPU 0.32 has an int4 MoE kernel for it, the
# plugin's probe refuses (vLLM's CPU layout is not the cache's Marlin layout); on x86-64 CPUs without the ISA
# that kernel wants, vLLM refuses first. A test may not depend on which CPU CI lands on: the refusal is
# asserted, not whose words it is in.
W4A16_REFUSALS = (
    "not the cache layout",  # mmap-offload's probe
    "No WNA16 MoE backend supports the deployment configuration",  # vLLM-CPU, before the plugin runs
)


def test_a_compiled_start_is_refused_not_served(runs):
    """vllm-cpu without --enforce-eager traces the MoE layer's Python into a compiled graph, where the
    expert cache's per-call routing cannot run (it served all-zero tokens there): refused at start with
    one line that names the fix; nothing served."""
    got = runs["compiled"]
    assert isinstance(got, str), f"served under torch.compile: {got}"
    assert "does not run under torch.compile" in got and "pass --enforce-eager" in got, got


def _assert_refused(outcome: str) -> None:
    assert outcome != "served", "W4A16 experts were served from a Marlin cache by a non-Marlin MoE backend"
    assert any(r in outcome for r in W4A16_REFUSALS), outcome
    if W4A16_REFUSALS[0] in outcome:
        assert "w13_weight_packed" in outcome, outcome  # the probe names the tensor that differs


def test_w4a16_with_a_non_marlin_moe_backend_is_refused(runs):
    """vLLM CPU holds W4A16 experts in its own layout, not Marlin: refused, never served (by the plugin's
    probe, or by vLLM itself first on CPUs without the ISA its int4 MoE kernel wants)."""
    _assert_refused(runs["w4a16"])


@pytest.mark.parametrize("outcome", [
    "ValueError: mmap-offload: layer 0 w13_weight_packed is [8, 32] in vLLM but [4, 64] in the cache: not the cache layout",
    "NotImplementedError: No WNA16 MoE backend supports the deployment configuration.",
])
def test_w4a16_refusal_check_accepts_either_refusal_and_rejects_serving(outcome):
    _assert_refused(outcome)
    with pytest.raises(AssertionError):
        _assert_refused("served")
    with pytest.raises(AssertionError):
        _assert_refused("RuntimeError: something else broke")


def test_launcher_serves_openai_api_from_the_warm_cache(runs, tmp_path):
    """`mmap-offload vllm serve` (API server + engine core + worker processes, the plugin loaded in
    each): the completion tokens equal the reference."""
    from serve_runner import serve_completions

    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    tokens, text = serve_completions(runs["ckpt"], ["--max-model-len", "128", "--max-num-seqs", "4",
                                                    "--mmap-cache-dir", str(runs["cache"]), "--mmap-lookahead", "0"],
                                     env, tmp_path / "serve.log", PROMPTS, MAX_TOKENS)
    assert tokens == runs["ref"]["tokens"]
    assert "mmap-offload: serving 2 MoE layers" in text and "warm-up" not in text  # warm: nothing rebuilt
    # the launcher's prefill steps: 8192 tokens, capped at every sequence at full length (4 x 128)
    assert "max_num_batched_tokens 512: a prompt of N tokens takes ceil(N / 512) such steps" in text
    assert "--max-num-batched-tokens 8192" not in text  # every prompt of max_model_len 128 fits one step
    assert "hybrid off (auto: not served on a CUDA device)" in text  # the launcher's hybrid "auto"


TP2_CHILD = textwrap.dedent(
    r'''
    import gc, json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.distributed import cleanup_dist_env_and_memory

    def _rank_summary(worker):
        """On each rank's worker: what its offloader's residency and host did (the parent cannot reach it)."""
        from vllm.model_executor.offloader import get_offloader
        s = get_offloader().summary()
        keys = ("residency_hybrid_calls", "residency_host_host_experts", "residency_host_threads", "residency_pool_misses",
                "residency_late_checks")
        return {k: int(s.get(k, 0) or 0) for k in keys}

    def run(ckpt, prompts, max_tokens, ranks=False, sequential=False, **kw):
        from token_match import top2_gaps
        llm = LLM(model=ckpt, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
                  max_num_seqs=4, tensor_parallel_size=2, seed=0, **kw)
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False, ignore_eos=True, logprobs=2)
        todo = [[p] for p in prompts] if sequential else [prompts]  # sequential: decode batch 1
        outs = [o for b in todo for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in b], sp, use_tqdm=False)]
        info = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "top2_gap": top2_gaps(outs)}
        if ranks:
            info["ranks"] = llm.collective_rpc(_rank_summary)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        return info

    if __name__ == "__main__":
        ckpt, cache, out, prompts, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
        sys.path.insert(0, sys.argv[6])  # tests/: token_match
        ref = run(ckpt, prompts, max_tokens)
        off = run(ckpt, prompts, max_tokens, offload_backend="mmap",
                  additional_config={"mmap_offload": {"cache_dir": cache, "lookahead": 0}})
        # the expert cache on each rank's shard: 3 of 4 experts per layer (tiny-mixtral, 2 layers)
        from mmap_offload.cache_reader import open_cache
        c = open_cache(cache, tp_rank=0, tp_size=2)
        gib = 3 * len(c.layers) * sum(s.nbytes for s in c.expert_specs) / 2**30
        c.close()
        experts = run(ckpt, prompts, max_tokens, offload_backend="mmap",
                      additional_config={"mmap_offload": {"cache_dir": cache, "expert_cache_gib": gib,
                                                         "layer_stream_fraction": 1.0}})
        # the user's set-up in small: TP=2 and hybrid, each rank computing some of its shard's misses on
        # the host (decode batch 1 routes 2 of 4 experts into 3 slots per layer; host_threads 1: one core
        # per rank here), against no offload at batch 1 (its logprobs' near-ties)
        ref_seq = run(ckpt, prompts, max_tokens, sequential=True)
        hybrid = run(ckpt, prompts, max_tokens, ranks=True, sequential=True, offload_backend="mmap",
                     additional_config={"mmap_offload": {"cache_dir": cache, "expert_cache_gib": gib,
                                                        "layer_stream_fraction": 0.75, "hybrid": True,
                                                        "host_threads": 1}})
        open(out, "w").write(json.dumps({"ref": ref, "mmap": off, "experts": experts, "ref_seq": ref_seq,
                                     "hybrid": hybrid}))
    '''
)


@pytest.fixture(scope="module")
def glm_runs(tmp_path_factory):
    from mmap_offload.synth import PRESETS, make_checkpoint

    tmp = tmp_path_factory.mktemp("vllm_e2e_glm")
    # with the multi-token-prediction layer GLM-4.5's checkpoints ship (layer 3 here, experts included)
    ckpt = make_checkpoint(tmp / "ckpt", **PRESETS["tiny-glm4-moe"], mtp_layers=1)
    cache = tmp / "cache"
    return {"ckpt": ckpt, "cache": cache, **_run_child(tmp, "glm", ckpt, cache)}


def test_glm4_moe_layers_after_a_dense_one_serve_the_same_tokens(glm_runs):
    """The user's model class (Glm4MoeForCausalLM: a dense first layer, then MoE layers whose router
    scores by sigmoid plus a correction bias, a shared expert beside the routed ones, and after the
    last layer the multi-token-prediction layer its checkpoints ship): the cache holds the served MoE
    layers only, under their own indices, and layer streaming (one buffer: every layer copied at every
    forward) gives no offload's tokens; vLLM's loader reads no served expert byte, and none of the
    multi-token-prediction layer, which it would read and drop (no speculative decoding here)."""
    from mmap_offload.checkpoint import open_checkpoint

    r = glm_runs
    with open_checkpoint(r["ckpt"]) as c:  # the multi-token-prediction layer (layer 3)
        mtp_names = [n for n in c.names() if n.startswith("model.layers.3.")]
        assert c.mtp_names() == mtp_names
        mtp = sum(c.ref(n).nbytes for n in mtp_names if ".experts." in n)
        mtp_all = sum(c.ref(n).nbytes for n in mtp_names)
    assert 0 < mtp < mtp_all
    assert r["ref"]["offloader"] == "NoopOffloader"
    assert r["ref"]["loader_expert_bytes"] == _expert_bytes(r["ckpt"]) + mtp
    assert r["cache_layers"] == [1, 2]  # not the dense layer 0, not the MTP layer 3
    cold = r["cold"]
    assert cold["offloader"] == "MmapOffloader"
    assert cold["tokens"] == r["ref"]["tokens"]
    # our warm-up read the served experts once; vLLM's loader read none of them, nor the MTP layer's
    # (without offload it reads them and drops them: skip_spec_layers)
    assert cold["loader_expert_bytes"] == 0 and cold["warmup_bytes"] == _expert_bytes(r["ckpt"])
    s = cold["summary"]
    assert s["skipped_bytes"] == _expert_bytes(r["ckpt"])
    assert s["skipped_mtp_tensors"] == len(mtp_names) and s["skipped_mtp_bytes"] == mtp_all
    assert s["prefetch_loads"] >= 2 * MAX_TOKENS  # 2 MoE layers, one buffer: both copied every forward
    # the dense layer's MLP and the shared experts were loaded by vLLM, not skipped
    assert 0 < cold["loader_bytes"] == r["ref"]["loader_bytes"] - _expert_bytes(r["ckpt"]) - mtp_all


def test_glm4_moe_expert_cache_and_hybrid_serve_the_same_tokens(glm_runs):
    """The same model through the expert pool (decode fetches only routed experts, sigmoid-routed
    ids remapped to slots) and with hybrid (misses computed on the host, added before vLLM adds the
    shared expert and applies its routed scaling): tokens equal no offload's (hybrid: up to a
    near-tie, tests/token_match.py)."""
    from token_match import assert_equal_up_to_a_near_tie

    r = glm_runs
    ex = r["experts"]
    assert ex["tokens"] == r["ref_seq"]["tokens"]
    s = ex["summary"]
    assert s["residency_pool_slots_per_layer"] == 3
    assert s["residency_expert_calls"] >= 2 * (MAX_TOKENS - 1)
    assert s["residency_pool_misses"] > 0 and s["residency_pool_evictions"] > 0 and s["residency_pool_hits"] > 0
    hy = r["hybrid"]
    assert_equal_up_to_a_near_tie(hy["tokens"], r["ref_seq"]["tokens"], r["ref_seq"]["top2_gap"])
    s = hy["summary"]
    assert s["residency_hybrid_calls"] > 0 and s["residency_host_host_experts"] > 0, s
    assert s["residency_late_checks"] > 0, s  # check_after_experts (the default): in patch 4b


def test_glm4_moe_speculative_decoding_with_its_mtp_layer_serves_the_same_tokens(glm_runs):
    """Speculative decoding with the checkpoint's multi-token-prediction layer (``method: mtp``, one draft
    token): vLLM loads that layer for its drafter (nothing of it skipped, its experts in memory: they are
    not served from the cache), and each decode step verifies two tokens per sequence through the expert
    pool, then with hybrid too; greedy tokens equal no offload's without speculation, up to a near-tie
    (verifying two tokens at once rounds differently; the reference has exact ties)."""
    from token_match import assert_equal_up_to_a_near_tie

    r = glm_runs
    for case in ("spec_pool", "spec_hybrid"):
        got = r[case]
        assert_equal_up_to_a_near_tie(got["tokens"], r["ref_seq"]["tokens"], r["ref_seq"]["top2_gap"])
        s = got["summary"]
        assert s["skipped_mtp_tensors"] == 0 and s["skipped_bytes"] == _expert_bytes(r["ckpt"]), s
        # decode steps of 2 tokens x top-2 routed ids against 3 slots: sparse calls (expert calls where they fit)
        assert s["residency_sparse_calls"] + s["residency_expert_calls"] > 0, s
    assert r["spec_hybrid"]["summary"]["residency_hybrid_calls"] > 0


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="binds one core per TP rank")
def test_tensor_parallel_2_each_rank_builds_and_serves_its_shard(tmp_path):
    """TP=2 (two CPU worker processes, one core each): each rank builds rank-r-of-2 while loading,
    and the tokens equal TP=2 without offload, with layer streaming and with the expert cache; with
    hybrid (the user's TP=2 set-up in small) each rank computes misses of its own shard on the host
    and the tokens equal no offload up to a near-tie (tests/token_match.py: the host rounds fp32 sums
    once, the kernel in its own order). The two-GPU run of the same is tests/test_vllm_gpu.py. ~4
    minutes on a 2-core machine."""
    from mmap_offload.synth import PRESETS, make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", **PRESETS["tiny-mixtral"])
    script, out, cache = tmp_path / "tp2.py", tmp_path / "tp2.json", tmp_path / "cache"
    script.write_text(TP2_CHILD)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of the child's own function (each rank's summary)
    proc = subprocess.run([sys.executable, str(script), str(ckpt), str(cache), str(out), json.dumps(PROMPTS), str(MAX_TOKENS),
                           str(Path(__file__).resolve().parent)], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"TP=2 child failed with {proc.returncode}:\n{proc.stderr[-8000:]}")
    res = json.loads(out.read_text())
    assert res["mmap"]["tokens"] == res["ref"]["tokens"]
    assert res["experts"]["tokens"] == res["ref"]["tokens"]  # routing-aware residency on each rank's shard
    from token_match import assert_equal_up_to_a_near_tie

    hy = res["hybrid"]
    assert_equal_up_to_a_near_tie(hy["tokens"], res["ref_seq"]["tokens"], res["ref_seq"]["top2_gap"])
    assert len(hy["ranks"]) == 2
    for r in hy["ranks"]:  # every rank: hybrid calls, experts of its shard computed on its host, 1 thread
        assert r["residency_hybrid_calls"] > 0 and r["residency_host_host_experts"] > 0, hy["ranks"]
        assert r["residency_host_threads"] == 1, hy["ranks"]
        # the default check_after_experts: every step's end-of-step check in the last layer's patch 4b
        assert r["residency_late_checks"] > 0, hy["ranks"]
    assert sorted(p.name for p in cache.iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
    for r in range(2):
        assert (cache / f"rank-{r}-of-2" / "manifest.json").exists()
