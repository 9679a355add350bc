"""Write one rank directory of a cache: lock, journal, per-layer temp file, fsync, rename, publish.

The protocol is docs/FORMAT.md, "Writing". In short:

    with RankWriter(rank_dir, manifest) as w:       # flock; stale manifest removed; journal read
        for layer in layers:
            if layer in w.done_layers: continue      # resume
            lw = w.begin_layer(layer)                # layer-N.bin.partial
            for e in range(E): lw.write_expert(e, tensors)   # one write per expert record
            lw.commit()                              # fsync, rename, journal line, fsync
        w.publish()                                  # manifest.json.partial -> manifest.json

Any exception inside a layer removes its ``.partial`` file; completed layers stay for a resume.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
from pathlib import Path

import numpy as np
import torch

from .cache_format import (
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    CacheIdentity,
    Manifest,
    checksum,
    layer_file_name,
    source_hash_hex,
)
from .errors import CacheLockedError, MmapOffloadError, StorageError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_FAULT_COUNTS: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Crash-test hook: ``MMAP_OFFLOAD_FAULT=name:N`` SIGKILLs this process the N-th time it passes ``name``.

    The crash tests use it to kill a warm-up at exact points of the publish protocol; unset, it costs
    one dict lookup."""
    spec = os.environ.get("MMAP_OFFLOAD_FAULT")
    if not spec:
        return
    want, _, count = spec.partition(":")
    if want != name:
        return
    _FAULT_COUNTS[name] = _FAULT_COUNTS.get(name, 0) + 1
    if _FAULT_COUNTS[name] >= int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def storage_error(e: OSError, path: Path) -> MmapOffloadError:
    """Turn an OSError raised while writing under ``path`` into one line naming cause and fix."""
    if e.errno in _NO_SPACE:
        return StorageError(f"disk full while writing {path}", "free space or pass another --cache-dir")
    if e.errno in (errno.EROFS,):
        return StorageError(f"{path} is on a read-only file system", "pass a writable --cache-dir")
    if e.errno in (errno.EACCES, errno.EPERM):
        return StorageError(f"no permission to write {path}", "pass a --cache-dir you can write to")
    return StorageError(f"cannot write {path} ({os.strerror(e.errno or 0)})", "check the --cache-dir")


def make_dir(path: Path) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise storage_error(e, path) from None
    if not os.access(path, os.W_OK):
        raise StorageError(f"no permission to write {path}", "pass a --cache-dir you can write to")


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous().cpu()
    return t.view(-1).view(torch.uint8).numpy()


def _write_all(fd: int, buf: memoryview, path: Path) -> None:
    try:
        while len(buf):
            n = os.write(fd, buf)
            buf = buf[n:]
    except OSError as e:
        raise storage_error(e, path) from None


class RankWriter:
    """Builds ``manifest`` (its identity, moe, record and layer list) in ``rank_dir``.

    ``manifest.tensors`` is filled in as layers are written; ``manifest.layers`` must list every
    layer (``{"layer", "file", "nbytes"}``) before the writer is entered.
    """

    def __init__(self, rank_dir: Path, manifest: Manifest, *, wait: bool = False, fsync: bool = True,
                 shard_stats: dict[str, tuple[int, int]] | None = None, recheck=None):
        self.dir = Path(rank_dir)
        self.manifest = manifest
        self.wait = wait
        self.fsync = fsync
        # source shard name -> (size, mtime_ns) now; a journaled layer read from a shard that has changed
        # since is not trusted on resume. None: sources are not tracked (tests writing raw caches).
        self.shard_stats = shard_stats
        # recheck(old_manifest) -> set of layers to rewrite, or None when the published cache is up to
        # date; an empty set republishes the manifest (e.g. to record a touched shard's new mtime).
        self.recheck = recheck
        self.done_layers: dict[int, list] = {}  # layer -> its rows of the tensor table
        self.done_sources: dict[int, dict] = {}  # layer -> {shard name: source hash of its bytes read}
        self.complete = False
        self.rewritten: set[int] = set()  # layers of a published cache found bad and rewritten
        self._lock_fd: int | None = None

    # -- lock -----------------------------------------------------------------------------------
    def __enter__(self) -> "RankWriter":
        make_dir(self.dir)
        self._lock()
        try:
            self._prepare()
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._unlock()

    def _lock(self) -> None:
        path = self.dir / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise storage_error(e, path) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if self.wait else fcntl.LOCK_NB))
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise CacheLockedError(
                f"another warm-up (pid {holder}) is writing {self.dir}",
                "wait for it to finish, or rerun with --wait",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                os.ftruncate(self._lock_fd, 0)
            except OSError:
                pass
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    # -- resume ---------------------------------------------------------------------------------
    def _journal_header(self) -> dict:
        m = self.manifest
        return {
            "journal": 1,
            "identity": m.identity.to_json(),
            "moe": m.moe,
            "record": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in m.record],
            "record_nbytes": m.record_nbytes,
            "checkpoint_path": m.checkpoint_path,  # informative (named in the resume hint), not compared
        }

    def _prepare(self) -> None:
        """Decide what is already done; remove everything that cannot be trusted."""
        manifest_path = self.dir / MANIFEST_NAME
        header = json.loads(json.dumps(self._journal_header()))  # normalise tuples -> lists
        journal = self.dir / JOURNAL_NAME
        expected_sizes = {l["layer"]: l["nbytes"] for l in self.manifest.layers}
        old = None
        if manifest_path.exists():
            old = self._existing_manifest(manifest_path)
            if old is not None:
                bad = {l["layer"] for l in old.layers if not self._file_ok(l)}
                more = self.recheck(old) if self.recheck is not None else None
                if not bad and more is None:
                    self.complete = True
                    journal.unlink(missing_ok=True)  # a crash right after publish
                    return
                bad |= set(more or ())
                self.rewritten = bad
                per_layer = len(old.record) * int(old.moe["num_experts"])
                for i, l in enumerate(old.layers):
                    if l["layer"] not in bad:
                        self.done_layers[l["layer"]] = old.tensors[i * per_layer : (i + 1) * per_layer]
                        self.done_sources[l["layer"]] = dict(l.get("source") or {})
            manifest_path.unlink()  # stale: stop it being valid before touching any data file
            fsync_dir(self.dir)
        if old is None and journal.exists():
            lines = journal.read_bytes().split(b"\n")
            entries = []
            for raw in lines:
                try:
                    entries.append(json.loads(raw))
                except ValueError:
                    break  # torn last line (or garbage): everything after it is ignored
            def same(h) -> bool:
                return isinstance(h, dict) and {k: v for k, v in h.items() if k != "checkpoint_path"} == {
                    k: v for k, v in header.items() if k != "checkpoint_path"}

            if entries and same(entries[0]):
                for entry in entries[1:]:
                    layer = entry.get("layer")
                    path = self.dir / layer_file_name(layer) if isinstance(layer, int) else None
                    if (
                        path is not None
                        and layer in expected_sizes
                        and path.exists()
                        and path.stat().st_size == expected_sizes[layer]
                        and self._sources_unchanged(entry.get("stat"))
                    ):
                        self.done_layers[layer] = entry["rows"]
                        self.done_sources[layer] = dict(entry.get("src") or {})
        # Rewrite the journal with exactly what is trusted (drops torn or stale lines).
        self._journal_rewrite(header)
        keep = {layer_file_name(l) for l in self.done_layers}
        for p in [*self.dir.glob("layer-*.bin*"), *self.dir.glob("*.partial")]:
            if p.name not in keep:
                p.unlink(missing_ok=True)

    def _existing_manifest(self, path: Path) -> Manifest | None:
        """The published manifest if it describes what is being built (its layer files may still be
        bad: the caller checks them), else None."""
        try:
            old = Manifest.loads(path.read_bytes(), str(path))
        except MmapOffloadError:
            return None
        m = self.manifest

        def files(layers):
            return [(l["layer"], l["file"], l["nbytes"]) for l in layers]

        if (old.identity, old.moe, old.record, old.record_nbytes, files(old.layers)) != (
            m.identity,
            m.moe,
            m.record,
            m.record_nbytes,
            files(m.layers),
        ):
            return None
        return old

    def _file_ok(self, layer: dict) -> bool:
        p = self.dir / layer["file"]
        try:
            return p.stat().st_size == layer["nbytes"]
        except OSError:
            return False

    def _sources_unchanged(self, stat: dict | None) -> bool:
        if self.shard_stats is None or not stat:
            return True
        return all(tuple(self.shard_stats.get(name, ())) == tuple(v) for name, v in stat.items())

    def _layer_stat(self, layer: int) -> dict:
        if self.shard_stats is None:
            return {}
        return {name: list(self.shard_stats[name]) for name in self.done_sources.get(layer, {})
                if name in self.shard_stats}

    def _write_whole(self, path: Path, data: bytes, fault: str | None = None) -> None:
        """``data`` as ``path``, whole or not at all: a temp file beside it (flushed; fsynced, and the
        directory after the rename, when ``fsync``), renamed over it; ``fault``: a fault_point between
        the write and the rename. An OSError removes the temp file and raises one StorageError."""
        tmp = path.with_name(path.name + ".partial")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            if fault:
                fault_point(fault)
            os.replace(tmp, path)
            if self.fsync:
                fsync_dir(self.dir)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise storage_error(e, path) from None

    def _journal_rewrite(self, header: dict) -> None:
        lines = [header] + [{"layer": l, "rows": r, "src": self.done_sources.get(l, {}), "stat": self._layer_stat(l)}
                            for l, r in sorted(self.done_layers.items())]
        self._write_whole(self.dir / JOURNAL_NAME,
                          b"".join(json.dumps(x, separators=(",", ":")).encode() + b"\n" for x in lines))

    def _journal_append(self, entry: dict) -> None:
        path = self.dir / JOURNAL_NAME
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            try:
                _write_all(fd, memoryview(json.dumps(entry, separators=(",", ":")).encode() + b"\n"), path)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            raise storage_error(e, path) from None

    # -- writing --------------------------------------------------------------------------------
    def begin_layer(self, layer: int) -> "LayerWriter":
        return LayerWriter(self, layer)

    def _layer_done(self, layer: int, rows: list, source: dict | None = None) -> None:
        self.done_sources[layer] = dict(source or {})
        self._journal_append({"layer": layer, "rows": rows, "src": self.done_sources[layer],
                              "stat": self._layer_stat(layer)})
        self.done_layers[layer] = rows

    def publish(self) -> Manifest:
        """Write manifest.json atomically; afterwards the cache is valid. Removes the journal."""
        m = self.manifest
        if self.complete:
            return m
        missing = [l["layer"] for l in m.layers if l["layer"] not in self.done_layers]
        if missing:
            raise RuntimeError(f"publish with layers not written: {missing}")
        m.tensors = [row for l in m.layers for row in self.done_layers[l["layer"]]]
        m.layers = [{**l, "source": self.done_sources.get(l["layer"], {})} for l in m.layers]
        totals: dict[str, int] = {}
        for l in m.layers:
            for name, hexsum in l["source"].items():
                totals[name] = (totals.get(name, 0) + int(hexsum, 16)) & ((1 << 128) - 1)
        stats = self.shard_stats or {}
        m.shards = [{"name": name, "size": stats[name][0] if name in stats else None,
                     "mtime_ns": stats[name][1] if name in stats else None, "hash": source_hash_hex(total)}
                    for name, total in sorted(totals.items())]
        self._write_whole(self.dir / MANIFEST_NAME, m.dumps(), fault="manifest-written")
        fault_point("manifest-renamed")
        (self.dir / JOURNAL_NAME).unlink(missing_ok=True)
        self.complete = True
        return m


class LayerWriter:
    """One layer file being written: expert records in order, one write each."""

    def __init__(self, owner: RankWriter, layer: int):
        self.owner = owner
        self.layer = layer
        self.file = layer_file_name(layer)
        self.path = owner.dir / self.file
        self.partial = self.path.with_name(self.file + ".partial")
        self.rows: list = []
        self.source: dict[str, str] = {}  # {shard name: source hash} of the checkpoint bytes this layer was made of
        self.next_expert = 0
        self.bytes_written = 0
        m = owner.manifest
        self._record = np.zeros(m.record_nbytes, dtype=np.uint8)  # padding stays zero forever
        try:
            self._fd = os.open(self.partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:
            raise storage_error(e, self.partial) from None

    def write_expert(self, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        m = self.owner.manifest
        if expert != self.next_expert:
            raise RuntimeError(f"experts must be written in order: got {expert}, expected {self.next_expert}")
        base = expert * m.record_nbytes
        try:
            for spec in m.record:
                t = tensors[spec.name]
                if tuple(t.shape) != spec.shape or t.dtype != spec.torch_dtype:
                    raise RuntimeError(
                        f"layout produced {spec.name} {tuple(t.shape)} {t.dtype}, record says "
                        f"{spec.shape} {spec.dtype}"
                    )
                raw = _tensor_bytes(t)
                dst = self._record[spec.offset : spec.offset + spec.nbytes]
                np.copyto(dst, raw)
                self.rows.append(
                    [self.layer, expert, spec.name, spec.dtype, list(spec.shape), self.file,
                     base + spec.offset, spec.nbytes, checksum(dst)]
                )
            _write_all(self._fd, memoryview(self._record), self.partial)
            fault_point("expert-written")
        except BaseException:
            self.abort()
            raise
        self.bytes_written += m.record_nbytes
        self.next_expert += 1

    def commit(self) -> None:
        """fsync + rename the layer file, then journal it. After this the layer survives a crash."""
        owner = self.owner
        try:
            if self.next_expert != owner.manifest.moe["num_experts"]:
                raise RuntimeError(f"layer {self.layer} committed with {self.next_expert} experts")
            try:
                if owner.fsync:
                    os.fsync(self._fd)
            except OSError as e:
                raise storage_error(e, self.partial) from None
            os.close(self._fd)
            self._fd = -1
            os.replace(self.partial, self.path)
            if owner.fsync:
                fsync_dir(owner.dir)
            fault_point("layer-renamed")
        except BaseException:
            self.abort()
            raise
        owner._layer_done(self.layer, self.rows, self.source)
        fault_point("layer-journaled")

    def abort(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.partial.unlink(missing_ok=True)

