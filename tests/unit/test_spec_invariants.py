"""One regression test per drafting invariant (docs/architecture.md, "Drafting invariants").
Each comes from a real bug in a production engine; each test here spies on the metadata of every
forward (or on the phase values) and fails if the invariant breaks -- output equality alone
cannot see most of them, because a wrong draft only lowers acceptance, it never changes greedy
output.

- seq lens after rejection  - per-step slots  - positions  - metadata per step
- phases are values (frozen, inputs never modified in place)
"""

from __future__ import annotations

import dataclasses
import types
from functools import cache

import pytest
import torch
from spec_fresh_prefill import assert_seeds_equal_a_fresh_prefill
from spec_helpers import (
    Forward,
    Recorder,
    assert_pages_free,
    chain,
    comb,
    engine_cfg,
    greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    run_ids,
    scripted_engine,
    slot,
    tiny_head,
    tiny_target,
)

import tandem.spec.engine as spec_engine
import tandem.spec.prompt_side as prompt_side
from tandem.spec import (
    DRAFT_GROUP,
    DraftExtendInput,
    DraftInput,
    DraftSeed,
    RoundInput,
    SpecConfig,
    SpecEngine,
    VerifyInput,
    VerifyResult,
)
from tandem.spec.tree_graphs import DraftedTree

N_NEW = 14
CHAIN = SpecConfig(num_steps=4)
TREE = SpecConfig(num_steps=3, topk=3)  # real tree drafting: 2 draft steps of 3 nodes


@cache
def _model():
    return tiny_target("llama", live=None)


@cache
def _refs(bs: int):
    ps = tuple(tuple(p) for p in prompts(bs, seed=300 + bs, lo=3, hi=21))
    got = reference(_model(), ps, greedy(N_NEW + 8))
    return ps, tuple(c.output_ids for c in got)


def _forced_run(spec: SpecConfig, ms: list[int], monkeypatch, kind: str = "eagle"):
    """Real drafting runs (its forwards are recorded) but the verified drafts are scripted so
    that request r accepts exactly ms[r] drafts every round."""
    ps, refs = _refs(len(ms))

    def script(rid, out):
        r = int(rid.split("-")[1])
        ref = refs[r][len(out):]
        if spec.topk == 1:
            return chain(ref, spec.num_steps, ms[r])
        return comb(ref, spec.num_steps, 2, ms[r], (1,) * spec.num_steps)

    model = _model()
    eng = scripted_engine(model, tiny_head(model, kind, live=None), spec, script, draft_too=True,
                          max_num_batched_tokens=16)
    rec = Recorder().install(eng, monkeypatch)
    _, reqs = run_ids(eng, [list(p) for p in ps], greedy(N_NEW))
    assert [tuple(r.output_ids) for r in reqs] == [ref[:N_NEW] for ref in refs]
    assert_pages_free(eng)
    return eng, rec, reqs


def _real_run(spec: SpecConfig, bs: int, monkeypatch, kind: str = "eagle", **cfg):
    ps, refs = _refs(bs)
    model = _model()
    eng = SpecEngine(engine_cfg(**cfg), spec, model, tiny_head(model, kind, live=None))
    rec = Recorder().install(eng, monkeypatch)
    _, reqs = run_ids(eng, [list(p) for p in ps], greedy(N_NEW))
    assert [tuple(r.output_ids) for r in reqs] == [ref[:N_NEW] for ref in refs]
    assert_pages_free(eng)
    return eng, rec, reqs


def _rows(f: Forward, i: int) -> range:
    return range(f.qo_indptr[i], f.qo_indptr[i + 1])


def _mask_rows(f: Forward, i: int) -> list[torch.Tensor]:
    """Sequence i's [q_len, kv_len] mask rows (causal when the forward has no custom mask)."""
    q_len, kv_len = f.qo_indptr[i + 1] - f.qo_indptr[i], f.kv_lens[i]
    if f.mask is None:
        full = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        return list(full)
    off = sum((f.qo_indptr[j + 1] - f.qo_indptr[j]) * f.kv_lens[j] for j in range(i))
    return list(f.mask[off : off + q_len * kv_len].view(q_len, kv_len))


# ---- seq lens after rejection -----------------------------------------------------------------


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_draft_attends_only_to_accepted_tokens_after_rejection(spec, monkeypatch):
    """After verify accepts a of k drafts, draft-extend covers exactly the a accepted tokens +
    the bonus (kv len = cached + a + 1), the next round starts from cached + a + 1, and no
    draft forward ever reads a KV slot that holds a rejected or scratch entry of an earlier
    round (SGLang's seq-lens-after-rejection bug)."""
    ms = [0, 2, spec.num_steps, 1]  # accepted drafts per round, per request
    eng, rec, reqs = _forced_run(spec, ms, monkeypatch)
    ps = eng.cfg.page_size
    # Provenance of every draft KV slot: ("committed", position) or ("scratch", round).
    draft_kv: dict[int, tuple] = {}
    num_checked = 0
    for f in (f for f in rec.forwards if f.model == "draft"):
        # Reads first (a token's own write is part of what it reads, checked via `own`).
        own = set(f.slot_ids)
        pages_all = f.meta.kv_page_ids_cpu.tolist()
        pind = f.meta.kv_page_indptr_cpu.tolist()
        for i in range(len(f.kv_lens)):
            pages = pages_all[pind[i] : pind[i + 1]]
            rows = _mask_rows(f, i)
            first_new = f.kv_lens[i] - len(rows)
            for row in rows:
                for pos in torch.nonzero(row).flatten().tolist():
                    s = slot(pages, pos, ps)
                    if f.phase == "draft_step":
                        nc = f.num_cached[i]
                        if pos < nc:
                            assert draft_kv.get(s) == ("committed", pos), (f.phase, f.round, pos)
                        else:  # this round's scratch: written by this or an earlier step
                            assert s in own or draft_kv.get(s) == ("scratch", f.round), (
                                f.round, pos, draft_kv.get(s))
                    elif pos < first_new:  # draft prefill / extend: the committed prefix
                        assert draft_kv.get(s) == ("committed", pos), (f.phase, f.round, pos,
                                                                       draft_kv.get(s))
                    else:
                        assert s in own
                    num_checked += 1
        for s, pos in zip(f.slot_ids, f.positions):
            draft_kv[s] = ("scratch", f.round) if f.phase == "draft_step" else ("committed", pos)
    assert num_checked > 1000

    # Exact seq lens of every extend and of the next round's draft steps.
    rid_index = {r.req_id: int(r.req_id.split("-")[1]) for r in reqs}
    k = spec.topk
    for t, (req_ids, result) in enumerate(zip(rec.round_req_ids, rec.results)):
        nc = rec.of("draft_step", t)[0].num_cached if spec.num_steps > 1 else None
        ext = rec.of("extend", t)
        assert len(ext) == 1
        ext = ext[0]
        for i, rid in enumerate(req_ids):
            a = ms[rid_index[rid]]
            assert result.num_accepted[i] == a
            cached = ext.num_cached[i]
            assert nc is None or nc[i] == cached
            assert ext.qo_indptr[i + 1] - ext.qo_indptr[i] == a + 1
            assert ext.kv_lens[i] == cached + a + 1, (t, rid)
            nxt = [j for j in range(t + 1, len(rec.round_req_ids)) if rid in rec.round_req_ids[j]]
            if not nxt:
                continue
            j = rec.round_req_ids[nxt[0]].index(rid)
            steps = rec.of("draft_step", nxt[0])
            assert steps and steps[0].num_cached[j] == cached + a + 1
            for m, step in enumerate(steps, start=1):
                assert step.kv_lens[j] == cached + a + 1 + m * k
                # what each query really attends to: the committed prefix + its own chain
                for row in _mask_rows(step, j):
                    assert int(row.sum()) == cached + a + 1 + m


def test_no_seq_lens_buffer_is_shared_or_mutated(monkeypatch):
    _, rec, _ = _forced_run(CHAIN, [1, 3, 0], monkeypatch)
    metas = [f.meta for f in rec.forwards]
    for name in ("kv_lens", "kv_lens_cpu", "qo_indptr", "qo_indptr_cpu", "slot_ids",
                 "kv_page_indptr", "kv_page_ids"):
        ptrs = [getattr(m, name).untyped_storage().data_ptr() for m in metas
                if getattr(m, name).numel()]
        assert len(set(ptrs)) == len(ptrs), f"{name}: a buffer is shared between forwards"
    # Nothing wrote into a forward's metadata after it was built (values as recorded then).
    for f in rec.forwards:
        assert f.meta.kv_lens_cpu.tolist() == f.kv_lens
        assert f.meta.kv_lens.tolist() == f.kv_lens
        assert f.meta.slot_ids.tolist() == f.slot_ids


# ---- per-step slots ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [CHAIN, TREE, SpecConfig(num_steps=4, topk=2,
                                                          num_draft_tokens=6)],
                         ids=["chain", "tree3x3", "tree4x2n6"])
def test_draft_step_writes_only_its_own_slots(spec, monkeypatch):
    eng, rec, _ = _real_run(spec, 3, monkeypatch)
    k, ps = spec.topk, eng.cfg.page_size
    rounds = 0
    for t in range(len(rec.round_req_ids)):
        steps = rec.of("draft_step", t)
        assert len(steps) == spec.num_steps - 1
        written: set[int] = set()
        for m, f in enumerate(steps, start=1):
            bs = len(f.kv_lens)
            assert len(f.slot_ids) == bs * k  # bs x topk new slots, nothing else
            assert not written & set(f.slot_ids), "a draft step rewrote an earlier step's slot"
            written |= set(f.slot_ids)
            for i in range(bs):
                nc, pages = f.num_cached[i], f.page_ids[i]
                assert len(_rows(f, i)) == k
                assert [f.slot_ids[q] for q in _rows(f, i)] == [
                    slot(pages, nc + (m - 1) * k + b, ps) for b in range(k)]
                assert f.kv_lens[i] == nc + m * k
                for b, row in enumerate(_mask_rows(f, i)):
                    assert int(row.sum()) == nc + m  # seq_len + i + 1 keys (i = m - 1)
                    assert bool(row[:nc].all())
                    scratch = (torch.nonzero(row[nc:]).flatten() // k).tolist()
                    assert scratch == list(range(m)), "not exactly one ancestor per level"
                    assert bool(row[nc + (m - 1) * k + b])  # its own slot
        rounds += 1
    assert rounds > 5


# ---- positions --------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_positions_of_every_phase(spec, monkeypatch):
    # A budget of 8 tokens splits prompts into chunks (draft prefill over several steps).
    _, rec, reqs = _real_run(spec, 3, monkeypatch, max_num_batched_tokens=8)
    prompt_len = {r.req_id: len(r.prompt_ids) for r in reqs}
    # Target and draft prefill cover positions 0 .. P-1 exactly once per request.
    for phase in ("prefill", "draft_prefill"):
        seen = sorted(p for f in rec.of(phase) for p in f.positions)
        assert seen == sorted(p for n in prompt_len.values() for p in range(n)), phase
    first_round: dict[str, int] = {}
    for t, req_ids in enumerate(rec.round_req_ids):
        (verify,) = rec.of("verify", t)
        (ext,) = rec.of("extend", t)
        result = rec.results[t]
        n = verify.qo_indptr[1]
        for i, rid in enumerate(req_ids):
            nc = verify.num_cached[i]
            first_round.setdefault(rid, nc)
            for m, f in enumerate(rec.of("draft_step", t), start=1):
                assert [f.positions[q] for q in _rows(f, i)] == [nc + m - 1] * spec.topk
            vpos = [verify.positions[q] for q in _rows(verify, i)]
            assert vpos[0] == nc  # the root (last committed token)
            assert len(vpos) == n
            assert vpos == [nc + d for d in rec.verifies[t].depths[i]]
            if spec.topk == 1:
                assert vpos == list(range(nc, nc + n))
            assert max(vpos) <= nc + spec.num_steps
            a = result.num_accepted[i]
            assert [ext.positions[q] for q in _rows(ext, i)] == list(range(nc, nc + a + 1))
    # A request continues at position prompt_len after its prefill.
    assert first_round == prompt_len


# ---- metadata per step ------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_fresh_metadata_for_every_forward(spec, monkeypatch):
    _, rec, _ = _real_run(spec, 3, monkeypatch, max_num_batched_tokens=8)
    # plan() ran exactly once per forward, on that forward's own metadata object.
    assert len(rec.plans) == len(rec.forwards)
    assert all(p is f.meta for p, f in zip(rec.plans, rec.forwards))
    assert len({id(m) for m in rec.plans}) == len(rec.plans)  # all alive: ids are unique
    # The phase sequence: prefill steps are (target, draft), rounds are
    # draft steps..., verify, extend -- one forward each.
    phases = [(f.phase, f.round) for f in rec.forwards]
    for t in range(len(rec.round_req_ids)):
        got = [p for p, r in phases if r == t and p in ("draft_step", "verify", "extend")]
        assert got == ["draft_step"] * (spec.num_steps - 1) + ["verify", "extend"]
    pre = [p for p, _ in phases if p in ("prefill", "draft_prefill")]
    assert pre == ["prefill", "draft_prefill"] * (len(pre) // 2)
    # Consecutive draft steps of a round differ in what they write: not a reused object.
    for t in range(len(rec.round_req_ids)):
        slots = [tuple(f.slot_ids) for f in rec.of("draft_step", t)]
        assert len(set(slots)) == len(slots)


# ---- phases are values ------------------------------------------------------------------------

PHASES = (DraftSeed, RoundInput, DraftInput, VerifyInput, VerifyResult, DraftExtendInput)


# DraftedTree: a tree drafted in CUDA graphs before its shape is read (spec/tree_graphs.py)
@pytest.mark.parametrize("cls", (*PHASES, DraftedTree), ids=lambda c: c.__name__)
def test_phase_classes_are_frozen_slotted_dataclasses(cls):
    assert dataclasses.is_dataclass(cls)
    params = cls.__dataclass_params__
    assert params.frozen, f"{cls.__name__} is not frozen"
    assert "__slots__" in cls.__dict__, f"{cls.__name__} has no __slots__ (fields can be added)"


def test_phase_values_reject_assignment(monkeypatch):
    made: list[object] = []
    for cls in PHASES:  # capture one real instance of each phase from a run
        orig = cls.__init__

        def init(self, *a, _orig=orig, **kw):
            _orig(self, *a, **kw)
            made.append(self)

        monkeypatch.setattr(cls, "__init__", init)
    _real_run(SpecConfig(num_steps=2, topk=2), 1, monkeypatch)
    kinds = {type(o) for o in made}
    assert kinds == set(PHASES)
    for obj in {type(o): o for o in made}.values():
        name = dataclasses.fields(obj)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, name, getattr(obj, name))
        with pytest.raises((AttributeError, TypeError)):
            obj.backup = 1  # no ad-hoc fields either


class _Snapshot:
    """Versions and values of every tensor reachable from some arguments."""

    def __init__(self, *objs) -> None:
        self.items = []
        for obj in objs:
            for name, t in _tensors(obj):
                try:
                    version = t._version
                except RuntimeError:  # inference tensors have no version counter
                    version = None
                self.items.append((name, t, version, t.detach().clone()))
        assert self.items

    def assert_unchanged(self, where: str) -> None:
        for name, t, version, value in self.items:
            if version is not None:
                assert t._version == version, f"{where} modified {name} in place"
            assert torch.equal(t, value), f"{where} changed the values of {name}"


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix or "tensor", obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{type(obj).__name__}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from _tensors(x, f"{prefix}[{i}]")


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_phase_functions_never_modify_their_inputs(spec, monkeypatch):
    calls: dict[str, int] = {}
    held: list[tuple[str, _Snapshot]] = []  # inputs of every call, re-checked at the end

    def guard(name, fn):
        def wrapper(*args, **kw):
            snap = _Snapshot(*args, *kw.values())
            out = fn(*args, **kw)
            snap.assert_unchanged(name)
            held.append((name, snap))
            calls[name] = calls.get(name, 0) + 1
            return out
        return wrapper

    for name in ("propose", "accept", "make_extend_input", "draft_extend",
                 "compact_accepted_path"):
        monkeypatch.setattr(spec_engine, name, guard(name, getattr(spec_engine, name)))
    monkeypatch.setattr(prompt_side, "draft_prefill",
                        guard("draft_prefill", prompt_side.draft_prefill))
    model = _model()
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, "eagle3", live=None))
    orig_round = eng._spec_round

    def spec_round(inp, **kw):  # the round's input, and the seeds it was built from, unchanged
        snap = _Snapshot(inp, *(eng.seeds[r] for r in inp.req_ids))
        out = orig_round(inp, **kw)
        snap.assert_unchanged("a speculative round (its input and seeds)")
        return out

    monkeypatch.setattr(eng, "_spec_round", spec_round)
    # step() runs under inference_mode, whose tensors keep no version counter: run its body
    # without it here, so that an in-place write of equal values is still seen.
    monkeypatch.setattr(eng, "step", types.MethodType(SpecEngine.step.__wrapped__, eng))
    ps, refs = _refs(3)
    _, reqs = run_ids(eng, [list(p) for p in ps], greedy(N_NEW))
    assert [tuple(r.output_ids) for r in reqs] == [ref[:N_NEW] for ref in refs]
    assert set(calls) == {"propose", "accept", "make_extend_input", "draft_extend",
                          "compact_accepted_path", "draft_prefill"}
    for name, snap in held:  # nor did anything later write into a consumed phase value
        snap.assert_unchanged(f"something after {name}")
    versions = [v for _, snap in held for _, _, v, _ in snap.items]
    # Most phase tensors are version-tracked (only forward outputs are inference tensors).
    assert sum(v is not None for v in versions) > len(versions) // 2


# ---- the draft KV follows the accepted path ---------------------------------------------------


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle-2layer"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_caches_equal_a_fresh_prefill_of_the_committed_tokens(spec, kind):
    """Mid-generation, after rounds with different acceptance per request (tree paths through
    later siblings), the target KV, the draft KV and the draft seed of every request equal
    what a plain prefill of its committed tokens gives: compaction moved the accepted nodes'
    target KV, and draft-extend ran over exactly the accepted tokens + bonus with the
    features of the accepted nodes. (A draft that follows a wrong path never changes greedy
    output -- only acceptance -- so only a direct comparison sees it.)"""
    ms = [0, 2, spec.num_steps]
    ps, refs = _refs(len(ms))

    def script(rid, out):
        r = int(rid.split("-")[1])
        ref = refs[r][len(out):]
        if spec.topk == 1:
            return chain(ref, spec.num_steps, ms[r])
        return comb(ref, spec.num_steps, 2, ms[r], (1, 0, 1)[: spec.num_steps])

    model = _model()
    head = tiny_head(model, kind, live=None)
    eng = scripted_engine(model, head, spec, script)
    for r, p in enumerate(ps):
        eng.add_request(list(p), greedy(N_NEW), req_id=f"req-{r}")
    for _ in range(3):
        eng.step()
    assert len(eng.seeds) == len(ms) and len(eng.rounds) >= 2 * len(ms)

    assert_seeds_equal_a_fresh_prefill(eng, spec, model, head)


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_handed_off_request_continues_at_prompt_len(spec, monkeypatch):
    """A request prefilled by one engine and admitted by another (KV pages copied to
    different page ids) runs no prefill there: its first forward is the verify of a round
    whose root sits at position prompt_len, with the draft steps right after it."""
    ps, refs = _refs(3)
    model = _model()
    head = tiny_head(model, "eagle", live=None)
    pre = SpecEngine(engine_cfg(), spec, model, head)
    dec = SpecEngine(engine_cfg(num_pages=300), spec, model, head)
    rec = Recorder().install(dec, monkeypatch)
    for r, p in enumerate(ps):
        pre.add_prefill_request(list(p), greedy(N_NEW), f"req-{r}")
    while pre.has_unfinished():
        pre.step()
    offset = dec.allocator.alloc(37)  # so the decode side's page ids differ from the prefill's
    results = {}
    for h in pre.take_handoffs():
        pages = dec.allocator.alloc(len(h.page_ids) + 4)
        for group in ("target", DRAFT_GROUP):
            src, dst = pre.kv_pool.group_tensor(group), dec.kv_pool.group_tensor(group)
            dst[:, pages[: len(h.page_ids)]] = src[:, list(h.page_ids)]
        pre.free_pages(h.page_ids)
        out = dec.admit_prefilled(h.req_id, h.prompt_ids, greedy(N_NEW), h.first_token, h.seed,
                                  pages)
        results[h.req_id] = list(out.new_token_ids)
    while dec.has_unfinished():
        for o in dec.step():
            results[o.req_id].extend(o.new_token_ids)
    assert [tuple(results[f"req-{r}"]) for r in range(len(ps))] == [x[:N_NEW] for x in refs]
    dec.allocator.free(offset)
    assert_pages_free(dec)
    assert_pages_free(pre)
    assert not rec.of("prefill") and not rec.of("draft_prefill")
    assert rec.forwards[0].phase in ("draft_step", "verify")
    (verify,) = rec.of("verify", 0)
    for i, rid in enumerate(rec.round_req_ids[0]):
        prompt_len = len(ps[int(rid.split("-")[1])])
        assert verify.num_cached[i] == prompt_len
        assert verify.positions[verify.qo_indptr[i]] == prompt_len
        for m, f in enumerate(rec.of("draft_step", 0), start=1):
            assert {f.positions[q] for q in _rows(f, i)} == {prompt_len + m - 1}


# ---- a prompt step: its tokens committed after the others' round ------------------------------

@pytest.mark.parametrize("merge", [False, True], ids=["apart", "merged"])
def test_a_prompt_step_commits_its_first_token_after_the_others_round(merge, monkeypatch):
    """spec/prompt_side.py: a step with a completing prompt and decoding requests queues the
    prompt's work, runs the others' round, and only then reads and commits the prompt's first
    token (one host read a step); outputs stay plain greedy's and every page comes back.
    Merged (`merge_arrivals`), the round's verify is the prompt's forward itself."""
    model = _model()
    eng = SpecEngine(engine_cfg(), CHAIN, model, tiny_head(model, "eagle", live=None))
    eng.merge_arrivals = merge
    events: list[tuple[str, str]] = []
    verify, append = eng._verify_forward, eng._append
    merged = eng._merged_prefill_step

    def verifying(v):
        events.append(("verify", ""))
        return verify(v)

    def merging(plan, v):
        events.append(("verify", ""))
        return merged(plan, v)

    monkeypatch.setattr(eng, "_merged_prefill_step", merging)

    def appending(req, tok, *a, **kw):
        if not req.output_ids:  # a first token
            events.append(("first", req.req_id))
        return append(req, tok, *a, **kw)

    monkeypatch.setattr(eng, "_verify_forward", verifying)
    monkeypatch.setattr(eng, "_append", appending)
    ps, refs = _refs(2)
    got: dict[str, list[int]] = {}

    def step() -> None:
        for out in eng.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)

    with torch.inference_mode():
        first = eng.add_request(list(ps[0]), greedy(N_NEW))
        while not eng.seeds:  # the first request decodes in rounds
            step()
        second = eng.add_request(list(ps[1]), greedy(N_NEW))
        events.clear()
        step()  # the second's prompt (one chunk) and the first's round
        assert events == [("verify", ""), ("first", second)], events
        while eng.has_unfinished():
            step()
    assert [tuple(got[first]), tuple(got[second])] == [refs[0][:N_NEW], refs[1][:N_NEW]]
    assert_pages_free(eng)
