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


def test_diag_summary_splits_a_call_into_python_c_and_the_threads_time():
    """The timed mean less the time in C is the Python side; a thread's idle time is the work's span
    (open to the last unit) less its join delay and its time in units; threads that joined no call are
    left out; the line names every part."""
    d = {"calls": 4, "c_us": 300.0, "prep_us": 2.0, "run_us": 290.0, "finish_us": 8.0,
         "threads": [{"joined": 4, "join_us": 0.0, "busy_us": 280.0, "red_us": 5.0, "wait_us": 1.0, "last_us": 290.0,
                      "units": 6.0},
                     {"joined": 2, "join_us": 30.0, "busy_us": 240.0, "red_us": 3.0, "wait_us": 0.0, "last_us": 288.0,
                      "units": 5.0},
                     {"joined": 0, "join_us": 0.0, "busy_us": 0.0, "red_us": 0.0, "wait_us": 0.0, "last_us": 0.0,
                      "units": 0.0}]}
    s = bench_host_kernel.diag_summary(d, 380.0)
    assert s["python_us"] == 80.0 and s["c_us"] == 300.0
    assert s["threads_joined"] == 1.5  # 6 joins over 4 calls
    assert s["join_us"] == 15.0 and s["join_max_us"] == 30.0 and s["busy_us"] == 260.0
    assert s["idle_us"] == ((290 - 0 - 280) + (290 - 30 - 240)) / 2
    assert (s["units_min"], s["units_max"]) == (5.0, 6.0) and s["last_min_us"] == 288.0
    line = bench_host_kernel.diag_line("user", 16, 1, s)
    assert "python 80 + C 300" in line and "join 15 (max 30)" in line and "idle 15" in line
    plain = bench_host_kernel.diag_summary({k: v for k, v in d.items() if k != "threads"}, 380.0)
    assert "busy_us" not in plain and "per thread" not in bench_host_kernel.diag_line("user", 16, 1, plain)
