"""The EAGLE head sharded over TP (spec/head.py `draft_tp`): on 2 gloo ranks in float32, each
rank holds half the head's attention heads, MLP and draft vocabulary, and the head proposes
what the head of one rank proposes -- the same top-1 ids, log-probabilities and logits, top-k
for trees -- so the speculative engine emits the same tokens and accepts the same drafts. Its
draft KV pages hold the target's head slice (the hand-off re-slices them alike)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from hf_tiny import save_tiny
from rank_helpers import run_ranks

from tandem.engine import EngineConfig, SamplingParams
from tandem.engine.loader import build_model, resolve_model
from tandem.engine.parallel import ParallelContext
from tandem.spec import DraftHeadConfig, SpecConfig, SpecEngine, dummy_head

pytestmark = pytest.mark.timeout(300)

# (head kind, draft vocabulary or None for the whole one, layers)
HEADS = {"eagle": ("eagle", None, 1), "eagle-dv64": ("eagle", 64, 1),
         "eagle3-dv64": ("eagle3", 64, 1), "eagle-2layer": ("eagle", None, 2)}


def _dirs(root) -> dict:
    from safetensors.torch import save_file

    model_dir, _ = save_tiny("llama", root)
    ecfg = EngineConfig(model=str(model_dir), dtype="float32")
    mcfg, path = resolve_model(ecfg)
    model = build_model(mcfg, path, ecfg, ParallelContext(), 512)
    out = {"model": model_dir}
    for name, (kind, dv, layers) in HEADS.items():
        cfg = DraftHeadConfig.like_target(mcfg, kind, draft_vocab_size=dv, num_layers=layers)
        head = dummy_head(cfg, model, torch.float32, torch.device("cpu"), 512, seed=3)
        if head.subset_vocab or kind == "eagle3":  # a draft vocabulary of scattered ids
            head.d2t.copy_(torch.arange(64) * 3 + 1 - torch.arange(64))
        state = head.state_for_saving()
        d = root / name
        d.mkdir()
        save_file(state, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg.to_json()))
        out[name] = d
    return out


def _generate(eng: SpecEngine, prompts, params) -> tuple[list, list]:
    """(outputs, the drafts of every round: the verify forward's tokens)."""
    drafts, verify = [], eng._verify_forward

    def spy(v):
        drafts.append(v.tokens.clone())
        return verify(v)

    eng._verify_forward = spy  # type: ignore[method-assign]
    try:
        return [c.output_ids for c in eng.generate(prompts, params)], drafts
    finally:
        del eng._verify_forward  # the class's again


def _probe(dirs: dict, par=None) -> dict:
    from tandem.engine import kernels

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(5, 64, generator=g)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13, 9)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    res = {}
    for name in HEADS:
        spec = SpecConfig(draft_model=str(dirs[name]), num_steps=3)
        eng = SpecEngine.from_config(EngineConfig(model=str(dirs["model"]), dtype="float32",
                                                  num_pages=96, page_size=4), spec, par)
        head = eng.head
        ids1, logp1 = head.topk(hidden, 1)
        ids3, logp3 = head.topk(hidden, 3)
        from tandem.worker.config import aux_buffer, kv_layout

        draft = next(r for r in kv_layout(eng, aux_buffer(eng, 2)).regions if r.name == "draft")
        res[name] = {
            "tp": head.tp.size, "kv_heads": head.kv_heads,
            "region": (draft.head_start, draft.num_heads),
            "ids1": ids1, "logp1": logp1, "ids3": ids3, "logp3": logp3,
            "logits": head.logits(hidden), "top1": head.top1(hidden),
        }
        res[name]["tokens"], res[name]["drafts"] = _generate(eng, prompts, params)
        # Every layer of at most 8 rows through the fused path (the torch twins here): under TP
        # rank 0's row-parallel GEMVs add the residual before the all-reduce, as on the GPU.
        layered = kernels.decode_fusion_ok
        kernels.decode_fusion_ok = lambda x: x.is_contiguous() and 1 <= x.shape[0] <= 8
        try:
            res[name]["fused"] = _generate(eng, prompts, params)
        finally:
            kernels.decode_fusion_ok = layered
    return res


def _rank(rank: int, port: int, dirs, out) -> None:
    from tandem.worker.ranks import RankInfo, join_group, leave_group

    torch.set_num_threads(1)
    par, _ = join_group(RankInfo(rank=rank, tp=2), "127.0.0.1", port, "cpu")
    # Pickled here: tensors through the queue itself would pass file descriptors that close
    # with this process.
    out.put((rank, pickle.dumps(_probe(dirs, par))))
    leave_group()


def test_a_sharded_head_proposes_what_one_rank_proposes(tmp_path):
    torch.set_num_threads(1)
    dirs = _dirs(tmp_path)
    want = _probe(dirs)
    items, codes = run_ranks(_rank, 2, dirs, timeout_s=250)
    assert codes == [0, 0]
    for rank, blob in items:
        got = pickle.loads(blob)
        for name in HEADS:
            w, g = want[name], got[name]
            assert w["tp"] == 1 and g["tp"] == 2, name  # every kind shards here
            assert g["kv_heads"] == (rank, 1) == g["region"], name  # 2 KV heads over 2 ranks
            assert w["kv_heads"] == (0, 2) == w["region"]
            for key in ("ids1", "ids3", "top1"):
                assert torch.equal(g[key], w[key]), (name, key)
            for key in ("logp1", "logp3", "logits"):
                torch.testing.assert_close(g[key], w[key], rtol=1e-5, atol=1e-5)
            assert g["tokens"] == w["tokens"] == w["fused"][0] == g["fused"][0], name
            for drafts in (g["drafts"], w["fused"][1], g["fused"][1]):  # the same drafts
                assert len(drafts) == len(w["drafts"]) and all(
                    torch.equal(a, b) for a, b in zip(drafts, w["drafts"])), name


def test_a_head_that_cannot_split_stays_replicated(monkeypatch):
    """A head whose KV heads differ from the target's (the hand-off could not re-slice them
    alike), or TANDEM_SHARD_DRAFT=0: one rank's head on every rank."""
    from tandem.spec.head import draft_tp

    ecfg = EngineConfig(model="smollm2-135m", load_format="dummy", dtype="float32")
    mcfg, _ = resolve_model(ecfg)

    from types import SimpleNamespace

    from tandem.engine.parallel import ParallelGroup

    # what draft_tp reads of a target: its config and its TP group (3 ranks, none joined)
    target = SimpleNamespace(cfg=mcfg, par=SimpleNamespace(tp=ParallelGroup(rank=0, size=3)))
    like = DraftHeadConfig.like_target(mcfg)
    assert draft_tp(like, target).size == 3  # 9 heads, 3 KV heads, 1536 over 3 ranks
    import dataclasses

    assert draft_tp(dataclasses.replace(like, num_kv_heads=1), target).size == 1
    assert draft_tp(dataclasses.replace(like, intermediate_size=1537), target).size == 1
    monkeypatch.setenv("TANDEM_SHARD_DRAFT", "0")
    assert draft_tp(like, target).size == 1
