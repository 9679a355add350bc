"""Read a Hugging Face safetensors checkpoint one tensor at a time, and find its MoE experts.

    ckpt = open_checkpoint(path)     # config.json + every shard's safetensors header; no tensor data
    ckpt.moe                         # MoEInfo: layers, experts, hidden, intermediate, top_k, name prefixes
    ckpt.quant                       # QuantScheme: "unquantized" | "w4a16" (compressed-tensors pack-quantized)
    ckpt.fingerprint                 # "sha256:..." over shard names, sizes, raw headers, sampled data
    refs = ckpt.expert_refs(layer, expert)    # {"gate"|"up"|"down": {"weight_packed": TensorRef, ...}}
    t = ckpt.read(refs["gate"]["weight_packed"])   # pread of exactly that tensor's bytes

``path`` is a checkpoint directory (shards listed by ``model.safetensors.index.json`` when present, else every
``*.safetensors`` in it) or a single ``.safetensors`` file (config.json read from its directory if there).

safetensors (the format, in full): 8-byte little-endian header length n, n bytes of JSON mapping each tensor
name to {"dtype", "shape", "data_offsets": [begin, end]} (relative to byte 8 + n), optional "__metadata__",
then the raw little-endian tensor bytes. The header is parsed here, not by the safetensors package, and data
is read with ``os.preadv`` into a fresh tensor: no shard is ever mapped or read whole, so reading one expert
costs that expert's bytes of memory and I/O (``bytes_read`` counts them).

Fingerprint: sha256 over, per shard in name order, its name, file size, raw header (length + JSON) and
16 windows of 4 KiB spread evenly over its data (64 KiB per shard, counted in ``open_bytes_read``). It
changes when a header changes (a tensor's name, dtype, shape or offsets), a shard is added, removed or
resized, or the weights are another checkpoint's (another seed, a fine-tune); it does not see a single
changed data byte outside the sampled windows: corruption of the checkpoint is not its job.

Routed experts are found by name: any ``<prefix>layers.L.<...>experts.E.<proj>.<suffix>`` with projection
names w1/gate_proj -> "gate", w3/up_proj -> "up", w2/down_proj -> "down" (Mixtral; Qwen-MoE / DeepSeek).
Shared experts (``shared_expert.gate_proj``, no expert index) are not routed experts and stay non-expert, as
do experts of layers at or past config.json's ``num_hidden_layers`` (DeepSeek's multi-token-prediction layer).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError, UnsupportedError

__all__ = ["open_checkpoint", "Checkpoint", "TensorRef", "MoEInfo", "QuantScheme", "PROJ_NAMES",
           "ST_DTYPES"]

MAX_HEADER_BYTES = 100 << 20  # the safetensors limit
FINGERPRINT_SAMPLES = 16
FINGERPRINT_WINDOW = 4096
INDEX_NAME = "model.safetensors.index.json"

ST_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"),
                     ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        ST_DTYPES[_name] = getattr(torch, _attr)

# checkpoint projection name -> canonical name
PROJ_NAMES: dict[str, str] = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down",
                              "down_proj": "down"}
PROJS = ("gate", "up", "down")
_EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:.+\.)?experts)\.(?P<expert>\d+)\."
    r"(?P<proj>[^.]+)\.(?P<suffix>[^.]+)$")
_UNQUANT_SUFFIXES = {"weight"}
_W4A16_SUFFIXES = {"weight_packed", "weight_scale", "weight_shape", "weight_g_idx"}
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SUPPORTED = ("mmap-offload supports unquantized bf16/fp16/fp32 experts and compressed-tensors pack-quantized "
              "4-bit symmetric int weights (W4A16, group or channel scales); use such a checkpoint")


@dataclass(frozen=True)
class TensorRef:
    """Where one tensor's bytes are: ``nbytes`` bytes at absolute ``offset`` of ``path``."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class QuantScheme:
    """How the routed experts are stored.

    kind "unquantized": ``weight`` in ``weight_dtype`` (bf16/fp16/fp32); scale_dtype None, group_size 0.
    kind "w4a16": compressed-tensors pack-quantized, ``weight_dtype`` int32 (packed), ``scale_dtype`` the
    scales' dtype, ``group_size`` > 0 or -1 (channelwise), ``actorder`` True when ``weight_g_idx`` is
    stored (actorder "group"), ``symmetric`` always True, ``num_bits`` 4.
    """

    kind: str
    group_size: int = 0
    actorder: bool = False
    symmetric: bool = True
    num_bits: int = 16
    weight_dtype: torch.dtype = torch.bfloat16
    scale_dtype: torch.dtype | None = None

    @classmethod
    def w4a16(cls, **overrides) -> "QuantScheme":
        """A W4A16 scheme (group 128, bf16 scales) with ``overrides``: for tests and benchmarks."""
        base = dict(kind="w4a16", group_size=128, num_bits=4, weight_dtype=torch.int32, scale_dtype=torch.bfloat16)
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict:
        """JSON-ready form (dtypes as names such as "bfloat16"), e.g. for a cache manifest."""
        def name(d: torch.dtype | None) -> str | None:
            return None if d is None else str(d).removeprefix("torch.")
        return {"kind": self.kind, "group_size": self.group_size, "actorder": self.actorder,
                "symmetric": self.symmetric, "num_bits": self.num_bits,
                "weight_dtype": name(self.weight_dtype), "scale_dtype": name(self.scale_dtype)}


@dataclass(frozen=True)
class MoEInfo:
    """The routed experts: ``layers`` (sorted MoE layer indices), ``num_experts`` per layer, ``hidden`` H,
    ``intermediate`` I (per expert, whole, before TP), ``top_k`` from config.json (0 if it does not say),
    ``prefixes[layer]`` the name prefix of that layer's experts (``model.layers.3.block_sparse_moe.experts``),
    ``proj_names`` canonical -> checkpoint projection name ({"gate": "w1", ...}), ``expert_nbytes`` the
    checkpoint bytes of one expert (all projections and suffixes)."""

    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    layers: list[int]
    prefixes: dict[int, str] = field(default_factory=dict)
    proj_names: dict[str, str] = field(default_factory=dict)
    expert_nbytes: int = 0

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def open_checkpoint(path: str | os.PathLike) -> "Checkpoint":
    """Open a checkpoint directory or one .safetensors file; reads config.json and headers only.

    Raises CheckpointError (missing path, no shards, malformed header or config, no MoE experts,
    inconsistent experts) or UnsupportedError (a quantization other than unquantized or W4A16)."""
    return Checkpoint(path)


class Checkpoint:
    """An opened checkpoint: headers parsed, experts indexed, file descriptors opened lazily.

    Thread-safe for ``read``. Use as a context manager or call ``close()`` to release descriptors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.dir, shard_paths = _find_shards(self.path)
        self.config: dict = _read_config(self.dir)
        self.shards: list[Path] = shard_paths
        self.bytes_read = 0
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}
        self._refs: dict[str, TensorRef] = {}
        self.open_bytes_read = 0  # headers + fingerprint samples read by open_checkpoint
        self.shard_stats: dict[str, tuple[int, int]] = {}  # shard name -> (size, mtime_ns) when opened
        digest = hashlib.sha256()
        for shard in sorted(shard_paths, key=lambda p: p.name):
            try:
                st = shard.stat()
            except OSError as e:
                raise CheckpointError(f"cannot read shard {shard} ({e.strerror})", "check file permissions") from None
            self.shard_stats[shard.name] = (int(st.st_size), int(st.st_mtime_ns))
            raw, refs, size = _parse_header(shard)
            sample = _data_sample(shard, len(raw), size)
            digest.update(f"{shard.name}\0{size}\0{len(raw)}\0".encode())
            digest.update(raw)
            digest.update(sample)
            self.open_bytes_read += len(raw) + len(sample)
            for ref in refs:
                if ref.name in self._refs:
                    raise CheckpointError(
                        f"tensor {ref.name} is in both {self._refs[ref.name].path.name} and {shard.name}",
                        "remove the duplicate shard, or add model.safetensors.index.json naming the shards")
                self._refs[ref.name] = ref
        self.fingerprint = "sha256:" + digest.hexdigest()
        self._experts, self._expert_names, self.moe = _discover(self._refs, self.config, self.path)
        self.quant = _quant_scheme(self.config, self._experts, self.moe, self.path)

    # -- lookup ------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return sorted(self._refs)

    def ref(self, name: str) -> TensorRef:
        return self._refs[name]

    def expert_refs(self, layer: int, expert: int) -> dict[str, dict[str, TensorRef]]:
        """``{"gate"|"up"|"down": {suffix: TensorRef}}`` of one routed expert (KeyError if none)."""
        try:
            return self._experts[(layer, expert)]
        except KeyError:
            raise KeyError(f"no routed expert {expert} in layer {layer} (MoE layers {self.moe.layers}, "
                           f"{self.moe.num_experts} experts)") from None

    def mtp_names(self) -> list[str]:
        """Every tensor of the multi-token-prediction layers (config ``num_nextn_predict_layers`` layers
        after the ``num_hidden_layers`` decoder layers: GLM-4.5, DeepSeek-V3), named as vLLM's
        ``get_spec_layer_idx_from_weight_name`` matches them. vLLM's main model drops these while loading
        (its MTP head loads them for speculative decoding); the cache never serves them."""
        tc = _text_config(self.config)
        base, n = tc.get("num_hidden_layers"), tc.get("num_nextn_predict_layers")
        if not isinstance(base, int) or not isinstance(n, int) or n <= 0:
            return []
        heads = tuple(f"{p}layers.{base + i}." for i in range(n) for p in ("model.", "", "model.language_model."))
        return sorted(name for name in self._refs if name.startswith(heads))

    def non_expert_names(self) -> list[str]:
        """Every tensor that is not part of a routed expert (attention, norms, routers, embeddings...)."""
        return sorted(n for n in self._refs if n not in self._expert_names)

    # -- reading -----------------------------------------------------------------------------------

    def read(self, ref: TensorRef, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read exactly ``ref``'s bytes with pread into a fresh CPU tensor (or into contiguous ``out``)."""
        if out is None:
            buf = torch.empty(ref.nbytes, dtype=torch.uint8)
        else:
            if not out.is_contiguous() or out.device.type != "cpu" or \
                    out.numel() * out.element_size() != ref.nbytes:
                raise ValueError(f"out must be a contiguous CPU tensor of {ref.nbytes} bytes for {ref.name}")
            buf = out.view(-1).view(torch.uint8)
        if ref.nbytes:
            self._pread(ref, memoryview(buf.numpy()))
        if out is not None:
            return out
        return buf.view(ref.dtype).reshape(ref.shape)

    def read_expert(self, layer: int, expert: int) -> dict[str, dict[str, torch.Tensor]]:
        """Every tensor of one routed expert, read: ``{"gate": {"weight_packed": t, ...}, ...}``."""
        return {proj: {suf: self.read(r) for suf, r in sufs.items()}
                for proj, sufs in self.expert_refs(layer, expert).items()}

    def _fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    try:
                        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    except OSError as e:
                        raise CheckpointError(f"cannot open shard {path} ({e.strerror})",
                                              "check that the checkpoint is complete and readable") from None
                    self._fds[path] = fd
        return fd

    def _pread(self, ref: TensorRef, view: memoryview) -> None:
        fd = self._fd(ref.path)
        done = 0
        while done < ref.nbytes:
            part = view[done:]
            n = os.preadv(fd, [part], ref.offset + done) if hasattr(os, "preadv") else \
                _pread_into(fd, part, ref.offset + done)
            if n <= 0:
                raise CheckpointError(
                    f"shard {ref.path} ended inside tensor {ref.name} (read {done} of {ref.nbytes} bytes)",
                    "the file changed or was truncated after opening; re-download the checkpoint")
            done += n
        with self._lock:
            self.bytes_read += ref.nbytes

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __getstate__(self) -> dict:
        """Picklable (e.g. for a worker process): descriptors and the lock are not carried over."""
        state = dict(self.__dict__)
        state["_fds"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        m = self.moe
        return (f"Checkpoint({str(self.path)!r}, {len(self.shards)} shards, {m.num_layers} MoE layers x "
                f"{m.num_experts} experts, H={m.hidden}, I={m.intermediate}, quant={self.quant.kind})")


def _pread_into(fd: int, view: memoryview, offset: int) -> int:
    data = os.pread(fd, len(view), offset)
    view[: len(data)] = data
    return len(data)


# ------------------------------------------------------------------------------------------ files


def _find_shards(path: Path) -> tuple[Path, list[Path]]:
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist",
                              "give a checkpoint directory or a .safetensors file")
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"checkpoint path {path} is neither a directory nor a .safetensors file",
                                  "give the checkpoint directory (with config.json and *.safetensors)")
        return path.parent, [path]
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} is neither a directory nor a .safetensors file",
                              "give the checkpoint directory (with config.json and *.safetensors)")
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index} is malformed ({e.__class__.__name__}: {e})",
                                  "re-download it, or delete it to use every *.safetensors file") from None
        shards = [path / f for f in files]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise CheckpointError(f"shard {missing[0]} listed in {INDEX_NAME} is missing from {path}"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                                  "finish downloading the checkpoint")
        if shards:
            return path, shards
    shards = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not shards:
        raise CheckpointError(f"checkpoint directory {path} holds no *.safetensors files",
                              "download the safetensors weights, or convert .bin weights to safetensors")
    return path, shards


def _read_config(directory: Path) -> dict:
    cfg = directory / "config.json"
    if not cfg.is_file():
        return {}
    try:
        config = json.loads(cfg.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg} is not valid JSON ({e})", "re-download config.json") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg} is not a JSON object", "re-download config.json")
    return config


def _data_sample(shard: Path, data_start: int, size: int) -> bytes:
    """FINGERPRINT_SAMPLES windows of FINGERPRINT_WINDOW bytes, evenly spaced over the data region (first
    and last included): checkpoints with equal headers but other weights (another seed, a fine-tune) get
    another fingerprint, at the cost of a few small reads per shard."""
    span = size - data_start
    if span <= FINGERPRINT_SAMPLES * FINGERPRINT_WINDOW:
        offsets = [data_start] if span > 0 else []
        window = span
    else:
        step = (span - FINGERPRINT_WINDOW) // (FINGERPRINT_SAMPLES - 1)
        offsets = [data_start + i * step for i in range(FINGERPRINT_SAMPLES)]
        window = FINGERPRINT_WINDOW
    parts = []
    try:
        fd = os.open(shard, os.O_RDONLY)
        try:
            for off in offsets:
                parts.append(os.pread(fd, window, off))
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointError(f"cannot read shard {shard} ({e.strerror})", "check file permissions") from None
    return b"".join(parts)


def _parse_header(shard: Path) -> tuple[bytes, list[TensorRef], int]:
    """(raw 8-byte length + header bytes, tensor refs, file size) of one shard; validates offsets."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"malformed safetensors file {shard}: {why}",
                               "re-download or re-convert this shard")

    try:
        size = shard.stat().st_size
        with open(shard, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes is too short for the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise bad(f"header length {n} does not fit in the file of {size} bytes")
            body = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read shard {shard} ({e.strerror})", "check file permissions") from None
    try:
        header = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"header is not valid JSON ({e.__class__.__name__}: {e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    refs = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            st_dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"entry {name!r} lacks dtype, shape or data_offsets") from None
        dtype = ST_DTYPES.get(st_dtype)
        if dtype is None:
            raise bad(f"tensor {name} has unknown dtype {st_dtype!r}")
        if not 0 <= begin <= end <= data_len:
            raise bad(f"tensor {name} data_offsets [{begin}, {end}] lie outside the {data_len} data bytes")
        if any(d < 0 for d in shape) or math.prod(shape) * dtype.itemsize != end - begin:
            raise bad(f"tensor {name} shape {list(shape)} x {st_dtype} does not match its "
                      f"{end - begin} bytes")
        refs.append(TensorRef(name, shard, dtype, shape, data_start + begin, end - begin))
    return head + body, refs, size


# ---------------------------------------------------------------------------------------- experts


def _text_config(config: dict) -> dict:
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) else config


def _discover(refs: dict[str, TensorRef], config: dict, path: Path):
    """Index routed experts by (layer, expert) and derive MoEInfo; checks they are complete and alike."""
    experts: dict[tuple[int, int], dict[str, dict[str, TensorRef]]] = {}
    prefixes: dict[int, str] = {}
    proj_names: dict[str, str] = {}
    expert_names: set[str] = set()
    tc = _text_config(config)
    # layers past num_hidden_layers (e.g. DeepSeek's multi-token-prediction layer) are not served
    limit = tc.get("num_hidden_layers") if isinstance(tc.get("num_hidden_layers"), int) else None
    for name, ref in refs.items():
        m = _EXPERT_RE.match(name)
        if m is None:
            continue
        layer, expert, proj = int(m["layer"]), int(m["expert"]), m["proj"]
        if limit is not None and layer >= limit:
            continue
        canon = PROJ_NAMES.get(proj)
        if canon is None:
            raise UnsupportedError(f"expert tensor {name} has projection {proj!r}, which mmap-offload does "
                                   f"not know", f"known projections: {', '.join(PROJ_NAMES)}")
        if proj_names.setdefault(canon, proj) != proj:
            raise CheckpointError(f"expert projections are named both {proj_names[canon]!r} and {proj!r} "
                                  f"(tensor {name})", "the checkpoint mixes two naming schemes; re-export it")
        if prefixes.setdefault(layer, m["prefix"]) != m["prefix"]:
            raise CheckpointError(f"layer {layer} has experts under two prefixes: {prefixes[layer]} and "
                                  f"{m['prefix']}", "the checkpoint mixes two naming schemes; re-export it")
        experts.setdefault((layer, expert), {}).setdefault(canon, {})[m["suffix"]] = ref
        expert_names.add(name)
    if not experts:
        raise CheckpointError(f"no MoE experts found in {path} (no tensor named like "
                              "'model.layers.L.<...>.experts.E.<proj>.weight')",
                              "mmap-offload serves routed experts of MoE models; give an MoE checkpoint")
    layers = sorted(prefixes)
    by_layer: dict[int, list[int]] = {}
    for layer, expert in experts:
        by_layer.setdefault(layer, []).append(expert)
    ref_layer = layers[0]
    num_experts = max(by_layer[ref_layer]) + 1
    for layer in layers:
        ids = sorted(by_layer[layer])
        if ids != list(range(num_experts)):
            missing = sorted(set(range(max(num_experts, ids[-1] + 1))) - set(ids))
            raise CheckpointError(
                f"layer {layer} has {len(ids)} experts (ids {ids[0]}..{ids[-1]}) but layer {ref_layer} has "
                f"{num_experts}" + (f"; missing expert {missing[0]}" if missing else ""),
                "the checkpoint is incomplete; re-download it")
    # every expert: same projections, same suffixes, same dtypes and shapes as the first one
    first_key = (ref_layer, 0)
    first = experts[first_key]
    for canon in PROJS:
        if canon not in first:
            raise CheckpointError(f"expert 0 of layer {ref_layer} ({prefixes[ref_layer]}.0) has no {canon} "
                                  f"projection (found {', '.join(sorted(first))})",
                                  "the checkpoint is incomplete; re-download it")
    sig = {c: {s: (r.dtype, r.shape) for s, r in first[c].items()} for c in PROJS}
    for key, projs in experts.items():
        for canon in PROJS:
            if canon not in projs:
                raise CheckpointError(f"expert {key[1]} of layer {key[0]} ({prefixes[key[0]]}.{key[1]}) has "
                                      f"no {canon} projection", "the checkpoint is incomplete; re-download it")
            got = {s: (r.dtype, r.shape) for s, r in projs[canon].items()}
            if got != sig[canon]:
                diff = sorted(set(got) ^ set(sig[canon])) or sorted(
                    s for s in got if got[s] != sig[canon][s])
                s = diff[0]
                raise CheckpointError(
                    f"experts with inconsistent shapes: {prefixes[key[0]]}.{key[1]}.{proj_names[canon]}.{s} "
                    f"is {_fmt(got.get(s))} but {prefixes[ref_layer]}.0.{proj_names[canon]}.{s} is "
                    f"{_fmt(sig[canon].get(s))}",
                    "all routed experts must have the same tensors; re-export the checkpoint")
    order = {s: i for i, s in enumerate(("weight", "weight_packed", "weight_scale", "weight_shape",
                                         "weight_g_idx"))}
    experts = {key: {c: dict(sorted(projs[c].items(), key=lambda kv: (order.get(kv[0], 99), kv[0])))
                     for c in PROJS}
               for key, projs in sorted(experts.items())}
    first = experts[first_key]
    proj_names = {c: proj_names[c] for c in PROJS}
    hidden, intermediate = _dims(first, prefixes[ref_layer], proj_names)
    top_k = int(tc.get("num_experts_per_tok") or tc.get("moe_topk") or tc.get("top_k") or 0)
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if isinstance(tc.get(key), int) and tc[key] != num_experts:
            raise CheckpointError(f"config.json says {key}={tc[key]} but the shards hold {num_experts} experts "
                                  f"per layer", "the checkpoint is incomplete or its config is from another model")
    _check_config_shapes(tc, hidden, intermediate, num_experts, top_k, prefixes[ref_layer], path)
    expert_nbytes = sum(r.nbytes for sufs in first.values() for r in sufs.values())
    moe = MoEInfo(num_experts=num_experts, hidden=hidden, intermediate=intermediate, top_k=top_k,
                  layers=layers, prefixes={L: prefixes[L] for L in layers}, proj_names=dict(proj_names),
                  expert_nbytes=expert_nbytes)
    return experts, expert_names, moe


def _check_config_shapes(tc: dict, hidden: int, intermediate: int, num_experts: int, top_k: int, prefix: str,
                         path: Path) -> None:
    """config.json must describe the tensors it ships with: hidden size, the experts' intermediate size
    (``moe_intermediate_size`` where the model has one, else ``intermediate_size``) and top-k."""
    fix = "the config.json is from another model or size; use the checkpoint's own config.json"
    if isinstance(tc.get("hidden_size"), int) and tc["hidden_size"] != hidden:
        raise CheckpointError(f"config.json says hidden_size={tc['hidden_size']} but the experts under {prefix} "
                              f"have hidden size {hidden}", fix)
    key = "moe_intermediate_size" if "moe_intermediate_size" in tc else "intermediate_size"
    if isinstance(tc.get(key), int) and tc[key] != intermediate:
        raise CheckpointError(f"config.json says {key}={tc[key]} but the experts under {prefix} have "
                              f"intermediate size {intermediate}", fix)
    if top_k > num_experts:
        raise CheckpointError(f"config.json routes each token to {top_k} experts but layers hold {num_experts}",
                              fix)


def _fmt(sig) -> str:
    return "absent" if sig is None else f"{str(sig[0]).removeprefix('torch.')} {list(sig[1])}"


def _dims(first: dict[str, dict[str, TensorRef]], prefix: str, proj_names: dict[str, str]) -> tuple[int, int]:
    """(hidden, intermediate) from the shapes of one expert: gate/up [I, H], down [H, I] (packed: K / 8)."""
    def nk(canon: str) -> tuple[int, int]:
        sufs = first[canon]
        if "weight" in sufs:
            shape = sufs["weight"].shape
            factor = 1
        elif "weight_packed" in sufs:
            shape = sufs["weight_packed"].shape
            factor = 8
        else:
            raise UnsupportedError(f"expert {prefix}.0.{proj_names[canon]} has neither weight nor weight_packed "
                                   f"(found {', '.join(sorted(sufs))})", _SUPPORTED)
        if len(shape) != 2:
            raise UnsupportedError(f"expert weight {prefix}.0.{proj_names[canon]} has shape {list(shape)}, "
                                   "not 2-D", _SUPPORTED)
        return shape[0], shape[1] * factor

    (ig, hg), (iu, hu), (hd, id_) = nk("gate"), nk("up"), nk("down")
    if not (ig == iu == id_ and hg == hu == hd):
        raise CheckpointError(f"experts with inconsistent shapes: gate [N, K] = [{ig}, {hg}], up [{iu}, {hu}], "
                              f"down [{hd}, {id_}] under {prefix}.0 (want gate/up [I, H], down [H, I])",
                              "re-export the checkpoint")
    return hg, ig


# ------------------------------------------------------------------------------------ quantization


def _matches(target: str, module: str, linear: bool = True) -> bool:
    """compressed-tensors matching: exact name, "re:" regex (re.match), or (``linear``) the class "Linear"."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or (linear and target == "Linear")


def _quant_scheme(config: dict, experts, moe: MoEInfo, path: Path) -> QuantScheme:
    first_layer = moe.layers[0]
    first = experts[(first_layer, 0)]
    suffixes = {s for sufs in first.values() for s in sufs}
    where = f"{moe.prefixes[first_layer]}.0"
    qc = _text_config(config).get("quantization_config") or config.get("quantization_config")
    if "weight_zero_point" in suffixes:
        raise UnsupportedError(
            f"unsupported quantization: experts are asymmetric (found {where}.*.weight_zero_point)", _SUPPORTED)
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError("config.json quantization_config is not an object", "re-download config.json")
    method = str((qc or {}).get("quant_method", "")).lower() or None

    if suffixes <= _UNQUANT_SUFFIXES:
        dtype = first["gate"]["weight"].dtype
        if dtype not in _FLOATS:
            raise UnsupportedError(
                f"unsupported quantization: expert weights are stored as {str(dtype).removeprefix('torch.')}"
                + (f" (quant_method {method!r})" if method else ""), _SUPPORTED)
        if method not in (None, "compressed-tensors"):
            raise UnsupportedError(
                f"unsupported quantization: quant_method {method!r} with float expert weights", _SUPPORTED)
        return QuantScheme(kind="unquantized", num_bits=dtype.itemsize * 8, weight_dtype=dtype)

    unknown = suffixes - _W4A16_SUFFIXES
    if unknown or "weight_packed" not in suffixes:
        found = ", ".join(sorted(suffixes))
        raise UnsupportedError(f"unsupported quantization: expert tensors {where}.*.{{{found}}} are not a known "
                               "layout" + (f" (quant_method {method!r})" if method else ""), _SUPPORTED)
    if qc is None:
        raise CheckpointError(f"experts are packed ({where}.*.weight_packed) but config.json has no "
                              "quantization_config", "use the config.json that came with the checkpoint")
    if method != "compressed-tensors":
        raise UnsupportedError(f"unsupported quantization: quant_method {method!r}", _SUPPORTED)
    module = f"{where}.{moe.proj_names['gate']}"
    if any(_matches(t, module, linear=False) for t in qc.get("ignore") or []):
        raise CheckpointError(f"experts are packed but quantization_config ignores {module}",
                              "the config does not describe these weights; use the checkpoint's own config")
    group = None
    for gname, g in (qc.get("config_groups") or {}).items():
        if isinstance(g, dict) and any(_matches(t, module) for t in g.get("targets") or []):
            group = g
            break
    if group is None or not isinstance(group.get("weights"), dict):
        raise CheckpointError(f"no config_group of quantization_config targets {module}",
                              "use the config.json that came with the checkpoint")
    w = group["weights"]
    fmt = group.get("format") or qc.get("format")
    bits, typ, sym = w.get("num_bits"), str(w.get("type", "int")).lower(), w.get("symmetric", True)
    strategy = str(w.get("strategy") or ("group" if (w.get("group_size") or 0) > 0 else "channel")).lower()
    found = f"{bits}-bit {typ}, {'symmetric' if sym else 'asymmetric'}, strategy {strategy}, format {fmt}"
    if fmt != "pack-quantized" or bits != 4 or typ != "int" or not sym or strategy not in ("group", "channel") \
            or w.get("dynamic") or group.get("input_activations"):
        raise UnsupportedError(f"unsupported quantization: experts are {found}"
                               + (" with quantized activations" if group.get("input_activations") else ""),
                               _SUPPORTED)
    group_size = -1 if strategy == "channel" else int(w.get("group_size") or 0)
    if strategy == "group" and group_size <= 0:
        raise CheckpointError(f"quantization_config has strategy group but group_size {w.get('group_size')}",
                              "re-export the checkpoint")
    actorder = w.get("actorder") in (True, "group", "dynamic")  # "weight"/"static": no g_idx
    has_gidx = "weight_g_idx" in suffixes
    if actorder != has_gidx:
        raise CheckpointError(f"quantization_config says actorder {w.get('actorder')!r} but experts "
                              f"{'have' if has_gidx else 'lack'} weight_g_idx ({where})",
                              "use the config.json that came with the checkpoint")
    if "weight_scale" not in suffixes:
        raise CheckpointError(f"packed experts lack weight_scale ({where})", "re-download the checkpoint")
    for canon in PROJS:
        sufs = first[canon]
        packed, scale = sufs["weight_packed"], sufs.get("weight_scale")
        name = f"{where}.{moe.proj_names[canon]}"
        if packed.dtype != torch.int32:
            raise UnsupportedError(f"{name}.weight_packed is {packed.dtype}, not int32", _SUPPORTED)
        if scale is None or scale.dtype not in _FLOATS:
            raise UnsupportedError(f"{name}.weight_scale is {getattr(scale, 'dtype', 'absent')}, not a float",
                                   _SUPPORTED)
        n, k = packed.shape[0], packed.shape[1] * 8
        groups = 1 if group_size == -1 else -(-k // group_size)
        if scale.shape != (n, groups):
            raise CheckpointError(f"{name}.weight_scale has shape {list(scale.shape)}, expected [{n}, {groups}] "
                                  f"for K={k} and group_size {group_size}",
                                  "the config's group_size does not fit the weights; use the checkpoint's config")
        g_idx = sufs.get("weight_g_idx")
        if g_idx is not None and (g_idx.shape != (k,) or g_idx.dtype not in (torch.int32, torch.int64)):
            raise CheckpointError(f"{name}.weight_g_idx is {_fmt((g_idx.dtype, g_idx.shape))}, expected "
                                  f"int32 [{k}]", "re-export the checkpoint")
    return QuantScheme(kind="w4a16", group_size=group_size, actorder=actorder, symmetric=True, num_bits=4,
                       weight_dtype=torch.int32, scale_dtype=first["gate"]["weight_scale"].dtype)
