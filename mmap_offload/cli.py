"""`mmap-offload`: synth, warmup, verify, info, demo, vllm.

Every user-facing error is an ``errors.MmapOffloadError``: printed as one line, no traceback, exit
code 2 (bad input) or 1 (a cache that fails verification).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .errors import MmapOffloadError


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# -- synth ----------------------------------------------------------------------------------------
def cmd_synth(args) -> int:
    from .synth import PRESETS, make_checkpoint

    if args.preset and args.preset not in PRESETS:
        raise MmapOffloadError(f"unknown preset {args.preset!r}", f"use one of {', '.join(sorted(PRESETS))}")
    kwargs = dict(PRESETS[args.preset]) if args.preset else {}
    for key in ("arch", "quant", "num_layers", "num_experts", "hidden", "intermediate", "top_k", "group_size", "seed"):
        value = getattr(args, key)
        if value is not None:
            kwargs[key] = value
    if args.actorder:
        kwargs["actorder"] = True
    t0 = time.perf_counter()
    path = make_checkpoint(args.out_dir, **kwargs)
    total = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
    print(f"wrote checkpoint {path} ({_gib(total)}) in {time.perf_counter() - t0:.1f} s")
    return 0


# -- warmup ---------------------------------------------------------------------------------------
def cmd_warmup(args) -> int:
    from .warmup import warmup

    ranks = None if args.tp_rank is None else [args.tp_rank]
    report = warmup(
        args.checkpoint, args.cache_dir, tp_size=args.tp_size, tp_ranks=ranks, device=args.device,
        progress=not args.quiet, wait=args.wait, repair=args.repair,
    )
    dirs = ", ".join(str(d) for d in report.rank_dirs)
    if report.shards_rechecked:
        print(
            f"checkpoint shard(s) {', '.join(report.shards_rechecked)} changed since the warm-up: re-hashed "
            f"{_gib(report.recheck_bytes)} in {report.recheck_seconds:.1f} s; {report.layers_stale} layer(s) stale"
        )
    if args.repair:
        print(f"repair: {report.layers_corrupt} bad layer(s) found" + (", rewritten" if report.layers_corrupt else ""))
    if report.layers_written == 0:
        print(f"cache up to date: {dirs}" + (" (manifest refreshed)" if report.republished else "")
              + ("" if args.repair else "; layer checksums were not re-read (`--repair` re-reads them)"))
    else:
        print(
            f"wrote {report.layers_written} layer(s), {_gib(report.bytes_written)} in {report.seconds:.1f} s "
            f"({report.gbps:.2f} GB/s); reused {report.layers_reused}: {dirs}"
        )
    return 0


# -- verify / info --------------------------------------------------------------------------------
def _rank_dirs(cache_dir: str) -> list[Path]:
    from .cache_format import warmup_command
    from .cache_reader import is_rank_dir

    root = Path(cache_dir)
    if not root.exists():
        raise MmapOffloadError(f"{cache_dir} does not exist", "pass the --cache-dir given to `mmap-offload warmup`")
    if is_rank_dir(root):
        return [root]
    dirs = sorted(p for p in root.glob("rank-*-of-*") if p.is_dir())
    if not dirs:
        raise MmapOffloadError(f"no cache in {cache_dir}", f"build one with {warmup_command(root)}")
    return dirs


def _open(d: Path):
    from .cache_reader import open_cache

    rank, size = _rank_of(d)
    return open_cache(d, tp_rank=rank, tp_size=size)


def _rank_of(d: Path) -> tuple[int, int]:
    from .cache_format import MANIFEST_NAME, Manifest

    parts = d.name.split("-")
    if len(parts) == 4 and parts[0] == "rank" and parts[2] == "of":
        return int(parts[1]), int(parts[3])
    m = Manifest.loads((d / MANIFEST_NAME).read_bytes(), str(d / MANIFEST_NAME)) if (d / MANIFEST_NAME).exists() else None
    return (m.identity.tp_rank, m.identity.tp_size) if m else (0, 1)


def cmd_verify(args) -> int:
    bad = 0
    fixes = []
    for d in _rank_dirs(args.cache_dir):
        cache = _open(d)
        t0 = time.perf_counter()
        report = cache.verify()
        dt = time.perf_counter() - t0
        status = "OK" if report.ok else f"{len(report.mismatches)} MISMATCH(ES)"
        print(
            f"{d}: {report.layers} layers, {report.tensors} tensors, {_gib(report.bytes)} checked in {dt:.1f} s "
            f"({report.bytes / max(dt, 1e-9) / 1e9:.2f} GB/s): {status}"
        )
        for layer, expert, name in report.mismatches[:20]:
            print(f"  checksum mismatch: layer {layer} expert {expert} {name}")
        bad += len(report.mismatches)
        if report.mismatches and cache.repair_command() not in fixes:
            fixes.append(cache.repair_command())
    if bad:
        print(f"verify failed: {bad} tensor(s) do not match their checksum; rewrite the bad layers with "
              + " and ".join(fixes))
        return 1
    return 0


def cmd_info(args) -> int:
    for d in _rank_dirs(args.cache_dir):
        cache = _open(d)
        m = cache.manifest
        ident = m.identity
        total = sum(l["nbytes"] for l in m.layers)
        if args.json:
            obj = m.to_obj()
            obj.pop("tensors")
            obj["dir"] = str(d)
            print(json.dumps(obj, indent=1))
            continue
        q = ident.quantization
        print(f"cache {d}")
        print(f"  checkpoint   {m.checkpoint_path} ({ident.fingerprint[:23]}...)")
        print(f"  quantization {q['kind']}" + (f", group {q['group_size']}, act-order {q['actorder']}" if q["kind"] != "unquantized" else f", {q.get('weight_dtype')}"))
        print(f"  layout       {ident.layout_name} v{ident.layout_version}; TP rank {ident.tp_rank} of {ident.tp_size}")
        print(f"  model        {len(cache.layers)} MoE layers x {cache.num_experts} experts, hidden {m.moe['hidden']}, intermediate {m.moe['intermediate']}, " + (f"top-{m.moe['top_k']}" if m.moe.get("top_k") else "top-k unknown (no num_experts_per_tok in config.json)"))
        print(f"  expert       {_gib(cache.record_nbytes)} per record: " + ", ".join(f"{s.name} {list(s.shape)} {s.dtype}" for s in cache.expert_specs))
        print(f"  size         {_gib(total)} in {len(m.layers)} files, {_gib(m.layers[0]['nbytes']) if m.layers else 0} per layer")
    return 0


# -- demo: the embedded default --------------------------------------------------------------------
def cmd_demo(args) -> int:
    import torch

    from .cache_reader import open_cache
    from .synth import PRESETS, make_checkpoint
    from .warmup import warmup

    work = Path(args.workdir)
    ckpt_dir, cache_dir = work / "checkpoint", work / "cache"
    preset = PRESETS["demo"]
    t0 = time.perf_counter()
    make_checkpoint(ckpt_dir, **preset)
    print(f"[1/4] synthetic W4A16 MoE checkpoint -> {ckpt_dir} ({time.perf_counter() - t0:.1f} s): {preset}")
    report = warmup(ckpt_dir, cache_dir, tp_size=args.tp_size, progress=not args.quiet)
    print(
        f"[2/4] warm-up (Marlin repack, xxh3, atomic publish) -> {cache_dir}: {report.layers_written} layers, "
        f"{_gib(report.bytes_written)} in {report.seconds:.1f} s ({report.gbps:.2f} GB/s)"
    )
    for d in report.rank_dirs:
        r = _open(d).verify()
        if not r.ok:
            print(f"verify failed in {d}: {r.mismatches[:3]}")
            return 1
    print(f"[3/4] verify: every checksum matches in {len(report.rank_dirs)} rank cache(s)")

    from .transfer import Copy, make_engine

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cache = open_cache(cache_dir, 0, args.tp_size)
    engine = make_engine("auto", device)
    moved = 0
    t1 = time.perf_counter()
    try:
        for layer in cache.layers:
            ext = cache.layer_extent(layer)
            dst = torch.empty(ext.nbytes, dtype=torch.uint8, device=device)
            engine.wait(engine.submit([Copy(src=ext, dst=[(0, ext.nbytes, dst)])]))
            ref = torch.from_numpy(cache.layer_buffer(layer))
            if not torch.equal(dst.cpu(), ref):
                print(f"served bytes of layer {layer} differ from the cache")
                return 1
            moved += ext.nbytes
        metrics = dict(engine.metrics)
    finally:
        engine.close()
    dt = time.perf_counter() - t1
    print(
        f"[4/4] served {len(cache.layers)} layers ({_gib(moved)}) through the {metrics.get('engine', 'auto')} engine "
        f"to {device} in {dt:.2f} s, bytes identical; pinned staging {_gib(int(metrics.get('pinned_bytes', 0)))}"
    )
    return 0


# -- vllm launcher -------------------------------------------------------------------------------------
def cmd_vllm(args, rest: list[str]) -> int:
    from .vllm_backend import vllm_main

    return vllm_main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mmap-offload", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("synth", help="write a synthetic Hugging Face MoE checkpoint (no download)")
    s.add_argument("out_dir")
    s.add_argument("--preset", help="a named size (demo, tiny-mixtral, ...)")
    s.add_argument("--arch", choices=["mixtral", "qwen_moe", "qwen2_moe", "glm4_moe"])  # synth.ARCHS (not imported: torch)
    s.add_argument("--quant", choices=["w4a16", "bf16"])
    s.add_argument("--num-layers", type=int)
    s.add_argument("--num-experts", type=int)
    s.add_argument("--hidden", type=int)
    s.add_argument("--intermediate", type=int)
    s.add_argument("--top-k", type=int)
    s.add_argument("--group-size", type=int)
    s.add_argument("--actorder", action="store_true")
    s.add_argument("--seed", type=int)
    s.set_defaults(func=cmd_synth)

    w = sub.add_parser("warmup", help="build the expert cache (resumable, memory-bounded)")
    w.add_argument("checkpoint")
    w.add_argument("--cache-dir", required=True)
    w.add_argument("--tp-size", type=int, default=1)
    w.add_argument("--tp-rank", type=int, help="build only this rank (default: all)")
    w.add_argument("--device", default="auto", help="where to repack: auto (CUDA if present), cpu, cuda")
    w.add_argument("--wait", action="store_true", help="wait for another warm-up of the same cache instead of failing")
    w.add_argument("--repair", action="store_true",
                   help="read every layer of an existing cache, check its checksums and rewrite exactly the bad layers")
    w.add_argument("--quiet", action="store_true")
    w.set_defaults(func=cmd_warmup)

    v = sub.add_parser("verify", help="read every byte of a cache and check every checksum")
    v.add_argument("cache_dir")
    v.set_defaults(func=cmd_verify)

    i = sub.add_parser("info", help="what a cache holds")
    i.add_argument("cache_dir")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    d = sub.add_parser("demo", help="synth a small W4A16 MoE, warm up, verify, serve it (the quick start)")
    d.add_argument("--workdir", default="mmap-offload-demo")
    d.add_argument("--tp-size", type=int, default=1)
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(func=cmd_demo)

    sub.add_parser("vllm", help="run vLLM's CLI with `--offload-backend mmap` available (e.g. `mmap-offload vllm serve MODEL ...`)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "vllm":
            return cmd_vllm(None, argv[1:])
        args = build_parser().parse_args(argv)
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe raises here, inside the handler below, not at interpreter exit
        return rc
    except MmapOffloadError as e:
        print(f"mmap-offload: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("mmap-offload: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader of stdout went away (`mmap-offload info | head`): not an error. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
