"""The checkpoint reader: headers, expert discovery, quantization scheme, fingerprint, preads, errors."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mmap_offload.checkpoint import (FINGERPRINT_SAMPLES, FINGERPRINT_WINDOW, Checkpoint, MoEInfo, QuantScheme,
                                    TensorRef, open_checkpoint)
from mmap_offload.errors import CheckpointError, MmapOffloadError, UnsupportedError
from mmap_offload.synth import make_checkpoint

TINY = dict(num_layers=3, num_experts=4, hidden=128, intermediate=256, top_k=2, vocab_size=300, num_heads=4,
            num_kv_heads=2)
INDEX = "model.safetensors.index.json"


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def safe_open_all(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as s:
            out.update({k: s.get_tensor(k) for k in s.keys()})
    return out


def rewrite_header(shard: Path, edit) -> None:
    """Apply ``edit(header_dict)`` to a shard's JSON header, keep the data bytes."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    shard.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


@pytest.fixture(scope="module")
def w4a16(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("w4a16") / "ckpt", quant="w4a16", shard_bytes=150_000,
                           **TINY)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", quant="bf16", **TINY)


def copy_ckpt(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


# ------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("arch", ["mixtral", "qwen_moe", "qwen2_moe"])
@pytest.mark.parametrize("quant", ["bf16", "w4a16"])
def test_round_trip(tmp_path, arch, quant):
    path = make_checkpoint(tmp_path / "c", arch=arch, quant=quant, shard_bytes=200_000, **TINY)
    with open_checkpoint(path) as ckpt:
        assert isinstance(ckpt, Checkpoint) and ckpt.path == path and len(ckpt.shards) > 1
        assert ckpt.config["num_hidden_layers"] == 3
        moe = ckpt.moe
        assert isinstance(moe, MoEInfo)
        assert (moe.num_experts, moe.hidden, moe.intermediate, moe.top_k, moe.layers) == (4, 128, 256, 2, [0, 1, 2])
        mid = "block_sparse_moe" if arch == "mixtral" else "mlp"
        assert moe.prefixes == {L: f"model.layers.{L}.{mid}.experts" for L in range(3)}
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        assert moe.proj_names == dict(zip(("gate", "up", "down"), names))
        if quant == "bf16":
            assert ckpt.quant == QuantScheme(kind="unquantized", num_bits=16, weight_dtype=torch.bfloat16)
            suffixes = ["weight"]
        else:
            assert ckpt.quant == QuantScheme(kind="w4a16", group_size=128, actorder=False, symmetric=True,
                                             num_bits=4, weight_dtype=torch.int32, scale_dtype=torch.bfloat16)
            suffixes = ["weight_packed", "weight_scale", "weight_shape"]

        ref_tensors = safe_open_all(path)
        expert_names = set()
        for L in moe.layers:
            for e in range(moe.num_experts):
                refs = ckpt.expert_refs(L, e)
                assert list(refs) == ["gate", "up", "down"]
                for canon, proj in moe.proj_names.items():
                    assert list(refs[canon]) == suffixes
                    for suf, ref in refs[canon].items():
                        assert isinstance(ref, TensorRef)
                        assert ref.name == f"{moe.prefixes[L]}.{e}.{proj}.{suf}"
                        expert_names.add(ref.name)
        assert moe.expert_nbytes == sum(r.nbytes for s in ckpt.expert_refs(0, 0).values() for r in s.values())
        assert ckpt.non_expert_names() == sorted(set(ref_tensors) - expert_names)
        assert ckpt.names() == sorted(ref_tensors)
        if arch == "qwen2_moe":  # the shared expert is not a routed expert
            assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in ckpt.non_expert_names()
        # every tensor, bit for bit, as safetensors reads it
        total = 0
        for name, want in ref_tensors.items():
            got = ckpt.read(ckpt.ref(name))
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert as_bytes(got) == as_bytes(want), name
            total += want.numel() * want.element_size()
        assert ckpt.bytes_read == total


@pytest.mark.parametrize("quant", ["bf16", "w4a16"])
def test_glm4_moe_experts_start_after_the_dense_layer(tmp_path, quant):
    """GLM-4.5's layout: the MoE layers are 1 and 2 (layer 0 is dense); the shared experts, the dense
    MLP and the router's correction bias are not routed experts."""
    path = make_checkpoint(tmp_path / "g", arch="glm4_moe", quant=quant, **TINY)
    with open_checkpoint(path) as ckpt:
        moe = ckpt.moe
        assert (moe.num_experts, moe.hidden, moe.intermediate, moe.top_k, moe.layers) == (4, 128, 256, 2, [1, 2])
        assert moe.prefixes == {L: f"model.layers.{L}.mlp.experts" for L in (1, 2)}
        others = ckpt.non_expert_names()
        for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.shared_experts.gate_proj.weight",
                     "model.layers.2.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.gate.weight"):
            assert name in others, name
        assert not [n for n in others if ".mlp.experts." in n]
        assert sorted(others + [r.name for L in moe.layers for e in range(4)
                                for parts in ckpt.expert_refs(L, e).values() for r in parts.values()]) == ckpt.names()


def test_glm4_moe_multi_token_prediction_layer_is_not_served(tmp_path):
    """GLM-4.5 ships a multi-token-prediction layer after its last decoder layer (experts included,
    config num_nextn_predict_layers): past num_hidden_layers, so its experts stay non-expert tensors."""
    path = make_checkpoint(tmp_path / "g", arch="glm4_moe", quant="w4a16", mtp_layers=1, **TINY)
    with open_checkpoint(path) as ckpt:
        assert ckpt.config["num_nextn_predict_layers"] == 1 and ckpt.moe.layers == [1, 2]
        mtp = [n for n in ckpt.names() if n.startswith("model.layers.3.")]
        assert "model.layers.3.eh_proj.weight" in mtp and "model.layers.3.mlp.experts.3.down_proj.weight_packed" in mtp
        assert set(mtp) <= set(ckpt.non_expert_names())
        assert ckpt.mtp_names() == sorted(mtp)  # what vLLM's main model drops (skip_spec_layers)
    no_mtp = make_checkpoint(tmp_path / "n", arch="glm4_moe", quant="w4a16", **TINY)
    with open_checkpoint(no_mtp) as ckpt:
        assert ckpt.config["num_nextn_predict_layers"] == 0 and ckpt.mtp_names() == []


def test_read_expert_and_read_into_out(w4a16):
    ckpt = open_checkpoint(w4a16)
    tensors = ckpt.read_expert(2, 3)
    want = safe_open_all(w4a16)
    for canon, proj in ckpt.moe.proj_names.items():
        for suf, t in tensors[canon].items():
            assert torch.equal(t, want[f"model.layers.2.block_sparse_moe.experts.3.{proj}.{suf}"])
    assert tensors["down"]["weight_shape"].tolist() == [128, 256]
    ref = ckpt.expert_refs(1, 0)["up"]["weight_packed"]
    out = torch.empty(ref.shape, dtype=ref.dtype)
    assert ckpt.read(ref, out=out) is out and torch.equal(out, want[ref.name])
    with pytest.raises(ValueError, match="bytes"):
        ckpt.read(ref, out=torch.empty(3, dtype=torch.int32))
    with pytest.raises(KeyError, match="expert 9"):
        ckpt.expert_refs(0, 9)


def test_reading_one_tensor_reads_only_its_bytes_and_never_maps(w4a16, monkeypatch):
    def no_mmap(*a, **k):
        raise AssertionError("the checkpoint reader must not mmap shards")

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    ckpt = open_checkpoint(w4a16)
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in ckpt.shards)
    assert ckpt.bytes_read == 0  # open reads headers + fingerprint samples only
    assert headers < ckpt.open_bytes_read <= headers + len(ckpt.shards) * FINGERPRINT_SAMPLES * FINGERPRINT_WINDOW
    ref = ckpt.expert_refs(1, 2)["gate"]["weight_scale"]
    ckpt.read(ref)
    assert ckpt.bytes_read == ref.nbytes == 256 * 1 * 2
    refs = [r for s in ckpt.expert_refs(2, 0).values() for r in s.values()]
    for r in refs:
        ckpt.read(r)
    assert ckpt.bytes_read == ref.nbytes + sum(r.nbytes for r in refs) == ref.nbytes + ckpt.moe.expert_nbytes


def test_pickles_for_worker_processes(w4a16):
    import pickle

    ckpt = open_checkpoint(w4a16)
    ref = ckpt.expert_refs(0, 1)["down"]["weight_packed"]
    first = ckpt.read(ref)
    clone = pickle.loads(pickle.dumps(ckpt))
    assert clone.fingerprint == ckpt.fingerprint and clone.moe == ckpt.moe and clone.quant == ckpt.quant
    assert torch.equal(clone.read(ref), first)
    ckpt.close()
    clone.close()


@pytest.mark.parametrize("group_size, actorder", [(64, True), (-1, False), (32, False)])
def test_quant_scheme_variants(tmp_path, group_size, actorder):
    path = make_checkpoint(tmp_path / "c", quant="w4a16", group_size=group_size, actorder=actorder, **TINY)
    ckpt = open_checkpoint(path)
    assert (ckpt.quant.kind, ckpt.quant.group_size, ckpt.quant.actorder) == ("w4a16", group_size, actorder)
    assert ckpt.quant.to_dict() == {"kind": "w4a16", "group_size": group_size, "actorder": actorder,
                                    "symmetric": True, "num_bits": 4, "weight_dtype": "int32",
                                    "scale_dtype": "bfloat16"}
    assert ("weight_g_idx" in ckpt.expert_refs(0, 0)["down"]) == actorder


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unquantized_dtypes(tmp_path, dtype):
    ckpt = open_checkpoint(make_checkpoint(tmp_path / "c", quant="bf16", dtype=dtype, **TINY))
    assert ckpt.quant.kind == "unquantized" and ckpt.quant.weight_dtype == dtype
    assert ckpt.quant.scale_dtype is None and ckpt.quant.to_dict()["weight_dtype"] == str(dtype)[6:]


def test_single_file_and_directory_without_index(bf16, tmp_path):
    (shard,) = bf16.glob("*.safetensors")
    one = open_checkpoint(shard)
    assert one.path == shard and one.shards == [shard] and one.moe.num_experts == 4
    assert one.config["model_type"] == "mixtral"
    no_index = copy_ckpt(bf16, tmp_path / "noindex")
    (no_index / INDEX).unlink()
    assert open_checkpoint(no_index).fingerprint == open_checkpoint(bf16).fingerprint


def test_index_decides_which_shards_are_read(bf16, tmp_path):
    c = copy_ckpt(bf16, tmp_path / "c")
    # a stray file not in the index (e.g. consolidated.safetensors) is ignored
    save_file({"model.layers.0.block_sparse_moe.experts.0.w1.weight": torch.zeros(2, 2)},
              str(c / "consolidated.safetensors"))
    assert open_checkpoint(c).fingerprint == open_checkpoint(bf16).fingerprint
    (c / INDEX).unlink()  # without the index, the duplicate is found
    with pytest.raises(CheckpointError, match="model.layers.0.block_sparse_moe.experts.0.w1.weight is in both"):
        open_checkpoint(c)


# ------------------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_stable_and_sees_headers_shards_and_weights(w4a16, tmp_path):
    fp = open_checkpoint(w4a16).fingerprint
    assert fp.startswith("sha256:") and len(fp) == 7 + 64
    assert open_checkpoint(w4a16).fingerprint == fp
    same = make_checkpoint(tmp_path / "same", quant="w4a16", shard_bytes=150_000, **TINY)
    assert open_checkpoint(same).fingerprint == fp  # same arguments -> same bytes -> same fingerprint
    other_seed = make_checkpoint(tmp_path / "seed", quant="w4a16", shard_bytes=150_000, seed=7, **TINY)
    assert open_checkpoint(other_seed).fingerprint != fp  # same headers, other weights

    # a header-visible change: one tensor's shape, same bytes
    c = copy_ckpt(w4a16, tmp_path / "hdr")
    shard = sorted(c.glob("*.safetensors"))[1]

    def transpose_first_2d(h):
        name = next(k for k, v in h.items() if k != "__metadata__" and len(v["shape"]) == 2
                    and v["shape"][0] != v["shape"][1])
        h[name]["shape"] = h[name]["shape"][::-1]

    rewrite_header(shard, transpose_first_2d)
    assert open_checkpoint(c).fingerprint != fp

    # a shard added
    c = copy_ckpt(w4a16, tmp_path / "added")
    (c / INDEX).unlink()
    assert open_checkpoint(c).fingerprint == fp
    save_file({"extra.weight": torch.zeros(4)}, str(c / "model-extra.safetensors"))
    assert open_checkpoint(c).fingerprint != fp

    # a data byte: inside a sampled window (the first data byte) it shows, between windows it does not
    for where, changes in (("first", True), ("middle", False)):
        c = copy_ckpt(w4a16, tmp_path / f"byte-{where}")
        shard = sorted(c.glob("*.safetensors"))[0]
        data = bytearray(shard.read_bytes())
        (n,) = struct.unpack("<Q", data[:8])
        start = 8 + n
        step = (len(data) - start - FINGERPRINT_WINDOW) // (FINGERPRINT_SAMPLES - 1)
        assert step > 2 * FINGERPRINT_WINDOW
        pos = start if where == "first" else start + FINGERPRINT_WINDOW + (step - FINGERPRINT_WINDOW) // 2
        data[pos] ^= 0xFF
        shard.write_bytes(bytes(data))
        assert (open_checkpoint(c).fingerprint != fp) == changes, where


# ------------------------------------------------------------------------------------------ errors


def expect(exc_type, match: str, path) -> MmapOffloadError:
    with pytest.raises(exc_type, match=match) as info:
        open_checkpoint(path)
    msg = str(info.value)
    assert "\n" not in msg and info.value.fix, msg  # one line, with a fix
    return info.value


def test_path_errors(tmp_path):
    expect(CheckpointError, "does not exist", tmp_path / "nope")
    (tmp_path / "weights.bin").write_bytes(b"x")
    expect(CheckpointError, "neither a directory nor a .safetensors file", tmp_path / "weights.bin")
    (tmp_path / "empty").mkdir()
    expect(CheckpointError, r"holds no \*.safetensors", tmp_path / "empty")


def test_index_errors(bf16, tmp_path):
    c = copy_ckpt(bf16, tmp_path / "c")
    (c / "model-00001-of-00001.safetensors").rename(c / "renamed.safetensors")
    expect(CheckpointError, "model-00001-of-00001.safetensors listed in model.safetensors.index.json is missing",
           c)
    (c / INDEX).write_text("{not json")
    expect(CheckpointError, "index.json is malformed", c)
    (c / INDEX).unlink()
    (c / "config.json").write_text("{bad")
    expect(CheckpointError, "config.json is not valid JSON", c)


@pytest.mark.parametrize("case, match", [
    ("short", "too short"),
    ("huge-length", "does not fit"),
    ("bad-json", "not valid JSON"),
    ("not-object", "not a JSON object"),
    ("offsets-out", "outside"),
    ("shape-mismatch", "does not match"),
    ("no-dtype", "lacks dtype"),
    ("bad-dtype", "unknown dtype"),
])
def test_malformed_headers(bf16, tmp_path, case, match):
    c = copy_ckpt(bf16, tmp_path / "c")
    shard = c / "model-00001-of-00001.safetensors"
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])

    def set_header(body: bytes) -> None:
        shard.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])

    def edit_first(fn):
        def edit(h):
            fn(h[next(k for k in h if k != "__metadata__")])
        rewrite_header(shard, edit)

    if case == "short":
        shard.write_bytes(b"\x01\x02\x03")
    elif case == "huge-length":
        shard.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    elif case == "bad-json":
        set_header(b"{\"a\": [1, 2" + b" " * 5)
    elif case == "not-object":
        set_header(b"[1, 2, 3]")
    elif case == "offsets-out":
        edit_first(lambda e: e.__setitem__("data_offsets", [0, len(raw) * 4]))
    elif case == "shape-mismatch":
        edit_first(lambda e: e.__setitem__("shape", [e["shape"][0] * 2] + e["shape"][1:]))
    elif case == "no-dtype":
        edit_first(lambda e: e.pop("dtype"))
    elif case == "bad-dtype":
        edit_first(lambda e: e.__setitem__("dtype", "Q7"))
    err = expect(CheckpointError, match, c)
    assert "model-00001-of-00001.safetensors" in str(err)


def test_truncated_after_open_is_a_checkpoint_error(bf16, tmp_path):
    c = copy_ckpt(bf16, tmp_path / "c")
    ckpt = open_checkpoint(c)
    shard = c / "model-00001-of-00001.safetensors"
    ref = ckpt.ref("lm_head.weight")
    assert ref.offset + ref.nbytes == shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(ref.offset + 10)
    with pytest.raises(CheckpointError, match="ended inside tensor lm_head.weight"):
        ckpt.read(ref)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(path.glob("*.safetensors"))))


def write_variant(src: Path, dst: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    dst.mkdir()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text()) if config is None else config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_layers_past_num_hidden_layers_are_not_routed_experts(bf16, tmp_path):
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["num_hidden_layers"] = 2  # like DeepSeek's MTP layer: in the shards, not in the model
    ckpt = open_checkpoint(write_variant(bf16, tmp_path / "mtp", tensors_of(bf16), cfg))
    assert ckpt.moe.layers == [0, 1]
    assert "model.layers.2.block_sparse_moe.experts.0.w1.weight" in ckpt.non_expert_names()
    # without num_nextn_predict_layers vLLM's main model does not drop layer 2: neither do we
    assert ckpt.mtp_names() == []
    cfg["num_nextn_predict_layers"] = 1
    ckpt = open_checkpoint(write_variant(bf16, tmp_path / "mtp1", tensors_of(bf16), cfg))
    assert ckpt.mtp_names() == sorted(n for n in ckpt.names() if n.startswith("model.layers.2."))
    assert len(ckpt.mtp_names()) > 0


def test_no_moe_experts(tmp_path):
    dense = {"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4),
             "model.layers.0.mlp.gate_proj.weight": torch.zeros(4, 4)}
    c = tmp_path / "dense"
    c.mkdir()
    save_file(dense, str(c / "model.safetensors"))
    expect(CheckpointError, "no MoE experts found", c)


def test_expert_structure_errors(bf16, tmp_path):
    base = tensors_of(bf16)
    p = "model.layers.1.block_sparse_moe.experts"

    t = dict(base)
    t[f"{p}.2.w2.weight"] = torch.zeros(128, 128, dtype=torch.bfloat16)
    expect(CheckpointError, rf"inconsistent shapes: {p}.2.w2.weight is bfloat16 \[128, 128\] but .* \[128, 256\]",
           write_variant(bf16, tmp_path / "shape", t))

    t = {k: v for k, v in base.items() if k != f"{p}.3.w3.weight"}
    expect(CheckpointError, rf"expert 3 of layer 1 \({p}.3\) has no up projection",
           write_variant(bf16, tmp_path / "proj", t))

    t = {k: v for k, v in base.items() if not k.startswith(f"{p}.1.")}
    expect(CheckpointError, "layer 1 has 3 experts .* missing expert 1", write_variant(bf16, tmp_path / "expert", t))

    t = dict(base)
    t[f"{p}.0.w9.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    expect(UnsupportedError, "projection 'w9'", write_variant(bf16, tmp_path / "w9", t))

    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["num_local_experts"] = 8
    expect(CheckpointError, "num_local_experts=8 but the shards hold 4",
           write_variant(bf16, tmp_path / "cfg", base, cfg))


def qcfg(src: Path, edit) -> dict:
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg["quantization_config"], cfg["quantization_config"]["config_groups"]["group_0"]["weights"])
    return cfg


@pytest.mark.parametrize("edit, match", [
    (lambda q, w: w.update(num_bits=8), "8-bit int"),
    (lambda q, w: w.update(symmetric=False), "asymmetric"),
    (lambda q, w: w.update(type="float"), "4-bit float"),
    (lambda q, w: q.update(format="float-quantized") or
     q["config_groups"]["group_0"].update(format="float-quantized"), "format float-quantized"),
    (lambda q, w: q.update(quant_method="gptq"), "quant_method 'gptq'"),
    (lambda q, w: q.update(quant_method="awq"), "quant_method 'awq'"),
    (lambda q, w: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8, "type": "int"}),
     "quantized activations"),
])
def test_unsupported_quantization(w4a16, tmp_path, edit, match):
    c = copy_ckpt(w4a16, tmp_path / "c")
    (c / "config.json").write_text(json.dumps(qcfg(w4a16, edit)))
    err = expect(UnsupportedError, match, c)
    assert "W4A16" in str(err)  # says what is supported


def test_unsupported_expert_tensors(bf16, w4a16, tmp_path):
    base = tensors_of(bf16)
    fp8 = {k: (v.to(torch.float8_e4m3fn) if ".experts." in k else v) for k, v in base.items()}
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    expect(UnsupportedError, r"stored as float8_e4m3fn \(quant_method 'fp8'\)",
           write_variant(bf16, tmp_path / "fp8", fp8, cfg))

    int8 = {k: (v.to(torch.int8) if ".experts." in k else v) for k, v in base.items()}
    expect(UnsupportedError, "stored as int8", write_variant(bf16, tmp_path / "int8", int8))

    q = copy_ckpt(w4a16, tmp_path / "zp")
    (q / INDEX).unlink()
    zp = {f"model.layers.{L}.block_sparse_moe.experts.{e}.{w}.weight_zero_point": torch.zeros(4, 4, dtype=torch.int32)
          for L in range(3) for e in range(4) for w in ("w1", "w2", "w3")}
    save_file(zp, str(q / "zp.safetensors"))
    expect(UnsupportedError, "experts are asymmetric", q)

    q = copy_ckpt(w4a16, tmp_path / "noconfig")
    (q / "config.json").unlink()
    expect(CheckpointError, "no quantization_config", q)

    q = copy_ckpt(w4a16, tmp_path / "actorder")
    (q / "config.json").write_text(json.dumps(qcfg(w4a16, lambda qc, w: w.update(actorder="group"))))
    expect(CheckpointError, "actorder 'group' but experts lack weight_g_idx", q)

    q = copy_ckpt(w4a16, tmp_path / "group")
    (q / "config.json").write_text(json.dumps(qcfg(w4a16, lambda qc, w: w.update(group_size=64))))
    expect(CheckpointError, r"weight_scale has shape \[256, 1\], expected \[256, 2\]", q)

    q = copy_ckpt(w4a16, tmp_path / "ignored")
    (q / "config.json").write_text(json.dumps(qcfg(w4a16, lambda qc, w: qc["ignore"].append("re:.*experts.*"))))
    expect(CheckpointError, "ignores model.layers.0.block_sparse_moe.experts.0.w1", q)


def test_errors_are_mmap_offload_errors_with_exit_code_2(tmp_path):
    with pytest.raises(MmapOffloadError) as info:
        open_checkpoint(tmp_path / "missing")
    assert info.value.exit_code == 2
