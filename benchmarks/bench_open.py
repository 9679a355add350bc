"""Time to ready from a valid cache: open_cache on a manifest of the seed model's size.

    python benchmarks/bench_open.py [--layers 92] [--experts 160] [--out open.json]
    python benchmarks/bench_open.py --verify-first-use [--verify-layers 4] [--dir /nvme/tmp]   # + the check's cost

The seed scenario (DESIGN.md section 1) is a GLM-4.5-Air-class W4A16 MoE: ~92 MoE layers x 160 experts x
4 Marlin tensors per rank. The layer files are sparse (no data is read when opening), so this measures
exactly what a server pays before its first forward: parse + check the manifest, stat the files.
Bar (DESIGN.md section 6): < 2 s, independent of the expert bytes.

``--verify-first-use`` adds what checking on first use costs at start (on by default in LayerPrefetcher,
ExpertCache and the vLLM backend: ``Cache.check_layer_once`` reads each layer file once per process and
checks every tensor's xxh3 before the layer is first served). It writes ``--verify-layers`` real layers of
the seed's size (random bytes, correct checksums) in ``--dir``, times ``check_layer_once`` per layer with the
page cache cold (files dropped from it first) and warm, and extrapolates to ``--layers`` layers: the time a
server adds before its first forward has touched every layer. Opting out: ``verify_first_use=False``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmap_offload.cache_format import CacheIdentity, Manifest, layer_file_name, layout_specs  # noqa: E402
from mmap_offload.cache_reader import open_cache  # noqa: E402


def make_manifest(directory: Path, layers: int, experts: int, hidden: int, inter: int, sparse: bool = True) -> Manifest:
    specs, record = layout_specs([
        ("w13_weight_packed", "int32", (hidden // 16, 4 * inter)),
        ("w2_weight_packed", "int32", (inter // 16, 2 * hidden)),
        ("w13_weight_scale", "bfloat16", (hidden // 128, 2 * inter)),
        ("w2_weight_scale", "bfloat16", (inter // 128, hidden)),
    ])
    m = Manifest(
        checkpoint_path="/models/seed", identity=CacheIdentity("sha256:" + "0" * 64,
        {"kind": "w4a16", "group_size": 128, "actorder": False, "symmetric": True, "num_bits": 4},
        "marlin-w4a16", 1, 0, 2), moe={"num_experts": experts, "hidden": hidden, "intermediate": 2 * inter,
        "top_k": 8, "layers": list(range(layers))}, record_nbytes=record, record=specs,
        layers=[{"layer": l, "file": layer_file_name(l), "nbytes": experts * record} for l in range(layers)],
    )
    m.tensors = [[l, e, s.name, s.dtype, list(s.shape), layer_file_name(l), e * record + s.offset, s.nbytes, "0" * 16]
                 for l in range(layers) for e in range(experts) for s in specs]
    if not sparse:
        return m
    (directory / "manifest.json").write_bytes(m.dumps())
    for l in range(layers):
        with open(directory / layer_file_name(l), "wb") as f:
            f.truncate(experts * record)  # sparse: opening reads no data
    return m


def verify_cost(directory: Path, vlayers: int, experts: int, hidden: int, inter: int) -> dict:
    """Seconds per layer of check_layer_once, cold and warm page cache, on ``vlayers`` real layers."""
    import numpy as np

    from mmap_offload.cache_format import checksum
    from mmap_offload.cache_writer import fsync_dir
    from mmap_offload.transfer.pagecache import evict_page_cache

    m = make_manifest(directory, vlayers, experts, hidden, inter, sparse=False)
    rec = m.record_nbytes
    layer = np.frombuffer(np.random.default_rng(0).bytes(experts * rec), dtype=np.uint8)
    sums = [[checksum(layer[e * rec + s.offset : e * rec + s.offset + s.nbytes]) for s in m.record]
            for e in range(experts)]
    m.tensors = [[l, e, s.name, s.dtype, list(s.shape), layer_file_name(l), e * rec + s.offset, s.nbytes, sums[e][i]]
                 for l in range(vlayers) for e in range(experts) for i, s in enumerate(m.record)]
    (directory / "manifest.json").write_bytes(m.dumps())
    for l in range(vlayers):
        with open(directory / layer_file_name(l), "wb") as f:
            f.write(memoryview(layer))
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(directory)
    out = {"layers_timed": vlayers, "layer_bytes": experts * rec}
    for mode in ("cold", "warm"):
        cache = open_cache(directory, tp_rank=0, tp_size=2)
        times = []
        for l in range(vlayers):
            if mode == "cold":
                evict_page_cache(directory / layer_file_name(l))
            t0 = time.perf_counter()
            cache.check_layer_once(l)
            times.append(time.perf_counter() - t0)
        out[f"{mode}_seconds_per_layer"] = sorted(times)[len(times) // 2]  # median
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=92)
    ap.add_argument("--experts", type=int, default=160)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=704, help="intermediate size per TP rank")
    ap.add_argument("--out", default=None)
    ap.add_argument("--verify-first-use", action="store_true", help="also time the first-use checksum check")
    ap.add_argument("--verify-layers", type=int, default=4, help="real layers written for --verify-first-use")
    ap.add_argument("--dir", default=None, help="where to write them (default: the temp dir; use the cache's disk)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        m = make_manifest(d, args.layers, args.experts, args.hidden, args.inter)
        size = (d / "manifest.json").stat().st_size
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            cache = open_cache(d, tp_rank=0, tp_size=2)
            times.append(time.perf_counter() - t0)
        expert_bytes = len(cache.layers) * cache.num_experts * cache.record_nbytes
    best = min(times)
    print(f"{'manifest':<28} {len(m.tensors)} tensors, {size / 2**20:.1f} MiB JSON, "
          f"{expert_bytes / 2**30:.1f} GiB of experts (sparse files)")
    print(f"{'open_cache (best of 3)':<28} {best:.3f} s   bar < 2 s: {'met' if best < 2 else 'MISSED'}")
    result = {"tensors": len(m.tensors), "manifest_bytes": size, "expert_bytes": expert_bytes, "open_seconds": times}
    if args.verify_first_use:
        if args.dir:
            os.makedirs(args.dir, exist_ok=True)  # the H200 run gave a path that did not exist yet
        with tempfile.TemporaryDirectory(dir=args.dir) as d:
            v = verify_cost(Path(d), args.verify_layers, args.experts, args.hidden, args.inter)
        result["verify_first_use"] = v
        gb = v["layer_bytes"] / 1e9
        for mode in ("cold", "warm"):
            per = v[f"{mode}_seconds_per_layer"]
            print(f"{'verify_first_use, ' + mode:<28} {per:.3f} s per layer ({v['layer_bytes'] / 2**20:.0f} MiB, "
                  f"{gb / per:.2f} GB/s); at start, {args.layers} layers: {per * args.layers:.1f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
