"""tests/child_runner.py (the harness of the vLLM GPU tests) on the CPU, with a child that sleeps
through its cases: the hang clock restarts at each case, a case that overruns it ends the child with
every thread's stack and the parent's dump of native waits, and the cases run before it stay readable."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from child_runner import run_child  # noqa: E402

CHILD = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[4])
    from child_runner import CaseClock, save_results
    work, out, hang_s = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
    clock = CaseClock(work, hang_s)
    results = {"cases": {}, "complete": False}
    for spec in sys.argv[5].split(","):
        case, seconds = spec.split(":")
        clock.start(case)
        time.sleep(float(seconds))
        results["cases"][case] = {"error": "it raised"} if case.startswith("bad") else {"slept": float(seconds)}
        save_results(out, results)
    results["complete"] = True
    save_results(out, results)
    clock.stop()
''')


def _run(tmp_path: Path, hang_s: float, plan: str) -> tuple[dict, str, float]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out, log = tmp_path / "out.json", tmp_path / "child.log"
    t0 = time.monotonic()
    argv = [sys.executable, str(script), str(tmp_path), str(out), str(hang_s), str(Path(__file__).parent), plan]
    res = run_child(argv, dict(os.environ), tmp_path, out, log, hang_s=hang_s, what="test child", timeout=60)
    return res, log.read_text(), time.monotonic() - t0


def test_the_clock_restarts_at_each_case_and_an_overrun_keeps_the_cases_before(tmp_path):
    # four cases of 1.2 s (4.8 s in all, more than hang_s), then one that sleeps past it
    res, log, took = _run(tmp_path, 4.5, "a:1.2,b:1.2,c:1.2,d:1.2,e:30")
    assert res["returncode"] != 0 and not res["complete"]
    assert [res["cases"][c]["slept"] for c in "abcd"] == [1.2] * 4  # whole, readable one by one
    with pytest.raises(pytest.fail.Exception, match="case e did not run: test child ended with 1"):
        res["cases"]["e"]
    assert "Timeout (0:00:04.5" in log  # faulthandler, in case e
    assert log.count("==== native waits of pid") == 1  # the parent's dump, only for the overrun case
    assert took < 20, took  # e was cut at 4.5 s, not slept through
    assert json.loads((tmp_path / "out.json").read_text())["cases"].keys() == set("abcd")


def test_a_complete_child_and_a_case_that_raised(tmp_path):
    res, log, _ = _run(tmp_path, 0, "a:0,bad:0,c:0")
    assert res["returncode"] == 0 and res["complete"] and res["cases"].why == ""
    assert res["cases"]["c"] == {"slept": 0.0}
    with pytest.raises(pytest.fail.Exception, match="bad: it raised"):
        res["cases"]["bad"]  # only the tests that read it fail
    with pytest.raises(pytest.fail.Exception, match="case z did not run: not in the plan"):
        res["cases"]["z"]
    assert "native waits" not in log


def test_a_child_that_wrote_nothing_fails_at_once(tmp_path):
    with pytest.raises(pytest.fail.Exception, match="test child failed with 3 before its first case"):
        run_child([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], dict(os.environ), tmp_path,
                  tmp_path / "out.json", tmp_path / "log", hang_s=0, what="test child", timeout=60)
