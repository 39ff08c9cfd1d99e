"""Shared pieces of the speculative-decoding tests (tests/unit/test_spec_*.py).

- `tiny_target`: a small random decoder of a supported family, built in-process (no checkpoint,
  no transformers import), float32. Optionally its lm_head is restricted to a few "live"
  tokens (pairs of rows +w / -w, every other row zero), so the target only ever emits live
  tokens and a random draft head that also proposes only live tokens is right some of the time:
  real drafting then produces every acceptance pattern (none, partial, all).
- `tiny_head`: a random EAGLE or EAGLE-3 head for such a target (EAGLE-3: explicit feature
  layers valid for a 4-layer target, draft vocabulary = the live tokens through `d2t`).
- `ScriptedSpecEngine`: a `SpecEngine` whose drafts come from a script over the reference
  continuation, to force acceptance patterns; it records every round's verify result.
- `Recorder`: spies on every forward (phase, metadata, positions) of a `SpecEngine`.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import pytest
import torch

from tandem.engine import (
    EngineConfig,
    LLMEngine,
    ModelConfig,
    ParallelContext,
    SamplingParams,
)
from tandem.engine.attention.device_decode import DeviceDecodePlan
from tandem.engine.models.decoder import DecoderLM
from tandem.spec import (
    DraftHeadConfig,
    EagleHead,
    SpecConfig,
    SpecEngine,
    VerifyInput,
    dummy_head,
)
from tandem.spec.phases import DraftInput

VOCAB = 256
MAX_LEN = 512
LIVE = (3, 17, 60, 101, 150, 222, 240, 255)  # target ids the restricted lm_head can emit

_COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": MAX_LEN,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
_ARCH = {
    "llama": {"architectures": ["LlamaForCausalLM"]},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "head_dim": 32},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                "num_experts_per_tok": 2},
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only contend (10x slower).
    Import this fixture into a test module to run it single-threaded; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_target(arch: str = "llama", *, num_layers: int = 4, seed: int = 0,
                live: Sequence[int] | None = LIVE, eos_token_id: int | None = None,
                max_position: int = MAX_LEN) -> DecoderLM:
    """max_position: rope table length (`build_model` uses the engine's max_model_len)."""
    raw = dict(_COMMON, **_ARCH[arch], num_hidden_layers=num_layers, eos_token_id=eos_token_id)
    cfg = ModelConfig.from_hf(raw)
    with torch.device("cpu"):
        model = DecoderLM(cfg, ParallelContext(), torch.float32, max_position)
    gen = torch.Generator().manual_seed(seed)
    for name, slot in sorted(model.weight_loaders().items()):
        t = torch.randn(slot.shape, generator=gen) * 0.1  # HF's initializer_range of hf_tiny
        slot.load(1.0 + t if slot.is_norm else t)
    if live:
        w = torch.zeros(VOCAB, cfg.hidden_size)
        dirs = torch.randn(len(live) // 2, cfg.hidden_size, generator=gen) * 0.3
        for i, tok in enumerate(live):
            w[tok] = dirs[i // 2] * (1 if i % 2 == 0 else -1)
        model.lm_head.weight.data.copy_(w)
    return model.eval()


def tiny_head(model: DecoderLM, kind: str = "eagle", *, live: Sequence[int] | None = LIVE,
              seed: int = 1, max_position: int = MAX_LEN) -> EagleHead:
    mc = model.cfg
    if kind == "eagle":
        cfg = DraftHeadConfig.like_target(mc, "eagle")
    elif kind == "eagle-2layer":  # EAGLE-1 head with a second decoder layer (own KV layer)
        cfg = DraftHeadConfig.like_target(mc, "eagle", num_layers=2)
    elif kind == "eagle-subset":  # EAGLE-1 head drafting over a reduced vocabulary
        # Drafts over the live tokens (or every other token when no vocabulary is live).
        ids = torch.tensor(sorted(live)) if live else torch.arange(0, mc.vocab_size, 2)
        cfg = DraftHeadConfig.like_target(mc, "eagle", draft_vocab_size=len(ids))
        with torch.device("cpu"):
            head = EagleHead(cfg, model, torch.float32, max_position)
        state = dummy_head(DraftHeadConfig.like_target(mc, "eagle"), model, torch.float32,
                           torch.device("cpu"), max_position, seed=seed).state_for_saving()
        state["d2t"] = ids - torch.arange(len(ids))  # draft id i -> target id sorted(live)[i]
        head.load_state(state, "tiny eagle-subset head")
        return head.eval()
    else:
        vocab = len(live) if live else None
        cfg = DraftHeadConfig.like_target(mc, "eagle3", draft_vocab_size=vocab)
        n = mc.num_layers
        cfg = replace(cfg, feature_layers=(0, n // 2, n - 1))  # like_target's needs >= 7 layers
    head = dummy_head(cfg, model, torch.float32, torch.device("cpu"), max_position, seed=seed)
    if kind == "eagle3" and live:
        ids = torch.tensor(sorted(live))
        head.d2t.copy_(ids - torch.arange(len(ids)))  # draft id i -> target id sorted(live)[i]
        # The draft vocabulary's rows of the target's lm_head, so that a random EAGLE-3 head
        # agrees with the target about as often as a random EAGLE one.
        head.lm_head.weight.data.copy_(model.lm_head.weight.data[ids])
    return head


def engine_cfg(**kw) -> EngineConfig:
    base = {"model": "tiny-in-process", "dtype": "float32", "num_pages": 256, "page_size": 4,
            "max_num_batched_tokens": 64, "cuda_graphs": False}
    base.update(kw)
    return EngineConfig(**base)


def prompts(num: int, seed: int, vocab: int = VOCAB, lo: int = 1, hi: int = 23) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def reference(model: DecoderLM, ps: Sequence[Sequence[int]], params, tokenizer=None, **cfg):
    """Completions of the non-speculative engine (the oracle)."""
    return LLMEngine(engine_cfg(**cfg), model, tokenizer).generate(ps, params)


def greedy(n: int, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_new_tokens=n, **kw)


def assert_seeded_runs_equal(make_engine: Callable[[], SpecEngine], ps, params,
                             runs: int = 2) -> None:
    """Seeded sampling is reproducible: engines from `make_engine` (each with a fresh policy
    of the same schedule) give the same outputs for the same requests, every page back."""
    outs = []
    for _ in range(runs):
        eng = make_engine()
        outs.append([c.output_ids for c in eng.generate(ps, params)])
        assert_pages_free(eng)
    assert all(o == outs[0] for o in outs[1:])


@functools.cache
def letter_tokenizer(*, split_on_spaces: bool = False):
    """One two-character word per id ("a0", "b0", ... "z0", "a1", ...), joined by spaces when
    decoded, so a word is found in a text only where its token is. `split_on_spaces` adds a
    whitespace pre-tokenizer, for tests that send text prompts."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from tandem.tokenizer import Tokenizer

    vocab = {f"{chr(97 + i % 26)}{i // 26}": i for i in range(VOCAB)}
    hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="a0"))
    if split_on_spaces:
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(tokenizer=hf, chat_template=None, special_tokens={})


def assert_pages_free(eng: LLMEngine) -> None:
    assert eng.allocator.num_free == eng.allocator.num_usable, "KV pages leaked"
    assert not eng.scheduler.running and not eng.scheduler.waiting
    if isinstance(eng, SpecEngine):
        assert not eng.seeds, "draft seeds of finished requests left behind"


# ---- scripted drafts ------------------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """Draft nodes below the root: tokens[j] is node j+1, parents[j] its parent (0 = root)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]


def wrong(tok: int, i: int = 0) -> int:
    return (tok + 1 + i) % VOCAB


def chain(ref: Sequence[int], k: int, m: int) -> Tree:
    """k drafts from the reference continuation `ref`, the first m correct."""
    toks = [ref[i] if i < m else wrong(ref[i]) for i in range(k)]
    return Tree(tuple(toks), tuple(range(k)))


def comb(ref: Sequence[int], depth: int, k: int, m: int, sibling: Sequence[int]) -> Tree:
    """A tree of `depth` levels of `k` siblings. At level l the sibling `sibling[l]` continues
    the tree; it carries the reference token when l < m (so the accepted path is that sibling
    at levels 0..m-1), a wrong one otherwise. Every other sibling is wrong. A distractor child
    (carrying the level-2 reference token) hangs under a wrong level-1 sibling: accepting it
    would mean the walk left the accepted path."""
    toks, parents = [], []
    current = 0
    for level in range(depth):
        base = len(toks) + 1
        for s in range(k):
            good = s == sibling[level] and level < m
            toks.append(ref[level] if good else wrong(ref[level], s))
            parents.append(current)
        current = base + sibling[level]
        if level == 0 and depth > 1:
            decoy_parent = base + (sibling[0] + 1) % k
            toks.append(ref[1])
            parents.append(decoy_parent)
    return Tree(tuple(toks), tuple(parents))


def comb_path(depth: int, k: int, m: int, sibling: Sequence[int]) -> tuple[int, ...]:
    """Node indices `comb` puts the accepted path at."""
    path, base = [], 1
    for level in range(m):
        path.append(base + sibling[level])
        base += k + (1 if level == 0 and depth > 1 else 0)
    return tuple(path)


Script = Callable[[str, list[int]], Tree]  # (req_id, committed output ids) -> draft tree


class ScriptedSpecEngine(SpecEngine):
    """Drafts come from `script` (None: the real draft head drafts); the head still runs
    draft-extend and prefill. Every round's (req_id, path_nodes, new_tokens) is recorded in
    `rounds`. With `draft_too`, the real drafting also runs (its forwards are what some tests
    inspect) and its proposal is replaced by the script's."""

    def __init__(self, *args, script: Script | None, draft_too: bool = False, **kw) -> None:
        super().__init__(*args, **kw)
        self.script, self.draft_too = script, draft_too
        self.rounds: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []

    def _propose(self, req_ids: list[str], inp: DraftInput, num_drafts: int) -> VerifyInput:
        if self.script is None or self.draft_too:
            drafted = super()._propose(req_ids, inp, num_drafts)
            if self.script is None:
                return drafted
        assert num_drafts == self.spec.num_steps, "scripted drafts have the configured depth"
        trees = [self.script(rid, list(self.scheduler.requests[rid].output_ids)) for rid in req_ids]
        n = len(trees[0].tokens) + 1
        assert all(len(t.tokens) + 1 == n for t in trees), "scripted trees differ in size"
        assert n <= self.spec.tree_size, "scripted tree larger than the pages reserved for it"
        last = inp.last_tokens.tolist()
        parents, depths = [], []
        for t in trees:
            par = (-1, *t.parents)
            dep = [0]
            for p in t.parents:
                dep.append(dep[p] + 1)
            parents.append(par)
            depths.append(tuple(dep))
        tokens = torch.tensor([[last[r], *t.tokens] for r, t in enumerate(trees)])
        return VerifyInput(page_ids=inp.page_ids, num_cached=inp.num_cached, tokens=tokens,
                           parents=tuple(parents), depths=tuple(depths))

    def _commit(self, reqs, result, nxt, num_drafts):
        for req, path, toks in zip(reqs, result.path_nodes, result.new_tokens):
            self.rounds.append((req.req_id, path, toks))
        return super()._commit(reqs, result, nxt, num_drafts)

    def paths_of(self, req_id: str) -> list[tuple[int, ...]]:
        return [p for r, p, _ in self.rounds if r == req_id]


def scripted_engine(model, head, spec: SpecConfig, script: Script | None, tokenizer=None,
                    draft_too: bool = False, **cfg) -> ScriptedSpecEngine:
    return ScriptedSpecEngine(engine_cfg(**cfg), spec, model, head, tokenizer, script=script,
                              draft_too=draft_too)


def run_ids(eng: LLMEngine, ps, params) -> tuple[list[str], list]:
    """Generate with explicit request ids req-0.. (so scripts can look up references)."""
    plist = [params] * len(ps) if isinstance(params, SamplingParams) else list(params)
    ids = [eng.add_request(p, sp, req_id=f"req-{i}") for i, (p, sp) in enumerate(zip(ps, plist))]
    reqs = {i: eng.scheduler.requests[i] for i in ids}
    while eng.has_unfinished():
        eng.step()
    return ids, [reqs[i] for i in ids]


# ---- spying on forwards -----------------------------------------------------------------------


@dataclass
class Forward:
    """One forward as the spy saw it."""

    phase: str  # prefill | draft_prefill | draft_step | verify | extend
    round: int  # speculative round index (-1 outside a round)
    model: str  # target | draft
    meta: object  # the AttentionMetadata planned
    positions: list[int]
    slot_ids: list[int]
    kv_lens: list[int]
    qo_indptr: list[int]
    mask: torch.Tensor | None  # custom mask (flat), cloned
    num_cached: tuple[int, ...] = ()  # the round's DraftInput.num_cached (rounds only)
    page_ids: tuple[tuple[int, ...], ...] = ()  # the round's page tables (rounds only)


@dataclass
class Recorder:
    forwards: list[Forward] = field(default_factory=list)
    plans: list[object] = field(default_factory=list)  # every meta passed to backend.plan
    phase: str = "idle"
    round: int = -1
    round_num_cached: tuple[int, ...] = ()
    round_page_ids: tuple[tuple[int, ...], ...] = ()
    round_req_ids: list[list[str]] = field(default_factory=list)
    results: list[object] = field(default_factory=list)  # VerifyResult per round
    verifies: list[object] = field(default_factory=list)  # VerifyInput per round

    def install(self, eng: SpecEngine, monkeypatch) -> Recorder:
        import tandem.spec.engine as spec_engine

        rec = self
        # Phases as separate forwards: a prompt step merged with the round's verify
        # (`merge_arrivals`) is one forward of both (tests/unit/test_merged_arrivals.py).
        eng.merge_arrivals = False
        backend = eng.runner.backend
        assert eng.draft.backend is backend
        orig_plan = backend.plan

        def plan(meta):
            rec.plans.append(meta)
            return orig_plan(meta)

        monkeypatch.setattr(backend, "plan", plan)

        def record(model: str, layout_attn, positions):
            a = layout_attn
            rec.forwards.append(Forward(
                phase=rec.phase, round=rec.round, model=model, meta=a,
                positions=positions.tolist(), slot_ids=a.slot_ids.tolist(),
                kv_lens=a.kv_lens_cpu.tolist(), qo_indptr=a.qo_indptr_cpu.tolist(),
                mask=None if a.custom_mask is None else a.custom_mask.clone(),
                num_cached=rec.round_num_cached, page_ids=rec.round_page_ids))

        orig_runner_forward = eng.runner.forward

        def runner_forward(batch):
            record("target", batch.attn, batch.positions)
            return orig_runner_forward(batch)

        monkeypatch.setattr(eng.runner, "forward", runner_forward)
        orig_draft_forward = eng.draft.forward

        def draft_forward(token_ids, features, layout):
            record("draft", layout.attn, layout.positions)
            return orig_draft_forward(token_ids, features, layout)

        monkeypatch.setattr(eng.draft, "forward", draft_forward)
        orig_draft_planned = eng.draft.forward_planned
        page_size = eng.cfg.page_size

        def draft_forward_planned(token_ids, features, positions, plan):
            # Chain draft steps plan nothing on the host (engine/attention/device_decode):
            # record their device plan as the metadata it stands for.
            if isinstance(plan, DeviceDecodePlan):
                meta = device_plan_metadata(plan, page_size)
                rec.plans.append(meta)
                record("draft", meta, positions)
            return orig_draft_planned(token_ids, features, positions, plan)

        monkeypatch.setattr(eng.draft, "forward_planned", draft_forward_planned)

        def phased(fn, name):
            def wrapper(*a, **kw):
                prev, rec.phase = rec.phase, name
                try:
                    return fn(*a, **kw)
                finally:
                    rec.phase = prev
            return wrapper

        monkeypatch.setattr(eng, "_prefill_step", phased(eng._prefill_step, "prefill"))
        import tandem.spec.prompt_side as prompt_side

        monkeypatch.setattr(prompt_side, "draft_prefill",
                            phased(prompt_side.draft_prefill, "draft_prefill"))
        monkeypatch.setattr(eng, "_verify_forward", phased(eng._verify_forward, "verify"))
        monkeypatch.setattr(spec_engine, "draft_extend",
                            phased(spec_engine.draft_extend, "extend"))
        orig_propose = eng._propose

        def propose(req_ids, inp, num_drafts):
            rec.round += 1
            rec.round_num_cached = inp.num_cached
            rec.round_page_ids = inp.page_ids
            rec.round_req_ids.append(list(req_ids))
            prev, rec.phase = rec.phase, "draft_step"
            try:
                return orig_propose(req_ids, inp, num_drafts)
            finally:
                rec.phase = prev

        monkeypatch.setattr(eng, "_propose", propose)
        orig_accept = spec_engine.accept

        def accept(verify, *a, **kw):
            res = orig_accept(verify, *a, **kw)
            rec.verifies.append(verify)
            rec.results.append(res)
            return res

        monkeypatch.setattr(spec_engine, "accept", accept)
        return self

    def of(self, phase: str, round: int | None = None) -> list[Forward]:
        return [f for f in self.forwards
                if f.phase == phase and (round is None or f.round == round)]


def device_plan_metadata(plan: DeviceDecodePlan, page_size: int) -> SimpleNamespace:
    """A chain draft step's device plan as the host metadata it stands for: one query per
    sequence, the pages its kv_lens keys fill, causal (no custom mask). `kv_lens` and
    `slot_ids` are the plan's own tensors, so the checks that no metadata buffer is shared
    between forwards or written after its forward see the real ones; the rest is derived."""
    lens, table = plan.kv_lens.tolist(), plan.page_table.tolist()
    pages = [table[i][: -(-n // page_size)] for i, n in enumerate(lens)]
    indptr = list(itertools.accumulate((len(p) for p in pages), initial=0))
    flat = torch.tensor([p for ps in pages for p in ps], dtype=torch.int32)
    qo = torch.arange(len(lens) + 1, dtype=torch.int32)
    return SimpleNamespace(
        kv_page_ids_cpu=flat, kv_page_ids=flat.clone(),
        kv_page_indptr_cpu=torch.tensor(indptr, dtype=torch.int32),
        kv_page_indptr=torch.tensor(indptr, dtype=torch.int32),
        kv_lens_cpu=torch.tensor(lens, dtype=torch.int32), kv_lens=plan.kv_lens,
        qo_indptr_cpu=qo, qo_indptr=qo.clone(), slot_ids=plan.slot_ids,
        custom_mask=None)


def slot(pages: Sequence[int], position: int, page_size: int) -> int:
    return pages[position // page_size] * page_size + position % page_size
