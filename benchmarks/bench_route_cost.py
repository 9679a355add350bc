"""The launching thread's price of the hybrid decode path, per MoE layer: ``Residency.route`` (the
stream hybrid call: ``AsyncStep.run_hybrid``'s enqueue and the Python around it) and patch 4b's
``add_host`` (the host rows' collect and its add), on a synthetic Marlin cache, with a stand-in for
vLLM's MoE kernel (one small matmul launch) between them.

Why: in real vLLM at decode (``--enforce-eager``) every microsecond the launching thread spends here is
a microsecond of the step (docs/BENCHMARKS.md, session 20: route ~250 us and collect ~100 us per layer
of a 20-27 ms step at batch 8 on the H200's host). The same loop without route/add_host is the floor.

    python benchmarks/bench_route_cost.py [--device cuda] [--steps 300] [--tokens 8] [--variant fast] [--out DIR]

``--variant`` (session 30) times the serving path against what it replaced: ``fast`` (a layer's steady
hybrid calls skip route()'s general path, and on CUDA three launches per layer are gone: one gather brings
the call's ids, weights and rows down, the copy kernel brings the kernel's weights and ids up, one launch
adds the host's rows), ``general`` (route()'s general path), ``copies`` (cudaMemcpy and torch's add_),
``old`` (both, the path before session 30). One process per variant; interleave them in one GPU call.

Prints one table (microseconds per layer: route, of it the async hybrid call and its C enqueues,
add_host, the stand-in step, the floor) and writes route_cost.json to --out. Not a test: no bar.

The stand-in also makes ``--launches`` small device ops per layer (vLLM's own launches: half before the
router, half after the MoE kernel), timed apart in both loops: their time beside ours against alone says
whether our work on the stream (host-function callbacks, copy threads, host jobs) slows the launches of
the code around it. In real vLLM (session 21) vLLM's own code ran ~1.3x slower beside ours at decode
batch 1, where the copy path moves ~86 MiB per step (no DRAM pressure) and the host computes nothing:
``--tokens 1 --slots 16`` takes that path (the async expert step, no host jobs). On CUDA a third loop
puts ``--host-funcs`` no-op host functions per layer where the router is, and nothing else of ours:
whether the callbacks alone slow the launches around them. On the H200 (session 22) they did not
(1.01x at 1 token, 1.06x at 8); beside our whole path the stand-in ran 1.13x and 1.03x.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

H, INTER, GROUP, E, K = 512, 256, 128, 32, 8
VARIANTS = ("fast", "general", "copies", "old")


def _residency(tmp: Path, device: torch.device, layers: tuple, slots: int):
    from fakes import cuda_engine, real_engines
    from test_hybrid import make_marlin_cache

    from mmap_offload.vllm_backend.options import MmapOptions
    from mmap_offload.vllm_backend.residency import Residency

    cache = make_marlin_cache(tmp, hidden=H, inter=INTER, group=GROUP, experts=E, layers=layers, seed=3)
    for layer in layers:
        cache.check_experts_once(layer, list(range(E)))
    if device.type == "cuda":
        eng = cuda_engine("ordered")
    else:
        eng = next(f for f in real_engines() if getattr(f, "name", "") == "real-mmap-ordered")()
    bufs = {l: {s.name: torch.zeros((E, *s.shape), dtype=s.torch_dtype, device=device) for s in cache.expert_specs}
            for l in layers}
    targets = [SimpleNamespace(layer=l, index=i, served=(), experts=None) for i, l in enumerate(layers)]
    opts = MmapOptions(hybrid=True, host_threads=2, layer_stream_fraction=1.0)
    off = SimpleNamespace(options=opts, device=device, cache=cache, engine=eng, targets=targets, tp_size=1,
                          _transforms={}, prefetcher=SimpleNamespace(claim=lambda layer, event=True: (bufs[layer], None)))
    nbytes = sum(s.nbytes for s in cache.expert_specs)
    return Residency(off, capacity_bytes=slots * len(layers) * nbytes), eng, targets


def _calls(steps: int, n: int, layers: int, device, seed: int = 9):
    """Per step and layer: (ids [n, K] of the project's skewed trace, weights f32 [n, K], x bf16 [n, H])."""
    from mmap_offload.traces import skewed_trace

    trace = skewed_trace(steps, layers, E, K, batch=n, seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        row = []
        for l in range(layers):
            w = rng.random((n, K)).astype(np.float32)
            x = torch.from_numpy(rng.standard_normal((n, H)).astype(np.float32)).to(torch.bfloat16)
            row.append((torch.from_numpy(trace[s, l]).to(device), torch.from_numpy(w / w.sum(1, keepdims=True)).to(device),
                        x.to(device)))
        out.append(row)
    return out


def _noop_host_func():
    """f(stream): enqueue a host function that does nothing (libc's ``free(NULL)``) on ``stream``, through
    the CUDA runtime torch loaded; the cost of a callback on the stream and on CUDA's thread, no work."""
    import ctypes

    from mmap_offload.async_step import _host_func  # the address the async step enqueues its callbacks with

    try:
        addr = _host_func()
    except RuntimeError as e:
        raise SystemExit(f"bench_route_cost: {e} (pass --host-funcs 0)") from None
    launch = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)(addr)
    free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p).value

    def enqueue(stream: int) -> None:
        err = launch(stream, free, None)
        if err:
            raise RuntimeError(f"cudaLaunchHostFunc failed ({err})")

    return enqueue


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--slots", type=int, default=6, help="pool slots per layer (fewer than a call's experts)")
    ap.add_argument("--launches", type=int, default=24,
                    help="small device ops per layer standing in for vLLM's own launches (half before the router, half "
                         "after the MoE kernel), timed apart in both loops")
    ap.add_argument("--host-funcs", type=int, default=2,
                    help="a third loop, CUDA only: the stand-in with this many no-op host functions per layer at the "
                         "router's place (cudaLaunchHostFunc of libc's free(NULL)) and nothing of ours: what the "
                         "callbacks alone cost the launches around them (0: no such loop)")
    ap.add_argument("--variant", default="fast", choices=VARIANTS,
                    help="fast: the serving path (a layer's steady hybrid calls skip route()'s general path; one launch "
                         "brings the inputs down, the copy kernel the kernel's weights and ids up, one adds the host's "
                         "rows); general: route()'s general path for every call; copies: cudaMemcpy and torch's add_ "
                         "instead of those launches (MMO_ASYNC_LAUNCHES=copies); old: both, as before session 30")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    layers = tuple(range(a.layers))
    tmp = Path(tempfile.mkdtemp(prefix="route-cost-"))
    saved = os.environ.get("MMO_ASYNC_LAUNCHES")
    os.environ["MMO_ASYNC_LAUNCHES"] = "copies" if a.variant in ("copies", "old") else "fused"
    try:
        res, eng, targets = _residency(tmp, dev, layers, a.slots)
    finally:
        if saved is None:
            del os.environ["MMO_ASYNC_LAUNCHES"]
        else:
            os.environ["MMO_ASYNC_LAUNCHES"] = saved
    if a.variant in ("general", "old"):
        res._fast_on = False  # route()'s general path for every call (MMO_FAST_HYBRID=0)
    w_kernel = torch.randn(H, H, device=dev, dtype=torch.bfloat16)
    calls = _calls(16, a.tokens, a.layers, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    small = torch.ones(64, device=dev)
    half = a.launches // 2
    clock = time.perf_counter

    host_func = _noop_host_func() if dev.type == "cuda" and a.host_funcs > 0 else None

    def step_loop(n_steps: int, ours: bool, host_funcs: int = 0) -> tuple[float, float]:
        """(the loop's wall time, of it the stand-in's own launches)"""
        t0, own = clock(), 0.0
        stream = torch.cuda.current_stream(dev).cuda_stream if host_funcs else None
        for s in range(n_steps):
            for t in targets:
                ids, w, x = calls[s % len(calls)][t.index]
                t1 = clock()
                for _ in range(half):  # vLLM's own launches before the router (norms, attention)
                    small.neg_()  # exact: the values never drift into denormals
                own += clock() - t1
                if ours:
                    w, ids = res.route(t, w, ids, x)
                for _ in range(host_funcs):
                    host_func(stream)
                t1 = clock()
                out = x @ w_kernel  # the stand-in MoE kernel: one launch
                own += clock() - t1
                if ours:
                    out = res.add_host(t, out)
                t1 = clock()
                for _ in range(a.launches - half):  # and after the MoE kernel
                    small.neg_()  # exact: the values never drift into denormals
                own += clock() - t1
            sync()  # the step's end: vLLM samples (a host sync)
        return clock() - t0, own

    try:
        if res.async_step is None or res._hy_sources is None:
            raise SystemExit(f"bench_route_cost: no stream hybrid path here ({res.async_off or 'no W4A16 host kernel'})")
        step_loop(20, True)
        step_loop(20, False)
        m0 = dict(res.metrics)
        a0 = res.async_step.summary()
        wall, own = step_loop(a.steps, True)
        m1 = res.metrics
        a1 = res.async_step.summary()
        floor, own_floor = min(step_loop(a.steps, False) for _ in range(2))
        hf = hf_error = None
        if host_func is not None:  # first run on the H200 pending (session 21): a failure costs this loop only
            try:
                hf = min(step_loop(a.steps, False, a.host_funcs) for _ in range(2))
            except Exception as e:  # noqa: BLE001
                hf_error = f"{type(e).__name__}: {e}"[:200]
        n = a.steps * len(targets)

        def us(key, src1=m1, src0=m0):
            return (src1[key] - src0[key]) / n * 1e6

        row = dict(device=str(dev), variant=a.variant, fused_launches=bool(res.async_step.fused_launches),
                   fast_hybrid_calls=int(m1["fast_hybrid_calls"] - m0["fast_hybrid_calls"]), tokens=a.tokens, layers=a.layers, steps=a.steps,
                   route_us=us("route_s"), hybrid_call_us=us("native_s"), enqueue_us=us("enqueue_s", a1, a0),
                   add_host_us=us("collect_s"), check_us=us("check_s"),
                   hybrid_calls=int(m1["hybrid_async_calls"] - m0["hybrid_async_calls"]),
                   async_calls=int(m1["async_calls"] - m0["async_calls"]),
                   step_us=wall / n * 1e6, floor_us=floor / n * 1e6, launches=a.launches,
                   standin_us=own / n * 1e6, standin_floor_us=own_floor / n * 1e6)
        row["ours_us"] = row["step_us"] - row["floor_us"]
        row["standin_x"] = row["standin_us"] / max(row["standin_floor_us"], 1e-9)
        if hf is not None:  # the stand-in beside no-op host functions alone
            row.update(host_funcs=a.host_funcs, host_funcs_step_us=hf[0] / n * 1e6, standin_host_funcs_us=hf[1] / n * 1e6)
        elif hf_error:
            row["host_funcs_error"] = hf_error
        print(f"# variant {a.variant}: fast path {row['fast_hybrid_calls']} of {n} calls, fused launches "
              f"{row['fused_launches']}")
        print(f"# the launching thread per MoE layer, {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'host'}),"
              f" {a.tokens} tokens x top-{K} of {E} experts, {a.slots} slots, {a.steps} steps x {a.layers} layers")
        print("| route us | of it: hybrid call | of that: C enqueues | add_host us | of it: check | step us | floor us | ours us "
              f"| stand-in's {a.launches + 1} launches us: beside ours / alone (x) |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(f"| {row['route_us']:.1f} | {row['hybrid_call_us']:.1f} | {row['enqueue_us']:.1f} | {row['add_host_us']:.1f} "
              f"| {row['check_us']:.1f} | {row['step_us']:.1f} | {row['floor_us']:.1f} | {row['ours_us']:.1f} "
              f"| {row['standin_us']:.1f} / {row['standin_floor_us']:.1f} ({row['standin_x']:.2f}) |")
        print(f"hybrid calls {row['hybrid_calls']}, async expert calls {row['async_calls']} of {n}; ceiling: the floor "
              "(ours 0 us per layer); the stand-in's x > 1 is vLLM's own launches slowed beside ours")
        if hf_error:
            print(f"the no-op host functions' loop failed: {hf_error}")
        if hf is not None:
            print(f"beside {a.host_funcs} no-op host functions per layer and nothing else of ours: step "
                  f"{row['host_funcs_step_us']:.1f} us, the stand-in's launches {row['standin_host_funcs_us']:.1f} us "
                  f"(x {row['standin_host_funcs_us'] / max(row['standin_floor_us'], 1e-9):.2f} alone)")
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "route_cost.json").write_text(json.dumps(row, indent=1))
    finally:
        res.close()
        eng.close()
    return row


if __name__ == "__main__":
    main()
