"""Routing-aware VRAM expert cache: make the routed experts resident, fetch only the misses.

At decode a layer needs only the experts its router picked (top_k per token), so copying whole
layers moves E/top_k times too much. ``ExpertCache`` keeps whole experts in fixed slots and hands the
MoE kernel slot tensors plus remapped ids:

    ExpertCache
      owns   pools: one per layer (default) or one shared by all layers
             each pool: {name: Tensor[S, *shape]} on the device, allocated once (fixed addresses)
      uses   engine.submit / engine.wait (transfer.py), one Copy per missing expert
             (src = cache.expert_extent(layer, e): one read per expert)
      policy "lfu-decay" (default) | "lfu" | "lru": which resident expert a miss evicts

    slots = ec.slots(layer)                  # {name: [S, *shape]}, same tensors for the whole run
    ids_s = ec.ensure(layer, topk_ids)       # same shape/dtype/device as topk_ids, values in [0, S)
    moe_kernel(x, slots["w13_weight"], slots["w2_weight"], topk_weights, ids_s)
    ec.prefetch_hint(next_layer, likely_ids) # optional: start fetching, do not wait

Contract of ``ensure(layer, ids)``:
- on return, for every position ``i``: ``slots[name][out[i]]`` holds the cache bytes of expert
  ``ids[i]`` of ``layer``, for every tensor name (copies complete on the device);
- it fetches each missing expert once, never evicts an expert needed by the same call, and raises
  ``UnsupportedError`` if the call needs more distinct experts than the pool has slots;
- the slots it returns stay valid until the next ``ensure`` on the same pool (``prefetch_hint``
  never evicts them; call the next ``ensure`` after the kernels using them are enqueued). A
  slot used earlier is refilled only after an event recorded on the current CUDA stream at the
  start of the overwriting call (``engine.submit(..., after=event)``: the copy stream waits, the
  host does not), so every kernel enqueued before that call is safe;
- on CUDA the copies are ordered before later work on the current stream (``engine.wait``), so
  call it with the stream that runs the MoE kernel current.

Stream-ordered misses (``stream_ordered=True``, an engine with ``submit_ordered``: the mmap engine
with an ordered part of its ring): on CUDA ``ensure`` does not wait for the copy threads at all. The
misses' copies are enqueued on the current stream behind a gate that opens once their bytes were
read (csrc/copy_pool.c, "Stream-ordered batches"), so the caller goes on launching work while the
threads read. A read that fails is then known only later: ``check_ordered()`` waits for every
such batch's reads, forgets the slots a failed one filled and raises its error; call it before
using the results of the kernels that read the slots (the vLLM backend: once per forward, before
sampling). On CPU the same path is taken and waited for in ``ensure`` (host kernels run at once).

Eviction policies (lower key is evicted first; ties go to the least recently used):
- ``lru``: key = time of last use.
- ``lfu-decay``: key = an exponentially decayed use count (half-life ``half_life_steps`` decode
  steps, one step = one call per layer), kept for every expert of every layer, resident or not, so
  a hot expert evicted by a burst keeps its standing. It beats LRU on skewed traces
  (benchmarks/bench_expert_cache.py; the same observation as Lin et al. 2025, arXiv:2511.05814).
  Under both frequency policies an expert used within the last decode step (the last
  ``len(layers)`` calls) is evicted only after every older one: a shared pool would otherwise evict
  a layer's fresh experts (count 1) before that layer's next step, their likeliest reuse (without
  this rule a shared pool fell below LRU on the skewed trace; per-layer pools are unaffected; the
  benchmark's pools table has the numbers).
- ``lfu``: the same without decay (never forgets; bad under drift).

Hints (``prefetch_hint``) are budgeted: hinted experts evicted unused, or not used yet, stay within
``hint_budget`` (default 0.25) x the experts fetched for routing, so bytes moved stay <= 1.25x the
routed misses whatever the predictor's quality.

Counters (``metrics``): calls, hits, misses, evictions, routed_bytes (distinct routed experts per
call), miss_bytes (routed experts fetched by the call), bytes_moved (every byte copied, hints
included), hint_fetches / hint_used / hint_wasted, stall_s (time blocked in ``engine.wait``),
submit_s (time in the engine's submit calls), ordered_fills (stream-ordered submits).
Bytes are tensor bytes (the sum of the record's tensor sizes), not the aligned record size.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from .errors import UnsupportedError
from .transfer import Copy

__all__ = ["ExpertCache", "POLICIES"]

POLICIES = ("lfu-decay", "lfu", "lru")
_RECENT_BONUS = 1e12  # above any log-score key: keeps last step's experts above all older ones


@dataclass(eq=False)  # compared by identity
class _Pending:
    """A copy in flight into one or more slots. ``ordered``: a stream-ordered batch
    (``engine.submit_ordered``): the current stream already waits for it; only its read error is
    left to check (``check_ordered``)."""

    ticket: Any
    done: bool = False
    ordered: bool = False


@dataclass
class _Pool:
    """S whole-expert slots: tensors, who is in each slot, and copies in flight."""

    layers: list[int]  # layer positions this pool serves
    size: int
    tensors: dict[str, torch.Tensor]
    owner_li: np.ndarray  # [S] layer position of the slot's expert, -1 if free
    owner_e: np.ndarray  # [S] expert id, -1 if free
    used: np.ndarray  # [S] bool: handed out by an ensure() at least once since filled
    hinted: np.ndarray  # [S] bool: filled by a hint, not used since
    pending: dict[int, _Pending] = field(default_factory=dict)  # slot -> copy in flight
    pinned: np.ndarray | None = None  # [S] uint8: the slots of the latest ensure() on this pool
    use_call: np.ndarray | None = None  # [S] number of the last ensure() that handed the slot out
    dst: dict[int, list] = field(default_factory=dict)  # slot -> (offset, nbytes, view) per tensor, built once
    fill_of: dict[int, _Pending] = field(default_factory=dict)  # slot -> the copy that last filled it
    dst_ptr: np.ndarray | None = None  # [S, tensors] uint64 device addresses of the slots (ordered submits)


def _ids_to_numpy(expert_ids) -> tuple[np.ndarray, torch.device | None, torch.dtype]:
    if isinstance(expert_ids, torch.Tensor):
        host = expert_ids.detach().to("cpu").numpy().astype(np.int64, copy=False)
        return host, expert_ids.device, expert_ids.dtype
    arr = np.asarray(expert_ids, dtype=np.int64)
    return arr, None, torch.int64


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small host tensor to ``device`` through pinned memory, without blocking the host: a
    copy from pageable memory may wait until the stream reaches it, i.e. until the expert copies
    that stream was told to wait for have landed (host and GPU would run in lock-step)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class ExpertCache:
    """A VRAM cache of whole experts for the MoE layers of one ``cache_reader.Cache``.

    Capacity is given in bytes of GPU memory for all slots (``capacity_bytes``) or in experts
    (``capacity_experts``), both totals over all layers; per-layer pools split it evenly (at most
    E slots each), a shared pool (``shared=True``) lets hot layers take more.
    """

    def __init__(
        self,
        cache,
        engine,
        device: str | torch.device = "cpu",
        *,
        capacity_bytes: int | None = None,
        capacity_experts: int | None = None,
        policy: str = "lfu-decay",
        half_life_steps: float = 64.0,
        hint_budget: float = 0.25,
        shared: bool = False,
        layers: Sequence[int] | None = None,
        verify_first_use: bool = True,
        stream_ordered: bool = False,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        if (capacity_bytes is None) == (capacity_experts is None):
            raise ValueError("give exactly one of capacity_bytes and capacity_experts")
        self.cache = cache
        self.engine = engine
        # cache.check_experts_once before an expert's first fill (default on: a flipped bit is refused,
        # never served; costs one extra read of each fetched expert per process; False opts out)
        self.verify_first_use = verify_first_use
        self.device = torch.device(device)
        # misses ordered on the current stream without a host wait (module docstring; on CPU the
        # same path, waited for at once)
        self.stream_ordered = bool(stream_ordered) and hasattr(engine, "submit_ordered")
        self._unchecked: list[tuple[_Pool, _Pending]] = []  # ordered batches whose reads are unchecked
        self._defer_checks = self.device.type == "cuda"  # on CPU an ordered fill is waited for at once
        self._raw = None  # _submit_ordered's per-expert source addresses (and the engine's map generation)
        self.policy = policy
        self.hint_budget = float(hint_budget)
        self.layers: list[int] = list(cache.layers if layers is None else layers)
        self._pos = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts: int = int(cache.num_experts)
        self.specs = list(cache.expert_specs)
        self.expert_nbytes: int = sum(s.nbytes for s in self.specs)
        L, E = len(self.layers), self.num_experts
        total = capacity_experts if capacity_experts is not None else int(capacity_bytes) // self.expert_nbytes
        per_pool = min(total, L * E) if shared else min(total // max(L, 1), E)
        if per_pool < 1:
            gib = self.expert_nbytes * (1 if shared else L) / 2**30
            raise UnsupportedError(
                f"expert cache capacity holds {total} experts, fewer than one per pool ({L} layers)",
                f"give at least {gib:.3f} GiB, or shared=True",
            )
        self.slots_per_pool = per_pool
        groups = [list(range(L))] if shared else [[i] for i in range(L)]
        self._pools = [self._make_pool(g, per_pool) for g in groups]
        self._pool_of = {li: p for p in self._pools for li in p.layers}
        self._lut = np.full((L, E), -1, dtype=np.int64)  # layer position, expert -> slot
        self._extents: dict[tuple[int, int], object] = {}  # memo of cache.expert_extent
        self._fences: deque = deque(maxlen=256)  # (call number, event), see _fence()

        # policy state for every (layer position, expert), resident or not
        self._clock = np.zeros(1, dtype=np.int64)  # the call clock (``_now``), shared with expert_step.py
        self._last = np.full((L, E), -np.inf)
        self._logscore = np.full((L, E), -np.inf)
        calls_per_half_life = max(half_life_steps, 1e-9) * max(L, 1)
        self._lam = 0.0 if policy == "lfu" else math.log(2.0) / calls_per_half_life

        self.metrics: dict[str, float] = dict(
            calls=0, hits=0, misses=0, evictions=0, routed_bytes=0, miss_bytes=0, bytes_moved=0,
            hint_fetches=0, hint_used=0, hint_wasted=0, stall_s=0.0, admitted=0, ordered_fills=0, submit_s=0.0,
        )

    @property
    def _now(self) -> int:
        return int(self._clock[0])

    @_now.setter
    def _now(self, value: int) -> None:
        self._clock[0] = value

    # -- set-up -------------------------------------------------------------------------------
    def _make_pool(self, layer_positions: list[int], size: int) -> _Pool:
        tensors = {
            s.name: torch.empty((size, *s.shape), dtype=s.torch_dtype, device=self.device) for s in self.specs
        }
        return _Pool(
            layers=layer_positions, size=size, tensors=tensors,
            owner_li=np.full(size, -1, dtype=np.int64), owner_e=np.full(size, -1, dtype=np.int64),
            used=np.zeros(size, dtype=bool), hinted=np.zeros(size, dtype=bool),
            use_call=np.full(size, -1, dtype=np.int64), pinned=np.zeros(size, dtype=np.uint8),
        )

    def _li(self, layer: int) -> int:
        try:
            return self._pos[layer]
        except KeyError:
            raise KeyError(f"layer {layer} is not an MoE layer of this cache ({self.layers})") from None

    # -- public views -------------------------------------------------------------------------
    def slots(self, layer: int) -> dict[str, torch.Tensor]:
        """The slot tensors ``{name: [S, *shape]}`` serving ``layer`` (fixed for the whole run)."""
        return self._pool_of[self._li(layer)].tensors

    def resident(self, layer: int) -> dict[int, int]:
        """``{expert: slot}`` of the experts of ``layer`` held now (including copies in flight)."""
        row = self._lut[self._li(layer)]
        return {int(e): int(row[e]) for e in np.flatnonzero(row >= 0)}

    def expert_map(self, layer: int, device: str | torch.device | None = None) -> torch.Tensor:
        """``[E]`` int32: slot of each expert of ``layer``, -1 if not resident (vLLM ``expert_map``
        style); valid until the next call on the same pool."""
        return _to_device(torch.from_numpy(self._lut[self._li(layer)].astype(np.int32)),
                          torch.device(device or self.device))

    def slot_map(self, layer: int) -> np.ndarray:
        """``[E]`` int64 view (do not write): slot of each expert of ``layer``, -1 if not resident;
        the same array for the whole run, current after each call on the pool (no copy made)."""
        return self._lut[self._li(layer)]

    @property
    def capacity_bytes(self) -> int:
        """GPU bytes held by all slots."""
        return len(self._pools) * self.slots_per_pool * self.expert_nbytes

    # -- policy -------------------------------------------------------------------------------
    def _keys(self, li: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(primary, tie-break) eviction keys of resident experts; lower is evicted first.

        Resident experts always have a finite ``_last`` (set on use or on a hinted fill)."""
        last = self._last[li, e]
        if self.policy == "lru":
            return last, last
        # log decayed count, shifted by now * lam (common to all): -inf for never used
        key = self._logscore[li, e] + last * self._lam
        # used within the last decode step (one call per layer): evicted only after all others
        recent = (self._now - last) < len(self.layers)
        return np.where(recent, key + _RECENT_BONUS, key), last

    def _decayed(self, li, e) -> np.ndarray:
        """log of the decayed use count of (li, e) now; -inf for never used."""
        ls = self._logscore[li, e]
        if self._lam == 0.0:
            return ls
        return ls - (float(self._now) - self._last[li, e]) * self._lam  # never used: -inf - inf

    def _touch(self, li: int, experts: np.ndarray) -> None:
        if self.policy != "lru":
            self._logscore[li, experts] = np.logaddexp(self._decayed(li, experts), 0.0)
        self._last[li, experts] = float(self._now)

    def _displaces(self, pool: _Pool, victims: list[int], scores: np.ndarray) -> np.ndarray:
        """Admission: ``scores[i]`` (a newcomer's decayed use) may take ``victims[i]`` if the slot is
        free or its holder's decayed use is lower. Returns the mask of the pairs that may."""
        keep = np.ones(len(victims), dtype=bool)
        occupied = [i for i, s in enumerate(victims) if pool.owner_li[s] >= 0]
        if occupied:
            vs = np.array([victims[i] for i in occupied])
            keep[occupied] = scores[occupied] > self._decayed(pool.owner_li[vs], pool.owner_e[vs])
        return keep

    def _victims(self, pool: _Pool, n: int, protected: set[int]) -> list[int]:
        """``n`` slots to (re)fill: free ones first, then the lowest keys among unprotected ones
        (protected slots are always occupied). Returns fewer if not enough are unprotected."""
        free_mask = pool.owner_li < 0
        free = np.flatnonzero(free_mask)
        if free.size >= n:
            return free[:n].tolist()
        occ = np.flatnonzero(~free_mask)
        key, tie = self._keys(pool.owner_li[occ], pool.owner_e[occ])
        if protected:
            prot = np.zeros(pool.size, dtype=bool)
            prot[list(protected)] = True
            keep = ~prot[occ]
            occ, key, tie = occ[keep], key[keep], tie[keep]
        need = min(n - free.size, occ.size)
        if need == 0:
            return free.tolist()
        if need < occ.size:
            kth = np.partition(key, need - 1)[need - 1]
            below = np.flatnonzero(key < kth)
            at = np.flatnonzero(key == kth)
            if at.size > need - below.size:  # ties at the boundary: least recently used first
                at = at[np.argsort(tie[at], kind="stable")[: need - below.size]]
            chosen = occ[np.concatenate([below, at])]
        else:
            chosen = occ
        return free.tolist() + chosen.tolist()

    # -- copies -------------------------------------------------------------------------------
    def _fence(self):
        """An event on the current stream: all work enqueued so far (uses of slots) precedes it.

        One is recorded per ensure() call (``self._fences``: call number -> event). A refill of a
        slot last handed out by call c waits for the fence of call c + 1, the first one recorded
        after every kernel that read the slot was enqueued; not for the kernels of the latest
        layer, so the copy overlaps them (waiting on the newest fence serialised copy and compute)."""
        if self.device.type == "cuda":
            ev = torch.cuda.current_stream(self.device).record_event()
            self._fences.append((self._now, ev))
            return ev
        return None

    def _fence_after(self, call: int, newest):
        """The oldest retained fence recorded at or after ``call`` (``newest`` if none is)."""
        for c, ev in self._fences:
            if c >= call:
                return ev
        return newest

    def _wait(self, pending: _Pending) -> None:
        if not pending.done:
            t0 = time.perf_counter()
            self.engine.wait(pending.ticket)
            self.metrics["stall_s"] += time.perf_counter() - t0
            pending.done = True

    def _evict(self, pool: _Pool, slot: int) -> bool:
        """Empty ``slot`` (finish its copy in flight, drop it from the LUT); True if a kernel may
        have read it, so that the refill must wait for the fence."""
        p = pool.pending.pop(slot, None)
        if p is not None:
            try:
                self._wait(p)
            except Exception:  # a failed copy into a slot being emptied: nothing to keep
                p.done = True
        was_used = bool(pool.used[slot])
        if pool.owner_li[slot] >= 0:
            if pool.hinted[slot]:
                self.metrics["hint_wasted"] += 1
            self._lut[pool.owner_li[slot], pool.owner_e[slot]] = -1
            self.metrics["evictions"] += 1
        pool.owner_li[slot] = pool.owner_e[slot] = -1
        pool.used[slot] = pool.hinted[slot] = False
        return was_used

    def _drop_failed(self, pool: _Pool, failed: _Pending) -> None:
        """Forget every slot whose copy was ``failed`` (its bytes are not the expert's): those still
        waiting for it and those it filled last (a stream-ordered fill, no longer pending)."""
        failed.done = True
        slots = {s for s, p in pool.pending.items() if p is failed}
        slots |= {s for s, p in pool.fill_of.items() if p is failed}
        for s in slots:
            self._forget_slot(pool, s)

    def _forget_slot(self, pool: _Pool, s: int) -> None:
        """Empty slot ``s`` without counting an eviction: its bytes are not its expert's."""
        pool.pending.pop(s, None)
        pool.fill_of.pop(s, None)
        if pool.owner_li[s] >= 0:
            self._lut[pool.owner_li[s], pool.owner_e[s]] = -1
        pool.owner_li[s] = pool.owner_e[s] = -1
        pool.used[s] = pool.hinted[s] = False

    def check_ordered(self) -> None:
        """Wait for the reads of every stream-ordered fill so far and raise the first read error,
        after forgetting the slots the failed ones filled (the next call fetches those experts
        again). Kernels already enqueued on those slots read stale bytes: the caller must drop their
        results (the vLLM backend fails the step)."""
        if not self._unchecked:
            return
        first = None
        t0 = time.perf_counter()
        for pool, pend in self._unchecked:
            try:
                self.engine.wait(pend.ticket)
            except BaseException as e:
                self._drop_failed(pool, pend)
                first = first or e
            pend.done = True
        self._unchecked = []
        self.metrics["stall_s"] += time.perf_counter() - t0
        if first is not None:
            raise first

    def _refill(self, pool: _Pool, li: int, pairs: list[tuple[int, int]], fence, ordered: bool = False) -> _Pending:
        """Evict the slots of ``pairs`` and fill them; a refill of a slot a kernel may still read
        is ordered after ``fence`` (the copy stream waits on it: no host sync)."""
        if self.verify_first_use:  # the experts it fetches, each once per process, before any slot is emptied
            self.cache.check_experts_once(self.layers[li], [e for e, _ in pairs])
        last_use = max((int(pool.use_call[s]) for _, s in pairs), default=-1)
        reused = [self._evict(pool, s) for _, s in pairs]
        after = self._fence_after(last_use + 1, fence) if any(reused) else None
        ticket = self._fill(pool, li, pairs, after, ordered)
        pend = _Pending(ticket, ordered=bool(getattr(ticket, "ordered", False)))
        for _, s in pairs:
            pool.fill_of[s] = pend
        return pend

    def _fill(self, pool: _Pool, li: int, pairs: list[tuple[int, int]], after=None, ordered: bool = False):
        """Submit one Copy per (expert, slot) of layer position ``li``; returns the engine ticket.
        ``ordered``: on the current stream (``engine.submit_ordered``) where the engine can, which
        needs no ``after`` (the slots' readers are earlier on that stream)."""
        t0 = time.perf_counter()
        ticket = self._submit_ordered(pool, li, pairs) if ordered else None
        if ticket is None:  # slots stay free (and out of the LUT) if this raises
            ticket = self.engine.submit(self._copies(pool, li, pairs), after=after)
        else:
            self.metrics["ordered_fills"] += 1
        self.metrics["submit_s"] += time.perf_counter() - t0
        for e, s in pairs:
            pool.owner_li[s], pool.owner_e[s] = li, e
            self._lut[li, e] = s
        self.metrics["bytes_moved"] += len(pairs) * self.expert_nbytes
        return ticket

    def _copies(self, pool: _Pool, li: int, pairs: list[tuple[int, int]]) -> list[Copy]:
        layer = self.layers[li]
        copies = []
        for e, s in pairs:
            dst = pool.dst.get(s)
            if dst is None:  # a slot's destinations never move: build the list once
                dst = pool.dst[s] = [(spec.offset, spec.nbytes, pool.tensors[spec.name][s]) for spec in self.specs]
            copies.append(Copy(src=self._extent(li, e), dst=dst, label=f"layer {layer} expert {e}"))
        return copies

    def _extent(self, li: int, e: int):
        ext = self._extents.get((li, e))
        if ext is None:
            ext = self._extents[(li, e)] = self.cache.expert_extent(self.layers[li], e)
        return ext

    def _submit_ordered(self, pool: _Pool, li: int, pairs: list[tuple[int, int]]):
        """A stream-ordered submit of ``pairs``, or None (the engine cannot: use ``submit``). With
        the mmap engine the pieces are planned here with numpy from addresses kept per expert and
        per slot (``submit_ordered_raw``): no Copy objects or per-piece checks on the decode path."""
        if getattr(self.engine, "submit_ordered_raw", None) is None:
            return self.engine.submit_ordered(self._copies(pool, li, pairs))
        es = np.fromiter((e for e, _ in pairs), dtype=np.int64, count=len(pairs))
        ss = np.fromiter((s for _, s in pairs), dtype=np.int64, count=len(pairs))
        return self._submit_raw(li, es, self._slot_addresses(pool)[ss])

    def _slot_addresses(self, pool: _Pool) -> np.ndarray:
        """``[S, tensors]`` uint64 device addresses of the pool's slots (the non-empty tensors of
        ``_raw_plan``), C-contiguous, made once."""
        if pool.dst_ptr is None:
            keep = self._raw_plan()[3]
            pool.dst_ptr = np.ascontiguousarray(np.array(
                [[pool.tensors[sp.name][s].data_ptr() for sp in self.specs] for s in range(pool.size)],
                dtype=np.uint64)[:, keep])
        return pool.dst_ptr

    def submit_rows_ordered(self, layer: int, experts, rows: dict[str, torch.Tensor]):
        """Stream-ordered copy of ``experts`` of ``layer`` into their rows of ``rows`` (``{name: [E,
        ...]}``, contiguous, a layer buffer): the vLLM backend's sparse path. Returns the engine's
        ticket, or None where the engine has no raw ordered submit or cannot take the batch (then
        copy them another way). The caller checks the reads (``admit(..., ordered_ticket=)``)."""
        if not self.stream_ordered or getattr(self.engine, "submit_ordered_raw", None) is None:
            return None
        base, stride = self._row_addresses(rows)
        es = np.asarray(experts, dtype=np.int64).reshape(-1)
        dst = base[None, :] + es.astype(np.uint64)[:, None] * stride[None, :]
        return self._submit_raw(self._li(layer), es, dst)

    def _row_addresses(self, rows: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        """(base address, row stride in bytes) of each non-empty tensor of a layer buffer ``rows``
        (``{name: [E, ...]}``, contiguous), in ``_raw_plan``'s order."""
        _, _, sizes, keep = self._raw_plan()
        names = [sp.name for sp, k in zip(self.specs, keep) if k]
        bases, strides = np.empty(len(names), dtype=np.uint64), np.empty(len(names), dtype=np.uint64)
        for j, (name, n) in enumerate(zip(names, sizes)):
            t = rows[name]
            row = t.element_size() * (t.numel() // max(1, t.shape[0]))
            if not t.is_contiguous() or row < int(n) or t.shape[0] < self.num_experts:
                raise ValueError(f"rows[{name!r}] must be contiguous, [{self.num_experts}, ...], with rows of at "
                                 f"least {int(n)} bytes")
            bases[j], strides[j] = t.data_ptr(), row
        return bases, strides

    def _raw_plan(self):
        """([L, E] source addresses in the engine's mappings (0: not looked up yet), offsets and
        sizes of the non-empty tensors in an expert's record, their mask over ``specs``), made anew
        when the engine's map generation changed."""
        gen = self.engine.map_generation
        if self._raw is None or self._raw[0] != gen:  # mappings (re)made: addresses anew
            sizes = np.array([sp.nbytes for sp in self.specs], dtype=np.uint64)
            keep = sizes > 0
            self._raw = (gen, np.zeros(self._lut.shape, dtype=np.uint64),
                         np.array([sp.offset for sp in self.specs], dtype=np.uint64)[keep], sizes[keep], keep)
        _, src, offs, sizes, keep = self._raw
        return src, offs, sizes, keep

    def _source_addresses(self, li: int, es: np.ndarray) -> np.ndarray:
        """The addresses of experts ``es``' records of layer position ``li`` in the engine's mappings
        (``_raw_plan``'s table, looked up where still 0: mapping the file if need be)."""
        src = self._raw_plan()[0]
        base = src[li, es]
        for j in np.flatnonzero(base == 0):
            ext = self._extent(li, int(es[j]))
            base[j] = src[li, es[j]] = self.engine.mapped_address(ext.path) + int(ext.offset)
        return base

    def _submit_raw(self, li: int, es: np.ndarray, dst: np.ndarray):
        """Ordered submit of experts ``es`` of layer position ``li`` to ``dst`` ([len(es), tensors]
        device addresses) through ``engine.submit_ordered_raw``."""
        _, offs, sizes, _ = self._raw_plan()
        base = self._source_addresses(li, es)
        tr = np.empty((len(es), len(sizes), 3), dtype=np.uint64)
        tr[:, :, 0] = base[:, None] + offs[None, :]
        tr[:, :, 1] = dst
        tr[:, :, 2] = sizes[None, :]
        return self.engine.submit_ordered_raw(tr.reshape(-1, 3))

    # -- the two verbs ------------------------------------------------------------------------
    def ensure(self, layer: int, expert_ids) -> torch.Tensor:
        """Make the experts in ``expert_ids`` resident; return their slot ids (see module doc)."""
        li = self._li(layer)
        ids, out_device, out_dtype = _ids_to_numpy(expert_ids)
        uniq = sorted(set(ids.reshape(-1).tolist()))  # small: Python beats np.unique here
        if uniq and (uniq[0] < 0 or uniq[-1] >= self.num_experts):
            raise IndexError(f"expert ids must be in [0, {self.num_experts}), got {uniq[0]}..{uniq[-1]}")
        pool = self._pool_of[li]
        if len(uniq) > pool.size:
            raise UnsupportedError(
                f"layer {layer} routes {len(uniq)} distinct experts in one call but its pool has "
                f"{pool.size} slots",
                f"raise the expert cache capacity to at least {len(uniq)} experts per pool, or use layer prefetch",
            )
        self._now += 1
        fence = self._fence()  # every call: later refills can wait for exactly their slot's users
        m = self.metrics
        nb = self.expert_nbytes
        row = self._lut[li]
        uniq_a = np.array(uniq, dtype=np.int64)
        slots_now = row[uniq_a].tolist()
        misses = [e for e, s in zip(uniq, slots_now) if s < 0]
        hit_slots = {s for s in slots_now if s >= 0}
        m["calls"] += 1
        m["routed_bytes"] += len(uniq) * nb
        m["hits"] += len(hit_slots)
        m["misses"] += len(misses)
        m["miss_bytes"] += len(misses) * nb

        to_wait: list[_Pending] = []
        if misses:
            victims = self._victims(pool, len(misses), hit_slots)
            pend = self._refill(pool, li, list(zip(misses, victims)), fence, self.stream_ordered)
            for s in victims:
                pool.pending[s] = pend
            if pend.ordered and self._defer_checks:  # the stream waits for it; reads checked later
                self._unchecked.append((pool, pend))
            else:
                to_wait.append(pend)
            needed = hit_slots.union(victims)
        else:
            needed = hit_slots
        pending, hinted, used = pool.pending, pool.hinted, pool.used
        for s in needed:
            p = pending.get(s) if pending else None
            if p is not None and p not in to_wait and not p.ordered:
                to_wait.append(p)
        for p in to_wait:
            try:
                self._wait(p)
            except BaseException:
                self._drop_failed(pool, p)  # never leave a slot that looks resident but is not
                raise
        for s in needed:
            if pending:
                pending.pop(s, None)
            if hinted[s]:
                m["hint_used"] += 1
                hinted[s] = False
            used[s] = True
        needed_a = list(needed)
        pool.use_call[needed_a] = self._now
        pool.pinned[:] = 0
        pool.pinned[needed_a] = 1
        self._touch(li, uniq_a)

        out = torch.from_numpy(row[ids])
        if out_device is None:
            return out
        return _to_device(out.to(out_dtype), out_device)

    def admit(self, layer: int, routed, rows: dict[str, torch.Tensor], fetched, read_slots=(),
              max_admit: int = 4, ordered_ticket: Any = None) -> list[tuple[int, int]]:
        """A call that served ``layer`` without the pool (more distinct experts than slots: the
        caller copied its misses ``fetched`` into ``rows``, a ``{name: [E, ...]}`` layer buffer
        whose copies the current stream already waits for). Count the routed experts' use, as
        ``ensure`` does, and copy into the pool, on the device, those fetched experts whose decayed
        use beats the slot they would take (never a slot this call read, nor one with a copy in
        flight), so a pool too small for a step still learns what is hot. Returns the
        (expert, slot) pairs filled; their bytes are the rows' (copied in stream order).
        ``read_slots``: pool slots the caller's call read on the device (its hits, gathered into
        the rows): like the filled ones, a later refill waits for this call's work first.
        ``max_admit``: at most this many per call (each is one device copy per tensor, launched
        from the host on the decode path; the pool converges over a few steps anyway).
        ``ordered_ticket``: the rows' misses came by a stream-ordered batch (``submit_ordered``) whose
        reads are not checked yet: ``check_ordered`` checks it and, if it failed, forgets the slots
        filled here from its rows."""
        li = self._li(layer)
        pool = self._pool_of[li]
        source = None
        if ordered_ticket is not None:
            source = _Pending(ordered_ticket, ordered=True)
            self._unchecked.append((pool, source))
        routed = np.unique(np.asarray(routed, dtype=np.int64))
        self._now += 1
        self._fence()  # a call like ensure's: later refills wait for the kernels enqueued so far
        self._touch(li, routed)
        read = [int(x) for x in read_slots]
        if read:
            pool.used[read] = True
            pool.use_call[read] = self._now
        want = np.array([e for e in np.unique(np.asarray(fetched, dtype=np.int64)) if self._lut[li, e] < 0],
                        dtype=np.int64)
        if not want.size:
            return []
        # the slots of the latest ensure may go: the copies here run on the compute stream, after
        # every kernel enqueued before them (hints, on the copy stream, must spare those slots)
        protected = set(pool.pending) | set(read)
        victims = self._victims(pool, min(int(want.size), max(0, int(max_admit))), protected)
        if not victims:
            return []
        # the hottest fetched experts first, each only where it beats the slot's holder
        order = np.argsort(-self._decayed(li, want), kind="stable")
        want = want[order][: len(victims)]
        keep = self._displaces(pool, victims, self._decayed(li, want))  # already counted by _touch
        pairs = [(int(e), int(s)) for e, s, k in zip(want, victims, keep) if k]
        for e, s in pairs:
            self._evict(pool, s)  # the refill is a device copy on the current stream: kernels enqueued before it are done reading
            for name, t in pool.tensors.items():
                t[s].copy_(rows[name][e], non_blocking=True)
            pool.owner_li[s], pool.owner_e[s] = li, e
            self._lut[li, e] = s
            if source is not None:
                pool.fill_of[s] = source
            else:
                pool.fill_of.pop(s, None)
            pool.hinted[s] = False
            pool.used[s] = True  # written on the compute stream: a refill waits for a later fence
            pool.use_call[s] = self._now
        self.metrics["admitted"] += len(pairs)
        return pairs

    def prefetch_hint(self, layer: int, expert_ids, max_fetch: int | None = None) -> int:
        """Start fetching likely experts of ``layer`` without waiting; returns how many were started.

        Never evicts the slots of the latest ``ensure`` on the same pool; under the frequency
        policies a hinted expert does not displace an expert with a higher score. Hinted experts
        not used yet or evicted unused are kept within ``hint_budget`` x the experts the cache had
        to fetch for routing, so wrong guesses cannot push bytes moved past that ratio."""
        li = self._li(layer)
        ids, _, _ = _ids_to_numpy(expert_ids)
        uniq = np.unique(ids)
        uniq = uniq[(uniq >= 0) & (uniq < self.num_experts)]
        want = uniq[self._lut[li, uniq] < 0]
        # budget: wasted + not-yet-used hinted bytes stay <= hint_budget x the routed bytes that had
        # to be fetched, so bytes moved <= (1 + hint_budget) x needed whatever the guesses' quality
        m = self.metrics
        outstanding = sum(int(p.hinted.sum()) for p in self._pools)
        allowed = int(self.hint_budget * (m["misses"] + m["hint_used"])) - m["hint_wasted"] - outstanding
        limit = allowed if max_fetch is None else min(allowed, max_fetch)
        want = want[: max(limit, 0)]
        if not want.size:
            return 0
        pool = self._pool_of[li]
        protected = set(np.flatnonzero(pool.pinned).tolist()) | set(pool.pending)
        victims = self._victims(pool, int(want.size), protected)
        want = want[: len(victims)]
        if self.policy != "lru" and want.size:
            # admission: a guess may only displace an expert whose score is below the guess's score
            keep = self._displaces(pool, victims, np.logaddexp(self._decayed(li, want), 0.0))  # as if used once more
            victims = [s for s, k in zip(victims, keep) if k]
            want = want[keep]
        if not want.size:
            return 0
        pend = self._refill(pool, li, list(zip(want.tolist(), victims)), self._fence())
        for s in victims:
            pool.pending[s] = pend
            pool.hinted[s] = True
        if self.policy == "lru":  # an inserted guess counts as recent, else the next miss evicts it
            self._last[li, want] = float(self._now)
        else:  # keep _last finite for every resident expert (its score stays as it was)
            last = self._last[li, want]
            self._last[li, want] = np.where(np.isfinite(last), last, float(self._now))
        self.metrics["hint_fetches"] += int(want.size)
        return int(want.size)

    def sync(self) -> None:
        """Wait for every copy in flight (hints included); raise an unchecked read error."""
        for pool in self._pools:
            for p in list(pool.pending.values()):
                if not p.ordered:
                    self._wait(p)
            pool.pending.clear()
        self.check_ordered()

    # -- derived numbers ----------------------------------------------------------------------
    def summary(self) -> dict[str, float]:
        """Metrics plus hit rate and the bytes-moved ratio of the bar (moved / routed misses)."""
        m = dict(self.metrics)
        lookups = m["hits"] + m["misses"]
        m["hit_rate"] = m["hits"] / lookups if lookups else 0.0
        needed = m["miss_bytes"] + m["hint_used"] * self.expert_nbytes
        m["moved_over_needed"] = m["bytes_moved"] / needed if needed else 0.0
        m["capacity_bytes"] = self.capacity_bytes
        m["slots_per_pool"] = self.slots_per_pool
        return m
