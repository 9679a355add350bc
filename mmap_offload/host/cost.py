"""The one cost model of hybrid MoE execution: which missed experts the host computes, which are copied.

Used by both executors: ``host.hybrid.HybridMoE`` (bench_moe's ``mmap-hybrid``) and
``vllm_backend.host_experts.HostExperts`` (the mmap backend's ``hybrid`` option). Per layer call the
misses are split so that the host job and the copy path finish together::

    host_s(k experts, R rows) = xfer + (call[th] + k * base[th] + R * row[th]) * slow_host
    copy_s(n experts)         = (copy_lat + n * expert_bytes / copy_bw) * slow_copy + gpu_call

``call`` and ``copy_lat`` are each side's fixed cost per call (host: the hand-off to the job's thread,
the pool's wake-up, the job set-up; copy: submit and the first chunk); ``base`` is one expert's bytes
over the host kernel's streamed rate at this thread count (a GEMV reads every weight once whatever
the few rows), ``row`` the arithmetic of one more token row (it makes the host lose at prefill and
large batches, where everything is copied); ``gpu_call`` is what the copy side adds before the
host rows are needed (the GPU MoE call, or in vLLM the launches between the copies and the add).
``plan`` tries every host count k (fewest rows first, then least popular: popular misses are copied
so they become resident) and keeps the one that minimises max(host_s, copy_s); k = 0 (copy all) is
always a candidate, so a host slower than the link gets nothing, and so does the host while either
side is not measured yet.

Rates come from measurements, never constants: ``calibrate_host`` times the kernel at this process's
thread counts on experts whose bytes are not in the CPU caches (a pool of distinct experts >= 4x the
last-level cache, each read once per pass), with 1 and 4 experts per call (the fixed cost and the
per-expert cost separate) and at M = 1 and 16 rows; the copy side is calibrated by the caller
(``host.hybrid.calibrate``) or learned from the first copies (vLLM). Every host job and every copy
then updates the model (``observe_host``, ``observe_copy``): a least-squares line ``seconds = fixed +
per_expert x experts`` over the recent calls (decayed; the calibration's slope where the calls do not
vary enough in size to give one), so each side's fixed and per-expert cost follow what the machine
does now (other work on its cores, a busy link). A host time that is only an upper bound (the job had
finished before anyone waited for it) is used only when it says the host is faster than the model.
"""

from __future__ import annotations

import glob
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np
import torch

__all__ = ["Rates", "Plan", "CostModel", "calibrate_host", "rates_from_host", "llc_bytes", "EXPERT_TENSORS",
           "crossover_table", "expected_distinct", "pcie_model_rates"]

EXPERT_TENSORS = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")


@dataclass
class Rates:
    """Measured rates of one machine (module docstring). Seconds, bytes and bytes/s; dicts by thread count."""

    expert_bytes: int
    host_base_s: dict  # threads -> seconds per expert (its bytes over the streamed rate), rows aside
    host_row_s: dict  # threads -> seconds per token row of one expert
    threads_split: int  # host threads while the copy engine runs
    threads_all: int  # host threads when nothing is copied
    copy_bw: float  # bytes/s of expert copies (page cache -> ring -> device); <= 0: not measured
    copy_lat_s: float = 0.0  # fixed cost of one batch of copies
    gpu_call_s: float = 0.0  # what the copy side adds before the host rows are needed
    xfer_s: float = 0.0  # activations down + rows up
    slow_host: float = 1.0  # host time x this while copies run
    slow_copy: float = 1.0  # copy time x this while the host computes
    max_host_rows: int = 64  # an expert with more rows is never sent to the host
    host_call_s: dict = field(default_factory=dict)  # threads -> fixed cost of one host job
    label: str = "measured"
    notes: dict = field(default_factory=dict)

    def host_gbps(self, threads: int) -> float:
        return self.expert_bytes / self.host_base_s[threads] / 1e9

    def call_s(self, threads: int) -> float:
        return float(self.host_call_s.get(threads, 0.0))

    def host_s(self, rows, threads: int, concurrent: bool) -> float:
        rows = np.asarray(rows, dtype=np.float64)
        if rows.size == 0:
            return 0.0
        t = self.call_s(threads) + rows.size * self.host_base_s[threads] + float(rows.sum()) * self.host_row_s[threads]
        return t * (self.slow_host if concurrent else 1.0)

    def copy_s(self, n: int, concurrent: bool) -> float:
        if n <= 0:
            return 0.0
        if self.copy_bw <= 0:
            return math.inf
        t = self.copy_lat_s + n * self.expert_bytes / self.copy_bw
        return t * (self.slow_copy if concurrent else 1.0)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["host_gbps"] = {t: self.host_gbps(t) for t in self.host_base_s}
        d["copy_gbps"] = self.copy_bw / 1e9
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Rates":
        """Inverse of ``to_dict`` (JSON turns the thread-count keys into strings)."""
        keep = set(cls.__dataclass_fields__)
        r = cls(**{k: v for k, v in d.items() if k in keep})
        for name in ("host_base_s", "host_row_s", "host_call_s"):
            setattr(r, name, {int(k): float(v) for k, v in (getattr(r, name) or {}).items()})
        return r


@dataclass
class Plan:
    host: np.ndarray  # indices into the misses given to plan(), computed on the host
    copy: np.ndarray  # indices copied
    threads: int  # host threads for this layer (0: no host job)
    est_s: float  # estimated time of the layer's misses beyond the hits: max(host, copy)
    est_host_s: float
    est_copy_s: float


class _Line:
    """``y = a + b x`` by decayed least squares over the recent observations (``memory``: the decay's
    horizon). Where they cannot separate a and b (every call had the same x) the slope is the prior's
    and the intercept the data's; with no data, the prior line (the calibration)."""

    def __init__(self, a0: float, b0: float, memory: float = 32.0):
        self.a0, self.b0 = max(0.0, float(a0)), max(1e-12, float(b0))
        self.decay = 1.0 - 1.0 / max(1.0, memory)
        self.s = np.zeros(5)  # W, Sx, Sy, Sxx, Sxy of the observations (decayed)
        self.n = 0
        self.a, self.b = self.a0, self.b0

    def add(self, x: float, y: float) -> None:
        self.s *= self.decay
        self.s += (1.0, x, y, x * x, x * y)
        self.n += 1
        self._solve()

    def predict(self, x: float) -> float:
        return self.a + self.b * x

    def _solve(self) -> None:
        W, Sx, Sy, Sxx, Sxy = self.s
        var = Sxx / W - (Sx / W) ** 2  # spread of x in the observations
        b = (Sxy / W - (Sx / W) * (Sy / W)) / var if var > 0.05 else self.b0
        b = max(b, 1e-12)
        a = (Sy - b * Sx) / W
        if a < 0:  # no negative fixed cost: the line through the origin that fits best
            a, b = 0.0, max(Sxy / Sxx, 1e-12)
        self.a, self.b = a, b


class CostModel:
    """``Rates`` plus their updates from every host job and copy, and the split (module docstring).
    ``learn=False`` keeps the rates as given (tests of the split on fixed rates)."""

    def __init__(self, rates: Rates, memory: float = 32.0, learn: bool = True):
        self.rates = rates
        self.memory = memory
        self.learn = learn
        r = rates
        self._host = {t: _Line(r.call_s(t), r.host_base_s[t] + r.host_row_s.get(t, 0.0), memory)
                      for t in r.host_base_s}
        self._copy = None if r.copy_bw <= 0 else _Line(r.copy_lat_s, r.expert_bytes / r.copy_bw, memory)
        self.observed = dict(host=0, host_bounds=0, host_bounds_used=0, copy=0, gap=0)

    # -- updates ----------------------------------------------------------------------------------
    def observe_host(self, threads: int, experts: int, rows: int, seconds: float, *, concurrent: bool = False,
                     upper_bound: bool = False) -> None:
        """One host job: ``experts`` experts, ``rows`` token rows in all, ``seconds`` of wall time.
        ``upper_bound``: the job had finished before it was waited for, so ``seconds`` may include
        time after its end (the caller's thread waiting for the GIL): used only if it is faster than
        the model says."""
        r = self.rates
        line = self._host.get(threads)
        if not self.learn or line is None or experts <= 0 or seconds <= 0:
            return
        y = seconds / (r.slow_host if concurrent else 1.0)
        y -= (rows - experts) * r.host_row_s.get(threads, 0.0)  # the line is at one row per expert
        if upper_bound:
            self.observed["host_bounds"] += 1
            if y >= line.predict(experts):
                return
            self.observed["host_bounds_used"] += 1
        line.add(float(experts), max(y, 1e-9))
        self.observed["host"] += 1
        r.host_call_s[threads] = line.a
        r.host_base_s[threads] = max(1e-12, line.b - r.host_row_s.get(threads, 0.0))

    def observe_copy(self, experts: int, seconds: float, *, concurrent: bool = False) -> None:
        """One batch of copies: ``experts`` experts delivered in ``seconds``."""
        r = self.rates
        if not self.learn or experts <= 0 or seconds <= 0:
            return
        y = seconds / (r.slow_copy if concurrent else 1.0)
        if self._copy is None:  # the first copy: no fixed cost known yet
            self._copy = _Line(0.0, y / experts, self.memory)
        self._copy.add(float(experts), y)
        self.observed["copy"] += 1
        r.copy_lat_s = self._copy.a
        r.copy_bw = r.expert_bytes / self._copy.b

    def observe_gap(self, seconds: float) -> None:
        """Time between the copies' end and the moment the host rows are needed (vLLM: launches)."""
        if self.learn and seconds >= 0:
            g = self.rates.gpu_call_s
            self.rates.gpu_call_s = seconds if self.observed["gap"] == 0 else 0.8 * g + 0.2 * seconds
            self.observed["gap"] += 1

    # -- the split ----------------------------------------------------------------------------------
    def plan(self, miss_rows, popularity=None, host_allowed: bool = True, hits: int = 0,
             forced_copy=None) -> Plan:
        """Host set and copy set of misses with ``miss_rows`` token rows each (module docstring);
        ``forced_copy`` (bool per miss) are copied in any case; ``hits`` > 0: a GPU call runs anyway."""
        r = self.rates
        rows = np.asarray(miss_rows, dtype=np.int64)
        n = rows.size
        empty = np.zeros(0, dtype=np.int64)
        if n == 0:
            return Plan(empty, empty, 0, 0.0, 0.0, 0.0)
        pop = np.zeros(n) if popularity is None else np.asarray(popularity, dtype=np.float64)
        forced = np.zeros(n, dtype=bool) if forced_copy is None else np.asarray(forced_copy, dtype=bool)
        ts, ta = r.threads_split, r.threads_all
        measured = ts in r.host_base_s and ta in r.host_base_s and r.copy_bw > 0  # else: nothing to weigh
        cand = np.flatnonzero(~forced & (rows <= r.max_host_rows)) if host_allowed and measured else empty
        order = cand[np.lexsort((pop[cand], rows[cand]))]  # fewest rows first, then least popular
        copy_only = r.copy_s(n, False) + r.gpu_call_s
        best = (copy_only, 0, 0, 0.0, copy_only)
        m = order.size
        if m:  # every host count k = 1..m at once
            k = np.arange(1, m + 1)
            cum_rows = np.cumsum(rows[order])
            rest = n - k
            host = r.xfer_s + np.where(
                rest > 0, (r.call_s(ts) + k * r.host_base_s[ts] + cum_rows * r.host_row_s[ts]) * r.slow_host,
                r.call_s(ta) + k * r.host_base_s[ta] + cum_rows * r.host_row_s[ta])
            per_copy = r.expert_bytes / r.copy_bw  # copy_bw > 0: else nothing is weighed (above)
            cp = np.where(rest > 0, (r.copy_lat_s + rest * per_copy) * r.slow_copy + r.gpu_call_s,
                          r.gpu_call_s if hits else 0.0)
            t = np.maximum(host, cp)
            i = int(np.argmin(t))
            if t[i] < best[0]:
                best = (float(t[i]), i + 1, ta if rest[i] == 0 else ts, float(host[i]), float(cp[i]))
        t, k, threads, host_t, cp_t = best
        host_idx = np.sort(order[:k])
        copy_mask = np.ones(n, dtype=bool)
        copy_mask[host_idx] = False
        return Plan(host_idx, np.flatnonzero(copy_mask), threads, t, host_t, cp_t)


# ---------------------------------------------------------------------------------------------
# Calibration of the host side
# ---------------------------------------------------------------------------------------------


def llc_bytes(default: int = 32 << 20) -> int:
    """The largest CPU cache of this machine (sysfs), ``default`` if it cannot be read."""
    best = 0
    for p in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            s = open(p).read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
            best = max(best, int(s.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or default


def calibrate_host(cache, kernels: dict, *, group: int, hidden: int, dtype=torch.bfloat16, rows_hi: int = 16,
                   calls: int = 12, per_call: int = 4, llc: int | None = None, budget_s: float = 5.0,
                   tensors: Sequence[str] = EXPERT_TENSORS) -> dict:
    """Host rates per thread count (``kernels``: {threads: kernel with ``experts_mlp``}), measured on
    bytes that are not in the CPU caches: a pool of distinct experts of the cache, at least 4x the
    last-level cache (from the last layer back; all of them if the cache is smaller, which the notes
    say), touched once first (page tables, so faults are not timed), then read in order, each call
    on experts not read since the pool's previous pass. Per thread count: the median of ``calls``
    calls of 1 expert (t1) and of ``per_call`` experts (tk) at M = 1, and of ``per_call`` experts at
    M = ``rows_hi`` (tr): per expert ``(tk - t1) / (per_call - 1)``, fixed cost ``t1`` less that,
    per row ``(tr - tk) / (per_call (rows_hi - 1))``. A job is ``(rows, *views of tensors, group,
    weights)``, as ``experts_mlp`` takes it. Returns dict(base, row, call, notes)."""
    t_start = time.perf_counter()
    nbytes = sum(s.nbytes for s in cache.expert_specs)
    llc = llc or llc_bytes()
    want = max(2 * per_call + 2, math.ceil(4 * llc / max(1, nbytes)))
    pool = [(l, e) for l in reversed(list(cache.layers)) for e in range(int(cache.num_experts))][:want]
    views = [tuple(cache.tensor(l, e, n) for n in tensors) for l, e in pool]
    fits_llc = len(pool) * nbytes < 4 * llc
    for v in views:  # touch every page once (the kernel then reads mapped pages, as in service)
        for t in v:
            t.reshape(-1).view(torch.uint8)[::4096].sum()
    x = {m: torch.randn(m, hidden).to(dtype) for m in (1, rows_hi)}
    out = {m: torch.zeros(m, hidden, dtype=dtype) for m in (1, rows_hi)}
    rows = {m: torch.arange(m) for m in (1, rows_hi)}
    wts = {m: torch.full((m,), 0.5) for m in (1, rows_hi)}
    pos = [0]

    def take(k):
        out_ = [views[(pos[0] + j) % len(views)] for j in range(k)]
        pos[0] = (pos[0] + k) % len(views)
        return out_

    def timed(kern, k, m, n_calls):
        ts = []
        for _ in range(n_calls):
            jobs = [(rows[m], *v, group, wts[m]) for v in take(k)]
            t0 = time.perf_counter()
            kern.experts_mlp(x[m], jobs, out[m])
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    base, row, call, raw = {}, {}, {}, {}
    for th, kern in sorted(kernels.items()):
        kern.experts_mlp(x[1], [(rows[1], *views[0], group, wts[1])], out[1])  # geometry, pool start-up
        t1 = timed(kern, 1, 1, calls)
        tk = timed(kern, per_call, 1, max(3, calls // 2))
        tr = tk
        if time.perf_counter() - t_start < budget_s:
            tr = timed(kern, per_call, rows_hi, max(3, calls // 4))
        per_expert = max((tk - t1) / (per_call - 1), 0.25 * tk / per_call, 1e-9)
        pr = max(0.0, (tr - tk) / (per_call * (rows_hi - 1)))
        row[th] = pr
        base[th] = max(1e-9, per_expert - pr)
        call[th] = max(0.0, t1 - per_expert)
        raw[th] = dict(t1_s=t1, tk_s=tk, tr_s=tr, gbps_streamed=nbytes / per_expert / 1e9)
    notes = dict(host=raw, pool_experts=len(pool), pool_bytes=len(pool) * nbytes, llc_bytes=llc,
                 pool_within_4x_llc=fits_llc, per_call=per_call, rows_hi=rows_hi,
                 seconds=time.perf_counter() - t_start)
    return dict(base=base, row=row, call=call, notes=notes)


def rates_from_host(cache, cal: dict, threads_split: int, threads_all: int, **kw) -> Rates:
    """``Rates`` with the host side of ``calibrate_host``'s result and the rest from ``kw``."""
    nbytes = sum(s.nbytes for s in cache.expert_specs)
    kw.setdefault("copy_bw", 0.0)
    return Rates(expert_bytes=nbytes, host_base_s=dict(cal["base"]), host_row_s=dict(cal["row"]),
                 host_call_s=dict(cal["call"]), threads_split=threads_split, threads_all=threads_all,
                 notes=dict(calibration=cal["notes"]), **kw)


def expected_distinct(tokens: int, experts: int, top_k: int) -> float:
    """Expected distinct experts of a layer under uniform routing of ``tokens`` tokens."""
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def crossover_table(rates: Rates, experts: int, top_k: int, resident_frac: float,
                    tokens: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 2048), seed: int = 0) -> list[dict]:
    """Tokens per step -> the model's split on uniform routing with ``resident_frac`` of the experts
    resident (random draws, the mean of 8 per size). Where "host" falls to 0 is the crossover."""
    rng = np.random.default_rng(seed)
    model = CostModel(rates)
    out = []
    for t in tokens:
        acc = np.zeros(6)
        for _ in range(8):
            ids = np.argsort(rng.random((t, experts)), axis=1)[:, :top_k]  # t uniform top-k draws
            uniq, counts = np.unique(ids, return_counts=True)
            resident = rng.random(uniq.size) < resident_frac
            miss_rows = counts[~resident]
            p = model.plan(miss_rows, hits=int(resident.sum()))
            copy_all = rates.copy_s(miss_rows.size, False) + (rates.gpu_call_s if miss_rows.size else 0.0)
            acc += (uniq.size, miss_rows.size, p.host.size, p.copy.size, p.est_s, copy_all)
        acc /= 8
        out.append(dict(tokens=t, routed=acc[0], misses=acc[1], host=acc[2], copied=acc[3],
                        est_ms=1e3 * acc[4], copy_all_ms=1e3 * acc[5],
                        rows_per_expert=t * top_k / max(acc[0], 1e-9)))
    return out


def pcie_model_rates(rates: Rates, h2d_gbps: float, measured_h2d_gbps: float | None, cores: int,
                     label: str, link_efficiency: float = 0.9) -> Rates:
    """The same split on another machine, from this one's per-byte rates (a model, labelled as such):
    copies at min(this run's copy rate, the other link x ``link_efficiency``: the copy engine streams at
    90-93% of pinned H2D once the CPU side is not the limit, TRANSFER.md); host rates at the thread
    counts the other machine can give (capped at this machine's: the other host's DRAM bandwidth is
    assumed equal to this one's); GPU call and activation costs as measured here.
    ``measured_h2d_gbps`` (this run's pinned H2D) is recorded beside it."""
    copy_bw = min(rates.copy_bw, link_efficiency * h2d_gbps * 1e9)
    threads = sorted(rates.host_base_s)
    t_all = max(t for t in threads if t <= max(cores, min(threads)))
    return Rates(
        expert_bytes=rates.expert_bytes, host_base_s=dict(rates.host_base_s), host_row_s=dict(rates.host_row_s),
        host_call_s=dict(rates.host_call_s), threads_split=rates.threads_split, threads_all=t_all, copy_bw=copy_bw,
        copy_lat_s=rates.copy_lat_s, gpu_call_s=rates.gpu_call_s, xfer_s=rates.xfer_s,
        slow_host=rates.slow_host, slow_copy=rates.slow_copy, max_host_rows=rates.max_host_rows,
        label=label, notes=dict(h2d_gbps=h2d_gbps, link_efficiency=link_efficiency,
                                measured_h2d_gbps=measured_h2d_gbps),
    )
