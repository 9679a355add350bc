"""Issue 13: repair, first-use checks by default, the resume hint, stale sources, and the small CLI faults.

Every user-facing fault here ends in one line naming cause and fix (no traceback), and every fix that
names a command is run as printed and must work.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from mmap_offload.cache_format import MANIFEST_NAME, Manifest, checksum
from mmap_offload.cache_reader import open_cache
from mmap_offload.checkpoint import open_checkpoint
from mmap_offload.errors import CheckpointError, CorruptCacheError, StaleCacheError
from mmap_offload.expert_cache import ExpertCache
from mmap_offload.prefetch import LayerPrefetcher
from mmap_offload.synth import make_checkpoint
from mmap_offload.warmup import ensure_cache, warmup

from fakes import SyncEngine, flip_byte, layer_matches, make_cache

SMALL = dict(arch="mixtral", num_layers=3, num_experts=4, hidden=128, intermediate=512, top_k=2,
             vocab_size=256, num_heads=4, num_kv_heads=2)


def cli(*args, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmap_offload.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})}, cwd=cwd)


def one_line(proc: subprocess.CompletedProcess, code: int = 2) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def run_advised(text: str, cwd=None) -> subprocess.CompletedProcess:
    """Run the `mmap-offload ...` command a message advises, exactly as printed."""
    m = re.search(r"`(mmap-offload [^`]+)`", text)
    assert m, f"no command in: {text}"
    argv = shlex.split(m.group(1))
    assert "CHECKPOINT" not in argv, f"the advised command has a placeholder: {m.group(1)}"
    return cli(*argv[1:], "--quiet", "--device", "cpu", cwd=cwd)


def inodes(d: Path) -> dict[str, int]:
    return {p.name: (p.stat().st_ino, p.stat().st_ctime_ns) for p in sorted(d.glob("layer-*.bin"))}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("w4a16") / "ckpt", quant="w4a16", group_size=128, **SMALL)


# -- item 3: checks on first use by default ------------------------------------------------------

def test_prefetcher_and_expert_cache_refuse_a_flipped_bit_by_default_and_can_opt_out(tmp_path):
    cache = make_cache(tmp_path, layers=(0, 1), num_experts=4)
    flip_byte(cache.layer_file(1), 3 * cache.record_nbytes + cache.expert_specs[1].offset + 5)
    pf = LayerPrefetcher(cache, SyncEngine(), "cpu", lookahead=0)
    assert layer_matches(cache, 0, pf.wait_for_layer(0))
    with pytest.raises(CorruptCacheError, match="layer 1 expert 3") as e:
        pf.wait_for_layer(1)
    assert "--repair" in str(e.value)
    ec = ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=4, shared=True)
    with pytest.raises(CorruptCacheError, match="layer 1 expert 3"):
        ec.ensure(1, [0, 3])
    LayerPrefetcher(cache, SyncEngine(), "cpu", lookahead=0, verify_first_use=False).wait_for_layer(1)
    ExpertCache(cache, SyncEngine(), "cpu", capacity_experts=4, shared=True,
                verify_first_use=False).ensure(1, [0, 3])


# -- item 2: repair -------------------------------------------------------------------------------

def test_verify_names_a_repair_command_that_rewrites_exactly_the_bad_layer(ckpt, tmp_path):
    cache_dir = tmp_path / "c"
    assert cli("warmup", ckpt, "--cache-dir", cache_dir, "--tp-size", "2", "--quiet", "--device", "cpu").returncode == 0
    cache = open_cache(cache_dir, 1, 2)
    bad_layer = cache.layers[1]
    flip_byte(cache.layer_file(bad_layer), 2 * cache.record_nbytes + cache.expert_specs[0].offset + 17)
    before = {r: inodes(cache_dir / f"rank-{r}-of-2") for r in (0, 1)}

    plain = cli("warmup", ckpt, "--cache-dir", cache_dir, "--tp-size", "2", "--quiet", "--device", "cpu")
    assert plain.returncode == 0 and "--repair" in plain.stdout  # says it did not re-read the checksums

    proc = cli("verify", cache_dir)
    assert proc.returncode == 1 and f"layer {bad_layer} expert 2" in proc.stdout
    fixed = run_advised(proc.stdout.splitlines()[-1])
    assert fixed.returncode == 0, fixed.stderr
    assert "1 bad layer(s) found, rewritten" in fixed.stdout and "wrote 1 layer(s)" in fixed.stdout
    after = {r: inodes(cache_dir / f"rank-{r}-of-2") for r in (0, 1)}
    assert after[0] == before[0]
    changed = {n for n in after[1] if after[1][n] != before[1][n]}
    assert changed == {cache.layer_file(bad_layer).name}
    assert cli("verify", cache_dir).returncode == 0
    again = cli("warmup", ckpt, "--cache-dir", cache_dir, "--tp-size", "2", "--repair", "--quiet", "--device", "cpu")
    assert "0 bad layer(s) found" in again.stdout and "cache up to date" in again.stdout


def test_first_use_refusal_and_a_truncated_layer_name_working_commands(ckpt, tmp_path):
    cache_dir = tmp_path / "c"
    warmup(ckpt, cache_dir, device="cpu")
    cache = open_cache(cache_dir)
    flip_byte(cache.layer_file(cache.layers[0]), 100)
    with pytest.raises(CorruptCacheError) as e:
        cache.check_layer_once(cache.layers[0])
    assert run_advised(str(e.value)).returncode == 0
    assert open_cache(cache_dir).verify().ok

    keep = inodes(cache.dir)
    victim = cache.layer_file(cache.layers[2])
    os.truncate(victim, victim.stat().st_size // 2)
    msg = one_line(cli("verify", cache_dir), code=1)
    assert "truncated" in msg
    assert run_advised(msg).returncode == 0
    now = inodes(cache.dir)
    assert {n for n in now if now[n] != keep[n]} == {victim.name}  # only that layer was rewritten
    assert open_cache(cache_dir).verify().ok


def test_old_format_and_corrupt_manifest_name_working_commands(ckpt, tmp_path):
    cache_dir = tmp_path / "c"
    warmup(ckpt, cache_dir, device="cpu")
    mpath = cache_dir / "rank-0-of-1" / MANIFEST_NAME
    obj = json.loads(mpath.read_bytes())
    obj["format_version"] = 1
    obj.pop("manifest_checksum")
    from mmap_offload.cache_format import _canonical

    obj["manifest_checksum"] = checksum(_canonical(obj))
    mpath.write_text(json.dumps(obj))
    msg = one_line(cli("info", cache_dir))
    assert "format version 1" in msg and f"--cache-dir {cache_dir}" in msg
    assert run_advised(msg).returncode == 0 and open_cache(cache_dir).verify().ok
    mpath.write_text("{ not json")
    msg = one_line(cli("info", cache_dir), code=1)
    assert "mmap-offload warmup" in msg
    m = re.search(r"`(mmap-offload [^`]+)`", msg)
    argv = [str(ckpt) if a == "CHECKPOINT" else a for a in shlex.split(m.group(1))]  # unknown: the user's
    assert cli(*argv[1:], "--quiet", "--device", "cpu").returncode == 0
    assert open_cache(cache_dir).verify().ok


# -- item 4: the resume hint ----------------------------------------------------------------------

def test_resume_hint_names_the_cache_dir_not_the_rank_dir(ckpt, tmp_path):
    cache_dir = tmp_path / "c"
    proc = cli("warmup", ckpt, "--cache-dir", cache_dir, "--quiet", "--device", "cpu",
               env={"MMAP_OFFLOAD_FAULT": "layer-journaled:1"})
    assert proc.returncode == -9
    for cmd in ("verify", "info"):
        msg = one_line(cli(cmd, cache_dir))
        assert "interrupted" in msg and f"--cache-dir {cache_dir}`" in msg and "rank-0-of-1`" not in msg
    resumed = run_advised(msg)
    assert resumed.returncode == 0 and "reused 1" in resumed.stdout, resumed.stdout
    assert sorted(p.name for p in cache_dir.iterdir()) == ["rank-0-of-1"]
    assert not list((cache_dir / "rank-0-of-1").glob("rank-*"))  # nothing nested
    assert open_cache(cache_dir).verify().ok
    # given the rank directory itself (as `verify` prints it), warm-up works on its parent
    again = cli("warmup", ckpt, "--cache-dir", cache_dir / "rank-0-of-1", "--quiet", "--device", "cpu")
    assert again.returncode == 0 and "cache up to date" in again.stdout
    assert not list((cache_dir / "rank-0-of-1").glob("rank-*"))


# -- item 5: stale sources ------------------------------------------------------------------------

def _copy_ckpt(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _unsampled_byte_of(ck, layer: int) -> tuple[Path, int]:
    """An offset inside an expert tensor of ``layer`` that the fingerprint's sample windows miss."""
    from mmap_offload.checkpoint import _data_sample  # noqa: F401  (windows: see FINGERPRINT_*)

    ref = ck.expert_refs(layer, 1)["down"]["weight_packed"]
    fp_before = ck.fingerprint
    for off in range(ref.offset + 7, ref.offset + ref.nbytes, 997):
        flip_byte(ref.path, off)
        same = open_checkpoint(ck.path).fingerprint == fp_before
        flip_byte(ref.path, off)
        if same:
            return ref.path, off
    raise AssertionError("every tried byte is sampled")


def test_a_changed_byte_outside_the_fingerprint_samples_is_stale_and_only_its_layer_is_rewritten(ckpt, tmp_path):
    ck_dir = _copy_ckpt(ckpt, tmp_path / "ck")
    cache_dir = tmp_path / "c"
    warmup(ck_dir, cache_dir, device="cpu")
    ck = open_checkpoint(ck_dir)
    layer = ck.moe.layers[1]
    path, off = _unsampled_byte_of(ck, layer)
    st = path.stat()
    flip_byte(path, off)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    ck2 = open_checkpoint(ck_dir)
    assert ck2.fingerprint == ck.fingerprint  # the sampled fingerprint does not see it
    with pytest.raises(StaleCacheError, match="changed since the warm-up") as e:
        ensure_cache(ck2, cache_dir, rebuild=False)
    assert "1 layer(s)" in str(e.value)
    keep = inodes(cache_dir / "rank-0-of-1")
    fixed = run_advised(str(e.value))
    assert fixed.returncode == 0 and "1 layer(s) stale" in fixed.stdout and "wrote 1 layer(s)" in fixed.stdout
    now = inodes(cache_dir / "rank-0-of-1")
    assert {n for n in now if now[n] != keep[n]} == {f"layer-{layer:05d}.bin"}
    # the bytes equal a fresh build from the changed checkpoint
    warmup(ck_dir, tmp_path / "fresh", device="cpu")
    a, b = open_cache(cache_dir), open_cache(tmp_path / "fresh")
    for l in a.layers:
        assert a.layer_file(l).read_bytes() == b.layer_file(l).read_bytes()
    assert ensure_cache(open_checkpoint(ck_dir), cache_dir, rebuild=False).verify().ok


def test_a_touched_shard_with_the_same_content_is_not_stale(ckpt, tmp_path):
    ck_dir = _copy_ckpt(ckpt, tmp_path / "ck")
    cache_dir = tmp_path / "c"
    warmup(ck_dir, cache_dir, device="cpu")
    keep = inodes(cache_dir / "rank-0-of-1")
    for p in ck_dir.glob("*.safetensors"):
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    ensure_cache(open_checkpoint(ck_dir), cache_dir, rebuild=False)  # re-hashed, same: served
    report = warmup(ck_dir, cache_dir, device="cpu")
    assert report.layers_written == 0 and report.republished == 1 and report.recheck_bytes > 0
    assert inodes(cache_dir / "rank-0-of-1") == keep
    report = warmup(ck_dir, cache_dir, device="cpu")  # recorded now: nothing re-hashed
    assert report.recheck_bytes == 0 and report.republished == 0
    m = Manifest.loads((cache_dir / "rank-0-of-1" / MANIFEST_NAME).read_bytes())
    shard = m.shards[0]
    assert shard["size"] == (ck_dir / shard["name"]).stat().st_size and len(shard["hash"]) == 32


def test_a_shard_changed_between_an_interrupted_warmup_and_its_resume_is_not_trusted(ckpt, tmp_path):
    ck_dir = _copy_ckpt(ckpt, tmp_path / "ck")
    cache_dir = tmp_path / "c"
    proc = cli("warmup", ck_dir, "--cache-dir", cache_dir, "--quiet", "--device", "cpu",
               env={"MMAP_OFFLOAD_FAULT": "layer-journaled:1"})
    assert proc.returncode == -9
    ck = open_checkpoint(ck_dir)
    path, off = _unsampled_byte_of(ck, ck.moe.layers[0])
    st = path.stat()
    flip_byte(path, off)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    report = warmup(ck_dir, cache_dir, device="cpu")
    assert report.layers_reused == 0 and report.layers_written == len(ck.moe.layers)
    warmup(ck_dir, tmp_path / "fresh", device="cpu")
    a, b = open_cache(cache_dir), open_cache(tmp_path / "fresh")
    assert all(a.layer_file(l).read_bytes() == b.layer_file(l).read_bytes() for l in a.layers)


def test_recheck_cost_is_reported(ckpt, tmp_path, capsys):
    """What a re-check costs: re-reading the expert bytes of each changed shard (printed for the docs)."""
    ck_dir = _copy_ckpt(ckpt, tmp_path / "ck")
    warmup(ck_dir, tmp_path / "c", device="cpu")
    for p in ck_dir.glob("*.safetensors"):
        os.utime(p)
    report = warmup(ck_dir, tmp_path / "c", device="cpu")
    ck = open_checkpoint(ck_dir)
    assert report.recheck_bytes == ck.moe.expert_nbytes * ck.moe.num_experts * len(ck.moe.layers)
    with capsys.disabled():
        print(f"\nre-check: {report.recheck_bytes / 2**20:.1f} MiB in {report.recheck_seconds * 1e3:.0f} ms")


# -- item 6: small ones ---------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA")
def test_device_cuda_without_cuda_and_device_tpu_are_one_line(ckpt, tmp_path):
    assert "--device cuda" in one_line(cli("warmup", ckpt, "--cache-dir", tmp_path / "c", "--device", "cuda"))
    assert "tpu" in one_line(cli("warmup", ckpt, "--cache-dir", tmp_path / "c", "--device", "tpu"))
    assert "cuda:7" in one_line(cli("warmup", ckpt, "--cache-dir", tmp_path / "c", "--device", "cuda:7"))
    assert not list(tmp_path.glob("c/**/*.bin"))


def test_device_tpu_is_one_line_everywhere(ckpt, tmp_path):
    assert "tpu" in one_line(cli("warmup", ckpt, "--cache-dir", tmp_path / "c", "--device", "tpu"))
    assert "nonsense" in one_line(cli("warmup", ckpt, "--cache-dir", tmp_path / "c", "--device", "nonsense"))


def test_info_into_a_closed_pipe_is_quiet(ckpt, tmp_path):
    warmup(ckpt, tmp_path / "c", tp_size=2, device="cpu")
    r, w = os.pipe()
    os.close(r)  # the reader is gone before anything is written (`info | head` after head exits)
    proc = subprocess.run([sys.executable, "-m", "mmap_offload.cli", "info", str(tmp_path / "c")], stdout=w,
                          stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(w)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    shell = subprocess.run(f"{shlex.quote(sys.executable)} -m mmap_offload.cli info --json {tmp_path / 'c'} | head -1",
                           shell=True, capture_output=True, text=True, timeout=120)
    assert shell.stdout.strip() == "{" and shell.stderr == "", shell.stderr


def test_config_disagreeing_with_the_tensors_is_refused(ckpt, tmp_path):
    for key, value in (("hidden_size", 256), ("intermediate_size", 1024), ("num_experts_per_tok", 9)):
        bad = _copy_ckpt(ckpt, tmp_path / f"bad-{key}")
        cfg = json.loads((bad / "config.json").read_text())
        cfg[key] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(CheckpointError, match=key if key != "num_experts_per_tok" else "routes each token"):
            open_checkpoint(bad)
        msg = one_line(cli("warmup", bad, "--cache-dir", tmp_path / "c", "--device", "cpu"))
        assert "config.json" in msg
    assert not list(tmp_path.glob("c/**/*.bin"))


def test_no_config_json_gives_no_top_0(ckpt, tmp_path):
    bare = _copy_ckpt(ckpt, tmp_path / "bare")
    (bare / "config.json").unlink()
    for p in bare.glob("*.json"):
        p.unlink()
    bf16 = make_checkpoint(tmp_path / "bf16", quant="bf16", **SMALL)
    (bf16 / "config.json").unlink()
    warmup(bf16, tmp_path / "c", device="cpu")
    info = cli("info", tmp_path / "c")
    assert info.returncode == 0 and "top-0" not in info.stdout and "top-k unknown" in info.stdout


def test_ensure_cache_rebuilds_a_stale_layer_reading_the_changed_shard_once(ckpt, tmp_path, monkeypatch):
    ck_dir = _copy_ckpt(ckpt, tmp_path / "ck")
    cache_dir = tmp_path / "c"
    warmup(ck_dir, cache_dir, device="cpu")
    ck = open_checkpoint(ck_dir)
    path, off = _unsampled_byte_of(ck, ck.moe.layers[2])
    st = path.stat()
    flip_byte(path, off)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    import mmap_offload.warmup as w

    calls = []
    real = w.SourceCheck.partials
    def counting(self, shard):
        if shard not in self._partials:  # a real re-read, not a memoised answer
            calls.append(shard)
        return real(self, shard)

    monkeypatch.setattr(w.SourceCheck, "partials", counting)
    cache = ensure_cache(open_checkpoint(ck_dir), cache_dir, device="cpu")  # rebuild=True: rewritten
    assert len(calls) == 1 and cache.verify().ok
    warmup(ck_dir, tmp_path / "fresh", device="cpu")
    fresh = open_cache(tmp_path / "fresh")
    assert all(cache.layer_file(l).read_bytes() == fresh.layer_file(l).read_bytes() for l in cache.layers)


def test_no_cache_hint_names_the_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    msg = one_line(cli("verify", tmp_path / "empty"))
    assert f"--cache-dir {tmp_path / 'empty'}`" in msg


def test_a_host_kernel_read_fault_names_the_file_and_a_repair_that_works(ckpt, tmp_path):
    """Hybrid's host kernel reads experts from the cache's mapping; a layer file truncated under it fails the
    call (HostReadFault, the process lives), ``Cache.fault_error`` turns the address into one line naming
    the file, offset, layer, expert and tensor, and the command it advises rewrites the layer as printed.
    An address outside the cache's mappings still gets a line with a working command."""
    from mmap_offload.host.kernel import HostKernel, HostReadFault

    cache_dir = tmp_path / "c"
    warmup(ckpt, cache_dir, device="cpu")
    cache = open_cache(cache_dir)
    layer, names = cache.layers[1], ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")
    group = cache.manifest.identity.quantization["group_size"]
    x = torch.randn(2, SMALL["hidden"], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    k = HostKernel(threads=2, isa="plain")
    try:
        job = (torch.arange(2), *(cache.tensor(layer, 3, n) for n in names), group, None)
        k.experts_mlp(x, [job], torch.zeros_like(x))  # reads fine while the file is whole
        os.truncate(cache.layer_file(layer), 0)
        with pytest.raises(HostReadFault) as err:
            k.experts_mlp(x, [job], torch.zeros_like(x))
    finally:
        k.close()
    msg = str(cache.fault_error(err.value.address))
    assert "\n" not in msg and str(cache.layer_file(layer)) in msg and f"(layer {layer} expert 3 " in msg, msg
    assert "SIGBUS" in msg and "--repair" in msg
    other = str(cache.fault_error(8))  # not in any of its mappings
    assert "SIGBUS" in other and "--repair" in other
    assert run_advised(msg).returncode == 0
    assert open_cache(cache_dir).verify().ok
