"""Overlap scheduling (engine/overlap.py): the plain engine launches step n+1 before it reads
step n's tokens. Outputs must be exactly those of the engine without overlap; the one-step
lag must show only in *when* outputs come back, and cost at most one wasted row per request
that a stop ends (none for a length limit). Each test here fails if the lag leaks: a pending
token fed wrongly, a length check counting the pending token, a row of a finished or aborted
request returned, a page kept."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import (
    assert_pages_free,
    engine_cfg,
    letter_tokenizer,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    tiny_target,
)

from tandem.engine import FinishReason, LLMEngine, SamplingParams
from tandem.engine.config import SamplingFault
from tandem.engine.cuda_graphs import DecodeGraphRunner
from tandem.engine.overlap import InflightStep, feed_input_ids
from tandem.engine.request import PENDING
from tandem.engine.scheduler import ScheduledChunk

MODEL = tiny_target("llama", live=None)


def _engine(overlap: bool, model=MODEL, graphs: bool = False, **cfg) -> LLMEngine:
    """graphs: the device-planned graph runner in eager mode (its body at every replay, the
    same buffers and padding), decode sizes 1-8 and prompt sizes 16-64: prompt steps, decode
    steps and steps mixing both replay "graphs", as on CUDA."""
    eng = LLMEngine(engine_cfg(overlap_schedule=overlap, **cfg), model, letter_tokenizer())
    assert eng.overlap is overlap
    eng.graph_rows = []  # the rows of each replay
    if graphs:
        eng.graphs = DecodeGraphRunner(
            eng.runner, (1, 2, 4, 8),
            max_pages_per_seq=-(-eng.max_model_len // eng.cfg.page_size),
            device_metadata=True, prefill_rows=(16, 32, 64))
        eng.graphs.capture(eager=True)
        run = eng.graphs.run
        eng.graphs.run = lambda batch: eng.graph_rows.append(batch.attn.num_tokens) or run(batch)
    return eng


def _run(eng: LLMEngine, ps, params) -> tuple[dict, dict]:
    """(req_id -> finished Request, req_id -> every token id streamed) for prompts `ps`."""
    plist = [params] * len(ps) if isinstance(params, SamplingParams) else list(params)
    ids = [eng.add_request(p, sp, req_id=f"r{i}") for i, (p, sp) in enumerate(zip(ps, plist))]
    reqs = {i: eng.scheduler.requests[i] for i in ids}
    streamed: dict[str, list[int]] = {i: [] for i in ids}
    texts: dict[str, str] = {i: "" for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            assert not reqs[o.req_id].finished or o.finished, "output after the finish"
            streamed[o.req_id] += o.new_token_ids
            texts[o.req_id] += o.text_delta
    for i in ids:
        assert reqs[i].finished and texts[i] == reqs[i].text
    assert_pages_free(eng)
    return reqs, streamed


def _same(params, ps=None, graphs: bool = False, **cfg) -> dict:
    """Overlap on == off (on with graphs where asked; off without: the eager reference)."""
    ps = ps or prompts(6, seed=7, lo=2, hi=30)
    off, s_off = _run(_engine(False, **cfg), ps, params)
    eng = _engine(True, graphs=graphs, **cfg)
    on, s_on = _run(eng, ps, params)
    assert any(r > 8 for r in eng.graph_rows) == graphs  # prompt rows replayed a graph
    for i in off:
        assert on[i].output_ids == off[i].output_ids, i
        assert on[i].finish_reason == off[i].finish_reason, i
        assert on[i].text == off[i].text, i
        assert on[i].output_logprobs == off[i].output_logprobs, i
        assert s_on[i] == s_off[i] == on[i].output_ids, i
    return off


@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_outputs_equal_without_overlap_mixed_lengths(graphs):
    off = _same([SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (1, 2, 5, 9, 17, 30)],
                graphs=graphs)
    assert [len(r.output_ids) for r in off.values()] == [1, 2, 5, 9, 17, 30]


@pytest.mark.parametrize("graphs", [False, True])
def test_max_tokens_one_and_chunked_prefill_equal_without_overlap(graphs):
    # 60-token prompts over a 16-token budget: prefill chunks and decodes share steps.
    ps = prompts(4, seed=3, lo=40, hi=60)
    _same(SamplingParams(max_new_tokens=1, ignore_eos=True), ps, graphs,
          max_num_batched_tokens=16)
    _same(SamplingParams(max_new_tokens=6, ignore_eos=True), ps, graphs,
          max_num_batched_tokens=16)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_context_limit_ends_requests_at_the_same_token(graphs):
    # max_model_len 40: prompts of up to 30 tokens are cut by the context, not max_new_tokens.
    off = _same(SamplingParams(max_new_tokens=100, ignore_eos=True), graphs=graphs,
                max_model_len=40)
    for r in off.values():
        assert r.finish_reason == FinishReason.LENGTH
        assert len(r.prompt_ids) + len(r.output_ids) == 40


def _first_new(out, start: int) -> int:
    """The first token of `out` from index `start` on that does not occur before it."""
    return next(t for j, t in enumerate(out) if j >= start and t not in out[:j])


def test_stop_tokens_eos_and_stop_strings_equal_without_overlap():
    ps = prompts(6, seed=11, lo=2, hi=30)
    ref, _ = _run(_engine(False), ps, SamplingParams(max_new_tokens=20, ignore_eos=True))
    tok = letter_tokenizer()
    # A stop token for request 0, a stop string for request 1, EOS (a model whose EOS id is
    # one of request 2's outputs) for everyone: each first met at its 4th output or later.
    t0, t1, eos = (_first_new(ref[i].output_ids, 3) for i in ("r0", "r1", "r2"))
    model = tiny_target("llama", live=None, eos_token_id=eos)
    params = [SamplingParams(max_new_tokens=20, stop_token_ids=(t0,)),
              SamplingParams(max_new_tokens=20, stop=(tok.decode([t1]),)),
              SamplingParams(max_new_tokens=20)] + [SamplingParams(max_new_tokens=20)] * 3
    off = _same(params, ps, model=model)
    assert off["r0"].finish_reason == off["r1"].finish_reason == FinishReason.STOP
    assert off["r2"].output_ids[-1] == eos


def test_logprobs_and_seeded_sampling_equal_without_overlap():
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=3),
              SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, seed=5),
              SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.7, seed=9,
                             logprobs=True, top_logprobs=2)]
    off = _same(params, prompts(3, seed=5))
    assert len(off["r0"].output_logprobs) == 8 and len(off["r2"].output_logprobs) == 5


@pytest.mark.parametrize("graphs", [False, True])
def test_preemption_equal_without_overlap_and_pages_back(graphs):
    # 24 pages of 4 tokens for 6 requests growing to ~50 tokens: the scheduler must preempt.
    ps = prompts(6, seed=21, lo=10, hi=20)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    eng = _engine(True, graphs=graphs, num_pages=24)
    on, _ = _run(eng, ps, params)
    assert eng.scheduler.num_preemptions > 0 and bool(eng.graph_rows) == graphs
    off, _ = _run(_engine(False, num_pages=256), ps, params)
    assert {i: r.output_ids for i, r in on.items()} == {i: r.output_ids for i, r in off.items()}


def test_tokens_come_back_one_step_late():
    eng = _engine(True)
    eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True), req_id="a")
    assert eng.step() == []  # the prefill is launched; its token is read by the next step
    req = eng.scheduler.requests["a"]
    assert req.num_pending == 1 and req.all_ids[-1] == PENDING
    assert eng.has_unfinished()
    outs = eng.step()  # launches the decode of the pending token, then reads the first token
    assert [o.req_id for o in outs] == ["a"] and len(req.output_ids) == 1
    assert req.num_pending == 1  # the second token, in flight
    steps = 2
    while eng.has_unfinished():
        eng.step()
        steps += 1
    # 3 tokens: prefill + 2 decodes launched, read one call later each; no wasted row.
    assert steps == 4 and req.output_ids and len(req.output_ids) == 3
    assert_pages_free(eng)


def _count_rows(eng: LLMEngine) -> dict[str, int]:
    """req_id -> rows computed for it, counted at each forward."""
    rows: dict[str, int] = {}
    inner = eng._forward_and_sample

    def spy(plan, graph_bs):
        for c in plan.chunks:
            rows[c.req_id] = rows.get(c.req_id, 0) + len(c.token_ids)
        return inner(plan, graph_bs)

    eng._forward_and_sample = spy
    return rows


def test_a_stop_costs_one_wasted_row_and_a_length_limit_none():
    ps = prompts(2, seed=31, lo=3, hi=6)
    ref, _ = _run(_engine(False), ps, SamplingParams(max_new_tokens=12, ignore_eos=True))
    out0 = ref["r0"].output_ids
    j = next(j for j in range(2, len(out0)) if out0[j] not in out0[:j])
    stop_tok = out0[j]
    eng = _engine(True)
    rows = _count_rows(eng)
    on, _ = _run(eng, ps, [SamplingParams(max_new_tokens=12, ignore_eos=True,
                                          stop_token_ids=(stop_tok,)),
                           SamplingParams(max_new_tokens=12, ignore_eos=True)])
    assert on["r0"].output_ids == out0[: j + 1]
    # prompt + j decodes of tokens 1..j + the wasted decode of the stop token itself
    assert rows["r0"] == len(ps[0]) + j + 1
    assert rows["r1"] == len(ps[1]) + 11  # the 12th token is sampled, never fed back


@pytest.mark.parametrize("graphs", [False, True])
def test_an_abort_while_a_step_is_in_flight_drops_its_row(graphs):
    ps = prompts(2, seed=41, lo=3, hi=8)
    eng = _engine(True, graphs=graphs)
    for i, p in enumerate(ps):
        eng.add_request(p, SamplingParams(max_new_tokens=10, ignore_eos=True), req_id=f"r{i}")
    kept = eng.scheduler.requests["r1"]
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    for _ in range(3):
        for o in eng.step():
            got[o.req_id] += o.new_token_ids
    assert eng.scheduler.requests["r0"].num_pending == 1  # a token of r0 is in flight
    assert eng.abort("r0")
    while eng.has_unfinished():
        for o in eng.step():
            got[o.req_id] += o.new_token_ids
    assert len(got["r0"]) == 2  # read before the abort; the in-flight one is dropped
    ref, _ = _run(_engine(False), ps[1:], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert got["r1"] == kept.output_ids == ref["r0"].output_ids
    assert_pages_free(eng)


def test_a_row_whose_sampling_fails_fails_its_request_alone():
    ps = prompts(3, seed=51)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8)
    eng = LLMEngine(engine_cfg(overlap_schedule=True, sampling_fault=SamplingFault(
        req_ids=frozenset({"r1"}))), MODEL, letter_tokenizer())
    on, _ = _run(eng, ps, [SamplingParams(max_new_tokens=6, ignore_eos=True), params,
                           SamplingParams(max_new_tokens=6, ignore_eos=True)])
    assert on["r1"].finish_reason == FinishReason.ERROR and "injected" in on["r1"].error
    off, _ = _run(_engine(False), [ps[0], ps[2]], SamplingParams(max_new_tokens=6,
                                                                 ignore_eos=True))
    assert on["r0"].output_ids == off["r0"].output_ids
    assert on["r2"].output_ids == off["r1"].output_ids


def test_feed_input_ids_takes_pending_tokens_from_the_device():
    prev = InflightStep(reqs=(), tokens=torch.tensor([70, 71, 72]), errors=("", "", ""),
                        read=None, rows={"x": 2, "y": 0})
    chunks = [ScheduledChunk(req_id="x", page_ids=(1,), num_cached=4, token_ids=(PENDING,),
                             samples=True),
              ScheduledChunk(req_id="z", page_ids=(2,), num_cached=0, token_ids=(9, 8),
                             samples=True),
              ScheduledChunk(req_id="y", page_ids=(3,), num_cached=2, token_ids=(PENDING,),
                             samples=True)]
    ids = feed_input_ids(chunks, 6, prev, torch.device("cpu"))
    assert ids.tolist() == [72, 9, 8, 70, 0, 0]
    with pytest.raises(ValueError, match="no step in flight"):
        feed_input_ids(chunks, 4, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="'x' has a pending token"):
        feed_input_ids(chunks[:1], 1, InflightStep(reqs=(), tokens=prev.tokens, errors=(),
                                                   read=None, rows={}), torch.device("cpu"))


def test_overlap_is_off_for_the_speculative_engine_and_auto_on_cuda_only():
    from spec_helpers import tiny_head

    from tandem.spec import SpecConfig, SpecEngine

    spec = SpecEngine(engine_cfg(overlap_schedule=True), SpecConfig(num_steps=2), MODEL,
                      tiny_head(MODEL, "eagle", live=None))
    assert not spec.overlap
    plain = LLMEngine(engine_cfg(), MODEL)
    assert not plain.overlap  # None = auto: off on the CPU
    # DP decode graphs rely on plain steps too (and are asked for, and no host-read dispatch)
    assert plain.dp_graphs_ok(engine_cfg(dp_decode_graphs=True))
    assert not plain.dp_graphs_ok(engine_cfg())
    assert not plain.dp_graphs_ok(engine_cfg(dp_decode_graphs=True, moe_dispatch="alltoall"))
    assert not spec.dp_graphs_ok(engine_cfg(dp_decode_graphs=True))
