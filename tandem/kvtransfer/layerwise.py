"""Layer-wise push vs push-after-compute, measured with a simulated per-layer compute time.

Layer-wise: after "computing" layer l of a group, its pages are queued at once, so they move while
layer l+1 computes; the completion still waits for every layer + the aux seed. Push-after-compute:
everything is queued once the whole prefill finished. `exposed_s` is the transfer time the
request still waits for after compute: what layer-wise push is meant to shrink.

The real thing -- pushes driven by the prefill forward's per-layer hook -- is
prefill_node/layerwise.py (WorkerConfig.layerwise_push), measured by benchmarks/layerwise_push.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.kvtransfer.contract import Destination, KVSender
from tandem.kvtransfer.layout import KVLayout


@dataclass(frozen=True, slots=True, kw_only=True)
class PushTiming:
    mode: str  # "layerwise" | "after_compute"
    compute_s: float  # simulated compute, all layers of all groups
    total_s: float  # first layer's compute starts -> transfer DONE (as seen by the sender)
    exposed_s: float  # total_s - compute_s: transfer latency not hidden behind compute


def _busy(sender: KVSender, seconds: float, pump: Callable[[], object]) -> None:
    """Simulate compute for `seconds` while the transfer keeps progressing."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sender.poll()
        pump()
        time.sleep(min(0.0005, max(0.0, end - time.perf_counter())))


def timed_push(sender: KVSender, layout: KVLayout, dest: Destination, src_page_ids: Sequence[int],
               aux_payload: bytes, *, compute_s_per_layer: float, layerwise: bool,
               pump: Callable[[], object] = lambda: None, timeout_s: float = 60.0) -> PushTiming:
    """One transfer of every group in `layout` (the sender's), timed. `pump` is called while
    waiting (an in-process receiver's poll, for the fake backend)."""
    sender.start(dest, src_page_ids, whole_groups=not layerwise)
    t0 = time.perf_counter()
    num_layers = 0
    for region in layout.regions:  # target layers first, then the draft's, as prefill runs them
        for layer in range(region.num_layers):
            _busy(sender, compute_s_per_layer, pump)
            num_layers += 1
            if layerwise:
                sender.push_layers(dest.room, region.name, range(layer, layer + 1))
    if not layerwise:
        for region in layout.regions:
            sender.push_layers(dest.room, region.name, range(region.num_layers))
    sender.finish(dest.room, aux_payload)
    end = time.perf_counter() + timeout_s
    while not sender.state(dest.room).terminal and time.perf_counter() < end:
        sender.poll()
        pump()
        time.sleep(0.0002)
    sender.wait(dest.room, timeout_s=0.0 if sender.state(dest.room).terminal else 1.0)
    total = time.perf_counter() - t0
    compute = num_layers * compute_s_per_layer
    return PushTiming(mode="layerwise" if layerwise else "after_compute", compute_s=compute,
                      total_s=total, exposed_s=max(0.0, total - compute))


def compare_push_modes(sender: KVSender, layout: KVLayout, make_dest: Callable[[], Destination],
                       src_page_ids: Sequence[int], aux_payload: bytes, *,
                       compute_s_per_layer: float, pump: Callable[[], object] = lambda: None,
                       ) -> tuple[PushTiming, PushTiming]:
    """(after_compute, layerwise) timings of the same transfer; `make_dest` reserves a fresh
    room each call."""
    after = timed_push(sender, layout, make_dest(), src_page_ids, aux_payload,
                       compute_s_per_layer=compute_s_per_layer, layerwise=False, pump=pump)
    layered = timed_push(sender, layout, make_dest(), src_page_ids, aux_payload,
                         compute_s_per_layer=compute_s_per_layer, layerwise=True, pump=pump)
    return after, layered
