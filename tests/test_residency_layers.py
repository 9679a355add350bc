"""The vLLM backend's layer mode (``Residency._layer_mode``: calls that stream whole layers, as prefill's
do) over the real ``LayerPrefetcher`` and an engine that poisons its destinations at submit and copies
later (``fakes.DeferredEngine``), on the CPU without vLLM: each layer's buffer holds exactly that
layer's bytes when ``route()`` returns (vLLM launches its kernel next), for one buffer (lookahead 0)
and more; with two or more, the next layer's copy is queued before the current one is waited for."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fakes import DeferredEngine, layer_matches, make_cache
from mmap_offload.prefetch import LayerPrefetcher
from mmap_offload.vllm_backend.options import MmapOptions
from mmap_offload.vllm_backend.residency import Residency

LAYERS = (0, 2, 5, 7)
E, TOKENS, TOP_K = 8, 4, 3


class LoggedEngine(DeferredEngine):
    """DeferredEngine that logs ("submit", layer) and ("wait", layer) in call order."""

    def __init__(self):
        super().__init__(seed=3)
        self.log: list[tuple[str, int]] = []
        self._layer_of: dict[int, int] = {}

    def submit(self, copies, after=None):
        ticket = super().submit(copies, after)
        layer = int(copies[0].label.split()[1])  # prefetch.py labels a layer's copy "layer L"
        self._layer_of[ticket] = layer
        self.log.append(("submit", layer))
        return ticket

    def wait(self, ticket) -> None:
        self.log.append(("wait", self._layer_of[ticket]))
        super().wait(ticket)


@pytest.mark.parametrize("lookahead", [0, 1, 2])
def test_each_layer_holds_its_bytes_when_route_returns(tmp_path, lookahead):
    """3 passes over 4 layers, every call beyond the layer threshold (4 tokens x top-3 of 8 experts,
    layer_stream_fraction 0.25, sparse_max_ids 0): after each route() the layer's buffer equals the
    cache's bytes of that layer. With lookahead 0 all layers share one buffer, so starting the next
    layer ahead would poison this one before its kernel ran (what the code did before: the next
    layer's copy was queued right after binding this one); with more buffers the next layer is
    started ahead, and from the second call of a pass on its copy is queued before this layer's
    wait."""
    c = make_cache(tmp_path, layers=LAYERS, num_experts=E)
    eng = LoggedEngine()
    pf = LayerPrefetcher(c, eng, "cpu", lookahead=lookahead, layers=list(LAYERS))
    targets = [SimpleNamespace(layer=l, index=i, served=(), experts=None) for i, l in enumerate(LAYERS)]
    opts = MmapOptions(layer_stream_fraction=0.25, sparse_max_ids=0)
    off = SimpleNamespace(options=opts, device=torch.device("cpu"), cache=c, engine=eng, targets=targets,
                          tp_size=1, _transforms={}, prefetcher=pf, _layer_tensors=lambda t: pf.wait_for_layer(t.layer))
    nbytes = sum(s.nbytes for s in c.expert_specs)
    res = Residency(off, capacity_bytes=2 * len(LAYERS) * nbytes)
    rng = np.random.default_rng(0)
    try:
        assert (pf.num_buffers == 1) == (lookahead == 0)  # (4 layers over 3 buffers take 4: assign_buffers)
        for _ in range(3):
            for t in targets:
                ids = torch.from_numpy(np.stack([rng.choice(E, size=TOP_K, replace=False) for _ in range(TOKENS)]))
                w = torch.rand(TOKENS, TOP_K)
                nxt = LAYERS[(t.index + 1) % len(LAYERS)]
                resident = pf.holds(nxt)  # (with a buffer per layer, from the second pass on)
                start = len(eng.log)
                wk, out = res.route(t, w, ids, None)
                assert wk is w and torch.equal(out, ids)
                assert layer_matches(c, t.layer, pf.buffer_tensors(t.layer)), (lookahead, t.layer)
                calls = eng.log[start:]
                if lookahead == 0:
                    assert ("submit", nxt) not in calls  # one buffer: nothing started ahead
                elif not resident:
                    assert ("submit", nxt) in calls
                    if ("submit", t.layer) not in calls:  # this layer was on its way: the next queued first
                        assert calls.index(("submit", nxt)) < calls.index(("wait", t.layer)), calls
        assert res.metrics["layer_calls"] == 3 * len(LAYERS)
        if lookahead:  # every layer but the first call's was started ahead of its own call
            assert pf.metrics["demand_loads"] == 1
        else:
            assert pf.metrics["demand_loads"] == 3 * len(LAYERS)
    finally:
        res.close()


@pytest.mark.parametrize("graph_mode", ["piecewise", "eager"])
def test_route_gives_graph_padding_rows_row_zeros_experts(tmp_path, monkeypatch, graph_mode):
    """A piecewise-graph forward padded from 2 tokens to 4 (``patches.unpadded_tokens`` says 2): route()
    hands the layer's kernel row 0's experts for the two padding rows (their own would be misses for
    outputs nobody reads); served eagerly vLLM never pads, and the ids pass as the router gave them."""
    import mmap_offload.vllm_backend.residency as resmod

    monkeypatch.setattr(resmod, "unpadded_tokens", lambda: 2)
    c = make_cache(tmp_path, layers=LAYERS, num_experts=E)
    eng = DeferredEngine(seed=1)
    pf = LayerPrefetcher(c, eng, "cpu", lookahead=1, layers=list(LAYERS))
    targets = [SimpleNamespace(layer=l, index=i, served=(), experts=None) for i, l in enumerate(LAYERS)]
    off = SimpleNamespace(options=MmapOptions(layer_stream_fraction=0.25, sparse_max_ids=0), device=torch.device("cpu"),
                          cache=c, engine=eng, targets=targets, tp_size=1, _transforms={}, prefetcher=pf,
                          _layer_tensors=lambda t: pf.wait_for_layer(t.layer), graph_mode=graph_mode)
    nbytes = sum(s.nbytes for s in c.expert_specs)
    res = Residency(off, capacity_bytes=2 * len(LAYERS) * nbytes)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0], [5, 6, 7]])
    try:
        _, out = res.route(targets[0], torch.rand(TOKENS, TOP_K), ids, None)
        if graph_mode == "piecewise":
            assert out.tolist() == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [0, 1, 2]] and res.metrics["padded_rows"] == 2
        else:
            assert torch.equal(out, ids) and res.metrics["padded_rows"] == 0
    finally:
        res.close()
