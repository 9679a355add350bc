"""``MmapOffloader``: vLLM's offloader for ``--offload-backend mmap`` (stable surface only).

Lifecycle (vLLM's ``BaseOffloader`` calls; MmapOffloader -> BaseOffloader; uses
warmup.ensure_cache, cache_reader.Cache, transfer.make_engine, prefetch.LayerPrefetcher and, with
an expert cache, residency.Residency):

    create_offloader       MmapOffloader(options)                  (model runner __init__; patch 2)
    wrap_modules(layers)   open this TP rank's cache, or build it layer by layer (warmup);
                           shrink each served expert parameter to a 1-expert placeholder holding
                           probe data; register the checkpoint names to skip (patch 3); hook each
                           decoder layer's forward and, with an expert cache, its router (patch 4)
    load_weights           the served expert tensors are skipped: no bytes read
    process_weights_...    vLLM's repack runs on the 1-expert placeholders only (cheap)
    post_init              probe check (probe.py); build the engine, the layer buffers and the
                           expert pool; point the parameters at them. vLLM's CPU runner never calls
                           post_init: the first forward does.
    forward of layer i     layer streaming: _wait_for_layer(i) (copy complete) ... forward ...
                           _start_prefetch(i) (the layer lookahead + 1 positions later).
                           expert cache: the router's top-k ids go through Residency.route, which
                           makes them resident and returns slot ids, or streams the whole layer
                           when the step routes most of its experts (prefill, large batches).

Everything vLLM-version-specific is in patches.py; options in options.py.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from ..cache_format import warmup_command
from ..cpus import allowed_cpus, core_count
from ..errors import CacheError, UnsupportedError
from .graphs import EAGER, StaticOutputs, capture_rows, check_graph_mode
from .launcher import prefill_note
from .options import CONFIG_KEY, MmapOptions
from .patches import (
    SERVED_FLAG, add_after_experts, after_moe_call, capturing_graphs, explain_capture_failures, graph_runtime_mode, log,
    moe_router_of, moe_runner_of, route_through, set_skipped_checkpoint_names,
)
from .probe import expected_layout, platform_transform, probe_tensor

try:  # inside vLLM: subclass its BaseOffloader so isinstance checks and get_offloader() work
    from vllm.model_executor.offloader.base import BaseOffloader as _OffloaderBase

    HAVE_VLLM = True
except ImportError:  # no vLLM (GPU test machine, unit tests): same method names, no base class

    class _OffloaderBase:  # type: ignore[no-redef]
        supports_tower_offload = False

    HAVE_VLLM = False


# vLLM parameter name of a fused MoE layer <- (checkpoint projection, checkpoint suffix)
_W13, _W2 = ("gate", "up"), ("down",)


def _param_name(proj: str, suffix: str) -> str:
    stem = "w2" if proj == "down" else "w13"
    return f"{stem}_{suffix}"


@dataclass
class _Target:
    """One offloaded MoE layer: the decoder layer vLLM wrapped and its fused-experts module."""

    index: int  # position among offloaded layers (the custom ops' layer_idx)
    layer: int  # MoE layer index in the checkpoint / cache
    decoder: torch.nn.Module
    experts: torch.nn.Module
    served: list[str]  # parameter names filled from the cache (== cache tensor names)
    flagged: list[str] = field(default_factory=list)  # every parameter whose checkpoint tensors are skipped
    router: Any = None  # the object whose select_experts feeds this layer's kernel (patches.moe_router_of)
    runner: Any = None  # the object whose _forward_impl vLLM's MoE op calls (patches.moe_runner_of)


# CUDA's words for a failed stream capture, spaces out (cudaErrorStreamCapture*, cudaErrorCapturedEvent: "operation
# not permitted when stream is capturing", "... a previous error during capture", "... separate capture sequences",
# "capturing stream has unjoined work", "dependency created on uncaptured work in another stream", "... an event last
# recorded in a capturing stream", "... a capturing blocking stream", "capture was not initiated in this stream")
_CAPTURE_ERRORS = ("streamiscapturing", "duringcapture", "capturesequence", "capturingstream", "uncapturedwork",
                   "capturingblockingstream", "capturewasnotinitiated", "errorstreamcapture", "errorcapturedevent")


class MmapOffloader(_OffloaderBase):
    """vLLM offloader serving routed experts from the mmap-offload cache (module docstring).

    Outside vLLM pass ``checkpoint``, ``tp_rank``/``tp_size`` and ``device``; inside vLLM they come
    from the current ``VllmConfig`` when ``wrap_modules`` runs."""

    supports_tower_offload = False

    def __init__(
        self,
        options: MmapOptions | None = None,
        *,
        checkpoint: str | os.PathLike | None = None,
        tp_rank: int | None = None,
        tp_size: int | None = None,
        device: str | torch.device | None = None,
        default_params: Iterable[str] = (),
    ):
        self.options = options
        self.checkpoint_path = None if checkpoint is None else Path(checkpoint)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.device = None if device is None else torch.device(device)
        self._default_params = tuple(default_params)
        self.targets: list[_Target] = []
        self.cache = None
        self.engine = None
        self._background_check = None  # cache_reader.BackgroundCheck (verify_in_background)
        self.prefetcher = None
        self.residency = None  # residency.Residency when the expert cache is on
        self._vcfg = None
        self.ready = False
        self._wrapped = False
        self._probe: dict[str, torch.Tensor] = {}  # cache-layout expectation of the probe data
        self._transforms: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {}
        self._kernel_buffers: list[dict[str, torch.Tensor]] = []
        self._kernel_layer: list[int | None] = []  # layer whose bytes each twin holds
        self._ready_lock = threading.Lock()
        self.graph_mode = EAGER  # graphs.check_graph_mode: eager, piecewise (CUDA graphs between MoE layers), compiled
        self._static: StaticOutputs | None = None  # the MoE outputs graph pieces read (piecewise only)
        self.metrics: dict[str, Any] = {"skipped_tensors": 0, "skipped_bytes": 0, "skipped_mtp_tensors": 0,
                                        "skipped_mtp_bytes": 0}

    @classmethod
    def from_offload_config(cls, offload_config) -> "MmapOffloader":
        """Built by the patched ``create_offloader``; selection defaults to vLLM's offload params."""
        params = set(getattr(getattr(offload_config, "uva", None), "cpu_offload_params", ()) or ())
        params |= set(getattr(getattr(offload_config, "prefetch", None), "offload_params", ()) or ())
        gb = getattr(getattr(offload_config, "uva", None), "cpu_offload_gb", 0) or 0
        if gb > 0:  # kept from a uva command line: nothing is pinned for it here
            log.warning("mmap-offload: --cpu-offload-gb %s is the uva backend's and is ignored: the mmap backend serves "
                        "the selected experts from its cache (their VRAM pool: --mmap-expert-cache-gib)", gb)
        return cls(None, default_params=sorted(params))

    # -- context ----------------------------------------------------------------------------------
    def _resolve_context(self) -> None:
        """Fill options, checkpoint, TP rank/size and device from vLLM where not given."""
        vcfg = None
        if HAVE_VLLM:
            from vllm.config import get_current_vllm_config

            try:
                vcfg = get_current_vllm_config()
            except AssertionError:  # driven outside a vLLM engine (tests): no config set
                vcfg = None
        self._vcfg = vcfg
        if self.options is None:
            extra = None
            if vcfg is not None and isinstance(getattr(vcfg, "additional_config", None), dict):
                extra = vcfg.additional_config.get(CONFIG_KEY)
            self.options = MmapOptions.resolve(extra)
        if not self.options.params:
            self.options.params = self._default_params or ("experts",)
        if vcfg is not None:
            self._check_vllm_config(vcfg)
        if self.checkpoint_path is None:
            if vcfg is None:
                raise UnsupportedError("MmapOffloader needs a checkpoint path outside vLLM", "pass checkpoint=...")
            self.checkpoint_path = _local_checkpoint(vcfg)
        if self.tp_size is None:
            self.tp_size = int(vcfg.parallel_config.tensor_parallel_size) if vcfg is not None else 1
        if self.tp_rank is None:
            self.tp_rank = 0
            if vcfg is not None and self.tp_size > 1:
                from vllm.distributed import get_tensor_model_parallel_rank

                self.tp_rank = int(get_tensor_model_parallel_rank())
        if self.options.cache_dir is None:
            self.options.cache_dir = str(Path.home() / ".cache" / "mmap-offload" / self.checkpoint_path.name)

    def _check_vllm_config(self, vcfg) -> None:
        pc, lc = vcfg.parallel_config, vcfg.load_config
        if getattr(pc, "enable_expert_parallel", False):
            raise UnsupportedError(
                "--offload-backend mmap does not support expert parallelism", "drop --enable-expert-parallel (use TP)"
            )
        fmt = str(getattr(lc, "load_format", "auto")).lower().split(".")[-1]
        if fmt not in ("auto", "safetensors"):
            raise UnsupportedError(
                f"--offload-backend mmap skips expert tensors in vLLM's safetensors loader, not with --load-format {fmt}",
                "use --load-format auto or safetensors",
            )
        extra = getattr(lc, "model_loader_extra_config", None) or {}
        if isinstance(extra, dict) and extra.get("enable_multithread_load"):
            raise UnsupportedError(
                "--offload-backend mmap cannot skip expert tensors with enable_multithread_load",
                "drop enable_multithread_load from --model-loader-extra-config",
            )
        strategy = getattr(lc, "safetensors_load_strategy", None)
        if strategy in ("eager", "prefetch"):
            log.warning(
                "mmap-offload: --safetensors-load-strategy %s reads whole shards, expert bytes included "
                "(they are skipped, not loaded); leave it unset to read no expert byte", strategy,
            )
        self.graph_mode = check_graph_mode(vcfg, layer_streaming=self.options.expert_cache_gib == 0)
        self.metrics["graph_mode"] = self.graph_mode

    # -- BaseOffloader: wrap_modules -----------------------------------------------------------------
    def wrap_modules(self, modules_generator, prefix: str = "") -> list[torch.nn.Module]:
        """Open (or build) the cache, install placeholders and forward hooks. Called once.

        vLLM constructs each decoder layer as the generator yields it, so each layer's experts are
        shrunk to placeholders before the next layer is built: device memory never holds more than
        one layer's full-size expert parameters."""
        if self._wrapped:
            raise UnsupportedError("MmapOffloader.wrap_modules was called twice", "wrap the decoder stack once")
        self._wrapped = True
        self._resolve_context()
        pre = f"{prefix}." if prefix else ""
        modules: list[torch.nn.Module] = []
        ckpt = None
        skip: set[str] = set()
        try:
            for pos, module in enumerate(modules_generator):  # vLLM builds the layer (its device context)
                modules.append(module)
                # vLLM builds layers under `with torch.device(target)`: our tensors are placed
                # explicitly, and whatever is made implicitly (checkpoint reads, probe data) on the CPU
                with torch.device("cpu"):
                    for sub_name, sub, sel in self._expert_modules(module, pre):
                        if ckpt is None:  # first MoE layer: the cache must be valid before any placeholder
                            from ..checkpoint import open_checkpoint

                            ckpt = open_checkpoint(self.checkpoint_path)
                            self._open_cache(ckpt)
                        self._add_target(pos, module, sub_name, sub, sel, ckpt, skip)
            if ckpt is None:
                log.warning("mmap-offload: no fused-experts parameters match %s; nothing offloaded", list(self.options.params))
                return modules
            self.metrics["skipped_tensors"] = len(skip)
            self.metrics["skipped_bytes"] = sum(ckpt.ref(n).nbytes for n in skip)
            mtp = self._unread_mtp_names(ckpt)
            self.metrics["skipped_mtp_tensors"] = len(mtp)
            self.metrics["skipped_mtp_bytes"] = sum(ckpt.ref(n).nbytes for n in mtp)
        finally:
            if ckpt is not None:
                ckpt.close()
        set_skipped_checkpoint_names(skip | mtp)
        log.info(
            "mmap-offload: serving %d MoE layers from %s (rank %d of %d); skipping %d checkpoint tensors (%.2f GiB)%s",
            len(self.targets), self.cache.dir, self.tp_rank, self.tp_size, len(skip), self.metrics["skipped_bytes"] / 2**30,
            f" and the {len(mtp)} of the multi-token-prediction layer ({self.metrics['skipped_mtp_bytes'] / 2**30:.2f} GiB, "
            "dropped by vLLM without speculative decoding)" if mtp else "",
        )
        return modules

    def _unread_mtp_names(self, ckpt) -> set[str]:
        """The multi-token-prediction layer's tensors, which vLLM's main model reads and drops
        (``skip_spec_layers``): skipped unread too, unless speculative decoding is on, whose MTP head
        loads them through the same loader."""
        if getattr(self._vcfg, "speculative_config", None) is not None:
            return set()
        return set(ckpt.mtp_names())

    def _expert_modules(self, module: torch.nn.Module, pre: str):
        """(name, fused-experts submodule, selected parameter names) inside one decoder layer."""
        for sub_name, sub in module.named_modules():
            own = dict(sub.named_parameters(recurse=False))
            if not any(n.startswith("w13_") for n in own) or not any(n.startswith("w2_") for n in own):
                continue
            rel = {n: f".{pre}{sub_name}.{n}." if sub_name else f".{pre}{n}." for n in own}
            sel = [n for n in own if any(f".{s}." in rel[n] for s in self.options.params)]
            if sel:
                yield sub_name, sub, sel

    def _add_target(self, pos, module, sub_name, sub, sel, ckpt, skip: set[str]) -> None:
        """Check one fused-experts module against the cache, register its skipped names, shrink
        its served parameters to placeholders, hook its decoder layer."""
        cache = self.cache
        served_names = [s.name for s in cache.expert_specs]
        layer = _layer_index(sub, module, pos)
        if layer not in cache.layers:
            raise CacheError(
                f"layer {layer} of the model has experts but the cache has MoE layers {cache.layers}",
                f"rebuild the cache for this checkpoint: {warmup_command(cache.dir, str(self.checkpoint_path))}",
            )
        own = dict(sub.named_parameters(recurse=False))
        missing = [n for n in served_names if n not in sel]
        if missing:
            raise UnsupportedError(
                f"mmap offload serves whole experts, but {sorted(missing)} of {sub_name or 'experts'} are not selected",
                "select them all (e.g. --cpu-offload-params experts)",
            )
        num_experts = int(own[served_names[0]].shape[0])
        if num_experts != cache.num_experts:
            raise CacheError(
                f"layer {layer} has {num_experts} local experts, the cache {cache.num_experts}",
                f"rebuild the cache for this model and TP size: {warmup_command(cache.dir, str(self.checkpoint_path))}",
            )
        flagged = set()
        for e in range(num_experts):
            for proj, parts in ckpt.expert_refs(layer, e).items():
                for suffix, ref in parts.items():
                    pname = _param_name(proj, suffix)
                    if pname in sel:
                        skip.add(ref.name)
                        flagged.add(pname)
        for pname in flagged:
            setattr(own[pname], SERVED_FLAG, True)
        t = _Target(len(self.targets), layer, module, sub, served_names, sorted(flagged),
                    router=moe_router_of(sub, module), runner=moe_runner_of(sub, module))
        self._install_placeholders(t, probe=not self.targets, ckpt=ckpt)
        if self.graph_mode == EAGER:  # compiled: the expert cache only (graphs.py), whose router decides; the
            self._hook_forward(t)     # decoder's forward is left to torch.compile untouched
        self.targets.append(t)

    def _open_cache(self, ckpt):
        """This rank's valid cache: open it, or build it (warmup, layer by layer), or refuse."""
        from ..warmup import ensure_cache

        opts = self.options
        for attempt in range(2):
            cache = ensure_cache(
                ckpt, opts.cache_dir, self.tp_rank, self.tp_size,
                device=self._warmup_device(), rebuild=opts.rebuild, progress=self.tp_rank == 0,
            )
            if opts.verify:
                report = cache.verify()
                if not report.ok:
                    from ..errors import CorruptCacheError

                    layer, expert, name = report.mismatches[0]
                    err = CorruptCacheError(
                        f"{len(report.mismatches)} tensor(s) of {cache.dir} fail their checksum (first: layer {layer} expert {expert} {name})",
                        "the bad layers are being rewritten" if opts.rebuild else f"rewrite them with {cache.repair_command()}",
                    )
                    if not opts.rebuild or attempt:
                        raise err
                    from ..warmup import warmup

                    log.warning("mmap-offload: %s", err)
                    cache.close()  # rewrite exactly the layers that fail (warm-up --repair), then reopen
                    warmup(ckpt, opts.cache_dir, tp_size=self.tp_size, tp_ranks=[self.tp_rank],
                           device=self._warmup_device(), repair=True, progress=self.tp_rank == 0)
                    continue
            self.cache = cache
            return cache
        raise AssertionError("unreachable")  # pragma: no cover

    def _warmup_device(self) -> str | torch.device:
        d = self.options.warmup_device
        if d == "auto" and self.device is not None:
            return self.device
        if d == "auto" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return "cpu" if d == "auto" else d

    def _install_placeholders(self, t: _Target, probe: bool, ckpt) -> None:
        """Shrink each served parameter to one expert. The first layer's holds probe data whose
        cache layout (our layout module) post_init compares with what vLLM's processing made of it."""
        own = dict(t.experts.named_parameters(recurse=False))
        if self.device is None:
            self.device = own[t.served[0]].device
        data = {}
        for name in t.served:
            p = own[name]
            shape = (1, *p.shape[1:])
            data[name] = probe_tensor(name, shape, p.dtype, p.device) if probe else torch.zeros(shape, dtype=p.dtype, device=p.device)
        if probe:
            self._probe = expected_layout(data, ckpt)
        for name, d in data.items():
            own[name].data = d

    def _hook_forward(self, t: _Target) -> None:
        """wait for this layer's copy before its forward, start the next copy after it."""
        module, index = t.decoder, t.index
        orig = module.forward
        ops = getattr(torch.ops, "vllm", None) if HAVE_VLLM else None
        wait_op = getattr(ops, "wait_prefetch", None) if ops is not None else None
        start_op = getattr(ops, "start_prefetch", None) if ops is not None else None

        def forward(*args, **kwargs):
            if self.residency is not None and self.ready:  # the router decides (residency.py): nothing to wait for
                return orig(*args, **kwargs)  # (two custom ops per layer the launching thread no longer pays)
            anchor = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
            if wait_op is not None and isinstance(anchor, torch.Tensor):
                wait_op(anchor, index)  # -> get_offloader()._wait_for_layer(index), opaque to torch.compile
            else:
                self._wait_for_layer(index)
            out = orig(*args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            if start_op is not None and isinstance(first, torch.Tensor):
                start_op(first, index)
            else:
                self._start_prefetch(index)
            return out

        module.forward = forward

    # -- BaseOffloader: post_init and the per-layer verbs ---------------------------------------------
    def post_init(self) -> None:
        """After process_weights_after_loading: check the probe, point parameters at slot buffers."""
        # buffers are written by engine threads, which are never in inference mode: make them
        # normal tensors even when the first forward (CPU runner) triggers this under inference_mode
        with self._ready_lock, torch.inference_mode(False), torch.device("cpu"):
            if self.ready or not self.targets:
                self.ready = True
                return
            self._check_probe()
            from ..prefetch import LayerPrefetcher
            from ..transfer import make_engine

            opts = self.options
            if opts.hybrid is None:  # "auto": decided before the engine's thread counts, which follow it
                why = self._hybrid_off_reason()
                opts.hybrid = why is None
                self.metrics["hybrid_auto"] = why or "on"
                log.info("mmap-offload: hybrid %s (auto: %s)", "on" if opts.hybrid else "off",
                         why or "a W4A16 cache on CUDA, the native host kernel and the stream path")
            layer_bytes = self.cache.num_experts * sum(sp.nbytes for sp in self.cache.expert_specs)
            pinned = min(opts.pinned_mib << 20, max(64 << 20, 2 * layer_bytes))  # exact size; no more than a layer needs
            slot_bytes = min(4 << 20, pinned // 2)  # the mmap engine's default (TRANSFER.md)
            # half of the ring for the expert cache's stream-ordered misses (residency.py), when
            # an expert cache may be built (its size is settled after the buffers exist)
            ordered = 0.5 if opts.stream_ordered and opts.expert_cache_gib != 0 else 0.0
            # with an ordered part, decode's misses are filled by copy_threads() threads of its own
            # (fewer with hybrid, whose host threads take the other cores) and whole layers by
            # layer_copy_threads(); without one, every copy is the same threads' (where the engine
            # cannot make the part it is asked for, Python copy threads without the native pool, the
            # layer threads copy decode's misses too: 8 with hybrid, beside its host threads)
            extra = {"ordered_fraction": ordered, "ordered_threads": opts.copy_threads()} if ordered else {}
            self.engine = make_engine(
                opts.engine, self.device, pinned_bytes=pinned, slot_bytes=slot_bytes,
                threads=opts.layer_copy_threads() if ordered else opts.copy_threads(), **extra,
            )
            self.prefetcher = LayerPrefetcher(
                self.cache, self.engine, self.device, lookahead=opts.lookahead,
                layers=[t.layer for t in self.targets], as_parameters=True,
                verify_first_use=opts.verify_first_use,
            )
            nb = self.prefetcher.num_buffers
            if self._transforms:  # kernel-layout twin of each slot buffer (CPU platform transforms)
                shapes = self.prefetcher.buffer_tensors(self.targets[0].layer)
                self._kernel_buffers = [
                    {n: torch.empty_like(shapes[n].data) for n in self._transforms} for _ in range(nb)
                ]
                self._kernel_layer = [None] * nb
            for t in self.targets:
                slot = self.prefetcher.buffer_tensors(t.layer)
                kernel = self._kernel_buffers[self.prefetcher.buffer_index(t.layer)] if self._kernel_buffers else {}
                for name in t.served:
                    p = getattr(t.experts, name)
                    buf = kernel.get(name, slot[name])
                    p.data = buf.data if isinstance(buf, torch.nn.Parameter) else buf
            self._start_background_check()
            self._start_residency()
            if self.residency is None:
                for t in self.targets[: min(opts.lookahead + 1, len(self.targets))]:
                    self.prefetcher.start_prefetch(t.layer)
            self.ready = True
            log.info(
                "mmap-offload: %d slot buffers of %.1f MiB each, engine %s, lookahead %d; %s",
                nb, self.prefetcher.layer_nbytes / 2**20, getattr(self.engine, "kind", opts.engine), opts.lookahead,
                "layer streaming only" if self.residency is None else
                f"expert cache {self.residency.ec.capacity_bytes / 2**30:.2f} GiB "
                f"({self.residency.slots} slots per layer, layer streaming above {self.residency.threshold} experts)"
                + ("" if self.residency.host is None else
                   f"; hybrid: {self.residency.host.threads} host threads ({core_count()} cores, "
                   f"{len(allowed_cpus())} hardware threads)"),
            )
            if self._vcfg is not None:  # what vLLM needs beside the pool (the default pool leaves it: residency.py)
                from .residency import kv_one_request_bytes, start_reserve_bytes

                self.metrics["kv_reserve_bytes"], self.metrics["act_reserve_bytes"] = start_reserve_bytes(self._vcfg)
                self.metrics["kv_one_request_bytes"] = kv_one_request_bytes(self._vcfg)
            sched, model = (getattr(self._vcfg, k, None) for k in ("scheduler_config", "model_config"))
            log.info("mmap-offload: %s", prefill_note(self.prefetcher.layer_nbytes * len(self.targets),
                                                      getattr(sched, "max_num_batched_tokens", None),
                                                      getattr(model, "max_model_len", None)))

    def _hybrid_off_reason(self) -> str | None:
        """Option hybrid "auto": None where hybrid was measured ahead (a W4A16 cache served on CUDA with
        the expert cache, the native host kernel and the stream path: BENCHMARKS.md "Real vLLM"), else
        why it stays off."""
        opts = self.options
        if self.device is None or self.device.type != "cuda":
            return "not served on a CUDA device"
        q = self.cache.manifest.identity.quantization
        if q.get("kind") != "w4a16":
            return f"a {q.get('kind', 'unquantized')} cache (host compute was measured ahead for W4A16 only)"
        if q.get("actorder"):
            return "an act-order W4A16 cache, which the host kernel does not read"
        if opts.expert_cache_gib == 0:
            return "no expert cache (expert_cache_gib 0: layer streaming)"
        if not (opts.native_step and opts.async_step and opts.hybrid_stream):
            return "the stream path is off (native_step, async_step or hybrid_stream)"
        from ..host.kernel import library
        from ..native import library_status, load_library

        try:  # what HostExperts will load: also refuses a stale build (its ABI, its SIGBUS guard)
            library()
        except UnsupportedError as e:
            return e.message
        if load_library("mo_native") is None:
            return library_status("mo_native")
        from .. import copy_kernel

        got = copy_kernel.load(self.device)
        return got if isinstance(got, str) else None

    def _start_background_check(self) -> None:
        """``verify_in_background``: check every expert in a low-priority thread, and pre-fault the
        engine's mapping of each layer once it is checked (its pages were just read), so first uses
        at decode neither read to check nor fault pages in (pagecache.py: a fresh mapping faults per
        page on first touch)."""
        opts = self.options
        if not (opts.verify_first_use and opts.verify_in_background) or opts.verify:
            return
        engine, cache = self.engine, self.cache
        prefault = getattr(engine, "prefault", None)
        self._background_check = cache.check_in_background(
            layers=[t.layer for t in self.targets],
            after_layer=(lambda layer: prefault([cache.layer_file(layer)])) if prefault else None,
        )

    def _start_residency(self) -> None:
        """Build the expert pools and route each layer's top-k through them (patch 4), if asked."""
        from .residency import Residency, auto_capacity_bytes

        gib = self.options.expert_cache_gib
        capacity = auto_capacity_bytes(self, self._vcfg) if gib is None else int(gib * 2**30)
        expert_bytes = sum(sp.nbytes for sp in self.cache.expert_specs)
        if capacity < expert_bytes * len(self.targets):  # not one slot per layer: layer streaming
            if self.graph_mode != EAGER:
                raise UnsupportedError(
                    f"no room for an expert pool ({expert_bytes * len(self.targets) / 2**30:.3f} GiB would hold one "
                    "expert per layer), and layer streaming does not run under torch.compile and CUDA graphs",
                    "pass --enforce-eager, or leave more room (--gpu-memory-utilization, --max-model-len)",
                )
            if gib:
                raise UnsupportedError(
                    f"mmap_offload expert_cache_gib={gib} holds fewer than one expert per MoE layer "
                    f"({len(self.targets)} layers x {expert_bytes / 2**20:.1f} MiB)",
                    f"give at least {expert_bytes * len(self.targets) / 2**30:.3f} GiB, or 0 for layer streaming",
                )
            if gib is None and self.device.type == "cuda":
                log.warning("mmap-offload: no room for an expert pool (%.3f GiB would hold one expert per layer) in "
                            "what vLLM's budget leaves after the weights and layer buffers: layer streaming only, every "
                            "decode step streams every expert; a higher --gpu-memory-utilization or more GPUs leave room",
                            expert_bytes * len(self.targets) / 2**30)
            return
        missing = [t.layer for t in self.targets if t.router is None]
        if missing:
            if gib or self.graph_mode != EAGER:
                raise UnsupportedError(
                    f"the MoE layers {missing[:4]} route inside their kernel (monolithic), so their routing cannot "
                    "reach the expert cache",
                    "pass expert_cache_gib=0 (layer streaming)",
                )
            log.warning("mmap-offload: MoE layers %s route inside their kernel: layer streaming only", missing[:4])
            return
        self.residency = Residency(self, capacity)
        for t in self.targets:
            route_through(t.router, lambda w, ids, x, t=t: self.residency.route(t, w, ids, x))
            if self.residency.host is not None:
                add_after_experts(t.experts, lambda out, t=t: self.residency.add_host(t, out))
        if self.graph_mode != EAGER:  # compiled: the MoE op runs eagerly between graph pieces (graphs.py)
            gone = [t.layer for t in self.targets if t.runner is None]
            if gone:
                raise UnsupportedError(f"the MoE layers {gone[:4]} have no runner that vLLM's MoE op calls, so "
                                       "their outputs cannot be kept for CUDA graphs", "pass --enforce-eager")
            self._static = StaticOutputs(capture_rows(self._vcfg))
            for t in self.targets:
                after_moe_call(t.runner, lambda out, t=t: self._graph_output(t, out))
            if self.device.type == "cuda":
                explain_capture_failures(self._explain_capture)

    def _explain_capture(self, e: BaseException) -> UnsupportedError | None:
        """Patch 7: vLLM's CUDA graph capture failed; one line naming the cause and the fix, or None
        (vLLM's own error stands) where the failure is neither of the two known here."""
        text = f"{type(e).__name__}: {e}".strip().splitlines()[0][:300]
        pool = self.residency.ec.capacity_bytes / 2**30 if self.residency is not None else 0.0
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in text.lower():
            return UnsupportedError(
                f"vLLM ran out of GPU memory capturing CUDA graphs beside the {pool:.2f} GiB expert pool ({text})",
                f"pass --mmap-expert-cache-gib below {pool:.2f}, fewer graphs (-cc.max_cudagraph_capture_size, "
                "--max-num-seqs), or --enforce-eager")
        low = text.lower().replace(" ", "")
        if any(p in low for p in _CAPTURE_ERRORS):  # another thread's CUDA call during a global-mode capture
            return UnsupportedError(
                f"vLLM's CUDA graph capture failed beside mmap-offload's copy threads ({text})",
                "pass --enforce-eager (the MoE layers run without graphs), and report it with the log")
        return None

    def _graph_output(self, t: _Target, out):
        """A MoE call's output under torch.compile (patch 6): in a piecewise CUDA-graph forward, copied to
        the fixed buffers the next graph piece reads (graphs.StaticOutputs)."""
        if graph_runtime_mode() != "PIECEWISE":
            return out
        return self._static.put(t.index, out)

    def _check_probe(self) -> None:
        """vLLM's processed placeholder of layer 0 must equal our cache layout of the same data."""
        t = self.targets[0]
        for name in t.served:
            got = getattr(t.experts, name).data
            want = self._probe[name].to(got.device)
            if tuple(got.shape[1:]) == tuple(want.shape) and got.dtype == want.dtype and torch.equal(got[0], want):
                continue
            fn = platform_transform(t.experts, got, want)
            if fn is None:
                raise UnsupportedError(
                    f"vLLM's MoE backend on this platform stores {name} as {tuple(got.shape[1:])} {got.dtype}, "
                    f"which is not the cache layout {tuple(want.shape)} {want.dtype} (or differs in content)",
                    "this MoE backend is not supported by --offload-backend mmap; see docs/VLLM.md",
                )
            if self.device.type != "cpu":
                raise UnsupportedError(
                    f"{name} needs a platform transform after each copy, supported on CPU only",
                    "see docs/VLLM.md for the supported MoE backends",
                )
            self._transforms[name] = fn
            log.info("mmap-offload: %s gets vLLM's platform transform (%s) after each copy", name, fn.__name__)
        self._probe = {}

    def _ensure_ready(self) -> None:
        if not self.ready:
            self.post_init()

    def _wait_for_layer(self, layer_idx: int) -> None:
        """Block until layer ``layer_idx``'s experts are in its slot buffer (and kernel layout).

        With the expert cache the decision waits for the router (residency.py): nothing here."""
        self._ensure_ready()
        if self.prefetcher is None or self.residency is not None:
            return
        # vLLM runs forwards under inference_mode; views made there are inference tensors, which
        # the engine's threads (never in inference mode) may not write: make normal ones
        with torch.inference_mode(False):
            self._layer_tensors(self.targets[layer_idx])

    def _layer_tensors(self, t: _Target) -> dict[str, torch.Tensor]:
        """The whole of layer ``t`` in its slot buffer, in the kernel's layout (copy complete)."""
        reuses = self.prefetcher.metrics["reuses"]
        w = self.prefetcher.wait_for_layer(t.layer)
        if not self._transforms:
            return w
        b = self.prefetcher.buffer_index(t.layer)
        twin = self._kernel_buffers[b]
        if not (self._kernel_layer[b] == t.layer and self.prefetcher.metrics["reuses"] > reuses):
            for name, fn in self._transforms.items():  # else the kernel-layout twin is current
                fn(w[name], twin[name])
            self._kernel_layer[b] = t.layer
        return {**w, **twin}

    def _start_prefetch(self, layer_idx: int) -> None:
        """After layer ``layer_idx``'s forward: start the layer ``lookahead + 1`` positions on.

        Any lookahead + 1 consecutive layers have distinct buffers (prefetch.assign_buffers), so
        that layer's buffer belongs to this layer or to one before it, whose compute is enqueued."""
        if self.prefetcher is None or self.residency is not None:
            return
        t = self.targets[layer_idx]
        with torch.inference_mode(False):  # see _wait_for_layer
            self.prefetcher.start_prefetch(self.prefetcher.layer_after(t.layer, self.options.lookahead + 1))

    def sync_prev_onload(self) -> None:
        """vLLM calls this before each CUDA graph piece is captured or replayed. With the expert cache,
        before a replay nothing: the pieces read no expert byte (the MoE op runs eagerly between them,
        its copies ordered on the stream), and a wait would stop the launching thread at every piece.
        Before a capture (vLLM's capture phase) the device, the layer prefetches and the expert cache's
        copies are waited for: vLLM captures in CUDA's global mode, where a copy thread's CUDA call
        during a capture fails it.
        Layer streaming (never under graphs: graphs.check_graph_mode): wait for its copies."""
        if self.residency is None:
            if self.prefetcher is not None:
                self.prefetcher.sync()
            return
        if self.graph_mode != EAGER and capturing_graphs():
            torch.cuda.synchronize(self.device)
            if self.prefetcher is not None:  # a large captured batch streams whole layers, the next one
                self.prefetcher.sync()       # started ahead (the H200's first capture failed on it, session 39)
            self.residency.ec.sync()
            self.metrics["graph_capture_waits"] = self.metrics.get("graph_capture_waits", 0) + 1

    def join_after_forward(self) -> None:
        """Nothing to join: copies complete on the host side of ``engine.wait`` (no capture)."""
        return

    def close(self) -> None:
        """Stop the engine, forget the skip list, and drop every reference to the model and to
        device memory (vLLM keeps the offloader in a global: a second engine in the same process
        would otherwise find the first one's buffers still allocated while it profiles memory)."""
        set_skipped_checkpoint_names(())
        if self._background_check is not None:
            self._background_check.stop()
        if self.prefetcher is not None:
            self.prefetcher.sync()
        if self.residency is not None:
            self.residency.close()
        self.metrics = self.summary()  # what summary() reported (engine counters too) stays readable
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        self.prefetcher = self.residency = None
        self.targets, self._kernel_buffers, self._probe = [], [], {}
        if self.cache is not None:
            self.cache.close()

    def summary(self) -> dict[str, Any]:
        out = dict(self.metrics)
        if self.prefetcher is not None:
            out.update({f"prefetch_{k}": v for k, v in self.prefetcher.metrics.items()})
        if self.engine is not None:
            out.update({f"engine_{k}": v for k, v in dict(self.engine.metrics).items() if isinstance(v, (int, float))})
        if self.residency is not None:
            out.update({f"residency_{k}": v for k, v in self.residency.summary().items()})
        if self._background_check is not None:
            out.update({f"check_bg_{k}": v for k, v in self._background_check.summary().items()})
        if self._static is not None:
            out.update({"graph_output_bytes": self._static.nbytes, "graph_output_copies": self._static.copies})
        return out


# -- helpers ----------------------------------------------------------------------------------------


def _layer_index(experts: torch.nn.Module, decoder: torch.nn.Module, pos: int) -> int:
    """The checkpoint layer index: from the fused-MoE layer's name, else the decoder's, else position."""
    for obj in (experts, decoder):
        for attr in ("layer_name", "prefix"):
            name = getattr(obj, attr, None)
            if isinstance(name, str):
                m = re.search(r"layers\.(\d+)(?:\.|$)", name)
                if m:
                    return int(m.group(1))
    for attr in ("layer_idx", "layer_id"):
        if isinstance(getattr(decoder, attr, None), int):
            return int(getattr(decoder, attr))
    return pos


def _local_checkpoint(vcfg) -> Path:
    """The local directory of the model's safetensors (downloaded by vLLM's own hub helper if needed)."""
    mc = vcfg.model_config
    path = Path(str(mc.model))
    if path.is_dir():
        return path
    try:
        from vllm.model_executor.model_loader.weight_utils import download_weights_from_hf

        folder = download_weights_from_hf(
            str(mc.model), vcfg.load_config.download_dir, ["*.safetensors", "*.json"], revision=mc.revision
        )
        return Path(folder)
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one line
        raise UnsupportedError(
            f"cannot find a local copy of {mc.model} for the mmap-offload cache ({type(e).__name__}: {e})",
            "pass a local checkpoint directory as the model",
        ) from None

__all__ = ["MmapOffloader"]
