"""The cache format of docs/FORMAT.md, as data: names, alignment, checksums, the manifest.

This module is the literal implementation of docs/FORMAT.md; change both together and bump
FORMAT_VERSION when the bytes on disk change meaning.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import xxhash

FORMAT_NAME = "mmap-offload-cache"
FORMAT_VERSION = 2  # 2: checkpoint.shards (size, mtime, content hash of what warm-up read) + layers[].source
SOURCE_HASH_NAME = "xxh3-128-sum"
ALIGNMENT = 4096
CHECKSUM_NAME = "xxh3-64"
MANIFEST_NAME = "manifest.json"
JOURNAL_NAME = "journal.jsonl"
LOCK_NAME = ".lock"

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "int8": torch.int8,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def checksum(buf) -> str:
    """xxh3-64 of a bytes-like object (numpy arrays and memoryviews included), as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(buf)


def rank_dir_name(tp_rank: int, tp_size: int) -> str:
    return f"rank-{tp_rank}-of-{tp_size}"


def layer_file_name(layer: int) -> str:
    return f"layer-{layer:05d}.bin"


_RANK_DIR_RE = re.compile(r"^rank-(\d+)-of-(\d+)$")


def parse_rank_dir_name(name: str) -> tuple[int, int] | None:
    """(rank, size) of a ``rank-R-of-N`` directory name, else None."""
    m = _RANK_DIR_RE.match(name)
    return (int(m[1]), int(m[2])) if m else None


def cache_root(rank_directory: str | Path) -> Path:
    """The ``--cache-dir`` that holds ``rank_directory`` (its parent when it is named rank-R-of-N)."""
    d = Path(rank_directory)
    return d.parent if parse_rank_dir_name(d.name) else d


def repair_command_for(path: str | Path) -> str:
    """The repair command for a cache file (its rank directory's manifest names the checkpoint; best
    effort, for errors raised where only a file path is known, as in the transfer engines)."""
    d = Path(path).parent
    ckpt = None
    try:
        obj = json.loads((d / MANIFEST_NAME).read_bytes())
        ckpt = obj["checkpoint"]["path"] if isinstance(obj["checkpoint"]["path"], str) else None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return warmup_command(d, ckpt, repair=True)


def warmup_command(rank_directory: str | Path, checkpoint: str | None = None, *, tp_size: int | None = None,
                   repair: bool = False) -> str:
    """The `mmap-offload warmup ...` command line that (re)builds the cache in ``rank_directory``:
    its --cache-dir is the directory above the rank directory (never the rank directory itself)."""
    d = Path(rank_directory)
    parsed = parse_rank_dir_name(d.name)
    size = tp_size if tp_size is not None else (parsed[1] if parsed else 1)
    cmd = f"mmap-offload warmup {shlex.quote(str(checkpoint)) if checkpoint else 'CHECKPOINT'} " \
          f"--cache-dir {shlex.quote(str(cache_root(d)))}"
    if size != 1:
        cmd += f" --tp-size {size}"
    if repair:
        cmd += " --repair"
    return f"`{cmd}`"


def source_hash_add(total: int, name: str, data) -> int:
    """Add one checkpoint tensor (its name and raw bytes) to a source hash: the sum modulo 2**128 of
    xxh3-128(name NUL bytes) over the tensors, so it does not depend on the order they were read in."""
    h = xxhash.xxh3_128()
    h.update(name.encode() + b"\0")
    h.update(data)
    return (total + h.intdigest()) & ((1 << 128) - 1)


def source_hash_hex(total: int) -> str:
    return f"{total:032x}"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an expert record: its place inside the record and what it holds."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    offset: int = 0  # bytes from the start of the expert record; multiple of ALIGNMENT
    nbytes: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class Extent:
    """A byte range of a file: the unit every transfer engine reads."""

    path: Path
    offset: int
    nbytes: int


def layout_specs(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[list[TensorSpec], int]:
    """Place (name, dtype, shape) triples one after another, each at an aligned offset.

    Returns the placed specs and the record size (a multiple of ALIGNMENT)."""
    placed, offset = [], 0
    for name, dtype, shape in specs:
        nbytes = DTYPES[dtype].itemsize
        for d in shape:
            nbytes *= int(d)
        placed.append(TensorSpec(name, dtype, tuple(int(d) for d in shape), offset, nbytes))
        offset = align_up(offset + nbytes)
    return placed, offset


@dataclass(frozen=True)
class CacheIdentity:
    """What a cache was built for. Two caches with equal identities hold the same bytes."""

    fingerprint: str
    quantization: dict
    layout_name: str
    layout_version: int
    tp_rank: int
    tp_size: int

    def differences(self, other: "CacheIdentity") -> list[str]:
        """Human-readable fields where ``self`` (the cache) differs from ``other`` (expected)."""
        out = []
        if self.fingerprint != other.fingerprint:
            out.append("checkpoint (fingerprint differs: made from another or a modified checkpoint)")
        if self.quantization != other.quantization:
            out.append(f"quantization (cache {_short(self.quantization)}, expected {_short(other.quantization)})")
        if self.layout_name != other.layout_name:
            out.append(f"layout (cache {self.layout_name}, expected {other.layout_name})")
        elif self.layout_version != other.layout_version:
            out.append(
                f"layout version (cache {self.layout_name} v{self.layout_version}, "
                f"this mmap-offload writes v{other.layout_version})"
            )
        if (self.tp_rank, self.tp_size) != (other.tp_rank, other.tp_size):
            out.append(
                f"TP (cache rank {self.tp_rank} of {self.tp_size}, expected rank {other.tp_rank} of {other.tp_size})"
            )
        return out

    def to_json(self) -> dict:
        return {
            "checkpoint_fingerprint": self.fingerprint,
            "quantization": self.quantization,
            "layout": {"name": self.layout_name, "version": self.layout_version},
            "tp": {"rank": self.tp_rank, "size": self.tp_size},
        }


def _short(q: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(q.items()))


TENSOR_COLUMNS = ["layer", "expert", "name", "dtype", "shape", "file", "offset", "length", "checksum"]


@dataclass
class Manifest:
    """manifest.json as Python objects (see docs/FORMAT.md for every key)."""

    checkpoint_path: str
    identity: CacheIdentity
    moe: dict
    record_nbytes: int
    record: list[TensorSpec]
    layers: list[dict]  # {"layer", "file", "nbytes"}
    tensors: list[list] = field(default_factory=list)  # rows of TENSOR_COLUMNS
    created_by: str = ""
    shards: list[dict] = field(default_factory=list)  # {"name", "size", "mtime_ns", "hash"} per source shard

    def to_obj(self) -> dict:
        obj = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "created_by": self.created_by,
            "checkpoint": {"path": self.checkpoint_path, "fingerprint": self.identity.fingerprint,
                           "source_hash": SOURCE_HASH_NAME, "shards": self.shards},
            "quantization": self.identity.quantization,
            "layout": {"name": self.identity.layout_name, "version": self.identity.layout_version},
            "tp": {"rank": self.identity.tp_rank, "size": self.identity.tp_size},
            "moe": self.moe,
            "alignment": ALIGNMENT,
            "checksum": CHECKSUM_NAME,
            "expert_record": {
                "nbytes": self.record_nbytes,
                "tensors": [
                    {"name": s.name, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes}
                    for s in self.record
                ],
            },
            "layers": self.layers,
            "tensor_columns": TENSOR_COLUMNS,
            "tensors": self.tensors,
        }
        return obj

    def dumps(self) -> bytes:
        obj = self.to_obj()
        obj["manifest_checksum"] = checksum(_canonical(obj))
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes, where: str = "manifest.json") -> "Manifest":
        """Parse and check a manifest; raises CorruptCacheError / StaleCacheError (one line each)."""
        from .errors import CorruptCacheError, StaleCacheError

        rank_directory = Path(where).parent
        ckpt_path = None
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptCacheError(f"{where} is not valid JSON ({e.__class__.__name__})",
                                    f"rebuild it with {warmup_command(rank_directory)}") from None
        if isinstance(obj, dict) and isinstance(obj.get("checkpoint"), dict):
            ckpt_path = obj["checkpoint"].get("path") if isinstance(obj["checkpoint"].get("path"), str) else None
        fix = f"rebuild it with {warmup_command(rank_directory, ckpt_path)}"
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise CorruptCacheError(f"{where} is not an mmap-offload cache manifest", fix)
        if obj.get("format_version") != FORMAT_VERSION:
            raise StaleCacheError(
                f"{where} has cache format version {obj.get('format_version')}, this mmap-offload reads "
                f"version {FORMAT_VERSION}",
                fix,
            )
        stored = obj.pop("manifest_checksum", None)
        if stored != checksum(_canonical(obj)):
            raise CorruptCacheError(f"{where} fails its checksum (edited or corrupted)", fix)
        try:
            rec = obj["expert_record"]
            return cls(
                checkpoint_path=obj["checkpoint"]["path"],
                identity=CacheIdentity(
                    fingerprint=obj["checkpoint"]["fingerprint"],
                    quantization=obj["quantization"],
                    layout_name=obj["layout"]["name"],
                    layout_version=int(obj["layout"]["version"]),
                    tp_rank=int(obj["tp"]["rank"]),
                    tp_size=int(obj["tp"]["size"]),
                ),
                moe=obj["moe"],
                record_nbytes=int(rec["nbytes"]),
                record=[
                    TensorSpec(t["name"], t["dtype"], tuple(t["shape"]), int(t["offset"]), int(t["nbytes"]))
                    for t in rec["tensors"]
                ],
                layers=obj["layers"],
                tensors=obj["tensors"],
                created_by=obj.get("created_by", ""),
                shards=list(obj["checkpoint"].get("shards") or []),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCacheError(f"{where} lacks or mangles a field ({e})", fix) from None


def _canonical(obj: dict) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
