"""Expert cache policies on routing traces, simulated on the CPU: hit rate and bytes per decode step.

    python benchmarks/bench_expert_cache.py --out bench-out/expert_cache.json       # ~2 min, 1 core
    python benchmarks/bench_expert_cache.py --quick                                 # seconds

It drives the real ``ExpertCache`` (mmap_offload/expert_cache.py) with a stand-in cache of tiny
records and an engine that only counts, so the numbers are the policy's, not a model of it. Bytes are
reported for the expert size of the chosen model class (``MODELS``: W4A16 Marlin bytes per expert per
rank). For each model class, trace (uniform; skewed = per-layer Zipf + sticky reuse, traces.py; drift = skewed
with a quarter of the layers re-ranking their experts every 50 steps, batch 1 only), batch
and capacity (fraction of all experts that fit in VRAM, per-layer pools) it prints:

    hit%          hits / routed experts (distinct per call)
    moved/step    bytes copied into VRAM per decode step (misses only, no hints)
    routed/step   bytes of the distinct routed experts per step: what UVA reads over PCIe per step
                  (its kernel touches only routed experts); moved/routed = 1 - hit rate
    vs layer-pf   moved / the bytes whole-layer prefetch moves per step (L x E experts)

Policies: ``lru``, ``lfu`` (no decay), ``lfu-decay`` (the default; half-life in decode steps), and
``belady`` (offline optimal with the future known: the ceiling for any online policy; simulated here,
not in the library). More tables: a sweep of the Zipf exponent and the half-life at one capacity;
per-layer pools against one shared pool; prefetch hints from a noisy next-layer predictor staying
within the 1.25x bytes bar.
The skew parameters are assumptions stated in traces.py; every number here comes from this script.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mmap_offload.cache_format import Extent, TensorSpec  # noqa: E402
from mmap_offload.expert_cache import ExpertCache  # noqa: E402
from mmap_offload.traces import skewed_trace, trace_stats, uniform_trace  # noqa: E402


def _w4a16_expert_bytes(hidden: int, inter: int, group: int = 128) -> int:
    """Marlin W4A16 bytes of one expert (w13 + w2 packed weights, bf16 group scales)."""
    w13 = hidden * 2 * inter // 2
    w2 = inter * hidden // 2
    scales = (hidden // group) * 2 * inter * 2 + (inter // group) * hidden * 2
    return w13 + w2 + scales


MODELS = {
    # name: layers, experts, top_k, bytes per expert (W4A16, TP=1), skew of its "skewed" trace.
    # mixtral: zipf_s / sticky_p chosen so the trace repeats the first choice between consecutive
    # tokens ~30% of the time against 12.5% by chance, the order the Mixtral paper reports for its
    # middle layers, with mild popularity skew (it found little specialisation). The fine-grained
    # models' values are assumptions (no published numbers); the sweep table shows their effect.
    "mixtral-8x7b": dict(layers=32, experts=8, top_k=2, expert_bytes=_w4a16_expert_bytes(4096, 14336),
                         zipf_s=0.5, sticky_p=0.2),
    "qwen3-30b-a3b": dict(layers=48, experts=128, top_k=8, expert_bytes=_w4a16_expert_bytes(2048, 768),
                          zipf_s=1.0, sticky_p=0.3),
    "deepseek-v2-lite": dict(layers=26, experts=64, top_k=6, expert_bytes=_w4a16_expert_bytes(2048, 1408),
                             zipf_s=1.0, sticky_p=0.3),
}


class _SimCache:
    """What ExpertCache reads of a cache_reader.Cache: layers, experts, specs, extents."""

    def __init__(self, layers: int, experts: int):
        self.layers = list(range(layers))
        self.num_experts = experts
        self.expert_specs = [TensorSpec("w", "uint8", (1,), 0, 1)]
        self.record_nbytes = 4096

    def expert_extent(self, layer: int, expert: int) -> Extent:
        return Extent(Path("/sim"), expert * 4096, 4096)


class _CountingEngine:
    """Counts submitted copies; moves nothing."""

    def __init__(self):
        self.copies = 0
        self.metrics = {}

    def submit(self, copies, after=None):
        self.copies += len(copies)
        return None

    def wait(self, ticket) -> None:
        pass


def run_policy(trace: np.ndarray, experts: int, slots: int, policy: str, half_life: float,
               hint_acc: float | None = None, seed: int = 0, shared: bool = False) -> dict:
    """Drive ExpertCache over ``trace`` with ``slots`` experts per layer (per-layer pools, or one
    shared pool of the same total). Returns its summary."""
    steps, layers = trace.shape[:2]
    ec = ExpertCache(_SimCache(layers, experts), _CountingEngine(), "cpu", capacity_experts=slots * layers,
                     policy=policy, half_life_steps=half_life, shared=shared, verify_first_use=False)
    rng = np.random.default_rng(seed)
    for t in range(steps):
        for li in range(layers):
            ec.ensure(li, trace[t, li])
            if hint_acc is not None and li + 1 < layers:
                nxt = np.unique(trace[t, li + 1])
                right = nxt[rng.random(nxt.size) < hint_acc]  # a predictor that finds hint_acc of them
                wrong = rng.integers(0, experts, nxt.size - right.size)  # and guesses the rest
                ec.prefetch_hint(li + 1, np.concatenate([right, wrong]))
    return ec.summary()


def run_belady(trace: np.ndarray, experts: int, slots: int) -> dict:
    """Offline optimal per-layer eviction (farthest next use), with all of a call's experts resident."""
    steps, layers = trace.shape[:2]
    hits = misses = 0
    for li in range(layers):
        sets = [np.unique(trace[t, li]).tolist() for t in range(steps)]
        nxt: list[dict[int, int]] = [dict() for _ in range(steps)]  # next use after step t
        upcoming: dict[int, int] = {}
        for t in range(steps - 1, -1, -1):
            nxt[t] = dict(upcoming)
            for e in sets[t]:
                upcoming[e] = t
        resident: set[int] = set()
        for t in range(steps):
            need = sets[t]
            for e in need:
                if e in resident:
                    hits += 1
                    continue
                misses += 1
                if len(resident) >= slots:
                    cand = [r for r in resident if r not in need]
                    victim = max(cand, key=lambda r: nxt[t].get(r, steps + 1))
                    resident.remove(victim)
                resident.add(e)
    return {"hits": hits, "misses": misses, "hit_rate": hits / max(hits + misses, 1)}


DRIFT_EVERY, DRIFT_FRAC = 50, 0.25  # "drift" trace: every 50 steps a quarter of the layers re-rank


def make_trace(kind: str, steps: int, m: dict, batch: int, zipf_s: float, sticky_p: float, seed: int):
    if kind == "uniform":
        return uniform_trace(steps, m["layers"], m["experts"], m["top_k"], batch=batch, seed=seed)
    drift = kind == "drift"
    return skewed_trace(steps, m["layers"], m["experts"], m["top_k"], batch=batch, zipf_s=zipf_s,
                        sticky_p=sticky_p, drift_every=DRIFT_EVERY if drift else 0, drift_frac=DRIFT_FRAC,
                        seed=seed)


def row_for(name: str, m: dict, trace_kind: str, batch: int, frac: float, policy: str, res: dict,
            distinct_per_step: float, steps: int) -> dict:
    eb = m["expert_bytes"]
    # the sim's experts are 1 byte each, so bytes_moved counts experts (belady: misses)
    moved_bytes = res.get("bytes_moved", res["misses"]) / steps * eb
    routed_bytes = distinct_per_step * eb
    layer_pf = m["layers"] * m["experts"] * eb
    return dict(model=name, trace=trace_kind, batch=batch, capacity_frac=frac, policy=policy,
                hit_rate=res["hit_rate"], moved_bytes_per_step=moved_bytes, routed_bytes_per_step=routed_bytes,
                moved_over_routed=moved_bytes / routed_bytes if routed_bytes else 0.0,
                moved_over_layer_prefetch=moved_bytes / layer_pf,
                moved_over_needed=res.get("moved_over_needed", 1.0),
                hint_fetches=res.get("hint_fetches", 0), hint_used=res.get("hint_used", 0))


def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--capacities", default="0.25,0.5", help="fractions of all experts resident")
    ap.add_argument("--policies", default="lru,lfu,lfu-decay,belady")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--zipf-s", type=float, default=None, help="override every model's Zipf exponent")
    ap.add_argument("--sticky-p", type=float, default=None, help="override every model's sticky probability")
    ap.add_argument("--half-life", type=float, default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="few steps, one model: a smoke run")
    ap.add_argument("--out", type=Path, default=None, help="write all rows as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.models, args.batches = 60, "mixtral-8x7b", "1"

    t_start = time.time()
    rows, sweeps, hint_rows, pool_rows, stats, skew = [], [], [], [], {}, {}
    policies = args.policies.split(",")
    for name in args.models.split(","):
        m = dict(MODELS[name])
        for key in ("zipf_s", "sticky_p"):
            if getattr(args, key) is not None:
                m[key] = getattr(args, key)
        skew[name] = {"zipf_s": m["zipf_s"], "sticky_p": m["sticky_p"]}
        for trace_kind in ("uniform", "skewed", "drift"):
            for batch in [int(b) for b in args.batches.split(",")]:
                if trace_kind == "drift" and batch != 1:
                    continue  # the drift rows only show what decay buys; batch 1 is enough
                tr = make_trace(trace_kind, args.steps, m, batch, m["zipf_s"], m["sticky_p"], args.seed)
                st = trace_stats(tr, m["experts"])
                stats[f"{name}/{trace_kind}/b{batch}"] = st
                distinct_per_step = st["distinct_per_call"] * m["layers"]
                for frac in [float(c) for c in args.capacities.split(",")]:
                    slots = max(1, int(round(frac * m["experts"])))
                    if slots < min(m["experts"], batch * m["top_k"]):
                        continue  # one call can need more experts than fit
                    for policy in policies:
                        if policy == "belady":
                            res = run_belady(tr, m["experts"], slots)
                        else:
                            res = run_policy(tr, m["experts"], slots, policy, args.half_life)
                        rows.append(row_for(name, m, trace_kind, batch, frac, policy, res, distinct_per_step,
                                            args.steps))

    # sensitivity: Zipf exponent and half-life, one model, batch 1, capacity 25%
    name = args.models.split(",")[-1]
    m = dict(MODELS[name], **skew[name])
    slots = max(1, int(round(0.25 * m["experts"])))
    if slots >= m["top_k"]:
        for s in (0.6, 1.0, 1.4):
            tr = make_trace("skewed", args.steps, m, 1, s, m["sticky_p"], args.seed)
            entry = {"model": name, "zipf_s": s, "sticky_p": m["sticky_p"], "capacity_frac": 0.25}
            entry["lru"] = run_policy(tr, m["experts"], slots, "lru", args.half_life)["hit_rate"]
            for hl in (16.0, 64.0, 256.0):
                entry[f"lfu-decay/{int(hl)}"] = run_policy(tr, m["experts"], slots, "lfu-decay", hl)["hit_rate"]
            entry["belady"] = run_belady(tr, m["experts"], slots)["hit_rate"]
            sweeps.append(entry)
        # one shared pool (what bench_moe.py uses) against per-layer pools, same total capacity
        for trace_kind in ("skewed", "drift"):
            tr = make_trace(trace_kind, args.steps, m, 1, m["zipf_s"], m["sticky_p"], args.seed)
            st = trace_stats(tr, m["experts"])
            for shared in (False, True):
                for policy in ("lru", "lfu-decay"):
                    res = run_policy(tr, m["experts"], slots, policy, args.half_life, shared=shared)
                    r = row_for(name, m, trace_kind, 1, 0.25, policy, res, st["distinct_per_call"] * m["layers"],
                                args.steps)
                    r["pool"] = "shared" if shared else "per-layer"
                    pool_rows.append(r)
        # hints from a predictor that finds 80% / 50% of the next layer's experts
        tr = make_trace("skewed", args.steps, m, 1, m["zipf_s"], m["sticky_p"], args.seed)
        st = trace_stats(tr, m["experts"])
        for acc in (None, 0.8, 0.5):
            res = run_policy(tr, m["experts"], slots, "lfu-decay", args.half_life, hint_acc=acc, seed=1)
            r = row_for(name, m, "skewed", 1, 0.25, "lfu-decay" + ("" if acc is None else f"+hints@{acc}"), res,
                        st["distinct_per_call"] * m["layers"], args.steps)
            hint_rows.append(r)

    # -- print ------------------------------------------------------------------------------
    skews = ", ".join(f"{k}: zipf_s={v['zipf_s']} sticky_p={v['sticky_p']}" for k, v in skew.items())
    print(f"# expert cache policies: {args.steps} decode steps, half-life {args.half_life} steps; skewed traces "
          f"{skews} (assumptions: mmap_offload/traces.py, MODELS here)\n")
    print("| model | trace | batch | VRAM % of experts | policy | hit % | GB moved/step | GB routed/step (UVA) "
          "| moved/routed | moved/layer-prefetch |")
    print("|---|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['trace']} | {r['batch']} | {100 * r['capacity_frac']:.0f} | {r['policy']} | "
              f"{100 * r['hit_rate']:.1f} | {fmt_gb(r['moved_bytes_per_step'])} | "
              f"{fmt_gb(r['routed_bytes_per_step'])} "
              f"| {r['moved_over_routed']:.2f} | {r['moved_over_layer_prefetch']:.3f} |")
    if sweeps:
        print(f"\n## hit % vs Zipf exponent and half-life ({name}, batch 1, 25% of experts in VRAM)\n")
        keys = [k for k in sweeps[0] if k not in ("model", "zipf_s", "sticky_p", "capacity_frac")]
        print("| zipf_s | " + " | ".join(keys) + " |")
        print("|---:|" + "---:|" * len(keys))
        for e in sweeps:
            print(f"| {e['zipf_s']} | " + " | ".join(f"{100 * e[k]:.1f}" for k in keys) + " |")
    if pool_rows:
        print(f"\n## per-layer pools vs one shared pool ({name}, batch 1, 25% of experts in VRAM)\n")
        print("| trace | pool | policy | hit % | GB moved/step |")
        print("|---|---|---|---:|---:|")
        for r in pool_rows:
            print(f"| {r['trace']} | {r['pool']} | {r['policy']} | {100 * r['hit_rate']:.1f} | "
                  f"{fmt_gb(r['moved_bytes_per_step'])} |")
    if hint_rows:
        print(f"\n## prefetch hints ({name}, skewed, batch 1, 25%): bytes moved / routed misses (bar <= 1.25)\n")
        print("| variant | hit % | hint fetches | hints used | moved/needed |")
        print("|---|---:|---:|---:|---:|")
        for r in hint_rows:
            print(f"| {r['policy']} | {100 * r['hit_rate']:.1f} | {r['hint_fetches']} | {r['hint_used']} | "
                  f"{r['moved_over_needed']:.3f} |")
    print("\ntrace statistics (top expert share of picks / first-choice repeat between steps / "
          "distinct per call):")
    for k, st in stats.items():
        print(f"  {k}: {st['top_expert_share']:.3f} (fair {st['fair_share']:.3f}) / "
              f"{st['first_choice_repeat']:.3f} "
              f"(uniform {st['first_choice_repeat_uniform']:.3f}) / {st['distinct_per_call']:.1f}")
    print(f"\n{time.time() - t_start:.1f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "models": MODELS, "skew": skew, "rows": rows, "sweeps": sweeps, "pools": pool_rows,
            "hints": hint_rows, "trace_stats": stats,
            "host": platform.node(), "torch": torch.__version__,
        }, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
