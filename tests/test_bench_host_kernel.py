"""bench_host_kernel.py's own helpers (the benchmark itself runs on the GPU machine's host)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_host_kernel  # noqa: E402


def test_cpu_flags_lists_the_vector_and_matrix_extensions(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU\n"
                    "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512bw amx_tile amx_bf16 avx_vnni fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx512f\n")
    assert bench_host_kernel.cpu_flags(str(info)) == ["amx_bf16", "amx_tile", "avx512_bf16", "avx512bw", "avx512f",
                                                     "avx_vnni"]
    assert bench_host_kernel.cpu_flags(str(tmp_path / "missing")) == []


def test_isa_lists_keep_order_and_name_what_the_cpu_has():
    have = ["avx512vnni", "avx512bw", "avx2", "plain"]
    assert bench_host_kernel.parse_isas("auto", have) == ["avx512vnni"]
    assert bench_host_kernel.parse_isas("all", have) == have
    assert bench_host_kernel.parse_isas("avx512bw,auto,avx512bw", have) == ["avx512bw", "avx512vnni"]
    try:
        bench_host_kernel.parse_isas("avx512vnni-novbmi", have)
    except SystemExit as e:
        assert "no 'avx512vnni-novbmi' kernel path" in str(e) and "avx512vnni, avx512bw, avx2, plain" in str(e)
    else:
        raise AssertionError("a path the CPU lacks was accepted")
