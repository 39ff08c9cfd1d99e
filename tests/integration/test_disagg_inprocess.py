"""Disaggregated == colocated with real transfer backends: a PrefillWorker and a DecodeWorker
in one process, KV and seeds moving over the fake, Mooncake and NIXL backends."""

from __future__ import annotations

import asyncio
import queue
import random
import time

import pytest

from disagg_helpers import tiny_model_and_head, worker_config
from tandem.decode_node.worker import DecodeWorker
from tandem.engine import SamplingParams
from tandem.prefill_node.worker import PrefillWorker
from tandem.spec import SpecConfig, SpecEngine
from tandem.worker import WorkerLoop

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


def run_disaggregated(prefill: PrefillWorker, decode: DecodeWorker, prompts, params):
    """Both workers on loop threads (as in their Ray actors); the test plays the router."""
    events: queue.Queue = queue.Queue()
    ploop = WorkerLoop(prefill, lambda outs: [events.put(("p", o)) for o in outs])
    dloop = WorkerLoop(decode, lambda outs: [events.put(("d", o)) for o in outs])
    try:
        ploop.call(prefill.connect, dloop.call(decode.endpoint))
        tokens: dict[int, list[int]] = {}
        for i, (p, sp) in enumerate(zip(prompts, params)):
            room = 1000 + i
            tokens[room] = []
            dest = dloop.call(decode.reserve, room, p, sp)
            ploop.call(prefill.submit, room, p, sp, dest)
        done: set[int] = set()
        while len(done) < len(prompts):
            side, o = events.get(timeout=60)
            if side == "p":
                assert o.ok, o.error
                if o.finished:
                    tokens[o.room].append(o.first_token)
                    done.add(o.room)
                    dloop.call(decode.abort, o.room)
                continue
            assert o.finish_reason != "error", o.error
            if o.finish_reason == "abort":
                continue
            tokens[o.room].extend(o.token_ids)
            if o.finished:
                done.add(o.room)
        deadline = time.monotonic() + 20  # let releases and late outcomes drain
        while time.monotonic() < deadline and (ploop.call(prefill.busy) or dloop.call(decode.busy)):
            time.sleep(0.01)
        return [tuple(tokens[1000 + i]) for i in range(len(prompts))]
    finally:
        ploop.close()
        dloop.close()


def connect_stepped(prefill: PrefillWorker, decode: DecodeWorker) -> None:
    """Handshake for a test that then steps both workers by hand: decode answers from a loop
    thread only while the prefill side connects."""
    dloop = WorkerLoop(decode, lambda outs: None)
    try:
        prefill.connect(dloop.call(decode.endpoint))
    finally:
        dloop.close()


def stepped_pair(dirs):
    """A prefill and a decode worker over the fake backend (chain k=3), one 6-token prompt, its
    sampling params and the colocated engine's answer to it."""
    model_dir, head_dir = dirs
    spec = SpecConfig(num_steps=3)
    pcfg = worker_config("prefill-0", model_dir, head_dir, "fake", spec)
    prefill = PrefillWorker(pcfg)
    decode = DecodeWorker(worker_config("decode-0", model_dir, head_dir, "fake", spec))
    prompt, sp = [7, 8, 9, 10, 11, 12], SamplingParams(max_new_tokens=6, ignore_eos=True)
    want = SpecEngine.from_config(pcfg.engine, pcfg.spec).generate([prompt], [sp])[0].output_ids
    return prefill, decode, prompt, sp, tuple(want)


def step_until_finished(prefill: PrefillWorker, decode: DecodeWorker, results: list
                        ) -> tuple[int, ...]:
    """Step both workers by hand until decode finishes a request; its tokens. Prefill results
    are appended to `results`."""
    tokens: list[int] = []
    for _ in range(2000):
        results += prefill.step()
        outs = decode.step()
        for o in outs:
            tokens.extend(o.token_ids)
        if any(o.finished for o in outs):
            return tuple(tokens)
        time.sleep(0.001)
    raise AssertionError("no request finished")


def step_until_results(prefill: PrefillWorker, decode: DecodeWorker, results: list,
                       rooms: set[int]) -> None:
    """Step both workers until prefill reported a result for every room in `rooms`."""
    for _ in range(200):
        results += prefill.step()
        decode.step()
        if rooms <= {r.room for r in results}:
            return
        time.sleep(0.001)
    raise AssertionError(f"no prefill result for rooms {rooms - {r.room for r in results}}")


@pytest.mark.parametrize("backend", ["fake", "mooncake", "nixl"])
@pytest.mark.parametrize("spec", [SpecConfig(num_steps=3),
                                  SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)],
                         ids=["chain", "tree"])
def test_disaggregated_equals_colocated(dirs, backend, spec):
    model_dir, head_dir = dirs
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 30))] for _ in range(5)]
    params = [SamplingParams(max_new_tokens=10, ignore_eos=True),
              SamplingParams(max_new_tokens=7, temperature=0.8, seed=11, ignore_eos=True),
              SamplingParams(max_new_tokens=1, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=5, temperature=1.1, top_p=0.9, seed=2,
                             ignore_eos=True)]
    pcfg = worker_config("prefill-0", model_dir, head_dir, backend, spec)
    dcfg = worker_config("decode-0", model_dir, head_dir, backend, spec)
    colocated = SpecEngine.from_config(pcfg.engine, pcfg.spec).generate(prompts, params)
    prefill, decode = PrefillWorker(pcfg), DecodeWorker(dcfg)
    try:
        got = run_disaggregated(prefill, decode, prompts, params)
        assert got == [c.output_ids for c in colocated]
        assert prefill.num_free_pages() == prefill.num_pages()
        assert decode.num_free_pages() == decode.num_pages()
    finally:
        prefill.close()
        decode.close()


def test_grant_overlaps_the_forward_and_first_token_streams_at_admission(dirs):
    """TTFT on the hand-off path. (1) Push-after-prefill (layerwise_push off) still starts the
    transfer -- BEGIN, answered by the decode side's GO -- before the forward that completes
    the prompt, so the grant's round trip overlaps the forward instead of following it. (2) The
    decode step that admits a request returns the prefill's first token at once; the request's
    first speculative round runs in the next step (before: one whole round later)."""
    model_dir, head_dir = dirs
    spec = SpecConfig(num_steps=3)
    prefill = PrefillWorker(worker_config("prefill-0", model_dir, head_dir, "fake", spec))
    decode = DecodeWorker(worker_config("decode-0", model_dir, head_dir, "fake", spec))
    log: list[str] = []
    forward, start = prefill.engine.runner.forward, prefill.sender.start
    prefill.engine.runner.forward = lambda *a, **k: (log.append("forward"), forward(*a, **k))[1]
    prefill.sender.start = lambda *a, **k: (log.append("start"), start(*a, **k))[1]
    try:
        connect_stepped(prefill, decode)
        prompt, sp = list(range(3, 20)), SamplingParams(max_new_tokens=8, ignore_eos=True)
        prefill.submit(7, prompt, sp, decode.reserve(7, prompt, sp))
        outs: list = []
        for _ in range(500):
            prefill.step()
            if outs := decode.step():
                break
            time.sleep(0.001)
        assert log[:2] == ["start", "forward"], log
        assert len(outs) == 1 and len(outs[0].token_ids) == 1 and not outs[0].finished
        assert decode.engine.spec_stats.num_rounds == 0  # no round ran before the first token
        nxt = decode.step()
        assert decode.engine.spec_stats.num_rounds == 1 and nxt and nxt[0].token_ids
    finally:
        prefill.close()
        decode.close()


def test_concurrent_dispatch_prefill_starts_before_the_destination_is_known(dirs):
    """Concurrent dispatch (the router passes decode's reserve answer by reference): a room
    submitted without a destination runs its forward at once and holds its hand-off (pages
    kept) until `route`, then moves like any other -- output equal to colocated; a held room
    that is aborted instead gives its pages back; a room its first token finished needs no
    route at all."""
    prefill, decode, prompt, sp, want = stepped_pair(dirs)
    try:
        connect_stepped(prefill, decode)
        free = prefill.num_free_pages()
        prefill.submit(1, prompt, sp, None)
        prefill.submit(2, prompt, sp, None)
        prefill.submit(3, prompt, SamplingParams(max_new_tokens=1, ignore_eos=True), None)
        results = []
        for _ in range(20):
            results += prefill.step()
        assert [(r.room, r.finished) for r in results] == [(3, True)]  # no route needed
        assert prefill.num_free_pages() < free and not prefill.busy()  # 1 and 2 hold pages
        held = prefill.num_free_pages()
        prefill.abort(2)
        assert prefill.num_free_pages() > held  # room 2's pages are back
        prefill.route(1, decode.reserve(1, prompt, sp))
        prefill.route(2, b"ignored: the room was aborted")
        assert step_until_finished(prefill, decode, results) == tuple(want)
        assert {(r.room, r.ok) for r in results} >= {(2, False), (3, True)}
        step_until_results(prefill, decode, results, {1})  # the transfer's outcome, page release
        assert prefill.num_free_pages() == prefill.num_pages()
    finally:
        prefill.close()
        decode.close()


def test_route_posted_during_the_forward_starts_the_transfer_before_the_draft_prefill(
        dirs, monkeypatch):
    """Concurrent dispatch on a single-rank worker: decode's destination usually arrives while
    the prompt's forward runs. `post_route` (thread-safe) queues it; the worker applies it right
    after the forward's sampling sync, so BEGIN and the target KV writes are queued before the
    draft prefill, not after the step. Output equal to colocated, every page back; a destination
    that does not fit fails its room (pages back) instead of raising in the caller."""
    import tandem.spec.prompt_side as prompt_side

    prefill, decode, prompt, sp, want = stepped_pair(dirs)
    log: list[str] = []
    routes: dict[int, bytes] = {}
    forward, start = prefill.engine.runner.forward, prefill.sender.start
    draft_prefill = prompt_side.draft_prefill

    def forward_then_route(*a, **k):  # the destinations arrive during the forward
        log.append("forward")
        out = forward(*a, **k)
        for room, dest in routes.items():
            prefill.post_route(room, dest)
        routes.clear()
        return out

    prefill.engine.runner.forward = forward_then_route
    prefill.sender.start = lambda *a, **k: (log.append("start"), start(*a, **k))[1]
    monkeypatch.setattr(prompt_side, "draft_prefill",
                        lambda *a, **k: (log.append("draft"), draft_prefill(*a, **k))[1])
    try:
        connect_stepped(prefill, decode)
        prefill.submit(1, prompt, sp, None)
        routes[1] = decode.reserve(1, prompt, sp)
        results: list = []
        assert step_until_finished(prefill, decode, results) == tuple(want)
        assert log[:3] == ["forward", "start", "draft"], log
        prefill.submit(2, prompt, sp, None)
        routes[2] = b"not a destination"
        step_until_results(prefill, decode, results, {1, 2})
        bad = [r for r in results if r.room == 2]
        assert len(bad) == 1 and not bad[0].ok and bad[0].error_kind == "invalid", bad
        assert prefill.num_free_pages() == prefill.num_pages()
    finally:
        prefill.close()
        decode.close()


def run_actor_scenario(actor, scenario, leak: str) -> None:
    """Run `scenario()` against a worker actor outside Ray, then wait until every page of its
    worker is free (failing with `leak` after 10 s), and shut it down."""
    try:
        asyncio.run(scenario())
        deadline = time.monotonic() + 10
        while actor.worker.num_free_pages() != actor.worker.num_pages():
            assert time.monotonic() < deadline, leak
            time.sleep(0.01)
    finally:
        asyncio.run(actor.shutdown())


def test_decode_actor_refuses_a_reserve_after_its_abort_and_ends_an_unstarted_room(dirs):
    """The router sends reserve and prefill together and aborts both on cancel, so decode may
    see a room's abort before its reserve: that reserve is refused (its pages would otherwise
    wait for the transfer deadline). A reserved room aborted before it started ends with an
    abort output on its router's channel and is unbound (DecodeActor outside Ray: the same
    object the actor runs)."""
    from tandem.deploy.actors import DecodeActor
    from tandem.messages import Abort, Reserve

    model_dir, head_dir = dirs
    actor = DecodeActor(worker_config("decode-0", model_dir, head_dir, "fake",
                                      SpecConfig(num_steps=3)))
    prompt, sp = (4, 5, 6), SamplingParams(max_new_tokens=4, ignore_eos=True)

    def reserve(room: int) -> Reserve:
        return Reserve(channel="r1", room=room, prompt_ids=prompt, params=sp)

    async def scenario():
        events = actor.events("r1").__aiter__()
        await actor.command(Abort(room=5))  # the abort overtook the reserve
        with pytest.raises(ValueError, match="aborted before its reserve"):
            await actor.command(reserve(5))
        assert not actor.channels.bound(5)
        await actor.command(reserve(6))
        assert actor.channels.bound(6)
        await actor.command(Abort(room=6))  # reserved, aborted, never started
        batch = await asyncio.wait_for(events.__anext__(), timeout=5)
        while not batch:  # keep-alives
            batch = await asyncio.wait_for(events.__anext__(), timeout=5)
        assert [(o.room, o.finish_reason) for o in batch] == [(6, "abort")]
        assert not actor.channels.bound(6) and actor.channels.num_rooms() == 0
        await events.aclose()

    run_actor_scenario(actor, scenario, "an aborted reserve kept its pages")


def test_prefill_actor_ends_a_request_whose_route_never_comes_or_that_is_aborted(dirs):
    """Concurrent dispatch: the router starts the prefill first and sends decode's destination
    later by `Route`. If no route comes (the router died), the prefill ends with an error after
    `route_wait_s` and gives its pages back; an abort while it waits ends it at once. Ray runs
    an async actor's calls out of order, so a `Route` or `Abort` may run before its room's
    `StartPrefill`: the route is kept for it (a bad one fails it at once, not after the wait),
    the abort ends it at once. Outcomes and first tokens come on the router's channel
    (PrefillActor outside Ray)."""
    from tandem.deploy.actors import PrefillActor
    from tandem.messages import Abort, FirstToken, Route, StartPrefill

    model_dir, head_dir = dirs
    actor = PrefillActor(worker_config("prefill-0", model_dir, head_dir, "fake",
                                       SpecConfig(num_steps=3)))
    actor.route_wait_s = 0.5
    prompt, sp = (4, 5, 6, 7), SamplingParams(max_new_tokens=4, ignore_eos=True)

    def start(room: int) -> StartPrefill:
        return StartPrefill(channel="r1", room=room, prompt_ids=prompt, params=sp)

    def route(room: int, destination: bytes) -> Route:
        return Route(room=room, destination=destination, decode_endpoint=b"")

    async def scenario():
        stream = actor.events("r1").__aiter__()
        seen: list = []

        async def outcome(room: int):
            """The room's PrefillResult from the channel (events of other rooms kept)."""
            while True:
                for ev in [e for e in seen if e.room == room and not isinstance(e, FirstToken)]:
                    return ev
                seen.extend(await asyncio.wait_for(stream.__anext__(), timeout=30))

        await actor.command(start(1))  # returns at once
        res = await outcome(1)
        assert not res.ok and "no destination from the router" in res.error
        await actor.command(start(2))
        await asyncio.sleep(0.05)
        await actor.command(Abort(room=2))
        res = await outcome(2)
        assert not res.ok and "aborted" in res.error
        await actor.command(route(3, b"not a destination"))  # ran before its start: kept
        assert actor._rooms[3].route.done() and actor._rooms[3].result is None
        t0 = time.monotonic()
        await actor.command(start(3))
        res = await outcome(3)
        assert not res.ok and "no destination from the router" not in res.error  # it used it
        assert time.monotonic() - t0 < actor.route_wait_s and 3 not in actor._rooms
        await actor.command(Abort(room=4))  # ran before its start
        await actor.command(start(4))
        res = await outcome(4)
        assert not res.ok and res.error_kind == "aborted"
        await actor.command(start(5))  # no route: the forward runs, then it waits
        res = await outcome(5)
        firsts = [e for e in seen if isinstance(e, FirstToken) and e.room == 5]
        assert not res.ok and len(firsts) == 1 and isinstance(firsts[0].token, int)
        assert seen.index(firsts[0]) < seen.index(res)  # the first token came first
        await actor.command(route(1, b"late"))  # a route after its prefill ended: not kept
        assert 1 not in actor._rooms and actor.channels.num_rooms() == 0
        await stream.aclose()

    run_actor_scenario(actor, scenario, "a prefill without a route kept its pages")
