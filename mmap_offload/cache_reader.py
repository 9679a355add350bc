"""Open a published cache: check it (docs/FORMAT.md, "Validity"), map layer files, hand out views.

Opening reads the manifest and stats the layer files; nothing else. Layer files are mapped on first
use (private, copy-on-write mappings: pages are shared with the page cache, and the views are
writable tensors without copies). ``verify`` reads every byte and checks every checksum.

    cache = open_cache("cache/", tp_rank=0, tp_size=1, expect=identity)
    cache.expert_extent(layer, expert)      # Extent(path, offset, nbytes): what engines read
    cache.tensor(layer, expert, "w2_weight") # zero-copy torch view
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .cache_format import (
    ALIGNMENT,
    JOURNAL_NAME,
    MANIFEST_NAME,
    CacheIdentity,
    Extent,
    Manifest,
    TensorSpec,
    cache_root,
    checksum,
    rank_dir_name,
    warmup_command,
)
from .errors import CacheError, CorruptCacheError, StaleCacheError, mapped_read_error


def is_rank_dir(path: Path) -> bool:
    """Whether ``path`` is one rank's cache directory (published, or a warm-up in progress)."""
    return (path / MANIFEST_NAME).exists() or (path / JOURNAL_NAME).exists()


def rank_dir(cache_dir: str | os.PathLike, tp_rank: int = 0, tp_size: int = 1) -> Path:
    """The directory holding one rank's cache: ``cache_dir`` itself if it has a manifest."""
    root = Path(cache_dir)
    if is_rank_dir(root):
        return root
    return root / rank_dir_name(tp_rank, tp_size)


def current_layout_version(name: str) -> int | None:
    """The version this build writes for layout ``name`` (None if unknown here)."""
    try:
        from .layout import LAYOUT_VERSIONS
    except ImportError:  # pragma: no cover - layout module always ships
        return None
    return LAYOUT_VERSIONS.get(name)


@dataclass
class VerifyReport:
    layers: int = 0
    tensors: int = 0
    bytes: int = 0
    mismatches: list[tuple[int, int, str]] = field(default_factory=list)  # (layer, expert, name)

    @property
    def ok(self) -> bool:
        return not self.mismatches


class Cache:
    """One rank's published cache. Cheap to create; thread-safe lazy mapping of layer files."""

    def __init__(self, directory: Path, manifest: Manifest):
        self.dir = directory
        self.manifest = manifest
        self.identity: CacheIdentity = manifest.identity
        self.layers: list[int] = [l["layer"] for l in manifest.layers]
        self.num_experts: int = int(manifest.moe["num_experts"])
        self.expert_specs: list[TensorSpec] = manifest.record
        self.record_nbytes: int = manifest.record_nbytes
        self._spec_by_name = {s.name: s for s in self.expert_specs}
        self._layer_info = {l["layer"]: l for l in manifest.layers}
        self._maps: dict[int, mmap.mmap] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self._map_lock = threading.Lock()
        self._checked: dict[int, list] = {}  # layer -> mismatches found by check_layer_once
        self._checked_experts: dict[int, dict[int, list]] = {}  # layer -> expert -> mismatches
        self._check_lock = threading.Lock()
        self._clean: dict[int, np.ndarray] = {}  # layer -> [E] uint8: 1 once the expert checked clean

    # -- where bytes are ------------------------------------------------------------------------
    def layer_file(self, layer: int) -> Path:
        return self.dir / self._layer_info[layer]["file"]

    def layer_extent(self, layer: int) -> Extent:
        return Extent(self.layer_file(layer), 0, int(self._layer_info[layer]["nbytes"]))

    def expert_extent(self, layer: int, expert: int) -> Extent:
        if not 0 <= expert < self.num_experts:
            raise IndexError(f"expert {expert} out of range [0, {self.num_experts})")
        return Extent(self.layer_file(layer), expert * self.record_nbytes, self.record_nbytes)

    def spec(self, name: str) -> TensorSpec:
        return self._spec_by_name[name]

    def expected_checksums(self, layer: int, expert: int) -> list[str]:
        """Checksums of the expert's tensors, in ``expert_specs`` order."""
        per_layer = len(self.expert_specs) * self.num_experts
        start = self.layers.index(layer) * per_layer + expert * len(self.expert_specs)
        return [row[8] for row in self.manifest.tensors[start : start + len(self.expert_specs)]]

    # -- zero-copy views ------------------------------------------------------------------------
    def _array(self, layer: int) -> np.ndarray:
        arr = self._arrays.get(layer)
        if arr is None:
            with self._map_lock:
                arr = self._arrays.get(layer)
                if arr is None:
                    with open(self.layer_file(layer), "rb") as f:
                        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                    self._maps[layer] = mm
                    arr = np.frombuffer(mm, dtype=np.uint8)
                    self._arrays[layer] = arr
        return arr

    def layer_buffer(self, layer: int) -> np.ndarray:
        """The whole layer file as a zero-copy uint8 view (its mapping)."""
        return self._array(layer)

    def expert_buffer(self, layer: int, expert: int) -> np.ndarray:
        ext = self.expert_extent(layer, expert)
        return self._array(layer)[ext.offset : ext.offset + ext.nbytes]

    def tensor(self, layer: int, expert: int, name: str) -> torch.Tensor:
        """Zero-copy view of the mapping; unguarded: reading it after a truncation or disk I/O error raises SIGBUS
        (the host kernel reads these views inside its own guard; ``fault_error`` names what failed)."""
        s = self.spec(name)
        start = expert * self.record_nbytes + s.offset
        raw = self._array(layer)[start : start + s.nbytes]
        return torch.from_numpy(raw).view(s.torch_dtype).view(s.shape)

    def fault_error(self, address: int) -> CacheError:
        """The one-line error of a read of this cache's mapping (``tensor``'s views: the host kernel's
        weights) that raised SIGBUS at ``address``: the file, the offset, the expert and tensor."""
        for layer, arr in list(self._arrays.items()):
            base = arr.ctypes.data
            if base <= address < base + arr.nbytes:
                off = address - base
                expert, within = divmod(off, self.record_nbytes)
                name = next((s.name for s in self.expert_specs if s.offset <= within < s.offset + s.nbytes), None)
                what = f"layer {layer} expert {expert}" + (f" {name}" if name else "")
                return mapped_read_error(self.layer_file(layer), off, what,
                                         f"check the disk, then {self.repair_command()}")
        return CacheError(f"reading a mapped file of the cache in {self.dir} at address {address:#x} failed (SIGBUS: "
                          "truncated, or an I/O error)", f"check the disk, then {self.repair_command()}")

    def close(self) -> None:
        """Drop the mappings (views handed out keep theirs alive until they are freed)."""
        with self._map_lock:
            self._arrays.clear()
            self._maps.clear()

    # -- checksums --------------------------------------------------------------------------------
    def verify_layer(self, layer: int, buf: np.ndarray | None = None) -> list[tuple[int, int, str]]:
        """Read one layer file (pread, not the mapping) and check every checksum in it; returns the
        (layer, expert, tensor) that do not match."""
        return self._verify_records(layer, range(self.num_experts), buf)

    def _verify_records(self, layer: int, experts, buf: np.ndarray | None = None) -> list[tuple[int, int, str]]:
        """pread each expert record of ``layer`` in ``experts`` and check its checksums."""
        if buf is None:
            buf = np.empty(self.record_nbytes, dtype=np.uint8)
        path = self.layer_file(layer)
        bad = []
        fd = os.open(path, os.O_RDONLY)
        try:
            for e in experts:
                n = os.preadv(fd, [buf], e * self.record_nbytes)
                if n != self.record_nbytes:
                    raise CorruptCacheError(f"{path} is truncated", f"rewrite it with {self.repair_command()}")
                for spec, want in zip(self.expert_specs, self.expected_checksums(layer, e)):
                    if checksum(buf[spec.offset : spec.offset + spec.nbytes]) != want:
                        bad.append((layer, e, spec.name))
        finally:
            os.close(fd)
        return bad

    def verify(self, progress=None) -> VerifyReport:
        """Read every byte and check every checksum."""
        report = VerifyReport()
        buf = np.empty(self.record_nbytes, dtype=np.uint8)
        for layer in self.layers:
            report.mismatches += self.verify_layer(layer, buf)
            report.layers += 1
            report.tensors += self.num_experts * len(self.expert_specs)
            report.bytes += self.num_experts * self.record_nbytes
            if progress is not None:
                progress(layer, report)
        return report

    def check_layer_once(self, layer: int) -> None:
        """Verify ``layer`` the first time this process serves it; raise CorruptCacheError on a
        mismatch (then on every later call too). The serving side calls this before a layer's
        first copy, so a flipped bit is never served (cost: one read of each layer per process)."""
        state = self._checked.get(layer)
        if state is None:
            with self._check_lock:
                state = self._checked.get(layer)
                if state is None:
                    bad = self.verify_layer(layer)
                    state = self._checked[layer] = bad
                    if not bad:
                        self.clean_mask(layer)[:] = 1
        if state:
            self._raise_corrupt(layer, state)

    def check_experts_once(self, layer: int, experts) -> None:
        """Verify these experts of ``layer`` the first time this process serves each of them (the
        expert cache's first-use check: it reads only the experts it fetches, not the whole layer;
        a layer already checked whole is not read again). Raises CorruptCacheError on a mismatch."""
        if layer in self._checked:
            return self.check_layer_once(layer)
        done = self._checked_experts.setdefault(layer, {})
        todo = [int(e) for e in experts if int(e) not in done]
        if todo:
            with self._check_lock:
                todo = [e for e in todo if e not in done]
                for e in todo:
                    done[e] = self._verify_records(layer, [e])
                    if not done[e]:
                        self.clean_mask(layer)[e] = 1
        bad = [m for e in experts for m in done.get(int(e), ())]
        if bad:
            self._raise_corrupt(layer, bad)

    def check_in_background(self, layers=None, nice: int = 19, after_layer=None) -> "BackgroundCheck":
        """Start checking every expert of ``layers`` (default: all) in a low-priority thread, so
        that first uses find their experts already checked instead of reading them on the serving
        path (``check_experts_once`` / ``check_layer_once`` use what it found). ``after_layer(layer)``
        runs in that thread once a layer is checked (the vLLM backend pre-faults the engine's
        mapping of it there). Returns the handle (``stop()``, counters)."""
        return BackgroundCheck(self, self.layers if layers is None else list(layers), nice=nice,
                               after_layer=after_layer)

    def _record_expert_check(self, layer: int, expert: int, bad: list) -> None:
        """A check of one expert made outside ``check_experts_once`` (the background thread)."""
        with self._check_lock:
            done = self._checked_experts.setdefault(layer, {})
            done.setdefault(expert, bad)
            if not done[expert]:
                self.clean_mask(layer)[expert] = 1
            if len(done) == self.num_experts and layer not in self._checked and not any(done.values()):
                self._checked[layer] = []  # every expert clean: the whole layer is (a bad one stays per expert)

    def clean_mask(self, layer: int) -> np.ndarray:
        """``[E]`` uint8 of ``layer``: 1 where this process checked the expert and found it clean
        (by any check: first use, background, whole layer), 0 where it has not checked it yet or
        found it corrupt. The same array for the whole run, written in place (the native expert
        step reads it: expert_step.py)."""
        m = self._clean.get(layer)
        if m is None:
            m = self._clean.setdefault(layer, np.zeros(self.num_experts, dtype=np.uint8))
        return m

    def _expert_checked(self, layer: int, expert: int) -> bool:
        return layer in self._checked or expert in self._checked_experts.get(layer, ())

    def _raise_corrupt(self, layer: int, bad: list) -> None:
        l, e, name = bad[0]
        raise CorruptCacheError(
            f"{len(bad)} tensor(s) of {self.layer_file(layer)} fail their checksum (first: layer {l} "
            f"expert {e} {name})",
            f"rewrite the bad layers with {self.repair_command()}",
        )

    def repair_command(self) -> str:
        """The command that re-checks this cache and rewrites exactly its bad layers."""
        return warmup_command(self.dir, self.manifest.checkpoint_path, tp_size=self.identity.tp_size, repair=True)


class BackgroundCheck:
    """``Cache.check_in_background``: one daemon thread reads and checksums every expert of the
    given layers (pread, like ``verify``; the GIL is held only for the hash, ~0.1 ms per 6 MB),
    lowest CPU priority first, skipping what the serving path already checked. A mismatch is
    recorded like a first-use check's: the serving path raises CorruptCacheError when it first
    needs that expert (or layer), nothing is served from it. Errors reading a file (truncated,
    EIO) end the thread and are left to the serving path's own check, which reports them."""

    def __init__(self, cache: Cache, layers: list[int], nice: int = 19, after_layer=None):
        self.cache = cache
        self.layers = layers
        self.nice = nice
        self.after_layer = after_layer
        self.layers_done = 0
        self.experts = 0  # checked by this thread
        self.bytes = 0
        self.seconds = 0.0
        self.mismatches = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mmap-offload-check", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)  # this thread only (Linux)
        except (AttributeError, OSError):
            pass
        c = self.cache
        buf = np.empty(c.record_nbytes, dtype=np.uint8)
        try:
            for layer in self.layers:
                for e in range(c.num_experts):
                    if self._stop.is_set():
                        return
                    if c._expert_checked(layer, e):
                        continue
                    bad = c._verify_records(layer, [e], buf)
                    c._record_expert_check(layer, e, bad)
                    self.experts += 1
                    self.bytes += c.record_nbytes
                    self.mismatches += len(bad)
                if self.after_layer is not None:
                    self.after_layer(layer)
                self.layers_done += 1
        except Exception as e:  # noqa: BLE001 - the serving path's own check reports it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.seconds = time.perf_counter() - t0

    def stop(self, wait: bool = True) -> None:
        self._stop.set()
        if wait:
            self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the pass is over (True) or ``timeout`` seconds went by (False)."""
        self._thread.join(timeout)
        return self.done

    def summary(self) -> dict:
        return dict(experts=self.experts, bytes=self.bytes, seconds=round(self.seconds, 3),
                    layers=self.layers_done, mismatches=self.mismatches, done=self.done, error=self.error)


def open_cache(
    cache_dir: str | os.PathLike,
    tp_rank: int = 0,
    tp_size: int = 1,
    expect: CacheIdentity | None = None,
) -> Cache:
    """Open one rank's cache; raise a one-line CacheError subtype if it cannot be served."""
    directory = rank_dir(cache_dir, tp_rank, tp_size)
    manifest_path = directory / MANIFEST_NAME
    # the --cache-dir to give warm-up is the directory above rank-R-of-N, even when a rank dir was passed
    fix_build = f"run {warmup_command(directory, tp_size=tp_size)}"
    if not manifest_path.exists():
        if (directory / JOURNAL_NAME).exists():
            ckpt = _journal_checkpoint(directory / JOURNAL_NAME)
            raise CacheError(f"the cache in {directory} is incomplete (a warm-up was interrupted)",
                             f"run {warmup_command(directory, ckpt, tp_size=tp_size)} to resume it")
        if Path(cache_dir).exists() and not directory.exists():
            present = sorted(p.name for p in Path(cache_dir).glob("rank-*-of-*"))
            if present:
                raise StaleCacheError(
                    f"{cache_dir} holds {', '.join(present)}, not {directory.name}",
                    f"{fix_build} for this TP size",
                )
        raise CacheError(f"no cache in {directory}", fix_build)
    try:
        data = manifest_path.read_bytes()
    except OSError as e:
        raise CacheError(f"cannot read {manifest_path} ({e.strerror})", "check the path and permissions") from None
    manifest = Manifest.loads(data, str(manifest_path))

    ident = manifest.identity
    if (ident.tp_rank, ident.tp_size) != (tp_rank, tp_size) and expect is None:
        expect = CacheIdentity(ident.fingerprint, ident.quantization, ident.layout_name, ident.layout_version, tp_rank, tp_size)
    if expect is not None:
        diffs = ident.differences(expect)
        if diffs:
            raise StaleCacheError(
                f"the cache in {directory} was made for another {diffs[0]}"
                + (f" (and {len(diffs) - 1} more difference(s))" if len(diffs) > 1 else ""),
                f"{fix_build} to rebuild it",
            )
    version = current_layout_version(ident.layout_name)
    if version is not None and version != ident.layout_version:
        raise StaleCacheError(
            f"the cache in {directory} has layout {ident.layout_name} v{ident.layout_version}; this "
            f"mmap-offload serves v{version}",
            f"{fix_build} to rebuild it",
        )

    _check_consistency(directory, manifest)
    return Cache(directory, manifest)


def _journal_checkpoint(path: Path) -> str | None:
    """The checkpoint path an interrupted warm-up recorded in its journal's first line (None if unreadable)."""
    import json

    try:
        with open(path, "rb") as f:
            head = json.loads(f.readline())
        return head.get("checkpoint_path") if isinstance(head.get("checkpoint_path"), str) else None
    except (OSError, ValueError, AttributeError):
        return None


def _check_consistency(directory: Path, m: Manifest) -> None:
    fix = f"rewrite it with {warmup_command(directory, m.checkpoint_path, tp_size=m.identity.tp_size)}"
    E = int(m.moe["num_experts"])
    if m.record_nbytes % ALIGNMENT or any(s.offset % ALIGNMENT for s in m.record):
        raise CorruptCacheError(f"{directory / MANIFEST_NAME} has unaligned offsets", fix)
    for l in m.layers:
        path = directory / l["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CorruptCacheError(f"{path} is missing", fix) from None
        if int(l["nbytes"]) != E * m.record_nbytes:
            raise CorruptCacheError(f"{directory / MANIFEST_NAME} gives {path.name} a wrong size", fix)
        if size != int(l["nbytes"]):
            what = "truncated" if size < int(l["nbytes"]) else "longer than recorded"
            raise CorruptCacheError(f"{path} is {what} ({size} of {l['nbytes']} bytes)", fix)
    n = len(m.record)
    if len(m.tensors) != len(m.layers) * E * n:
        raise CorruptCacheError(f"{directory / MANIFEST_NAME} has an incomplete tensor table", fix)
    for i, row in enumerate(m.tensors):
        li, rem = divmod(i, E * n)
        e, t = divmod(rem, n)
        spec = m.record[t]
        layer = m.layers[li]
        if (
            row[0] != layer["layer"] or row[1] != e or row[2] != spec.name or row[5] != layer["file"]
            or row[6] != e * m.record_nbytes + spec.offset or row[7] != spec.nbytes
        ):
            raise CorruptCacheError(f"{directory / MANIFEST_NAME} row {i} disagrees with the record layout", fix)
