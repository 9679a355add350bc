"""One process, several vLLM engines in turn (engine in-process), for tests/test_vllm_gpu.py.

    python3 tests/vllm_gpu_child.py MODEL WORKDIR OUT.json

MODEL: bf16 | w4a16 (a Mixtral-style model) | glm-w4a16 (GLM-4.5's layout, the user's model class:
synth arch glm4_moe, a dense first layer, sigmoid routing with a correction bias, a shared expert, and
the multi-token-prediction layer GLM ships after its last layer, which vLLM's main model drops: the mmap
backend skips it unread; the same sizes otherwise). Cases, in this order (each a fresh ``LLM``, the same greedy prompts):
    ref          no offload (experts in VRAM)
    uva          vLLM's own --cpu-offload-params experts --offload-backend uva
    mmap_cold    --offload-backend mmap, cache built while loading (layer streaming)
    mmap_warm    the same, warm cache (layer streaming)
    mmap_experts warm cache, expert cache of 6 slots per layer for 8 experts (decode: routed
                 experts only; prefill: whole layers)
    mmap_hybrid  the same, decode misses split between host compute and copies (the Python path:
                 hybrid_stream off)
    mmap_auto    warm cache, the default expert cache size (from what vLLM leaves free)
    mmap_sparse  warm cache, 2 slots per layer: every call routes more ids than slots (sparse
                 calls decided on the stream, async_step.py)
    mmap_hybrid_sparse  mmap_sparse with hybrid: W4A16 sparse calls on the stream send part of
                 their misses to the host kernel (AsyncStep.run_hybrid), hybrid "auto" (must resolve
                 on); bf16 takes the Python path (hybrid on)
    mmap_hybrid_small   (W4A16 only) mmap_experts' pool with hybrid, hybrid_small_calls=auto at
                 hybrid_small_ms 0: decode calls that fit the pool switch to the hybrid form after
                 the first step's check
    mmap_host_only      (W4A16 only) hybrid_admit 0 and hybrid_small_calls on: the pool admits nothing from
                 decode calls, every routed expert but one per call without a hit computed on the host
    mmap_graphs  (W4A16 only, CUDA) mmap_experts' pool with hybrid "auto", started without enforce_eager and
                 capture sizes 1, 2, 4: torch.compile with piecewise CUDA graphs (vLLM's FULL_AND_PIECEWISE
                 made PIECEWISE), the MoE layers eager between them (graphs.py); decode batches of 2 replay
    mmap_not_eager, mmap_compiled   refused at start, the refusal's text kept: layer streaming without
                 enforce_eager (vLLM's default graphs); on CUDA full CUDA graphs (cudagraph_mode FULL) with the
                 expert cache, on vLLM-CPU torch.compile with graphs off
Per case: tokens, what vLLM's loader and our warm-up read (expert bytes), the offloader's summary
(pinned bytes, residency counters), the MoE kernel class, time to ready. OUT.json is rewritten after
every case ("complete": false until the last), so a child cut short still reports the cases it ran.
MMO_CHILD_HANG_S: a case (its load included) that runs longer dumps every thread's stack and ends the
child; the clock restarts at each case (tests/child_runner.py, which says why).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

PROMPTS = [[1, 5, 9, 200, 33], [7, 8, 9, 10, 11, 12, 13, 14]]
MAX_TOKENS = 16
SHAPES = dict(arch="mixtral", num_layers=4, num_experts=8, hidden=512, intermediate=1024, top_k=2,
              vocab_size=2048, num_heads=4, num_kv_heads=2, group_size=128)
# MODEL's prefix before "-" -> what it changes in SHAPES (no prefix: SHAPES as they are);
# GLM-4.5/4.6 checkpoints ship one MTP layer
SHAPES_OF = {"glm": {"arch": "glm4_moe", "mtp_layers": 1}}


def main() -> int:
    model, work, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    prefix, _, quant = model.rpartition("-")
    shapes = {**SHAPES, **SHAPES_OF[prefix]} if prefix else SHAPES
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # fakes.SafeOpenTap, child_runner
    from child_runner import CaseClock, save_results

    clock = CaseClock(work, float(os.environ.get("MMO_CHILD_HANG_S") or 0))
    clock.start("setup")  # imports, the checkpoint
    only = set(filter(None, os.environ.get("MMO_CHILD_CASES", "").split(",")))  # run just these (debugging)
    import torch
    import vllm.model_executor.model_loader.weight_utils as wu
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    import mmap_offload.checkpoint as mc
    from fakes import SafeOpenTap
    from mmap_offload.synth import make_checkpoint
    from mmap_offload.vllm_backend import register

    register()  # the entry point vLLM would call (the checkout is on PYTHONPATH, not pip-installed)
    ckpt = make_checkpoint(work / f"ckpt-{model}", quant=quant, **shapes)
    cache = work / f"cache-{model}"
    counts = {"loader_expert_bytes": 0, "warmup_bytes": 0}

    def count(name, t):
        if ".experts." in name:
            counts["loader_expert_bytes"] += t.numel() * t.element_size()

    real_open, real_read = wu.safe_open, mc.Checkpoint.read
    wu.safe_open = lambda *a, **k: SafeOpenTap(real_open(*a, **k), count)

    def counting_read(self, ref, out=None):
        counts["warmup_bytes"] += ref.nbytes
        return real_read(self, ref, out)

    mc.Checkpoint.read = counting_read
    expert_bytes = None
    common = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=256,
                  gpu_memory_utilization=0.3, seed=0, attention_config={"backend": "TRITON_ATTN"})
    results: dict = {"quant": quant, "model": model, "arch": shapes["arch"], "cases": {}, "complete": False}

    def run(case: str, **kw) -> dict:
        clock.start(case)
        for k in counts:
            counts[k] = 0
        from vllm.compilation.counter import compilation_counter

        graphs0 = compilation_counter.num_cudagraph_captured
        t0 = time.perf_counter()
        llm = LLM(model=str(ckpt), **{**common, **kw})
        res: dict = {"ready_s": round(time.perf_counter() - t0, 2),
                     "graphs_captured": compilation_counter.num_cudagraph_captured - graphs0}
        try:
            def kernel_info(model):
                for mod in model.modules():
                    qm = getattr(mod, "quant_method", None)
                    if qm is not None and any(n.startswith("w13_") for n, _ in mod.named_parameters(recurse=False)):
                        mk = getattr(qm, "moe_kernel", None)
                        fe = getattr(mk, "fused_experts", None) if mk is not None else None
                        return {"method": type(qm).__name__, "experts": type(fe).__name__ if fe is not None else None}
                return {}

            res["kernel"] = llm.apply_model(kernel_info)[0]
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2)
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], sp, use_tqdm=False)
            res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            # per position, how close the greedy choice was to a tie (the hybrid test allows a
            # different token only at a near-tie: tests/token_match.py)
            from token_match import top2_gaps

            res["top2_gap"] = top2_gaps(outs)
            if case == "mmap_graphs":  # a decode batch of 3 replays the size-4 graphs: one padding row per MoE call
                outs3 = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS + [[3, 17, 301, 42]]], sp,
                                     use_tqdm=False)
                res["padded_tokens"] = [list(o.outputs[0].token_ids) for o in outs3]
            res.update(counts)
            from vllm.model_executor.offloader import get_offloader

            off = get_offloader()
            res["offloader"] = type(off).__name__
            if hasattr(off, "summary"):
                # patch 6's target found in every MoE layer (what serving under CUDA graphs needs)
                res["runners_found"] = [getattr(t, "runner", None) is not None for t in getattr(off, "targets", [])]
                res["summary"] = off.summary()
                off.close()
            from vllm.model_executor.offloader import NoopOffloader, set_offloader

            set_offloader(NoopOffloader())  # vLLM keeps the offloader in a global: release it
            if hasattr(torch.cuda, "host_memory_stats"):
                st = torch.cuda.host_memory_stats()
                res["torch_host_pinned_peak"] = int(st.get("allocated_bytes.current", 0) or 0)
        finally:
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
            torch.cuda.empty_cache()
        return res

    from mmap_offload.checkpoint import open_checkpoint

    with open_checkpoint(ckpt) as c:
        expert_bytes = sum(r.nbytes for l in c.moe.layers for e in range(c.moe.num_experts)
                           for parts in c.expert_refs(l, e).values() for r in parts.values())
    results["expert_bytes"] = expert_bytes
    mm = {"cache_dir": str(cache), "lookahead": 1, "expert_cache_gib": 0}
    plan = [
        ("ref", {}),
        ("uva", dict(cpu_offload_gb=4, cpu_offload_params={"experts"}, offload_backend="uva")),
        ("mmap_cold", dict(offload_backend="mmap", additional_config={"mmap_offload": mm})),
        ("mmap_warm", dict(offload_backend="mmap", additional_config={"mmap_offload": mm})),
    ]
    for case, kw in plan:
        if only and case not in only:
            continue
        try:
            results["cases"][case] = run(case, **kw)
        except BaseException as e:  # noqa: BLE001 - record and go on: the test names the case
            results["cases"][case] = {"error": f"{type(e).__name__}: {e}"[:3000], "tb": traceback.format_exc()[-4000:]}
        print(case, json.dumps(results["cases"][case])[:800], flush=True)
        save_results(out, results)
    gib = no_cache = None
    try:  # 6 slots per layer: sized from the cache's own record size (mmap_cold built it)
        from mmap_offload.cache_reader import open_cache

        c = open_cache(cache, tp_rank=0, tp_size=1)
        gib = 6 * len(c.layers) * sum(s.nbytes for s in c.expert_specs) / 2**30
        c.close()
    except BaseException as e:  # noqa: BLE001 - each case below that runs records it
        no_cache = {"error": f"{type(e).__name__}: {e}"[:3000], "tb": traceback.format_exc()[-4000:]}
    g = gib or 0.0
    pool_cases = (("mmap_experts", {"expert_cache_gib": g, "sparse_max_ids": 0}),  # prefill: the threshold
                  # misses on the host too, the Python path (hybrid_stream would take these calls, whose ids
                  # fit the pool, on the async step without the host)
                  ("mmap_hybrid", {"expert_cache_gib": g, "hybrid": True, "hybrid_stream": False}),
                  ("mmap_auto", {"expert_cache_gib": None}),  # the default pool size
                  # 2 slots per layer, 4 ids per decode call: sparse calls, decided on the stream
                  ("mmap_sparse", {"expert_cache_gib": g / 3, "layer_stream_fraction": 1.0}),
                  # W4A16: hybrid "auto" (the launcher's default), which must resolve on here; bf16: on
                  ("mmap_hybrid_sparse", {"expert_cache_gib": g / 3, "layer_stream_fraction": 1.0,
                                          "hybrid": "auto" if quant == "w4a16" else True}))
    if quant == "w4a16":  # hybrid_small_calls=auto with a threshold of 0: from the first step's check on,
        # the decode calls that fit the 6-slot pool take the hybrid form on the stream (W4A16 only)
        pool_cases += (("mmap_hybrid_small", {"expert_cache_gib": g, "hybrid": True, "hybrid_small_ms": 0.0}),
                       # every decode call hybrid, the pool admitting nothing: experts on the host (session 37)
                       ("mmap_host_only", {"expert_cache_gib": g, "hybrid": True, "hybrid_admit": 0,
                                           "hybrid_small_calls": "on"}))
    cuda = torch.cuda.is_available()
    graphs = {"enforce_eager": False, "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}}
    if quant == "w4a16" and cuda:  # compiled, piecewise CUDA graphs between eager MoE layers (graphs.py)
        pool_cases += (("mmap_graphs", {"expert_cache_gib": g, "hybrid": "auto"}),)
    for case, extra in pool_cases:
        if only and case not in only:
            continue
        if no_cache is not None:
            results["cases"][case] = no_cache
        else:
            try:
                llm_kw = graphs if case == "mmap_graphs" else {}
                results["cases"][case] = run(case, offload_backend="mmap", additional_config={"mmap_offload": {**mm, **extra}},
                                             **llm_kw)
            except BaseException as e:  # noqa: BLE001
                results["cases"][case] = {"error": f"{type(e).__name__}: {e}"[:3000], "tb": traceback.format_exc()[-4000:]}
        print(case, json.dumps(results["cases"][case])[:800], flush=True)
        save_results(out, results)
    # last (a refused start may leave vLLM's state half made): started without enforce_eager, the backend
    # refuses layer streaming (whose waits are in the decoder's forward) and, on CUDA, full graphs (one step's
    # expert placement replayed), on vLLM-CPU torch.compile (graphs off; vllm-cpu compiled served all-zero
    # tokens, session 36): at start, one line each, serving nothing
    full = {"cudagraph_mode": "FULL"} if cuda else {"cudagraph_mode": "NONE"}
    refusals = (("mmap_not_eager", {"enforce_eager": False}, mm),
                ("mmap_compiled", {"enforce_eager": False, "compilation_config": full},
                 {**mm, "expert_cache_gib": g} if cuda else mm))
    for case, kw, opts in refusals:
        if only and case not in only:
            continue
        clock.start(case)
        try:
            llm = LLM(model=str(ckpt), **{**common, **kw, "offload_backend": "mmap",
                                          "additional_config": {"mmap_offload": opts}})
            results["cases"][case] = {"served": True}
            del llm
        except BaseException as e:  # noqa: BLE001 - the refusal, as vLLM passes it on
            results["cases"][case] = {"refused": f"{type(e).__name__}: {e}"[:3000]}
        finally:
            gc.collect()
            cleanup_dist_env_and_memory()
            torch.cuda.empty_cache()
        print(case, json.dumps(results["cases"][case])[:800], flush=True)
        save_results(out, results)
    results["complete"] = True
    save_results(out, results)
    clock.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
