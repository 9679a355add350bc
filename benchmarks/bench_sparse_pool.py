"""The expert pool's hit rate at decode batch 8 as vLLM serves it (sparse calls on the stream), on the
CPU, next to two ceilings: how much of the copy path a better pool could still save.

    python benchmarks/bench_sparse_pool.py                       # bench_vllm's trace and pool, ~10 s
    python benchmarks/bench_sparse_pool.py --batch 8 --slots 40 --max-admit 1,4,16 --out /tmp/pool.json

It drives the real ``AsyncStep.run_sparse`` (csrc/async_step.c: hits, misses, ``mo_step_admit``'s
admissions, the policy's evictions) over a cache of tiny records, with bench_vllm's skewed trace
(``make_trace``: per-layer Zipf popularity, ~0.4 of a sequence's experts reused from its previous
step), so the decisions are the library's, bit for bit, and only the bytes are small. Printed per
policy and admission cap: hits / distinct routed experts per call (after a warm-up), the measure
bench_vllm reports as "pool hit". The ceilings, computed from the same trace:

    static top-S   each layer's S most often routed experts, chosen in hindsight and never changed
    belady         after every step keep the S experts used again soonest (the future known, any
                   number of admissions): no online policy does better without predicting routing
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # bench_vllm's trace


def static_top(tr: np.ndarray, slots: int, batch: int, warm: int) -> float:
    hits = routed = 0
    for layer in range(tr.shape[1]):
        sets = [set(tr[s, layer, :batch].ravel().tolist()) for s in range(tr.shape[0])]
        count: dict[int, int] = {}
        for d in sets:
            for e in d:
                count[e] = count.get(e, 0) + 1
        top = set(sorted(count, key=lambda e: -count[e])[:slots])
        for d in sets[warm:]:
            hits += len(d & top)
            routed += len(d)
    return hits / max(routed, 1)


def belady(tr: np.ndarray, slots: int, batch: int, warm: int) -> float:
    hits = routed = 0
    for layer in range(tr.shape[1]):
        sets = [set(tr[s, layer, :batch].ravel().tolist()) for s in range(tr.shape[0])]
        nxt: list[dict[int, int]] = [{} for _ in sets]  # step -> expert -> its next use after that step
        later: dict[int, int] = {}
        for s in range(len(sets) - 1, -1, -1):
            nxt[s] = dict(later)
            for e in sets[s]:
                later[e] = s
        res: set[int] = set()
        for s, d in enumerate(sets):
            if s >= warm:
                hits += len(d & res)
                routed += len(d)
            res = set(sorted(res | d, key=lambda e: nxt[s].get(e, 1 << 30))[:slots])
    return hits / max(routed, 1)


def tiny_cache(directory: Path, layers: tuple[int, ...], experts: int):
    """A cache of ``experts`` records of 512 bytes per layer (the decisions do not depend on sizes)."""
    from mmap_offload.cache_format import CacheIdentity, Manifest, layer_file_name, layout_specs
    from mmap_offload.cache_reader import open_cache
    from mmap_offload.cache_writer import RankWriter

    placed, record_nbytes = layout_specs([("w13_weight", "uint8", (256,)), ("w2_weight", "uint8", (256,))])
    manifest = Manifest(
        checkpoint_path="synthetic", identity=CacheIdentity("sha256:sim", {"kind": "sim"}, "sim-raw", 1, 0, 1),
        moe={"num_experts": experts, "layers": list(layers)}, record_nbytes=record_nbytes, record=placed,
        layers=[{"layer": l, "file": layer_file_name(l), "nbytes": experts * record_nbytes} for l in layers])
    with RankWriter(directory, manifest, fsync=False) as w:
        for l in layers:
            lw = w.begin_layer(l)
            for e in range(experts):
                lw.write_expert(e, {s.name: torch.full(s.shape, e % 251, dtype=torch.uint8) for s in placed})
            lw.commit()
        w.publish()
    c = open_cache(directory)
    for l in layers:
        c.check_experts_once(l, list(range(experts)))
    return c


def simulate(tr: np.ndarray, *, experts: int, slots: int, batch: int, policy: str, max_admit: int, warm: int,
             workdir: Path) -> float:
    from mmap_offload import transfer
    from mmap_offload.async_step import AsyncStep
    from mmap_offload.expert_cache import ExpertCache
    from mmap_offload.expert_step import ExpertStep

    layers = tuple(range(tr.shape[1]))
    c = tiny_cache(Path(tempfile.mkdtemp(dir=workdir)), layers, experts)
    eng = transfer.make_engine("mmap", "cpu", pinned_bytes=4 << 20, slot_bytes=1 << 20, threads=2, ordered_fraction=0.5)
    ec = ExpertCache(c, eng, "cpu", capacity_experts=slots * len(layers), stream_ordered=True, policy=policy)
    a = AsyncStep.create(ExpertStep.create(ec), max_experts=min(slots, 15))
    if isinstance(a, str):
        raise SystemExit(f"the async step is not available here: {a}")
    rows = {s.name: torch.zeros((experts, *s.shape), dtype=s.torch_dtype) for s in c.expert_specs}
    hits = routed = 0
    try:
        for s in range(tr.shape[0]):
            for li, layer in enumerate(layers):
                ids = torch.from_numpy(np.ascontiguousarray(tr[s, li, :batch]).astype(np.int64))
                resident = {e for e in range(experts) if ec._lut[ec._li(layer), e] >= 0}
                d = set(ids.ravel().tolist())
                if s >= warm:
                    hits += len(d & resident)
                    routed += len(d)
                if not a.run_sparse(layer, ids, rows, max_admit=max_admit):
                    raise SystemExit(f"step {s} layer {layer}: the sparse call was declined")
            a.wait()
    finally:
        a.close()
        eng.close()
        c.close()
    return hits / max(routed, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=160)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="sequences per decode step (more ids than slots: sparse)")
    ap.add_argument("--slots", type=int, default=40, help="pool slots per layer (bench_vllm: 0.25 x 160)")
    ap.add_argument("--steps", type=int, default=128, help="decode steps, the first --warm-up not counted")
    ap.add_argument("--warm-up", type=int, default=32)
    ap.add_argument("--zipf-s", type=float, default=1.0)
    ap.add_argument("--reuse", type=float, default=0.4)
    ap.add_argument("--policies", default="lfu-decay,lfu,lru")
    ap.add_argument("--max-admit", default="1,4,16", help="admissions per call (the vLLM backend passes 4)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.batch * args.top_k <= args.slots:
        raise SystemExit(f"--batch {args.batch} x --top-k {args.top_k} ids fit {args.slots} slots: not a sparse call")
    import bench_vllm

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stats = bench_vllm.make_trace(work / "trace.csv", steps=args.steps, layers=args.layers,
                                      num_experts=args.experts, top_k=args.top_k, batch=max(args.batch, 8),
                                      zipf_s=args.zipf_s, reuse=args.reuse, seed=0)
        from mmap_offload import traces

        tr = traces.read_csv(work / "trace.csv")
        rows = []
        for policy in [p for p in args.policies.split(",") if p]:
            for ma in [int(v) for v in args.max_admit.split(",") if v]:
                t0 = time.perf_counter()
                hit = simulate(tr, experts=args.experts, slots=args.slots, batch=args.batch, policy=policy,
                               max_admit=ma, warm=args.warm_up, workdir=work)
                rows.append({"policy": policy, "max_admit": ma, "hit": round(hit, 4),
                             "seconds": round(time.perf_counter() - t0, 2)})
        ceil = {"static_top": round(static_top(tr, args.slots, args.batch, args.warm_up), 4),
                "belady": round(belady(tr, args.slots, args.batch, args.warm_up), 4)}
    print(f"trace: {args.experts} experts, top-{args.top_k}, batch {args.batch}, Zipf {args.zipf_s}, reuse "
          f"{stats['reuse']:.2f}; {args.slots} slots per layer; hits / distinct routed experts per call after "
          f"{args.warm_up} steps")
    print("| policy | max admit | hit |\n| --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['policy']} | {r['max_admit']} | {r['hit']:.3f} |")
    print(f"| static top-{args.slots} (hindsight) | - | {ceil['static_top']:.3f} |")
    print(f"| belady (future known) | - | {ceil['belady']:.3f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "trace": stats,
                                        "rows": rows, "ceilings": ceil}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
