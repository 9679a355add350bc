"""Build the cache from a checkpoint: read -> layout transform -> checksum -> append, per expert.

Memory stays bounded by a few experts: each expert's checkpoint tensors are read with ``pread`` (never
a mapped shard), transformed for every TP rank being built (on CUDA when a GPU is present; several
experts in parallel on CPU cores), written in order as one record per rank, and dropped. Layers are committed one at a time (docs/FORMAT.md, "Writing"), so an
interrupted warm-up resumes after the last complete layer and a finished one is a no-op.

    report = warmup("ckpt/", "cache/", tp_size=2)          # all ranks
    cache = ensure_cache("ckpt/", "cache/", tp_rank=1, tp_size=2)   # open, or build then open
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import __version__
from .cache_format import (
    CacheIdentity,
    Manifest,
    cache_root,
    layer_file_name,
    layout_specs,
    parse_rank_dir_name,
    rank_dir_name,
    source_hash_add,
    source_hash_hex,
    warmup_command,
)
from .cache_reader import Cache, is_rank_dir, open_cache
from .cache_writer import RankWriter, make_dir
from .checkpoint import Checkpoint, open_checkpoint
from .cpus import allowed_cpus
from .errors import CacheError, CorruptCacheError, StaleCacheError, StorageError, UnsupportedError
from .layout import Layout, layout_for


@dataclass
class WarmupReport:
    rank_dirs: list[Path] = field(default_factory=list)
    layers_written: int = 0
    layers_reused: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    layers_corrupt: int = 0  # layers of a published cache that failed their checksums (--repair) or size
    layers_stale: int = 0  # layers whose source shard changed (content hash differs): rewritten
    shards_rechecked: list[str] = field(default_factory=list)  # shards whose size/mtime changed: re-hashed
    recheck_bytes: int = 0  # checkpoint bytes read to re-hash them
    recheck_seconds: float = 0.0
    republished: int = 0  # rank caches whose manifest was rewritten without rewriting a layer

    @property
    def gbps(self) -> float:
        return self.bytes_written / self.seconds / 1e9 if self.seconds > 0 else 0.0


def cache_identity(ckpt: Checkpoint, layout: Layout, tp_rank: int, tp_size: int) -> CacheIdentity:
    return CacheIdentity(
        fingerprint=ckpt.fingerprint,
        quantization=ckpt.quant.to_dict(),
        layout_name=layout.name,
        layout_version=layout.version,
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def moe_dict(ckpt: Checkpoint) -> dict:
    moe = ckpt.moe
    return {
        "num_experts": int(moe.num_experts),
        "hidden": int(moe.hidden),
        "intermediate": int(moe.intermediate),
        "top_k": int(moe.top_k),
        "layers": [int(l) for l in moe.layers],
    }


def plan_manifest(ckpt: Checkpoint, layout: Layout, tp_rank: int, tp_size: int) -> Manifest:
    """The manifest a complete cache of this rank will have, minus the checksum table."""
    specs, record_nbytes = layout_specs(layout.expert_tensor_specs(ckpt.moe, ckpt.quant, tp_rank, tp_size))
    E = int(ckpt.moe.num_experts)
    return Manifest(
        checkpoint_path=str(Path(ckpt.path).resolve()),
        identity=cache_identity(ckpt, layout, tp_rank, tp_size),
        moe=moe_dict(ckpt),
        record_nbytes=record_nbytes,
        record=specs,
        layers=[{"layer": int(l), "file": layer_file_name(int(l)), "nbytes": E * record_nbytes} for l in ckpt.moe.layers],
        created_by=f"mmap-offload {__version__}",
    )


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``auto`` (CUDA if this torch sees a GPU, else CPU), ``cpu`` or ``cuda[:N]``; anything else, or CUDA
    where there is none, is refused with one line."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise UnsupportedError(f"unknown --device {device!r}", "use auto, cpu or cuda") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise UnsupportedError(f"--device {device} is not supported for the warm-up", "use auto, cpu or cuda")
    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise UnsupportedError(f"--device {device} but {why}", "use --device cpu (or auto)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UnsupportedError(f"--device {device} but only {torch.cuda.device_count()} CUDA device(s) are visible",
                               "pick a visible GPU, or --device auto")
    return dev


class SourceCheck:
    """Is the checkpoint still what a cache was made of? Shards whose size or mtime differ from the
    manifest's record are re-hashed (every expert tensor in them is read again: the cost of a re-check,
    docs/RELIABILITY.md); a layer is stale when its source hash of a changed shard differs. Results are
    memoised per shard, so several rank caches of one checkpoint cost one re-read."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self._partials: dict[str, dict[int, str]] = {}  # shard -> {layer: source hash now}
        self.bytes_read = 0
        self.seconds = 0.0

    def changed_shards(self, m: Manifest) -> list[str]:
        now = self.ckpt.shard_stats
        return [s["name"] for s in m.shards
                if s["name"] not in now or (s.get("size"), s.get("mtime_ns")) != tuple(now[s["name"]])]

    def partials(self, shard: str) -> dict[int, str]:
        got = self._partials.get(shard)
        if got is None:
            t0 = time.perf_counter()
            got = {}
            ckpt = self.ckpt
            for layer in ckpt.moe.layers:
                total, seen = 0, False
                for e in range(int(ckpt.moe.num_experts)):
                    for sufs in ckpt.expert_refs(layer, e).values():
                        for ref in sufs.values():
                            if ref.path.name != shard:
                                continue
                            t = ckpt.read(ref)
                            total = source_hash_add(total, ref.name, _raw(t))
                            self.bytes_read += ref.nbytes
                            seen = True
                if seen:
                    got[int(layer)] = source_hash_hex(total)
            self._partials[shard] = got
            self.seconds += time.perf_counter() - t0
        return got

    def stale_layers(self, m: Manifest) -> tuple[list[str], set[int]]:
        """(shards whose size/mtime changed, layers whose source bytes changed)."""
        changed = self.changed_shards(m)
        stale: set[int] = set()
        for shard in changed:
            if shard not in self.ckpt.shard_stats:
                stale |= {int(l["layer"]) for l in m.layers if shard in (l.get("source") or {})}
                continue
            now = self.partials(shard)
            for l in m.layers:
                if (l.get("source") or {}).get(shard) != now.get(int(l["layer"])):
                    stale.add(int(l["layer"]))
        return changed, stale


def _raw(t: torch.Tensor):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


def warmup(
    checkpoint: str | os.PathLike | Checkpoint,
    cache_dir: str | os.PathLike,
    *,
    tp_size: int = 1,
    tp_ranks: list[int] | None = None,
    device: str | torch.device | None = "auto",
    progress: bool = False,
    wait: bool = False,
    fsync: bool = True,
    repair: bool = False,
    sources: "SourceCheck | None" = None,
) -> WarmupReport:
    """Build (or resume, or confirm) the cache of ``checkpoint`` for the given TP ranks.

    A published cache is kept layer by layer: a layer file of the wrong size, or one read from a source
    shard whose content changed since (size/mtime differ and the shard's content hash too), is rewritten;
    ``repair=True`` also reads every layer file and rewrites exactly those failing a checksum."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    if tp_size < 1:
        raise UnsupportedError(f"--tp-size must be >= 1, got {tp_size}", "pass a positive TP size")
    ranks = list(range(tp_size)) if tp_ranks is None else list(tp_ranks)
    for r in ranks:
        if not 0 <= r < tp_size:
            raise UnsupportedError(f"--tp-rank {r} is outside TP size {tp_size}", f"pass a rank in 0..{tp_size - 1}")
    layout = layout_for(ckpt.quant)
    dev = resolve_device(device)
    # Every shape rule is checked here, for every rank, before anything is written.
    plans = {r: plan_manifest(ckpt, layout, r, tp_size) for r in ranks}

    root = Path(cache_dir)
    if parse_rank_dir_name(root.name) and is_rank_dir(root):
        root = root.parent  # given one rank's directory (as `verify` prints it): its cache is the parent
    make_dir(root)
    report = WarmupReport()
    t0 = time.perf_counter()
    sources = sources if sources is not None and sources.ckpt is ckpt else SourceCheck(ckpt)  # re-hash once

    def recheck_for(d: Path):
        def recheck(old: Manifest):
            changed, stale = sources.stale_layers(old)
            report.shards_rechecked = sorted(set(report.shards_rechecked) | set(changed))
            bad = set(stale)
            report.layers_stale += len(stale)
            if repair:
                cache = Cache(d, old)
                for layer in cache.layers:
                    if layer in bad:
                        continue
                    try:
                        if cache.verify_layer(layer):
                            bad.add(layer)
                    except (CorruptCacheError, OSError):
                        bad.add(layer)
            if not bad and not changed:
                return None
            if not bad:
                report.republished += 1
            return bad
        return recheck

    with ExitStack() as stack:
        writers = {}
        for r in ranks:
            d = root / rank_dir_name(r, tp_size)
            writers[r] = stack.enter_context(RankWriter(d, plans[r], wait=wait, fsync=fsync,
                                                        shard_stats=ckpt.shard_stats, recheck=recheck_for(d)))
            report.rank_dirs.append(d)
        report.layers_corrupt = sum(len(w.rewritten) for w in writers.values()) - report.layers_stale
        todo_bytes = sum(
            l["nbytes"] for r, w in writers.items() if not w.complete for l in plans[r].layers if l["layer"] not in w.done_layers
        )
        _check_free_space(root, todo_bytes)

        layers = list(ckpt.moe.layers)
        bar = _progress(len(layers), enabled=progress)
        n_workers = transform_workers(dev)
        pool = (stack.enter_context(ThreadPoolExecutor(n_workers, "mmap-offload-prepare")),
                stack.enter_context(ThreadPoolExecutor(1, "mmap-offload-write")), n_workers)
        # Layer L's fsync (disk-bound) overlaps writing layer L + 1 (memory-bound); one in flight.
        committer = stack.enter_context(ThreadPoolExecutor(1, "mmap-offload-commit"))
        commit = None

        def finish(fut) -> None:
            report.bytes_written += fut.result()
            report.layers_written += 1
            elapsed = time.perf_counter() - t0
            bar.set_postfix_str(f"{report.bytes_written / max(elapsed, 1e-9) / 1e9:.2f} GB/s")
            bar.update(1)

        try:
            for layer in layers:
                pending = [r for r, w in writers.items() if not w.complete and layer not in w.done_layers]
                if not pending:
                    report.layers_reused += 1
                    bar.update(1)
                    continue
                written = _write_layer(ckpt, layout, layer, {r: writers[r] for r in pending}, tp_size, dev, report, pool)
                if commit is not None:
                    fut, commit = commit, None
                    finish(fut)
                commit = committer.submit(_commit_all, written)
            if commit is not None:
                fut, commit = commit, None
                finish(fut)
        finally:
            if commit is not None:  # an error elsewhere: let the layer in flight land or abort
                try:
                    commit.result()
                except BaseException:
                    pass
            bar.close()
        for w in writers.values():
            w.publish()
    report.seconds = time.perf_counter() - t0
    report.recheck_bytes, report.recheck_seconds = sources.bytes_read, sources.seconds
    return report


def _prepare_expert(ckpt, layout, layer, expert, ranks, tp_size, dev) -> tuple[int, dict, dict]:
    """Read one expert and transform it for every rank: (bytes read, {rank: cache tensors}, {shard: source
    hash of the tensors read from it})."""
    refs = ckpt.expert_refs(layer, expert)
    tensors = {p: {k: ckpt.read(r) for k, r in sufs.items()} for p, sufs in refs.items()}
    nread = sum(t.numel() * t.element_size() for parts in tensors.values() for t in parts.values())
    src: dict[str, int] = {}
    for p, sufs in refs.items():
        for k, r in sufs.items():
            src[r.path.name] = source_hash_add(src.get(r.path.name, 0), r.name, _raw(tensors[p][k]))
    if dev.type != "cpu":
        tensors = {p: {k: t.to(dev, non_blocking=True) for k, t in parts.items()} for p, parts in tensors.items()}
    return nread, {r: layout.transform_expert(tensors, ckpt.quant, r, tp_size, dev) for r in ranks}, src


def transform_workers(dev: torch.device) -> int:
    """Experts prepared at once: one per core up to 8 on CPU (torch ops release the GIL, and vLLM-like
    OMP_NUM_THREADS=1 makes each single-threaded); 2 on CUDA (one's transfers overlap the other's repack)."""
    if dev.type != "cpu":
        return 2
    return max(1, min(8, len(allowed_cpus())))


def _write_layer(ckpt, layout, layer, writers: dict[int, RankWriter], tp_size, dev, report, pool) -> None:
    """One layer as a pipeline: N workers read + transform experts in parallel | one thread writes
    them in order. At most N + 2 experts are in memory at once (N = ``transform_workers``)."""
    prep_pool, write_pool, n_workers = pool
    layer_writers = {r: w.begin_layer(layer) for r, w in writers.items()}
    ranks = list(layer_writers)
    E = int(ckpt.moe.num_experts)
    preps: list = []
    writes: list = []
    src: dict[str, int] = {}
    try:
        preps = [prep_pool.submit(_prepare_expert, ckpt, layout, layer, e, ranks, tp_size, dev)
                 for e in range(min(n_workers, E))]
        for e in range(E):
            nread, outs, part = preps[e].result()
            preps[e] = None
            for shard, h in part.items():
                src[shard] = (src.get(shard, 0) + h) & ((1 << 128) - 1)
            if e + n_workers < E:
                preps.append(prep_pool.submit(_prepare_expert, ckpt, layout, layer, e + n_workers, ranks, tp_size, dev))
            report.bytes_read += nread
            while len(writes) >= 2:
                writes.pop(0).result()
            writes.append(write_pool.submit(_write_expert_all, layer_writers, e, outs))
            del outs
        while writes:
            writes.pop(0).result()
        for lw in layer_writers.values():
            lw.source = {shard: source_hash_hex(h) for shard, h in sorted(src.items())}
    except BaseException:
        for f in [*preps, *writes]:
            if f is not None:
                f.cancel()
        for f in [*preps, *writes]:
            if f is not None:
                try:
                    f.result()
                except BaseException:
                    pass
        for lw in layer_writers.values():
            lw.abort()
        raise
    return list(layer_writers.values())


def _commit_all(layer_writers) -> int:
    """fsync + rename + journal every rank's file of one layer (runs on the commit thread)."""
    try:
        for lw in layer_writers:
            lw.commit()
    except BaseException:
        for lw in layer_writers:
            lw.abort()
        raise
    return sum(lw.bytes_written for lw in layer_writers)


def _write_expert_all(layer_writers, expert: int, outs: dict) -> None:
    for r, lw in layer_writers.items():
        lw.write_expert(expert, outs[r])


def _check_free_space(root: Path, needed: int) -> None:
    free = shutil.disk_usage(root).free
    if needed > free:
        raise StorageError(
            f"not enough free space in {root}: the cache needs {needed / 2**30:.2f} GiB more, "
            f"{free / 2**30:.2f} GiB are free",
            "free space or pass another --cache-dir",
        )


class _NoBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="layer", desc="warm-up", dynamic_ncols=True)


def ensure_cache(
    checkpoint: str | os.PathLike | Checkpoint,
    cache_dir: str | os.PathLike,
    tp_rank: int = 0,
    tp_size: int = 1,
    *,
    device: str | torch.device | None = "auto",
    rebuild: bool = True,
    progress: bool = False,
) -> Cache:
    """Open this rank's cache if it is valid for ``checkpoint``; else build it (``rebuild``) or refuse."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    expect = cache_identity(ckpt, layout_for(ckpt.quant), tp_rank, tp_size)
    sources = None
    try:
        cache = open_cache(cache_dir, tp_rank, tp_size, expect=expect)
    except CacheError:
        if not rebuild:
            raise
    else:
        sources = SourceCheck(ckpt)
        changed, stale = sources.stale_layers(cache.manifest)
        if not changed:
            return cache
        if not rebuild:
            if not stale:
                return cache  # touched, same content (re-hashed on every open until a warm-up records it)
            raise StaleCacheError(
                f"checkpoint shard {changed[0]} changed since the warm-up of {cache.dir} ({len(stale)} layer(s) "
                f"hold its old bytes)",
                f"rewrite them with {warmup_command(cache.dir, str(ckpt.path))}",
            )
        cache.close()
    warmup(ckpt, cache_dir, tp_size=tp_size, tp_ranks=[tp_rank], device=device, progress=progress, wait=True,
           sources=sources)
    return open_cache(cache_dir, tp_rank, tp_size, expect=expect)
