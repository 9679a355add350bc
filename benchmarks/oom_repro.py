"""The user's host OOM, reproduced at reduced scale, and the same checkpoint served by mmap-offload.

    python benchmarks/oom_repro.py                       # CPU, ~200 MB of experts, < 60 s
    python benchmarks/oom_repro.py --expert-mib 4096     # larger (GPU machine), --real-pin on CUDA
    python3 benchmarks/oom_repro.py --vllm --out OUT     # real vLLM (GPU machine, . .vdev/env.sh), ~3 min

Two modes. The harness mode (default) emulates vLLM's load path; ``--vllm`` runs real vLLM (section
"Real vLLM" below and ``main_vllm``).

Harness mode: two child processes run the same synthetic W4A16 checkpoint (``synth.make_checkpoint``) under the same
memory cap:

``uva``   what vLLM's ``--offload-backend uva`` does at load (DESIGN.md section 1): every expert
          parameter ``[E, ...]`` of every layer is loaded (GPTQ orientation, as vLLM's loader
          transposes it) into memory pinned the way ``Tensor.pin_memory()`` pins it: torch's
          CachingHostAllocator rounds each block up to a power of two, and freed blocks stay cached,
          never returned to the OS. On CPU that is emulated with plain allocations of the rounded size,
          every page touched (``--real-pin`` on CUDA uses ``torch.empty(pin_memory=True)``). Then the
          Marlin repack runs layer by layer: a new full-size tensor per parameter, copied to host
          pageable and pinned again, while the old pinned block stays in the allocator's cache. Peak
          host memory is (rounded experts) + (rounded repacked copy) >= 2x the experts.
``mmap``  ``warmup.warmup`` builds the cache (one expert at a time), then every layer is served
          through the real transfer engine (``make_engine("mmap")``) into a layer buffer, and every
          tensor's xxh3 checksum is compared with the manifest.

The cap defaults to ``baseline + 1.25 x expert bytes`` (``--cap-factor``), where ``baseline`` is the
cgroup peak of a child that only imports what both modes import. Where it runs: a child memory
cgroup (v2 ``memory.max``, or v1 ``memory.limit_in_bytes``) created under this process's own cgroup
(root needed). Without cgroups: ``RLIMIT_DATA`` (private writable memory) in the child, which the
report says. Prints one JSON document with both children's outcome and peak memory.

Real vLLM (``--vllm``): the user's failure and its fix in vLLM itself
-------------------------------------------------------------------

A synthetic W4A16 Mixtral-style checkpoint whose expert tensors do not round to powers of two
(default 24 layers x 24 experts, H 2048, I 1536: 2.80 GB of experts; ``--layers/--experts/--hidden/
--intermediate`` scale it) is served by real vLLM (engine in-process, one ``LLM`` per child process,
``vllm_runner.run_child``), each case in its own memory cgroup (v2: ``memory.max``, ``memory.peak``,
``memory.events`` oom_kill; v1 on the CI machine):

    noff       no offload (experts in VRAM), no cap: its memory.peak P0 is the baseline
    uva        ``cpu_offload_params={"experts"}, offload_backend="uva"`` (every expert offloaded)
               under P0 + 1.25 x expert bytes (``--uva-cap-factor``): the bar says it is killed
    uva-nocap  the same without a cap: how much uva really needs (peak as a multiple of the experts)
    mmap-cold  ``offload_backend="mmap"``, empty cache dir (the cache is built while loading)
               under P0 + 0.25 x expert bytes (``--mmap-cap-factor``): the bar says it serves
    mmap-warm  the same again on the cache the cold run left

Every case generates 16 greedy tokens from 2 token-id prompts; they must equal no offload's.
The checkpoint is read once by this process before the children start, so its page cache is
charged to this process's cgroup and no child pays for it (as in the measurement of issue 14);
page cache a child creates (the cold cache's files) is charged to it but reclaimable, pinned pages
are not. Reported per case: outcome (ok / killed (OOM) / failed), memory.peak, the maxima of
memory.stat (anon + shmem), pinned host bytes (uva: torch's pinned allocator peak; mmap: the
engine's exact ring), time to ready (``LLM(...)``), tokens. Writes ``oom_vllm.json`` and
``oom_vllm.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from vllm_runner import _make_cgroup, remove_cgroup  # noqa: E402  (one cgroup discovery for both modes)

MIB = 1 << 20


# ----------------------------------------------------------------------------------------------
# memory caps
# ----------------------------------------------------------------------------------------------


class MemCap:
    """A child memory cgroup (v2 or v1) with ``limit`` bytes, or an rlimit fallback."""

    def __init__(self, name: str, limit: int | None):
        self.limit = limit
        self.kind = "none"
        self.path: Path | None = None
        self.reason = ""
        try:
            self.path, self.kind = _make_cgroup(name)
        except Exception as exc:  # no cgroup we may write: fall back to an rlimit in the child
            self.reason = f"{type(exc).__name__}: {exc}"
            self.kind = "rlimit-data"
            return
        if limit is not None:
            if self.kind == "v2":
                (self.path / "memory.max").write_text(str(limit))
                if (self.path / "memory.swap.max").exists():
                    (self.path / "memory.swap.max").write_text("0")
            else:
                (self.path / "memory.limit_in_bytes").write_text(str(limit))
                sw = self.path / "memory.memsw.limit_in_bytes"
                if sw.exists():
                    try:
                        sw.write_text(str(limit))
                    except OSError:
                        pass

    def preexec(self):
        """Run in the child after fork: join the cgroup (or set the rlimit) before Python starts."""
        path, kind, limit = self.path, self.kind, self.limit

        def enter():
            if kind in ("v1", "v2"):
                with open(path / "cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))
            elif limit is not None:
                resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

        return enter

    def peak(self) -> int | None:
        if self.kind == "v2":
            p = self.path / "memory.peak"
            return int(p.read_text()) if p.exists() else None
        if self.kind == "v1":
            return int((self.path / "memory.max_usage_in_bytes").read_text())
        return None

    def oom_kills(self) -> int | None:
        try:
            if self.kind == "v2":
                for line in (self.path / "memory.events").read_text().splitlines():
                    k, v = line.split()
                    if k == "oom_kill":
                        return int(v)
            if self.kind == "v1":
                for line in (self.path / "memory.oom_control").read_text().splitlines():
                    k, v = line.split()
                    if k == "oom_kill":
                        return int(v)
        except OSError:
            pass
        return None

    def remove(self) -> None:
        remove_cgroup(self.path)


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------


def _emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_hwm() -> int:
    return _status("VmHWM")


def _imports():
    import numpy  # noqa: F401
    import torch  # noqa: F401

    from mmap_offload import cache_reader, checkpoint, transfer, warmup  # noqa: F401
    from mmap_offload.cache_format import checksum  # noqa: F401


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


class _HostAllocatorEmulation:
    """Tensor.pin_memory() as torch's CachingHostAllocator does it: power-of-two blocks, cached on free."""

    def __init__(self, real: bool):
        self.real = real
        self.blocks = []  # never released: the caching allocator keeps freed pinned blocks
        self.requested = 0
        self.reserved = 0

    def empty(self, shape, dtype):
        import torch

        n = dtype.itemsize
        for d in shape:
            n *= int(d)
        size = _next_pow2(n)
        if self.real:
            raw = torch.empty(n, dtype=torch.uint8, pin_memory=True)  # the allocator rounds it itself
        else:
            raw = torch.empty(size, dtype=torch.uint8)
            raw.fill_(0)  # touch every page: pinned pages are resident, unlike a lazy malloc
        self.blocks.append(raw)
        self.requested += n
        self.reserved += size
        return raw[:n].view(dtype).view(*shape)


def _repack(t, kind: str, group: int):
    """vLLM's process_weights_after_loading for one [E, ...] parameter: a new full-size tensor holding
    the Marlin repack (``repack.marlin_repack`` per expert) or the permuted scales, old one still alive."""
    import torch

    from mmap_offload import repack as rp

    if kind == "packed":  # [E, K/8, N] -> [E, K/16, 2N]
        e, k8, n = t.shape
        out = torch.empty((e, k8 // 2, 2 * n), dtype=torch.int32)
        for i in range(e):
            rp.marlin_repack(t[i].t().contiguous(), out=out[i])
        return out
    e, g, n = t.shape  # scales [E, K/g, N], permuted in place of a copy
    size_k = g * group
    return torch.stack([rp.permute_scales(t[i], size_k, group) for i in range(e)])


def child_uva(args) -> int:
    import torch

    from mmap_offload.checkpoint import open_checkpoint

    ckpt = open_checkpoint(args.ckpt)
    moe = ckpt.moe
    E, H, I = moe.num_experts, moe.hidden, moe.intermediate
    group = ckpt.quant.group_size if ckpt.quant.group_size > 0 else H
    alloc = _HostAllocatorEmulation(real=args.real_pin and torch.cuda.is_available())
    params = []
    _emit(event="start", mode="uva", layers=len(moe.layers), experts=E)
    # 1. load: every expert parameter pinned (weight loader: transpose to [K/8, N] / [K/g, N])
    for layer in moe.layers:
        p = {}
        for e in range(E):
            refs = ckpt.expert_refs(layer, e)
            for proj, key in (("gate", "w13"), ("up", "w13"), ("down", "w2")):
                for suffix in ("weight_packed", "weight_scale"):
                    ref = refs[proj][suffix]
                    src = ckpt.read(ref)  # [N, K/8] int32 or [N, K/g]
                    name = f"{key}_{suffix}"
                    if name not in p:
                        n_out = ref.shape[0] * (2 if key == "w13" else 1)
                        p[name] = alloc.empty((E, ref.shape[1], n_out), src.dtype)
                    col = ref.shape[0] if proj == "up" else 0
                    p[name][e, :, col : col + ref.shape[0]].copy_(src.t())
        params.append(p)
        _emit(event="loaded", layer=layer, pinned_reserved=alloc.reserved, vm_hwm=_vm_hwm())
    # 2. process_weights_after_loading: repack per parameter, back to host, pinned again
    for li, p in enumerate(params):
        for name in list(p):
            new = _repack(p[name], "packed" if name.endswith("packed") else "scale", group)
            pinned = alloc.empty(tuple(new.shape), new.dtype)
            pinned.copy_(new)
            del new
            p[name] = pinned  # the old pinned block stays in the allocator's cache
        _emit(event="repacked", layer=moe.layers[li], pinned_reserved=alloc.reserved, vm_hwm=_vm_hwm())
    _emit(event="done", mode="uva", pinned_requested=alloc.requested, pinned_reserved=alloc.reserved, vm_hwm=_vm_hwm())
    return 0


def child_mmap(args) -> int:
    import torch

    from mmap_offload.cache_format import Extent, checksum
    from mmap_offload.cache_reader import open_cache
    from mmap_offload.transfer import Copy, make_engine
    from mmap_offload.warmup import warmup

    _emit(event="start", mode="mmap")
    t0 = time.perf_counter()
    rep = warmup(args.ckpt, args.cache, tp_size=1, device=args.warmup_device, progress=False)
    _emit(event="warm", seconds=time.perf_counter() - t0, bytes=int(getattr(rep, "bytes_written", 0)), vm_hwm=_vm_hwm())
    cache = open_cache(args.cache)
    dev = torch.device(args.device)
    engine = make_engine("mmap", dev, pinned_bytes=args.ring_mib * MIB, threads=4)
    E, rec = cache.num_experts, cache.record_nbytes
    buf = torch.empty((E, rec), dtype=torch.uint8, device=dev)
    ok = bad = 0
    t0 = time.perf_counter()
    try:
        for layer in cache.layers:
            ext = cache.layer_extent(layer)
            dst = [(e * rec, rec, buf[e]) for e in range(E)]
            engine.wait(engine.submit([Copy(src=Extent(ext.path, ext.offset, E * rec), dst=dst)]))
            host = buf.cpu() if dev.type != "cpu" else buf
            for e in range(E):
                want = cache.expected_checksums(layer, e)
                for spec, w in zip(cache.expert_specs, want):
                    got = checksum(host[e, spec.offset : spec.offset + spec.nbytes].numpy())
                    ok += got == w
                    bad += got != w
            _emit(event="served", layer=layer, ok=ok, bad=bad, vm_hwm=_vm_hwm())
        pinned = int(engine.metrics.get("pinned_bytes", 0))
    finally:
        engine.close()
    _emit(event="done", mode="mmap", checksums_ok=ok, checksums_bad=bad, serve_s=time.perf_counter() - t0,
          pinned_bytes=pinned, vm_hwm=_vm_hwm(), rss_anon=_status("RssAnon"))
    return 0 if bad == 0 else 1


def child_baseline(args) -> int:
    _imports()
    _emit(event="done", mode="baseline", vm_hwm=_vm_hwm(), vm_data=_status("VmData"))
    return 0


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------


def run_child(mode: str, args, cap: MemCap, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--ckpt", str(args.ckpt),
           "--cache", str(args.cache), "--device", args.device, "--warmup-device", args.warmup_device,
           "--ring-mib", str(args.ring_mib)] + (["--real-pin"] if args.real_pin else [])
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=cap.preexec())
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    events = []
    for line in out.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    rc = proc.returncode
    last = events[-1] if events else {}
    if rc == -signal.SIGKILL:
        outcome = "killed (SIGKILL: out of memory)" if cap.kind in ("v1", "v2") else "killed (SIGKILL)"
    elif rc == 0 and last.get("event") == "done":
        outcome = "completed"
    elif "MemoryError" in err or "out of memory" in err.lower() or "alloc" in err.lower():
        outcome = "failed to allocate"
    else:
        outcome = f"failed (rc {rc})"
    return dict(mode=mode, outcome=outcome, returncode=rc, seconds=time.perf_counter() - t0,
                cgroup_peak_bytes=cap.peak(), oom_kills=cap.oom_kills(), last_event=last,
                progress=[e for e in events if e.get("event") in ("loaded", "repacked", "served")][-3:],
                stderr_tail=err.strip().splitlines()[-3:] if rc else [])


def choose_shapes(expert_mib: float) -> dict:
    """Layers x experts adding up to ~expert_mib MiB; E and I are not powers of two (as in real MoEs),
    so the allocator's power-of-two rounding shows."""
    hidden, inter, experts = 1024, 768, 48
    per_expert = 3 * hidden * inter // 2 + 3 * hidden * inter // 128 * 2
    if expert_mib >= 2048:  # bigger experts so the per-tensor overhead does not dominate
        hidden, inter, experts = 4096, 1536, 64
        per_expert = 3 * hidden * inter // 2 + 3 * hidden * inter // 128 * 2
    layers = max(2, round(expert_mib * MIB / (per_expert * experts)))
    return dict(hidden=hidden, inter=inter, experts=experts, layers=layers, expert_bytes=layers * experts * per_expert)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--vllm" in argv:
        return main_vllm([a for a in argv if a != "--vllm"])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--expert-mib", type=float, default=192.0, help="total routed expert bytes of the checkpoint")
    p.add_argument("--cap-factor", type=float, default=1.25, help="cap = baseline + factor x expert bytes")
    p.add_argument("--cap-mib", type=float, default=None, help="absolute cap (overrides --cap-factor)")
    p.add_argument("--device", default="cpu", help="where mmap-offload serves layers (cpu or cuda)")
    p.add_argument("--warmup-device", default="cpu", help="device of the warm-up repack")
    p.add_argument("--real-pin", action="store_true", help="UVA child pins with torch (CUDA) instead of emulating")
    p.add_argument("--ring-mib", type=int, default=64)
    p.add_argument("--workdir", default=None)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--child", choices=("uva", "mmap", "baseline"), help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return {"uva": child_uva, "mmap": child_mmap, "baseline": child_baseline}[args.child](args)

    from mmap_offload.synth import make_checkpoint

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="oom-repro-"))
    work.mkdir(parents=True, exist_ok=True)
    shp = choose_shapes(args.expert_mib)
    args.ckpt, args.cache = work / "ckpt", work / "cache"
    if args.cache.exists():
        shutil.rmtree(args.cache)
    t0 = time.perf_counter()
    make_checkpoint(args.ckpt, arch="mixtral", quant="w4a16", num_layers=shp["layers"], num_experts=shp["experts"],
                    hidden=shp["hidden"], intermediate=shp["inter"], top_k=2, vocab_size=256, num_heads=1,
                    num_kv_heads=1, head_dim=128, group_size=128)
    synth_s = time.perf_counter() - t0
    result = dict(shapes=shp, synth_s=synth_s, workdir=str(work))
    tag = f"mmo-oom-{os.getpid()}"
    caps = []
    try:
        base_cap = MemCap(tag + "-base", None)
        caps.append(base_cap)
        base = run_child("baseline", args, base_cap, 120)
        if base["outcome"] != "completed":
            raise RuntimeError(f"the baseline child failed: {base['stderr_tail']}")
        if base_cap.kind in ("v1", "v2"):
            baseline = base["cgroup_peak_bytes"] or base["last_event"]["vm_hwm"]
        else:  # RLIMIT_DATA counts private writable memory: the baseline is the child's VmData
            baseline = base["last_event"]["vm_data"]
        cap_bytes = int(args.cap_mib * MIB) if args.cap_mib else int(baseline + args.cap_factor * shp["expert_bytes"])
        result.update(cap_kind=base_cap.kind, cap_fallback_reason=base_cap.reason, baseline_bytes=baseline,
                      cap_bytes=cap_bytes,
                      uva_needs_at_least=baseline + 2 * shp["expert_bytes"])
        for mode in ("uva", "mmap"):
            cap = MemCap(f"{tag}-{mode}", cap_bytes)
            caps.append(cap)
            result[mode] = run_child(mode, args, cap, args.timeout)
    finally:
        for c in caps:
            c.remove()
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    u, m = result["uva"], result["mmap"]
    result["reproduced"] = u["outcome"] != "completed"
    result["mmap_ok"] = (m["outcome"] == "completed" and m["last_event"].get("checksums_bad") == 0
                         and m["last_event"].get("checksums_ok", 0) > 0)
    doc = json.dumps(result, indent=1)
    print(doc)
    mib = lambda n: f"{(n or 0) / MIB:.0f} MiB"  # noqa: E731
    print(f"cap {mib(cap_bytes)} ({result['cap_kind']}); experts {mib(shp['expert_bytes'])}, baseline {mib(baseline)}")
    print(f"uva : {u['outcome']}; peak: cgroup (incl. page cache) {mib(u['cgroup_peak_bytes'])}, "
          f"process RSS {mib(u['last_event'].get('vm_hwm'))} at its last report")
    print(f"mmap: {m['outcome']}; peak: cgroup (incl. reclaimable page cache) {mib(m['cgroup_peak_bytes'])}, "
          f"process RSS {mib(m['last_event'].get('vm_hwm'))}, anon at end {mib(m['last_event'].get('rss_anon'))}; "
          f"checksums ok {m['last_event'].get('checksums_ok')} bad {m['last_event'].get('checksums_bad')}")
    if args.json:
        Path(args.json).write_text(doc)
    return 0 if result["reproduced"] and result["mmap_ok"] else 1


# ----------------------------------------------------------------------------------------------
# Real vLLM (--vllm)
# ----------------------------------------------------------------------------------------------

VLLM_CASES = ("noff", "uva", "uva-nocap", "mmap-cold", "mmap-warm")
VLLM_PROMPTS = [[1, 5, 9, 200, 33], [7, 8, 9, 10, 11, 12, 13, 14]]


def _vllm_args(argv):
    p = argparse.ArgumentParser(description="real-vLLM OOM reproduction (oom_repro.py --vllm)")
    p.add_argument("--out", required=True, help="oom_vllm.json and oom_vllm.md go here")
    p.add_argument("--workdir", default=None)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="2 layers x 4 experts, bf16 (vLLM's CPU build)")
    p.add_argument("--quant", default=None, choices=("w4a16", "bf16"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=24)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--cases", default=",".join(VLLM_CASES), help=f"some of {','.join(VLLM_CASES)} (noff first)")
    p.add_argument("--uva-cap-factor", type=float, default=1.25)
    p.add_argument("--mmap-cap-factor", type=float, default=0.25)
    p.add_argument("--cap-slack-mib", type=float, default=0.0, help="added to both caps (noise on a small model)")
    p.add_argument("--mmap-options", default="{}", help="JSON merged into additional_config['mmap_offload']")
    p.add_argument("--gpu-util", type=float, default=0.3)
    p.add_argument("--timeout", type=float, default=300.0, help="per child, seconds")
    p.add_argument("--deadline", type=float, default=540.0, help="whole run, seconds: later cases are skipped")
    p.add_argument("--python", default=None, help="interpreter of the children (default: this one)")
    p.add_argument("--no-cgroup", action="store_true")
    a = p.parse_args(argv)
    if a.tiny:
        a.layers, a.experts, a.hidden, a.intermediate, a.top_k = 2, 4, 128, 256, 2
    a.quant = a.quant or ("bf16" if a.tiny else "w4a16")
    return a


def _read_all(folder: Path) -> int:
    """Read every file of ``folder`` once (page cache charged to this process's cgroup)."""
    n = 0
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while True:
                    b = fh.read(8 << 20)
                    if not b:
                        break
                    n += len(b)
    return n


def _vllm_spec(a, case: str, ckpt: Path, cache: Path, expert_bytes: int) -> dict:
    llm = dict(model=str(ckpt), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
               max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    if a.device == "cuda":
        llm.update(attention_config={"backend": "TRITON_ATTN"}, gpu_memory_utilization=a.gpu_util)
    if case.startswith("uva"):
        llm.update(cpu_offload_params=["experts"], offload_backend="uva",
                   cpu_offload_gb=round(expert_bytes / 2**30 + 1.0, 3))  # more than every expert: all offloaded
    elif case.startswith("mmap"):
        llm.update(offload_backend="mmap",
                   additional_config={"mmap_offload": {"cache_dir": str(cache), **json.loads(a.mmap_options)}})
    return {"label": case, "register_backend": case.startswith("mmap"), "num_experts": a.experts,
            "env": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}, "llm": llm,
            "tasks": [{"kind": "greedy", "name": "greedy", "prompts": VLLM_PROMPTS, "max_tokens": 16}]}


def vllm_case_report(child: dict, expert_bytes: int, baseline: int | None) -> dict:
    """One row of the report from a run_child result."""
    ready = child.get("ready") or {}
    greedy = next((e["result"] for e in child["tasks"] if e.get("name") == "greedy"), {})
    done = next((e for e in reversed(child["events"]) if e.get("event") == "done"), {})
    summary = done.get("summary") or ready.get("summary") or {}
    torch_pinned = max((e.get("mem", {}).get("torch_pinned_peak", 0) for e in child["events"]), default=0)
    cg = child["cgroup"]
    peak = cg.get("peak")
    st = cg.get("stat_max") or {}
    last = child["events"][-1] if child["events"] else {}
    return {
        "case": child["label"], "outcome": child["outcome"], "killed": child["outcome"].startswith("killed (OOM)"),
        "cap_bytes": cg.get("mem_max"), "cgroup": cg.get("kind"), "peak_bytes": peak, "oom_kill": cg.get("oom_kill"),
        "peak_over_experts": round(peak / expert_bytes, 3) if peak else None,
        "excess_over_noff_experts": round((peak - baseline) / expert_bytes, 3) if peak and baseline else None,
        "anon_shmem_peak_bytes": st.get("anon+shmem"), "file_peak_bytes": st.get("file", st.get("cache")),
        "pinned_bytes": int(torch_pinned or 0) + int(summary.get("engine_pinned_bytes", 0) or 0),
        "torch_pinned_peak": torch_pinned, "engine_pinned_bytes": summary.get("engine_pinned_bytes"),
        "ready_s": ready.get("ready_s"), "process_ready_s": ready.get("t"), "wall_s": child["wall_s"],
        "last_stage": last.get("event") if last.get("event") != "task" else f"task {last.get('name')}",
        "tokens": greedy.get("tokens"), "moe_kernel": (ready.get("model_info") or {}).get("moe_experts_kernel"),
        "uva_expert_bytes": (ready.get("model_info") or {}).get("expert_bytes_uva"),
        "offloader_summary": summary or None,
        "log_tail": child.get("log_tail"),
    }


def vllm_markdown(res: dict) -> str:
    gb = lambda n: "" if n is None else f"{n / 1e9:.2f} GB"  # noqa: E731
    L = [f"Real vLLM {res['env'].get('vllm', '?')} on {res['env'].get('gpu') or 'CPU'}; {res['shapes_text']}: "
         f"{gb(res['expert_bytes'])} of experts; no-offload peak P0 = {gb(res['baseline_bytes'])}; cgroup {res['cgroup_kind']}.",
         "",
         "| case | cap | outcome | memory.peak | peak / expert bytes | (peak - P0) / expert bytes | anon+shmem peak | pinned | ready s | tokens = no offload |",
         "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in res["cases"]:
        cap = "none" if r.get("cap_bytes") is None else gb(r["cap_bytes"]) + (
            f" (P0 + {r['cap_factor']} x experts{' + slack' if res['cap_slack_bytes'] else ''})"
            if r.get("cap_factor") is not None else "")
        out = r["outcome"] if not r["killed"] else f"**{r['outcome']}** at {r.get('last_stage')}"
        eq = {True: "yes", False: "**no**", None: "-"}[r.get("tokens_equal")]
        L.append(f"| {r['case']} | {cap} | {out[:90]} | {gb(r.get('peak_bytes'))} | {r.get('peak_over_experts') or ''} | "
                 f"{r.get('excess_over_noff_experts') if r.get('excess_over_noff_experts') is not None else ''} | "
                 f"{gb(r.get('anon_shmem_peak_bytes'))} | {gb(r.get('pinned_bytes'))} | {r.get('ready_s') or ''} | {eq} |")
    L += ["", "| bar (issue 14) | result | met |", "| --- | --- | --- |"]
    for b in res["bars"]:
        L.append(f"| {b['bar']} | {b['result']} | {({True: 'yes', False: '**no**', None: 'not measured'})[b['met']]} |")
    return "\n".join(L) + "\n"


def main_vllm(argv) -> int:
    """``--vllm``: the cases of the module docstring's section "Real vLLM", one child each."""
    a = _vllm_args(argv)
    t_start = time.time()
    from mmap_offload.synth import make_checkpoint

    import vllm_runner

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="oom-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    ckpt, cache = work / "ckpt", work / "cache"
    shapes = dict(arch="mixtral", quant=a.quant, num_layers=a.layers, num_experts=a.experts, hidden=a.hidden,
                  intermediate=a.intermediate, top_k=a.top_k, vocab_size=2048 if not a.tiny else 1000,
                  num_heads=max(1, a.hidden // 128), num_kv_heads=max(1, min(8, a.hidden // 512)),
                  group_size=128 if a.hidden % 128 == 0 and a.intermediate % 128 == 0 else 64)
    t = time.perf_counter()
    make_checkpoint(ckpt, **shapes)
    synth_s = time.perf_counter() - t
    from mmap_offload.checkpoint import open_checkpoint

    with open_checkpoint(ckpt) as c:
        expert_bytes = sum(r.nbytes for li in c.moe.layers for e in range(c.moe.num_experts)
                           for parts in c.expert_refs(li, e).values() for r in parts.values())
    read = _read_all(ckpt)
    shapes_text = (f"{a.quant.upper()} {a.layers} layers x {a.experts} experts, H {a.hidden}, I {a.intermediate}, "
                   f"top-{a.top_k}")
    print(f"checkpoint {ckpt}: {shapes_text}, {expert_bytes / 1e9:.2f} GB of experts, {read / 1e9:.2f} GB read into "
          f"the page cache by this process ({synth_s:.1f} s)", flush=True)
    cases = [c for c in a.cases.split(",") if c]
    bad = [c for c in cases if c not in VLLM_CASES]
    if bad:
        raise SystemExit(f"unknown case(s) {bad}: use some of {','.join(VLLM_CASES)}")
    if cases and cases[0] != "noff" and any(c in ("uva", "mmap-cold", "mmap-warm") for c in cases):
        cases = ["noff"] + [c for c in cases if c != "noff"]  # the caps need P0
    slack = int(a.cap_slack_mib * MIB)
    baseline = None
    rows, env, cg_kind = [], {}, None
    for case in cases:
        left = t_start + a.deadline - time.time()
        if left < 30:
            rows.append({"case": case, "outcome": "skipped (deadline)", "killed": False})
            continue
        cap, factor = None, None
        if case in ("uva", "mmap-cold", "mmap-warm") and baseline is not None:
            factor = a.uva_cap_factor if case == "uva" else a.mmap_cap_factor
            cap = int(baseline + factor * expert_bytes) + slack
        if case == "mmap-cold":
            shutil.rmtree(cache, ignore_errors=True)
        spec = _vllm_spec(a, case, ckpt, cache, expert_bytes)
        print(f"== {case}: cap {'none' if cap is None else f'{cap / 1e9:.2f} GB'}", flush=True)
        child = vllm_runner.run_child(spec, workdir=work / "children", mem_max=cap, timeout=min(a.timeout, left),
                                      cgroup=not a.no_cgroup, python=a.python)
        r = vllm_case_report(child, expert_bytes, baseline)
        r["cap_factor"] = factor
        cg_kind = cg_kind or r["cgroup"]
        if case == "noff":
            baseline = r["peak_bytes"]
            if baseline is None:  # no cgroup: the child's own peak RSS
                baseline = max((e.get("mem", {}).get("VmHWM", 0) for e in child["events"]), default=None)
                r["baseline_from"] = "VmHWM (no cgroup)"
        if not env:
            imp = next((e for e in child["events"] if e.get("event") == "imported"), None)
            if imp:
                env = {k: imp.get(k) for k in ("vllm", "torch", "gpu")}
        print(f"   {case}: {r['outcome']}; memory.peak {(r['peak_bytes'] or 0) / 1e9:.2f} GB, pinned "
              f"{(r['pinned_bytes'] or 0) / 1e9:.2f} GB, ready {r['ready_s']} s", flush=True)
        if child["outcome"] != "ok" and not r["killed"]:
            for line in (child.get("log_tail") or [])[-15:]:
                print("   | " + line, flush=True)
        rows.append(r)
    ref = next((r.get("tokens") for r in rows if r["case"] == "noff"), None)
    for r in rows:
        toks = r.get("tokens")
        r["tokens_equal"] = None if (toks is None or ref is None or r["case"] == "noff") else toks == ref
    by = {r["case"]: r for r in rows}

    def served(c):
        r = by.get(c)
        if r is None or r["outcome"].startswith("skipped"):
            return None
        return r["outcome"] == "ok" and r.get("tokens_equal") is True

    bars_ = []
    if "uva" in by and not by["uva"]["outcome"].startswith("skipped"):
        u = by["uva"]
        bars_.append({"bar": f"uva killed under P0 + {a.uva_cap_factor} x expert bytes", "result": u["outcome"],
                      "met": u["killed"]})
    for c in ("mmap-cold", "mmap-warm"):
        if c in by and not by[c]["outcome"].startswith("skipped"):
            r = by[c]
            bars_.append({"bar": f"{c} serves under P0 + {a.mmap_cap_factor} x expert bytes, tokens = no offload",
                          "result": f"{r['outcome']}, peak {r.get('peak_over_experts')} x expert bytes, "
                                    f"tokens equal {r.get('tokens_equal')}", "met": served(c)})
    if "uva-nocap" in by and by["uva-nocap"].get("excess_over_noff_experts") is not None:
        r = by["uva-nocap"]
        bars_.append({"bar": "uva without a cap needs (peak - P0) / expert bytes", "result":
                      f"{r['excess_over_noff_experts']}x ({r['peak_bytes'] / 1e9:.2f} GB peak)", "met": None})
    res = {
        "command": "python3 benchmarks/oom_repro.py --vllm " + " ".join(argv),
        "env": env, "device": a.device, "shapes": shapes, "shapes_text": shapes_text, "expert_bytes": expert_bytes,
        "baseline_bytes": baseline, "cgroup_kind": cg_kind, "cap_slack_bytes": slack,
        "mmap_options": json.loads(a.mmap_options), "cases": rows, "bars": bars_,
        "page_cache": "checkpoint read by the parent before the children (charged outside their cgroups)",
        "synth_s": round(synth_s, 1), "wall_s": round(time.time() - t_start, 1),
    }
    (out / "oom_vllm.json").write_text(json.dumps(res, indent=1, default=str))
    md = vllm_markdown(res)
    (out / "oom_vllm.md").write_text(md)
    print(md, flush=True)
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(b["met"] is not False for b in bars_)
    return 0 if ok and all(not r["outcome"].startswith("failed") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
