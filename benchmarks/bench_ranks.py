"""Two TP ranks, one page cache: what serving rank 0 and rank 1 of one cache at once costs each.

    python benchmarks/bench_ranks.py --gib 8 --device cuda --passes 3 --out ranks.json          # H200 (1 GPU: both on it)
    python benchmarks/bench_ranks.py --gib 0.0625 --device cpu --passes 1                        # CI size
    python benchmarks/bench_ranks.py --cache-dir CACHE --device cpu                              # an existing TP-2 cache

Each rank is one process (as vLLM runs TP ranks) serving its own ``rank-R-of-2`` directory: every layer,
experts in a random order, ``--passes`` times, through the transfer engine (``--engine``) into device
tensors (rank R on ``cuda:R`` where that GPU exists, else ``cuda:0``). Phases, each with the page cache
warm (``--cold``: the cache's files dropped from it before each phase):

    alone-0, alone-1   one rank at a time: its GB/s with the disk, page cache and memory bandwidth to itself
    shared             both at once, started together: each rank's GB/s while the other serves

The cost of sharing is shared/alone per rank. After the timed passes, each child serves every expert once
more and checks every tensor against the manifest's xxh3 checksums (untimed); any mismatch fails the run.
Without ``--cache-dir`` a random-bytes TP-2 cache of ``--gib`` per rank is written (reused across runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

GiB = 2**30


def child(spec: dict) -> int:
    import numpy as np
    import torch

    from mmap_offload.cache_reader import open_cache
    from mmap_offload.transfer import Copy, make_engine

    r = spec["tp_rank"]
    if spec["device"].startswith("cuda"):
        device = torch.device("cuda", r if torch.cuda.device_count() > r else 0)
    else:
        device = torch.device("cpu")
    cache = open_cache(spec["cache"], r, 2)
    engine = make_engine(spec["engine"], device, pinned_bytes=spec["pinned_bytes"], threads=spec["threads"])
    rec, E = cache.record_nbytes, cache.num_experts
    dsts = [torch.empty(rec, dtype=torch.uint8, device=device) for _ in range(E)]
    rng = np.random.default_rng(r)
    # start together: wait for the go file (the parent writes it once every child is ready)
    Path(spec["ready"]).write_text("1")
    while not Path(spec["go"]).exists():
        time.sleep(0.001)
    t_start = time.time()
    t0 = time.perf_counter()
    moved = 0
    for _ in range(spec["passes"]):
        for layer in cache.layers:
            order = rng.permutation(E)
            engine.wait(engine.submit([Copy(src=cache.expert_extent(layer, int(e)), dst=[(0, rec, dsts[i])],
                                            label=f"layer {layer} expert {int(e)}") for i, e in enumerate(order)]))
            moved += E * rec
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    secs = time.perf_counter() - t0
    t_end = time.time()
    check = check_every_expert(cache, engine, dsts)
    metrics = dict(engine.metrics)
    engine.close()
    Path(spec["out"]).write_text(json.dumps({
        "tp_rank": r, "device": str(device), "bytes": moved, "seconds": secs, "gbps": moved / secs / 1e9,
        "t_start": t_start, "t_end": t_end, "engine": metrics.get("engine", spec["engine"]),
        "checked_bytes": check["distinct_bytes"], "mismatches": check["mismatches"],
        "first_mismatches": check["first_mismatches"]}))
    return 0


def check_every_expert(cache, engine, dsts) -> dict:
    """Serve every expert of ``cache`` once more and check each tensor against the manifest (untimed)."""
    import torch

    from mmap_offload.transfer import Copy
    from soak_pressure import check_served

    rec = cache.record_nbytes
    host = torch.empty(rec, dtype=torch.uint8)
    out = {"distinct_bytes": 0, "mismatches": 0, "first_mismatches": []}
    for layer in cache.layers:
        engine.wait(engine.submit([Copy(src=cache.expert_extent(layer, e), dst=[(0, rec, dsts[e])])
                                   for e in range(cache.num_experts)]))
        for e in range(cache.num_experts):
            check_served(cache, layer, e, dsts[e], host, out)
            out["distinct_bytes"] += rec
    return out


def run_phase(name: str, ranks: list[int], args, cache_dir: Path, work: Path) -> dict[int, dict]:
    go = work / f"{name}.go"
    go.unlink(missing_ok=True)
    procs = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for r in ranks:
        spec = {"cache": str(cache_dir), "tp_rank": r, "device": args.device, "engine": args.engine,
                "threads": args.threads, "pinned_bytes": args.pinned_mib << 20, "passes": args.passes,
                "ready": str(work / f"{name}.{r}.ready"), "go": str(go), "out": str(work / f"{name}.{r}.json")}
        for k in ("ready", "out"):
            Path(spec[k]).unlink(missing_ok=True)
        p = work / f"{name}.{r}.spec.json"
        p.write_text(json.dumps(spec))
        procs[r] = (subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(p)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), spec)
    deadline = time.time() + 600
    while not all(Path(s["ready"]).exists() for _, s in procs.values()):
        if any(p.poll() is not None for p, _ in procs.values()) or time.time() > deadline:
            break
        time.sleep(0.01)
    go.write_text("go")
    out = {}
    for r, (p, spec) in procs.items():
        log, _ = p.communicate(timeout=900)
        if p.returncode != 0:
            raise SystemExit(f"bench_ranks: rank {r} ({name}) failed with {p.returncode}:\n{log[-3000:]}")
        out[r] = json.loads(Path(spec["out"]).read_text())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="bytes per rank of the random cache written")
    ap.add_argument("--cache-dir", default=None, help="serve this TP-2 cache instead (rank-0-of-2, rank-1-of-2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--pinned-mib", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the cache from the page cache before each phase")
    ap.add_argument("--workdir", default="/tmp/mmap-offload-ranks")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(Path(args.child).read_text()))

    from mmap_offload.cache_reader import open_cache
    from soak_pressure import build_random_cache, evict

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if args.cache_dir:
        cache_dir = Path(args.cache_dir)
    else:
        cache_dir = work / "cache"
        for r in (0, 1):
            build_random_cache(cache_dir / f"rank-{r}-of-2", int(args.gib * GiB), tp_rank=r, tp_size=2, record_mib=4)
    files = []
    for r in (0, 1):
        c = open_cache(cache_dir, r, 2)
        files += [c.layer_file(l) for l in c.layers]
    total = sum(f.stat().st_size for f in files)
    print(f"cache {cache_dir}: 2 ranks, {total / GiB:.2f} GiB; device {args.device}, engine {args.engine}, "
          f"{args.passes} pass(es), page cache {'cold' if args.cold else 'warm'}")
    if not args.cold:  # warm: one untimed pass first
        run_phase("prewarm", [0, 1], argparse.Namespace(**{**vars(args), "passes": 1}), cache_dir, work)
    phases = {}
    for name, ranks in (("alone-0", [0]), ("alone-1", [1]), ("shared", [0, 1])):
        if args.cold:
            evict(files)
        phases[name] = run_phase(name, ranks, args, cache_dir, work)
    sh = phases["shared"]
    overlap = min(sh[0]["t_end"], sh[1]["t_end"]) - max(sh[0]["t_start"], sh[1]["t_start"])
    rows = []
    for r in (0, 1):
        a, s = phases[f"alone-{r}"][r], sh[r]
        rows.append({"rank": r, "device": s["device"], "alone_gbps": a["gbps"], "shared_gbps": s["gbps"],
                     "shared_over_alone": s["gbps"] / a["gbps"], "mismatches": a["mismatches"] + s["mismatches"],
                     "checked_bytes": s["checked_bytes"]})
    print(f"{'rank':<5} {'device':<8} {'alone GB/s':>10} {'shared GB/s':>11} {'shared/alone':>12}  checked")
    for row in rows:
        print(f"{row['rank']:<5} {row['device']:<8} {row['alone_gbps']:>10.2f} {row['shared_gbps']:>11.2f} "
              f"{row['shared_over_alone']:>12.2f}  {row['checked_bytes'] / GiB:.2f} GiB, {row['mismatches']} mismatch(es)")
    both = (sh[0]["bytes"] + sh[1]["bytes"]) / (max(sh[0]["t_end"], sh[1]["t_end"]) - min(sh[0]["t_start"], sh[1]["t_start"])) / 1e9
    print(f"shared: the two ranks overlapped {overlap:.2f} s; together {both:.2f} GB/s")
    ok = all(r["mismatches"] == 0 for r in rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "overlap_s": overlap, "together_gbps": both,
                                              "phases": phases, "ok": ok, "cold": args.cold}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
