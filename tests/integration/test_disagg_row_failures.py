"""One request can never stop a disaggregated worker: a PrefillWorker and a DecodeWorker in
one process on their loop threads (as in their Ray actors), KV over the fake backend, the test
playing the router. Requests at the sampling edges (temperature 1e-300, top_p 1e-300) are
served like any other; a request whose sampling raises (the test-only `sampling_fault` hook)
on the prefill worker ends with `PrefillResult(ok=False, error_kind="request")`, on the decode
worker -- in a speculative round's acceptance -- with `DecodeOutput(finish_reason="error",
error_kind="request")`; the other requests of the batch get the colocated engine's tokens, the
next request is served, and both workers end with every page free."""

from __future__ import annotations

import queue
import time
from dataclasses import replace

import pytest

from disagg_helpers import tiny_model_and_head, worker_config
from tandem.decode_node.worker import DecodeWorker
from tandem.engine import SamplingFault, SamplingParams
from tandem.prefill_node.worker import PrefillWorker
from tandem.spec import SpecConfig, SpecEngine
from tandem.worker import WorkerLoop

pytestmark = pytest.mark.timeout(180)

SPEC = SpecConfig(num_steps=3)
EVENTS: queue.Queue = queue.Queue()  # (side "p"/"d", output) from the two loop threads


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


def _with_fault(cfg, *rooms: int):
    return replace(cfg, engine=replace(cfg.engine, sampling_fault=SamplingFault(
        req_ids=frozenset(str(r) for r in rooms))))


def _serve(ploop: WorkerLoop, dloop: WorkerLoop, prefill: PrefillWorker, decode: DecodeWorker,
           requests: dict[int, tuple[list[int], SamplingParams]]) -> dict[int, tuple]:
    """Every request at once; per room ("ok", tokens), ("prefill", error_kind, error) or
    ("decode", error_kind, error, tokens streamed before the failure)."""
    for room, (prompt, params) in requests.items():
        dest = dloop.call(decode.reserve, room, prompt, params)
        ploop.call(prefill.submit, room, prompt, params, dest)
    tokens: dict[int, list[int]] = {room: [] for room in requests}
    ends: dict[int, tuple] = {}
    while len(ends) < len(requests):
        side, o = EVENTS.get(timeout=60)
        if o.room in ends:
            continue
        if side == "p":
            if not o.ok:  # the router ends the request and releases decode's reservation
                ends[o.room] = ("prefill", o.error_kind, o.error)
                dloop.call(decode.abort, o.room)
            elif o.finished:
                ends[o.room] = ("ok", (o.first_token,))
                dloop.call(decode.abort, o.room)
            continue
        if o.finish_reason == "error":
            ends[o.room] = ("decode", o.error_kind, o.error, tuple(tokens[o.room]))
            continue
        tokens[o.room].extend(o.token_ids)
        if o.finished:
            ends[o.room] = ("ok", tuple(tokens[o.room]))
    return ends


def _drain(ploop, dloop, prefill, decode) -> None:
    """Let releases and late transfer outcomes settle."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (
            ploop.call(prefill.busy) or dloop.call(decode.busy)
            or ploop.call(prefill.num_free_pages) != ploop.call(prefill.num_pages)
            or dloop.call(decode.num_free_pages) != dloop.call(decode.num_pages)):
        time.sleep(0.02)


def test_a_failed_row_fails_its_request_on_either_worker_and_both_serve_on(dirs):
    model_dir, head_dir = dirs
    pcfg = worker_config("prefill-0", model_dir, head_dir, "fake", SPEC)
    dcfg = worker_config("decode-0", model_dir, head_dir, "fake", SPEC)
    prompts = {room: [(room * 7 + j) % 256 for j in range(3 + room % 5)]
               for room in range(1000, 1008)}
    n = 10

    def sp(**kw):
        return SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)

    params = {1000: sp(), 1001: sp(), 1002: sp(), 1003: sp(temperature=0.8, seed=11),
              1004: sp(temperature=0.9, seed=3), 1005: sp(temperature=1e-300),
              1006: sp(temperature=1.0, top_p=1e-300, seed=5), 1007: sp()}
    # The colocated engine's answers: the edge rooms are greedy (their own params too).
    colocated = SpecEngine.from_config(pcfg.engine, pcfg.spec)
    rooms = sorted(params)
    want = dict(zip(rooms, (c.output_ids for c in colocated.generate(
        [prompts[r] for r in rooms], [params[r] for r in rooms]))))
    greedy_want = colocated.generate([prompts[1005], prompts[1006]], [sp(), sp()])
    assert (want[1005], want[1006]) == tuple(c.output_ids for c in greedy_want)

    prefill = PrefillWorker(_with_fault(pcfg, 1001))
    decode = DecodeWorker(_with_fault(dcfg, 1002, 1004))
    ploop = WorkerLoop(prefill, lambda outs: [EVENTS.put(("p", o)) for o in outs])
    dloop = WorkerLoop(decode, lambda outs: [EVENTS.put(("d", o)) for o in outs])
    try:
        ploop.call(prefill.connect, dloop.call(decode.endpoint))
        got = _serve(ploop, dloop, prefill, decode,
                     {r: (prompts[r], params[r]) for r in rooms if r != 1007})
        # Prefill side: the first token's sampling raised -> a request failure, not transfer.
        kind, error_kind, error = got[1001]
        assert (kind, error_kind) == ("prefill", "request")
        assert error.startswith("sampling: InjectedFault") and "'1001'" in error, error
        # Decode side: a speculative round's acceptance raised -> a request failure; what was
        # streamed before (the prefill's first token) is the colocated answer's start.
        for room in (1002, 1004):
            kind, error_kind, error, before = got[room]
            assert (kind, error_kind) == ("decode", "request"), got[room]
            assert error.startswith("acceptance: InjectedFault") and f"'{room}'" in error
            assert before == want[room][:1]  # the first token, streamed at admission
        for room in (1000, 1003, 1005, 1006):
            assert got[room] == ("ok", want[room]), room
        assert ploop.error is None and dloop.error is None  # both loops still run
        nxt = _serve(ploop, dloop, prefill, decode, {1007: (prompts[1007], params[1007])})
        assert nxt[1007] == ("ok", want[1007])
        _drain(ploop, dloop, prefill, decode)
        assert ploop.call(prefill.num_free_pages) == ploop.call(prefill.num_pages)
        assert dloop.call(decode.num_free_pages) == dloop.call(decode.num_pages)
    finally:
        ploop.close()
        dloop.close()
        prefill.close()
        decode.close()
