"""CUDA graphs replay the eager decode exactly, leave the caller's tensors alone, and greedy
generation is identical with and without graphs -- for graphs planned on the host (FlashInfer,
TANDEM_DEVICE_DECODE=0); graphs planned on the device (`DeviceDecodePlanner`, the default) run
tandem's paged-decode kernel where the eager engine runs FlashInfer's, so there greedy output
parts only at bf16 near-ties, and a replay equals the same kernels run eagerly."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

from tandem.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from near_ties import assert_parts_only_at_near_ties  # noqa: E402


def _engine(cuda_graphs: bool, max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16",
        cuda_graphs=cuda_graphs, max_num_seqs=max_num_seqs, max_model_len=1024,
        kv_cache_bytes=256 << 20,
    ))


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, vocab, (5 + 11 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=["device", "host"])
def engines(request):
    """(graphs planned on the device or on the host, eager)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_DEVICE_DECODE", "1" if request.param == "device" else "0")
        graphs = _engine(True)
    assert graphs.graphs.device_metadata == (request.param == "device")
    return graphs, _engine(False)


@pytest.mark.parametrize("num_prompts", [1, 4, 8])  # captured sizes: no padding difference
def test_greedy_identical_with_and_without_graphs(engines, num_prompts):
    with_graphs, eager = engines
    assert with_graphs.graphs is not None and eager.graphs is None
    prompts = _prompts(num_prompts, with_graphs.model_cfg.vocab_size)
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    a = [c.output_ids for c in with_graphs.generate(prompts, params)]
    b = [c.output_ids for c in eager.generate(prompts, params)]
    if with_graphs.graphs.device_metadata:  # another attention kernel: bf16 rounding differs
        assert_parts_only_at_near_ties(eager, prompts, a, b)
    else:
        assert a == b


def test_replay_equals_eager_and_keeps_inputs(engines):
    """Replay of a padded batch (3 rows in the graph of 4) gives the eager logits of the same
    padded batch bit for bit, and the batch's own tensors are unchanged."""
    eng, _ = engines
    from tandem.engine.attention import SeqSlice, build_metadata
    from tandem.engine.cuda_graphs import pad_decode_slices
    from tandem.engine.runner import ForwardBatch

    pages = eng.allocator.alloc(6)
    slices = [SeqSlice(page_ids=pages[2 * i : 2 * i + 2], num_cached=5 + 7 * i, num_new=1)
              for i in range(3)]
    layout = build_metadata(pad_decode_slices(slices, 4), eng.cfg.page_size, eng.device)
    ids = torch.tensor([11, 22, 33, 0], device=eng.device)
    batch = ForwardBatch(input_ids=ids, positions=layout.positions, attn=layout.attn,
                         logits_indices=torch.arange(3, device=eng.device))
    saved = [t.clone() for t in (batch.input_ids, batch.positions, batch.attn.slot_ids,
                                 batch.attn.kv_page_ids)]
    scratch_before = eng.kv_pool.layer("target", 0)[1:].clone()
    graph_logits = eng.graphs.run(batch)
    if eng.graphs.device_metadata:  # the same kernels, eagerly
        eager_logits = eng.graphs.eager(batch)
    else:  # the engine's own eager path: the same FlashInfer kernels
        eager_logits = eng.runner.forward(batch).logits
    assert torch.equal(graph_logits, eager_logits)
    for before, after in zip(saved, (batch.input_ids, batch.positions, batch.attn.slot_ids,
                                     batch.attn.kv_page_ids)):
        assert torch.equal(before, after)
    # only the three real slots (and the scratch page) changed in layer 0
    changed = (eng.kv_pool.layer("target", 0)[1:] != scratch_before).flatten(1).any(1)
    assert set((changed.nonzero().flatten() + 1).tolist()) <= set(pages)
    # The returned logits are the caller's: a later replay (other tokens) leaves them alone.
    other = ForwardBatch(input_ids=ids + 1, positions=batch.positions, attn=batch.attn,
                         logits_indices=batch.logits_indices)
    assert not torch.equal(eng.graphs.run(other), graph_logits)
    assert torch.equal(graph_logits, eager_logits)
    eng.allocator.free(pages)
