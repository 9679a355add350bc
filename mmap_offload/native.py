"""The one place that finds (or builds) a native shared library of csrc/ and loads it with ctypes.

    lib = load_library("mo_native")      # ctypes.CDLL, or None: callers keep a pure-Python path
    library_status("mo_native")          # one line for users and logs: which path was taken

Each library of ``LIBRARIES`` is looked up, first hit wins:

1. ``$MMAP_OFFLOAD_NATIVE_<STEM>`` (e.g. ``MMAP_OFFLOAD_NATIVE_MO_NATIVE=/path/lib.so``): an override.
2. The extension built at install (``pip install .`` / ``-e .``: setup.py compiles each library as a
   plain-C extension ``mmap_offload/_<stem>.<abi tag>.so``; no Python API in it, loaded with ctypes).
   In a source checkout, an extension built from other sources than csrc/ holds now (the source
   hash setup.py compiled into it, symbol ``mo_sources_<stem>``, differs) is skipped as stale.
3. A run-time build with ``$CC`` / ``cc`` into ``build/`` of the checkout or ``~/.cache/mmap-offload``,
   named by a hash of the sources (a build of older sources is never loaded), written to a temporary
   file and renamed into place (several ranks may build at once). Needs csrc/ (a checkout or sdist).
4. None, with the reason in ``library_status``: no compiler, no source, or a CPU without what the
   library was compiled for (``needs``: mo_native is built with -mavx2).

Loading never raises: a library that cannot be had is None and the reason is kept.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LIBRARIES", "Library", "cpu_flag", "library_status", "load_library", "source_hash"]


@dataclass(frozen=True)
class Library:
    """How to build one native library: C ``sources`` (and ``headers``) of csrc/, compiler flags,
    link libraries, the CPU flags (/proc/cpuinfo names) it needs to be loaded, and ``fallback``: flags
    added for a second try where the first compile fails (a part the toolchain may not assemble, left out)."""

    sources: tuple[str, ...]
    headers: tuple[str, ...] = ()
    cflags: tuple[str, ...] = ("-O3",)
    libs: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    fallback: tuple[str, ...] = ()


LIBRARIES: dict[str, Library] = {
    # the copy kernels and the batch copy pool of the mmap engine (mmap_offload/transfer/native_pool.py),
    # and the expert cache's decode step (mmap_offload/expert_step.py)
    "mo_native": Library(("copy_pool.c", "fastcopy.c", "route_step.c", "async_step.c"),
                         ("fastcopy.h", "route_step.h", "sigbus_guard.h"),
                         ("-O3", "-mavx2", "-ffp-contract=off"), ("pthread", "m"), ("avx2",)),
    # host compute of missed experts: dispatches on the ISA at run time (function target attributes);
    # without the avxvnni path where the assembler lacks AVX-VNNI's {vex} form (binutils < 2.36)
    "mo_host": Library(("host_kernel.c",), ("sigbus_guard.h",), ("-O3",), ("pthread", "m"), (),
                       ("-DMO_NO_AVXVNNI",)),
}

PACKAGE_DIR = Path(__file__).resolve().parent
CSRC_DIR = PACKAGE_DIR.parent / "csrc"

_lock = threading.Lock()
_loaded: dict[str, tuple[ctypes.CDLL | None, str]] = {}


@functools.lru_cache(maxsize=None)
def cpu_flag(name: str) -> bool:
    """``name`` is in the first CPU's flags of /proc/cpuinfo (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return name in line.split(":", 1)[1].split()
    except OSError:
        pass
    return False


def source_hash(stem: str, csrc: Path | None = None) -> str | None:
    """12 hex digits of sha256 over the library's sources and headers, None if one is missing."""
    lib, h = LIBRARIES[stem], hashlib.sha256()
    for name in lib.sources + lib.headers:
        try:
            h.update(((csrc or CSRC_DIR) / name).read_bytes())
        except OSError:
            return None
    return h.hexdigest()[:12]


def build_dirs() -> list[Path]:
    """Where the run-time build goes: build/ of the checkout, then the user's cache."""
    return [CSRC_DIR.parent / "build", Path.home() / ".cache" / "mmap-offload"]


def load_library(stem: str, build: bool = True) -> ctypes.CDLL | None:
    """The loaded library ``stem`` of ``LIBRARIES``, or None (see ``library_status`` for why).
    Found once per process; ``build=False`` skips the run-time build (it is tried by a later call
    that allows it)."""
    with _lock:
        got = _loaded.get(stem)
        if got is None or (got[0] is None and build and got[1].endswith(_NOT_TRIED)):
            got = _loaded[stem] = _find(stem, build)
    return got[0]


def library_status(stem: str) -> str:
    """One line: "installed extension (<path>)", "override $VAR (<path>)", "built at run time in
    <dir>", or "not available: <reason>"."""
    load_library(stem)
    return _loaded[stem][1]


def _reset() -> None:
    """Forget what was loaded (tests)."""
    with _lock:
        _loaded.clear()


_NOT_TRIED = "(run-time build not tried)"


def _find(stem: str, build: bool) -> tuple[ctypes.CDLL | None, str]:
    if stem not in LIBRARIES:
        return None, f"not available: unknown library {stem!r} (known: {', '.join(LIBRARIES)})"
    lib = LIBRARIES[stem]
    missing = [f for f in lib.needs if not cpu_flag(f)]
    if missing:
        return None, f"not available: the CPU lacks {', '.join(missing)}"
    var = f"MMAP_OFFLOAD_NATIVE_{stem.upper()}"
    if os.environ.get(var):
        path = os.environ[var]
        return _open(path, f"override ${var} ({path})")
    stale = ""
    ext = installed_extension(stem)
    if ext is not None:
        got = _open(str(ext), f"installed extension ({ext})")
        current = source_hash(stem)
        if got[0] is not None and current is not None and _compiled_hash(got[0], stem) != current:
            got = (None, f"installed extension {ext.name} is stale (built from other sources than csrc/)")
        if got[0] is not None:
            return got
        stale = f"; {got[1].removeprefix('not available: ')}"
    name = source_hash(stem)
    if name is None:
        if not CSRC_DIR.is_dir():
            return None, ("not available: no installed extension (pip builds it where a C compiler runs) "
                          f"and no csrc/ to build from{stale}")
        missing = [s for s in lib.sources + lib.headers if not (CSRC_DIR / s).exists()]
        return None, f"not available: no installed extension, and {CSRC_DIR} lacks {', '.join(missing)}{stale}"
    fname = f"lib{stem}-{name}.so"
    for d in build_dirs():
        if (d / fname).exists():
            return _open(str(d / fname), f"built at run time in {d}")
    if not build:
        return None, f"not available: not built yet {_NOT_TRIED}"
    path, why = _build(stem, fname)
    if path is None:
        return None, f"not available: {why}{stale}"
    return _open(str(path), f"built at run time in {path.parent}")


def installed_extension(stem: str) -> Path | None:
    """``mmap_offload/_<stem>.<abi tag>.so`` (or plain ``_<stem>.so``) if setup.py built it."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    for cand in (PACKAGE_DIR / f"_{stem}{suffix}", PACKAGE_DIR / f"_{stem}.so"):
        if cand.exists():
            return cand
    found = sorted(PACKAGE_DIR.glob(f"_{stem}.*.so"))
    return found[0] if found else None


def _compiled_hash(lib: ctypes.CDLL, stem: str) -> str | None:
    """The source hash setup.py compiled into the extension (None if it has none)."""
    try:
        return (ctypes.c_char * 13).in_dll(lib, f"mo_sources_{stem}").value.decode()
    except (ValueError, UnicodeDecodeError):
        return None


def _open(path: str, how: str) -> tuple[ctypes.CDLL | None, str]:
    try:
        return ctypes.CDLL(path), how
    except OSError as e:
        return None, f"not available: {path} does not load ({e})"


def compile_command(stem: str, out: str, cc: str, fallback: bool = False) -> list[str]:
    """The one compiler line of a run-time build (setup.py passes the same flags to setuptools);
    ``fallback``: with the library's fallback flags (its second try)."""
    lib = LIBRARIES[stem]
    return [cc, *lib.cflags, *(lib.fallback if fallback else ()), "-shared", "-fPIC",
            *(str(CSRC_DIR / s) for s in lib.sources), *(f"-l{x}" for x in lib.libs), "-o", out]


def _build(stem: str, fname: str) -> tuple[Path | None, str]:
    """Compile into the first writable build dir; atomic (temp file + rename), older builds of the
    same stem removed. (path, "") or (None, reason)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (set $CC or install cc; or pip install the package where one is)"
    why = "no writable build directory"
    for d in build_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
            os.close(fd)
        except OSError as e:
            why = f"cannot write {d} ({e.strerror})"
            continue
        try:
            r = subprocess.run(compile_command(stem, tmp, cc), capture_output=True, timeout=180)
            if r.returncode != 0 and LIBRARIES[stem].fallback:  # the second try, without the optional part
                r2 = subprocess.run(compile_command(stem, tmp, cc, fallback=True), capture_output=True, timeout=180)
                r = r if r2.returncode != 0 else r2
        except (OSError, subprocess.SubprocessError) as e:
            os.unlink(tmp)
            return None, f"the compiler {cc} did not run ({e})"
        if r.returncode != 0:
            os.unlink(tmp)
            err = (r.stderr or b"").decode(errors="replace").strip().splitlines()
            return None, f"{cc} failed (exit {r.returncode}){': ' + err[0] if err else ''}"
        out = d / fname
        os.replace(tmp, out)
        for old in d.glob(f"lib{stem}-*.so"):
            if old.name != fname:
                old.unlink(missing_ok=True)
        return out, ""
    return None, why
