"""The cache format on its own: writer -> files -> reader, with hand-made records (no checkpoint)."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch

from mmap_offload.cache_format import (
    ALIGNMENT,
    JOURNAL_NAME,
    MANIFEST_NAME,
    CacheIdentity,
    Manifest,
    layer_file_name,
    layout_specs,
)
from mmap_offload.cache_reader import open_cache
from mmap_offload.cache_writer import RankWriter
from mmap_offload.errors import CacheError, CacheLockedError, CorruptCacheError, StaleCacheError, StorageError

from fakes import flip_byte

E = 3
LAYERS = [0, 2, 5]
SPECS = [("w13", "bfloat16", (8, 96)), ("w2", "int32", (5, 7)), ("scale", "float16", (3,))]


def identity(**kw) -> CacheIdentity:
    base = dict(
        fingerprint="sha256:abc",
        quantization={"kind": "w4a16", "group_size": 128, "actorder": False, "symmetric": True, "num_bits": 4},
        layout_name="test-layout",
        layout_version=1,
        tp_rank=0,
        tp_size=1,
    )
    base.update(kw)
    return CacheIdentity(**base)


def plan(ident=None) -> Manifest:
    specs, nbytes = layout_specs(SPECS)
    return Manifest(
        checkpoint_path="/nowhere",
        identity=ident or identity(),
        moe={"num_experts": E, "hidden": 8, "intermediate": 48, "top_k": 2, "layers": LAYERS},
        record_nbytes=nbytes,
        record=specs,
        layers=[{"layer": l, "file": layer_file_name(l), "nbytes": E * nbytes} for l in LAYERS],
    )


def tensors_for(layer: int, expert: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(layer * 100 + expert)
    return {
        "w13": torch.randn(8, 96, generator=g).to(torch.bfloat16),
        "w2": torch.randint(-(2**31), 2**31 - 1, (5, 7), generator=g, dtype=torch.int32),
        "scale": torch.rand(3, generator=g).to(torch.float16),
    }


def write(d, layers=LAYERS, publish=True, ident=None):
    with RankWriter(d, plan(ident), fsync=False) as w:
        for l in layers:
            if l in w.done_layers:
                continue
            lw = w.begin_layer(l)
            for e in range(E):
                lw.write_expert(e, tensors_for(l, e))
            lw.commit()
        if publish:
            w.publish()
    return w


def test_round_trip_bytes_alignment_and_views(tmp_path):
    write(tmp_path)
    cache = open_cache(tmp_path)
    assert cache.layers == LAYERS and cache.num_experts == E
    assert cache.record_nbytes % ALIGNMENT == 0
    assert all(s.offset % ALIGNMENT == 0 for s in cache.expert_specs)
    for l in LAYERS:
        assert cache.layer_file(l).stat().st_size == E * cache.record_nbytes
        raw = cache.layer_file(l).read_bytes()
        for e in range(E):
            ext = cache.expert_extent(l, e)
            assert ext.offset == e * cache.record_nbytes and ext.offset % ALIGNMENT == 0
            for name, t in tensors_for(l, e).items():
                got = cache.tensor(l, e, name)
                assert got.dtype == t.dtype and torch.equal(got, t)
                spec = cache.spec(name)
                start = ext.offset + spec.offset
                assert raw[start : start + spec.nbytes] == t.view(-1).view(torch.uint8).numpy().tobytes()
            # padding between tensors is zero
            buf = cache.expert_buffer(l, e)
            s0 = cache.expert_specs[0]
            assert not buf[s0.offset + s0.nbytes : cache.expert_specs[1].offset].any()
    assert cache.verify().ok
    assert not (tmp_path / JOURNAL_NAME).exists()


def test_views_are_zero_copy(tmp_path):
    write(tmp_path)
    cache = open_cache(tmp_path)
    a = cache.tensor(LAYERS[0], 1, "w13")
    b = cache.tensor(LAYERS[0], 1, "w13")
    assert a.data_ptr() == b.data_ptr()  # both views of the same mapping, nothing copied
    base = cache.expert_buffer(LAYERS[0], 0).ctypes.data
    assert a.data_ptr() == base + cache.record_nbytes + cache.spec("w13").offset


def test_manifest_table_lists_every_tensor(tmp_path):
    write(tmp_path)
    obj = json.loads((tmp_path / MANIFEST_NAME).read_bytes())
    assert obj["format"] == "mmap-offload-cache" and obj["format_version"] == 2
    assert len(obj["tensors"]) == len(LAYERS) * E * len(SPECS)
    row = dict(zip(obj["tensor_columns"], obj["tensors"][len(SPECS) + 1]))
    assert (row["layer"], row["expert"], row["name"]) == (0, 1, "w2")
    assert row["offset"] % ALIGNMENT == 0 and row["file"] == "layer-00000.bin"


def test_interrupted_write_is_not_a_cache_and_resumes(tmp_path):
    write(tmp_path, layers=LAYERS[:2], publish=False)
    with pytest.raises(CacheError, match="incomplete"):
        open_cache(tmp_path)
    with RankWriter(tmp_path, plan(), fsync=False) as w:
        assert set(w.done_layers) == set(LAYERS[:2])
    write(tmp_path)
    assert open_cache(tmp_path).verify().ok


def test_torn_journal_line_and_partial_files_are_dropped(tmp_path):
    write(tmp_path, layers=LAYERS[:2], publish=False)
    with open(tmp_path / JOURNAL_NAME, "ab") as f:
        f.write(b'{"layer": 5, "rows": [[5, 0')  # torn
    (tmp_path / "layer-00005.bin.partial").write_bytes(b"x" * 100)
    with RankWriter(tmp_path, plan(), fsync=False) as w:
        assert set(w.done_layers) == set(LAYERS[:2])
    assert not (tmp_path / "layer-00005.bin.partial").exists()


def test_journal_of_another_build_is_discarded(tmp_path):
    write(tmp_path, layers=LAYERS[:2], publish=False)
    with RankWriter(tmp_path, plan(identity(fingerprint="sha256:other")), fsync=False) as w:
        assert w.done_layers == {}
    assert not list(tmp_path.glob("layer-*.bin"))


def test_layer_file_lost_after_journal_is_rewritten(tmp_path):
    write(tmp_path, layers=LAYERS[:2], publish=False)
    (tmp_path / layer_file_name(LAYERS[1])).unlink()
    with RankWriter(tmp_path, plan(), fsync=False) as w:
        assert set(w.done_layers) == {LAYERS[0]}


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("fingerprint", "sha256:zzz", "checkpoint"),
        ("quantization", {"kind": "unquantized"}, "quantization"),
        ("layout_version", 2, "layout version"),
        ("tp_size", 2, "TP"),
    ],
)
def test_stale_cache_is_refused_naming_the_field(tmp_path, field, value, needle):
    write(tmp_path)
    with pytest.raises(StaleCacheError, match=needle):
        open_cache(tmp_path, tp_size=identity().tp_size, expect=identity(**{field: value}))


def test_rank_directories_of_another_tp_size_are_named(tmp_path):
    write(tmp_path / "rank-0-of-2")
    with pytest.raises(StaleCacheError, match="rank-0-of-2"):
        open_cache(tmp_path, tp_rank=0, tp_size=4)


def test_truncated_and_missing_files_are_refused(tmp_path):
    write(tmp_path)
    path = tmp_path / layer_file_name(LAYERS[1])
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    with pytest.raises(CorruptCacheError, match="truncated"):
        open_cache(tmp_path)
    path.unlink()
    with pytest.raises(CorruptCacheError, match="missing"):
        open_cache(tmp_path)


def test_flipped_byte_is_caught_by_verify(tmp_path):
    write(tmp_path)
    cache = open_cache(tmp_path)
    spec = cache.spec("w2")
    path = cache.layer_file(LAYERS[2])
    flip_byte(path, 2 * cache.record_nbytes + spec.offset + 5, 0x10)
    report = open_cache(tmp_path).verify()
    assert report.mismatches == [(LAYERS[2], 2, "w2")]


def test_edited_manifest_fails_its_checksum(tmp_path):
    write(tmp_path)
    p = tmp_path / MANIFEST_NAME
    obj = json.loads(p.read_bytes())
    obj["tensors"][0][8] = "0" * 16
    p.write_text(json.dumps(obj))
    with pytest.raises(CorruptCacheError, match="checksum"):
        open_cache(tmp_path)
    p.write_text("{not json")
    with pytest.raises(CorruptCacheError, match="not valid JSON"):
        open_cache(tmp_path)


def test_other_format_version_is_stale(tmp_path):
    write(tmp_path)
    p = tmp_path / MANIFEST_NAME
    obj = json.loads(p.read_bytes())
    obj["format_version"] = 99
    p.write_text(json.dumps(obj))
    with pytest.raises(StaleCacheError, match="version 99"):
        open_cache(tmp_path)


def test_second_writer_is_refused_while_first_holds_the_lock(tmp_path):
    with RankWriter(tmp_path, plan(), fsync=False):
        with pytest.raises(CacheLockedError, match=f"pid {os.getpid()}"):
            with RankWriter(tmp_path, plan(), fsync=False):
                pass
    with RankWriter(tmp_path, plan(), fsync=False):  # released
        pass


def test_stale_manifest_is_removed_before_rebuilding(tmp_path):
    write(tmp_path)
    with RankWriter(tmp_path, plan(identity(fingerprint="sha256:new")), fsync=False) as w:
        assert not (tmp_path / MANIFEST_NAME).exists()
        assert w.done_layers == {}


def test_complete_cache_is_reused(tmp_path):
    write(tmp_path)
    mtime = (tmp_path / MANIFEST_NAME).stat().st_mtime_ns
    with RankWriter(tmp_path, plan(), fsync=False) as w:
        assert w.complete
    assert (tmp_path / MANIFEST_NAME).stat().st_mtime_ns == mtime


def test_disk_full_leaves_no_partial_file(tmp_path, monkeypatch):
    real_write = os.write

    def full(fd, data):
        if len(data) >= 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StorageError, match="disk full"):
        write(tmp_path)
    assert not list(tmp_path.glob("*.partial"))
    assert not (tmp_path / MANIFEST_NAME).exists()


def test_unwritable_directory_is_one_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="cannot write|permission|read-only"):
        write(blocker / "cache")


def test_wrong_shape_from_layout_is_a_bug_not_silent(tmp_path):
    with RankWriter(tmp_path, plan(), fsync=False) as w:
        lw = w.begin_layer(0)
        bad = tensors_for(0, 0)
        bad["w2"] = bad["w2"][:4]
        with pytest.raises(RuntimeError, match="record says"):
            lw.write_expert(0, bad)
    assert not list(tmp_path.glob("*.partial"))


def test_buffer_bytes_equal_numpy_of_file(tmp_path):
    write(tmp_path)
    cache = open_cache(tmp_path)
    arr = np.fromfile(cache.layer_file(LAYERS[0]), dtype=np.uint8)
    assert np.array_equal(cache.expert_buffer(LAYERS[0], 2), arr[2 * cache.record_nbytes : 3 * cache.record_nbytes])


def _flip(cache, layer, expert, name, delta=5):
    spec = cache.spec(name)
    flip_byte(cache.layer_file(layer), expert * cache.record_nbytes + spec.offset + delta, 0x40)


def test_check_layer_once_raises_for_a_flipped_bit_and_passes_clean_layers(tmp_path):
    write(tmp_path)
    cache = open_cache(tmp_path)
    _flip(cache, LAYERS[1], 1, "w13")
    cache.check_layer_once(LAYERS[0])  # clean: silent
    for _ in range(2):  # and stays refused
        with pytest.raises(CorruptCacheError, match=f"layer {LAYERS[1]} expert 1 w13"):
            cache.check_layer_once(LAYERS[1])
    assert cache.verify_layer(LAYERS[2]) == []


def test_background_check_finds_a_flip_first_and_first_uses_read_nothing_more(tmp_path, monkeypatch):
    """Cache.check_in_background: every expert checked in a background thread; afterwards the
    serving path's first-use checks read no byte (clean experts pass, whole clean layers count as
    checked for layer streaming), and the flipped expert is refused by name while its layer's
    other experts stay servable."""
    write(tmp_path)
    cache = open_cache(tmp_path)
    _flip(cache, LAYERS[1], 1, "w13")
    bg = cache.check_in_background()
    assert bg.wait(60) and bg.error is None
    s = bg.summary()
    assert s["experts"] == len(LAYERS) * cache.num_experts and s["mismatches"] == 1 and s["done"]
    reads = []
    real = cache._verify_records
    monkeypatch.setattr(cache, "_verify_records", lambda *a, **k: reads.append(a) or real(*a, **k))
    cache.check_experts_once(LAYERS[0], range(cache.num_experts))
    cache.check_layer_once(LAYERS[0])  # all clean: known whole
    cache.check_experts_once(LAYERS[1], [0, 2])
    with pytest.raises(CorruptCacheError, match=f"layer {LAYERS[1]} expert 1 w13"):
        cache.check_experts_once(LAYERS[1], [1])
    assert reads == []
    with pytest.raises(CorruptCacheError, match=f"layer {LAYERS[1]} expert 1 w13"):
        cache.check_layer_once(LAYERS[1])  # a layer with a bad expert is read whole, and refused


def test_background_check_skips_what_serving_checked_and_stops(tmp_path):
    write(tmp_path)
    cache = open_cache(tmp_path)
    cache.check_layer_once(LAYERS[0])
    cache.check_experts_once(LAYERS[1], [0, 1])
    bg = cache.check_in_background()
    assert bg.wait(60)
    assert bg.experts == (len(LAYERS) - 1) * cache.num_experts - 2  # none read twice
    stopped = cache.check_in_background()
    stopped.stop()
    assert stopped.done


def test_layer_buffer_is_the_whole_file_zero_copy(tmp_path):
    write(tmp_path)
    cache = open_cache(tmp_path)
    buf = cache.layer_buffer(LAYERS[1])
    assert buf.tobytes() == cache.layer_file(LAYERS[1]).read_bytes()
    assert buf.ctypes.data == cache.expert_buffer(LAYERS[1], 0).ctypes.data
