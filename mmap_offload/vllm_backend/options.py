"""What a user can set for ``--offload-backend mmap`` (stable: independent of vLLM's internals).

Precedence: ``additional_config={"mmap_offload": {...}}`` (``--additional-config``), then
``MMAP_OFFLOAD_<FIELD>`` environment variables, then the defaults below.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from typing import Any

from ..errors import UnsupportedError

CONFIG_KEY = "mmap_offload"  # key of vLLM's additional_config
ENV_PREFIX = "MMAP_OFFLOAD_"
COPY_THREADS = 8  # the engine's copy threads by default (MmapOptions.copy_threads)
HYBRID_COPY_THREADS = 6  # ... with hybrid: its host threads get the cores the copy threads leave
HELD_SHARE_COPY_CORES = 3  # ... of which the host's default count leaves at most 3 with hybrid_share 1


@dataclass
class MmapOptions:
    """What a user can set. Each field is also ``MMAP_OFFLOAD_<FIELD>`` and
    ``additional_config["mmap_offload"][field]``."""

    cache_dir: str | None = None  # default: ~/.cache/mmap-offload/<model dir name>
    engine: str = "auto"  # transfer engine: auto | mmap | pread | kvikio
    lookahead: int = 1  # layers copied ahead of compute; lookahead + 1 slot buffers
    params: tuple[str, ...] = ()  # name segments to offload; () = vLLM's --cpu-offload-params, else "experts"
    rebuild: bool = True  # build a missing/stale/corrupt cache at start; False: refuse
    verify: bool = False  # read and checksum the whole cache at start
    verify_first_use: bool = True  # checksum each layer before this process first serves it
    # with verify_first_use: a low-priority thread checks every expert from start-up on, so first
    # uses find them checked instead of reading them on the decode path (cache_reader.BackgroundCheck)
    verify_in_background: bool = True
    warmup_device: str = "auto"  # where a cold start repacks: auto (this rank's GPU) | cpu | cuda
    pinned_mib: int = 256  # pinned staging of the mmap/pread engines (exact size)
    # copy threads of the engine; 0 = auto: 8 that stream whole layers (layer_copy_threads()), and
    # for decode's misses 8, or 6 with hybrid, whose host threads take the cores those leave
    # (copy_threads(); docs/VLLM.md, BENCHMARKS.md "Real vLLM" sessions 18 and 33)
    threads: int = 0
    # routing-aware residency (docs/VLLM.md "Expert cache"): a VRAM pool of whole experts that the
    # MoE kernel reads through remapped ids; None = auto (half of what vLLM's memory budget leaves
    # free after the weights, capped at the experts' bytes); 0 = whole-layer streaming only
    expert_cache_gib: float | None = None
    # a step whose layer routes more than this fraction of the layer's experts streams the whole
    # layer (prefill, large batches) instead of fetching experts one by one
    layer_stream_fraction: float = 0.5
    # expert cache: a step's misses are ordered on the MoE kernel's stream behind a gate that opens
    # once the copy threads have read them (docs/TRANSFER.md "Stream-ordered batches"), instead of
    # the launching thread waiting for the threads to read and issue them; half of the pinned ring
    # is set aside for them. False: the launching thread waits (the path before session 7)
    stream_ordered: bool = True
    # with stream_ordered: expert mode's per-layer work (ids to the host, hits and misses, eviction,
    # the misses' batch, slot ids) in one native call (mmap_offload/expert_step.py); False: Python
    native_step: bool = True
    # with native_step: a decode layer is decided on the stream (a host-function callback + a copy
    # kernel, mmap_offload/async_step.py; calls of more ids than its pool's slots fill the layer
    # buffer's routed rows): vLLM's thread never waits for the router's ids. False: the native step
    # waits for them per layer
    async_step: bool = True
    # hybrid: at decode, misses are split between host compute (straight from the cache's bytes,
    # host/kernel.py) and the copy path, so that both finish together (host_experts.py). None ("auto",
    # the `mmap-offload vllm` launcher's default): on where it was measured ahead, a W4A16 cache served on
    # CUDA with the expert cache, the native host kernel and the stream path; off elsewhere
    # (MmapOffloader.post_init decides, before the engine's thread counts, and logs why)
    hybrid: bool | None = False
    # with hybrid and async_step, W4A16: a sparse call on the stream (more ids than the pool's slots,
    # decode at batch 8) sends a share of its misses that are not admitted into the pool to the host
    # kernel, started from the stream's callback (async_step.py run_hybrid), and a call whose ids fit
    # the pool takes the async step without the host; False: hybrid calls wait for the router
    # (host_experts.py's Python path) and sparse ones copy every miss
    hybrid_stream: bool = True
    # with hybrid_stream: how many staging loads (parts: a callback and a kernel each on the stream) a
    # hybrid call may copy; 0 the fewest that hold its admissions into the pool (the misses beyond
    # them go to the host), -1 as many as a plain sparse call (most empty at batch 8), n > 0 at most n
    hybrid_parts: int = 0
    # with hybrid_stream: the share of a hybrid call's misses not admitted into the pool that the host
    # computes. 1 (default): every such miss; only what the pool admits is copied (each copied byte
    # crosses the host's DRAM three times, each computed one once, and at decode batch 8 DRAM bounds the
    # step: BENCHMARKS.md "Real vLLM", sessions 31-32). -1: it starts at the host's calibrated rate
    # against the copy path's and each collect adapts it (up when the host's job was done first, down
    # when the stream waited for it), as if the host and the copies were independent (the default
    # before session 32). Another value in [0, 1] holds the share there
    hybrid_share: float = 1.0
    # with hybrid_stream: how many of a hybrid call's misses the VRAM pool may admit (copy and keep for the
    # calls after it; the pool's policy picks which). 4 (default): as a plain sparse call. 0: the pool
    # learns nothing from hybrid calls, so (with hybrid_share 1) the host computes every routed expert the
    # pool does not hold already, but one copied where a call has no hit (the row its host pairs point
    # at): experts on the CPU, llama.cpp's --cpu-moe / KTransformers' way, inside vLLM; with
    # hybrid_small_calls "on" batch 1 too
    hybrid_admit: int = 4
    # host compute threads; 0 = this rank's CPUs less vLLM's launching thread and the copy threads, of
    # which at most HELD_SHARE_COPY_CORES are counted where hybrid_share is 1 on the stream path (they
    # copy only the pool's admissions then, and sleep while idle): 12 at 16 cores, else 9; and at most
    # one per physical core but the launching thread's (hosts with two threads per core: cpus.py)
    host_threads: int = 0
    # with hybrid, W4A16: how long (us) an idle host compute thread spins before it sleeps; a sleeping
    # thread joins the next host job late (~0.1 ms on the H200's host: host/kernel.py SPIN_US). 0: sleep at once
    host_spin_us: float = 1000.0
    # with hybrid_stream: calls whose ids fit the pool (decode batch 1) take the hybrid sparse form too,
    # so that their misses not admitted into the pool can go to the host kernel instead of the link.
    # "off": they take the async expert step, copying every miss. "on": the hybrid form always.
    # "auto" (default): the expert step until the end-of-step check has seen such calls miss
    # hybrid_small_ms of link time or more per call (an average over their steps, from 0, weight 0.1 to
    # the newest), then the hybrid form until they miss under 3/4 of it. On the H200 in real vLLM the
    # hybrid form won where batch 1's calls missed ~56 MiB each (independent uniform picks at the
    # default shapes: sessions 23-25, 4 runs of 4) and ~25 MiB (the skewed trace at the default shapes:
    # session 26, 0.990x uva against 0.839x, 3 children each), tied at ~35 MiB (the user's shapes'
    # uniform picks: ahead in sessions 23 and 26, behind in 25) and lost at ~11 MiB (the skewed trace at
    # the user's shapes, sessions 14 and 17): "auto" takes each side's winner (BENCHMARKS.md "Real
    # vLLM", sessions 24-26)
    hybrid_small_calls: str = "auto"
    # with hybrid_small_calls="auto": the misses' link time per small call (ms: missed bytes / this GPU's
    # pinned host -> device rate, measured when the backend starts) from which they go hybrid. 0.4 ms
    # = 21 MiB at the H200's 55 GB/s: between the measured loss (~11 MiB, 0.21 ms) and the smallest
    # win (~25 MiB, 0.47 ms; session 26 lowered it from 0.6, whose 31.5 MiB left that win on the
    # expert step; at 0.4 in vLLM, session 27: the hybrid form there, the expert step on the user's
    # skewed trace, each ahead of the other form). On PCIe Gen4 (~25 GB/s) it is ~9.5 MiB: a slower
    # link sends misses to the host sooner (the H200's decisions carried over by link time; not
    # measured on Gen4)
    hybrid_small_ms: float = 0.4
    # calls of up to this many routed ids (tokens x top-k) take the sparse form on the stream (the
    # routed experts only: hits copied from the pool on the device, misses through the staging) even
    # where layer_stream_fraction would stream the whole layer. 512 = decode batch 64 at top-8: the
    # H200 in real vLLM (session 13) served it at 482.9 tok/s sparse against 307.2 whole layers and
    # 329.3 for mmap-layer (uniform; skewed 465.9 / 311.0 / 332.8); at bench_moe's shapes (64 experts)
    # batch 8's 64 ids would otherwise stream every layer whole (0.29x uva). 0: the threshold alone
    # decides, and sparse calls stop at 256 ids. Prefill (2k tokens: 16k ids) still streams whole layers
    sparse_max_ids: int = 512
    # with hybrid: the end-of-step check of the step's reads (and of the last layer's host job) runs in
    # patch 4b, after the last MoE layer's kernel and host collect are enqueued, instead of in that
    # layer's route() before vLLM launches its kernel: the GPU runs the last layer's kernel while the
    # host job ends. Still before anything samples from the step, and before the layer's TP all-reduce.
    # On the H200 in real vLLM (session 19, decode batch 8 skewed, 8 interleaved children each) it ran
    # 346.8 tok/s against 331.4 with the check in route(), ahead in each of 3 runs. False: in route()
    check_after_experts: bool = True
    # benchmark only: replace the router's top-k ids by a trace's (CSV: step,layer,expert ids...)
    routing_trace: str | None = None

    def __post_init__(self) -> None:
        self.hybrid_small_calls = _mode(self.hybrid_small_calls)

    @classmethod
    def resolve(cls, extra: dict | None = None, env: dict | None = None) -> "MmapOptions":
        """Options from ``extra`` (additional_config["mmap_offload"]) over ``env`` over defaults.

        Unknown keys or bad values raise UnsupportedError naming the key."""
        env = os.environ if env is None else env
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise UnsupportedError(
                f"unknown mmap_offload option(s) {', '.join(unknown)}", f"use one of {', '.join(known)}"
            )
        out = cls()
        for name, f in known.items():
            raw = extra.get(name, env.get(ENV_PREFIX + name.upper()))
            if raw is None:
                continue
            setattr(out, name, _coerce(name, f.type, raw))
        out.hybrid_small_calls = _mode(out.hybrid_small_calls)
        out.check()
        return out

    def check(self) -> None:
        from ..transfer import ENGINE_KINDS

        if self.engine not in ENGINE_KINDS:
            raise UnsupportedError(f"unknown mmap_offload engine {self.engine!r}", f"use one of {', '.join(ENGINE_KINDS)}")
        if self.threads < 0:
            raise UnsupportedError(f"mmap_offload threads must be >= 0, got {self.threads}",
                                   f"pass 0 (auto: {COPY_THREADS}, {HYBRID_COPY_THREADS} with hybrid) or a count")
        if self.host_threads < 0:
            raise UnsupportedError(f"mmap_offload host_threads must be >= 0, got {self.host_threads}",
                                   "pass 0 (auto: the cores the copy threads and vLLM's thread leave) or a count")
        if not 0 <= self.host_spin_us <= 1e6:
            raise UnsupportedError(f"mmap_offload host_spin_us must be in [0, 1000000], got {self.host_spin_us}",
                                   "pass the microseconds an idle host thread spins before it sleeps, e.g. 1000")
        if self.lookahead < 0:
            raise UnsupportedError(f"mmap_offload lookahead must be >= 0, got {self.lookahead}", "pass 0 or more")
        if self.expert_cache_gib is not None and self.expert_cache_gib < 0:
            raise UnsupportedError(
                f"mmap_offload expert_cache_gib must be >= 0, got {self.expert_cache_gib}",
                "pass 0 (layer streaming only), a size in GiB, or leave it unset (auto)",
            )
        if not 0.0 < self.layer_stream_fraction <= 1.0:
            raise UnsupportedError(
                f"mmap_offload layer_stream_fraction must be in (0, 1], got {self.layer_stream_fraction}",
                "pass e.g. 0.5",
            )
        if not 0 <= self.sparse_max_ids <= 4096:
            raise UnsupportedError(
                f"mmap_offload sparse_max_ids must be in [0, 4096], got {self.sparse_max_ids}",
                "pass 0 (the layer threshold decides) or the routed ids per call to serve sparse, e.g. 512",
            )
        if self.hybrid_small_calls not in ("auto", "on", "off"):
            raise UnsupportedError(f"mmap_offload hybrid_small_calls must be auto, on or off, got {self.hybrid_small_calls!r}",
                                   "pass auto (the default), on or off")
        if not self.hybrid_small_ms >= 0:
            raise UnsupportedError(f"mmap_offload hybrid_small_ms must be >= 0, got {self.hybrid_small_ms}",
                                   "pass the misses' link time per decode call (ms) from which they go to the host, e.g. 0.4")
        if not (self.hybrid_share == -1 or 0 <= self.hybrid_share <= 1):
            raise UnsupportedError(f"mmap_offload hybrid_share must be -1 or in [0, 1], got {self.hybrid_share}",
                                   "pass 1 (every miss the pool does not admit, the default), -1 (adapted per call) or a share in [0, 1]")
        if not 0 <= self.hybrid_admit <= 64:
            raise UnsupportedError(f"mmap_offload hybrid_admit must be in [0, 64], got {self.hybrid_admit}",
                                   "pass 4 (the default: as a plain sparse call) or 0 (the pool admits nothing)")
        if self.hybrid_parts < -1:
            raise UnsupportedError(
                f"mmap_offload hybrid_parts must be >= -1, got {self.hybrid_parts}",
                "pass 0 (the fewest parts), -1 (as many as a plain sparse call) or a count",
            )

    def copy_threads(self) -> int:
        """The engine's copy threads: ``threads``, or where it is 0 the default, 8, or 6 with
        ``hybrid``. Measured in real vLLM on the H200 (16 cores; BENCHMARKS.md "Real vLLM", sessions
        17-18, decode skewed at the user's shapes, interleaved children): 6 copy threads and 9 host
        threads ran 1.343x uva at batch 8 and 0.883x at batch 1 (9 children), against 1.279x and
        0.799x with 8 and 7 (11 children): each missed byte computed on the host crosses DRAM once,
        one copied crosses it three times, and vLLM's launching thread runs slower the busier DRAM
        is. Without hybrid the copy threads are the only miss path and keep their 8."""
        if self.threads > 0:
            return self.threads
        return HYBRID_COPY_THREADS if self.hybrid else COPY_THREADS

    def layer_copy_threads(self) -> int:
        """The engine's threads that stream whole layers (prefill, calls beyond sparse_max_ids):
        ``threads``, or where it is 0 the default 8, with hybrid too: the host computes nothing on
        those calls, so its threads sleep and the copies may have the cores (``copy_threads()``
        counts decode's fill threads, which the host's default thread count leaves room for). On
        the H200 in real vLLM (session 33, bench_moe's shapes, prefill 2k) hybrid's layers streamed
        by 6 threads ran 12386 tok/s against 17008 for mmap-layer's 8 (0.73x; 6/8 = 0.75), the same
        layers and bytes per step; with 8 and the layer mode's next-layer order (session 34) 1.068x."""
        return self.threads if self.threads > 0 else COPY_THREADS

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _mode(v: Any) -> Any:
    """An auto | on | off option's value from a bool or its spellings (else ``v``, which check() refuses)."""
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, str):
        low = v.lower()
        return {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(low, low)
    return v


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    typ = str(typ)
    try:
        if "tuple" in typ:
            if isinstance(raw, str):
                raw = [s for s in re.split(r"[,\s]+", raw) if s]
            return tuple(str(s) for s in raw)
        if raw in (None, "", "auto") and "None" in typ:
            return None
        if typ.startswith("bool"):
            if isinstance(raw, str):
                if raw.lower() in ("1", "true", "yes", "on"):
                    return True
                if raw.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(raw)
            return bool(raw)
        if typ.startswith("int"):
            return int(raw)
        if typ.startswith("float"):
            return float(raw)
        return None if raw in (None, "") else str(raw)
    except (TypeError, ValueError):
        raise UnsupportedError(f"mmap_offload option {name}={raw!r} is not a valid {typ}", "fix the value") from None


__all__ = ["CONFIG_KEY", "COPY_THREADS", "ENV_PREFIX", "HELD_SHARE_COPY_CORES", "HYBRID_COPY_THREADS", "MmapOptions"]
