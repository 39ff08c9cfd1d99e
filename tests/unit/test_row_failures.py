"""One request can never stop a worker. Seed bug: `SamplingParams(temperature=1e-300)` (or
1e-38, or top_p=1e-300 at temperature 1) passed validation, turned into NaN probabilities in
float32, and torch.multinomial raised out of the engine's `step()` -- which ends a worker's loop
for good, failing every request on it.

Now (1) sampling cannot produce NaN: a temperature under GREEDY_TEMPERATURE is greedy, the top
token survives any top_p, min_p edges and non-finite logits give valid distributions; (2) a row
that raises anyway -- in its sampling (the test-only `EngineConfig.sampling_fault` hook), its
acceptance or its detokenizer -- fails its own request only (FinishReason.ERROR, its pages
back) while the rest of its batch and the next request are served. In process (`target_probs`,
`Sampler`, `accept`, LLMEngine, SpecEngine) and through the colocated dispatcher; the
disaggregated workers are in tests/integration/test_disagg_row_failures.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from spec_helpers import (
    assert_pages_free,
    engine_cfg,
    greedy,
    letter_tokenizer,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    tiny_head,
    tiny_target,
)

from tandem.colocated_node import ColocatedDispatcher
from tandem.engine import (
    GREEDY_TEMPERATURE,
    FinishReason,
    LLMEngine,
    Sampler,
    SamplingFault,
    SamplingParams,
    target_probs,
)
from tandem.router import Placement, RequestFailed, RoutedRequest
from tandem.router.errors import Code, from_dispatch_error
from tandem.spec import SpecConfig, SpecEngine, VerifyInput, accept

LENGTH, ERROR = FinishReason.LENGTH, FinishReason.ERROR
INF = float("inf")


@pytest.fixture(scope="module")
def model():
    return tiny_target("llama", live=None)  # every token reachable: outputs differ per prompt


@pytest.fixture(scope="module")
def head(model):
    return tiny_head(model, "eagle")


def _engine(kind: str, model, head, tokenizer=None, **cfg) -> LLMEngine:
    if kind == "plain":
        return LLMEngine(engine_cfg(**cfg), model, tokenizer)
    return SpecEngine(engine_cfg(**cfg), SpecConfig(num_steps=3), model, head, tokenizer)


def _serve(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
           ) -> dict[str, tuple[tuple[int, ...], FinishReason, str]]:
    """Run `requests` (id -> prompt, params) together to the end: per id (tokens streamed,
    finish reason, error)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    ends: dict[str, tuple[FinishReason, str]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            assert o.req_id not in ends, f"{o.req_id} produced output after its end"
            tokens[o.req_id] += o.new_token_ids
            if o.finished:
                ends[o.req_id] = (o.finish_reason, o.error)
    return {rid: (tuple(tokens[rid]), *ends[rid]) for rid in requests}


# ---- (1) sampling cannot produce NaN ---------------------------------------------------------

BIG = torch.tensor([30.0, 10.0, -5.0, 29.5, 0.0])  # logits / 1e-38 overflow float32 (> 3.4)

EDGES = {
    # name: (logits, params, expected probabilities)
    "temperature 1e-300": (BIG, SamplingParams(temperature=1e-300), [1, 0, 0, 0, 0]),
    "temperature 1e-38": (BIG, SamplingParams(temperature=1e-38), [1, 0, 0, 0, 0]),
    "temperature at the threshold": (BIG, SamplingParams(temperature=GREEDY_TEMPERATURE),
                                     [1, 0, 0, 0, 0]),
    "top_p 1e-300": (BIG / 30, SamplingParams(temperature=1.0, top_p=1e-300), [1, 0, 0, 0, 0]),
    "top_p 1e-300 + min_p 1": (BIG / 30, SamplingParams(temperature=1.0, top_p=1e-300, min_p=1.0),
                               [1, 0, 0, 0, 0]),
    "min_p 1 with ties": (torch.tensor([2.0, 2.0, 1.0, 0.0]),
                          SamplingParams(temperature=1.0, min_p=1.0), [0.5, 0.5, 0, 0]),
    "min_p 1 without ties": (torch.tensor([2.0, 1.9, 1.0]), SamplingParams(temperature=1.0,
                                                                            min_p=1.0), [1, 0, 0]),
    "min_p 1e-300": (torch.log(torch.tensor([0.5, 0.3, 0.2])),
                     SamplingParams(temperature=1.0, min_p=1e-300), [0.5, 0.3, 0.2]),
    "min_p 0": (torch.log(torch.tensor([0.5, 0.3, 0.2])),
                SamplingParams(temperature=1.0, min_p=0.0), [0.5, 0.3, 0.2]),
    # float32 rounds 1e39 to inf: uniform over the finite logits, not -inf / inf = NaN.
    "temperature 1e39 with a masked logit": (torch.tensor([1.0, -INF, 3.0, 2.0]),
                                             SamplingParams(temperature=1e39),
                                             [1 / 3, 0, 1 / 3, 1 / 3]),
    "a +inf logit": (torch.tensor([1.0, INF, 2.0]), SamplingParams(temperature=0.7), [0, 1, 0]),
}


@pytest.mark.parametrize("case", EDGES.values(), ids=EDGES.keys())
def test_target_probs_is_a_distribution_at_every_edge(case):
    logits, params, want = case
    for rows in (logits, logits.repeat(3, 1)):  # one row and a batch of rows
        p = target_probs(rows, params)
        assert torch.isfinite(p).all() and (p >= 0).all(), p
        assert torch.allclose(p.sum(-1), torch.ones(()))
        assert p.reshape(-1, p.shape[-1])[0].tolist() == pytest.approx(want, abs=1e-6)


def test_nan_logits_fall_back_to_a_valid_distribution():
    p = target_probs(torch.tensor([[0.3, float("nan"), 0.1], [0.3, 0.5, 0.1]]),
                     SamplingParams(temperature=0.9))
    assert torch.isfinite(p).all() and p.sum(-1).tolist() == pytest.approx([1.0, 1.0])
    assert (p[0] == 1).sum() == 1  # one-hot (on the argmax)


def test_a_temperature_under_the_threshold_is_greedy_everywhere():
    """`greedy` is what the engine, speculative acceptance and a prefill worker's first token
    all branch on (no generator, no randomness consumed)."""
    for t in (0.0, 1e-300, 1e-38, GREEDY_TEMPERATURE / 2):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    with pytest.raises(ValueError, match="^temperature:"):
        SamplingParams(temperature=INF)


def test_sampler_draws_edge_rows_with_the_rest_of_the_batch():
    """Seeded and unseeded (batched) rows of every edge in one batch: no row raises, the
    tiny temperatures and top_p = 1e-300 give the argmax."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 30  # big logits: logits / 1e-38 overflows
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=1e-38),
              SamplingParams(temperature=1.0, top_p=1e-300),
              SamplingParams(temperature=1.0, top_p=1e-300, seed=1),
              SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=0.8)]
    gens = [None, None, None, torch.Generator().manual_seed(1), None, None]
    out = Sampler().sample(logits, params, gens, [f"r{i}" for i in range(6)])
    assert out.errors == ("",) * 6
    assert out.tokens[:5].tolist() == logits.argmax(-1)[:5].tolist()


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_edge_sampling_params_are_served_in_one_batch(model, head, kind):
    """Every edge in one batch with a plain greedy row: each is the greedy answer (the
    speculative engine's too: lossless), and the engine serves on."""
    ps = prompts(7, seed=21, lo=3)
    n = 8
    edge = [SamplingParams(max_new_tokens=n, temperature=1e-300, ignore_eos=True),
            SamplingParams(max_new_tokens=n, temperature=1e-38, ignore_eos=True),
            SamplingParams(max_new_tokens=n, temperature=1.0, top_p=1e-300, seed=3,
                           ignore_eos=True),
            SamplingParams(max_new_tokens=n, temperature=1.0, top_p=1e-300, ignore_eos=True),
            SamplingParams(max_new_tokens=n, temperature=1.0, min_p=1.0, seed=4, ignore_eos=True),
            greedy(n)]
    want = [c.output_ids for c in reference(model, ps, greedy(n))]
    eng = _engine(kind, model, head)
    outs = eng.generate(ps[:6], edge)
    assert [c.output_ids for c in outs] == want[:6]
    assert all(c.finish_reason is LENGTH for c in outs)
    assert eng.generate([ps[6]], greedy(n))[0].output_ids == want[6]
    assert_pages_free(eng)


# ---- (2) a row that raises fails its own request only ----------------------------------------


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_a_row_that_raises_in_sampling_fails_alone(model, head, kind):
    """The fault hook makes request 'bad' raise inside sampling (its first token, drawn in the
    batch with 'a' and 'c'): 'bad' ends with ERROR and no tokens, 'a' and 'c' get their
    tokens, every page comes back, and the next request is served."""
    ps = prompts(4, seed=11, lo=3)
    params = [greedy(10), SamplingParams(max_new_tokens=8, temperature=0.8, seed=5,
                                         ignore_eos=True), greedy(6), greedy(9)]
    want = [c.output_ids for c in reference(model, ps, params)]
    eng = _engine(kind, model, head, sampling_fault=SamplingFault(req_ids=frozenset({"bad"})))
    free0 = eng.allocator.num_free
    got = _serve(eng, {"a": (ps[0], params[0]), "bad": (ps[1], params[1]),
                       "c": (ps[2], params[2])})
    tokens, reason, error = got["bad"]
    assert tokens == () and reason is ERROR
    assert error.startswith("sampling: InjectedFault") and "'bad'" in error, error
    assert got["a"] == (want[0], LENGTH, "") and got["c"] == (want[2], LENGTH, "")
    assert eng.allocator.num_free == free0
    assert _serve(eng, {"next": (ps[3], params[3])})["next"] == (want[3], LENGTH, "")
    assert_pages_free(eng)


def test_generate_reports_a_failed_request_in_its_completion(model, head):
    ps = prompts(3, seed=12, lo=3)
    want = reference(model, ps, greedy(5))
    eng = _engine("plain", model, head,
                  sampling_fault=SamplingFault(req_ids=frozenset({"req-1"})))  # generate's ids
    outs = eng.generate(ps, greedy(5))
    assert outs[1].finish_reason is ERROR and "InjectedFault" in outs[1].error
    assert [outs[0].output_ids, outs[2].output_ids] == [want[0].output_ids, want[2].output_ids]
    assert outs[0].error == outs[2].error == ""
    assert_pages_free(eng)


def _verify(tokens: list[list[int]]) -> VerifyInput:
    """Chains (root + drafts) of equal length, one per request."""
    bs, n = len(tokens), len(tokens[0])
    return VerifyInput(page_ids=((),) * bs, num_cached=(0,) * bs, tokens=torch.tensor(tokens),
                       parents=(tuple(range(-1, n - 1)),) * bs, depths=(tuple(range(n)),) * bs)


@pytest.mark.parametrize("mixed", [False, True], ids=["all-greedy", "mixed"])
def test_accept_fails_only_the_faulted_row(mixed):
    """Speculative acceptance is sampling too: the hook fails row 1 alone, on the all-greedy
    device path and on the per-row host walk; the other rows accept exactly what they would
    without it."""
    torch.manual_seed(3)
    logits = torch.randn(3 * 4, 20)  # 3 requests, chains of 4 nodes
    verify = _verify([[1, int(logits[0].argmax()), 5, 6], [2, 3, 4, 5], [7, 8, 9, 10]])
    params = [greedy(4), SamplingParams(temperature=0.8), greedy(4)]
    if not mixed:
        params[1] = greedy(4)

    def run(fault):
        gens = [None, torch.Generator().manual_seed(9), None]
        return accept(verify, logits, params, gens, ["r0", "r1", "r2"], fault)

    clean, faulted = run(None), run(SamplingFault(req_ids=frozenset({"r1"})))
    assert clean.errors == ()
    assert faulted.error_of(0) == faulted.error_of(2) == ""
    assert faulted.error_of(1).startswith("acceptance: InjectedFault")
    for r in (0, 2):
        assert faulted.new_tokens[r] == clean.new_tokens[r]
        assert faulted.path_nodes[r] == clean.path_nodes[r]


class PoisonedTokenizer:
    """A real tokenizer whose decode raises on one token id: a detokenizer that fails for one
    request's output only (handed to the engine through its constructor)."""

    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, poison: int) -> None:
        self.poison = poison

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.poison in ids:
            raise ValueError(f"cannot decode token {self.poison}")
        return letter_tokenizer().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_a_row_whose_detokenizer_raises_fails_alone(model, head, kind):
    """A token only request 'b' generates (not among its first two) breaks the detokenizer:
    'b' streams its tokens up to it and then ends with ERROR -- in a speculative engine inside
    a round's commit -- while 'a' and 'c' finish with their tokens; pages come back."""
    ps = prompts(4, seed=41, lo=3)
    n = 12
    want = [c.output_ids for c in reference(model, ps, greedy(n))]
    poison = next(t for t in want[1][2:] if t not in want[0] + want[2] + want[3]
                  and t not in want[1][:2])
    cut = want[1].index(poison)
    eng = _engine(kind, model, head, tokenizer=PoisonedTokenizer(poison))
    got = _serve(eng, {"a": (ps[0], greedy(n)), "b": (ps[1], greedy(n)),
                       "c": (ps[2], greedy(n))})
    tokens, reason, error = got["b"]
    assert reason is ERROR and "cannot decode token" in error, error
    assert want[1][:len(tokens)] == tokens and len(tokens) <= cut  # nothing past the failure
    assert got["a"][:2] == (want[0], LENGTH) and got["c"][:2] == (want[2], LENGTH)
    assert _serve(eng, {"next": (ps[3], greedy(n))})["next"][:2] == (want[3], LENGTH)
    assert_pages_free(eng)


# ---- colocated: the dispatcher maps a failed row to RequestFailed (INTERNAL) -----------------


def _routed(rid: str, prompt, params: SamplingParams) -> RoutedRequest:
    return RoutedRequest(request_id=rid, room=1, model="default", prompt_ids=tuple(prompt),
                         params=params, deadline=None,
                         placement=Placement(prefill_worker="colocated-0",
                                             decode_worker="colocated-0"))


async def _stream(d: ColocatedDispatcher, req: RoutedRequest) -> tuple[int, ...]:
    return tuple(t for c in [c async for c in d.submit(req)] for t in c.token_ids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_colocated_failed_row_is_internal_for_its_request_only(model, head, kind):
    """Through `ColocatedDispatcher` + `EngineLoop`: the faulted request raises RequestFailed
    (INTERNAL, naming the request and the cause); the requests streamed alongside -- one of
    them at temperature 1e-300 -- get their tokens, the worker stays healthy, the next request
    is served and every page is back."""
    ps = prompts(4, seed=31, lo=3)
    n = 8
    want = [c.output_ids for c in reference(model, ps, greedy(n))]
    eng = _engine(kind, model, head, sampling_fault=SamplingFault(req_ids=frozenset({"bad"})))
    d = ColocatedDispatcher.from_engine(eng)
    tiny_t = SamplingParams(max_new_tokens=n, temperature=1e-300, ignore_eos=True)

    async def main():
        got = await asyncio.gather(_stream(d, _routed("a", ps[0], greedy(n))),
                                   _stream(d, _routed("bad", ps[1], greedy(n))),
                                   _stream(d, _routed("tiny-t", ps[2], tiny_t)),
                                   return_exceptions=True)
        nxt = await _stream(d, _routed("next", ps[3], greedy(n)))
        return got, nxt

    try:
        (a, bad, tiny), nxt = asyncio.run(asyncio.wait_for(main(), 100))
        assert isinstance(bad, RequestFailed), bad
        assert "request 'bad'" in str(bad) and "InjectedFault" in str(bad)
        err = from_dispatch_error(bad)
        assert err.code is Code.INTERNAL and "request 'bad'" in err.message
        assert (a, tiny, nxt) == (want[0], want[2], want[3])
        (info,) = d.workers()
        assert info.healthy, info.error
        assert d.loop("colocated-0").wait_idle(10)
        assert_pages_free(eng)
    finally:
        asyncio.run(d.close())


def test_engine_config_rejects_a_fault_hook_from_yaml():
    with pytest.raises(ValueError, match="^sampling_fault:"):
        engine_cfg(sampling_fault={"req_ids": ["x"]})


def test_request_failed_is_internal_and_names_the_request():
    """The disaggregated dispatcher builds RequestFailed from a worker's error_kind "request"
    result; either form maps to INTERNAL (never UNAVAILABLE: the worker is healthy)."""
    named = from_dispatch_error(RequestFailed("sampling: InjectedFault: x", request_id="r7"))
    assert named.code is Code.INTERNAL
    assert named.message == "request 'r7' failed on the worker: sampling: InjectedFault: x"
    plain = from_dispatch_error(RequestFailed("decode worker 'd' failed this request: boom"))
    assert plain.code is Code.INTERNAL and plain.message.endswith("boom")
