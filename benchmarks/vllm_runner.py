"""One real vLLM engine per child process, measured from outside: the runner behind
``benchmarks/bench_vllm.py`` and ``benchmarks/oom_repro.py --vllm``.

    parent (this module, imported)                 child (``python vllm_runner.py --spec S``)
    Cgroup(name, mem_max)    cgroup v2 (or v1) --> joins it before exec (preexec_fn)
    run_child(spec, ...)     spec JSON ----------> sets env, imports vLLM, LLM(**spec["llm"]) in process
      polls memory.stat      <-- events JSONL ---  one line per stage and per task, flushed at once,
      reads memory.peak,                           so a child killed by the OOM killer still says how
      memory.events oom_kill                       far it got
      after the child exits                        os._exit(0) after the last line (vLLM does not free
                                                   a model cleanly: one engine per process)

vLLM does not free a model cleanly and its first W4A16 model JIT-compiles Marlin, so every
configuration runs in its own process, under a deadline (``spec["deadline_at"]``: tasks that would
start after it are skipped and reported as such; the parent kills the child at the deadline + grace).

Child tasks (``spec["tasks"]``, run in order, each reported as one ``task`` event):
    greedy    {"prompts": [[ids]], "max_tokens": n}              -> greedy token ids
    decode    {"batch": b, "tokens": T, "prompt_len": p}         -> decode tokens/s at batch b: time of a
              (T+1)-token generation minus a 1-token one (both after a warm-up of this batch size), so
              the prompts' prefill is not counted
    prefill   {"tokens": n, "repeats": r}                        -> prefill tokens/s of one n-token prompt
              (median of r fresh prompts after a warm-up prompt; 1 output token)
    trace     {"path": csv | None}                               -> from now on the routers' top-k ids
              are the trace's (``TraceRouting``, mirrors the backend's ``routing_trace``); None = off
    record    {"tokens": n}                                      -> per-layer expert counts of one
              n-token prefill (the Marlin read model of bench_vllm.py), untimed
Every task result carries the offloader's ``summary()`` (when it has one) before and after its timed
part, the process's VmHWM / RssAnon / RssShmem, and on CUDA the torch host (pinned) allocator's stats.

Prompts are token ids (synthetic checkpoints have no tokenizer). Prefix caching is off in the specs
the benchmarks build, so a repeated prompt is computed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 1 << 30

# set in the child before vLLM is imported (smoke.py of ../shared/vllm-gpu: tested on the H200)
CHILD_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in this process: apply_model / get_offloader reach the model
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # FlashInfer is not in the GPU bundle; the sampler probes it
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # vLLM's CPU build only: 1 GiB of KV cache (its default is 4 GiB)
}


# ----------------------------------------------------------------------------------------------
# memory cgroups
# ----------------------------------------------------------------------------------------------



def _profiled(fn) -> dict:
    """``fn()`` under torch.profiler with CUDA activities: its wall time (s), the time the device ran
    anything (the union of kernels, copies and memsets, us), the span from its first to its last
    device op (us), device ops and the host's blocking CUDA calls by name: {name: [count, us]}."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    dev, kern, host = [], {}, {}
    for e in prof.events():
        name = e.name
        start, end = e.time_range.start, e.time_range.end
        if e.device_type == torch.autograd.DeviceType.CUDA:
            dev.append((start, end))
            kind = ("memcpy " + name.split("(")[-1].split(")")[0]) if "emcpy" in name else (
                "memset" if "emset" in name else name[:70])
            k = kern.setdefault(kind, [0, 0.0])
            k[0] += 1
            k[1] += end - start
        elif name.startswith(("cuda", "cu")) and any(w in name for w in ("ynchronize", "Memcpy", "LaunchHostFunc",
                                                                        "HostRegister", "StreamWait")):
            h = host.setdefault(name, [0, 0.0])
            h[0] += 1
            h[1] += end - start
    dev.sort()
    busy, cur_s, cur_e = 0.0, None, None
    for s, e in dev:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return {"wall": wall, "busy": busy, "span": (dev[-1][1] - dev[0][0]) if dev else 0.0, "ops": kern, "host": host}


def device_timeline(fn_one, fn_many, steps: int) -> dict:
    """The device's side of ``steps`` decode steps (``MMO_PROFILE_DECODE=1``): ``fn_many`` generates
    ``steps`` tokens more than ``fn_one`` from the same prompts, both profiled (``_profiled``), and
    the difference is summarised per step (so the prefill both share drops out): the wall time, the
    time the GPU ran anything, the idle rest of the span, device ops by name and the host's blocking
    CUDA calls. Tracing adds a few microseconds per launch, so the wall time is longer than the
    unprofiled step; the device durations are the device's own."""
    a, b = _profiled(fn_one), _profiled(fn_many)
    per = max(steps, 1) * 1000.0  # us -> ms per step

    def diff(key, n):
        d = {k: [c - a[key].get(k, [0, 0.0])[0], t - a[key].get(k, [0, 0.0])[1]] for k, (c, t) in b[key].items()}
        return [[k, c, round(t / per, 4)] for k, (c, t) in sorted(d.items(), key=lambda kv: -kv[1][1])[:n]]

    busy, span = b["busy"] - a["busy"], b["span"] - a["span"]
    return {"steps": steps, "wall_ms_per_step": round(1000 * (b["wall"] - a["wall"]) / max(steps, 1), 3),
            "device_busy_ms_per_step": round(busy / per, 3), "device_span_ms_per_step": round(span / per, 3),
            "device_idle_ms_per_step": round((span - busy) / per, 3),
            "device_ops": diff("ops", 14), "host_cuda_calls": diff("host", 8)}


class HostSampler:
    """Where the engine's host thread spends the timed decode (``MMO_SAMPLE_DECODE=1``): a thread
    samples this thread's Python stack every ``interval`` seconds and counts, per function, the samples
    it is on the stack (inclusive) and on top (self), as fractions of the sampled time. Statistical, low
    overhead. The sampler needs the GIL to look: while the thread runs Python (or a C call that holds
    the GIL) a look comes only at its next switch (~5 ms), so each look is weighted by the time since
    the previous one; a C call that releases the GIL (a CUDA sync, a native copy wait) shows as the
    Python line that called it."""

    def __init__(self, interval: float = 0.001, top: int = 40):
        self.interval, self.top = interval, top
        self.target = threading.get_ident()
        self.incl: dict[str, float] = {}
        self.self_: dict[str, float] = {}
        self.samples, self.total = 0, 0.0
        self._keys: dict = {}  # code object -> "file:function" (a look holds the GIL: keep it short)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="mmo-host-sampler", daemon=True)
        self._t.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            f = sys._current_frames().get(self.target)
            now = time.perf_counter()
            w, last = now - last, now
            if f is None:
                continue
            self.samples += 1
            self.total += w
            seen = set()
            top = True
            keys = self._keys
            while f is not None:
                co = f.f_code
                key = keys.get(co)
                if key is None:
                    key = keys[co] = (f"{co.co_filename.rsplit('/site-packages/', 1)[-1].rsplit('/work/main/', 1)[-1]}:"
                                      f"{co.co_name}")
                if top:
                    key_line = f"{key}:{f.f_lineno}"
                    self.self_[key_line] = self.self_.get(key_line, 0) + w
                    top = False
                if key not in seen:
                    seen.add(key)
                    self.incl[key] = self.incl.get(key, 0) + w
                f = f.f_back

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        n = max(self.total, 1e-9)

        def best(d):
            return [[k, round(v / n, 4)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[: self.top]]

        return {"samples": self.samples, "seconds": round(self.total, 4), "interval_s": self.interval,
                "inclusive": best(self.incl),
                "self": best(self.self_)}

class Cgroup:
    """A child memory cgroup (v2, else v1) with ``mem_max`` bytes (None = no cap, still measured).

    ``kind`` is "v2", "v1" or "none" (no writable memory cgroup: nothing is capped or measured;
    ``reason`` says why). Created under this process's own cgroup (v2: its parent when the own group
    holds processes and so cannot delegate); root needed."""

    STAT_KEYS = ("anon", "file", "shmem", "file_dirty", "file_mapped", "unevictable", "kernel",  # v2
                 "rss", "cache", "mapped_file", "dirty")  # v1 names

    def __init__(self, name: str, mem_max: int | None = None, create: bool = True):
        self.name, self.mem_max = name, mem_max
        self.kind, self.path, self.reason = "none", None, "" if create else "not asked for"
        if not create:
            return
        try:
            self.path, self.kind = _make_cgroup(name)
        except OSError as exc:
            self.reason = f"{type(exc).__name__}: {exc}"
            return
        if self.kind == "v2":
            if mem_max is not None:
                _write(self.path / "memory.max", str(int(mem_max)))
            _write(self.path / "memory.swap.max", "0", missing_ok=True)
            _write(self.path / "memory.oom.group", "1", missing_ok=True)  # kill every process of the child
        elif mem_max is not None:
            _write(self.path / "memory.limit_in_bytes", str(int(mem_max)))
            try:
                _write(self.path / "memory.memsw.limit_in_bytes", str(int(mem_max)), missing_ok=True)
            except OSError:
                pass

    @property
    def enforced(self) -> bool:
        return self.kind in ("v1", "v2")

    def preexec(self):
        """For ``Popen(preexec_fn=...)``: the forked child joins the group before it execs."""
        path, kind = self.path, self.kind

        def enter():
            if kind in ("v1", "v2"):
                with open(path / "cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))

        return enter

    def peak(self) -> int | None:
        try:
            if self.kind == "v2":
                return int((self.path / "memory.peak").read_text())
            if self.kind == "v1":
                return int((self.path / "memory.max_usage_in_bytes").read_text())
        except (OSError, ValueError):
            pass
        return None

    def oom_kills(self) -> int | None:
        f = {"v2": "memory.events", "v1": "memory.oom_control"}.get(self.kind)
        if f is None:
            return None
        try:
            for line in (self.path / f).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except (OSError, ValueError):
            pass
        return None

    def stat(self) -> dict[str, int]:
        """The memory.stat counters of STAT_KEYS (bytes)."""
        if not self.enforced:
            return {}
        try:
            text = (self.path / "memory.stat").read_text()
        except OSError:
            return {}
        out = {}
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k in self.STAT_KEYS:
                out[k] = int(v)
        return out

    def remove(self) -> None:
        remove_cgroup(self.path)

    def describe(self) -> dict:
        return {"kind": self.kind, "mem_max": self.mem_max, "path": str(self.path) if self.path else None,
                "reason": self.reason}


def proc_status() -> dict[str, int]:
    """This process's VmHWM / VmRSS / RssAnon / RssFile / RssShmem in bytes (Linux; {} elsewhere)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def remove_cgroup(path: Path | None) -> None:
    """Remove a child cgroup's folder (None: nothing), retrying for 5 s while its last process exits."""
    if path is None:
        return
    for _ in range(50):
        try:
            path.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def _write(path: Path, text: str, missing_ok: bool = False) -> None:
    if missing_ok and not path.exists():
        return
    path.write_text(text)


def _own_cgroup() -> tuple[str | None, str | None]:
    v1 = v2 = None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "":
            v2 = path
        elif "memory" in ctrls.split(","):
            v1 = path
    return v1, v2


def _make_cgroup(name: str) -> tuple[Path, str]:
    v1, v2 = _own_cgroup()
    root = Path("/sys/fs/cgroup")
    if v1 is not None and (root / "memory").is_dir():
        path = root / "memory" / v1.lstrip("/") / name
        path.mkdir(exist_ok=True)
        return path, "v1"
    if v2 is not None and (root / "cgroup.controllers").exists():
        own = root / v2.lstrip("/")
        # a v2 group with processes cannot delegate controllers to children, except the root
        for base in ((own, own.parent) if own != root else (root,)):
            try:
                if "memory" not in (base / "cgroup.subtree_control").read_text().split():
                    (base / "cgroup.subtree_control").write_text("+memory")
                path = base / name
                path.mkdir(exist_ok=True)
                if (path / "memory.max").exists():
                    return path, "v2"
            except OSError:
                continue
        raise OSError("no writable cgroup v2 parent with the memory controller")
    raise OSError("no cgroup memory controller mounted")


# ----------------------------------------------------------------------------------------------
# parent: run one child
# ----------------------------------------------------------------------------------------------


def cpu_calibration(torch=None, iters: int = 400, repeats: int = 7) -> float:
    """Microseconds per iteration of a fixed launching-thread-like loop (a dict update and one
    small in-place torch op: interpreter and dispatcher work, no memory streaming), the best of
    ``repeats``. A decode step in eager mode is this thread's CPU time, and on the H200's host that
    speed differed by up to 1.44x between two children of one run with nothing else running (no
    offload: 12.56 and 18.07 ms per step, session 20); the figure lets rows of different children
    be read against their own thread's speed."""
    x = torch.zeros(8) if torch is not None else None
    d: dict[int, int] = {}
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(iters):
            d[i & 7] = i
            if x is not None:
                x.add_(1.0)
        best = min(best, time.perf_counter() - t)
    return round(best / iters * 1e6, 3)


def _thread_rusage() -> dict:
    """This thread's context switches so far: nvcsw (it waited), nivcsw (it was preempted); 0 where
    the platform has no per-thread rusage."""
    try:
        import resource

        ru = resource.getrusage(resource.RUSAGE_THREAD)
        return {"nvcsw": ru.ru_nvcsw, "nivcsw": ru.ru_nivcsw}
    except (ImportError, AttributeError, OSError):
        return {"nvcsw": 0, "nivcsw": 0}


def system_cpu(path: str = "/proc/stat") -> dict:
    """The whole machine's CPU time so far, in seconds summed over its CPUs (/proc/stat's first line):
    ``busy`` (user, nice, system, irq, softirq), ``idle`` (idle, iowait) and ``steal`` (time the
    hypervisor ran something else while this guest's CPU wanted to run); {} where unreadable."""
    try:
        with open(path) as f:
            head = f.readline().split()
        tick = float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError):
        return {}
    if not head or head[0] != "cpu":
        return {}
    user, nice, system, idle, iowait, irq, softirq, steal = ([int(x) for x in head[1:9]] + [0] * 8)[:8]
    return {"busy": (user + nice + system + irq + softirq) / tick, "idle": (idle + iowait) / tick, "steal": steal / tick}


def file_stem(label: str) -> str:
    """``label`` as one file name (its child's spec, events, log and cgroup): characters other than
    letters, digits, ``.``, ``_``, ``-``, ``=``, ``:`` and ``,`` become ``_``, plus a short hash of the label
    when any was replaced, so that two labels never share files (a config option naming a path,
    ``env.VAR=/tmp/x.so``, made a label with ``/`` in it: session 17 lost a run to it)."""
    safe = re.sub(r"[^A-Za-z0-9._=:,-]", "_", label)[:120]
    if safe == label:
        return safe
    return f"{safe}~{hashlib.sha1(label.encode()).hexdigest()[:8]}"


def run_child(spec: dict, *, workdir: Path, mem_max: int | None = None, timeout: float = 600.0,
              cgroup: bool = True, python: str | None = None, echo=print) -> dict:
    """Run one vLLM configuration (``spec``) in its own process and cgroup; return what happened.

    Returns ``label, outcome, returncode, wall_s, events, tasks, ready, cgroup`` where ``outcome``
    is "ok" (the child reported ``done``), "killed (OOM)" (the cgroup's oom_kill counter rose, or
    SIGKILL under an enforced cap), "killed (timeout)", or "failed (rc N): <last error>".
    ``cgroup`` has the cap, ``peak`` (memory.peak / max_usage_in_bytes), ``oom_kill`` and the
    maxima of memory.stat sampled every 50 ms (``stat_max``)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    label = spec["label"]
    stem = file_stem(label)
    spec_path, events_path, log_path = (workdir / f"{stem}.{s}" for s in ("spec.json", "events.jsonl", "log"))
    events_path.unlink(missing_ok=True)
    spec = dict(spec, events=str(events_path))
    spec_path.write_text(json.dumps(spec, indent=1))
    cg = Cgroup(f"mmo-{stem}-{os.getpid()}", mem_max, create=cgroup)
    stat_max: dict[str, int] = {}
    stop = threading.Event()

    def sample():
        while not stop.wait(0.05):
            s = cg.stat()
            for k, v in s.items():
                stat_max[k] = max(stat_max.get(k, 0), v)
            if s:
                anon_shm = s.get("anon", s.get("rss", 0)) + s.get("shmem", 0)
                stat_max["anon+shmem"] = max(stat_max.get("anon+shmem", 0), anon_shm)

    cmd = [python or sys.executable, str(Path(__file__).resolve()), "--spec", str(spec_path)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec.get("env") or {})  # a configuration's own win over this process's (the child only sets defaults)
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                preexec_fn=cg.preexec(), start_new_session=True)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        seen = 0
        try:
            while True:
                try:
                    proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    pass
                seen = _echo_events(events_path, seen, label, echo)
                if time.perf_counter() - t0 > timeout:
                    timed_out = True
                    _kill_group(proc)
                    proc.wait()
                    break
        except BaseException:
            _kill_group(proc)
            proc.wait()
            raise
        finally:
            stop.set()
            sampler.join()
        _echo_events(events_path, seen, label, echo)
    wall = time.perf_counter() - t0
    events = read_events(events_path)
    rc = proc.returncode
    oom = cg.oom_kills()
    last = events[-1] if events else {}
    if timed_out:
        outcome = "killed (timeout)"
    elif (oom or 0) > 0 or (rc == -signal.SIGKILL and cg.enforced and mem_max is not None):
        outcome = "killed (OOM)"
    elif rc == 0 and last.get("event") == "done":
        outcome = "ok"
    else:
        err = next((e.get("error") for e in reversed(events) if e.get("error")), None)
        outcome = f"failed (rc {rc})" + (f": {err[:300]}" if err else "")
    res = {
        "label": label, "outcome": outcome, "returncode": rc, "wall_s": round(wall, 2), "events": events,
        "tasks": [e for e in events if e.get("event") == "task"],
        "ready": next((e for e in events if e.get("event") == "ready"), None),
        "last_event": last.get("event"),
        "cgroup": {**cg.describe(), "peak": cg.peak(), "oom_kill": oom, "stat_max": stat_max},
        "log": str(log_path),
    }
    if outcome != "ok":
        res["log_tail"] = _tail(log_path, 40)
    cg.remove()
    return res


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def read_events(path: Path) -> list[dict]:
    out = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return out


def _echo_events(path: Path, seen: int, label: str, echo) -> int:
    ev = read_events(path)
    for e in ev[seen:]:
        if echo is not None:
            echo(f"  [{label}] {_brief(e)}")
    return max(seen, len(ev))


def _brief(e: dict) -> str:
    kind = e.get("event")
    if kind == "task":
        r = e.get("result", {})
        keys = ("tok_s", "tokens", "seconds", "error", "skipped", "installed")
        return f"task {e.get('name')}: " + ", ".join(f"{k}={str(r[k])[:120]}" for k in keys if k in r)
    if kind == "ready":
        return f"ready in {e.get('ready_s')} s (process {e.get('t')} s)"
    return json.dumps({k: v for k, v in e.items() if k not in ("model_info", "summary", "env")})[:300]


# ----------------------------------------------------------------------------------------------
# routing traces (the CSV format of mmap_offload.traces; the replay mirrors the backend's)
# ----------------------------------------------------------------------------------------------


class TraceRouting:
    """Wraps each MoE layer's ``router.select_experts`` (this process's model): optionally replace
    the top-k ids by a trace's (``trace``), optionally count the routed experts (``record``).

    The step counter advances after the last MoE layer of every forward, trace on or off, as the
    backend's does. Used where the mmap backend's own ``routing_trace`` does not act: no offload,
    vLLM's uva, and mmap layer streaming (which routes nothing); and in every decode task, trace or
    not, for ``timing``.

    ``timing`` (seconds, cumulative; the launching thread's wall time, the same for every
    configuration): ``router_s`` inside ``select_experts`` (vLLM's router, the trace's substitution,
    and the mmap backend's patch 4 ``route()`` where it wraps the router: installed after the model
    loads, this wrapper is the outer one), ``gap_s`` from one MoE layer's router to the next one's in
    the same forward (vLLM's MoE kernel, the layer's other work, the next attention; with the mmap
    backend its patch 4b too), ``outside_s`` from the last MoE layer's router to the next forward's
    first (sampling, scheduling, the tail and head of the model). What separates vLLM's own per-layer
    time under our threads from its time without them (no offload, uva).

    The stream's side of the same clock (``probe``: on where CUDA is, one timing event per MoE
    layer): each router records an event on the current stream when the thread enters it, and asks
    whether the stream has reached the previous layer's (``behind``/``probed``: the stream more than a
    layer behind the thread); once a forward's events are done, its first-to-last router span on the
    stream (``gpu_span_s``) and on the thread (``cpu_span_s``) are added (``spans`` forwards). A stream
    span longer than the thread's is the stream falling behind through the layers (the step bound by
    the device's work and the host functions on the stream); equal spans with the stream rarely behind
    is a step bound by the launching thread."""

    SETS = 4  # forwards whose events may be in flight at once (a forward's are read once done)

    def __init__(self, num_experts: int = 1, probe: bool | None = None, event_factory=None):
        self.num_experts = num_experts
        self.trace = None
        self._dev = None  # (trace, device, traces.DeviceTrace): the trace on the router's device
        self.step = 0
        self.record = None  # list of per-layer numpy counts while recording
        self.routers: list = []
        self.timing = {"router_s": 0.0, "gap_s": 0.0, "outside_s": 0.0, "router_calls": 0,
                       "gpu_span_s": 0.0, "cpu_span_s": 0.0, "spans": 0, "behind": 0, "probed": 0}
        self._exit: float | None = None  # when the last router returned
        self.probe = probe  # None: on where any of the model's parameters is on CUDA (decided at install)
        self._event_factory = event_factory
        self._sets: list | None = None  # SETS lists of per-layer events
        self._cur = 0  # the set this forward records into
        self._n_rec = 0  # events recorded in this forward, in layer order
        self._t_first = 0.0
        self._pending: list = []  # (set index, thread span) of finished forwards whose events may not be done yet
        self._graph: dict | None = None  # prepare_graphs: the trace, its step and its switch on the device

    def prepare_graphs(self, trace, device) -> None:
        """Graph-safe replay, for an engine that captures the routers in CUDA graphs (vLLM's FULL decode
        graphs under uva or no offload: without this a replayed step routes as the model does, whatever
        ``set_trace`` said). Called before the capture: ``trace`` is copied to ``device`` once, the step
        and an on/off switch live there too, and every routed call reads all three on the device
        (``traces.DeviceTrace.ids_at``, then a select on the switch), so each replay takes the trace's
        next rows; ``set_trace`` later changes their contents, never their addresses."""
        import torch

        from mmap_offload.traces import DeviceTrace

        dt = DeviceTrace(trace, device, self.num_experts)
        dt.warm(torch.int32, torch.int64)  # the router's ids' dtypes: none made during a capture
        self._graph = {"trace": dt, "step": torch.zeros(1, dtype=torch.int64, device=device),
                       "on": torch.zeros((), dtype=torch.bool, device=device)}

    def set_trace(self, trace) -> None:
        """Replace the routers' ids by ``trace``'s (None: the model's own routing from now on)."""
        g = self._graph
        if g is not None:
            if trace is not None:
                g["trace"].load(trace)  # refuses another shape: the graphs hold this one's addresses
            g["on"].fill_(trace is not None)
        self.trace = trace

    def _probe(self, pos: int, n_layers: int, t_in: float) -> None:
        """The stream's side at router ``pos`` (see the class doc)."""
        if self._sets is None:
            if self._event_factory is None:
                import torch

                self._event_factory = lambda: torch.cuda.Event(enable_timing=True)
            self._sets = [[self._event_factory() for _ in range(n_layers)] for _ in range(self.SETS)]
        timing = self.timing
        if pos == 0:
            self.flush()
            if len(self._pending) >= self.SETS - 1:  # not done after SETS - 1 forwards: its set is reused
                self._pending.pop(0)
            busy = {i for i, _ in self._pending}
            self._cur = next(i for i in range(self.SETS) if i not in busy)
            self._n_rec = 0
            self._t_first = t_in
        elif self._n_rec == pos:
            timing["probed"] += 1
            if not self._sets[self._cur][pos - 1].query():
                timing["behind"] += 1
        if self._n_rec != pos:  # a forward that skipped a layer (or began mid-way): not a span
            return
        self._sets[self._cur][pos].record()
        self._n_rec += 1
        if pos == n_layers - 1:
            self._pending.append((self._cur, t_in - self._t_first))

    def flush(self) -> None:
        """Adds the spans of the finished forwards whose events the stream has passed (in order: one
        stream). The runner calls it after each timed run's sync, so a run's spans are its own."""
        timing = self.timing
        while self._pending and self._sets[self._pending[0][0]][-1].query():
            i, cpu = self._pending.pop(0)
            evs = self._sets[i]
            timing["gpu_span_s"] += evs[0].elapsed_time(evs[-1]) / 1000.0
            timing["cpu_span_s"] += cpu
            timing["spans"] += 1

    def install(self, model) -> int:
        routers = []
        for mod in model.modules():
            r = getattr(mod, "router", None)
            if r is not None and hasattr(r, "select_experts") and hasattr(mod, "routed_experts"):
                if all(r is not x for x in routers):
                    routers.append(r)
        if self.probe is None:
            self.probe = (any(p.is_cuda for p in model.parameters())
                          and not os.environ.get("MMO_NO_STREAM_PROBE"))
        for pos, r in enumerate(routers):
            self._wrap(pos, r, len(routers))
        self.routers = routers
        return len(routers)

    def _wrap(self, pos: int, router, n_layers: int) -> None:
        import torch

        from mmap_offload.traces import DeviceTrace

        orig = router.select_experts

        timing, clock = self.timing, time.perf_counter

        def select_experts(*args, **kwargs):
            t_in = clock()
            if self._exit is not None:
                timing["gap_s" if pos else "outside_s"] += t_in - self._exit
            if self.probe and not (self._graph is not None and torch.cuda.is_current_stream_capturing()):
                self._probe(pos, n_layers, t_in)
            w, ids = orig(*args, **kwargs)
            g = self._graph
            if g is not None:  # device ops only: what a CUDA graph captures here replays the trace
                ids = torch.where(g["on"], g["trace"].ids_at(g["step"], pos, int(ids.shape[0]), int(ids.shape[-1]),
                                                             ids.dtype), ids)
                if pos == n_layers - 1:
                    g["step"].add_(1)
            elif self.trace is not None:
                if self._dev is None or self._dev[0] is not self.trace or self._dev[1] != ids.device:
                    self._dev = (self.trace, ids.device, DeviceTrace(self.trace, ids.device, self.num_experts))
                ids = self._dev[2].ids(self.step, pos, int(ids.shape[0]), int(ids.shape[-1]), ids.dtype)
            if self.record is not None:
                c = torch.bincount(ids.reshape(-1).long(), minlength=self.num_experts).cpu().numpy()
                self.record.append((pos, c))
            if pos == n_layers - 1:
                self.step += 1
            self._exit = clock()
            timing["router_s"] += self._exit - t_in
            timing["router_calls"] += 1
            return w, ids

        select_experts._trace_routing = True  # type: ignore[attr-defined]
        router.select_experts = select_experts


# ----------------------------------------------------------------------------------------------
# child
# ----------------------------------------------------------------------------------------------


class _Child:
    def __init__(self, spec: dict):
        self.spec = spec
        self.t0 = time.perf_counter()
        self.events = open(spec["events"], "a", buffering=1)
        self.deadline_at = spec.get("deadline_at")
        self.llm = None
        self.routing = TraceRouting(int(spec.get("num_experts", 1)))
        self.routing_installed = None
        self.torch = None

    def emit(self, event: str, **kw) -> None:
        kw = {"event": event, "t": round(time.perf_counter() - self.t0, 2), **kw}
        self.events.write(json.dumps(kw, default=_json_default) + "\n")
        self.events.flush()
        os.fsync(self.events.fileno())  # a kill right after must not lose the line

    # -- measurements --------------------------------------------------------------------------
    def mem(self, cuda: bool = True) -> dict:
        """This process's memory (/proc/self/status) and, once vLLM is up (``cuda``), CUDA's and
        torch's pinned allocator's counters (not before: no CUDA context ahead of vLLM's own)."""
        out = proc_status()
        torch = self.torch
        if cuda and torch is not None and torch.cuda.is_available():
            out["cuda_max_allocated"] = int(torch.cuda.max_memory_allocated())
            out["cuda_allocated"] = int(torch.cuda.memory_allocated())
            free, total = torch.cuda.mem_get_info()
            out["cuda_used"] = int(total - free)
            try:
                hs = torch.cuda.host_memory_stats()
                out["torch_pinned_peak"] = int(hs.get("allocated_bytes.peak", 0) or 0)
                out["torch_pinned_current"] = int(hs.get("allocated_bytes.current", 0) or 0)
                out["torch_pinned_active_peak"] = int(hs.get("active_bytes.peak", 0) or 0)
            except Exception:  # noqa: BLE001 - older torch
                pass
        return out

    def offloader(self):
        try:
            from vllm.model_executor.offloader import get_offloader

            return get_offloader()
        except Exception:  # noqa: BLE001
            return None

    def wait_background_check(self, timeout: float = 300.0) -> float:
        """Seconds spent waiting for the mmap backend's background checksum pass (0 where there is
        none or it is over): a decode task times steady serving, and the pass takes the GIL for each
        expert's hash while it runs (it starts at post_init; on a large cache it outlasts start-up)."""
        bg = getattr(self.offloader(), "_background_check", None)
        if bg is None or bg.done:
            return 0.0
        t = time.perf_counter()
        bg.wait(timeout)
        return round(time.perf_counter() - t, 3)

    def summary(self) -> dict | None:
        off = self.offloader()
        if off is not None and hasattr(off, "summary"):
            try:
                return _plain(off.summary())
            except Exception as e:  # noqa: BLE001
                return {"error": f"{type(e).__name__}: {e}"}
        return None

    def sync(self) -> None:
        if self.torch is not None and self.torch.cuda.is_available():
            self.torch.cuda.synchronize()

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        spec = self.spec
        for k, v in {**CHILD_ENV, **spec.get("env", {})}.items():
            os.environ.setdefault(k, str(v))
        self.emit("start", pid=os.getpid(), label=spec["label"], mem=self.mem())
        if "selftest" in spec:
            return self.selftest(spec["selftest"])
        try:
            import torch

            self.torch = torch
            import vllm
            from vllm import LLM

            if spec.get("register_backend"):
                register_backend()
            self.emit("imported", vllm=getattr(vllm, "__version__", "?"), torch=torch.__version__,
                      gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, mem=self.mem(False))
            kw = dict(spec["llm"])
            if "cpu_offload_params" in kw:
                kw["cpu_offload_params"] = set(kw["cpu_offload_params"])
            paths = [t["path"] for t in spec.get("tasks", []) if t.get("kind") == "trace" and t.get("path")]
            compiled = not kw.get("enforce_eager")
            if paths and (os.environ.get("MMO_ROUTING_AT_LOAD") == "1" or (compiled and not spec.get("register_backend"))):
                self._route_at_load(paths[0], compiled)
            t = time.perf_counter()
            self.llm = LLM(**kw)
            ready_s = time.perf_counter() - t
            info = self.model_info()
            self.emit("ready", ready_s=round(ready_s, 2), model_info=info, summary=self.summary(), mem=self.mem())
            # the first mmap child builds the cache while loading: its GiBs of dirty pages would be
            # written back during its timed tasks (the kernel flushes them ~30 s later), taking memory
            # bandwidth and CPU from that child alone. Write them now, untimed (later children: ~0 s).
            t = time.perf_counter()
            os.sync()
            self.emit("synced", seconds=round(time.perf_counter() - t, 3))
        except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
            import traceback

            self.emit("error", stage="build", error=f"{type(e).__name__}: {e}"[:3000],
                      traceback=traceback.format_exc()[-6000:], mem=self.mem())
            return 1
        rc = 0
        for task in spec.get("tasks", []):
            name = task.get("name") or task["kind"]
            if self.deadline_at is not None and time.time() > self.deadline_at:
                self.emit("task", name=name, kind=task["kind"], result={"skipped": "deadline"})
                continue
            t = time.perf_counter()
            try:
                result = getattr(self, "task_" + task["kind"])(task)
            except BaseException as e:  # noqa: BLE001
                import traceback

                result = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-4000:]}
                rc = 1
            result["wall_s"] = round(time.perf_counter() - t, 3)
            self.emit("task", name=name, kind=task["kind"], result=result, mem=self.mem())
        self.emit("done", summary=self.summary(), mem=self.mem())
        return rc

    def selftest(self, st: dict) -> int:
        """No vLLM: allocate and touch ``alloc_mib``, hold ``hold_s``, exit with ``rc`` (tests of the
        runner: cgroup peak, OOM kill, timeout, failure)."""
        buf = bytearray(int(st.get("alloc_mib", 0)) << 20)
        for i in range(0, len(buf), 4096):
            buf[i] = 1
        self.emit("task", name="alloc", kind="selftest", result={"bytes": len(buf)}, mem=self.mem())
        time.sleep(float(st.get("hold_s", 0)))
        if st.get("rc"):
            self.emit("error", stage="selftest", error=f"asked to fail with {st['rc']}")
            return int(st["rc"])
        self.emit("done", mem=self.mem())
        return 0

    def model_info(self) -> dict:
        """MoE kernel class, expert parameter bytes where they live (GPU / uva host / CPU)."""
        off = self.offloader()

        def info(model):
            torch = self.torch
            out = {"moe_layers": 0, "expert_bytes_device": 0, "expert_bytes_uva": 0, "expert_bytes_cpu": 0,
                   "param_bytes_device": 0, "uva_layers": [], "offloader": None}
            seen = set()
            for n, p in model.named_parameters():
                nb = p.numel() * p.element_size()
                ptr = (p.device.type, p.data_ptr())
                if ptr in seen:
                    continue
                seen.add(ptr)
                uva = bool(getattr(p, "_vllm_is_uva_offloaded", False))
                if p.device.type != "cpu" and not uva:
                    out["param_bytes_device"] += nb
                if ".experts." in f".{n}." or ".routed_experts." in f".{n}.":
                    key = "expert_bytes_uva" if uva else ("expert_bytes_cpu" if p.device.type == "cpu"
                                                         else "expert_bytes_device")
                    out[key] += nb
            for mod in model.modules():
                if getattr(mod, "quant_method", None) is None:
                    continue
                own = dict(mod.named_parameters(recurse=False))
                if not any(k.startswith("w13_") for k in own):
                    continue
                out["moe_layers"] += 1
                tot = sum(p.numel() * p.element_size() for p in own.values())
                uva = sum(p.numel() * p.element_size() for p in own.values()
                          if getattr(p, "_vllm_is_uva_offloaded", False))
                out["uva_layers"].append(round(uva / tot, 4) if tot else 0.0)
                if out["moe_layers"] == 1:
                    qm = mod.quant_method
                    out["moe_method"] = type(qm).__name__
                    mk = getattr(qm, "moe_kernel", None)
                    fe = getattr(mk, "fused_experts", None) if mk is not None else None
                    out["moe_experts_kernel"] = type(fe).__name__ if fe is not None else None
                    out["expert_params"] = {k: [list(p.shape), str(p.dtype)] for k, p in own.items()}
            if off is not None:
                out["offloader"] = type(off).__name__
                extra = _backend_vram(off)
                out.update(extra)
            if torch.cuda.is_available():
                out["cuda_allocated_after_build"] = int(torch.cuda.memory_allocated())
            return out

        try:
            return self.llm.apply_model(info)[0]
        except Exception as e:  # noqa: BLE001
            return {"error": f"apply_model failed: {type(e).__name__}: {e}"}

    # -- tasks -------------------------------------------------------------------------------------
    def _sp(self, max_tokens: int):
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)

    def _gen(self, prompts, max_tokens: int):
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], self._sp(max_tokens),
                                 use_tqdm=False)

    def _prompts(self, n: int, length: int, seed: int) -> list[list[int]]:
        import random

        rng = random.Random(seed)
        vocab = int(self.spec.get("vocab_size", 1000))
        return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]

    def _timed(self, prompts, max_tokens: int) -> tuple[float, list, dict | None, dict | None]:
        """(seconds, outputs, backend summary before, after); ``self.last_thread`` gets this thread's
        CPU seconds and context switches over the same call (the engine runs in-process: this is
        the thread that launches the model's GPU work)."""
        s0 = self.summary()
        self.sync()
        self.routing.flush()
        ru0, c0, l0, m0 = _thread_rusage(), time.thread_time(), dict(self.routing.timing), system_cpu()
        t = time.perf_counter()
        outs = self._gen(prompts, max_tokens)
        self.sync()
        dt = time.perf_counter() - t
        self.routing.flush()
        c1, ru1, l1, m1 = time.thread_time(), _thread_rusage(), self.routing.timing, system_cpu()
        self.last_thread = {"cpu_s": c1 - c0, **{k: ru1[k] - ru0[k] for k in ru0}}
        self.last_system = {k: m1[k] - m0[k] for k in m0 if k in m1}
        self.last_layers = {k: l1[k] - l0[k] for k in l0}
        return dt, outs, s0, self.summary()

    def task_greedy(self, task: dict) -> dict:
        dt, outs, s0, s1 = self._timed(task["prompts"], int(task.get("max_tokens", 16)))
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(dt, 4),
                "summary_before": s0, "summary_after": s1}

    def task_decode(self, task: dict) -> dict:
        b, T = int(task["batch"]), int(task["tokens"])
        plen = int(task.get("prompt_len", 16))
        try:  # the per-layer timing (TraceRouting.timing) in every configuration
            self._ensure_routing()
        except Exception:  # noqa: BLE001 - no model reachable: the row goes without it
            self.routing_installed = 0
        seed = int(task.get("seed", 1000 + b))
        # steady serving: the checksum pass over (it holds the GIL per hash), within the child's deadline
        left = None if self.deadline_at is None else max(0.0, self.deadline_at - time.time())
        bg_wait = self.wait_background_check(300.0 if left is None else min(300.0, left))
        warm = self._prompts(b, plen, seed + 7)
        self._gen(warm, int(task.get("warmup_tokens", 4)))  # this batch size's kernels
        prompts = self._prompts(b, plen, seed)
        sampler = HostSampler() if os.environ.get("MMO_SAMPLE_DECODE") else None
        # ``repeats`` timed pairs (1 token, then T + 1), the row from the median one by decode time: on the
        # H200's VM one vCPU's speed flips between ~1.0x and ~1.85x for seconds at a time, whatever runs in
        # the VM (bench_cpu_pairs.py, session 36), and a single pair reads whichever state the launching
        # thread's CPU was in; each pair's own calibration goes with it
        reps = []
        for _ in range(max(1, int(task.get("repeats", 1)))):
            # this thread's speed, then a 1-token run: the per-layer clock's first span of the timed 1-token
            # run must not count the calibration (its difference with the T-token run's would go below the
            # truth: session 20's runs 2-3, ~0.1-0.15 ms per step)
            calib = cpu_calibration(self.torch)
            self._gen(warm, 1)
            one = {"calib": calib}
            one["t1"], _, one["a0"], one["a1"] = self._timed(prompts, 1)
            one["th1"], one["ly1"] = self.last_thread, self.last_layers
            one["tT"], one["outs"], one["b0"], one["b1"] = self._timed(prompts, T + 1)
            one["thT"], one["lyT"], one["syT"] = self.last_thread, self.last_layers, self.last_system
            one["dec"] = max(one["tT"] - one["t1"], 1e-9)
            reps.append(one)
        chosen = sorted(range(len(reps)), key=lambda i: reps[i]["dec"])[len(reps) // 2]
        r = reps[chosen]
        dec, calib, t1, a0, a1, th1, ly1 = (r[k] for k in ("dec", "calib", "t1", "a0", "a1", "th1", "ly1"))
        tT, outs, b0, b1, thT, lyT, syT = (r[k] for k in ("tT", "outs", "b0", "b1", "thT", "lyT", "syT"))
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res = {"batch": b, "tokens": T, "generated": n, "seconds": round(dec, 4), "t_1": round(t1, 4),
               "t_T1": round(tT, 4), "tok_s": round(b * T / dec, 2), "step_ms": round(1000 * dec / T, 3),
               "summary_1": [a0, a1], "summary_T1": [b0, b1],
               # the launching thread per decode step (the same difference): its CPU time, and its forced
               # (preempted) and voluntary (waited) context switches
               "thread_cpu_ms": round(1000 * (thT["cpu_s"] - th1["cpu_s"]) / T, 3),
               "thread_nivcsw": round((thT["nivcsw"] - th1["nivcsw"]) / T, 2),
               "thread_nvcsw": round((thT["nvcsw"] - th1["nvcsw"]) / T, 2), "cpu_calib_us": calib,
               "bg_check_wait_s": bg_wait, "repeats": len(reps), "rep_chosen": chosen,
               "rep_tok_s": [round(b * T / x["dec"], 2) for x in reps], "rep_calib_us": [x["calib"] for x in reps]}
        if syT:  # the whole machine over the T-token run (not a difference: /proc/stat counts 10 ms ticks)
            tot = syT["busy"] + syT["idle"] + syT["steal"]
            res["sys_busy_cpus"] = round(syT["busy"] / max(tT, 1e-9), 2)  # CPUs busy on average
            res["sys_steal_frac"] = round(syT["steal"] / tot, 4) if tot > 0 else 0.0  # the hypervisor's share
        if lyT["router_calls"] > ly1["router_calls"]:  # per decode step, the same difference (TraceRouting.timing)
            res.update({f"layers_{k[:-2]}_ms": round(1000 * (lyT[k] - ly1[k]) / T, 3)
                        for k in ("router_s", "gap_s", "outside_s")})
            res["layers_per_step"] = round((lyT["router_calls"] - ly1["router_calls"]) / T, 2)
        spans, probed = lyT["spans"] - ly1["spans"], lyT["probed"] - ly1["probed"]
        if spans > 0:  # per decode forward: first to last MoE router on the stream and on the thread
            res["layers_gpu_span_ms"] = round(1000 * (lyT["gpu_span_s"] - ly1["gpu_span_s"]) / spans, 3)
            res["layers_cpu_span_ms"] = round(1000 * (lyT["cpu_span_s"] - ly1["cpu_span_s"]) / spans, 3)
        if probed > 0:  # routers entered with the stream not yet at the previous layer's
            res["stream_behind_frac"] = round((lyT["behind"] - ly1["behind"]) / probed, 3)
        if sampler is not None:
            res["host_profile"] = sampler.stop()
        if os.environ.get("MMO_PROFILE_DECODE") and self.torch is not None and self.torch.cuda.is_available():
            n = int(os.environ.get("MMO_PROFILE_STEPS", "8"))
            try:  # n + 1 tokens minus 1 token: n decode steps, the prefill taken out
                res["device_profile"] = device_timeline(lambda: self._gen(prompts, 1),
                                                        lambda: self._gen(prompts, n + 1), n)
            except Exception as e:  # a profiler failure costs the view, not the row
                res["device_profile"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        return res

    def task_prefill(self, task: dict) -> dict:
        n, reps = int(task["tokens"]), int(task.get("repeats", 3))
        seed = int(task.get("seed", 5000))
        self._gen(self._prompts(1, n, seed + 99), 1)  # warm-up: kernels and attention for this length
        times, sums = [], []
        for r in range(reps):
            dt, _, s0, s1 = self._timed(self._prompts(1, n, seed + r), 1)
            times.append(dt)
            sums.append([s0, s1])
        med = statistics.median(times)
        return {"tokens": n, "seconds": round(med, 4), "all_seconds": [round(t, 4) for t in times],
                "tok_s": round(n / med, 2), "summary": sums[len(sums) // 2]}

    def _route_at_load(self, path: str, compiled: bool) -> None:
        """TraceRouting installed as the model runner loads the model, before vLLM captures CUDA graphs,
        with the trace at ``path`` copied to the device for graph-safe replay (``prepare_graphs``): a
        child whose engine captures its routers (uva or no offload without ``enforce_eager``) routes by
        the trace in replayed steps too. (The mmap backend's children take the trace through its own
        option, and keep the MoE layers out of graphs.) ``MMO_ROUTING_AT_LOAD=1``: the same in any child.

        vLLM's CPU backend compiles the MoE layer's Python, routers included (CUDA keeps it inside an
        opaque op): a trace cannot reach a compiled CPU engine's routers, and such a child fails at load
        with one line."""
        from vllm.v1.worker import gpu_model_runner

        from mmap_offload.traces import read_csv

        trace = read_csv(path)
        classes = [gpu_model_runner.GPUModelRunner]
        try:
            from vllm.v1.worker.cpu_model_runner import CPUModelRunner

            classes.append(CPUModelRunner)
        except Exception:  # noqa: BLE001 - a GPU build without the CPU runner
            pass
        for cls in classes:
            if "load_model" not in cls.__dict__:
                continue
            orig = cls.__dict__["load_model"]

            def load_model(runner, *a, _orig=orig, **kw):
                out = _orig(runner, *a, **kw)
                if self.routing_installed is not None:  # one install per process (a runner calling its base's)
                    return out
                model = runner.get_model()
                device = next(model.parameters()).device
                if compiled and device.type != "cuda":
                    raise RuntimeError(f"a routing trace cannot reach the routers of an engine compiled on {device.type} "
                                       "(vLLM compiles the MoE layers' Python there): pass llm.enforce_eager=true")
                self.routing_installed = self.routing.install(model)
                if self.routing_installed:
                    self.routing.prepare_graphs(trace, device)
                return out

            cls.load_model = load_model

    def _ensure_routing(self) -> int:
        if self.routing_installed is None:
            self.routing_installed = self.llm.apply_model(self.routing.install)[0]
        return self.routing_installed

    def task_trace(self, task: dict) -> dict:
        path = task.get("path")
        n = self._ensure_routing()
        if n == 0:
            raise RuntimeError("no MoE router found (module with router.select_experts and routed_experts)")
        if path:
            from mmap_offload.traces import read_csv

            self.routing.set_trace(read_csv(path))
        else:
            self.routing.set_trace(None)
        return {"installed": n, "trace": path, "shape": list(self.routing.trace.shape) if path else None,
                "graph_safe": self.routing._graph is not None}  # installed at load, its step on the device

    def task_record(self, task: dict) -> dict:
        """Per-layer routed-expert counts of one prefill (not timed)."""
        self._ensure_routing()
        self.routing.record = []
        try:
            self._gen(self._prompts(1, int(task["tokens"]), int(task.get("seed", 7777))), 1)
        finally:
            rec, self.routing.record = self.routing.record, None
        layers: dict[int, list[int]] = {}
        for pos, c in rec:
            if pos not in layers:  # the prompt's prefill is the first call per layer
                layers[pos] = [int(x) for x in c]
        return {"tokens": int(task["tokens"]), "counts": [layers[p] for p in sorted(layers)]}


def _backend_vram(off) -> dict:
    """Device bytes of the mmap backend's expert pools and layer buffers (each once; the expert
    parameters point into them)."""
    out = {}
    try:
        tensors = []
        pf = getattr(off, "prefetcher", None)
        res = getattr(off, "residency", None)
        targets = getattr(off, "targets", []) or []
        layers = [t.layer for t in targets]
        if pf is not None:
            for layer in layers:
                tensors += list(pf.buffer_tensors(layer).values())
            out["mmap_layer_buffers"] = int(getattr(pf, "num_buffers", 0))
            out["mmap_layer_buffer_bytes"] = int(getattr(pf, "num_buffers", 0) * getattr(pf, "layer_nbytes", 0))
        if res is not None:
            for layer in layers:
                tensors += list(res.ec.slots(layer).values())
            out["mmap_pool_bytes"] = int(res.ec.capacity_bytes)
        extra = 0
        mine = set()
        for t in tensors:
            t = getattr(t, "data", t)
            key = (t.device.type, t.data_ptr())
            if t.device.type == "cpu" or key in mine:
                continue
            mine.add(key)
            extra += t.numel() * t.element_size()
        out["mmap_device_bytes"] = extra  # pools + buffers (some are bound as parameters at any time)
    except Exception as e:  # noqa: BLE001 - a backend without these attributes
        out["mmap_device_bytes_error"] = f"{type(e).__name__}: {e}"
    return out


def register_backend() -> None:
    """The mmap backend's ``vllm.general_plugins`` entry point (a checkout on PYTHONPATH is not
    pip-installed, so vLLM does not call it)."""
    try:
        from mmap_offload.vllm_backend import register
    except ImportError:
        from mmap_offload.vllm_plugin import register  # the module before the package split
    register()


def _plain(x):
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _json_default(o):
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:
        pass
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)


def child_main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="one vLLM configuration (spawned by run_child)")
    p.add_argument("--spec", required=True)
    a = p.parse_args(argv)
    spec = json.loads(Path(a.spec).read_text())
    sys.path.insert(0, str(ROOT))
    child = _Child(spec)
    try:
        rc = child.run()
    except BaseException as e:  # noqa: BLE001
        child.emit("error", stage="run", error=f"{type(e).__name__}: {e}"[:2000])
        rc = 1
    child.events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # vLLM's teardown can hang or fail after the work is done: skip it


if __name__ == "__main__":
    child_main()
