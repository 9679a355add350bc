"""Marlin repack throughput: CPU (one core) and CUDA, with and without act-order.

    python benchmarks/bench_repack.py [--device cpu|cuda|all] [--out results.json] [--repeats N]

Throughput is packed weight bytes in (== bytes out) per second. Two measurements per case:
- "repack": ``marlin_repack`` of one expert's gate, up (into the halves of w13) and down, tensors already on
  the device; CPU timed with ``time.perf_counter`` under ``torch.set_num_threads(1)`` (the median of
  ``--repeats`` runs; the CPU-time rate is printed too, since other processes share this machine), CUDA
  timed with CUDA events.
- "layout": ``MarlinW4A16Layout.transform_expert`` (weights, scales, g_idx; CPU in, CPU out: on CUDA
  this includes the host->device and device->host copies, so it is the warm-up's real per-expert step).

Bars (docs/LAYOUTS.md, issue 3): CPU >= 300 MB/s per core without act-order; CUDA >= 20 GB/s on an H200.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmap_offload.checkpoint import QuantScheme  # noqa: E402
from mmap_offload.layout import MarlinW4A16Layout  # noqa: E402
from mmap_offload.repack import marlin_repack, sort_g_idx  # noqa: E402


Quant = QuantScheme.w4a16  # the real scheme; keyword overrides as the tests need


SHAPES = {  # name: (hidden, intermediate, experts per measurement)
    "mixtral-like H=4096 I=14336": (4096, 14336, 1),
    "qwen-moe-like H=2048 I=768": (2048, 768, 16),
}


def make_experts(hidden: int, inter: int, n: int, actorder: bool, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(n):
        def proj(rows: int, k: int) -> dict:
            d = {"weight_packed": torch.randint(-2**31, 2**31, (rows, k // 8), generator=gen,
                                                dtype=torch.int64).to(torch.int32),
                 "weight_scale": torch.rand((rows, k // 128), generator=gen).to(torch.bfloat16),
                 "weight_shape": torch.tensor([rows, k])}
            if actorder:
                d["weight_g_idx"] = (torch.arange(k) // 128)[torch.randperm(k, generator=gen)].to(torch.int32)
            return d
        gate = proj(inter, hidden)
        up = proj(inter, hidden)
        if actorder:
            up["weight_g_idx"] = gate["weight_g_idx"].clone()
        experts.append({"gate": gate, "up": up, "down": proj(hidden, inter)})
    return experts


def packed_bytes(experts: list[dict]) -> int:
    return sum(p["weight_packed"].numel() * 4 for e in experts for p in e.values())


def repack_experts(experts: list[dict], actorder: bool) -> None:
    for e in experts:
        inter, hw = e["gate"]["weight_packed"].shape
        dev = e["gate"]["weight_packed"].device
        perm13 = perm2 = None
        if actorder:
            perm13 = sort_g_idx(e["gate"]["weight_g_idx"])[1]
            perm2 = sort_g_idx(e["down"]["weight_g_idx"])[1]
        w13 = torch.empty((hw // 2, 4 * inter), dtype=torch.int32, device=dev)
        marlin_repack(e["gate"]["weight_packed"], perm13, out=w13[:, : 2 * inter])
        marlin_repack(e["up"]["weight_packed"], perm13, out=w13[:, 2 * inter:])
        marlin_repack(e["down"]["weight_packed"], perm2)


def layout_experts(experts: list[dict], actorder: bool, device: str) -> None:
    quant = Quant(actorder=actorder)
    layout = MarlinW4A16Layout()
    for e in experts:
        layout.transform_expert(e, quant, 0, 1, device)


def time_cpu(fn, repeats: int) -> tuple[float, float]:
    """(median wall seconds, median CPU seconds) of ``fn`` after one warm-up call."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def time_cuda(fn, repeats: int) -> float:
    """Median seconds of ``fn`` measured with CUDA events, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return statistics.median(times)


def bench_cpu(repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for shape, (h, inter, n) in SHAPES.items():
        for actorder in (False, True):
            experts = make_experts(h, inter, n, actorder)
            nbytes = packed_bytes(experts)
            for what, fn in (("repack", lambda: repack_experts(experts, actorder)),
                             ("layout", lambda: layout_experts(experts, actorder, "cpu"))):
                wall, cpu = time_cpu(fn, repeats)
                rows.append({"device": "cpu", "threads": 1, "shape": shape, "experts": n, "actorder": actorder,
                             "what": what, "bytes": nbytes, "seconds": wall, "cpu_seconds": cpu,
                             "MB_per_s": nbytes / wall / 1e6, "MB_per_cpu_s": nbytes / max(cpu, 1e-9) / 1e6})
    return rows


def bench_cuda(repeats: int) -> list[dict]:
    rows = []
    shapes = dict(SHAPES)
    shapes["qwen-moe-like H=2048 I=768"] = (2048, 768, 64)
    for shape, (h, inter, n) in shapes.items():
        for actorder in (False, True):
            experts = make_experts(h, inter, n, actorder)
            nbytes = packed_bytes(experts)
            on_dev = [{p: {k: v.cuda() for k, v in d.items()} for p, d in e.items()} for e in experts]
            sec = time_cuda(lambda: repack_experts(on_dev, actorder), repeats)
            rows.append({"device": torch.cuda.get_device_name(), "shape": shape, "experts": n,
                         "actorder": actorder, "what": "repack", "bytes": nbytes, "seconds": sec,
                         "GB_per_s": nbytes / sec / 1e9})
            sec = time_cuda(lambda: layout_experts(experts, actorder, "cuda"), repeats)
            rows.append({"device": torch.cuda.get_device_name(), "shape": shape, "experts": n,
                         "actorder": actorder, "what": "layout (incl. H2D + D2H, pageable)", "bytes": nbytes,
                         "seconds": sec, "GB_per_s": nbytes / sec / 1e9})
            del on_dev
            torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'device':<24} {'shape':<28} {'exp':>3} {'act-order':>9} {'what':<36} {'MB':>8} {'rate':>16}")
    for r in rows:
        if "GB_per_s" in r:
            rate = f"{r['GB_per_s']:8.1f} GB/s"
        else:
            rate = f"{r['MB_per_s']:6.0f} MB/s ({r['MB_per_cpu_s']:.0f}/cpu-s)"
        print(f"{r['device'][:24]:<24} {r['shape']:<28} {r['experts']:>3} {str(r['actorder']):>9} "
              f"{r['what']:<36} {r['bytes'] / 1e6:8.1f} {rate:>16}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda", "all"), default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows: list[dict] = []
    if args.device in ("cpu", "all"):
        rows += bench_cpu(args.repeats)
    if args.device in ("cuda", "all"):
        if not torch.cuda.is_available():
            print("CUDA is not available", file=sys.stderr)
            return 2
        rows += bench_cuda(args.repeats)
    print_table(rows)
    if args.out:
        meta = {"torch": torch.__version__, "machine": platform.machine(), "processor": platform.processor(),
                "bars": {"cpu_MB_per_s_per_core": 300, "cuda_GB_per_s": 20}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
