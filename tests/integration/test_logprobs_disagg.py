"""Log-probabilities, disaggregated == colocated: a PrefillWorker and a DecodeWorker in one
process (KV and seeds over the fake backend), their events turned into the client's chunks by
the router's follower (router/flight.py), as the disaggregated dispatcher does. The first
token's logprob comes from the prefill worker (`FirstToken`, or `PrefillResult` when it ends the
request) -- or, when decode's first output reaches the router first, from the seed -- and the
rest from `DecodeOutput`; together they equal the colocated speculative engine's, value for
value (float32, greedy and seeded sampling, chain and tree). Once more on Ray, with Mooncake and
the router's `DisaggregatedDispatcher`."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from disagg_helpers import tiny_model_and_head, worker_config
from tandem.decode_node.worker import DecodeWorker
from tandem.engine import SamplingParams
from tandem.messages import FirstToken
from tandem.prefill_node.worker import PrefillWorker
from tandem.router.dispatch import Placement, RoutedRequest
from tandem.router.flight import Flight, follow
from tandem.spec import SpecConfig, SpecEngine
from tandem.worker import WorkerLoop

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_model_and_head(tmp_path_factory.mktemp("m"))


def _params() -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=5),
            SamplingParams(max_new_tokens=7, temperature=0.8, seed=11, ignore_eos=True,
                           logprobs=True, top_logprobs=2),
            SamplingParams(max_new_tokens=1, ignore_eos=True, logprobs=True,
                           top_logprobs=3),  # ends on prefill: PrefillResult carries it
            SamplingParams(max_new_tokens=9, ignore_eos=True),  # does not ask
            SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True)]  # no top


async def _serve(prefill: PrefillWorker, decode: DecodeWorker, prompts, params,
                 hold_first: set[int]):
    """Every request through both workers on loop threads; the test plays the dispatcher's
    part (reserve, submit, route the events by room) and the router's `follow` makes the
    chunks. The first tokens of requests in `hold_first` never reach the router (decode's
    first output then brings the first token). Returns each request's chunks."""
    loop = asyncio.get_running_loop()
    queues = {1000 + i: asyncio.Queue() for i in range(len(prompts))}

    def deliver(worker: str, events) -> None:
        for ev in events:
            if isinstance(ev, FirstToken) and ev.room - 1000 in hold_first:
                continue
            loop.call_soon_threadsafe(queues[ev.room].put_nowait, (worker, ev))

    ploop = WorkerLoop(prefill, lambda outs: deliver("prefill-0", outs))
    dloop = WorkerLoop(decode, lambda outs: deliver("decode-0", outs))
    prefill.on_first = lambda first: deliver("prefill-0", [first])
    try:
        ploop.call(prefill.connect, dloop.call(decode.endpoint))

        async def one(i: int):
            room = 1000 + i
            req = RoutedRequest(request_id=f"r{i}", room=room, model="default",
                                prompt_ids=tuple(prompts[i]), params=params[i],
                                placement=Placement(prefill_worker="prefill-0",
                                                    decode_worker="decode-0"),
                                deadline=time.time() + 60)
            dest = dloop.call(decode.reserve, room, prompts[i], params[i])
            ploop.call(prefill.submit, room, prompts[i], params[i], dest)
            flight = Flight(prefill="prefill-0", decode="decode-0", room=room)
            chunks = [c async for c in follow(req, flight, queues[room], num_steps=3,
                                              table=None)]
            if flight.ended_on_prefill:  # the dispatcher releases decode's reservation
                dloop.call(decode.abort, room)
            return chunks

        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        deadline = time.monotonic() + 20  # let releases and late outcomes drain
        while time.monotonic() < deadline and (ploop.call(prefill.busy)
                                               or dloop.call(decode.busy)):
            time.sleep(0.01)
        ploop.close()
        dloop.close()


@pytest.mark.parametrize("hold_first", [(), (0, 1, 4)], ids=["first-from-prefill",
                                                              "first-from-decode"])
@pytest.mark.parametrize("spec", [SpecConfig(num_steps=3),
                                  SpecConfig(num_steps=2, topk=2, num_draft_tokens=4)],
                         ids=["chain", "tree"])
def test_disaggregated_logprobs_equal_colocated(dirs, spec, hold_first):
    model_dir, head_dir = dirs
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 30))] for _ in range(5)]
    params = _params()
    pcfg = worker_config("prefill-0", model_dir, head_dir, "fake", spec)
    dcfg = worker_config("decode-0", model_dir, head_dir, "fake", spec)
    colocated = SpecEngine.from_config(pcfg.engine, pcfg.spec).generate(prompts, params)
    prefill, decode = PrefillWorker(pcfg), DecodeWorker(dcfg)
    try:
        got = asyncio.run(_serve(prefill, decode, prompts, params, set(hold_first)))
        for i, (chunks, want) in enumerate(zip(got, colocated)):
            tokens = tuple(t for c in chunks for t in c.token_ids)
            lps = tuple(lp for c in chunks for lp in c.logprobs)
            assert tokens == want.output_ids, i
            assert all(len(c.logprobs) == (len(c.token_ids) if params[i].logprobs else 0)
                       for c in chunks), i
            assert len(lps) == len(want.logprobs), i
            for a, b in zip(lps, want.logprobs):
                assert a.token_id == b.token_id
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert a.top_ids == b.top_ids
                assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
        assert colocated[3].logprobs == () and len(colocated[2].logprobs) == 1
        assert prefill.num_free_pages() == prefill.num_pages()
        assert decode.num_free_pages() == decode.num_pages()
    finally:
        prefill.close()
        decode.close()


@pytest.mark.slow
def test_ray_disaggregated_logprobs_equal_colocated(dirs):
    """The same through Ray: prefill and decode actors, KV over Mooncake, the router's
    `DisaggregatedDispatcher` (channels, events, the follower)."""
    ray = pytest.importorskip("ray")
    from tandem.deploy.config import DeployConfig, GroupConfig
    from tandem.deploy.launcher import init_ray, launch
    from tandem.engine import EngineConfig
    from tandem.router.disagg import DisaggregatedDispatcher
    from tandem.router.dispatch import ModelInfo

    model_dir, head_dir = dirs
    cfg = DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=256),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=10.0,
        prefill=GroupConfig(num_cpus=0.5), decode=GroupConfig(num_cpus=0.5))
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 24))] for _ in range(5)]
    params = _params()
    colocated = SpecEngine.from_config(cfg.engine, cfg.spec).generate(prompts, params)
    init_ray(num_cpus=4)
    dep = launch(cfg)
    try:
        disp = DisaggregatedDispatcher(
            dep.prefill, dep.decode, dep.endpoints,
            ModelInfo(name="default", vocab_size=256, max_model_len=512, max_request_tokens=900),
            num_steps=3)

        async def one(i: int):
            req = RoutedRequest(request_id=f"r{i}", room=8000 + i, model="default",
                                prompt_ids=tuple(prompts[i]), params=params[i],
                                placement=Placement(prefill_worker="prefill-0",
                                                    decode_worker="decode-0"),
                                deadline=time.time() + 60)
            return [c async for c in disp.submit(req)]

        async def run_all():
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))

        for i, (chunks, want) in enumerate(zip(asyncio.run(run_all()), colocated)):
            assert tuple(t for c in chunks for t in c.token_ids) == want.output_ids, i
            lps = tuple(lp for c in chunks for lp in c.logprobs)
            assert len(lps) == len(want.logprobs), i
            for a, b in zip(lps, want.logprobs):
                assert a.token_id == b.token_id and a.top_ids == b.top_ids
                assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
                assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)
    finally:
        dep.shutdown()
        ray.shutdown()
