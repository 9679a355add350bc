"""Memory-pressure soak: serve a cache at least twice a cgroup's memory cap, random routing, every byte checked.

    python benchmarks/soak_pressure.py --gib 8 --cap-gib 4 --seconds 120 --device cuda --workdir /tmp/soak
    python benchmarks/soak_pressure.py --gib 0.75 --cap-gib 0.34 --seconds 60 --device cpu   # CI size

The parent writes a cache of random bytes (``--gib``, reused when already there), drops it from the
page cache, and runs one child in its own memory cgroup (v2, else v1; ``benchmarks/vllm_runner.Cgroup``)
capped at ``--cap-gib``, which must be at most half the cache. The child opens the cache and serves random
routing until ``--passes`` times the cache's bytes are served and every expert was served once, or ``--seconds`` pass: per step a random
layer and ``--top-k`` distinct random experts, one ``Copy`` per expert through the transfer engine
(``--engine``, default auto) into device tensors; every served tensor is hashed (xxh3-64, on the CPU) and
compared with the manifest's checksum. The page cache the child fills is charged to its cgroup, so the
kernel must reclaim the cache's pages (and the mmap engine's mapped pages) over and over while serving.

Pass: the child exits 0, no signal (no SIGBUS, no SIGKILL), the cgroup's oom_kill counter is 0, no
checksum mismatch, and the distinct bytes served are at least twice the cap. Prints one line per fact and
writes ``--out`` (JSON). Exit 0 on pass, 1 on a failed soak, 2 when no memory cgroup can be made (the
reason is printed; run as root on a host with a writable cgroup v1 memory or v2 hierarchy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

GiB = 2**30


# ---------------------------------------------------------------------------------------- cache
def build_random_cache(rank_dir: Path, nbytes: int, *, experts: int = 16, record_mib: float = 1.0, seed: int = 0,
                       tp_rank: int = 0, tp_size: int = 1) -> Path:
    """A cache of random bytes of about ``nbytes`` in ``rank_dir`` (reused when already complete)."""
    import numpy as np
    import torch

    from mmap_offload.cache_format import CacheIdentity, Manifest, layer_file_name, layout_specs
    from mmap_offload.cache_writer import RankWriter

    inter = max(16, int(record_mib * 2**20 / 4 / 3 / 256) // 16 * 16)  # 3 int32 tensors of [256, inter]
    specs, record = layout_specs([
        ("w13_weight_packed", "int32", (256, 2 * inter)),
        ("w2_weight_packed", "int32", (256, inter)),
        ("w13_weight_scale", "bfloat16", (7, 2 * inter)),  # odd row count: a record with padding
    ])
    layers = max(2, math.ceil(nbytes / (experts * record)))
    ident = CacheIdentity(f"sha256:random-{seed}-{layers}-{experts}-{record}", {"kind": "random"}, "random-raw", 1,
                          tp_rank, tp_size)
    m = Manifest(checkpoint_path="(random bytes)", identity=ident,
                 moe={"num_experts": experts, "hidden": 256, "intermediate": inter, "top_k": 0, "layers": list(range(layers))},
                 record_nbytes=record, record=specs,
                 layers=[{"layer": l, "file": layer_file_name(l), "nbytes": experts * record} for l in range(layers)])
    rng = np.random.default_rng([seed, tp_rank])
    with RankWriter(rank_dir, m, fsync=True) as w:
        for l in range(layers):
            if w.complete or l in w.done_layers:
                continue
            lw = w.begin_layer(l)
            for e in range(experts):
                raw = np.frombuffer(rng.bytes(record), dtype=np.uint8)
                lw.write_expert(e, {s.name: torch.from_numpy(raw[s.offset : s.offset + s.nbytes].copy())
                                    .view(s.torch_dtype).view(s.shape) for s in specs})
            lw.commit()
        w.publish()
    return rank_dir


def evict(paths) -> None:
    from mmap_offload.transfer.pagecache import evict_page_cache

    for p in paths:
        evict_page_cache(p)


# ---------------------------------------------------------------------------------------- serving
def check_served(cache, layer: int, expert: int, served, host, out: dict) -> None:
    """Check one served expert record (``served``, on any device, copied through the CPU tensor ``host``)
    against the manifest's checksums: each tensor that differs adds 1 to ``out["mismatches"]``, the first
    five are named in ``out["first_mismatches"]``."""
    from mmap_offload.cache_format import checksum

    host.copy_(served)
    buf = host.numpy()
    for spec, want in zip(cache.expert_specs, cache.expected_checksums(layer, expert)):
        if checksum(buf[spec.offset : spec.offset + spec.nbytes]) != want:
            out["mismatches"] += 1
            if len(out["first_mismatches"]) < 5:
                out["first_mismatches"].append(f"layer {layer} expert {expert} {spec.name}")


def serve_and_check(cache, engine, device, *, top_k: int, max_bytes: int, seconds: float, seed: int,
                    events=None) -> dict:
    """Random routing over ``cache`` through ``engine``; every served tensor checked against its checksum.

    Returns steps, bytes served, distinct bytes served, mismatches (first few named), seconds."""
    import numpy as np
    import torch

    from mmap_offload.transfer import Copy

    rng = np.random.default_rng(seed)
    E, rec = cache.num_experts, cache.record_nbytes
    k = min(top_k, E)
    dsts = [torch.empty(rec, dtype=torch.uint8, device=device) for _ in range(k)]
    host = torch.empty(rec, dtype=torch.uint8)
    seen: set[tuple[int, int]] = set()
    out = {"steps": 0, "bytes": 0, "mismatches": 0, "first_mismatches": [], "copy_seconds": 0.0}
    t0 = time.perf_counter()
    last_event = t0
    everything = len(cache.layers) * E
    # until ``max_bytes`` are served and every expert was served at least once (or the time is up)
    while (out["bytes"] < max_bytes or len(seen) < everything) and time.perf_counter() - t0 < seconds:
        layer = cache.layers[int(rng.integers(len(cache.layers)))]
        experts = [int(e) for e in rng.choice(E, size=k, replace=False)]
        t1 = time.perf_counter()
        ticket = engine.submit([Copy(src=cache.expert_extent(layer, e), dst=[(0, rec, d)],
                                     label=f"layer {layer} expert {e}") for e, d in zip(experts, dsts)])
        engine.wait(ticket)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["copy_seconds"] += time.perf_counter() - t1
        for e, d in zip(experts, dsts):
            check_served(cache, layer, e, d, host, out)
            seen.add((layer, e))
        out["steps"] += 1
        out["bytes"] += k * rec
        if events is not None and time.perf_counter() - last_event > 1.0:
            last_event = time.perf_counter()
            events({"event": "progress", "bytes": out["bytes"], "distinct_bytes": len(seen) * rec})
    out["seconds"] = time.perf_counter() - t0
    out["distinct_bytes"] = len(seen) * rec
    out["gbps"] = out["bytes"] / max(out["copy_seconds"], 1e-9) / 1e9
    return out


def child(spec: dict) -> int:
    import torch

    from mmap_offload.cache_reader import open_cache
    from mmap_offload.errors import MmapOffloadError
    from mmap_offload.transfer import make_engine

    events = open(spec["events"], "a")

    def emit(obj):
        events.write(json.dumps(obj) + "\n")
        events.flush()

    device = torch.device(spec["device"])
    cache = open_cache(spec["cache"], spec.get("tp_rank", 0), spec.get("tp_size", 1))
    engine = make_engine(spec["engine"], device, pinned_bytes=spec["pinned_bytes"], threads=spec["threads"])
    emit({"event": "ready", "rss_kib": _rss_kib()})
    try:
        res = serve_and_check(cache, engine, device, top_k=spec["top_k"], max_bytes=spec["max_bytes"],
                              seconds=spec["seconds"], seed=spec["seed"], events=emit)
        res["engine"] = engine.metrics.get("engine", spec["engine"])
    except MmapOffloadError as e:
        emit({"event": "error", "error": str(e)})
        return 1
    finally:
        engine.close()
    res["rss_kib"] = _rss_kib()
    emit({"event": "done", **res})
    return 0


def _rss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def read_events(path: Path) -> list[dict]:
    out = []
    try:
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    except OSError:
        pass
    return out


# ---------------------------------------------------------------------------------------- parent
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.75, help="cache size (GiB); at least 2 x --cap-gib")
    ap.add_argument("--cap-gib", type=float, default=None, help="the child's cgroup memory cap (default: --gib / 2)")
    ap.add_argument("--seconds", type=float, default=60.0, help="soak at most this long")
    ap.add_argument("--passes", type=float, default=2.0, help="stop after serving this many times the cache's bytes")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--record-mib", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pinned-mib", type=int, default=32)
    ap.add_argument("--workdir", default="/tmp/mmap-offload-soak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(Path(args.child).read_text()))

    from vllm_runner import Cgroup

    cap = int((args.cap_gib if args.cap_gib is not None else args.gib / 2) * GiB)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    d = build_random_cache(work / "cache" / "rank-0-of-1", int(args.gib * GiB), experts=args.experts,
                           record_mib=args.record_mib, seed=args.seed)
    from mmap_offload.cache_reader import open_cache

    cache = open_cache(d)
    cache_bytes = sum(l["nbytes"] for l in cache.manifest.layers)
    print(f"cache        {d}: {cache_bytes / GiB:.2f} GiB ({len(cache.layers)} layers x {cache.num_experts} experts "
          f"x {cache.record_nbytes / 2**20:.2f} MiB), ready in {time.perf_counter() - t0:.1f} s")
    if cache_bytes < 2 * cap:
        print(f"soak_pressure: error: the cache ({cache_bytes / GiB:.2f} GiB) is under twice the cap "
              f"({cap / GiB:.2f} GiB): raise --gib or lower --cap-gib", file=sys.stderr)
        return 2
    evict([cache.layer_file(l) for l in cache.layers])

    cg = Cgroup(f"mmo-soak-{os.getpid()}", cap)
    if not cg.enforced:
        print(f"soak_pressure: no memory cgroup ({cg.reason}): run as root where cgroup v1 memory or v2 is "
              "writable", file=sys.stderr)
        return 2
    events_path = work / "soak.events.jsonl"
    events_path.unlink(missing_ok=True)
    spec = {"cache": str(work / "cache"), "device": args.device, "engine": args.engine, "threads": args.threads,
            "pinned_bytes": args.pinned_mib << 20, "top_k": args.top_k, "seconds": args.seconds,
            "max_bytes": int(args.passes * cache_bytes), "seed": args.seed, "events": str(events_path)}
    spec_path = work / "soak.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t1 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)], env=env,
                              preexec_fn=cg.preexec(), capture_output=True, text=True,
                              timeout=args.seconds + 300)
        rc, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired:
        rc, stderr = None, "timed out"
    wall = time.perf_counter() - t1
    oom, peak = cg.oom_kills(), cg.peak()
    cg.remove()
    events = read_events(events_path)
    done = next((e for e in events if e.get("event") == "done"), None)
    error = next((e["error"] for e in events if e.get("event") == "error"), None)
    sig = signal.Signals(-rc).name if rc is not None and rc < 0 else None
    result = {"cache_bytes": cache_bytes, "cap_bytes": cap, "cgroup": cg.kind, "returncode": rc, "signal": sig,
              "oom_kill": oom, "memory_peak": peak, "wall_s": wall, "device": args.device, "error": error,
              **(done or {})}
    checks = {
        "child exited 0 (no SIGBUS, no SIGKILL)": rc == 0,
        "no OOM kill in the cgroup": (oom or 0) == 0,
        "every served tensor matches its checksum": done is not None and done["mismatches"] == 0,
        "distinct bytes served >= 2 x cap": done is not None and done["distinct_bytes"] >= 2 * cap,
    }
    result["checks"] = checks
    result["ok"] = all(checks.values())
    if done:
        print(f"served       {done['bytes'] / GiB:.2f} GiB ({done['distinct_bytes'] / GiB:.2f} GiB distinct) in "
              f"{done['steps']} steps, {done['seconds']:.1f} s, {done['gbps']:.2f} GB/s through {done['engine']} "
              f"to {args.device}; {done['mismatches']} mismatch(es) {done['first_mismatches'] or ''}")
    print(f"cgroup {cg.kind}    cap {cap / GiB:.2f} GiB, peak {(peak or 0) / GiB:.2f} GiB, oom_kill {oom}; "
          f"child rc {rc}{f' ({sig})' if sig else ''}" + (f"; error: {error}" if error else ""))
    if rc != 0 and not done:
        print(stderr[-2000:], file=sys.stderr)
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAILED'}] {name}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
