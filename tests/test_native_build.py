"""mmap_offload.native: the install-time extension is what loads; without a compiler or a source the
package reports "not available: <reason>" instead of raising. Builds go to tmp_path (no network)."""

import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mmap_offload import native

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Nothing cached, no override, run-time builds into tmp_path/rt only."""
    monkeypatch.delenv("MMAP_OFFLOAD_NATIVE_MO_NATIVE", raising=False)
    monkeypatch.delenv("MMAP_OFFLOAD_NATIVE_MO_HOST", raising=False)
    monkeypatch.setattr(native, "build_dirs", lambda: [tmp_path / "rt"])
    native._reset()
    yield
    native._reset()


def _setup_build_ext(out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "-b", str(out / "lib"), "-t", str(out / "tmp")],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def built_ext(tmp_path_factory):
    """setup.py's build_ext output (what `pip install .` puts next to the package)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp("ext")
    r = _setup_build_ext(out)
    assert r.returncode == 0, r.stderr
    return out / "lib" / "mmap_offload"


def test_setup_builds_each_library_with_its_source_hash(built_ext):
    ext = next(built_ext.glob("_mo_native*.so"))
    nm = subprocess.run(["nm", "-D", str(ext)], capture_output=True, text=True)
    if nm.returncode == 0:
        assert "mo_sources_mo_native" in nm.stdout and "mo_pool_submit" in nm.stdout
    assert (list(built_ext.glob("_mo_host*.so")) != []) == (ROOT / "csrc" / "host_kernel.c").exists()


def test_the_installed_extension_is_what_loads(built_ext, monkeypatch):
    if not native.cpu_flag("avx2"):
        pytest.skip("mo_native needs AVX2 to load")
    monkeypatch.setattr(native, "PACKAGE_DIR", built_ext)
    lib = native.load_library("mo_native")
    assert lib is not None and lib.mo_pool_abi() > 0
    assert native.library_status("mo_native").startswith("installed extension (")
    assert not (native.build_dirs()[0]).exists()  # nothing was compiled at run time


def test_this_install_loads_its_extension_when_setup_built_one():
    """In the test venv (`pip install -e .` by scripts/test.sh) the in-tree extension is picked."""
    ext = native.installed_extension("mo_native")
    if ext is None:
        pytest.skip("this install predates setup.py (reinstall: pip install -e .)")
    if not native.cpu_flag("avx2"):
        pytest.skip("mo_native needs AVX2 to load")
    if native._compiled_hash(ctypes.CDLL(str(ext)), "mo_native") != native.source_hash("mo_native"):
        pytest.skip("csrc/ changed since the install (reinstall: pip install -e .)")
    assert native.library_status("mo_native").startswith("installed extension (")


def test_a_stale_extension_is_skipped_for_a_run_time_build(built_ext, monkeypatch, tmp_path):
    if not native.cpu_flag("avx2"):
        pytest.skip("mo_native needs AVX2 to load")
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    with open(csrc / "fastcopy.c", "a") as f:
        f.write("\n/* edited after the install */\n")
    monkeypatch.setattr(native, "PACKAGE_DIR", built_ext)
    monkeypatch.setattr(native, "CSRC_DIR", csrc)
    assert native.load_library("mo_native") is not None
    assert native.library_status("mo_native") == f"built at run time in {tmp_path / 'rt'}"
    assert len(list((tmp_path / "rt").glob("libmo_native-*.so"))) == 1


def _old_cc(tmp_path: Path) -> Path:
    """A compiler that fails on host_kernel.c unless its optional part is left out, as an assembler
    without AVX-VNNI's {vex} form would; any other call goes to cc."""
    cc = tmp_path / "old-cc"
    cc.write_text("#!/bin/sh\ncase \"$*\" in *-DMO_NO_AVXVNNI*) ;; *host_kernel.c*)\n"
                  "  echo 'Error: no such instruction: `vex vpdpbusd' >&2; exit 1;; esac\n"
                  f"exec {shutil.which('cc')} \"$@\"\n")
    cc.chmod(0o755)
    return cc


@needs_cc
def test_setup_builds_the_host_kernel_again_without_its_optional_part(tmp_path):
    """setup.py's side of the same: the install's extension is built on the second try, without avxvnni."""
    r = _setup_build_ext(tmp_path, env={**os.environ, "CC": str(_old_cc(tmp_path))})
    assert r.returncode == 0, r.stderr
    ext = next((tmp_path / "lib" / "mmap_offload").glob("_mo_host*.so"))
    lib = ctypes.CDLL(str(ext))
    assert lib.mo_host_isa_available(7) == 0 and lib.mo_host_isa_available(0) == 1
    assert "again with -DMO_NO_AVXVNNI" in r.stderr + r.stdout


@needs_cc
def test_a_toolchain_without_the_avxvnni_form_still_builds_the_host_kernel(monkeypatch, tmp_path):
    """mo_host's optional part (the avxvnni path's {vex} vpdpbusd, which binutils < 2.36 cannot assemble):
    where the first compile fails, the run-time build tries again with the library's fallback flags and
    the kernel loads without that path; the other paths are the CPU's as before."""
    monkeypatch.setenv("CC", str(_old_cc(tmp_path)))
    monkeypatch.setattr(native, "PACKAGE_DIR", tmp_path)  # no installed extension: a run-time build
    lib = native.load_library("mo_host")
    assert lib is not None, native.library_status("mo_host")
    assert native.library_status("mo_host") == f"built at run time in {tmp_path / 'rt'}"
    assert lib.mo_host_isa_available(7) == 0  # avxvnni: left out of this build
    assert lib.mo_host_isa_available(0) == 1 and lib.mo_host_isa_available(1) == int(native.cpu_flag("avx2"))


@pytest.mark.parametrize("how", ["cc_fails", "no_cc"])
def test_no_compiler_gives_none_and_a_reason(how, monkeypatch, tmp_path):
    monkeypatch.setattr(native, "PACKAGE_DIR", tmp_path)  # no installed extension
    monkeypatch.setattr(native, "cpu_flag", lambda name: True)
    if how == "cc_fails":
        monkeypatch.setenv("CC", "/bin/false")
    else:
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
    assert native.load_library("mo_native") is None
    status = native.library_status("mo_native")
    assert status.startswith("not available: ")
    assert ("/bin/false failed" if how == "cc_fails" else "no C compiler") in status


def test_missing_source_or_cpu_or_name_gives_none_and_a_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "PACKAGE_DIR", tmp_path)
    monkeypatch.setattr(native, "CSRC_DIR", tmp_path / "csrc")
    monkeypatch.setattr(native, "cpu_flag", lambda name: True)
    assert native.load_library("mo_host") is None
    assert "no csrc/ to build from" in native.library_status("mo_host")  # a wheel without a compiler
    (tmp_path / "csrc").mkdir()
    native._reset()
    assert native.load_library("mo_host") is None
    assert "lacks host_kernel.c" in native.library_status("mo_host")
    monkeypatch.setattr(native, "cpu_flag", lambda name: False)
    native._reset()
    assert native.load_library("mo_native") is None
    assert native.library_status("mo_native") == "not available: the CPU lacks avx2"
    assert native.load_library("nope") is None and "unknown library" in native.library_status("nope")


def test_override_env(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "cpu_flag", lambda name: True)
    monkeypatch.setenv("MMAP_OFFLOAD_NATIVE_MO_NATIVE", str(tmp_path / "missing.so"))
    assert native.load_library("mo_native") is None
    assert native.library_status("mo_native").startswith(f"not available: {tmp_path / 'missing.so'} does not load")


@needs_cc
def test_setup_never_fails_without_a_compiler(tmp_path):
    env = {**os.environ, "CC": "/bin/false"}
    r = _setup_build_ext(tmp_path, env)
    assert r.returncode == 0, r.stderr
    assert "falls back" in r.stderr + r.stdout
    assert not list((tmp_path / "lib").rglob("*.so"))
