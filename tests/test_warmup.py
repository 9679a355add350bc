"""Warm-up end to end: synthetic checkpoint -> cache; bytes, TP shards, crashes, locks, CLI errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mmap_offload.cache_format import JOURNAL_NAME, MANIFEST_NAME, layout_specs
from mmap_offload.cache_reader import open_cache
from mmap_offload.cache_writer import RankWriter
from mmap_offload.checkpoint import open_checkpoint
from mmap_offload.errors import CacheError, StaleCacheError
from mmap_offload.layout import layout_for
from mmap_offload.synth import make_checkpoint
from mmap_offload.warmup import ensure_cache, plan_manifest, warmup

SMALL = dict(arch="mixtral", num_layers=2, num_experts=4, hidden=128, intermediate=512, top_k=2,
             vocab_size=256, num_heads=4, num_kv_heads=2)


def cli(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mmap_offload.cli", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def w4a16_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("w4a16") / "ckpt", quant="w4a16", group_size=128, **SMALL)


@pytest.fixture(scope="module")
def actorder_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("act") / "ckpt", quant="w4a16", group_size=64, actorder=True, **SMALL)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("bf16") / "ckpt", quant="bf16", **SMALL)


@pytest.fixture(scope="module")
def glm_ckpt(tmp_path_factory) -> Path:
    """GLM-4.5's layout (the user's model class): layer 0 dense, MoE layers 1 and 2, a shared expert."""
    return make_checkpoint(tmp_path_factory.mktemp("glm") / "ckpt", quant="w4a16", group_size=128,
                           **{**SMALL, "arch": "glm4_moe", "num_layers": 3})


@pytest.mark.parametrize("flavour", ["w4a16", "bf16", "w4a16-actorder", "glm-w4a16"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cache_bytes_equal_the_layout_of_the_checkpoint(flavour, tp, w4a16_ckpt, bf16_ckpt, actorder_ckpt, glm_ckpt,
                                                        tmp_path):
    path = {"w4a16": w4a16_ckpt, "bf16": bf16_ckpt, "w4a16-actorder": actorder_ckpt, "glm-w4a16": glm_ckpt}[flavour]
    warmup(path, tmp_path, tp_size=tp, device="cpu")
    ckpt = open_checkpoint(path)
    layout = layout_for(ckpt.quant)
    for r in range(tp):
        cache = open_cache(tmp_path, r, tp)
        assert cache.verify().ok
        assert cache.layers == ([1, 2] if flavour.startswith("glm") else [0, 1])  # the checkpoint's own indices
        for layer in ckpt.moe.layers:
            for e in range(ckpt.moe.num_experts):
                want = layout.transform_expert(ckpt.read_expert(layer, e), ckpt.quant, r, tp, torch.device("cpu"))
                assert [s.name for s in cache.expert_specs] == list(want)
                for name, t in want.items():
                    got = cache.tensor(layer, e, name)
                    assert got.dtype == t.dtype and torch.equal(got, t), (layer, e, name, r)


@pytest.mark.parametrize("tp", [2, 4])
def test_unquantized_rank_shards_concatenate_to_the_whole(tp, bf16_ckpt, tmp_path):
    warmup(bf16_ckpt, tmp_path, tp_size=tp, device="cpu")
    ckpt = open_checkpoint(bf16_ckpt)
    caches = [open_cache(tmp_path, r, tp) for r in range(tp)]
    I = ckpt.moe.intermediate
    Ir = I // tp
    for layer in ckpt.moe.layers:
        for e in range(ckpt.moe.num_experts):
            src = ckpt.read_expert(layer, e)
            w13 = [c.tensor(layer, e, "w13_weight") for c in caches]
            assert torch.equal(torch.cat([w[:Ir] for w in w13]), src["gate"]["weight"])
            assert torch.equal(torch.cat([w[Ir:] for w in w13]), src["up"]["weight"])
            assert torch.equal(torch.cat([c.tensor(layer, e, "w2_weight") for c in caches], dim=1), src["down"]["weight"])


def test_second_warmup_is_a_no_op_and_stale_cache_is_rebuilt(w4a16_ckpt, tmp_path):
    first = warmup(w4a16_ckpt, tmp_path)
    assert first.layers_written == 2
    again = warmup(w4a16_ckpt, tmp_path)
    assert again.layers_written == 0 and again.layers_reused == 2
    # a cache made for TP 1 is refused for TP 2 ...
    with pytest.raises(CacheError):
        open_cache(tmp_path, 0, 2)
    # ... and ensure_cache builds the missing one instead
    cache = ensure_cache(w4a16_ckpt, tmp_path, tp_rank=1, tp_size=2, device="cpu")
    assert cache.identity.tp_size == 2 and cache.verify().ok


def test_cache_of_another_checkpoint_is_refused(w4a16_ckpt, tmp_path):
    other = make_checkpoint(tmp_path / "other", quant="w4a16", seed=7, **SMALL)
    warmup(other, tmp_path / "cache", device="cpu")
    ckpt = open_checkpoint(w4a16_ckpt)
    from mmap_offload.warmup import cache_identity

    expect = cache_identity(ckpt, layout_for(ckpt.quant), 0, 1)
    with pytest.raises(StaleCacheError, match="checkpoint"):
        open_cache(tmp_path / "cache", expect=expect)


def _layer_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("layer-*.bin"))}


@pytest.mark.parametrize(
    "fault", ["expert-written:3", "layer-renamed:1", "layer-journaled:1", "manifest-written:1", "manifest-renamed:1"]
)
def test_sigkill_at_any_point_then_rerun_gives_the_uninterrupted_result(fault, w4a16_ckpt, tmp_path):
    ref = tmp_path / "ref"
    warmup(w4a16_ckpt, ref, device="cpu")
    cache_dir = tmp_path / "cache"
    proc = cli("warmup", w4a16_ckpt, "--cache-dir", cache_dir, "--device", "cpu", "--quiet",
               env={"MMAP_OFFLOAD_FAULT": fault})
    assert proc.returncode == -9, proc.stderr
    rank = cache_dir / "rank-0-of-1"
    if fault == "manifest-renamed:1":
        assert open_cache(cache_dir).verify().ok  # published before the kill: complete and valid
    else:
        with pytest.raises(CacheError):
            open_cache(cache_dir)  # never opened as valid
    proc = cli("warmup", w4a16_ckpt, "--cache-dir", cache_dir, "--device", "cpu", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert open_cache(cache_dir).verify().ok
    assert _layer_bytes(rank) == _layer_bytes(ref / "rank-0-of-1")
    got = json.loads((rank / MANIFEST_NAME).read_bytes())
    want = json.loads((ref / "rank-0-of-1" / MANIFEST_NAME).read_bytes())
    assert got["tensors"] == want["tensors"]
    assert not (rank / JOURNAL_NAME).exists() and not list(rank.glob("*.partial"))


def test_concurrent_warmup_fails_clearly_or_waits(w4a16_ckpt, tmp_path):
    ckpt = open_checkpoint(w4a16_ckpt)
    plan = plan_manifest(ckpt, layout_for(ckpt.quant), 0, 1)
    rank = tmp_path / "rank-0-of-1"
    with RankWriter(rank, plan):
        proc = cli("warmup", w4a16_ckpt, "--cache-dir", tmp_path, "--quiet")
        assert proc.returncode == 2
        assert "another warm-up" in proc.stderr and f"pid {os.getpid()}" in proc.stderr
        assert "Traceback" not in proc.stderr
        waiting = subprocess.Popen(
            [sys.executable, "-m", "mmap_offload.cli", "warmup", str(w4a16_ckpt), "--cache-dir", str(tmp_path),
             "--quiet", "--wait", "--device", "cpu"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        time.sleep(1.5)
        assert waiting.poll() is None  # blocked on the lock
    out, err = waiting.communicate(timeout=120)
    assert waiting.returncode == 0, err
    assert open_cache(tmp_path).verify().ok


def _one_error_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for n in needles:
        assert n.lower() in lines[0].lower(), lines[0]


def test_bad_input_is_one_line_and_exit_2(w4a16_ckpt, tmp_path):
    _one_error_line(cli("warmup", tmp_path / "nope", "--cache-dir", tmp_path / "c"), "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_error_line(cli("warmup", empty, "--cache-dir", tmp_path / "c"), "safetensors")

    # a dense checkpoint: no MoE experts
    from safetensors.torch import save_file

    dense = tmp_path / "dense"
    dense.mkdir()
    save_file({"model.layers.0.mlp.down_proj.weight": torch.zeros(4, 4)}, str(dense / "model.safetensors"))
    (dense / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    _one_error_line(cli("warmup", dense, "--cache-dir", tmp_path / "c"), "expert")

    # an unsupported quantization (8-bit)
    eight = tmp_path / "eight"
    eight.mkdir()
    for p in w4a16_ckpt.iterdir():
        (eight / p.name).symlink_to(p)
    cfg = json.loads((w4a16_ckpt / "config.json").read_text())
    for g in cfg["quantization_config"]["config_groups"].values():
        g["weights"]["num_bits"] = 8
    (eight / "config.json").unlink()
    (eight / "config.json").write_text(json.dumps(cfg))
    _one_error_line(cli("warmup", eight, "--cache-dir", tmp_path / "c"), "8")

    # an unwritable cache dir
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    _one_error_line(cli("warmup", w4a16_ckpt, "--cache-dir", blocker / "cache"), "blocker")
    assert not list(tmp_path.glob("c/**/*.bin"))


def test_verify_and_info_cli(w4a16_ckpt, tmp_path):
    proc = cli("warmup", w4a16_ckpt, "--cache-dir", tmp_path, "--tp-size", "2", "--quiet", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    proc = cli("verify", tmp_path)
    assert proc.returncode == 0 and proc.stdout.count(": OK") == 2, proc.stdout
    info = cli("info", tmp_path)
    assert info.returncode == 0 and "marlin-w4a16" in info.stdout and "rank 1 of 2" in info.stdout
    cache = open_cache(tmp_path, 1, 2)
    path, spec = cache.layer_file(cache.layers[-1]), cache.expert_specs[0]
    data = bytearray(path.read_bytes())
    data[cache.record_nbytes * 3 + spec.offset + 17] ^= 0x01
    path.write_bytes(bytes(data))
    proc = cli("verify", tmp_path)
    assert proc.returncode == 1
    assert f"layer {cache.layers[-1]} expert 3 {spec.name}" in proc.stdout
    proc = cli("verify", tmp_path / "missing")
    _one_error_line(proc, "missing")


@pytest.mark.slow
def test_peak_rss_is_bounded_by_the_largest_layer_not_the_checkpoint(tmp_path):
    # 3 GiB of W4A16 experts in ~64 MiB layers: the bound is 2 x 64 MiB + 1 GiB.
    ckpt = make_checkpoint(
        tmp_path / "big", arch="mixtral", quant="w4a16", num_layers=48, num_experts=8, hidden=2048,
        intermediate=2816, top_k=2, vocab_size=256, num_heads=4, num_kv_heads=2, group_size=128,
    )
    c = open_checkpoint(ckpt)
    layout = layout_for(c.quant)
    _, record = layout_specs(layout.expert_tensor_specs(c.moe, c.quant, 0, 1))
    layer_bytes = record * c.moe.num_experts
    expert_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    assert expert_bytes > 3 * 2**30
    bound = 2 * layer_bytes + 2**30
    assert expert_bytes > 2.5 * bound
    script = textwrap.dedent(f"""
        import resource, sys
        from mmap_offload.warmup import warmup
        warmup({str(ckpt)!r}, {str(tmp_path / 'cache')!r}, device="cpu", fsync=False)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stdout.strip().splitlines()[-1])
    print(f"warm-up peak RSS {peak / 2**20:.0f} MiB for {expert_bytes / 2**30:.2f} GiB of checkpoint; bound {bound / 2**20:.0f} MiB")
    assert peak <= bound


def test_synth_cli_presets_and_unknown_preset(tmp_path):
    proc = cli("synth", tmp_path / "ck", "--preset", "tiny-mixtral")
    assert proc.returncode == 0 and "wrote checkpoint" in proc.stdout, proc.stderr
    assert open_checkpoint(tmp_path / "ck").moe.num_experts == 4
    _one_error_line(cli("synth", tmp_path / "x", "--preset", "nope"), "unknown preset", "tiny-mixtral")
