"""LayerwisePusher + the forward's after_layer hook, with a recording sender: the hook sees the
layers in order, pushes of a granted room happen inside the forward that completes the prompt
(never in an earlier chunk's forward), an ungranted room falls back to push-after-prefill."""

from __future__ import annotations

import pytest
import torch

from disagg_helpers import tiny_model_and_head, worker_config
from tandem.deploy.worker_config import aux_buffer, kv_layout
from tandem.engine import SamplingParams
from tandem.kvtransfer import Destination, TransferState
from tandem.prefill_node.layerwise import LayerwisePusher
from tandem.spec import SpecConfig, SpecEngine


class RecordingSender:
    """The part of KVSender the pusher uses; every call lands in `log`."""

    def __init__(self, log: list, granted: bool) -> None:
        self.log, self.granted = log, granted

    def start(self, dest, src_page_ids):
        self.log.append(("start", dest.room, tuple(src_page_ids)))

    def poll(self):
        return []

    def state(self, room):
        return TransferState.TRANSFERRING if self.granted else TransferState.RESERVED

    def push_layers(self, room, group, layers):
        self.log.append(("push", room, group, tuple(layers)))

    def finish(self, room, aux_payload):
        self.log.append(("finish", room))

    def abort(self, room):
        self.log.append(("abort", room))


@pytest.fixture(scope="module")
def engine_cfg(tmp_path_factory):
    model_dir, head_dir = tiny_model_and_head(tmp_path_factory.mktemp("m"))
    cfg = worker_config("p", model_dir, head_dir, "fake", SpecConfig(num_steps=2))
    return cfg


def run_one(cfg, granted: bool):
    import dataclasses

    engine = SpecEngine.from_config(
        dataclasses.replace(cfg.engine, max_num_batched_tokens=8), cfg.spec)
    log: list = []
    layout = kv_layout(engine, aux_buffer(engine, 2))
    room = 7
    dest = Destination(receiver_session=1, room=room, page_ids=tuple(range(10)), aux_slot=0,
                       timeout_s=5.0)
    pusher = LayerwisePusher(RecordingSender(log, granted), layout, {room: dest}.get,
                             device=torch.device("cpu"))

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
    log, h, num_layers, pusher = run_one(engine_cfg, granted=True)
    # 12 tokens, 8 per forward: the first chunk's forward has no hook, the second completes.
    expected = [("end",), ("start", 7, h.page_ids)]
    for i in range(num_layers):
        expected += [("layer", i), ("push", 7, "target", (i,))]
    expected += [("end",), ("push", 7, "draft", (0,)), ("finish", 7)]
    assert log == expected
    assert pusher.num_layers_early == num_layers


def test_ungranted_room_falls_back_to_push_after_prefill(engine_cfg):
    log, h, num_layers, pusher = run_one(engine_cfg, granted=False)
    expected = [("end",), ("start", 7, h.page_ids)]
    expected += [("layer", i) for i in range(num_layers)]
    expected += [("end",), ("push", 7, "target", tuple(range(num_layers))),
                 ("push", 7, "draft", (0,)), ("finish", 7)]
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
