"""Synthetic Hugging Face MoE checkpoints with random weights, written by streaming.

``make_checkpoint(out_dir, ...)`` writes a directory that loaders take for a real checkpoint:

    config.json                          architecture config (+ compressed-tensors quantization_config)
    generation_config.json
    model-0000x-of-0000y.safetensors     tensors, shards of at most ``shard_bytes`` (one tensor may exceed it)
    model.safetensors.index.json         {"metadata": {"total_size": ...}, "weight_map": {name: shard}}

Architectures (``arch``) and their routed-expert names:

    "mixtral"    MixtralForCausalLM    model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}   (gate, up, down)
                                        router model.layers.L.block_sparse_moe.gate
    "qwen_moe"   Qwen3MoeForCausalLM   model.layers.L.mlp.experts.E.{gate,up,down}_proj, router mlp.gate,
                                        q_norm / k_norm, no shared expert
    "qwen2_moe"  Qwen2MoeForCausalLM   as qwen_moe plus q/k/v biases and a shared expert
                                        (mlp.shared_expert.*, mlp.shared_expert_gate) that is not routed
    "glm4_moe"   Glm4MoeForCausalLM    GLM-4.5 / 4.6 (the user's model class): layer 0 dense
                                        (mlp.{gate,up,down}_proj, ``first_k_dense_replace`` 1), then
                                        mlp.experts.E.{gate,up,down}_proj; router mlp.gate with a float32
                                        mlp.gate.e_score_correction_bias (sigmoid scores, grouped top-k), a
                                        shared expert mlp.shared_experts.*, q/k/v biases, partial rotary;
                                        ``mtp_layers`` adds its multi-token-prediction layer(s) after the last

Quantization (``quant``): "bf16" writes every tensor in ``dtype``; "w4a16" writes the routed experts the way
llm-compressor saves compressed-tensors ``pack-quantized`` symmetric int4 weights, per projection:
``weight_packed`` int32 [N, K/8] (nibble j of word [n, c] holds u[n, 8c + j], u = q + 8 in [0, 15]),
``weight_scale`` [N, K/group] (``dtype``; [N, 1] when ``group_size == -1``), ``weight_shape`` int64 [2] = [N, K]
(compressed-tensors saves ``torch.tensor(weight.shape)``), and with ``actorder`` ``weight_g_idx`` int32 [K]
(a random permutation of ``arange(K) // group_size``: each group id appears ``group_size`` times).
K need not be a multiple of ``group_size`` (the last group is partial, as compressed-tensors allows), but
vLLM's Marlin kernels need it to be; vLLM 0.32 also refuses actorder "group" checkpoints. Attention,
routers, shared experts, embeddings and lm_head stay in ``dtype``: the config targets "Linear" and its
``ignore`` lists every other Linear by name, as compressed-tensors writes it, so vLLM's compressed-tensors
config quantizes exactly the routed experts (tested against vLLM 0.32 in tests/test_synth.py).

Values: float weights are bf16 bit patterns with random sign and mantissa and magnitude in [2^-9, 2^-5)
(|w| < 0.032, so a forward pass stays finite); norms are 1; packed words are uniformly random (every nibble
uniform in [0, 15]); scales are positive in [2^-9, 2^-8). Each tensor draws from its own generator seeded by
(seed, crc32(name)), so a checkpoint is a pure function of its arguments, whatever the sharding.

Memory: the header of each shard is computed from shapes first, then tensors are generated and written in
chunks of at most ``CHUNK_BYTES``, so memory stays bounded whatever the checkpoint size.
"""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import CheckpointError, StorageError

__all__ = ["PRESETS", "embedded_default", "make_checkpoint", "ARCHS", "QUANTS"]

ARCHS = ("mixtral", "qwen_moe", "qwen2_moe", "glm4_moe")
QUANTS = ("bf16", "w4a16")
CHUNK_BYTES = 8 << 20
GLM_DENSE_LAYERS = 1  # glm4_moe: first_k_dense_replace (GLM-4.5-Air's; GLM-4.5 has 3)
DEFAULT_SHARD_BYTES = 1 << 30
TRANSFORMERS_VERSION = "4.57.1"
COMPRESSED_TENSORS_VERSION = "0.12.2"

_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32",
             torch.int64: "I64"}
_CONFIG_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}

# Named sizes. "demo" is the embedded default of the quick start (~150 MB, W4A16); "tiny-mixtral" is
# small enough for vLLM's CPU build to load and generate with in seconds.
PRESETS: dict[str, dict] = {
    "demo": dict(arch="mixtral", quant="w4a16", num_layers=4, num_experts=8, hidden=1024,
                 intermediate=2048, top_k=2, vocab_size=8192, num_heads=8, num_kv_heads=2,
                 group_size=128),
    "tiny-mixtral": dict(arch="mixtral", quant="bf16", num_layers=2, num_experts=4, hidden=128,
                         intermediate=256, top_k=2, vocab_size=1000, num_heads=4, num_kv_heads=2),
    "tiny-mixtral-w4a16": dict(arch="mixtral", quant="w4a16", num_layers=2, num_experts=4, hidden=128,
                               intermediate=256, top_k=2, vocab_size=1000, num_heads=4, num_kv_heads=2,
                               group_size=64),
    "tiny-qwen-moe": dict(arch="qwen_moe", quant="bf16", num_layers=2, num_experts=8, hidden=128,
                          intermediate=128, top_k=2, vocab_size=1000, num_heads=4, num_kv_heads=2),
    # the user's model class in small: a dense first layer, then 2 MoE layers of 8 experts, top-2 by
    # sigmoid score plus correction bias (one group, as GLM-4.5's n_group 1), a shared expert
    "tiny-glm4-moe": dict(arch="glm4_moe", quant="bf16", num_layers=3, num_experts=8, hidden=128,
                          intermediate=128, top_k=2, vocab_size=1000, num_heads=4, num_kv_heads=2),
}


def embedded_default() -> dict:
    """The sizes of the quick-start demo checkpoint (a copy of ``PRESETS["demo"]``)."""
    return dict(PRESETS["demo"])


@dataclass(frozen=True)
class _Plan:
    """One tensor to write: name, dtype, shape, and how to fill it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    kind: str  # "weight" | "ones" | "packed" | "scale" | "shape" | "g_idx"
    values: tuple[int, ...] = ()  # [N, K] for "shape", (group_size,) for "g_idx"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def make_checkpoint(
    out_dir: str | os.PathLike,
    *,
    arch: str = "mixtral",
    quant: str = "w4a16",
    num_layers: int = 4,
    num_experts: int = 8,
    hidden: int = 1024,
    intermediate: int = 2048,
    top_k: int = 2,
    vocab_size: int = 8192,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    group_size: int = 128,
    actorder: bool = False,
    seed: int = 0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    dtype: torch.dtype = torch.bfloat16,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    mtp_layers: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write a synthetic MoE checkpoint into ``out_dir`` (created if missing) and return its path.

    ``group_size`` -1 means channelwise scales; ``actorder`` adds ``weight_g_idx`` (needs grouped scales).
    ``mtp_layers`` (glm4_moe only): multi-token-prediction layers after the last decoder layer, as GLM-4.5's
    checkpoints ship one (``model.layers.<num_layers>.*``: a whole MoE layer, experts included, plus
    ``eh_proj``, ``enorm``, ``hnorm``, ``shared_head.norm``; config ``num_nextn_predict_layers``); vLLM
    builds them only for speculative decoding, and they are not routed experts of the served model.
    ``progress`` is called with the bytes of each chunk written. Files of an earlier run in ``out_dir`` are
    replaced; shards the new index does not name are removed. On any failure the files written so far are
    removed again. Raises CheckpointError for sizes that cannot make a checkpoint, StorageError when the
    directory cannot be written or lacks the space (checked before writing).
    """
    out = Path(out_dir)
    head_dim = head_dim or (hidden // num_heads if num_heads else 0)
    _check_args(arch, quant, num_layers, num_experts, hidden, intermediate, top_k, vocab_size, num_heads,
                num_kv_heads, head_dim, group_size, actorder, dtype, shard_bytes, mtp_layers)
    plans = _plan_tensors(arch, quant, num_layers, num_experts, hidden, intermediate, vocab_size, num_heads,
                          num_kv_heads, head_dim, group_size, actorder, dtype, tie_word_embeddings, mtp_layers)
    shards = _split_shards(plans, shard_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    config = _config(arch, quant, num_layers, num_experts, hidden, intermediate, top_k, vocab_size, num_heads,
                     num_kv_heads, head_dim, group_size, actorder, dtype, max_position_embeddings,
                     tie_word_embeddings, mtp_layers)
    index = {"metadata": {"total_size": sum(p.nbytes for p in plans)},
             "weight_map": {p.name: names[i] for i, shard in enumerate(shards) for p in shard}}
    total = index["metadata"]["total_size"]
    written: list[Path] = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(out).free
        if free < total + (1 << 20):
            raise StorageError(f"not enough space in {out} for the checkpoint: {total / 2**30:.2f} GiB needed, "
                               f"{free / 2**30:.2f} GiB free", "free space or choose another directory")
        # config.json and the index go last: until then the directory is not a checkpoint
        for stale in [out / "config.json", out / "model.safetensors.index.json", out / "model.safetensors",
                      *out.glob("model-*-of-*.safetensors")]:
            if stale.exists() and stale.name not in names:
                stale.unlink()
        for name, shard in zip(names, shards):
            written.append(out / name)
            _write_shard(out / name, shard, seed, progress)
        generation = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                      "transformers_version": TRANSFORMERS_VERSION}
        for name, obj in (("generation_config.json", generation), ("model.safetensors.index.json", index),
                          ("config.json", config)):
            written.append(out / name)
            _write_json(out / name, obj)
    except BaseException as e:
        for path in written:  # nothing half-written is left behind
            path.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                  errno.EPERM, errno.ENOTDIR, errno.EEXIST):
            raise StorageError(f"cannot write the checkpoint to {out} ({os.strerror(e.errno)})",
                               "free space or choose a writable directory") from None
        raise
    return out


# --------------------------------------------------------------------------------------------- plan


def _check_args(arch, quant, num_layers, num_experts, hidden, intermediate, top_k, vocab_size, num_heads,
                num_kv_heads, head_dim, group_size, actorder, dtype, shard_bytes, mtp_layers=0) -> None:
    def bad(msg: str, fix: str) -> None:
        raise CheckpointError(f"cannot synthesize this checkpoint: {msg}", fix)

    if arch not in ARCHS:
        bad(f"unknown arch {arch!r}", f"use one of {', '.join(ARCHS)}")
    if quant not in QUANTS:
        bad(f"unknown quant {quant!r}", f"use one of {', '.join(QUANTS)}")
    if dtype not in _CONFIG_DTYPE:
        bad(f"dtype {dtype} is not a float type", "use torch.bfloat16, torch.float16 or torch.float32")
    for label, v in (("num_layers", num_layers), ("num_experts", num_experts), ("hidden", hidden),
                     ("intermediate", intermediate), ("num_heads", num_heads),
                     ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("shard_bytes", shard_bytes)):
        if int(v) < 1:
            bad(f"{label} is {v}", f"give {label} >= 1")
    if not 1 <= top_k <= num_experts:
        bad(f"top_k {top_k} is not in [1, num_experts={num_experts}]", "give 1 <= top_k <= num_experts")
    if vocab_size < 3:
        bad(f"vocab_size {vocab_size} leaves no room for bos/eos ids 1 and 2", "give vocab_size >= 3")
    if num_heads % num_kv_heads:
        bad(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
            "choose num_kv_heads dividing num_heads")
    if arch == "qwen2_moe" and head_dim * num_heads != hidden:
        bad("qwen2_moe needs head_dim * num_heads == hidden", "drop head_dim or make them agree")
    if mtp_layers and (arch != "glm4_moe" or mtp_layers < 0):
        bad(f"mtp_layers {mtp_layers} with arch {arch}", "give mtp_layers >= 0, and > 0 only with arch glm4_moe")
    if arch == "glm4_moe" and num_layers < GLM_DENSE_LAYERS + 1:
        bad(f"glm4_moe's first {GLM_DENSE_LAYERS} layer is dense, so num_layers {num_layers} leaves no MoE layer",
            f"give num_layers >= {GLM_DENSE_LAYERS + 1}")
    if quant == "w4a16":
        for label, k in (("hidden", hidden), ("intermediate", intermediate)):
            if k % 8:
                bad(f"{label} {k} is not a multiple of 8 (8 int4 values per int32)",
                    f"give {label} a multiple of 8")
        if group_size != -1 and group_size < 1:
            bad(f"group_size is {group_size}", "give group_size > 0, or -1 for channelwise scales")
        if actorder and group_size == -1:
            bad("actorder needs grouped scales", "give group_size > 0 or actorder=False")


def _plan_tensors(arch, quant, num_layers, num_experts, hidden, intermediate, vocab_size, num_heads,
                  num_kv_heads, head_dim, group_size, actorder, dtype, tie, mtp_layers=0) -> list[_Plan]:
    H, I = hidden, intermediate
    glu = (("gate_proj", I, H), ("up_proj", I, H), ("down_proj", H, I))  # (name, N, K) of a gated MLP
    plans = [_Plan("model.embed_tokens.weight", dtype, (vocab_size, H), "weight")]
    for L in range(num_layers + mtp_layers):
        p = f"model.layers.{L}"
        if L >= num_layers:  # a multi-token-prediction layer's own tensors (GLM-4.5's), then a MoE layer
            plans.append(_Plan(f"{p}.eh_proj.weight", dtype, (H, 2 * H), "weight"))
            plans += [_Plan(f"{p}.{n}.weight", dtype, (H,), "ones") for n in ("enorm", "hnorm", "shared_head.norm")]
        plans.append(_Plan(f"{p}.input_layernorm.weight", dtype, (H,), "ones"))
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        for proj, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            plans.append(_Plan(f"{p}.self_attn.{proj}.weight", dtype, (n, H), "weight"))
            if arch in ("qwen2_moe", "glm4_moe"):
                plans.append(_Plan(f"{p}.self_attn.{proj}.bias", dtype, (n,), "weight"))
        plans.append(_Plan(f"{p}.self_attn.o_proj.weight", dtype, (H, q), "weight"))
        if arch == "qwen_moe":
            plans.append(_Plan(f"{p}.self_attn.q_norm.weight", dtype, (head_dim,), "ones"))
            plans.append(_Plan(f"{p}.self_attn.k_norm.weight", dtype, (head_dim,), "ones"))
        plans.append(_Plan(f"{p}.post_attention_layernorm.weight", dtype, (H,), "ones"))
        if arch == "glm4_moe" and L < GLM_DENSE_LAYERS:  # a dense MLP, no experts
            for proj, n, k in glu:
                plans.append(_Plan(f"{p}.mlp.{proj}.weight", dtype, (n, k), "weight"))
            continue
        moe = f"{p}.block_sparse_moe" if arch == "mixtral" else f"{p}.mlp"
        plans.append(_Plan(f"{moe}.gate.weight", dtype, (num_experts, H), "weight"))
        if arch == "glm4_moe":  # float32, as GLM's checkpoints store it
            plans.append(_Plan(f"{moe}.gate.e_score_correction_bias", torch.float32, (num_experts,), "weight"))
        projs = (("w1", I, H), ("w2", H, I), ("w3", I, H)) if arch == "mixtral" else glu
        for e in range(num_experts):
            for proj, n, k in projs:
                base = f"{moe}.experts.{e}.{proj}"
                if quant == "bf16":
                    plans.append(_Plan(f"{base}.weight", dtype, (n, k), "weight"))
                    continue
                groups = 1 if group_size == -1 else -(-k // group_size)  # a last partial group is allowed
                plans.append(_Plan(f"{base}.weight_packed", torch.int32, (n, k // 8), "packed"))
                plans.append(_Plan(f"{base}.weight_scale", dtype, (n, groups), "scale"))
                plans.append(_Plan(f"{base}.weight_shape", torch.int64, (2,), "shape", (n, k)))
                if actorder:
                    plans.append(_Plan(f"{base}.weight_g_idx", torch.int32, (k,), "g_idx", (group_size,)))
        if arch == "qwen2_moe":
            for proj, n, k in glu:
                plans.append(_Plan(f"{moe}.shared_expert.{proj}.weight", dtype, (n, k), "weight"))
            plans.append(_Plan(f"{moe}.shared_expert_gate.weight", dtype, (1, H), "weight"))
        if arch == "glm4_moe":
            for proj, n, k in glu:
                plans.append(_Plan(f"{moe}.shared_experts.{proj}.weight", dtype, (n, k), "weight"))
    plans.append(_Plan("model.norm.weight", dtype, (H,), "ones"))
    if not tie:
        plans.append(_Plan("lm_head.weight", dtype, (vocab_size, H), "weight"))
    return plans


def _split_shards(plans: list[_Plan], shard_bytes: int) -> list[list[_Plan]]:
    """Greedy, in order: a new shard starts when the next tensor would push this one past shard_bytes."""
    shards: list[list[_Plan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _ignored_linears(arch: str, num_layers: int, tie: bool, mtp_layers: int = 0) -> list[str]:
    """Every Linear module left unquantized, in module order, as compressed-tensors lists them."""
    names = []
    for L in range(num_layers + mtp_layers):
        p = f"model.layers.{L}"
        if L >= num_layers:
            names.append(f"{p}.eh_proj")
        names += [f"{p}.self_attn.{x}_proj" for x in "qkvo"]
        if arch == "glm4_moe" and L < GLM_DENSE_LAYERS:
            names += [f"{p}.mlp.{x}_proj" for x in ("gate", "up", "down")]
            continue
        if arch == "mixtral":
            names.append(f"{p}.block_sparse_moe.gate")
        else:
            names.append(f"{p}.mlp.gate")
        if arch == "qwen2_moe":
            names += [f"{p}.mlp.shared_expert.{x}_proj" for x in ("gate", "up", "down")]
            names.append(f"{p}.mlp.shared_expert_gate")
        if arch == "glm4_moe":
            names += [f"{p}.mlp.shared_experts.{x}_proj" for x in ("gate", "up", "down")]
    names.append("lm_head")
    return names


def _quantization_config(arch: str, num_layers: int, group_size: int, actorder: bool, tie: bool,
                         mtp_layers: int = 0) -> dict:
    channel = group_size == -1
    weights = {
        "actorder": "group" if actorder else None,
        "block_structure": None,
        "dynamic": False,
        "group_size": None if channel else group_size,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "channel" if channel else "group",
        "symmetric": True,
        "type": "int",
    }
    return {
        "config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                                      "output_activations": None, "targets": ["Linear"],
                                      "weights": weights}},
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": _ignored_linears(arch, num_layers, tie, mtp_layers),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def _config(arch, quant, num_layers, num_experts, hidden, intermediate, top_k, vocab_size, num_heads,
            num_kv_heads, head_dim, group_size, actorder, dtype, max_pos, tie, mtp_layers=0) -> dict:
    common = {
        "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": hidden, "initializer_range": 0.02, "max_position_embeddings": max_pos,
        "num_attention_heads": num_heads, "num_experts_per_tok": top_k, "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads, "output_router_logits": False, "rope_scaling": None,
        "sliding_window": None, "tie_word_embeddings": tie, "torch_dtype": _CONFIG_DTYPE[dtype],
        "transformers_version": TRANSFORMERS_VERSION, "use_cache": True, "vocab_size": vocab_size,
    }
    if arch == "mixtral":
        cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "head_dim": head_dim,
               "intermediate_size": intermediate, "num_local_experts": num_experts, "rms_norm_eps": 1e-5,
               "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.0}
    elif arch == "glm4_moe":
        # GLM-4.5-Air's config.json in small (its n_group / topk_group 1, GLM-4.5's routed_scaling_factor 2.5,
        # partial_rotary_factor 0.5; num_nextn_predict_layers: mtp_layers)
        cfg = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": True,
               "first_k_dense_replace": GLM_DENSE_LAYERS, "head_dim": head_dim, "intermediate_size": intermediate,
               "moe_intermediate_size": intermediate, "n_group": 1, "n_routed_experts": num_experts,
               "n_shared_experts": 1, "norm_topk_prob": True, "num_nextn_predict_layers": mtp_layers,
               "pad_token_id": 0, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
               "routed_scaling_factor": 2.5, "topk_group": 1, "use_qk_norm": False}
    else:
        cfg = {"decoder_sparse_step": 1, "intermediate_size": intermediate, "max_window_layers": num_layers,
               "mlp_only_layers": [], "moe_intermediate_size": intermediate, "norm_topk_prob": True,
               "num_experts": num_experts, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
               "router_aux_loss_coef": 0.001, "use_sliding_window": False}
        if arch == "qwen_moe":
            cfg.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                        "attention_bias": False, "head_dim": head_dim, "norm_topk_prob": True})
        else:
            cfg.update({"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                        "norm_topk_prob": False, "qkv_bias": True,
                        "shared_expert_intermediate_size": intermediate})
    cfg.update(common)
    if quant == "w4a16":
        cfg["quantization_config"] = _quantization_config(arch, num_layers, group_size, actorder, tie, mtp_layers)
    return dict(sorted(cfg.items()))


# -------------------------------------------------------------------------------------------- write


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _header(plans: list[_Plan]) -> bytes:
    """The safetensors header of one shard: 8-byte LE length + JSON, padded with spaces to 8 bytes."""
    meta: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        meta[p.name] = {"dtype": _ST_DTYPE[p.dtype], "shape": list(p.shape),
                        "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    body = json.dumps(meta, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _write_shard(path: Path, plans: list[_Plan], seed: int, progress: Callable[[int], None] | None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(_header(plans))
            for p in plans:
                for chunk in _generate(p, seed):
                    f.write(chunk)
                    if progress is not None:
                        progress(len(chunk))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _rng(seed: int, name: str) -> np.random.PCG64DXSM:
    return np.random.PCG64DXSM(np.random.SeedSequence([seed & 0xFFFFFFFF, seed >> 32, zlib.crc32(name.encode())]))


def _random_bf16_bits(bitgen: np.random.PCG64DXSM, n: int, exp_lo: int, exp_span_mask: int,
                      signed: bool) -> np.ndarray:
    """n random bf16 bit patterns: random mantissa, exponent exp_lo + (2 random bits & exp_span_mask),
    random sign if ``signed`` else positive. Works on 64-bit words (4 values each), in place."""
    lanes = np.uint64(0x0001000100010001)
    w = bitgen.random_raw((n + 3) // 4)
    e = w >> np.uint64(7)
    e &= lanes * np.uint64(exp_span_mask)
    e += lanes * np.uint64(exp_lo)  # per 16-bit lane: at most 121, no carry into the next lane
    e <<= np.uint64(7)
    w &= lanes * np.uint64(0x807F if signed else 0x007F)
    w |= e
    return w.view(np.uint16)[:n]


def _to_dtype(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """bf16 bit patterns as ``dtype`` values (exact: the magnitudes fit fp16 and fp32)."""
    if dtype == torch.bfloat16:
        return bits
    if dtype == torch.float32:
        return bits.astype(np.uint32) << np.uint32(16)
    return torch.from_numpy(bits).view(torch.bfloat16).to(dtype).numpy()


def _generate(p: _Plan, seed: int) -> Iterator[memoryview]:
    """The bytes of one tensor, in chunks of at most CHUNK_BYTES (deterministic for (seed, name))."""
    n = math.prod(p.shape)
    if p.kind == "ones":
        yield memoryview(torch.ones(p.shape, dtype=p.dtype).view(torch.uint8).numpy()).cast("B")
        return
    if p.kind == "shape":
        yield memoryview(np.array(p.values, dtype="<i8")).cast("B")
        return
    if p.kind == "g_idx":
        # gate and up share their input, so real GPTQ gives them one g_idx (and vLLM keeps one for both)
        bitgen = _rng(seed, p.name.replace(".w3.", ".w1.").replace(".up_proj.", ".gate_proj."))
        k, g = n, p.values[0]
        ids = np.arange(k, dtype=np.int32) // np.int32(g)
        np.random.Generator(bitgen).shuffle(ids)
        yield memoryview(ids.astype("<i4")).cast("B")
        return
    bitgen = _rng(seed, p.name)
    per_chunk = max(1, CHUNK_BYTES // p.dtype.itemsize)
    done = 0
    while done < n:
        m = min(per_chunk, n - done)
        if p.kind == "packed":
            words = bitgen.random_raw((m + 1) // 2).view(np.uint32)[:m]
            yield memoryview(words).cast("B")
        elif p.kind == "weight":  # |w| in [2^-9, 2^-5), random sign
            yield memoryview(np.ascontiguousarray(_to_dtype(_random_bf16_bits(bitgen, m, 118, 3, True),
                                                            p.dtype))).cast("B")
        elif p.kind == "scale":  # s in [2^-9, 2^-8), positive
            yield memoryview(np.ascontiguousarray(_to_dtype(_random_bf16_bits(bitgen, m, 118, 0, False),
                                                            p.dtype))).cast("B")
        else:
            raise AssertionError(p.kind)
        done += m
