"""`LayerwisePusher`: the prefill worker's layer-wise KV push (WorkerConfig.layerwise_push).

In the prefill forward that completes a prompt (its last chunk; earlier chunks' pages are
already complete in every layer), target layer l's pages leave as soon as layer l ran, so the
transfer of a long prompt hides behind the rest of its prefill instead of following it:

    hook_for(chunks)   before the forward: `start` each completing request's transfer to each
                       of its destinations (BEGIN per decode rank it feeds)
    after layer l      pump the sender; for every room whose grant (GO) arrived from every
                       destination, push target layers [first not pushed .. l] (a late GO
                       catches up on earlier layers)
    after_target       after the forward's sampling sync, before the draft prefill: start the
                       rooms whose destination arrived during the forward (concurrent
                       dispatch), queue every target layer not pushed yet
    complete(room)     after the forward + draft prefill (the hand-off): the target layers still
                       missing, every draft layer, then `finish` with the EAGLE seed

Several destinations (prefill and decode TP sizes differ, the KV heads re-slice): the sender
keeps one leg per decode rank, and `push_layers`/`finish`/`state` act on the room, i.e. on every
leg; a room is granted once no leg waits for GO any more (`state` is the least advanced leg's),
and `start` refuses a new leg after the first push, so every leg starts before the forward.

With `per_layer=False` (the default push-after-prefill, `layerwise_push: false`) the pusher
only starts each transfer before the forward and pushes every layer in `complete`: the BEGIN ->
GO round trip then overlaps the prompt's forward instead of following it (no hook runs inside
the forward, no per-layer sync).

A room whose GO never arrived during the forward therefore degrades to push-after-prefill. The
pages pushed are the same either way, so the decode side receives bit-identical KV: layer l's
pages are never written again by this request once layer l ran (draft prefill writes only the
draft group, pushed in `complete`).

Memory ordering: on the CPU a layer's K/V is in memory when the layer returns (synchronous
ops), so the backend may read it at once. On CUDA the layer's kernels are only enqueued when
the hook runs; the hook synchronizes the current stream before the first push of a layer, so
the backend (RDMA/NVLink reading device memory outside the stream) never sees stale KV. That
costs one host sync per layer, only in a forward that has something to push.

Owns: the table of rooms started early and how many target layers each has pushed, and the
send outcomes its pumping collected (the worker takes them with the sender's own).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tandem.engine.scheduler import ScheduledChunk
from tandem.kvtransfer import (Destination, KVLayout, KVSender, SendOutcome, TransferError,
                               TransferState)


@dataclass(slots=True)
class _Early:
    """A room whose transfer started before its forward (same page ids as its hand-off)."""

    page_ids: tuple[int, ...]
    num_dests: int  # decode ranks fed: legs at the sender, all started before the forward
    num_pushed: int = 0  # target layers [0, num_pushed) are queued at the sender
    error: TransferError | None = None  # start/push failed: reported at the hand-off


class LayerwisePusher:
    def __init__(self, sender: KVSender, layout: KVLayout,
                 dests_of: Callable[[int], Sequence[Destination]], *, device: torch.device,
                 target_group: str = "target", per_layer: bool = True) -> None:
        # dests_of(room): one Destination per decode rank the room goes to; empty: not early
        self.sender, self.layout, self.dests_of = sender, layout, dests_of  # layout: the sender's
        self.target_group, self.device = target_group, device
        self.per_layer = per_layer  # False: start early, push everything in complete()
        self._early: dict[int, _Early] = {}  # room -> its transfer, until complete()/drop()
        self._outcomes: list[SendOutcome] = []  # collected by the hook's pumping
        # (target layer, destination) pairs pushed inside a forward, all rooms in total
        self.num_layers_early = 0

    def hook_for(self, chunks: Sequence[ScheduledChunk]) -> Callable[[int], None] | None:
        """The `after_layer` hook of a forward in which `chunks` complete their prompts."""
        rooms = self._start(chunks)
        if not rooms or not self.per_layer:
            return None
        return lambda layer: self._after_layer(rooms, layer)

    def _start(self, chunks: Sequence[ScheduledChunk]) -> list[int]:
        """Start (BEGIN) the transfer of each chunk's room to each of its destinations; the
        rooms started (a room without destinations, or already started, is skipped)."""
        rooms: list[int] = []
        for c in chunks:
            room = int(c.req_id)
            dests = self.dests_of(room)
            if not dests or room in self._early:
                continue
            entry = self._early[room] = _Early(page_ids=c.page_ids, num_dests=len(dests))
            try:
                for dest in dests:
                    # layer by layer: nothing to build ahead (a partial push drops it)
                    self.sender.start(dest, c.page_ids, whole_groups=not self.per_layer)
            except TransferError as exc:
                entry.error = exc
                if dest is not dests[0]:  # end the legs already started: no push will follow
                    self.sender.abort(room)
                continue
            rooms.append(room)
        return rooms

    def after_target(self, chunks: Sequence[ScheduledChunk]) -> None:
        """The forward of `chunks` is over and synced (their target KV is final on the
        device); their draft prefill is still to come. Start the transfers of rooms whose
        destination arrived during the forward (concurrent dispatch), and queue every target
        layer not pushed yet: writes of rooms already granted leave now, and the BEGIN -> GO
        round trip of the others overlaps the draft prefill instead of following it."""
        self._start([c for c in chunks if int(c.req_id) not in self._early])
        last = self.layout.region(self.target_group).num_layers
        for c in chunks:
            entry = self._early.get(int(c.req_id))
            if entry is None or entry.error is not None or entry.num_pushed == last:
                continue
            try:
                self.sender.push_layers(int(c.req_id), self.target_group,
                                        range(entry.num_pushed, last))
            except TransferError as exc:
                entry.error = exc
                continue
            entry.num_pushed = last

    def pump(self) -> None:
        """Let the sender act on what arrived (a GO) and post queued writes now. The worker calls
        it right after a prefill step, while the draft prefill may still run on the device: the
        target KV `after_target` queued moves during it (it only reads target pages, final
        since the step's sampling sync)."""
        self._outcomes += self.sender.poll()

    def _after_layer(self, rooms: list[int], layer: int) -> None:
        self._outcomes += self.sender.poll()  # GO arrives through the pump
        ready = [r for r in rooms if self._early[r].error is None
                 and self.sender.state(r) is TransferState.TRANSFERRING]
        if not ready:
            return
        if self.device.type == "cuda":  # the layer's KV writes are only enqueued: land them
            torch.cuda.current_stream(self.device).synchronize()
        for room in ready:
            entry = self._early[room]
            try:
                self.sender.push_layers(room, self.target_group,
                                        range(entry.num_pushed, layer + 1))
            except TransferError as exc:
                entry.error = exc
                continue
            # Counted per destination: each leg queued these layers (its own head slice).
            self.num_layers_early += (layer + 1 - entry.num_pushed) * entry.num_dests
            entry.num_pushed = layer + 1

    def started(self, room: int) -> bool:
        return room in self._early

    def complete(self, room: int, page_ids: Sequence[int], aux_payload: bytes) -> None:
        """The hand-off of a room started early: push what is left and finish. Raises the
        TransferError its start/pushes met (the room is terminal at the sender then)."""
        entry = self._early.pop(room)
        if tuple(page_ids) != entry.page_ids:  # the scheduler detaches the chunk's pages
            raise AssertionError(f"room {room}: hand-off pages differ from the started ones")
        if entry.error is not None:
            raise entry.error
        for region in self.layout.regions:
            first = entry.num_pushed if region.name == self.target_group else 0
            if first < region.num_layers:
                self.sender.push_layers(room, region.name, range(first, region.num_layers))
        self.sender.finish(room, aux_payload)

    def drop(self, room: int, *, abort: bool) -> None:
        """A room started early needs no transfer after all. `abort`: end it now (the request
        was aborted; decode was told by the router). Otherwise (its first token finished it)
        it is left to decode: the router aborts decode for a request prefill finished, and
        that ABORT ends the room here (the deadline otherwise); aborting from this side could
        reach decode first and surface as a transfer error for a request that succeeded.
        The outcome comes back through poll() and concerns no one."""
        if self._early.pop(room, None) is not None and abort:
            self.sender.abort(room)

    def take_outcomes(self) -> list[SendOutcome]:
        out, self._outcomes = self._outcomes, []
        return out
