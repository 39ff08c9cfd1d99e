"""OpenTelemetry tracing across processes: a disaggregated deployment of the tiny model (Ray prefill
and decode actors, Mooncake on 127.0.0.1) behind the gRPC router in this process, every process
exporting to a test OTLP/HTTP receiver on 127.0.0.1.

Checks: one request sent with a client `traceparent` is one trace over three services -- the
router's spans (tandem.request under the client's span; router.prepare, router.admission,
router.dispatch under it), the prefill worker's (`prefill` under router.dispatch; its phases
prefill.queue, prefill.forward, kv.push under it) and the decode worker's (`decode` under
router.dispatch; kv.receive, decode.generate under it) -- with worker names, token counts and
transfer bytes, and the phases of each worker in time order."""

from __future__ import annotations

import os

import pytest
from grpc_system import SHORT, System, dirs, local_ray  # noqa: F401 -- module fixtures
from otlp_receiver import OtlpReceiver

from tandem import otel
from tandem.deploy.config import DeployConfig, GroupConfig
from tandem.engine import EngineConfig
from tandem.spec import SpecConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
ray = pytest.importorskip("ray")

N = 6
TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "10f067aa0ba902b7"
ROUTER = {"tandem.request", "router.prepare", "router.admission", "router.dispatch"}
PREFILL = {"prefill", "prefill.queue", "prefill.forward", "kv.push"}
DECODE = {"decode", "kv.receive", "decode.generate"}


@pytest.fixture(scope="module")
def system(dirs, local_ray):  # noqa: F811 -- the module fixtures above
    model_dir, head_dir = dirs
    receiver = OtlpReceiver()
    # Workers export every 100 ms (the OTEL_* settings reach them with the endpoint)
    before = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    otel.configure(otel.traces_url(receiver.url, "test"), "tandem-router")
    cfg = DeployConfig(
        engine=EngineConfig(model=str(model_dir), dtype="float32", page_size=4, num_pages=256),
        spec=SpecConfig(draft_model=str(head_dir), num_steps=3),
        transfer_backend="mooncake", transfer_timeout_s=4.0, endpoint=SHORT,
        prefill=GroupConfig(num_cpus=0.5), decode=GroupConfig(num_cpus=0.5))
    system = System(cfg)
    yield receiver, system
    system.close()
    otel.shutdown()
    receiver.close()
    if before is None:
        os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
    else:
        os.environ["OTEL_BSP_SCHEDULE_DELAY"] = before


def test_router_prefill_and_decode_spans_share_one_trace(system):
    from tandem.proto import router_pb2 as pb

    receiver, sys_ = system
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    req = pb.GenerateRequest(prompt_token_ids=prompt,
                             sampling=pb.SamplingParams(max_tokens=N, ignore_eos=True))
    metadata = (("traceparent", f"00-{TRACE}-{CLIENT_SPAN}-01"),)
    tokens = [t for m in sys_.stub.Generate(req, timeout=60, metadata=metadata)
              for t in m.token_ids]
    assert len(tokens) == N
    otel.flush()
    want = ROUTER | PREFILL | DECODE
    spans = receiver.wait_for(lambda s: want <= {x.name for x in s if x.trace_id == TRACE}, 30)
    got = {}
    for s in spans:
        if s.trace_id == TRACE:
            assert s.name not in got, f"two {s.name} spans in one request's trace"
            got[s.name] = s
    assert want <= set(got), sorted(want - set(got))

    root, dispatch = got["tandem.request"], got["router.dispatch"]
    prefill, decode = got["prefill"], got["decode"]
    # Parent links: client -> root -> router stages; dispatch -> each worker -> its phases
    assert root.parent_id == CLIENT_SPAN
    for name in ROUTER - {"tandem.request"}:
        assert got[name].parent_id == root.span_id, name
    assert prefill.parent_id == decode.parent_id == dispatch.span_id
    for name in PREFILL - {"prefill"}:
        assert got[name].parent_id == prefill.span_id, name
    for name in DECODE - {"decode"}:
        assert got[name].parent_id == decode.span_id, name
    # Each process reports as its own service
    assert {got[n].service for n in ROUTER} == {"tandem-router"}
    assert {got[n].service for n in PREFILL} == {"tandem-prefill"}
    assert {got[n].service for n in DECODE} == {"tandem-decode"}
    # Attributes: workers, counts, bytes
    assert dispatch.attrs["tandem.prefill_worker"] == prefill.attrs["tandem.worker"] == (
        "prefill-0")
    assert dispatch.attrs["tandem.decode_worker"] == decode.attrs["tandem.worker"] == "decode-0"
    assert dispatch.attrs["tandem.room"] == prefill.attrs["tandem.room"] == decode.attrs[
        "tandem.room"]
    assert root.attrs["gen_ai.usage.input_tokens"] == prefill.attrs[
        "gen_ai.usage.input_tokens"] == len(prompt)
    assert root.attrs["gen_ai.usage.output_tokens"] == N
    assert root.attrs["gen_ai.response.finish_reasons"] == "length"
    # Decode returns every token it committed, the prefill's first (which it was handed) too
    assert got["decode.generate"].attrs["gen_ai.usage.output_tokens"] == N
    assert decode.attrs["gen_ai.response.finish_reasons"] == "length"
    pages = -(-len(prompt) // 4)  # the prompt's KV pages (page_size 4)
    assert got["kv.push"].attrs["tandem.kv.pages"] == got["kv.receive"].attrs[
        "tandem.kv.pages"] == pages
    assert got["kv.push"].attrs["tandem.kv.bytes"] == got["kv.receive"].attrs[
        "tandem.kv.bytes"] > 0
    assert all(s.status == 0 for s in got.values())
    # Each worker's phases follow one another, inside the worker's span
    for phases, whole in ((("prefill.queue", "prefill.forward", "kv.push"), prefill),
                          (("kv.receive", "decode.generate"), decode)):
        spans_in_order = [got[n] for n in phases]
        assert whole.start_ns <= spans_in_order[0].start_ns
        for a, b in zip(spans_in_order, spans_in_order[1:]):
            assert a.end_ns <= b.start_ns, (a.name, b.name)
        assert spans_in_order[-1].end_ns <= whole.end_ns + 10**9  # different processes' clocks
    assert sys_.all_free()
