"""Synthetic MoE routing traces for the expert cache: uniform, and skewed with temporal locality.

A trace is an ``int64`` array ``[steps, layers, batch, top_k]``: for every decode step, MoE layer
and sequence of the batch, the ``top_k`` distinct experts the router picked. ``trace_stats`` measures
what the benchmark and the tests need from one (expert popularity, reuse between steps, distinct
experts per call).

The skewed model (``skewed_trace``), stated plainly:

1. **Popularity** per layer is Zipf over experts: the expert of rank ``r`` (1-based) has weight
   ``r ** -zipf_s``; the ranking is an independent random permutation per layer (hot experts differ
   between layers). A fresh pick draws ``top_k`` distinct experts without replacement in proportion
   to the weights (Gumbel-top-k).
2. **Temporal locality** per sequence: at each step each of a sequence's ``top_k`` choices keeps the
   expert it had at the previous step (same layer) with probability ``sticky_p``; the others are
   fresh picks that avoid the kept ones. Sequences of a batch are independent.
3. **Drift** (optional): every ``drift_every`` steps the ranking of one layer in ``drift_frac`` of
   the layers is re-drawn, so that a policy cannot rely on frequencies forever.

Where the parameters come from, and what is an assumption:

- Mixtral 8x7B (Jiang et al. 2024, arXiv:2401.04088, section 5 "Routing analysis") reports that
  consecutive tokens get the same expert much more often than chance: at middle and late layers the
  first choice repeats in roughly 22-28% of consecutive tokens against 12.5% for uniform routing,
  and it finds little topic specialisation (so only mild popularity skew). For 8 experts, top-2,
  ``zipf_s`` = 0.5 and ``sticky_p`` = 0.2 reproduce a ~30% repeat (``trace_stats`` prints it); the
  benchmark uses those for its Mixtral-class rows. The calibration is ours, to one published ratio.
- Fine-grained MoE (64-128 experts, top-6/8: DeepSeek, Qwen3): decode popularity is skewed and
  long-tailed: MoE-Infinity (Xue et al. 2024, arXiv:2401.14361) reports that decode activates a
  small, skewed set of experts per request; Lin et al. 2025 (arXiv:2511.05814) trace expert
  activations and find LFU beats LRU because of that skew; mixtral-offloading (Eliseev & Mazur
  2023, arXiv:2312.17238) gets useful LRU hit rates from 2-4 cached experts of 8 per layer. None
  gives a Zipf exponent or a reuse probability for these models: the defaults ``zipf_s`` = 1.0
  (the most popular of 128 experts gets ~18% of single picks, ~23x a fair share) and ``sticky_p``
  = 0.3 are assumptions, not measurements; the benchmark sweeps ``zipf_s`` so a conclusion does
  not hang on one value.
- Hot sets that differ by layer and drift slowly are assumptions too (observed qualitatively in the
  papers above; no numbers).
Replace these traces with recorded router outputs of a real model when one can be run.
"""

from __future__ import annotations

import numpy as np

__all__ = ["uniform_trace", "skewed_trace", "trace_stats", "zipf_weights", "reuse_fraction", "read_csv",
           "write_csv", "check_trace", "DeviceTrace"]


def zipf_weights(num_experts: int, s: float) -> np.ndarray:
    """Normalised Zipf weights ``r ** -s`` for ranks 1..num_experts (s = 0 is uniform)."""
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** (-float(s))
    return w / w.sum()


def _check(num_experts: int, top_k: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")


def _gumbel_topk(rng: np.random.Generator, logw: np.ndarray, n: int, k: int) -> np.ndarray:
    """``n`` draws of ``k`` distinct indices without replacement, in proportion to ``exp(logw)``;
    returned in draw order (a prefix of a draw is itself a valid smaller draw)."""
    g = logw[None, :] + rng.gumbel(size=(n, logw.shape[0]))
    return np.argsort(-g, axis=1)[:, :k]


def uniform_trace(steps: int, layers: int, num_experts: int, top_k: int, batch: int = 1,
                  seed: int = 0) -> np.ndarray:
    """Every pick uniform over experts, independent across steps: the worst case for any cache."""
    _check(num_experts, top_k)
    rng = np.random.default_rng(seed)
    logw = np.zeros(num_experts)
    out = _gumbel_topk(rng, logw, steps * layers * batch, top_k)
    return out.reshape(steps, layers, batch, top_k).astype(np.int64)


def skewed_trace(steps: int, layers: int, num_experts: int, top_k: int, batch: int = 1,
                 zipf_s: float = 1.0, sticky_p: float = 0.3, drift_every: int = 0,
                 drift_frac: float = 0.25, seed: int = 0) -> np.ndarray:
    """Per-layer Zipf popularity plus per-sequence stickiness (the model in the module docstring)."""
    _check(num_experts, top_k)
    if not 0.0 <= sticky_p <= 1.0:
        raise ValueError(f"sticky_p={sticky_p} must be in [0, 1]")
    rng = np.random.default_rng(seed)
    base = np.log(zipf_weights(num_experts, zipf_s))
    perms = [rng.permutation(num_experts) for _ in range(layers)]

    def layer_logw(layer: int) -> np.ndarray:
        lw = np.empty(num_experts)
        lw[perms[layer]] = base  # expert perms[layer][r] has rank r
        return lw

    logws = [layer_logw(li) for li in range(layers)]
    out = np.empty((steps, layers, batch, top_k), dtype=np.int64)
    for t in range(steps):
        if drift_every and t and t % drift_every == 0:
            for li in np.flatnonzero(rng.random(layers) < drift_frac):
                perms[li] = rng.permutation(num_experts)
                logws[li] = layer_logw(li)
        for li in range(layers):
            # 2*top_k fresh candidates per sequence, enough to replace any choice that is not kept
            fresh = _gumbel_topk(rng, logws[li], batch, min(num_experts, 2 * top_k))
            if t == 0 or sticky_p == 0.0:
                out[t, li] = fresh[:, :top_k]
                continue
            prev = out[t - 1, li]
            keep = rng.random((batch, top_k)) < sticky_p
            for b in range(batch):
                row = np.where(keep[b], prev[b], -1)
                kept = set(row[keep[b]].tolist())
                cand = (int(e) for e in fresh[b] if int(e) not in kept)
                for j in range(top_k):
                    if row[j] < 0:
                        row[j] = next(cand)
                out[t, li, b] = row
    return out


def trace_stats(trace: np.ndarray, num_experts: int) -> dict:
    """What a trace looks like: share of the most popular expert per layer (mean over layers),
    first-choice repeat rate between consecutive steps, distinct experts per (step, layer) call."""
    steps, layers, batch, top_k = trace.shape
    top_share = []
    for li in range(layers):
        counts = np.bincount(trace[:, li].ravel(), minlength=num_experts)
        top_share.append(counts.max() / counts.sum())
    repeat = float((trace[1:, :, :, 0] == trace[:-1, :, :, 0]).mean()) if steps > 1 else 0.0
    distinct = [len(np.unique(trace[t, li])) for t in range(steps) for li in range(layers)]
    return {
        "top_expert_share": float(np.mean(top_share)),
        "fair_share": 1.0 / num_experts,
        "first_choice_repeat": repeat,
        "first_choice_repeat_uniform": 1.0 / num_experts,
        "distinct_per_call": float(np.mean(distinct)),
    }


def reuse_fraction(trace: np.ndarray) -> float:
    """Mean share of a sequence's top-k experts (per layer) that it also had at the previous step."""
    steps, layers, batch, top_k = trace.shape
    if steps < 2:
        return 0.0
    prev, cur = trace[:-1], trace[1:]
    hit = (cur[..., :, None] == prev[..., None, :]).any(-1)  # [steps-1, layers, batch, top_k]
    return float(hit.mean())


# CSV form of a trace (the vLLM backend's ``routing_trace`` option, benchmarks/traces/, bench_moe.py
# --trace): one row per (step, MoE layer position, sequence), ``step,layer,e0,...,e{k-1}[,w0,...,w{k-1}]``;
# the rows of one (step, layer) are the batch's sequences in order; the optional weights are the router's
# top-k weights of the row (floats >= 0). Lines starting with "#" and a header starting with "step" are
# skipped (a header naming w0... columns says the rows carry weights; without a header, a row carries
# weights when a field after step,layer is written as a float, e.g. "0.25", and then holds k ids and k
# weights). Every (step, layer) of 0..S-1 x 0..L-1 must have the same number of rows; the ids of a row
# are distinct.


def write_csv(trace: np.ndarray, path, comment: str = "", weights: np.ndarray | None = None):
    """Write ``trace`` ``[steps, layers, batch, top_k]`` (and ``weights`` of the same shape, if given)
    as CSV (format above); returns the path."""
    from pathlib import Path

    steps, layers, batch, top_k = trace.shape
    if weights is not None and np.shape(weights) != trace.shape:
        raise ValueError(f"weights {np.shape(weights)} must have the trace's shape {trace.shape}")
    lines = [f"# {c}" for c in comment.splitlines() if c] if comment else []
    head = "step,layer," + ",".join(f"e{j}" for j in range(top_k))
    if weights is not None:
        head += "," + ",".join(f"w{j}" for j in range(top_k))
    lines.append(head)
    for t in range(steps):
        for li in range(layers):
            for b, row in enumerate(trace[t, li]):
                line = f"{t},{li}," + ",".join(str(int(e)) for e in row)
                if weights is not None:
                    line += "," + ",".join(repr(float(np.float32(w))) for w in weights[t, li, b])
                lines.append(line)
    p = Path(path)
    p.write_text("\n".join(lines) + "\n")
    return p


def read_csv(path, with_weights: bool = False):
    """Read a CSV trace (format above) into ``int64 [steps, layers, batch, top_k]``; with
    ``with_weights`` return ``(ids, weights)``, weights ``float32`` of the same shape or None when the
    file has none.

    Raises UnsupportedError naming the file and the first problem (missing file, ragged rows, a
    (step, layer) missing or with another batch size, a negative or repeated id, a bad weight)."""
    from pathlib import Path

    from .errors import UnsupportedError

    p = Path(path)
    fix = "write it with mmap_offload.traces.write_csv (rows: step,layer,expert ids[,weights])"
    try:
        text = p.read_text()
    except OSError as e:
        raise UnsupportedError(f"routing trace {p} cannot be read: {e.strerror or e}", "pass an existing CSV file") from None
    except UnicodeDecodeError:
        raise UnsupportedError(f"routing trace {p} is not text", fix) from None
    rows: dict[tuple[int, int], list[list[int]]] = {}
    wrows: dict[tuple[int, int], list[list[float]]] = {}
    width = None  # fields per row
    has_w = None  # rows carry weights
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.lower().startswith("step"):
            cols = [c.strip().lower() for c in line.split(",")]
            if any(c.startswith("w") for c in cols[2:]):
                has_w = True
            continue
        fields = [f.strip() for f in line.split(",")]
        floaty = any(("." in f or "e" in f.lower() or "n" in f.lower()) for f in fields[2:])
        row_w = has_w if has_w is not None else floaty
        if width is not None and len(fields) != width:
            raise UnsupportedError(f"routing trace {p} line {n} has {len(fields)} fields, expected {width}", fix)
        if len(fields) < 3 or (row_w and (len(fields) - 2) % 2):
            raise UnsupportedError(f"routing trace {p} line {n} has {len(fields)} fields, expected step,layer and "
                                   f"{'k ids and k weights' if row_w else '>= 1 expert id'}", fix)
        k = (len(fields) - 2) // 2 if row_w else len(fields) - 2
        try:
            vals = [int(v) for v in fields[: 2 + k]]
        except ValueError:
            raise UnsupportedError(f"routing trace {p} line {n} is not integers: {line[:60]!r}", fix) from None
        ws = None
        if row_w:
            try:
                ws = [float(v) for v in fields[2 + k:]]
            except ValueError:
                raise UnsupportedError(f"routing trace {p} line {n} has a weight that is not a number: {line[:60]!r}",
                                       fix) from None
            if not all(np.isfinite(w) and w >= 0 for w in ws):
                raise UnsupportedError(f"routing trace {p} line {n} has a negative or non-finite weight", fix)
        if has_w is None:
            has_w = row_w
        elif row_w != has_w:
            raise UnsupportedError(f"routing trace {p} line {n} {'has' if row_w else 'lacks'} weights, unlike the "
                                   "rows before it", fix)
        width = len(fields)
        if min(vals) < 0:
            raise UnsupportedError(f"routing trace {p} line {n} has a negative value", fix)
        if len(set(vals[2:])) != k:
            raise UnsupportedError(f"routing trace {p} line {n} repeats an expert id (a row's top-k ids are distinct)",
                                   fix)
        rows.setdefault((vals[0], vals[1]), []).append(vals[2:])
        if ws is not None:
            wrows.setdefault((vals[0], vals[1]), []).append(ws)
    if not rows:
        raise UnsupportedError(f"routing trace {p} has no rows", fix)
    steps = 1 + max(s for s, _ in rows)
    layers = 1 + max(li for _, li in rows)
    batch = len(next(iter(rows.values())))
    k = len(next(iter(rows.values()))[0])
    out = np.empty((steps, layers, batch, k), dtype=np.int64)
    wout = np.empty((steps, layers, batch, k), dtype=np.float32) if wrows else None
    for t in range(steps):
        for li in range(layers):
            r = rows.get((t, li))
            if r is None or len(r) != batch:
                raise UnsupportedError(
                    f"routing trace {p}: step {t} layer {li} has {0 if r is None else len(r)} rows, expected {batch}", fix)
            out[t, li] = r
            if wout is not None:
                wout[t, li] = wrows[(t, li)]
    return (out, wout) if with_weights else out


def check_trace(trace: np.ndarray, num_experts: int, top_k: int, source: str = "routing trace") -> None:
    """A trace read from a file against the model it drives: ids below ``num_experts``, ``top_k`` per row.
    Raises UnsupportedError (one line: what and how to fix)."""
    from .errors import UnsupportedError

    if trace.ndim != 4:
        raise UnsupportedError(f"{source} has shape {trace.shape}, not [steps, layers, batch, top_k]",
                               "read it with mmap_offload.traces.read_csv")
    if trace.shape[3] != top_k:
        raise UnsupportedError(f"{source} routes {trace.shape[3]} experts per token, the model top_k={top_k}",
                               f"record the trace with this model, or pass --top-k {trace.shape[3]}")
    hi = int(trace.max()) if trace.size else -1
    if hi >= num_experts:
        raise UnsupportedError(f"{source} routes expert {hi}, the model has {num_experts} experts",
                               f"use a trace recorded for {num_experts} experts, or pass --experts {hi + 1}")


class DeviceTrace:
    """A trace's ids served where the router's are, without a host sync per layer.

    ``ids(step, pos, n, k, dtype)``: the ids of MoE layer position ``pos`` at forward ``step`` for
    ``n`` tokens, the step's batch rows tiled over the tokens (step and position modulo the trace).
    The whole trace is copied to ``device`` once; each call is a view or one small device-side
    repeat, so the step stays asynchronous as with a real router (a per-layer copy from host memory
    would wait for the GPU to drain and add its own cost to whatever is measured)."""

    def __init__(self, trace: np.ndarray, device, num_experts: int, source: str = "routing trace"):
        import torch

        from .errors import UnsupportedError

        if trace.ndim != 4 or trace.size == 0:
            raise UnsupportedError(f"{source} has shape {trace.shape}, not [steps, layers, batch, top_k]",
                                   "read it with mmap_offload.traces.read_csv")
        hi = int(trace.max())
        if hi >= num_experts:
            raise UnsupportedError(f"{source} routes expert {hi}, the model has {num_experts} experts",
                                   "use a trace made for this model")
        self.source = source
        self._num_experts = num_experts
        self.steps, self.layers, self.batch, self.top_k = (int(s) for s in trace.shape)
        self._dev = torch.from_numpy(np.ascontiguousarray(trace, dtype=np.int64)).to(device)
        self._by_dtype = {torch.int64: self._dev}

    def _of(self, dtype, k: int):
        from .errors import UnsupportedError

        if k > self.top_k:
            raise UnsupportedError(f"{self.source} has top-{self.top_k}; the model routes top-{k}",
                                   "use a trace made for this model")
        t = self._by_dtype.get(dtype)
        if t is None:
            t = self._by_dtype[dtype] = self._dev.to(dtype)
        return t

    def _tile(self, row, n: int):
        if n <= self.batch:
            return row[:n].clone()  # the caller's own tensor, as a router's (vLLM may write in place)
        return row.repeat(-(-n // self.batch), 1)[:n]

    def ids(self, step: int, pos: int, n: int, k: int, dtype):
        t = self._of(dtype, k)
        return self._tile(t[step % self.steps, pos % self.layers, :, :k], n)  # [batch, k] tiled

    def ids_at(self, step_t, pos: int, n: int, k: int, dtype):
        """``ids`` with the step read on the device from ``step_t`` (a one-element int64 tensor there):
        device ops only, so a CUDA graph that captures the call replays the trace's next rows as
        ``step_t`` advances (the caller adds 1 to it on the device once per forward)."""
        import torch

        t = self._of(dtype, k)
        sel = torch.remainder(step_t, self.steps)
        return self._tile(t[:, pos % self.layers].index_select(0, sel)[0, :, :k], n)

    def warm(self, *dtypes) -> None:
        """Makes the trace's copies in ``dtypes`` now (a capture must not allocate them)."""
        for d in dtypes:
            self._of(d, self.top_k)

    def load(self, trace: np.ndarray) -> None:
        """Replaces the trace's contents in place, every dtype's copy at the address it had (what a
        captured CUDA graph reads); a trace of another shape or with ids out of range is refused."""
        import torch

        from .errors import UnsupportedError

        shape = (self.steps, self.layers, self.batch, self.top_k)
        if tuple(trace.shape) != shape:
            raise UnsupportedError(f"routing trace of shape {tuple(trace.shape)} cannot replace the {shape} one "
                                   "whose addresses CUDA graphs hold", "make every trace of a run with one shape")
        check = DeviceTrace(trace, "cpu", self._num_experts, self.source)  # the range check, before any byte moves
        self._dev.copy_(check._dev)
        for d, t in self._by_dtype.items():
            if d != torch.int64:
                t.copy_(self._dev)
