"""Tree drafting in CUDA graphs on the GPU (spec/tree_graphs.py): a SpecEngine with a tree
config captures it; a replay equals the same body run eagerly on the same padded inputs, bit
for bit; the tree it proposes is well formed (parents before children, depths = parent + 1)
and matches the eager host-side tree wherever the draft's scores are not near-tied; a request's
own pages are never written while drafting.

    python -m pytest -q tests/gpu/test_tree_graphs_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from test_spec_graphs import _abort, _cfg, _input  # noqa: E402

from tandem.engine.loader import DTYPES, build_model, resolve_model  # noqa: E402
from tandem.engine.parallel import ParallelContext  # noqa: E402
from tandem.spec import DraftHeadConfig, SpecConfig, SpecEngine, dummy_head, propose  # noqa: E402
from tandem.spec.draft_runner import DRAFT_GROUP  # noqa: E402

TREE = SpecConfig(num_steps=4, topk=3, num_draft_tokens=10)


@pytest.fixture(scope="module")
def engine():
    cfg = _cfg(True)
    model_cfg, path = resolve_model(cfg)
    model = build_model(model_cfg, path, cfg, ParallelContext(), 1024)
    head = dummy_head(DraftHeadConfig.like_target(model_cfg), model, DTYPES["bfloat16"],
                      torch.device("cuda"), 1024)
    eng = SpecEngine(cfg, TREE, model, head)
    assert eng.tree_graphs is not None and eng.spec_graphs is not None
    return eng


def _well_formed(parents, depths) -> None:
    for par, dep in zip(parents, depths):
        assert par[0] == -1 and dep[0] == 0
        for j in range(1, len(par)):
            assert 0 <= par[j] < j and dep[j] == dep[par[j]] + 1


@pytest.mark.parametrize("bs", [1, 3, 4])  # 3 runs in the graph of 4
def test_tree_replay_equals_its_body_run_eagerly(engine, bs):
    eng, tree = engine, engine.tree_graphs
    ids, inp = _input(eng, bs, seed=70 + bs)
    rows = tree.bucket(bs)
    pages = sorted({p for ps in inp.page_ids for p in ps})
    idx = torch.tensor(pages, device="cuda")
    before = [eng.kv_pool.layer(DRAFT_GROUP, i)[idx].clone()
              for i in range(eng.head.cfg.num_layers)]
    got = tree.propose(inp)  # the graph; buffers now hold this round's padded inputs
    for i, b in enumerate(before):
        assert torch.equal(eng.kv_pool.layer(DRAFT_GROUP, i)[idx], b), "a request page written"
    _well_formed(got.parents, got.depths)
    outs = [t[:rows].clone() for t in (tree._out_tokens, tree._out_parents, tree._out_depths)]
    tree._body(rows)  # eagerly, same inputs
    torch.cuda.synchronize()
    for a, t in zip(outs, (tree._out_tokens, tree._out_parents, tree._out_depths)):
        assert torch.equal(a, t[:rows])
    want = propose(eng.draft, inp, eng.spec)  # the eager host-side tree (FlashInfer + mask)
    assert torch.equal(got.tokens[:, :1 + TREE.topk], want.tokens[:, :1 + TREE.topk])
    _abort(eng, ids)


def test_float32_tree_graphs_are_lossless():
    """float32 on the GPU (FlashInfer has no float32 kernels: the torch attention backend, the
    verify and extend runners in eager mode over it), tree drafting through real CUDA graphs of
    `TreeDraftGraphs` (the Triton device-metadata decode kernel in float32): greedy speculative
    == plain, token for token."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_spec_graph_padding import _FakePlanner

    from tandem.engine import EngineConfig, LLMEngine, SamplingParams
    from tandem.spec.cuda_graphs import SpecGraphRunner
    from tandem.spec.tree_graphs import TreeDraftGraphs, lanes_needed

    cfg = EngineConfig(model="smollm2-135m", load_format="dummy", device="cuda",
                       dtype="float32", attention_backend="torch", cuda_graphs=False,
                       max_num_seqs=8, max_model_len=512, kv_cache_bytes=256 << 20)
    model_cfg, path = resolve_model(cfg)
    model = build_model(model_cfg, path, cfg, ParallelContext(), 512)
    head = dummy_head(DraftHeadConfig.like_target(model_cfg), model, torch.float32,
                      torch.device("cuda"), 512)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 49152, (6 + 17 * i,), generator=g).tolist() for i in range(3)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    want = [c.output_ids for c in LLMEngine(cfg, model).generate(prompts, params)]
    eng = SpecEngine(cfg, TREE, model, head)
    backend = eng.runner.backend
    backend.graph_decode_planner = lambda bs, pages: _FakePlanner(backend, True)
    backend.graph_prefill_planner = (lambda bs, n, pages, kv, custom_mask:
                                     _FakePlanner(backend, False, n, custom_mask))
    sizes = (1, 2, 4)
    runner = SpecGraphRunner(eng.runner, eng.draft, TREE, sizes,
                             max_kv_len=eng.max_model_len + TREE.slots_per_round,
                             capture_layers=eng.capture)
    runner.capture(eager=True)
    eng.spec_graphs = runner
    lanes = eng.allocator.alloc(lanes_needed(TREE, cfg.page_size, sizes))
    eng.tree_graphs = TreeDraftGraphs(eng.draft, TREE, sizes,
                                      max_kv_len=eng.max_model_len + TREE.slots_per_round,
                                      lane_pages=lanes)
    eng.tree_graphs.capture()  # real CUDA graphs
    got = [c.output_ids for c in eng.generate(prompts, params)]
    assert got == want
    eng.allocator.free(lanes)
    assert eng.allocator.num_free == eng.allocator.num_usable
