"""Faults on the read path (issue 13): a cache file truncated while mapped, read errors (EIO) and
short reads. Each ends in one clean CacheError naming the file; the process lives, nothing hangs,
and the engine keeps serving other files. SIGBUS cases run in a child process, so a regression
kills the child (and fails the test), not pytest."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from mmap_offload.cache_format import Extent
from mmap_offload.errors import CacheError
from mmap_offload.transfer import Copy, make_engine, native_copy_lib
from mmap_offload.transfer.kvikio_engine import KvikioEngine

ROOT = Path(__file__).resolve().parents[1]
needs_native = pytest.mark.skipif(native_copy_lib() is None,
                                  reason="no C compiler / AVX2: the native pool is unavailable")
MiB = 1 << 20


def _child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


TRUNCATE_UNDER_THE_ENGINE = """
    import os, sys
    import numpy as np, torch
    from mmap_offload.cache_format import Extent
    from mmap_offload.errors import CacheError
    from mmap_offload.transfer import Copy, make_engine
    d, native = sys.argv[1], sys.argv[2] == "1"
    rng = np.random.default_rng(3)
    n = 8 << 20
    data = {}
    for name in ("a.bin", "b.bin"):
        data[name] = rng.integers(0, 256, n, dtype=np.uint8)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data[name].tobytes())
    a, b = os.path.join(d, "a.bin"), os.path.join(d, "b.bin")
    eng = make_engine("mmap", "cpu", pinned_bytes=4 << 20, slot_bytes=1 << 20, threads=2, native=native)
    assert eng.native == native
    if len(sys.argv) > 3 and sys.argv[3] == "faulthandler":  # a SIGBUS handler after the pool's: sees it first
        import faulthandler
        faulthandler.enable()
    elif len(sys.argv) > 3:  # the host kernel's guard after the pool's (vLLM's hybrid order): passes it on
        from mmap_offload.host.kernel import HostKernel, library
        hk = HostKernel(threads=2, isa="plain")
        assert library().mo_host_sigbus_guarded() == 1
        assert eng.metrics["sigbus_guarded"] is True  # the host kernel's guard passes the pool's faults on
    dst = torch.zeros(n, dtype=torch.uint8)
    copy = Copy(Extent(a, 0, n), [(0, n, dst)], label="layer 3 expert 5")
    eng.wait(eng.submit([copy]))  # mapped, pre-faulted, read once
    assert np.array_equal(dst.numpy(), data["a.bin"])
    os.truncate(a, 1 << 20)  # truncated while mapped: pages past 1 MiB now raise SIGBUS
    try:
        eng.wait(eng.submit([copy]))
        print("NO ERROR")
    except CacheError as e:
        print("ERROR1", e)
    other = torch.zeros(n, dtype=torch.uint8)  # the engine still serves other files
    eng.wait(eng.submit([Copy(Extent(b, 0, n), [(0, n, other)])]))
    print("OTHER", np.array_equal(other.numpy(), data["b.bin"]))
    try:  # the truncated file again: refused at submit now (its size is re-read)
        eng.wait(eng.submit([copy]))
        print("NO ERROR")
    except CacheError as e:
        print("ERROR2", e)
    head = torch.zeros(1 << 20, dtype=torch.uint8)  # what is left of it still reads
    eng.wait(eng.submit([Copy(Extent(a, 0, 1 << 20), [(0, 1 << 20, head)])]))
    print("HEAD", np.array_equal(head.numpy(), data["a.bin"][:1 << 20]))
    eng.close()
    print("ALIVE")
"""


@needs_native
@pytest.mark.parametrize("later_handler", [None, "faulthandler", "host-kernel"])
def test_native_pool_survives_a_file_truncated_while_mapped(tmp_path, later_handler):
    """With faulthandler enabled after the pool (it dumps, then re-raises to the pool's handler)
    the process still lives; the message then names the faulting piece's start. The host kernel's own
    SIGBUS guard (host/kernel.py), installed after the pool's as hybrid does, passes the pool's faults on."""
    r = _child(TRUNCATE_UNDER_THE_ENGINE, str(tmp_path), "1", *([later_handler] if later_handler else []))
    assert r.returncode == 0, f"child died (rc {r.returncode}): {r.stderr[-3000:]}"
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert "NO" not in lines, r.stdout
    one = lines["ERROR1"]
    assert str(tmp_path / "a.bin") in one and "layer 3 expert 5" in one and "SIGBUS" in one
    assert "\n" not in one and "mmap-offload verify" in one
    assert lines["OTHER"] == "True" and lines["HEAD"] == "True"
    assert "a.bin ends at 1048576 bytes" in lines["ERROR2"]
    assert r.stdout.rstrip().endswith("ALIVE")


def test_python_copy_threads_check_the_size_before_copying(tmp_path):
    """The fallback cannot catch SIGBUS: it checks the file's size first (a truncation racing with
    the copy itself is not covered; _MappedFile says so)."""
    r = _child(TRUNCATE_UNDER_THE_ENGINE, str(tmp_path), "0")
    assert r.returncode == 0, f"child died (rc {r.returncode}): {r.stderr[-3000:]}"
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert "NO" not in lines, r.stdout
    assert f"cache file {tmp_path / 'a.bin'} ends at 1048576 bytes" in lines["ERROR1"]
    assert lines["OTHER"] == "True" and lines["HEAD"] == "True" and "ALIVE" in r.stdout


@needs_native
def test_a_sigbus_outside_the_pool_still_kills_the_process(tmp_path):
    """The pool's handler passes a fault it did not guard to the handler before it (the default:
    the process dies of SIGBUS, as it would without the pool)."""
    code = """
        import mmap, os, sys
        from mmap_offload.transfer import make_engine
        from mmap_offload.transfer.native_pool import native_copy_lib
        eng = make_engine("mmap", "cpu", pinned_bytes=1 << 20, slot_bytes=1 << 18, threads=1)
        assert eng.native and native_copy_lib().mo_sigbus_guarded() == 1
        p = os.path.join(sys.argv[1], "c.bin")
        with open(p, "wb") as f:
            f.write(b"x" * (1 << 20))
        f = open(p, "rb")
        m = mmap.mmap(f.fileno(), 1 << 20, prot=mmap.PROT_READ)
        os.truncate(p, 0)
        print("READING", flush=True)
        print(m[8192])  # Python's own read of the mapping: not the pool's, not guarded
        print("SURVIVED")
    """
    r = _child(code, str(tmp_path))
    assert "READING" in r.stdout and "SURVIVED" not in r.stdout
    assert r.returncode == -7, (r.returncode, r.stderr[-2000:])  # SIGBUS


# --- pread: an injectable reader -------------------------------------------------------------

@pytest.fixture
def two_files(tmp_path):
    rng = np.random.default_rng(9)
    out = {}
    for name in ("p.bin", "q.bin"):
        data = rng.integers(0, 256, 3 * MiB + 123, dtype=np.uint8)
        (tmp_path / name).write_bytes(data.tobytes())
        out[tmp_path / name] = data
    return out


def _read_all(eng, path: Path, data: np.ndarray) -> torch.Tensor:
    dst = torch.zeros(len(data), dtype=torch.uint8)
    eng.wait(eng.submit([Copy(Extent(path, 0, len(data)), [(0, len(data), dst)])]))
    return dst


@pytest.mark.parametrize("direct_io", [True, False])
def test_pread_eio_is_a_clean_error_naming_the_file(two_files, direct_io):
    (p, pdata), (q, qdata) = two_files.items()
    eng = make_engine("pread", "cpu", pinned_bytes=4 * MiB, slot_bytes=MiB, threads=3, direct_io=direct_io)
    real = eng._preadv

    def failing(fd, bufs, offset):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("p.bin") and offset >= MiB:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd, bufs, offset)

    eng._preadv = failing
    try:
        with pytest.raises(CacheError) as ei:
            _read_all(eng, p, pdata)
        msg = str(ei.value)
        assert str(p) in msg and "Input/output error" in msg and "offset" in msg and "\n" not in msg
        assert np.array_equal(_read_all(eng, q, qdata).numpy(), qdata)  # still serving
    finally:
        eng.close()


def test_pread_short_reads_are_completed_and_a_zero_read_is_an_error(two_files):
    (p, pdata), (q, qdata) = two_files.items()
    eng = make_engine("pread", "cpu", pinned_bytes=4 * MiB, slot_bytes=MiB, threads=2, direct_io=False)
    real = eng._preadv
    calls = []

    def short(fd, bufs, offset):  # at most 1000 bytes a call: legal, the engine must loop
        calls.append(offset)
        return real(fd, [bufs[0][:1000]], offset)

    eng._preadv = short
    try:
        assert np.array_equal(_read_all(eng, q, qdata).numpy(), qdata) and len(calls) > 3000
        eng._preadv = lambda fd, bufs, offset: 0  # the disk says EOF mid-file
        with pytest.raises(CacheError, match=f"cache file {p} ended early"):
            _read_all(eng, p, pdata)
        eng._preadv = real
        assert np.array_equal(_read_all(eng, p, pdata).numpy(), pdata)
    finally:
        eng.close()


# --- kvikio: a fake CuFile (kvikio is not installed on CPU) ------------------------------------

class _FakeFuture:
    def __init__(self, fn):
        self._fn = fn

    def get(self):
        return self._fn()


class _FakeKvikio:
    """The part of kvikio the engine uses: defaults.set/get and CuFile(path, "r").pread(buf, n, off)
    returning a future. ``fault(path, offset, n)`` returns None (read normally), an int (bytes read:
    a short read) or raises."""

    def __init__(self, fault):
        fake = self

        class defaults:  # noqa: N801 - the module attribute's name
            @staticmethod
            def set(*a, **k):
                pass

            @staticmethod
            def get(name):
                return {"compat_mode": "ON", "bounce_buffer_size": 16 << 20}[name]

        class CuFile:
            def __init__(self, path, mode):
                self.path = path
                self.f = open(path, "rb")

            def pread(self, buf, n, offset):
                def run():
                    got = fake.fault(os.fspath(self.path), offset, n)
                    if got is not None:
                        return got
                    self.f.seek(offset)
                    b = self.f.read(n)
                    np.asarray(buf).reshape(-1)[:len(b)] = np.frombuffer(b, dtype=np.uint8)
                    return len(b)
                return _FakeFuture(run)

            def close(self):
                self.f.close()

        self.defaults = defaults
        self.CuFile = CuFile
        self.fault = fault


@pytest.mark.parametrize("what", ["eio", "short"])
def test_kvikio_read_errors_and_short_reads_are_clean_errors(two_files, what):
    (p, pdata), (q, qdata) = two_files.items()

    def fault(path, offset, n):
        if path.endswith("p.bin"):
            if what == "eio":
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return n // 2
        return None

    eng = KvikioEngine(torch.device("cpu"), _kvikio=_FakeKvikio(fault))
    try:
        with pytest.raises(CacheError) as ei:
            _read_all(eng, p, pdata)
        msg = str(ei.value)
        assert str(p) in msg and "\n" not in msg
        assert ("Input/output error" in msg) if what == "eio" else ("read 1572925 of 3145851 bytes" in msg)
        assert np.array_equal(_read_all(eng, q, qdata).numpy(), qdata)
    finally:
        eng.close()
