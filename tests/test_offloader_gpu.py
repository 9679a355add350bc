"""MmapOffloader driven the way vLLM drives it, without vLLM: a small MoE model shaped like vLLM's
(decoder layers holding a fused-experts module with ``w13_weight [E, 2I, H]`` / ``w2_weight [E, H, I]``
and a ``layer_name``), weights from a synthetic Mixtral checkpoint.

Lifecycle as in vLLM: wrap_modules (cache opened or built, placeholders, forward hooks) ->
"weight loading" that skips the experts -> post_init -> forwards. The outputs must equal, bit for
bit, the same model with every expert in device memory; parameter addresses never change.
The CUDA variants (marked ``gpu``) run the copies on the engine's stream; the CPU ones run in CI.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmap_offload.checkpoint import open_checkpoint
from mmap_offload.errors import UnsupportedError
from mmap_offload.synth import make_checkpoint
from mmap_offload.vllm_backend import MmapOffloader, MmapOptions

E, H, I, K, LAYERS = 4, 64, 128, 2, 4

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]


class ToyExperts(torch.nn.Module):
    """vLLM's fused-MoE parameter layout: w13 = [gate rows; up rows], w2 = down."""

    def __init__(self, layer: int, device, dtype=torch.bfloat16):
        super().__init__()
        self.layer_name = f"model.layers.{layer}.block_sparse_moe.experts"
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * I, H, dtype=dtype, device=device), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, H, I, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, topk_w: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x.float()
        for e in range(self.w13_weight.shape[0]):
            w = (topk_w * (topk_ids == e)).sum(-1)
            h = xf @ self.w13_weight[e].float().T
            a = F.silu(h[:, :I]) * h[:, I:]
            out += w[:, None] * (a @ self.w2_weight[e].float().T)
        return out.to(x.dtype)


class ToyLayer(torch.nn.Module):
    def __init__(self, layer: int, device):
        super().__init__()
        self.router = torch.nn.Linear(H, E, bias=False, device=device, dtype=torch.float32)
        self.block_sparse_moe = torch.nn.Module()
        self.block_sparse_moe.experts = ToyExperts(layer, device)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(h.float()), dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        return h + self.block_sparse_moe.experts(h, w / w.sum(-1, keepdim=True), ids)


def build(ckpt_dir, device, load_experts: bool) -> list[ToyLayer]:
    """The toy decoder stack; experts loaded like vLLM's weight loader does, or left unloaded."""
    layers = [ToyLayer(l, device) for l in range(LAYERS)]
    with open_checkpoint(ckpt_dir) as ck:
        for l, layer in enumerate(layers):
            gate = ck.read(ck.ref(f"model.layers.{l}.block_sparse_moe.gate.weight"))
            layer.router.weight.data.copy_(gate.float())
            if not load_experts:
                continue
            ex = layer.block_sparse_moe.experts
            for e in range(E):
                refs = ck.expert_refs(l, e)
                w1, w3, w2 = (ck.read(refs[p]["weight"]) for p in ("gate", "up", "down"))
                ex.w13_weight.data[e].copy_(torch.cat([w1, w3], 0))
                ex.w2_weight.data[e].copy_(w2)
    return layers


@torch.inference_mode()  # as vLLM's model runner
def run(layers, x, steps=3) -> list[torch.Tensor]:
    outs = []
    for _ in range(steps):
        h = x
        for layer in layers:
            h = layer(h)
        outs.append(h.float().cpu())
    return outs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("toy") / "ckpt", arch="mixtral", quant="bf16", num_layers=LAYERS, num_experts=E,
        hidden=H, intermediate=I, top_k=K, vocab_size=64, num_heads=2, num_kv_heads=1,
    )


def _expert_bytes(ckpt) -> int:
    with open_checkpoint(ckpt) as c:
        return sum(r.nbytes for l in c.moe.layers for e in range(E) for p in c.expert_refs(l, e).values() for r in p.values())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lookahead,engine", [(0, "mmap"), (1, "mmap"), (2, "pread")])
def test_offloaded_outputs_equal_all_in_memory(ckpt, tmp_path, device, lookahead, engine, monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(8, H, device=device).to(torch.bfloat16)
    ref = run(build(ckpt, device, load_experts=True), x)

    import mmap_offload.checkpoint as mc

    read = {"bytes": 0}
    orig_read = mc.Checkpoint.read

    def counting_read(self, ref, out=None):
        read["bytes"] += ref.nbytes
        return orig_read(self, ref, out)

    monkeypatch.setattr(mc.Checkpoint, "read", counting_read)
    cache_dir = tmp_path / "cache"
    for start in ("cold", "warm"):
        read["bytes"] = 0
        layers = build(ckpt, device, load_experts=False)  # vLLM skips the served expert tensors
        read["bytes"] = 0
        off = MmapOffloader(
            MmapOptions(cache_dir=str(cache_dir), lookahead=lookahead, engine=engine, pinned_mib=8, threads=2),
            checkpoint=ckpt, device=device,
        )
        wrapped = off.wrap_modules(iter(layers))
        assert wrapped == layers
        assert read["bytes"] == (_expert_bytes(ckpt) if start == "cold" else 0)
        for layer in layers:  # one-expert placeholders until post_init
            assert layer.block_sparse_moe.experts.w13_weight.shape[0] == 1
        off.post_init()
        ptrs = [(l.block_sparse_moe.experts.w13_weight.data_ptr(), l.block_sparse_moe.experts.w2_weight.data_ptr()) for l in layers]
        outs = run(layers, x)
        for a, b in zip(outs, ref):
            assert torch.equal(a, b)
        assert ptrs == [(l.block_sparse_moe.experts.w13_weight.data_ptr(), l.block_sparse_moe.experts.w2_weight.data_ptr()) for l in layers]
        nb = off.prefetcher.num_buffers
        assert min(lookahead + 1, LAYERS) <= nb <= min(lookahead + 2, LAYERS)
        assert len({p for p, _ in ptrs}) == nb  # layers share the prefetcher's fixed slot buffers
        s = off.summary()
        assert s["skipped_bytes"] == _expert_bytes(ckpt)
        if nb < LAYERS:  # streamed every layer of every step (3 steps)
            assert s["prefetch_loads"] >= 3 * LAYERS - nb
        off.sync_prev_onload()
        off.join_after_forward()
        off.close()


@pytest.mark.parametrize("device", DEVICES)
def test_layout_mismatch_is_refused(ckpt, tmp_path, device):
    """A backend whose processing changes the expert layout (here: transposed w2) is never served."""
    layers = build(ckpt, device, load_experts=False)
    off = MmapOffloader(MmapOptions(cache_dir=str(tmp_path / "cache"), pinned_mib=8), checkpoint=ckpt, device=device)
    off.wrap_modules(iter(layers))
    for layer in layers:  # a "process_weights_after_loading" that transposes w2
        ex = layer.block_sparse_moe.experts
        ex.w2_weight.data = ex.w2_weight.data.transpose(1, 2).contiguous()
    with pytest.raises(UnsupportedError, match="w2_weight"):
        off.post_init()
    off.close()


def test_partial_selection_is_refused(ckpt, tmp_path):
    layers = build(ckpt, "cpu", load_experts=False)
    off = MmapOffloader(MmapOptions(cache_dir=str(tmp_path / "cache"), params=("w2_weight",)), checkpoint=ckpt, device="cpu")
    with pytest.raises(UnsupportedError, match="whole experts"):
        off.wrap_modules(iter(layers))


def test_the_multi_token_prediction_layer_is_skipped_unless_speculative_decoding_loads_it(ckpt, tmp_path):
    """A checkpoint whose last layer is a multi-token-prediction layer (num_nextn_predict_layers past
    num_hidden_layers, as GLM-4.5 and DeepSeek-V3 ship): the model has no such layer and vLLM's main
    model drops its tensors after reading them (skip_spec_layers), so the loader is told to skip them
    unread with the served experts; with speculative decoding (its MTP head loads them) they stay."""
    import json
    from types import SimpleNamespace

    from mmap_offload.vllm_backend import skipped_checkpoint_names

    mtp_ckpt = tmp_path / "mtp"
    mtp_ckpt.mkdir()
    for f in ckpt.iterdir():
        if f.name != "config.json":
            (mtp_ckpt / f.name).symlink_to(f)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(num_hidden_layers=LAYERS - 1, num_nextn_predict_layers=1)
    (mtp_ckpt / "config.json").write_text(json.dumps(cfg))
    layers = [ToyLayer(l, "cpu") for l in range(LAYERS - 1)]
    off = MmapOffloader(MmapOptions(cache_dir=str(tmp_path / "cache"), pinned_mib=8), checkpoint=mtp_ckpt, device="cpu")
    try:
        off.wrap_modules(iter(layers))
        with open_checkpoint(mtp_ckpt) as c:
            last = sorted(n for n in c.names() if n.startswith(f"model.layers.{LAYERS - 1}."))
            served = {r.name for l in c.moe.layers for e in range(E) for p in c.expert_refs(l, e).values() for r in p.values()}
            assert c.moe.layers == list(range(LAYERS - 1)) and last
            assert skipped_checkpoint_names() == served | set(last)
            s = off.summary()
            assert s["skipped_tensors"] == len(served) and s["skipped_mtp_tensors"] == len(last)
            assert s["skipped_mtp_bytes"] == sum(c.ref(n).nbytes for n in last) > 0
            off._vcfg = SimpleNamespace(speculative_config=SimpleNamespace(method="mtp"))
            assert off._unread_mtp_names(c) == set()
            off._vcfg = SimpleNamespace(speculative_config=None)
            assert off._unread_mtp_names(c) == set(last)
    finally:
        off.close()


def test_each_layer_is_shrunk_before_the_next_is_built(ckpt, tmp_path):
    """vLLM builds decoder layers lazily inside wrap_modules: full-size experts of one layer at most."""
    seen = []

    def layers():
        built = []
        for l in range(LAYERS):
            seen.append([b.block_sparse_moe.experts.w13_weight.shape[0] for b in built])
            layer = ToyLayer(l, "cpu")
            built.append(layer)
            yield layer

    off = MmapOffloader(MmapOptions(cache_dir=str(tmp_path / "cache"), pinned_mib=8), checkpoint=ckpt, device="cpu")
    off.wrap_modules(layers())
    assert seen == [[1] * l for l in range(LAYERS)]
    off.close()


def test_a_bit_flipped_after_warmup_is_never_served(ckpt, tmp_path):
    """Default options: each layer is checksummed before its first copy; a corrupt one stops the forward."""
    from mmap_offload.cache_reader import open_cache
    from mmap_offload.errors import CorruptCacheError
    from mmap_offload.warmup import warmup

    cache_dir = tmp_path / "cache"
    warmup(ckpt, cache_dir, device="cpu")
    cache = open_cache(cache_dir)
    path = cache.layer_file(2)
    data = bytearray(path.read_bytes())
    data[cache.record_nbytes + 100] ^= 0x04  # expert 1 of layer 2, inside w13_weight
    path.write_bytes(bytes(data))
    layers = build(ckpt, "cpu", load_experts=False)
    off = MmapOffloader(MmapOptions(cache_dir=str(cache_dir), pinned_mib=8, threads=2), checkpoint=ckpt, device="cpu")
    off.wrap_modules(iter(layers))
    off.post_init()
    with pytest.raises(CorruptCacheError, match="layer 2 expert 1 w13_weight"):
        run(layers, torch.randn(4, H).to(torch.bfloat16), steps=1)
    off.close()


def test_forward_hook_skips_the_layer_verbs_once_the_router_decides(ckpt, tmp_path):
    """With the expert cache (a residency), the router makes each layer's experts resident: the
    decoder hook then calls the original forward alone (no wait or start per layer, which through
    vLLM are two custom ops on the launching thread); before post_init and without a residency it
    still waits and starts."""
    layers = build(ckpt, "cpu", False)
    off = MmapOffloader(MmapOptions(cache_dir=str(tmp_path / "cache"), lookahead=0, pinned_mib=8), checkpoint=ckpt,
                        device="cpu")
    calls = []
    try:
        off.wrap_modules(iter(layers))
        wait, start = off._wait_for_layer, off._start_prefetch
        off._wait_for_layer = lambda i: (calls.append(("wait", i)), wait(i))[1]
        off._start_prefetch = lambda i: (calls.append(("start", i)), start(i))[1]
        x = torch.randn(2, H).to(torch.bfloat16)
        run(layers, x, steps=1)  # post_init on the first wait; no residency: every layer waits and starts
        assert calls == [(v, i) for i in range(LAYERS) for v in ("wait", "start")]
        calls.clear()
        off.residency = object()  # the router decides from here on
        with torch.inference_mode():
            for layer in layers:
                layer.block_sparse_moe.experts.w13_weight.data = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16)
                layer.block_sparse_moe.experts.w2_weight.data = torch.zeros(E, H, I, dtype=torch.bfloat16)
                x = layer(x)
        assert calls == []
    finally:
        off.residency = None
        off.close()
