"""The CPU-testable parts of the real-vLLM benchmarks (benchmarks/bench_vllm.py, vllm_runner.py):
routing traces (CSV round trip, the replay rows, the skewed generator's reuse), the cgroup child
runner, the Marlin read model, the ratio / bar / table code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from mmap_offload import traces
from mmap_offload.errors import UnsupportedError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import vllm_runner  # noqa: E402


# -- traces ------------------------------------------------------------------------------------------


def test_trace_csv_round_trip(tmp_path):
    tr = traces.skewed_trace(6, 3, 20, 4, batch=5, seed=3)
    p = traces.write_csv(tr, tmp_path / "t.csv", comment="made by the test\nsecond line")
    text = p.read_text().splitlines()
    assert text[0] == "# made by the test" and text[2] == "step,layer,e0,e1,e2,e3"
    assert text[3].split(",")[:2] == ["0", "0"] and len(text) == 3 + 6 * 3 * 5
    back = traces.read_csv(p)
    assert back.dtype == np.int64 and back.shape == (6, 3, 5, 4)
    assert (back == tr).all()


@pytest.mark.parametrize("body, what", [
    ("0,0,1,2\n0,0,3\n", "fields"),
    ("0,0,1,2\n0,1,1,2\n1,0,1,2\n", "step 1 layer 1 has 0 rows"),
    ("0,0,1,2\n0,0,3,4\n0,1,1,2\n", "step 0 layer 1 has 1 rows, expected 2"),
    ("0,0,1,x\n", "not integers"),
    ("0,0,1,-2\n", "negative"),
    ("# nothing\n", "no rows"),
])
def test_trace_csv_errors_name_the_problem(tmp_path, body, what):
    p = tmp_path / "bad.csv"
    p.write_text(body)
    with pytest.raises(UnsupportedError, match=what):
        traces.read_csv(p)
    with pytest.raises(UnsupportedError, match="cannot be read"):
        traces.read_csv(tmp_path / "missing.csv")


def test_reuse_fraction():
    tr = np.zeros((3, 1, 1, 2), dtype=np.int64)
    tr[:, 0, 0] = [[1, 2], [2, 3], [4, 5]]  # step 1 keeps 1 of 2, step 2 keeps 0
    assert traces.reuse_fraction(tr) == pytest.approx(0.25)
    assert traces.reuse_fraction(tr[:1]) == 0.0


def test_trace_rows_mirror_the_backend_replay():
    tr = np.arange(2 * 3 * 4 * 2).reshape(2, 3, 4, 2)
    rows = vllm_runner.trace_rows(tr, step=3, pos=4, n=6, k=2)  # step 3 % 2, layer 4 % 3: tr[1, 1]
    assert rows.tolist() == tr[1, 1].tolist() + tr[1, 1, :2].tolist()
    assert vllm_runner.trace_rows(tr, 0, 0, 1, 1).tolist() == [[0]]
    with pytest.raises(ValueError, match="top-2"):
        vllm_runner.trace_rows(tr, 0, 0, 1, 3)
