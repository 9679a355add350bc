"""A test's child process that runs cases one after the other (tests/vllm_gpu_child.py: one vLLM engine
per case), and the parent that reads its results case by case.

Child side: ``CaseClock.start(case)`` restarts the hang clock at each case (a case that runs longer
than ``hang_s`` dumps every thread's Python stack and ends the child) and dates the case's start in
``WORKDIR/case_started``; ``save_results`` rewrites OUT.json after each case, whole or not at all.
Until session 13 the clock ran once for the whole child: a W4A16-only child on a freshly started GPU
machine spends ~100 s of its first case compiling kernels, was cut at 150 s (sessions 12 and 13) and
was read as a hang.

Parent side: ``run_child`` starts the child with its output in a log, writes where each thread waits
below Python (system call, kernel stack, nvidia-smi, gdb where present) into the log once a case has
run ``hang_s - 3`` seconds, and returns the results with their cases in a ``Cases``: a test that reads a
case the child did not finish fails with the log's tail, one that reads a case that raised fails with
its error, and the tests of the other cases still run.
"""

from __future__ import annotations

import faulthandler
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest


class CaseClock:
    """The child's hang clock: restarted at each case; 0 s: no clock, the start is still dated."""

    def __init__(self, work: Path, hang_s: float) -> None:
        self.started = Path(work) / "case_started"
        self.hang_s = float(hang_s)

    def start(self, case: str) -> None:
        if self.hang_s > 0:
            faulthandler.dump_traceback_later(self.hang_s, exit=True)
        self.started.write_text(f"{case} {time.time():.3f}\n")

    def stop(self) -> None:
        faulthandler.cancel_dump_traceback_later()


def save_results(out: Path, results: dict) -> None:
    """OUT.json with the cases so far: a reader sees the previous file or this one, never a part."""
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, out)


class Cases(dict):
    """The child's cases: a missing one fails the test that reads it with ``why``, one that raised
    with its error."""

    def __init__(self, cases: dict, why: str) -> None:
        super().__init__(cases)
        self.why = why

    def __getitem__(self, case: str) -> dict:
        if case not in self:
            pytest.fail(f"case {case} did not run: {self.why or 'not in the plan'}")
        r = super().__getitem__(case)
        if "error" in r:
            pytest.fail(f"{case}: {r['error']}\n{r.get('tb', '')}")
        return r


def run_child(argv: list[str], env: dict, work: Path, out: Path, log_path: Path, hang_s: float,
              what: str = "child", timeout: float = 900) -> dict:
    """Run the child to its end (or ``timeout``); its results with ``returncode`` and ``cases`` as a
    ``Cases``. Fails at once only when the child wrote no results at all."""
    Path(log_path).write_text("")
    # O_APPEND: the child's writes and native_waits' land one after the other (with a plain "w" the
    # child writes at its own offset, over what was appended meanwhile: sessions 12-13's dumps lost
    # their first lines so)
    with open(log_path, "a") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        watcher = threading.Thread(target=_watch, args=(proc, Path(work) / "case_started", hang_s, log_path),
                                   daemon=True)
        watcher.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        watcher.join(timeout=5)
    text = Path(log_path).read_text(errors="replace")
    if not Path(out).exists():
        pytest.fail(f"{what} failed with {proc.returncode} before its first case:\n{text[-8000:]}")
    res = json.loads(Path(out).read_text())
    res["returncode"] = proc.returncode
    why = "" if proc.returncode == 0 and res.get("complete") else (
        f"{what} ended with {proc.returncode} before it:\n{text[-8000:]}")
    res["cases"] = Cases(res.get("cases", {}), why)
    return res


def _watch(proc: subprocess.Popen, started: Path, hang_s: float, log_path: Path) -> None:
    """While the child runs: once a case has run hang_s - 3 seconds (``started`` dates its start),
    write where each thread waits into the log, once per case."""
    t0, dumped = time.time(), None
    while proc.poll() is None:
        try:
            since = started.stat().st_mtime
        except OSError:
            since = t0
        if hang_s > 0 and time.time() - since > hang_s - 3 and dumped != since:
            native_waits(proc.pid, log_path)
            dumped = since
        time.sleep(0.2)


def native_waits(pid: int, log_path: Path) -> None:
    """Append every thread's name, state, system call (number and arguments: 202 futex, 16 ioctl, 7
    poll) and kernel stack of process ``pid`` to ``log_path``: where a hung child waits below Python;
    then whether the device is busy (nvidia-smi, three samples: a kernel spinning on a flag no fill
    sets would hold it at 100%) and, where the machine has gdb, every thread's native frames."""
    lines = [f"==== native waits of pid {pid}"]
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        def read(name: str) -> str:
            try:
                return (task / name).read_text(errors="replace").strip()
            except OSError as e:
                return f"({e.strerror})"
        stat = read("stat")
        state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
        stack = " <- ".join(ln.split("]", 1)[-1].strip() for ln in read("stack").splitlines()[:6])
        lines.append(f"tid {task.name} {read('comm')!r} state {state} wchan {read('wchan')} syscall {read('syscall')} "
                     f"stack {stack}")
    if shutil.which("nvidia-smi"):
        for _ in range(3):
            try:
                q = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used,clocks.sm",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
                lines.append(f"nvidia-smi {time.strftime('%H:%M:%S')}: {q.strip()}")
            except (OSError, subprocess.TimeoutExpired) as e:
                lines.append(f"nvidia-smi: {e}")
            time.sleep(0.5)
    if shutil.which("gdb"):
        try:
            bt = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"],
                                capture_output=True, text=True, timeout=60).stdout
            lines += [ln for ln in bt.splitlines() if ln.startswith(("Thread", "#"))]
        except (OSError, subprocess.TimeoutExpired) as e:
            lines.append(f"gdb: {e}")
    with open(log_path, "a") as f:
        f.write("\n".join(lines) + "\n")
