"""Layer prefetch: whole MoE layers copied into fixed GPU slot buffers ahead of their compute.

    LayerPrefetcher
      owns   num_buffers buffers, each {name: Tensor[E, *shape]} on the device, allocated once:
             addresses never change, so CUDA graphs / torch.compile see fixed addresses, and the
             tensors have the [E, ...] form vLLM's MoE kernels take as parameters
      maps   each layer to one buffer, statically, such that any lookahead + 1 cyclically
             consecutive layers (the last layer's successor is the first) use distinct buffers;
             ``num_buffers`` (the attribute) is the count used: raised only where the layer
             count leaves no choice (5 layers cannot alternate between 2 buffers across passes:
             they get 3; see ``assign_buffers``); lookahead + 2 buffers never need raising
      uses   engine.submit / engine.wait (transfer.py): one Copy per layer, src =
             cache.layer_extent(layer) (one read per layer), one dst per (expert, tensor)

The usual schedule, with lookahead k and num_buffers = k + 1 (the default; a smaller num_buffers
caps the lookahead at num_buffers - 1):

    pf.start_prefetch(layers[0]) ... pf.start_prefetch(layers[k - 1])      # once
    for i, layer in enumerate(layers):
        w = pf.wait_for_layer(layer)             # copy of `layer` complete; its tensors
        pf.start_prefetch(pf.layer_after(layer)) # copy of layer i+k overlaps compute of layer i
        moe(x, w["w13_weight"], w["w2_weight"], ...)

Buffer release (the rule callers must respect): the tensors handed out for layer L stay valid
until a layer that maps to the same buffer is started, by ``start_prefetch`` or implicitly by
``wait_for_layer`` of a layer that is not loaded. At that moment an event is recorded on the
current CUDA stream and the new copy starts only after it completed (the copy stream waits on
it; the host does not), so every use of L enqueued on the current stream before that call is
safe. With the schedule above layer i+k displaces layer i-1, whose compute was enqueued before.
A buffer whose copy has not completed is never handed out: ``wait_for_layer`` waits for it (and
starts it first if nobody did, counted as a demand load); on CUDA "waits" means ``engine.wait``:
the current stream waits on the copy's event, so call it with the stream that runs the layer's
compute current. A copy that fails raises from ``wait_for_layer``; the buffer then holds nothing
and the next wait reloads it.

Parameter mode (``as_parameters=True``): the buffers are ``torch.nn.Parameter`` (no grad), and
``attach(layer, module)`` points ``module.<name>`` at its buffer, so a vLLM layer's ``w13_weight``
etc. alias the slot buffer that the prefetcher fills in place. Layers mapped to the same buffer
share storage; only the layer most recently waited for holds its own bytes.

Metrics (``metrics``): loads (copies submitted), demand_loads (started by wait_for_layer),
reuses (waited for a layer still resident: no copy), bytes_moved, stall_s (host time blocked in
``engine.wait``; on CUDA that is the read and issue of the copies, not the device transfer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .cache_format import warmup_command
from .errors import CacheError
from .transfer import Copy

__all__ = ["LayerPrefetcher", "assign_buffers"]


def assign_buffers(num_layers: int, num_buffers: int, window: int | None = None) -> tuple[list[int], int]:
    """Buffer index per layer position, and the buffer count actually used.

    Any ``window`` (default ``num_buffers``; the prefetcher uses lookahead + 1) cyclically
    consecutive positions get distinct buffers. Positions are cut into blocks of ``window`` to
    ``num_buffers`` consecutive layers, each numbered 0, 1, ...; that works whenever some block
    count q has q * window <= num_layers <= q * num_buffers. Otherwise (e.g. 5 layers, 2 buffers,
    window 2: an odd cycle cannot alternate) the count is raised to the least that works,
    ceil(num_layers / (num_layers // window))."""
    w = num_buffers if window is None else max(1, min(window, num_buffers))
    if num_buffers >= num_layers:
        return list(range(num_layers)), num_layers
    q = -(-num_layers // num_buffers)  # fewest blocks of at most num_buffers
    if q * w > num_layers:  # no split into blocks of lengths in [w, num_buffers]: more buffers
        q = num_layers // w
    base, extra = divmod(num_layers, q)
    out: list[int] = []
    for j in range(q):
        out.extend(range(base + (1 if j < extra else 0)))
    return out, max(out) + 1


@dataclass
class _Buffer:
    tensors: dict[str, torch.Tensor]
    layer: int | None = None  # layer whose bytes it holds or is receiving
    ticket: Any = None  # copy in flight, None once waited for
    handed_out: bool = False  # wait_for_layer returned it since it was filled
    dst_list: list | None = None  # (offset, nbytes, view) of every expert tensor: built once


class LayerPrefetcher:
    """Fixed per-layer slot buffers filled ahead of compute (see module docstring)."""

    def __init__(
        self,
        cache,
        engine,
        device: str | torch.device = "cpu",
        lookahead: int = 1,
        num_buffers: int | None = None,
        *,
        layers: Sequence[int] | None = None,
        as_parameters: bool = False,
        verify_first_use: bool = True,
    ):
        if lookahead < 0:
            raise ValueError(f"lookahead={lookahead} must be >= 0")
        self.cache = cache
        self.engine = engine
        # cache.check_layer_once before a layer's first copy (default on: a flipped bit is refused, never
        # served; costs one read of each layer per process; verify_first_use=False opts out)
        self.verify_first_use = verify_first_use
        self.device = torch.device(device)
        self.layers: list[int] = list(cache.layers if layers is None else layers)
        if not self.layers:
            raise ValueError("no layers to prefetch")
        nb = lookahead + 1 if num_buffers is None else int(num_buffers)
        if nb < 1:
            raise ValueError(f"num_buffers={nb} must be >= 1")
        # a copy k layers ahead needs k + 1 buffers: with fewer, the lookahead is capped
        self.lookahead = min(lookahead, nb - 1)
        self._buf_index, self.num_buffers = assign_buffers(len(self.layers), nb, window=self.lookahead + 1)
        self._pos = {layer: i for i, layer in enumerate(self.layers)}
        self.specs = list(cache.expert_specs)
        self.num_experts = int(cache.num_experts)
        self.record_nbytes = int(cache.record_nbytes)
        self.layer_nbytes = self.num_experts * sum(s.nbytes for s in self.specs)
        self.as_parameters = as_parameters
        self._buffers = [self._make_buffer() for _ in range(self.num_buffers)]
        self.metrics: dict[str, float] = dict(loads=0, demand_loads=0, reuses=0, bytes_moved=0, stall_s=0.0)

    def _make_buffer(self) -> _Buffer:
        tensors: dict[str, torch.Tensor] = {}
        for s in self.specs:
            t = torch.empty((self.num_experts, *s.shape), dtype=s.torch_dtype, device=self.device)
            tensors[s.name] = torch.nn.Parameter(t, requires_grad=False) if self.as_parameters else t
        return _Buffer(tensors)

    # -- mapping ------------------------------------------------------------------------------
    def _buffer_of(self, layer: int) -> _Buffer:
        try:
            return self._buffers[self._buf_index[self._pos[layer]]]
        except KeyError:
            raise KeyError(f"layer {layer} is not an MoE layer of this cache ({self.layers})") from None

    def buffer_index(self, layer: int) -> int:
        """Which buffer serves ``layer`` (fixed for the life of the prefetcher)."""
        self._buffer_of(layer)
        return self._buf_index[self._pos[layer]]

    def layer_after(self, layer: int, k: int | None = None) -> int:
        """The layer ``k`` (default: lookahead) positions after ``layer``, wrapping to the next pass."""
        step = self.lookahead if k is None else k
        return self.layers[(self._pos[layer] + step) % len(self.layers)]

    def buffer_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """The fixed tensors ``layer`` is served from (whatever they hold now); for graph capture."""
        return self._buffer_of(layer).tensors

    def attach(self, layer: int, module: torch.nn.Module, names: dict[str, str] | None = None) -> None:
        """Make ``module.<attr>`` alias ``layer``'s buffer for every cache tensor name.

        ``names`` maps cache tensor names to attribute names (default: the same name). An existing
        Parameter keeps its identity and gets the buffer as its ``.data``; a missing one is added."""
        buf = self._buffer_of(layer)
        for s in self.specs:
            attr = (names or {}).get(s.name, s.name)
            t = buf.tensors[s.name]
            old = getattr(module, attr, None)
            if isinstance(old, torch.nn.Parameter):
                if tuple(old.shape) != tuple(t.shape) or old.dtype != t.dtype:
                    raise CacheError(
                        f"layer {layer}: {attr} is {tuple(old.shape)} {old.dtype} in the model but "
                        f"{tuple(t.shape)} {t.dtype} in the cache",
                        f"rebuild the cache for this model: "
                        f"{warmup_command(self.cache.dir, self.cache.manifest.checkpoint_path)}",
                    )
                old.data = t.data if isinstance(t, torch.nn.Parameter) else t
            else:
                param = t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
                if old is not None:
                    delattr(module, attr)
                module.register_parameter(attr, param)

    # -- the two verbs ------------------------------------------------------------------------
    def start_prefetch(self, layer: int) -> None:
        """Start copying ``layer`` into its buffer, unless it is there or on its way already.

        Releases the layer the buffer held (see the release rule in the module docstring)."""
        buf = self._buffer_of(layer)
        if buf.layer == layer:
            return
        self._load(buf, layer)

    def holds(self, layer: int) -> bool:
        """Whether ``layer`` is in its buffer or on its way there (``start_prefetch`` would do nothing)."""
        return self._buffer_of(layer).layer == layer

    def wait_for_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Return ``{name: [E, *shape]}`` holding ``layer``'s cache bytes; blocks until copied."""
        buf = self._buffer_of(layer)
        if buf.layer != layer:
            self._load(buf, layer)
            self.metrics["demand_loads"] += 1
        elif buf.ticket is None:
            self.metrics["reuses"] += 1
        if buf.ticket is not None:
            self._finish(buf)
        buf.handed_out = True
        return buf.tensors

    def claim(self, layer: int, event: bool = True) -> tuple[dict[str, torch.Tensor], Any]:
        """Take ``layer``'s buffer for the caller to fill itself (only some experts, say): returns
        ``(tensors, after)``, the buffer afterwards holds no layer for the prefetcher (a later
        ``wait_for_layer`` reloads it). The release rule holds: ``after`` is an event recorded on
        the current CUDA stream (None on CPU or when nothing used the buffer) that copies into it
        from another stream must wait for; copies on the current stream are ordered anyway, so a
        caller that copies only there passes ``event=False`` (no event made: None)."""
        buf = self._buffer_of(layer)
        after = self._release(buf, event)
        buf.handed_out = True  # the caller's bytes: the next copy into it waits for their users
        return buf.tensors, after

    def sync(self) -> None:
        """Wait for every copy in flight."""
        for buf in self._buffers:
            if buf.ticket is not None:
                self._finish(buf)

    # -- mechanism ----------------------------------------------------------------------------
    def _finish(self, buf: _Buffer) -> None:
        t0 = time.perf_counter()
        try:
            self.engine.wait(buf.ticket)
        except BaseException:
            buf.layer = buf.ticket = None  # holds nothing valid: the next wait_for_layer reloads
            raise
        finally:
            self.metrics["stall_s"] += time.perf_counter() - t0
        buf.ticket = None

    def _release(self, buf: _Buffer, event: bool = True) -> Any:
        """Empty ``buf`` for a new writer: finish a copy in flight (never two writers at once), mark
        it as holding nothing, and return the event a copy into it must wait for (None if nothing
        used it, on CPU, or not asked for: ``event=False``): every use of the old bytes was enqueued on the current stream before
        this call, so the copy stream waits for them (no host sync)."""
        if buf.ticket is not None:
            self._finish(buf)
        after = None
        if event and buf.handed_out and self.device.type == "cuda":
            after = torch.cuda.current_stream(self.device).record_event()
        buf.layer = None  # holds nothing valid until the new bytes are in
        buf.handed_out = False
        return after

    def _load(self, buf: _Buffer, layer: int) -> None:
        if self.verify_first_use:
            self.cache.check_layer_once(layer)  # raises before anything of a corrupt layer is copied
        after = self._release(buf)
        dst = buf.dst_list
        if dst is None:  # the same per buffer every time (fixed addresses): build it once
            dst = []
            for e in range(self.num_experts):
                base = e * self.record_nbytes
                for s in self.specs:
                    dst.append((base + s.offset, s.nbytes, buf.tensors[s.name].data[e]))
            buf.dst_list = dst
        copies = [Copy(src=self.cache.layer_extent(layer), dst=dst, label=f"layer {layer}")]
        buf.ticket = self.engine.submit(copies, after=after)
        buf.layer = layer
        self.metrics["loads"] += 1
        self.metrics["bytes_moved"] += self.layer_nbytes
