"""LayerwisePusher + the forward's after_layer hook, with a recording sender: the hook sees the
layers in order, pushes of a granted room happen inside the forward that completes the prompt
(never in an earlier chunk's forward), an ungranted room falls back to push-after-prefill, and
a room fed to two decode ranks pushes every layer to both."""

from __future__ import annotations

import pytest
import torch

from disagg_helpers import tiny_model_and_head, worker_config
from tandem.engine import SamplingParams
from tandem.kvtransfer import Destination, ErrorKind, TransferError, TransferState
from tandem.prefill_node.layerwise import LayerwisePusher
from tandem.spec import SpecConfig, SpecEngine
from tandem.worker import aux_buffer, kv_layout


class RecordingSender:
    """The part of KVSender the pusher uses; every call lands in `log`. Like PrefillSender it
    keeps one leg per destination: `push_layers`/`finish` act on every leg of the room (logged
    per leg), `state` is the least advanced leg's, and `start` refuses a leg after a push."""

    def __init__(self, log: list, granted: set[int], refused: frozenset[int] = frozenset()) -> None:
        self.log, self.granted = log, granted  # granted: decode sessions whose GO arrived
        self.refused = refused  # decode sessions whose start raises (e.g. never connected)
        self.legs: dict[int, list[int]] = {}  # room -> decode sessions, in start order
        self.pushed: set[int] = set()  # rooms with a push

    def start(self, dest, src_page_ids, *, whole_groups=True):
        assert dest.room not in self.pushed, "a leg started after the room's first push"
        # the pusher pushes layer by layer here: nothing is to be built ahead for whole groups
        assert whole_groups is False
        if dest.receiver_session in self.refused:
            raise TransferError(ErrorKind.HANDSHAKE, "not connected", room=dest.room)
        self.legs.setdefault(dest.room, []).append(dest.receiver_session)
        self.log.append(("start", dest.room, dest.receiver_session, tuple(src_page_ids)))

    def poll(self):
        return []

    def state(self, room):
        granted = all(s in self.granted for s in self.legs[room])
        return TransferState.TRANSFERRING if granted else TransferState.RESERVED

    def push_layers(self, room, group, layers):
        self.pushed.add(room)
        self.log += [("push", room, s, group, tuple(layers)) for s in self.legs[room]]

    def finish(self, room, aux_payload):
        self.log.append(("finish", room))

    def abort(self, room):
        self.log.append(("abort", room))


@pytest.fixture(scope="module")
def engine_cfg(tmp_path_factory):
    model_dir, head_dir = tiny_model_and_head(tmp_path_factory.mktemp("m"))
    cfg = worker_config("p", model_dir, head_dir, "fake", SpecConfig(num_steps=2))
    return cfg


def run_one(cfg, granted: set[int], sessions: tuple[int, ...] = (1,)):
    """Prefill a 12-token prompt (two chunks) whose KV goes to one destination per decode
    session in `sessions`; the GO of those in `granted` arrived."""
    import dataclasses

    engine = SpecEngine.from_config(
        dataclasses.replace(cfg.engine, max_num_batched_tokens=8), cfg.spec)
    log: list = []
    layout = kv_layout(engine, aux_buffer(engine, 2))
    room = 7
    dests = tuple(Destination(receiver_session=s, room=room, page_ids=tuple(range(10)),
                              aux_slot=0, timeout_s=5.0) for s in sessions)
    pusher = LayerwisePusher(RecordingSender(log, granted), layout,
                             lambda r: dests if r == room else (), device=torch.device("cpu"))

    def hook_for(chunks):
        inner = pusher.hook_for(chunks)
        assert inner is not None
        return lambda i: (log.append(("layer", i)), inner(i))

    engine.prefill_layer_hook = hook_for
    forward = engine.runner.forward
    engine.runner.forward = lambda batch: (out := forward(batch), log.append(("end",)))[0]
    engine.add_prefill_request(list(range(3, 15)), SamplingParams(max_new_tokens=4), str(room))
    handoffs = []
    while not handoffs:
        engine.step()
        handoffs = engine.take_handoffs()
    (h,) = handoffs
    pusher.complete(room, h.page_ids, h.seed_bytes())
    engine.free_pages(h.page_ids)
    assert engine.allocator.num_free == engine.allocator.num_usable
    return log, h, engine.model.cfg.num_layers, pusher


def test_granted_room_pushes_each_layer_inside_its_forward(engine_cfg):
    log, h, num_layers, pusher = run_one(engine_cfg, granted={1})
    # 12 tokens, 8 per forward: the first chunk's forward has no hook, the second completes.
    expected = [("end",), ("start", 7, 1, h.page_ids)]
    for i in range(num_layers):
        expected += [("layer", i), ("push", 7, 1, "target", (i,))]
    expected += [("end",), ("push", 7, 1, "draft", (0,)), ("finish", 7)]
    assert log == expected
    assert pusher.num_layers_early == num_layers


def test_two_destinations_push_each_layer_to_both_inside_the_forward(engine_cfg):
    """Prefill TP 1 feeding decode TP 2 (KV heads re-slice): both legs start before the
    forward, and each target layer goes to both right after it ran."""
    log, h, num_layers, pusher = run_one(engine_cfg, granted={1, 2}, sessions=(1, 2))
    expected = [("end",), ("start", 7, 1, h.page_ids), ("start", 7, 2, h.page_ids)]
    for i in range(num_layers):
        expected += [("layer", i), ("push", 7, 1, "target", (i,)),
                     ("push", 7, 2, "target", (i,))]
    expected += [("end",), ("push", 7, 1, "draft", (0,)), ("push", 7, 2, "draft", (0,)),
                 ("finish", 7)]
    assert log == expected
    assert pusher.num_layers_early == 2 * num_layers


def test_two_destinations_one_ungranted_push_after_prefill(engine_cfg):
    """The room is granted only once every destination's GO arrived (the sender pushes a
    room's layers to all its legs): one missing GO means push-after-prefill for both."""
    log, h, num_layers, pusher = run_one(engine_cfg, granted={2}, sessions=(1, 2))
    expected = [("end",), ("start", 7, 1, h.page_ids), ("start", 7, 2, h.page_ids)]
    expected += [("layer", i) for i in range(num_layers)]
    every = tuple(range(num_layers))
    expected += [("end",), ("push", 7, 1, "target", every), ("push", 7, 2, "target", every),
                 ("push", 7, 1, "draft", (0,)), ("push", 7, 2, "draft", (0,)), ("finish", 7)]
    assert log == expected
    assert pusher.num_layers_early == 0


def test_ungranted_room_falls_back_to_push_after_prefill(engine_cfg):
    log, h, num_layers, pusher = run_one(engine_cfg, granted=set())
    expected = [("end",), ("start", 7, 1, h.page_ids)]
    expected += [("layer", i) for i in range(num_layers)]
    expected += [("end",), ("push", 7, 1, "target", tuple(range(num_layers))),
                 ("push", 7, 1, "draft", (0,)), ("finish", 7)]
    assert log == expected
    assert pusher.num_layers_early == 0


def test_forward_without_hook_is_unchanged(engine_cfg):
    """The hook is a no-op for the numbers: same logits with and without it."""
    engine = SpecEngine.from_config(engine_cfg.engine, engine_cfg.spec)
    seen: list[int] = []
    outs = []
    for hook in (None, seen.append):
        engine.prefill_layer_hook = None if hook is None else (lambda chunks, h=hook: h)
        engine.add_prefill_request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=2),
                                   f"r{len(outs)}")
        engine.step()
        (h,) = engine.take_handoffs()
        outs.append((h.first_token, h.seed.hidden.clone()))
        engine.free_pages(h.page_ids)
    assert seen == list(range(engine.model.cfg.num_layers))
    assert outs[0][0] == outs[1][0] and torch.equal(outs[0][1], outs[1][1])


def test_second_destination_refused_aborts_the_started_leg(engine_cfg):
    """A start that fails after another leg started ends that leg at once (it would otherwise
    hold decode pages until its deadline); the hand-off raises the start's error, no push."""
    import dataclasses

    engine = SpecEngine.from_config(
        dataclasses.replace(engine_cfg.engine, max_num_batched_tokens=8), engine_cfg.spec)
    log: list = []
    dests = tuple(Destination(receiver_session=s, room=7, page_ids=tuple(range(10)),
                              aux_slot=0, timeout_s=5.0) for s in (1, 2))
    pusher = LayerwisePusher(RecordingSender(log, {1, 2}, refused=frozenset({2})),
                             kv_layout(engine, aux_buffer(engine, 2)), lambda r: dests,
                             device=torch.device("cpu"))
    engine.prefill_layer_hook = pusher.hook_for
    engine.add_prefill_request(list(range(3, 15)), SamplingParams(max_new_tokens=4), "7")
    handoffs = []
    while not handoffs:
        engine.step()
        handoffs = engine.take_handoffs()
    (h,) = handoffs
    with pytest.raises(TransferError, match="not connected"):
        pusher.complete(7, h.page_ids, h.seed_bytes())
    engine.free_pages(h.page_ids)
    assert log == [("start", 7, 1, h.page_ids), ("abort", 7)]
    assert pusher.num_layers_early == 0
