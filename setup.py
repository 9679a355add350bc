"""Build the native libraries of csrc/ at install (pyproject.toml holds the metadata).

Each library of ``mmap_offload/native.py: LIBRARIES`` becomes a plain-C extension
``mmap_offload._<stem>`` (no Python API: the package loads it with ctypes), for ``pip install .``,
``pip install -e .`` and wheel builds alike. The build never fails the install: without a compiler, or
with a source missing, it warns and the package falls back to the run-time build or pure Python
(``python -c "from mmap_offload.native import library_status as s; print(s('mo_native'))"`` says which).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("_mo_native_table", ROOT / "mmap_offload" / "native.py")
native = sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native)  # stdlib only: no torch at build time


def extensions() -> list[Extension]:
    out = []
    for stem, lib in native.LIBRARIES.items():
        if not all((ROOT / "csrc" / s).exists() for s in lib.sources):
            print(f"mmap-offload: csrc/ lacks a source of {stem}; not built (the package works without it)")
            continue
        out.append(Extension(f"mmap_offload._{stem}", [f"csrc/{s}" for s in lib.sources],
                             depends=[f"csrc/{h}" for h in lib.headers], extra_compile_args=list(lib.cflags),
                             libraries=list(lib.libs), optional=True))
    return out


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing, and compiles each library's source hash into it
    (symbol ``mo_sources_<stem>``: native.py skips an extension built from other sources)."""

    def build_extension(self, ext: Extension) -> None:
        stem = ext.name.rsplit("._", 1)[1]
        digest = native.source_hash(stem, ROOT / "csrc")
        stamp = Path(self.build_temp) / f"mo_sources_{stem}.c"
        try:
            stamp.parent.mkdir(parents=True, exist_ok=True)
            stamp.write_text(f'const char mo_sources_{stem}[13] = "{digest}";\n')
            ext.sources = [s for s in ext.sources if not s.endswith(stamp.name)] + [str(stamp)]
            try:
                super().build_extension(ext)
            except Exception:  # noqa: BLE001 - a second try without the library's optional part, if it has one
                fallback = native.LIBRARIES[stem].fallback
                if not fallback:
                    raise
                ext.extra_compile_args = [*ext.extra_compile_args, *fallback]
                self.warn(f"mmap-offload: building {ext.name} again with {' '.join(fallback)}")
                super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - any failure: the package still works without it
            Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)  # no older build ships instead
            self.warn(f"mmap-offload: building {ext.name} failed ({e}); the package falls back to a "
                      "run-time build or pure Python")

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return []  # no PyInit_*: a ctypes library, not a Python module


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
