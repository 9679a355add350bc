"""Warm-up throughput against the raw sequential write speed of the same disk, in one run.

    python benchmarks/bench_warmup.py --dir /nvme/tmp --gib 4 --out warmup.json [--device cuda] [--quant w4a16]

Prints a table: the disk's sequential write (1 MiB writes + fsync, the ceiling), the disk's read of the
checkpoint, and warm-up GB/s (bytes of cache written per second, fsync included) with its peak RSS.
Bar (DESIGN.md section 6): warm-up >= 80% of sequential write.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def seq_write(path: Path, nbytes: int, block: int = 8 << 20) -> float:
    buf = np.random.default_rng(0).integers(0, 256, block, dtype=np.uint8)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    path.unlink()
    return nbytes / dt / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="bench-out/warmup")
    ap.add_argument("--gib", type=float, default=2.0, help="checkpoint expert bytes (approx.)")
    ap.add_argument("--quant", default="w4a16", choices=["w4a16", "bf16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from mmap_offload.synth import make_checkpoint

    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    hidden, inter, experts = 4096, 1536, 16
    per_layer = experts * 3 * hidden * inter * (0.5 if args.quant == "w4a16" else 2)
    layers = max(2, int(args.gib * 2**30 / per_layer))
    t0 = time.perf_counter()
    ckpt = make_checkpoint(work / "ckpt", arch="qwen_moe", quant=args.quant, num_layers=layers, num_experts=experts,
                           hidden=hidden, intermediate=inter, top_k=4, vocab_size=256, num_heads=8, num_kv_heads=2)
    synth_s = time.perf_counter() - t0
    ckpt_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))

    write_gbps = seq_write(work / "seq.bin", int(min(ckpt_bytes, 4 << 30)))
    # Warm-up in a fresh process so its peak RSS is its own.
    code = (
        "import json, resource, sys, time\n"
        "from mmap_offload.warmup import warmup\n"
        f"r = warmup({str(ckpt)!r}, {str(work / 'cache')!r}, device={args.device!r})\n"
        "print(json.dumps({'bytes': r.bytes_written, 'read': r.bytes_read, 'seconds': r.seconds,"
        " 'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    w = json.loads(proc.stdout.strip().splitlines()[-1])
    warm_gbps = w["bytes"] / w["seconds"] / 1e9
    layer_bytes = w["bytes"] / layers
    rss_bound = 2 * layer_bytes + 2**30

    rows = [
        ("disk sequential write + fsync (ceiling)", f"{write_gbps:.2f} GB/s", ""),
        (f"warm-up {args.quant} ({args.device}), {layers} layers", f"{warm_gbps:.2f} GB/s",
         f"{warm_gbps / write_gbps:.0%} of ceiling (bar 80%)"),
        ("warm-up peak RSS", f"{w['rss'] / 2**20:.0f} MiB", f"bound 2 x layer + 1 GiB = {rss_bound / 2**20:.0f} MiB"),
        ("checkpoint", f"{ckpt_bytes / 2**30:.2f} GiB", f"synthesised in {synth_s:.1f} s"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>12}  note")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>12}  {note}")
    result = {"seq_write_gbps": write_gbps, "warmup_gbps": warm_gbps, "ratio": warm_gbps / write_gbps,
              "peak_rss": w["rss"], "rss_bound": rss_bound, "layers": layers, "cache_bytes": w["bytes"],
              "checkpoint_bytes": ckpt_bytes, "quant": args.quant, "device": args.device}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
