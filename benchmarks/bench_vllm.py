"""Real vLLM: ``--offload-backend mmap`` against vLLM's own ``uva`` at equal VRAM for expert weights.

    . .vdev/env.sh; python3 benchmarks/bench_vllm.py --out OUT            # GPU machine, ~5-6 min
    python benchmarks/bench_vllm.py --out /tmp/b --device cpu --tiny       # vLLM's CPU build, bf16 toy

A synthetic compressed-tensors W4A16 Mixtral-style checkpoint (``synth.make_checkpoint``) at the
user's per-rank expert shapes (H 5120, I 768 = 1536 / TP 2, 160 experts, top-8; ``--layers`` of
them, 8 by default) is served by real vLLM (engine in-process, ``enforce_eager``, token-id prompts,
TRITON_ATTN), one configuration per child process (``vllm_runner.run_child``: vLLM does not free
a model cleanly):

    config      what holds the experts                                    VRAM for expert weights
    uva         vLLM ``cpu_offload_params={"experts"}``, ``offload_backend="uva"``,  B (the layers it
                ``cpu_offload_gb`` = (expert bytes - B) / GiB: the first layers'      did not offload)
                expert parameters pinned and read in place over PCIe by Marlin
    mmap-layer  ``offload_backend="mmap"``, ``expert_cache_gib=0``: whole layers     2 layer buffers
                streamed from the cache into 2 slot buffers (lookahead 1)
    mmap-cache  ``offload_backend="mmap"``, ``expert_cache_gib`` = B: routed experts  B + 2 layer buffers
                made resident in per-layer VRAM pools, whole layers above the
                backend's threshold (prefill, large batches)
    noff        no offload: every expert in VRAM (the roofline)                 all
    mmap-cache-wait (``--configs``) mmap-cache with ``stream_ordered=False``: the      B + 2 layer buffers
                launching thread waits for the misses' reads (the path before session 7)
    mmap-cache-py (``--configs``) mmap-cache with ``native_step=False``: expert mode  B + 2 layer buffers
                in Python (the path before session 8; mmap_offload/expert_step.py)
    mmap-cache-sync (``--configs``) mmap-cache with ``async_step=False``: the native   B + 2 layer buffers
                step waits for each layer's ids (the path before session 9; async_step.py)
    mmap-all    (``--configs``) mmap-cache whose pool holds every expert: the     all + 2 layer buffers
                residency step's own price at 100% hits (against noff); a diagnostic
    uva-eqtotal (``--configs``) uva given B + the mmap layer buffers             B + 2 layer buffers

B = ``--budget-frac`` x expert bytes (0.25), the same for uva and the expert pool ("give uva the
bytes of our pool", issue 12); the layer buffers are mmap's fixed extra and are reported.

Routing: ``uniform`` is the random model's own router (near uniform over experts; not a real
model's routing). ``skewed`` replaces every router's top-k ids by a synthetic trace's (CSV:
``step,layer,expert ids``; ``make_trace``: per-layer Zipf(``--zipf-s``) popularity over experts and
per-sequence reuse of the previous step's experts tuned to ``--reuse`` (0.4)): in the mmap-cache
configuration through the backend's own ``routing_trace`` option, elsewhere through
``vllm_runner.TraceRouting`` (the same rows: step and layer position modulo the trace, its batch
rows tiled over the step's tokens). Rows with a trace are labelled ``skewed``; their tokens are not
the model's. ``uniform-trace`` (``--routings``, not in the default) does the same with a trace of
independent uniform picks (``traces.uniform_trace``): the random router's decode tokens route alike from
step to step (session 22: its pool hit 58% of distinct experts where independent picks allow ~38%), so
this is the uniform routing issue 15's bar names. Prefill is measured with the model's own routing only
(``--prefill-skewed`` adds it, with each trace).

Workloads: decode at batch 1, 8, 64 (16-token prompts; tokens/s = batch x T / (time of T+1 tokens -
time of 1 token)) and prefill of one 2048-token prompt (1 output token, median of 3).

Also reported: how many times vLLM's Marlin MoE kernel reads each routed expert's weights under uva
at prefill (``marlin_model``: a model from the kernel's tiling, stated in its docstring, applied to
the routed-expert counts recorded in the uva child); peak pinned host memory, peak RSS, cgroup
memory.peak, VRAM for expert weights, time to ready; the bars of issue 12.

Writes ``bench_vllm.json``, ``bench_vllm.md`` and ``bench_vllm.png`` into ``--out``. ``--deadline``
(s, from the start) bounds the whole run: a child is not started without ``--min-child-s`` left,
a running child skips tasks after it and is killed 30 s past it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import vllm_runner  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20

USER_SHAPES = dict(hidden=5120, intermediate=768, experts=160, top_k=8, num_heads=40, num_kv_heads=8)
TINY_SHAPES = dict(hidden=128, intermediate=256, experts=8, top_k=2, num_heads=4, num_kv_heads=2)
# bench_moe.py's default shapes (Qwen3-235B-class experts: 64 of 9.3 MiB in W4A16), where issue 15 sets its
# bars (decode >= 1.0x uva uniform, >= 1.5x skewed): the same bars in real vLLM with --shapes harness
HARNESS_SHAPES = dict(hidden=4096, intermediate=1536, experts=64, top_k=8, num_heads=32, num_kv_heads=8)
SHAPES = {"user": USER_SHAPES, "harness": HARNESS_SHAPES}
DECODE_BATCHES = (1, 8, 64)
CONFIGS = ("uva", "mmap-layer", "mmap-cache", "mmap-cache-wait", "mmap-cache-py", "mmap-cache-sync", "mmap-hybrid",
           "noff", "uva-eqtotal", "mmap-all")
POOL_CONFIGS = ("mmap-cache", "mmap-cache-wait", "mmap-cache-py", "mmap-cache-sync", "mmap-hybrid",
                "mmap-all")  # an expert pool; the trace via the backend
DEFAULT_CONFIGS = "uva,mmap-layer,mmap-cache,mmap-hybrid,noff"
BARS = {"decode_skewed": 0.8, "prefill": 1.0}
ROUTINGS = ("uniform", "uniform-trace", "skewed")  # the model's router, then the traces
GRAPHS_VARIANT = "llm.enforce_eager=false"  # `cfg:llm.enforce_eager=false`: vLLM's CUDA graphs (bars() reads it)
TRACE_ROUTINGS = ROUTINGS[1:]


# ----------------------------------------------------------------------------------------------
# traces
# ----------------------------------------------------------------------------------------------


def make_trace(path, *, steps: int, layers: int, num_experts: int, top_k: int, batch: int, zipf_s: float = 1.0,
               reuse: float = 0.4, seed: int = 0) -> dict:
    """Write a skewed routing trace (CSV, ``mmap_offload.traces.write_csv``) and return its stats.

    Per-layer Zipf(``zipf_s``) popularity over experts (``traces.skewed_trace``); its per-sequence
    stickiness is chosen from 0, 0.05, ..., 0.9 so that the share of a sequence's top-k that it
    also had at the previous step (``traces.reuse_fraction``, measured on a 32-step sample) is
    closest to ``reuse`` (real models: 0.34-0.45, DESIGN.md section 5; uniform over 160 experts,
    top-8: 0.05)."""
    from mmap_offload import traces

    best = None
    for i in range(19):
        p = round(0.05 * i, 2)
        sample = traces.skewed_trace(32, min(layers, 4), num_experts, top_k, batch=min(batch, 8), zipf_s=zipf_s,
                                     sticky_p=p, seed=seed + 1)
        err = abs(traces.reuse_fraction(sample) - reuse)
        if best is None or err < best[0]:
            best = (err, p)
    sticky = best[1]
    tr = traces.skewed_trace(steps, layers, num_experts, top_k, batch=batch, zipf_s=zipf_s, sticky_p=sticky,
                             seed=seed)
    stats = trace_summary(tr, num_experts, path, reuse_uniform=top_k / num_experts, zipf_s=zipf_s, sticky_p=sticky,
                          target_reuse=reuse, seed=seed)
    comment = (f"synthetic skewed routing trace (benchmarks/bench_vllm.py make_trace): steps {steps}, layers {layers}, "
               f"batch {batch}, {num_experts} experts, top-{top_k}, Zipf s={zipf_s}, sticky_p={sticky}\n"
               f"measured: reuse of the previous step's experts {stats['reuse']:.3f} (uniform {top_k / num_experts:.3f}), "
               f"top expert share {stats['top_expert_share']:.3f} (fair {1 / num_experts:.4f})\n"
               "rows: step,layer,expert ids (one row per sequence of the step's batch)")
    traces.write_csv(tr, path, comment=comment)
    return stats


def trace_summary(tr, num_experts: int, path, **extra) -> dict:
    """A trace's stats as the run records them: ``traces.trace_stats``, its step-to-step reuse, its
    shape and path, and ``extra``."""
    from mmap_offload import traces

    return {**traces.trace_stats(tr, num_experts), "reuse": traces.reuse_fraction(tr), **extra,
            "shape": list(tr.shape), "path": str(path)}


def make_uniform_trace(path, *, steps: int, layers: int, num_experts: int, top_k: int, batch: int,
                       seed: int = 0) -> dict:
    """Write a trace of independent uniform picks (``traces.uniform_trace``: no popularity, no reuse
    beyond chance) and return its stats, as ``make_trace`` does."""
    from mmap_offload import traces

    tr = traces.uniform_trace(steps, layers, num_experts, top_k, batch=batch, seed=seed)
    stats = trace_summary(tr, num_experts, path, reuse_uniform=top_k / num_experts, seed=seed)
    comment = (f"synthetic uniform routing trace (benchmarks/bench_vllm.py make_uniform_trace): steps {steps}, "
               f"layers {layers}, batch {batch}, {num_experts} experts, top-{top_k}, independent picks\n"
               f"measured: reuse of the previous step's experts {stats['reuse']:.3f} (chance {top_k / num_experts:.3f})\n"
               "rows: step,layer,expert ids (one row per sequence of the step's batch)")
    traces.write_csv(tr, path, comment=comment)
    return stats


def write_sample_traces(folder) -> list[Path]:
    """The small traces shipped in benchmarks/traces/ (regenerate with ``--write-traces``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, kw in (
        ("user-e160-top8-zipf1.0-reuse0.4.csv", dict(steps=32, layers=4, num_experts=160, top_k=8, batch=8)),
        ("tiny-e8-top2-zipf1.0-reuse0.4.csv", dict(steps=64, layers=2, num_experts=8, top_k=2, batch=8)),
    ):
        make_trace(folder / name, zipf_s=1.0, reuse=0.4, seed=0, **kw)
        out.append(folder / name)
    return out


# ----------------------------------------------------------------------------------------------
# the Marlin read model
# ----------------------------------------------------------------------------------------------


def marlin_block_size_m(m: int, top_k: int, num_experts: int) -> int:
    """vLLM's ``fused_marlin_moe`` (experts/marlin_moe.py, 0.26.0 and 0.32.0): the first of 8, 16,
    32, 48, 64 with ``M * topk / E / block_size_m < 0.9``, else 64 (16-bit activations)."""
    for bm in (8, 16, 32, 48, 64):
        if m * top_k / num_experts / bm < 0.9:
            return bm
    return 64


def marlin_model(counts, top_k: int, uva_fraction=None, expert_nbytes: int = 0) -> dict:
    """How many times vLLM's Marlin MoE kernel reads each routed expert's weights in one forward.

    The model (an inference from the source, not a measurement): ``moe_align_block_size`` sorts the
    step's (token, expert) pairs by expert and pads each expert's run to a multiple of
    ``block_size_m``; ``moe_wna16_marlin_gemm`` runs one M-block per ``block_size_m`` rows, and an
    M-block multiplies its rows by the expert's whole weight matrix, so each M-block reads all of
    that expert's w13 (and, in the second GEMM over the same blocks, w2). Reads of expert e =
    ceil(n_e / block_size_m), n_e = tokens routed to e. Under uva the weights are host memory read
    in place, so every read crosses PCIe unless L2 (50 MB on an H200; one expert here is ~6 MB)
    still holds it from an M-block of the same expert running at the same time: an upper bound.

    ``counts``: per MoE layer, tokens per expert of one forward; ``uva_fraction``: per layer, the
    share of its expert bytes that uva offloaded (1 = all). Returns the block size, reads per routed
    expert (mean), and PCIe bytes under uva against whole-layer streaming of the offloaded layers."""
    counts = [list(map(int, c)) for c in counts]
    if not counts:
        return {}
    E = len(counts[0])
    m = sum(counts[0]) // top_k
    bm = marlin_block_size_m(m, top_k, E)
    reads = routed = 0
    pcie = stream = 0.0
    for li, c in enumerate(counts):
        frac = 1.0 if uva_fraction is None else float(uva_fraction[li % len(uva_fraction)])
        r = sum(math.ceil(n / bm) for n in c if n > 0)
        reads += r
        routed += sum(1 for n in c if n > 0)
        pcie += frac * r * expert_nbytes
        stream += frac * E * expert_nbytes
    return {"tokens": m, "top_k": top_k, "experts": E, "block_size_m": bm,
            "reads_per_routed_expert": round(reads / max(routed, 1), 3),
            "routed_experts_per_layer": round(routed / len(counts), 1),
            "uva_pcie_bytes": int(pcie), "layer_stream_bytes": int(stream),
            "uva_over_stream": round(pcie / stream, 3) if stream else None}


def uva_fractions(offload_bytes: float, layer_bytes: int, n_layers: int) -> list[float]:
    """The share of each MoE layer's expert bytes that vLLM's UVAOffloader offloads: it walks the
    decoder layers in order and offloads parameters until ``cpu_offload_gb`` is reached."""
    out, left = [], float(offload_bytes)
    for _ in range(n_layers):
        take = min(max(left, 0.0), layer_bytes)
        out.append(round(take / layer_bytes, 4))
        left -= take
    return out


def expected_marlin_reads(m: int, top_k: int, num_experts: int) -> float:
    """ceil(n / block_size_m) expected over uniform routing, n ~ Binomial(m, top_k / E), given n > 0."""
    bm = marlin_block_size_m(m, top_k, num_experts)
    p = top_k / num_experts
    tot = pz = 0.0
    for n in range(0, m + 1):
        lp = math.lgamma(m + 1) - math.lgamma(n + 1) - math.lgamma(m - n + 1)
        lp += (n * math.log(p) if n else 0.0) + ((m - n) * math.log1p(-p) if m - n else 0.0)
        pr = math.exp(lp)
        if n == 0:
            pz = pr
        else:
            tot += pr * math.ceil(n / bm)
    return round(tot / max(1.0 - pz, 1e-12), 3)


# ----------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------


def workloads(args) -> list[str]:
    return [w for w in args.workloads.split(",") if w]


def decode_tasks(args, routing: str) -> list[dict]:
    out = []
    for w in workloads(args):
        if w.startswith("decode-"):
            b = int(w.split("-")[1])
            out.append({"kind": "decode", "name": f"{routing}/{w}", "batch": b, "tokens": args.decode_tokens,
                        "prompt_len": 16, "warmup_tokens": args.decode_warmup_tokens,
                        "repeats": args.decode_repeats})
    return out


def prefill_tasks(args, routing: str) -> list[dict]:
    if not any(w.startswith("prefill") for w in workloads(args)):
        return []
    return [{"kind": "prefill", "name": f"{routing}/prefill-{args.prefill_tokens // 1024}k" if args.prefill_tokens % 1024 == 0
             else f"{routing}/prefill-{args.prefill_tokens}", "tokens": args.prefill_tokens, "repeats": args.prefill_repeats}]


def child_specs(args, ckpt: Path, cache: Path, trace: Path | None, expert_bytes: int, layer_bytes: int,
                deadline_at: float, uniform_trace: Path | None = None) -> list[dict]:
    """One spec per child, in run order (the cold cache is built by the first mmap child). ``trace``:
    the skewed routing's CSV, ``uniform_trace`` the uniform-trace routing's (each used where its
    routing is asked for)."""
    cuda = args.device == "cuda"
    common = dict(model=str(ckpt), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
                  max_model_len=args.prefill_tokens + 256, enable_prefix_caching=False,
                  max_num_seqs=max(DECODE_BATCHES),
                  max_num_batched_tokens=args.max_batched_tokens or max(4096, args.prefill_tokens + 256))
    if cuda:
        common.update(attention_config={"backend": "TRITON_ATTN"}, gpu_memory_utilization=args.gpu_util,
                      kv_cache_memory_bytes=int(args.kv_cache_gib * GIB))
    budget = budget_bytes(args, expert_bytes)
    routings = args.routings
    traced = [(r, p) for r, p in (("skewed", trace), ("uniform-trace", uniform_trace)) if r in routings and p is not None]
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    base = {"num_experts": args.experts_n, "vocab_size": args.vocab, "deadline_at": deadline_at, "env": env}

    def own_routing_tasks(record: bool) -> list[dict]:
        t = []
        if "uniform" in routings:
            t += decode_tasks(args, "uniform") + prefill_tasks(args, "uniform")
            if record and prefill_tasks(args, "uniform"):
                t.append({"kind": "record", "name": "record/prefill", "tokens": args.prefill_tokens})
        for routing, path in traced:
            t.append({"kind": "trace", "name": "trace/on", "path": str(path)})
            t += decode_tasks(args, routing) + (prefill_tasks(args, routing) if args.prefill_skewed else [])
        return t

    mm = {"cache_dir": str(cache), "lookahead": 1, **mmap_options(args.mmap_option)}
    def config_specs(cfg: str, extra: dict) -> list[dict]:
        """The children of one configuration (a pool configuration: one per routing), ``extra`` options
        on top of the mmap ones."""
        out: list[dict] = []
        mm_cfg = {**mm, **extra}
        if cfg in ("uva", "uva-eqtotal"):
            resident = budget + (2 * layer_bytes if cfg == "uva-eqtotal" else 0)
            gb = max(0.0, (expert_bytes - resident) / GIB)
            out.append({**base, "label": cfg, "config": cfg, "register_backend": False, "tasks": own_routing_tasks(cfg == "uva"),
                       "llm": {**common, "cpu_offload_params": ["experts"], "offload_backend": "uva",
                               "cpu_offload_gb": round(gb, 6)}})
        elif cfg == "noff":
            out.append({**base, "label": cfg, "config": cfg, "register_backend": False, "tasks": own_routing_tasks(False),
                       "llm": dict(common)})
        elif cfg == "mmap-layer":
            out.append({**base, "label": cfg, "config": cfg, "register_backend": True, "tasks": own_routing_tasks(False),
                       "llm": {**common, "offload_backend": "mmap",
                               "additional_config": {"mmap_offload": {**mm_cfg, "expert_cache_gib": 0}}}})
        elif cfg in POOL_CONFIGS:
            pool = {**mm_cfg, "expert_cache_gib": round((expert_bytes if cfg == "mmap-all" else budget) / GIB, 9)}
            if cfg == "mmap-hybrid":  # the same pool; decode misses split between host compute and copies
                pool["hybrid"] = True
            if cfg == "mmap-cache-wait":  # the same pool; the launching thread waits for the misses' reads
                pool["stream_ordered"] = False
            if cfg == "mmap-cache-py":  # the same pool; expert mode in Python, not in one native call
                pool["native_step"] = False
            if cfg == "mmap-cache-sync":  # the same pool; the native step waits for each layer's ids
                pool["async_step"] = False
            for routing, path in traced:  # a trace goes through the backend's own option: one engine per routing
                out.append({**base, "label": f"{cfg}-{routing}", "config": cfg, "register_backend": True,
                           "tasks": decode_tasks(args, routing) + (prefill_tasks(args, routing) if args.prefill_skewed else []),
                           "llm": {**common, "offload_backend": "mmap",
                                   "additional_config": {"mmap_offload": {**pool, "routing_trace": str(path)}}}})
            if "uniform" in routings:
                out.append({**base, "label": cfg, "config": cfg, "register_backend": True,
                           "tasks": decode_tasks(args, "uniform") + prefill_tasks(args, "uniform"),
                           "llm": {**common, "offload_backend": "mmap",
                                   "additional_config": {"mmap_offload": pool}}})
        return out

    specs = []
    seen: dict[str, int] = {}
    for item in [c for c in args.configs.split(",") if c]:
        cfg, _, opt_text = item.partition(":")  # "mmap-hybrid:threads=6:host_threads=9": a variant with options
        if cfg not in CONFIGS:
            raise SystemExit(f"unknown config {cfg!r}: use some of {', '.join(CONFIGS)}")
        extra = mmap_options(opt_text.split(":")) if opt_text else {}
        # env.NAME=VALUE: an environment variable of the variant's children (e.g. env.MMO_PROFILE_DECODE=1);
        # llm.NAME=VALUE: an engine argument of theirs (e.g. llm.max_num_batched_tokens=2048: prefill in chunks)
        var_env = {k[4:]: str(v) for k, v in extra.items() if k.startswith("env.")}
        var_llm = {k[4:]: v for k, v in extra.items() if k.startswith("llm.")}
        extra = {k: v for k, v in extra.items() if not k.startswith(("env.", "llm."))}
        if extra and cfg not in POOL_CONFIGS + ("mmap-layer",):
            raise SystemExit(f"config {item!r}: only the mmap configurations take options (KEY=VALUE after ':')")
        seen[cfg] = seen.get(cfg, 0) + 1
        if extra or var_env or var_llm:  # a variant: its own row, labelled with its options, never the row the bars read
            n0 = len(specs)
            specs += config_specs(cfg, extra)
            for sp in specs[n0:]:
                sp.update(label=item + sp["label"][len(cfg):], repeat=seen[cfg], variant=opt_text,
                          env={**sp["env"], **var_env}, llm={**sp["llm"], **var_llm})
            continue
        if seen[cfg] > 1:  # a configuration named again runs again, later in the run (order effects)
            n0 = len(specs)
            specs += [{**sp, "label": f"{sp['label']}#{seen[cfg]}", "repeat": seen[cfg]}
                      for sp in specs if sp["config"] == cfg and "repeat" not in sp]
            if len(specs) > n0:
                continue
        specs += config_specs(cfg, {})
    return specs


def mmap_options(items) -> dict:
    """``--mmap-option KEY=VALUE`` pairs as backend options (VALUE parsed as JSON where it parses; True /
    False in any case as booleans)."""
    out = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--mmap-option {item!r}: write KEY=VALUE, e.g. threads=14")
        try:
            out[key] = json.loads(value)
        except ValueError:  # a word stays a string, but True / False mean the booleans (a string "False" is truthy)
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def budget_bytes(args, expert_bytes: int) -> int:
    if args.budget_gib is not None:
        return int(args.budget_gib * GIB)
    return int(args.budget_frac * expert_bytes)


# ----------------------------------------------------------------------------------------------
# results
# ----------------------------------------------------------------------------------------------


def _delta(a: dict | None, b: dict | None, key: str) -> float:
    if not a or not b:
        return 0.0
    try:
        return float(b.get(key, 0) or 0) - float(a.get(key, 0) or 0)
    except (TypeError, ValueError):
        return 0.0


MOVED_KEYS = ("engine_bytes_moved", "engine_ordered_bytes_filled")  # ordinary + stream-ordered batches


def rows_from_child(child: dict) -> list[dict]:
    """One row per timed task of one child (decode / prefill), with the backend's counters as
    deltas over the timed part (decode: the (T+1)-token run minus the 1-token run)."""
    rows = []
    for ev in child["tasks"]:
        kind, r = ev.get("kind"), ev.get("result", {})
        if kind not in ("decode", "prefill"):
            continue
        routing, _, workload = ev["name"].partition("/")
        row = {"config": child["config"], "routing": routing, "workload": workload}
        if child.get("repeat"):  # the n-th run of this configuration in this run, or a variant with options
            row.update(repeat=child["repeat"], label=child.get("label"))
        if child.get("variant"):
            row["variant"] = child["variant"]
        if "skipped" in r or "error" in r:
            row["status"] = r.get("skipped") or r.get("error", "")[:200]
            rows.append(row)
            continue
        row.update(tok_s=r["tok_s"], seconds=r["seconds"])
        if kind == "decode":
            steps = r["tokens"]
            row["step_ms"] = r["step_ms"]
            for k in ("thread_cpu_ms", "thread_nivcsw", "thread_nvcsw", "cpu_calib_us", "bg_check_wait_s",  # the launching thread per step
                      "repeats", "rep_tok_s", "rep_calib_us",  # each timed run, the row's the median
                      "layers_router_ms", "layers_gap_ms", "layers_outside_ms", "layers_per_step",  # and per layer
                      "layers_gpu_span_ms", "layers_cpu_span_ms", "stream_behind_frac",  # the stream's side
                      "sys_busy_cpus", "sys_steal_frac"):  # the whole machine
                if r.get(k) is not None:
                    row[k] = r[k]
            if r.get("host_profile"):  # MMO_SAMPLE_DECODE=1 (vllm_runner.HostSampler)
                row["host_profile"] = r["host_profile"]
            if r.get("device_profile"):  # MMO_PROFILE_DECODE=1 (vllm_runner.device_timeline)
                row["device_profile"] = r["device_profile"]
            s1, sT = r.get("summary_1") or [None, None], r.get("summary_T1") or [None, None]
            after = sT[1] or {}
            if (sT[0] or {}).get("check_bg_done") is False:  # the background checksum pass still ran (it takes
                row["bg_check_running"] = True  # the GIL for each expert's hash): this row's step is not clean

            def d(key):
                return _delta(*sT, key) - _delta(*s1, key)
        else:
            steps = 1
            row["step_ms"] = round(1000 * r["seconds"], 3)
            sp = r.get("summary") or [None, None]
            after = sp[1] or {}

            def d(key):
                return _delta(*sp, key)
        if child.get("has_summary"):
            moved = sum(d(k) for k in MOVED_KEYS)
            row["mmap_mib_per_step"] = round(moved / steps / MIB, 1)
            # routed experts found resident, over expert-mode and sparse calls alike
            hits = d("residency_pool_hits") + d("residency_sparse_hits")
            misses = d("residency_pool_misses") + d("residency_sparse_misses")
            if hits + misses > 0:
                row["pool_hit_rate"] = round(hits / (hits + misses), 3)
            # the residency's per-layer decisions (expert / sparse / layer / ...), whatever modes it has
            keys = [k for k in after if k.startswith("residency_") and k.endswith("_calls") and k != "residency_pool_calls"]
            calls = {k[len("residency_"):-len("_calls")]: d(k) for k in keys}
            if any(calls.values()):
                row["residency_calls"] = {k: int(v) for k, v in calls.items()}
            # where the residency step's host time goes, per forward step (ms): all of route(), the
            # wait for the router's ids (the one sync per layer), the pool's ensure (misses' copies
            # included) and its part blocked on copies
            # (stream-ordered misses: check = the end-of-step wait for their reads; gate wait = the
            # time the MoE stream stood at a gate whose reads were not done, the device's stall;
            # native step = expert mode's calls served by expert_step.py whole, ids to slot ids)
            for key, name in (("residency_route_s", "route_ms"), ("residency_sync_s", "sync_ms"),
                              ("residency_ensure_s", "ensure_ms"), ("residency_pool_stall_s", "stall_ms"),
                              ("residency_check_s", "check_ms"), ("engine_ordered_gate_wait_seconds", "gate_wait_ms"),
                              ("residency_ids_s", "ids_ms"), ("residency_map_s", "map_ms"),
                              ("residency_pool_submit_s", "submit_ms"),
                              ("engine_ordered_submit_seconds", "native_submit_ms"),
                              ("residency_native_s", "native_ms"), ("residency_between_s", "between_ms"),
                              ("residency_outside_s", "outside_ms"), ("residency_collect_s", "collect_ms"),
                              ("residency_between_cpu_s", "between_cpu_ms"), ("residency_outside_cpu_s", "outside_cpu_ms"),
                              ("residency_async_fill_s", "async_fill_ms"),
                              ("residency_async_callback_s", "async_cb_ms"),
                              ("residency_async_enqueue_s", "async_enqueue_ms"),
                              ("residency_async_host_s", "async_host_ms"),
                              ("residency_async_host_wait_s", "async_host_wait_ms"),
                              ("residency_trace_s", "trace_ms")):
                if key in after:
                    row[name] = round(1000 * d(key) / steps, 3)
            for key, name in (("residency_thread_nivcsw", "nivcsw_per_step"), ("residency_thread_nvcsw", "nvcsw_per_step")):
                if key in after:  # the launching thread's context switches: preempted / waited
                    row[name] = round(d(key) / steps, 2)
            if "residency_async_host_experts" in after:  # hybrid calls on the stream: experts computed on the host
                row["async_host_experts_per_step"] = round(d("residency_async_host_experts") / steps, 1)
                row["async_host_share"] = after.get("residency_async_host_share")
            if "residency_small_on_mib" in after:  # hybrid_small_calls=auto: its threshold, from the link timed at start
                row["small_on_mib"] = round(after["residency_small_on_mib"], 1)
                row["link_h2d_gbps"] = round(after.get("residency_link_h2d_gbps") or 0.0, 1)
            if "residency_small_miss_mib" in after:  # ... its average and where it stands
                row["small_miss_mib"] = round(after["residency_small_miss_mib"], 1)
                row["small_calls_hybrid"] = bool(after.get("residency_small_calls_hybrid"))
        rows.append(row)
    return rows


def config_summary(child: dict, spec: dict) -> dict:
    ready = child.get("ready") or {}
    info = ready.get("model_info") or {}
    done = next((e for e in reversed(child["events"]) if e.get("event") == "done"), None) or {}
    last_mem = {}
    for e in child["events"]:
        if e.get("mem"):
            for k, v in e["mem"].items():
                if k in ("VmHWM", "cuda_max_allocated", "torch_pinned_peak", "torch_pinned_active_peak"):
                    last_mem[k] = max(last_mem.get(k, 0), v)
                else:
                    last_mem[k] = v
    summary = done.get("summary") or ready.get("summary") or {}
    cfg = spec["config"]
    if cfg.startswith("mmap"):
        vram_experts = info.get("mmap_device_bytes")
    else:
        vram_experts = info.get("expert_bytes_device")
    pinned = int(last_mem.get("torch_pinned_peak", 0)) + int((summary or {}).get("engine_pinned_bytes", 0) or 0) + \
        int((summary or {}).get("residency_async_pinned_bytes", 0) or 0)  # the async step's staging and jobs
    out = {
        "label": child["label"], "config": cfg, "outcome": child["outcome"], "wall_s": child["wall_s"],
        "ready_s": ready.get("ready_s"), "process_ready_s": ready.get("t"),
        "moe_kernel": info.get("moe_experts_kernel") or info.get("moe_method"),
        "vram_expert_bytes": vram_experts, "uva_expert_bytes": info.get("expert_bytes_uva"),
        "uva_layers": info.get("uva_layers"),
        "pinned_bytes": pinned, "torch_pinned_peak": last_mem.get("torch_pinned_peak"),
        "engine_pinned_bytes": (summary or {}).get("engine_pinned_bytes"),
        "peak_rss_bytes": last_mem.get("VmHWM"), "cuda_max_allocated": last_mem.get("cuda_max_allocated"),
        "cgroup_peak_bytes": child["cgroup"].get("peak"), "cgroup_stat_max": child["cgroup"].get("stat_max"),
        "llm_kwargs": {k: v for k, v in spec["llm"].items() if k != "model"},
        "model_info": info, "summary": summary,
    }
    if child["outcome"] != "ok":
        out["log_tail"] = child.get("log_tail")
    return out


def ratios(rows: list[dict]) -> None:
    """``x_uva`` on every row: tokens/s over uva's for the same routing and workload (the mean of
    uva's runs where ``--configs`` names it more than once; each uva row's own ratio then shows how
    far the runs of one configuration drift within the run). uva's variants (``uva:llm.X=V``) are rows
    against it, not part of it (until session 40 they were averaged in: the x_uva fields of
    docs/bench/vllm-gpu-s38-run2.json and -s39-run1.json)."""
    got: dict[tuple, list[float]] = {}
    for r in rows:
        if r["config"] == "uva" and r.get("tok_s") and not r.get("variant"):
            got.setdefault((r["routing"], r["workload"]), []).append(r["tok_s"])
    ref = {k: sum(v) / len(v) for k, v in got.items()}
    for r in rows:
        u = ref.get((r["routing"], r["workload"]))
        if u and r.get("tok_s"):
            r["x_uva"] = round(r["tok_s"] / u, 3)


def _find(rows, config, routing, workload):
    return next((r for r in rows if r["config"] == config and r["routing"] == routing and r["workload"] == workload
                 and r.get("tok_s") and not r.get("variant")), None)


def _runs_ratio(rows, config, routing, workload, variant: str | None = None) -> tuple[float | None, list[float]]:
    """(the mean x uva over every run of ``config`` in this run, repeats included and variants not, or
    only those of ``variant``; each run's own ratio). A configuration named twice in ``--configs``
    (``uva,mmap-cache,uva,mmap-cache``) runs twice, so a bar reads the mean of its runs against the mean
    of uva's, not one child's luck: batch 1 drifts by up to ~25% from one child to the next on the H200
    (session 14: uva 79.5 and 63.0 tok/s)."""
    got = [r["x_uva"] for r in rows if r["config"] == config and r["routing"] == routing and r["workload"] == workload
           and r.get("x_uva") is not None and (r.get("variant") or "").lower() == (variant or "").lower()]
    return (round(sum(got) / len(got), 3) if got else None), got


def _bar(name: str, rows, config, routing, workload, need: float | None, variant: str | None = None) -> dict:
    """One bar (``need`` None: a row for information, met "info")."""
    v, runs = _runs_ratio(rows, config, routing, workload, variant)
    if need is None:
        out = {"bar": name, "value": v, "need": "-", "met": "info"}
    else:
        out = {"bar": name, "value": v, "need": f">= {need}", "met": None if v is None else v >= need}
    if len(runs) > 1:
        out["runs"] = runs
    return out


def hybrid_prefill_bar(rows: list[dict], prefill_name: str) -> dict:
    """Issue 15's prefill bar: mmap-hybrid at least the best copy variant of this run (mmap-layer,
    mmap-cache), each as the mean x uva of its runs; None where hybrid or neither copy variant ran."""
    hy, _ = _runs_ratio(rows, "mmap-hybrid", "uniform", prefill_name)
    best = max((v for v in (_runs_ratio(rows, c, "uniform", prefill_name)[0] for c in ("mmap-layer", "mmap-cache"))
                if v is not None), default=None)
    v = round(hy / best, 3) if hy is not None and best else None
    return {"bar": f"{prefill_name} uniform: mmap-hybrid / the best copy variant (issue 15)", "value": v,
            "need": f">= {BARS['prefill']}", "met": None if v is None else v >= BARS["prefill"]}


def bars(rows: list[dict], prefill_name: str) -> list[dict]:
    """The bars of issue 12, from this run's rows (None where a row is missing; the mean of a
    configuration's runs where it ran more than once)."""
    out = []
    for b in (1, 8):
        out.append(_bar(f"decode-{b} skewed: mmap-cache / uva", rows, "mmap-cache", "skewed", f"decode-{b}",
                        BARS["decode_skewed"]))
        ceiling = _bar(f"decode-{b} skewed: noff / uva (ceiling of this run, information)", rows, "noff", "skewed",
                       f"decode-{b}", None)
        if ceiling["value"] is not None:  # the ceiling of this run: every expert in VRAM, nothing moved
            out.append(ceiling)
    for cfg in ("mmap-cache", "mmap-layer"):
        out.append(_bar(f"{prefill_name} uniform: {cfg} / uva", rows, cfg, "uniform", prefill_name, BARS["prefill"]))
    out.append(hybrid_prefill_bar(rows, prefill_name))
    issue15 = [("uniform", 1.0), ("skewed", 1.5)]
    if any(r["routing"] == "uniform-trace" for r in rows):  # the uniform bar on independent picks too
        issue15.insert(1, ("uniform-trace", 1.0))
    for routing, need in issue15:  # issue 15's bars for host compute
        for b in (1, 8):
            out.append(_bar(f"decode-{b} {routing}: mmap-hybrid / uva (issue 15)", rows, "mmap-hybrid", routing,
                            f"decode-{b}", need))
            # served with vLLM's CUDA graphs (the MoE layers eager between piecewise graphs), where a run has it:
            # against uva (eager), the issue's bar, and against uva with its own graphs, for information
            g = _bar(f"decode-{b} {routing}: mmap-hybrid with CUDA graphs / uva (issue 15)", rows, "mmap-hybrid",
                     routing, f"decode-{b}", need, GRAPHS_VARIANT)
            if g["value"] is None:
                continue
            out.append(g)
            ug, _ = _runs_ratio(rows, "uva", routing, f"decode-{b}", GRAPHS_VARIANT)
            if ug:
                out.append({"bar": f"decode-{b} {routing}: mmap-hybrid with CUDA graphs / uva with CUDA graphs "
                                   "(information)", "value": round(g["value"] / ug, 3), "need": "-", "met": "info"})
    pairs = []
    for routing in ROUTINGS:
        for b in DECODE_BATCHES:
            c = _find(rows, "mmap-cache", routing, f"decode-{b}")
            lay = _find(rows, "mmap-layer", routing, f"decode-{b}")
            if c and lay:
                pairs.append((f"{routing} decode-{b}", round(c["tok_s"] / lay["tok_s"], 2)))
    if pairs:
        out.append({"bar": "decode: mmap-cache / mmap-layer (every routing and batch)",
                    "value": min(v for _, v in pairs), "detail": dict(pairs), "need": "> 1.0",
                    "met": all(v > 1.0 for _, v in pairs)})
    return out


def _g(n, unit=GIB, nd=2):
    return "" if n is None else f"{n / unit:.{nd}f}"


_BREAKDOWN = ("step_ms", "layers_router_ms", "layers_gap_ms", "layers_outside_ms", "route_ms", "trace_ms", "collect_ms", "check_ms",
              "cpu_calib_us", "layers_cpu_span_ms", "layers_gpu_span_ms", "stream_behind_frac")


def miss_dram_gbps(row: dict, expert_nbytes: int) -> float | None:
    """The host DRAM traffic of a pool row's misses per second, a model (GB/s): each copied byte crosses
    DRAM three times (the page cache read, the staging write, the device's read of the staging) and each
    byte the host kernel computes on once; an upper bound where the staging is still in the CPU caches
    when the device reads it. None without the row's copied bytes (uva, no offload)."""
    if row.get("mmap_mib_per_step") is None or not row.get("step_ms"):
        return None
    moved = 3 * row["mmap_mib_per_step"] * MIB + (row.get("async_host_experts_per_step") or 0) * expert_nbytes
    return round(moved / (row["step_ms"] / 1e3) / 1e9, 2)


def step_breakdown(rows: list[dict], expert_nbytes: int = 0) -> list[dict]:
    """Where the decode steps go, per (configuration and variant, routing, workload): the means over
    its children of the per-step columns in ``_BREAKDOWN`` and of ``miss_dram_gbps`` (the misses' DRAM
    traffic, a model; host rows count only with ``expert_nbytes``), and where a no-offload row of the same
    routing and workload exists, the split of the step's excess over it: ``ours_ms`` (our calls on the
    launching thread: ``route()`` less the routing trace's replay, which uva's runs pay in their
    router, and patch 4b, the end-of-step check in whichever it ran) and
    ``vllm_extra_ms`` (the rest: vLLM's own code and waits running longer than without offload)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("tok_s") is None or not str(r.get("workload", "")).startswith("decode"):
            continue
        name = r["config"] + (f":{r['variant']}" if r.get("variant") else "")
        groups.setdefault((name, r["routing"], r["workload"]), []).append(r)
    out = []
    for (name, routing, workload), rs in groups.items():
        b = {"config": name, "routing": routing, "workload": workload, "children": len(rs)}
        dram = [v for v in (miss_dram_gbps(r, expert_nbytes) for r in rs) if v is not None]
        if dram:
            b["miss_dram_gbps"] = round(sum(dram) / len(dram), 2)
        for k in _BREAKDOWN:
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                b[k] = round(sum(vals) / len(vals), 3)
        out.append(b)
    ref = {(b["routing"], b["workload"]): b for b in out if b["config"] == "noff"}
    for b in out:
        base = ref.get((b["routing"], b["workload"]))
        if base is None or b is base or "route_ms" not in b:
            continue
        b["excess_ms"] = round(b["step_ms"] - base["step_ms"], 3)
        b["ours_ms"] = round(b["route_ms"] - b.get("trace_ms", 0.0) + b.get("collect_ms", 0.0), 3)
        b["vllm_extra_ms"] = round(b["excess_ms"] - b["ours_ms"], 3)
    return out


def markdown(res: dict) -> str:
    rows, cfgs = res["rows"], {c["config"] + ("/" + c["label"] if c["label"] != c["config"] else ""): c
                                for c in res["configs"]}
    by_cfg = {c["config"]: c for c in res["configs"] if c["label"] == c["config"]}
    for c in res["configs"]:
        by_cfg.setdefault(c["config"], c)
    L = [f"Shapes: {res['shapes_text']}; expert bytes {_g(res['expert_bytes'])} GiB; VRAM budget for expert weights "
         f"B = {_g(res['budget_bytes'])} GiB ({res['budget_frac_text']}); mmap layer buffers "
         f"{_g(res['layer_buffer_bytes'])} GiB on top. Routing `skewed` = trace {res.get('trace_text', '-')}"
         + (f"; `uniform-trace` = {res['uniform_trace_text']}" if res.get("uniform_trace_text") else "") + ".",
         "",
         "| config | routing | workload | tokens/s | x uva | step ms (launching thread's CPU ms, forced switches) [per step: in MoE routers, between them, outside them] | host ms/step: route / sync / ensure / stall | mmap MiB/step | pool hit | layer modes | pinned GiB | peak RSS GiB | cgroup peak GiB | VRAM experts GiB | ready s |",
         "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    order = {c: i for i, c in enumerate(CONFIGS)}
    wl = {w: i for i, w in enumerate(res["workloads"])}
    rt = {r: i for i, r in enumerate(ROUTINGS)}
    for r in sorted(rows, key=lambda r: (rt.get(r["routing"], 99), wl.get(r["workload"], 99), order.get(r["config"], 99),
                                         r.get("repeat", 1))):
        c = by_cfg.get(r["config"], {})
        if r["routing"] in TRACE_ROUTINGS and r["config"] in POOL_CONFIGS:
            c = cfgs.get(f"{r['config']}/{r['config']}-{r['routing']}", c)
        if r.get("repeat"):
            c = cfgs.get(f"{r['config']}/{r.get('label')}", c)
        name = (f"{r['config']}:{r['variant']}" if r.get("variant")
                else r["config"] + (f" #{r['repeat']}" if r.get("repeat") else ""))
        if "tok_s" not in r:
            L.append(f"| {name} | {r['routing']} | {r['workload']} | {r.get('status', '-')} | | | | | | | | | | | |")
            continue
        hit = f"{100 * r['pool_hit_rate']:.0f}%" if "pool_hit_rate" in r else ""
        modes = " ".join(f"{k} {v}" for k, v in r.get("residency_calls", {}).items() if v)
        host = " / ".join(f"{r[k]:.2f}" for k in ("route_ms", "sync_ms", "ensure_ms", "stall_ms") if k in r)
        if r.get("gate_wait_ms") is not None:  # stream-ordered misses
            host += f" (check {r.get('check_ms', 0):.2f}, gate wait {r['gate_wait_ms']:.2f})"
        if r.get("ids_ms") is not None:  # route's parts: ids to the host, the pool's submits, the slot map
            host += (f" [ids {r['ids_ms']:.2f}, submit {r.get('submit_ms', 0):.2f}"
                     f"{' (C %.2f)' % r['native_submit_ms'] if r.get('native_submit_ms') is not None else ''}, "
                     f"map {r.get('map_ms', 0):.2f}"
                     f"{', native step %.2f' % r['native_ms'] if r.get('native_ms') else ''}]")
        if r.get("async_cb_ms"):  # the async step's stream callbacks (CUDA's thread), and its waits for fills
            host += (f" <callbacks {r['async_cb_ms']:.2f}, fill waits {r.get('async_fill_ms', 0):.2f}"
                     + (f", enqueues {r['async_enqueue_ms']:.2f}" if r.get("async_enqueue_ms") is not None else "") + ">")
        if r.get("async_host_experts_per_step"):  # hybrid on the stream: host experts, its job time, the stream's wait
            host += (f" <host {r['async_host_experts_per_step']:.1f} experts, {r.get('async_host_ms', 0):.2f} ms, "
                     f"waited {r.get('async_host_wait_ms', 0):.2f}, share {r.get('async_host_share') or 0:.2f}>")
        if r.get("small_miss_mib") is not None:  # hybrid_small_calls=auto: misses per small call, the mode at the end
            host += (f" <small calls {r['small_miss_mib']:.1f} MiB missed each"
                     + (f" (hybrid from {r['small_on_mib']:.1f}: link {r.get('link_h2d_gbps', 0):.1f} GB/s)"
                        if r.get("small_on_mib") is not None else "")
                     + f", {'hybrid' if r.get('small_calls_hybrid') else 'expert step'}>")
        if r.get("between_ms") is not None:  # vLLM's own host time between MoE layers, and around them
            cpu = (lambda k: f" (cpu {r[k]:.2f})" if r.get(k) is not None else "")
            host += (f" {{between layers {r['between_ms']:.2f}{cpu('between_cpu_ms')}, "
                     f"outside {r.get('outside_ms', 0):.2f}{cpu('outside_cpu_ms')}"
                     + (f", of them patch 4b {r['collect_ms']:.2f}" if r.get("collect_ms") is not None else "")
                     + (f"; switches {r['nivcsw_per_step']:.1f} forced, {r.get('nvcsw_per_step', 0):.1f} waits"
                        if r.get("nivcsw_per_step") is not None else "") + "}")
        step = f"{r['step_ms']:.2f}"
        if r.get("thread_cpu_ms") is not None:  # the launching thread's CPU time per step, its forced switches
            step += f" (thread cpu {r['thread_cpu_ms']:.2f}, {r.get('thread_nivcsw', 0):.1f} forced)"
        if r.get("cpu_calib_us") is not None:  # this child's single-thread speed, idle (vllm_runner.cpu_calibration)
            step += f" {{calib {r['cpu_calib_us']:.2f} us}}"
        if len(r.get("rep_tok_s") or ()) > 1:  # every timed run's tokens/s and calibration; the row is the median
            step += " {runs " + ", ".join(f"{v:.1f}@{c:.1f}" for v, c in zip(r["rep_tok_s"], r.get("rep_calib_us") or ())) + "}"
        if r.get("bg_check_running"):
            step += " (background check running)"
        if r.get("sys_busy_cpus") is not None:  # the machine's CPUs busy meanwhile, the hypervisor's share of them
            step += f" (machine: {r['sys_busy_cpus']:.1f} CPUs busy, steal {100 * r.get('sys_steal_frac', 0):.1f}%)"
        if r.get("layers_gap_ms") is not None:  # the same clock in every configuration (vllm_runner.TraceRouting)
            step += (f" [routers {r['layers_router_ms']:.2f}, between them {r['layers_gap_ms']:.2f}, "
                     f"outside {r['layers_outside_ms']:.2f}]")
        if r.get("layers_gpu_span_ms") is not None:  # first to last router: the stream's span and the thread's
            step += (f" <span stream {r['layers_gpu_span_ms']:.2f} / thread {r['layers_cpu_span_ms']:.2f}, "
                     f"stream behind {100 * r.get('stream_behind_frac', 0):.0f}%>")
        L.append(f"| {name} | {r['routing']} | {r['workload']} | {r['tok_s']:.1f} | {r.get('x_uva', '')} | "
                 f"{step} | {host} | {r.get('mmap_mib_per_step', '')} | {hit} | {modes} | {_g(c.get('pinned_bytes'))} | "
                 f"{_g(c.get('peak_rss_bytes'))} | {_g(c.get('cgroup_peak_bytes'))} | {_g(c.get('vram_expert_bytes'))} | "
                 f"{c.get('ready_s', '')} |")
    L += ["", "| bar (issue 12) | this run | need | met |", "| --- | ---: | ---: | --- |"]
    for b in res["bars"]:
        met = {True: "yes", False: "**no**", None: "not measured", "info": "-"}[b["met"]]
        detail = ", ".join(f"{k} {v}" for k, v in b.get("detail", {}).items())
        if b.get("runs"):  # the mean of several runs: each one's ratio
            detail = "mean of runs " + " / ".join(str(v) for v in b["runs"])
        L.append(f"| {b['bar']} | {b['value'] if b['value'] is not None else '-'}{' (' + detail + ')' if detail else ''} | "
                 f"{b['need']} | {met} |")
    sb = [b for b in res.get("step_breakdown", []) if b.get("layers_gap_ms") is not None]
    if sb:  # the means over each configuration's children, and the excess over no offload split
        L += ["", "Where decode steps go (ms per step, the means over each configuration's children; excess over no "
              "offload of the same routing and workload = ours (`route()` + patch 4b) + vLLM's extra; the misses' DRAM "
              "traffic is a model: 3 x the bytes copied + the bytes the host computed on, per second, an upper bound):", "",
              "| config | routing | workload | children | step | in routers | between them | outside them | route() | "
              "patch 4b | calib us | excess | ours | vLLM's extra | first-to-last router: thread / stream | stream behind | "
              "misses' DRAM GB/s |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for b in sb:
            f = (lambda k: f"{b[k]:.2f}" if b.get(k) is not None else "")
            span = (f"{b['layers_cpu_span_ms']:.2f} / {b['layers_gpu_span_ms']:.2f}"
                    if b.get("layers_gpu_span_ms") is not None else "")
            behind = f"{100 * b['stream_behind_frac']:.0f}%" if b.get("stream_behind_frac") is not None else ""
            L.append(f"| {b['config']} | {b['routing']} | {b['workload']} | {b['children']} | {f('step_ms')} | "
                     f"{f('layers_router_ms')} | {f('layers_gap_ms')} | {f('layers_outside_ms')} | {f('route_ms')} | "
                     f"{f('collect_ms')} | {f('cpu_calib_us')} | {f('excess_ms')} | {f('ours_ms')} | {f('vllm_extra_ms')} | "
                     f"{span} | {behind} | {f('miss_dram_gbps')} |")
    mm = res.get("marlin_model") or {}
    if mm:
        L += ["", "Marlin reads under uva at prefill (a model from the kernel's tiling, not a measurement: "
              "reads of an expert = ceil(tokens routed to it / block_size_m); an upper bound, L2 may absorb "
              "concurrent re-reads):", ""]
        for k, v in mm.items():
            if isinstance(v, dict) and v:
                L.append(f"- {k}: {v.get('tokens')} tokens, top-{v.get('top_k')} of {v.get('experts')}, block_size_m "
                         f"{v.get('block_size_m')}: **{v.get('reads_per_routed_expert')} reads per routed expert**; "
                         f"uva moves {_g(v.get('uva_pcie_bytes'))} GiB over PCIe per prefill vs "
                         f"{_g(v.get('layer_stream_bytes'))} GiB to stream the same offloaded layers once "
                         + (f"({v['uva_over_stream']}x)" if v.get("uva_over_stream") is not None else "(no layer offloaded)"))
            elif k == "uniform_expectation":
                L.append(f"- expected under uniform routing (binomial): {v} reads per routed expert")
    profiled = [r for r in res["rows"] if r.get("host_profile")]
    if profiled:  # MMO_SAMPLE_DECODE=1: where the engine thread's time went (vllm_runner.HostSampler)
        L += ["", "Host profile of the timed decode (share of the step's time, time-weighted stack samples; lines that "
              "release the GIL are inflated by the sampler's own looks):", ""]
        for r in profiled:
            hp = r["host_profile"]
            # this package's functions below the forward wrapper and its lambdas (which contain everything)
            mine = [(k, v) for k, v in hp["inclusive"] if "mmap_offload/" in k
                    and not k.endswith((":forward", ":<lambda>"))][:6]
            top = [(k, v) for k, v in hp["self"]][:6]
            ours = ", ".join(f"`{k.rsplit('/', 1)[-1]}` {v:.0%}" for k, v in mine) or "-"
            L.append(f"- {r['config']} {r['routing']} {r['workload']} ({hp['samples']} samples): this package "
                     f"{ours}; on top: " + ", ".join(f"`{k.rsplit('/', 1)[-1]}` {v:.0%}" for k, v in top))
    timed = [r for r in res["rows"] if r.get("device_profile")]
    if timed:  # MMO_PROFILE_DECODE=1: the device's own timeline of a few profiled decode steps
        L += ["", "Device timeline of profiled decode steps (torch.profiler with CUDA activities; ms per step; the "
              "profiled wall is longer than the unprofiled step):", "",
              "| config | routing | workload | wall | device busy | device idle | top device ops (count, ms/step) | "
              "host blocking CUDA calls (count, ms/step) |", "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
        for r in timed:
            dp = r["device_profile"]
            if "error" in dp:
                L.append(f"| {r['config']} | {r['routing']} | {r['workload']} | {dp['error'][:80]} | | | | |")
                continue
            ops = "; ".join(f"{k[:40]} {c} {t}" for k, c, t in dp["device_ops"][:6])
            hc = "; ".join(f"{k} {c} {t}" for k, c, t in dp["host_cuda_calls"][:4])
            L.append(f"| {r['config']} | {r['routing']} | {r['workload']} | {dp['wall_ms_per_step']} | "
                     f"{dp['device_busy_ms_per_step']} | {dp['device_idle_ms_per_step']} | {ops} | {hc} |")
    L += ["", "| config | outcome | ready s | kernel | pinned GiB | peak RSS GiB | cgroup peak GiB | VRAM experts GiB | CUDA peak alloc GiB |",
          "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for c in res["configs"]:
        L.append(f"| {c['label']} | {c['outcome'][:80]} | {c.get('ready_s', '')} | {c.get('moe_kernel', '')} | "
                 f"{_g(c.get('pinned_bytes'))} | {_g(c.get('peak_rss_bytes'))} | {_g(c.get('cgroup_peak_bytes'))} | "
                 f"{_g(c.get('vram_expert_bytes'))} | {_g(c.get('cuda_max_allocated'))} |")
    return "\n".join(L) + "\n"


def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: {e}"
    routings = [r for r in ROUTINGS if any(x["routing"] == r for x in res["rows"])]
    if not routings:
        return "no plot: no rows"
    cfgs = [c for c in CONFIGS if any(x["config"] == c and "x_uva" in x for x in res["rows"])]
    fig, axes = plt.subplots(1, len(routings), figsize=(6 * len(routings), 4.2), squeeze=False)
    for ax, routing in zip(axes[0], routings):
        wls = [w for w in res["workloads"] if any(x["routing"] == routing and x["workload"] == w for x in res["rows"])]
        width = 0.8 / max(len(cfgs), 1)
        for i, c in enumerate(cfgs):
            # the mean of the configuration's runs, as the bars read it
            ys = [_runs_ratio(res["rows"], c, routing, w)[0] or float("nan") for w in wls]
            xs = [j + i * width for j in range(len(wls))]
            ax.bar(xs, ys, width, label=c)
            for x, y in zip(xs, ys):
                if y == y:  # not NaN
                    ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(BARS["decode_skewed"], color="r", lw=0.8, ls="--")
        ax.set_xticks([j + width * (len(cfgs) - 1) / 2 for j in range(len(wls))], wls)
        ax.set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter

        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.set_ylabel("tokens/s / uva's (mean of runs)")
        ax.set_title(f"{routing} routing" + (" (trace)" if routing in TRACE_ROUTINGS else " (model's router)"))
        ax.legend(fontsize=8)
    fig.suptitle(f"real vLLM {res['env'].get('vllm', '')}: {res['shapes_text']}, B = {_g(res['budget_bytes'])} GiB", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


def expert_sizes(ckpt: Path) -> tuple[int, int, int]:
    """(all routed expert bytes, one expert's bytes, number of MoE layers) of a checkpoint."""
    from mmap_offload.checkpoint import open_checkpoint

    with open_checkpoint(ckpt) as c:
        one = sum(r.nbytes for parts in c.expert_refs(c.moe.layers[0], 0).values() for r in parts.values())
        return one * c.moe.num_experts * len(c.moe.layers), one, len(c.moe.layers)


def synth(args, work: Path) -> Path:
    from mmap_offload.synth import GLM_DENSE_LAYERS, make_checkpoint

    # --layers counts MoE layers: glm4_moe's dense first layer comes on top
    layers = args.layers + (GLM_DENSE_LAYERS if args.arch == "glm4_moe" else 0)
    kw = dict(arch=args.arch, quant=args.quant, num_layers=layers, num_experts=args.experts_n, hidden=args.hidden,
              intermediate=args.intermediate, top_k=args.top_k, vocab_size=args.vocab, num_heads=args.num_heads,
              num_kv_heads=args.num_kv_heads, group_size=args.group_size, max_position_embeddings=max(4096, args.prefill_tokens + 512))
    ckpt = work / "ckpt"
    stamp = ckpt / ".bench_vllm.json"
    if stamp.exists() and json.loads(stamp.read_text()) == kw:
        return ckpt  # same shapes as a previous run in this workdir: reuse (and its cache)
    shutil.rmtree(work / "cache", ignore_errors=True)
    make_checkpoint(ckpt, **kw)
    stamp.write_text(json.dumps(kw))
    return ckpt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="bench_vllm.json / .md / .png go here (required to run)")
    p.add_argument("--workdir", default=None, help="checkpoint, cache, traces, child logs (default: a temp dir)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="toy shapes, bf16, 2 layers (vLLM's CPU build)")
    p.add_argument("--shapes", default="user", choices=sorted(SHAPES),
                   help="user: the user's per-rank experts (H 5120, I 768, 160, top-8); harness: bench_moe's "
                        "default (H 4096, I 1536, 64, top-8), where issue 15's bars are set")
    p.add_argument("--arch", default="mixtral", choices=("mixtral", "glm4_moe"),
                   help="the synthetic model's layout: mixtral (experts in every layer; the runs in the docs), or "
                        "glm4_moe (GLM-4.5's: a dense first layer, sigmoid routing with a correction bias, a shared "
                        "expert beside the routed ones, in every config alike)")
    p.add_argument("--layers", type=int, default=8, help="MoE layers")
    p.add_argument("--experts", dest="experts_n", type=int, default=None, help="routed experts per layer (160)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None, help="per-rank I (768 = 1536 / TP 2)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--quant", default=None, choices=("w4a16", "bf16"))
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--budget-frac", type=float, default=0.25, help="VRAM for expert weights B = this x expert bytes")
    p.add_argument("--budget-gib", type=float, default=None, help="B in GiB (overrides --budget-frac)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"some of {','.join(CONFIGS)}, run in this order; a name given again runs again in that place "
                        "(e.g. uva first and last: x uva is then against the mean of uva's runs); an mmap config "
                        "followed by ':KEY=VALUE' pairs runs as a variant with those backend options "
                        "(e.g. mmap-hybrid:threads=6:host_threads=9; env.NAME=VALUE sets a variable of its "
                        "children, e.g. any config:env.MMO_PROFILE_DECODE=1; llm.NAME=VALUE an engine argument of "
                        "theirs, e.g. uva:llm.max_num_batched_tokens=2048)")
    p.add_argument("--routings", default="uniform,skewed",
                   help=f"some of {','.join(ROUTINGS)}: the model's router, a trace of independent uniform picks, "
                        "the skewed trace")
    p.add_argument("--workloads", default="decode-1,decode-8,decode-64,prefill-2k")
    p.add_argument("--decode-tokens", type=int, default=96,
                   help="timed decode steps per batch size (32 until session 10: ~0.6 s at batch 1, where one "
                        "host hiccup moved a ratio by percents)")
    p.add_argument("--decode-repeats", type=int, default=3,
                   help="timed decode runs per batch size, the row from the median by time (1 until session 36: "
                        "one run read whatever speed the launching thread's vCPU had then, ~1.0-1.85x)")
    p.add_argument("--decode-warmup-tokens", type=int, default=32,
                   help="untimed decode steps first, per batch size: the pool fills and each expert's "
                        "first-use check is paid before timing (sessions 4-5 used 4, so their decode rows "
                        "include pool warm-up)")
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--prefill-repeats", type=int, default=3)
    p.add_argument("--max-batched-tokens", type=int, default=None,
                   help="vLLM's max_num_batched_tokens for every child (default: the prefill prompt in one step, "
                        "max(4096, --prefill-tokens + 256)); fewer: the prompt's prefill in chunks of this many tokens")
    p.add_argument("--prefill-skewed", action="store_true", help="also prefill with the trace's routing")
    p.add_argument("--trace", default="auto", help="'auto' (make_trace sized for this run) or a CSV path")
    p.add_argument("--zipf-s", type=float, default=1.0)
    p.add_argument("--reuse", type=float, default=0.4)
    p.add_argument("--gpu-util", type=float, default=0.5)
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="fixed KV cache (CUDA), the same for every config")
    p.add_argument("--deadline", type=float, default=420.0, help="seconds for the whole run, from the start")
    p.add_argument("--min-child-s", type=float, default=45.0, help="do not start a child with less time left")
    p.add_argument("--no-cgroup", action="store_true", help="do not put children in a memory cgroup")
    p.add_argument("--python", default=None, help="interpreter of the children (default: this one)")
    p.add_argument("--mmap-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an mmap_offload option for every mmap config (e.g. threads=14, verify_first_use=false); "
                        "repeat for several; values are JSON where they parse as JSON")
    p.add_argument("--write-traces", default=None, metavar="DIR", help="write the sample traces into DIR and exit")
    a = p.parse_args(argv)
    a.routings = tuple(r for r in a.routings.split(",") if r)  # parsed once: the names the run takes
    bad = [r for r in a.routings if r not in ROUTINGS]
    if bad:
        p.error(f"--routings: unknown {', '.join(bad)}; use some of {','.join(ROUTINGS)}")
    shp = TINY_SHAPES if a.tiny else SHAPES[a.shapes]
    a.experts_n = a.experts_n or shp["experts"]
    a.hidden = a.hidden or shp["hidden"]
    a.intermediate = a.intermediate or shp["intermediate"]
    a.top_k = a.top_k or shp["top_k"]
    a.num_heads, a.num_kv_heads = shp["num_heads"], shp["num_kv_heads"]
    a.quant = a.quant or ("bf16" if a.tiny else "w4a16")
    if a.tiny:
        a.layers = min(a.layers, 2)
        a.group_size = min(a.group_size, 64)
        a.vocab = min(a.vocab, 1000)
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.write_traces:
        for p in write_sample_traces(args.write_traces):
            print(p)
        return 0
    if not args.out:
        raise SystemExit("bench_vllm.py: --out DIR is required (where bench_vllm.json / .md / .png go)")
    t_start = time.time()
    deadline_at = t_start + args.deadline
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.workdir:
        work = Path(args.workdir)
    else:
        import tempfile

        work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    log = print
    t = time.perf_counter()
    ckpt = synth(args, work)
    expert_bytes, expert_nbytes, n_layers = expert_sizes(ckpt)
    layer_bytes = expert_nbytes * args.experts_n
    synth_s = time.perf_counter() - t
    log(f"checkpoint {ckpt}: {n_layers} layers x {args.experts_n} experts x {expert_nbytes / MIB:.2f} MiB = "
        f"{expert_bytes / GIB:.2f} GiB of experts ({synth_s:.1f} s)")
    trace, trace_stats = None, None
    # the traces' length: about the decode steps the run's decode tasks take, their warm-up included
    n_dec = sum(1 for w in workloads(args) if w.startswith("decode-"))
    trace_steps = max(64, n_dec * (max(1, args.decode_repeats) * (args.decode_tokens + 3) + 8) + 32)
    if "skewed" in args.routings:
        if args.trace == "auto":
            trace = work / "trace.csv"
            trace_stats = make_trace(trace, steps=trace_steps, layers=n_layers, num_experts=args.experts_n, top_k=args.top_k,
                                     batch=max(DECODE_BATCHES), zipf_s=args.zipf_s, reuse=args.reuse, seed=0)
        else:
            from mmap_offload import traces

            trace = Path(args.trace)
            trace_stats = trace_summary(traces.read_csv(trace), args.experts_n, trace)
        log(f"trace {trace}: {json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in trace_stats.items()})}")
        big = max((int(w.split("-")[1]) for w in workloads(args) if w.startswith("decode-")), default=1)
        if trace_stats["shape"][2] < big:
            log(f"WARNING: the trace has {trace_stats['shape'][2]} sequences per step, decode-{big} repeats them "
                "(fewer distinct experts than real sequences would route)")
    uniform_trace, uniform_stats = None, None
    if "uniform-trace" in args.routings:
        uniform_trace = work / "trace-uniform.csv"
        uniform_stats = make_uniform_trace(uniform_trace, steps=trace_steps,
                                           layers=n_layers, num_experts=args.experts_n, top_k=args.top_k,
                                           batch=max(DECODE_BATCHES), seed=0)
        log(f"uniform trace {uniform_trace}: reuse {uniform_stats['reuse']:.3f}, "
            f"{uniform_stats['distinct_per_call']:.1f} distinct experts per call")
    cache = work / "cache"
    specs = child_specs(args, ckpt, cache, trace, expert_bytes, layer_bytes, deadline_at - 15, uniform_trace)
    children, rows, cfgs = [], [], []
    for spec in specs:
        left = deadline_at - time.time()
        if left < args.min_child_s:
            log(f"== {spec['label']}: skipped ({left:.0f} s left < --min-child-s {args.min_child_s:.0f})")
            cfgs.append({"label": spec["label"], "config": spec["config"], "outcome": "skipped (deadline)"})
            continue
        log(f"== {spec['label']} ({left:.0f} s left)")
        try:
            child = vllm_runner.run_child(spec, workdir=work / "children", timeout=left + 30,
                                          cgroup=not args.no_cgroup, python=args.python, echo=log)
        except Exception as exc:  # the parent's side of one child (its files, its cgroup): the others' rows stay
            child = {"label": spec["label"], "outcome": f"failed (runner): {type(exc).__name__}: {exc}",
                     "returncode": None, "wall_s": 0.0, "events": [], "tasks": [], "ready": None, "cgroup": {}}
        child["config"] = spec["config"]
        child["repeat"] = spec.get("repeat")
        child["variant"] = spec.get("variant")
        child["has_summary"] = spec.get("register_backend", False)
        log(f"   {spec['label']}: {child['outcome']} in {child['wall_s']} s")
        if child["outcome"] != "ok":
            for line in child.get("log_tail", [])[-15:]:
                log("   | " + line)
        children.append((spec, child))
        rows += rows_from_child(child)
        cfgs.append(config_summary(child, spec))
    ratios(rows)
    prefill_name = next((w for w in workloads(args) if w.startswith("prefill")), "prefill-2k")
    # the Marlin read model: routed-expert counts recorded in the uva child at prefill
    mm = {}
    uva = next((c for s, c in children if s["config"] == "uva"), None)
    if uva is not None:
        rec = next((e["result"] for e in uva["tasks"] if e.get("kind") == "record" and "counts" in e.get("result", {})), None)
        frac = ((uva.get("ready") or {}).get("model_info") or {}).get("uva_layers")
        if not frac or not any(frac):  # no uva flags seen (e.g. vLLM's CPU build): vLLM's plan from the bytes
            spec = next(s for s, c in children if s["config"] == "uva")
            frac = uva_fractions(min(expert_bytes, spec["llm"]["cpu_offload_gb"] * GIB), layer_bytes, n_layers)
        if rec:
            mm["uva_prefill_model_routing"] = marlin_model(rec["counts"], args.top_k, frac, expert_nbytes)
            mm["uva_prefill_model_routing"]["uva_layer_fractions"] = frac
    mm["uniform_expectation"] = expected_marlin_reads(args.prefill_tokens, args.top_k, args.experts_n)
    env = {}
    for s, c in children:
        imp = next((e for e in c["events"] if e.get("event") == "imported"), None)
        if imp:
            env = {k: imp.get(k) for k in ("vllm", "torch", "gpu")}
            break
    res = {
        "command": "python3 benchmarks/bench_vllm.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "env": env, "device": args.device,
        "shapes": {"layers": n_layers, "experts": args.experts_n, "hidden": args.hidden, "intermediate": args.intermediate,
                   "top_k": args.top_k, "quant": args.quant, "group_size": args.group_size, "arch": args.arch},
        "shapes_text": f"{args.quant.upper()} {n_layers} layers x {args.experts_n} experts, H {args.hidden}, I {args.intermediate}, top-{args.top_k}"
                       + (f" ({args.arch}: a dense first layer, a shared expert)" if args.arch != "mixtral" else ""),
        "expert_bytes": expert_bytes, "expert_nbytes": expert_nbytes, "layer_bytes": layer_bytes,
        "budget_bytes": budget_bytes(args, expert_bytes),
        "budget_frac_text": f"{budget_bytes(args, expert_bytes) / expert_bytes:.2f} x expert bytes",
        "layer_buffer_bytes": 2 * layer_bytes,
        "trace": trace_stats,
        "uniform_trace": uniform_stats,
        "uniform_trace_text": (f"independent uniform picks, reuse {uniform_stats['reuse']:.2f} of the previous step's "
                               "experts (chance)" if uniform_stats else None),
        "trace_text": (f"{'Zipf s=' + str(trace_stats['zipf_s']) if 'zipf_s' in trace_stats else Path(trace_stats['path']).name}, reuse {trace_stats['reuse']:.2f} of the previous step's experts"
                       if trace_stats else None),
        "workloads": workloads(args), "decode_tokens": args.decode_tokens,
        "rows": rows, "bars": bars(rows, prefill_name), "step_breakdown": step_breakdown(rows, expert_nbytes), "marlin_model": mm,
        "configs": cfgs,
        "synth_s": round(synth_s, 1), "wall_s": round(time.time() - t_start, 1), "deadline_s": args.deadline,
    }
    (out / "bench_vllm.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (out / "bench_vllm.md").write_text(md)
    why = plot(res, out / "bench_vllm.png")
    if why:
        log(why)
    print(md)
    log(f"wrote {out}/bench_vllm.json, .md{'' if why else ', .png'} in {res['wall_s']} s")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(c["outcome"] == "ok" for _, c in children) and children else 1


if __name__ == "__main__":
    sys.exit(main())
