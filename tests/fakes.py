"""Test helpers for prefetch / expert cache: a small real cache, and engines that misbehave on purpose.

- ``make_cache``: writes a real cache (cache_writer.RankWriter) of random bytes and opens it with
  cache_reader.open_cache, so tests run against the real reader.
- ``flip_byte``: flips bits of one byte of a file in place (a corrupt layer file or shard).
- ``SyncEngine``: a trivially synchronous engine (pread + copy in ``submit``); strict about tickets.
- ``DeferredEngine``: models an asynchronous engine. ``submit`` poisons every destination at once
  and performs the copy only later: when its ticket is waited for, or at random on later calls.
  A buffer handed out before its copy completed, or overwritten while still in use, shows poison.
  It wraps any engine (the real transfer engine included) to do the actual copies.
- ``SafeOpenTap``: wraps a safetensors ``safe_open`` handle and reports every tensor read through
  it (the vLLM tests count what vLLM's loader reads).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from mmap_offload.cache_format import CacheIdentity, Manifest, layer_file_name, layout_specs
from mmap_offload.cache_reader import open_cache
from mmap_offload.cache_writer import RankWriter

POISON = 0xA5

DEFAULT_SPECS = [
    ("w13_weight", "bfloat16", (16, 8)),  # 256 bytes
    ("w2_weight", "bfloat16", (8, 8)),
    ("w13_weight_scale", "float32", (3, 5)),  # odd size: 60 bytes
    ("w2_g_idx", "int32", (7,)),
]


def make_cache(directory: Path, layers=(0, 1, 2), num_experts: int = 6, specs=None, seed: int = 0,
               identity: CacheIdentity | None = None, fill=None):
    """Write and open a cache of random bytes; returns the real ``cache_reader.Cache``.

    ``identity``: the manifest's CacheIdentity (a test one by default). ``fill(spec) -> tensor``: each
    tensor's values, called layer by layer, expert by expert, in record order (default: random bytes
    from ``seed``)."""
    placed, record_nbytes = layout_specs(list(specs or DEFAULT_SPECS))
    ident = identity or CacheIdentity("sha256:test", {"kind": "test"}, "test-raw", 1, 0, 1)
    if fill is None:
        rng = np.random.default_rng(seed)

        def fill(s):
            raw = torch.from_numpy(rng.integers(0, 256, size=s.nbytes, dtype=np.uint8))
            return raw.view(s.torch_dtype).view(s.shape)

    manifest = Manifest(
        checkpoint_path="synthetic",
        identity=ident,
        moe={"num_experts": num_experts, "layers": list(layers)},
        record_nbytes=record_nbytes,
        record=placed,
        layers=[{"layer": l, "file": layer_file_name(l), "nbytes": num_experts * record_nbytes} for l in layers],
    )
    with RankWriter(Path(directory), manifest, fsync=False) as w:
        for l in layers:
            lw = w.begin_layer(l)
            for e in range(num_experts):
                lw.write_expert(e, {s.name: fill(s) for s in placed})
            lw.commit()
        w.publish()
    return open_cache(directory)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8).cpu()


def expert_matches(cache, layer: int, expert: int, tensors: dict[str, torch.Tensor], index: int) -> bool:
    """Whether ``tensors[name][index]`` equals the cache bytes of (layer, expert) for every name."""
    return all(
        torch.equal(as_bytes(tensors[s.name][index]), as_bytes(cache.tensor(layer, expert, s.name)))
        for s in cache.expert_specs
    )


def layer_matches(cache, layer: int, tensors: dict[str, torch.Tensor]) -> bool:
    return all(expert_matches(cache, layer, e, tensors, e) for e in range(cache.num_experts))


def flip_byte(path: Path, offset: int, mask: int = 0x01) -> None:
    """XOR the byte at ``offset`` of the file ``path`` with ``mask``, in place (a corrupt cache or shard)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _do_copy(copy) -> None:
    fd = os.open(copy.src.path, os.O_RDONLY)
    try:
        buf = os.pread(fd, copy.src.nbytes, copy.src.offset)
    finally:
        os.close(fd)
    src = np.frombuffer(buf, dtype=np.uint8)
    for off, n, dst in copy.dst:
        as_view = dst.data.view(-1).view(torch.uint8)
        assert as_view.numel() == n, (as_view.numel(), n)
        as_view.copy_(torch.from_numpy(src[off : off + n].copy()))


class SyncEngine:
    """Copies in ``submit``; ``wait`` of an unknown or already-waited ticket raises."""

    name = "sync"

    def __init__(self):
        self._next = 0
        self._open: set[int] = set()
        self.submits = 0
        self.bytes = 0
        self.metrics = {}

    def submit(self, copies, after=None):
        for c in copies:
            _do_copy(c)
            self.bytes += sum(n for _, n, _ in c.dst)
        self.submits += 1
        self._next += 1
        self._open.add(self._next)
        return self._next

    def wait(self, ticket) -> None:
        self._open.remove(ticket)

    def close(self) -> None:
        pass


class DeferredEngine:
    """Poison at submit, copy later (see module docstring). ``inner``: an engine doing real copies."""

    def __init__(self, inner=None, seed: int = 0, complete_prob: float = 0.3):
        self.inner = inner or SyncEngine()
        self.rng = random.Random(seed)
        self.complete_prob = complete_prob
        self._pending: dict[int, list] = {}
        self._done: set[int] = set()
        self._next = 0
        self.metrics = {}

    def _complete(self, ticket: int) -> None:
        copies = self._pending.pop(ticket)
        self.inner.wait(self.inner.submit(copies))
        self._done.add(ticket)

    def _maybe_progress(self) -> None:
        for t in list(self._pending):
            if self.rng.random() < self.complete_prob:
                self._complete(t)

    def submit(self, copies, after=None):
        self._maybe_progress()
        for c in copies:
            for _, _, dst in c.dst:
                dst.data.view(-1).view(torch.uint8).fill_(POISON)
        self._next += 1
        self._pending[self._next] = list(copies)
        return self._next

    def wait(self, ticket) -> None:
        if ticket in self._pending:
            self._complete(ticket)
        self._done.remove(ticket)  # KeyError: unknown ticket or waited twice
        self._maybe_progress()

    def close(self) -> None:
        self.inner.close()


def real_engines(device: str = "cpu") -> list:
    """Factories of the real transfer engines usable here (empty until transfer.py is in)."""
    try:
        from mmap_offload import transfer
    except ImportError:
        return []
    out = []
    for kind in ("mmap", "pread"):
        def make(kind=kind):
            return transfer.make_engine(kind, device, pinned_bytes=4 << 20, slot_bytes=1 << 20, threads=2)
        make.name = f"real-{kind}"
        out.append(make)
    if transfer.native_copy_lib() is not None:  # the mmap engine with stream-ordered batches
        def ordered():
            return transfer.make_engine("mmap", device, pinned_bytes=4 << 20, slot_bytes=1 << 20, threads=2,
                                        ordered_fraction=0.5)
        ordered.name = "real-mmap-ordered"
        out.append(ordered)
    return out


def cuda_engine(engine_kind: str):
    """For the GPU tests: the real mmap engine on CUDA ("real"), the same with stream-ordered
    batches ("ordered"), or the synchronous fake."""
    if engine_kind == "real":
        return real_engines(device="cuda")[0]()
    if engine_kind == "ordered":
        return next(f for f in real_engines(device="cuda") if f.name == "real-mmap-ordered")()
    return SyncEngine()


def engine_factories(device: str = "cpu") -> list:
    """The stand-in engine plus every real engine (content tests run against all of them)."""
    return [SyncEngine] + real_engines(device)


class FailingEngine(SyncEngine):
    """Like SyncEngine, but the submits numbered in ``fail`` (1-based) poison their destinations
    and their ``wait`` raises CacheError, as a read error of the real engines does."""

    def __init__(self, fail=()):
        super().__init__()
        self.fail = set(fail)

    def submit(self, copies, after=None):
        if self.submits + 1 in self.fail:
            for c in copies:
                for _, _, dst in c.dst:
                    dst.data.view(-1).view(torch.uint8).fill_(POISON)
            self.submits += 1
            self._next += 1
            self._open.add(-self._next)
            return -self._next
        return super().submit(copies, after)

    def wait(self, ticket) -> None:
        from mmap_offload.errors import CacheError

        super().wait(ticket)
        if ticket < 0:
            raise CacheError("reading the cache failed: injected", "check the cache files")


class SafeOpenTap:
    """A safetensors ``safe_open`` handle that calls ``on_tensor(name, tensor)`` for every
    ``get_tensor``; everything else goes to the wrapped handle (also as a context manager)."""

    def __init__(self, f, on_tensor) -> None:
        self._f = f
        self._on_tensor = on_tensor

    def __enter__(self) -> "SafeOpenTap":
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def get_tensor(self, name: str):
        t = self._f.get_tensor(name)
        self._on_tensor(name, t)
        return t

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def run_child(code: str, *args: str, timeout: float = 120) -> tuple[list[str], str]:
    """Run ``code`` in a child Python (from the checkout's root; a SIGBUS test must not risk this
    process) with ``args``; asserts it exited 0. Returns (its stdout lines, the first of them
    starting with "ERR" or "NO ERROR", "" if none)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    return lines, next((line for line in lines if line.startswith(("ERR", "NO ERROR"))), "")
