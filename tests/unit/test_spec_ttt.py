"""The training-time-test forward computes exactly what inference computes: step 0 equals the
draft over true features, and step s at position t equals the s-th chained draft step that
continues from the head's own hidden (same keys, same positions)."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import save_tiny
from tandem.engine import EngineConfig, LLMEngine, SeqSlice, build_metadata
from tandem.spec import DraftHeadConfig, DraftRunner, draft_kv_group, dummy_head, target_features
from tandem.spec.ttt import ttt_forward


@pytest.mark.parametrize("kind, layers", [("eagle", 1), ("eagle3", 1), ("eagle", 2)],
                         ids=["eagle", "eagle3", "eagle-2layer"])
def test_ttt_matches_chained_inference(tmp_path, kind, layers):
    path, _ = save_tiny("llama", tmp_path)
    base = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", num_pages=4))
    model = base.model
    head = dummy_head(DraftHeadConfig.like_target(model.cfg, kind, num_layers=layers), model,
                      torch.float32, torch.device("cpu"), 512, seed=3)
    eng = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_pages=64, page_size=4),
                    model, extra_kv_groups=[draft_kv_group(head)])
    draft = DraftRunner(head, eng.kv_pool, eng.runner.backend, eng.max_model_len)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 256, (14,), generator=g)
    # Target features of the sequence.
    from tandem.engine import ForwardBatch

    pages = eng.allocator.alloc(8)
    lay = build_metadata([SeqSlice(page_ids=pages, num_cached=0, num_new=14)], 4)
    out = eng.runner.forward(ForwardBatch(input_ids=seq, positions=lay.positions, attn=lay.attn,
                                          logits_indices=torch.tensor([0]),
                                          capture_layers=head.cfg.feature_layers))
    feats = target_features(out, head)  # [14, F]
    tokens = seq[1:]  # x_{t+1} for draft position t, t = 0..12
    steps = 3
    with torch.no_grad():
        outs = ttt_forward(head, tokens[None], feats[:13][None], steps)
    t = 9  # check position t of every step
    for s in range(steps):
        # Inference: true-feature pairs for positions < t - s, then s chained steps.
        p0 = t - s
        lay = build_metadata([SeqSlice(page_ids=pages, num_cached=0, num_new=p0 + 1)], 4)
        h = draft.forward(tokens[: p0 + 1], feats[: p0 + 1], lay)[-1:]
        for j in range(1, s + 1):
            lay = build_metadata([SeqSlice(page_ids=pages, num_cached=p0 + j, num_new=1)], 4)
            h = draft.forward(tokens[p0 + j : p0 + j + 1], h, lay)
        torch.testing.assert_close(outs[s][0, t], h[0], atol=1e-5, rtol=1e-5,
                                   msg=f"step {s}")


def test_ttt_loss_soft_labels_and_feature_term(tmp_path):
    """Soft labels: a target sure of one token gives the hard-label loss; a spread target
    gives a different one (the loss reads the whole distribution). The feature term adds
    weight x smooth-L1 per step, and vanishes when the hidden equals the next feature."""
    from tandem.spec.ttt import ttt_loss

    path, _ = save_tiny("llama", tmp_path)
    eng = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", num_pages=4))
    model = eng.model
    head = dummy_head(DraftHeadConfig.like_target(model.cfg, "eagle"), model, torch.float32,
                      torch.device("cpu"), 64, seed=1)
    g = torch.Generator().manual_seed(0)
    b, t, v, h = 2, 7, model.cfg.vocab_size, model.cfg.hidden_size
    outs = [torch.randn(b, t, h, generator=g) for _ in range(3)]
    labels = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 5:] = False
    with torch.no_grad():
        hard, acc = ttt_loss(head, outs, labels, mask, None)
        sure = torch.full((int(mask.sum()), v), -1e4).scatter(1, labels[mask][:, None], 0.0)
        sure = torch.log_softmax(sure, -1)
        soft, acc_soft = ttt_loss(head, outs, labels, mask, None, target_logp=sure)
        torch.testing.assert_close(soft, hard)
        assert acc == acc_soft
        spread = torch.log_softmax(torch.randn(int(mask.sum()), v, generator=g), -1)
        other, _ = ttt_loss(head, outs, labels, mask, None, target_logp=spread)
        assert (other - hard).abs() > 1e-3
        nxt = torch.randn(b, t, h, generator=g)
        with_feat, _ = ttt_loss(head, outs, labels, mask, None, next_hidden=nxt,
                                feature_weight=0.5)
        expect = hard + sum(0.5 * 0.8**s * torch.nn.functional.smooth_l1_loss(
            outs[s][mask & (torch.arange(t) >= s)], nxt[mask & (torch.arange(t) >= s)])
            for s in range(3))
        torch.testing.assert_close(with_feat, expect)
        same = [nxt.clone() for _ in range(3)]
        base, _ = ttt_loss(head, same, labels, mask, None)
        zero_feat, _ = ttt_loss(head, same, labels, mask, None, next_hidden=nxt,
                                feature_weight=2.0)
        torch.testing.assert_close(zero_feat, base)


def test_a_grown_head_starts_out_computing_what_the_smaller_one_did(tmp_path):
    """--num-layers with --init-head of a one-layer head: the new layer copies the last one
    with o_proj and down_proj zeroed, so the two-layer head's hidden equals the one-layer
    head's (and training can move the new layer off zero: its outputs get gradients)."""
    from tandem.spec.head import EagleHead
    from tandem.spec.train import export_head, grow_layers, start_from, trainable

    path, _ = save_tiny("llama", tmp_path)
    eng = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", num_pages=4))
    model = eng.model
    one = dummy_head(DraftHeadConfig.like_target(model.cfg, "eagle"), model, torch.float32,
                     torch.device("cpu"), 512, seed=3)
    export_head(one, tmp_path / "one", {})
    two = EagleHead(DraftHeadConfig.like_target(model.cfg, "eagle", num_layers=2), model,
                    torch.float32, 512)
    start_from(two, tmp_path / "one")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, 9), generator=g)
    feats = torch.randn(1, 9, model.cfg.hidden_size, generator=g)
    b = ttt_forward(two, tokens, feats, 2)
    # The export is bf16: compare with the one-layer head loaded back from it.
    one_saved = EagleHead(DraftHeadConfig.like_target(model.cfg, "eagle"), model,
                          torch.float32, 512)
    start_from(one_saved, tmp_path / "one")
    for x, y in zip(ttt_forward(one_saved, tokens, feats, 2), b):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert two.later[0].attn.o_proj.weight.abs().max() == 0
    params = trainable(two)
    sum(o.sum() for o in ttt_forward(two, tokens, feats, 2)).backward()
    assert two.later[0].attn.o_proj.weight.grad.abs().max() > 0
    assert two.later[0].mlp.down.weight.grad.abs().max() > 0
    assert len(params) > len(trainable(one_saved))
    with pytest.raises(ValueError, match="more than the 1 trained"):
        grow_layers(two.state_for_saving(), 1, "two-layer head")


def test_spec_stats_tau_and_its_standard_error():
    """SpecStats from recorded rounds: tau, P(draft j accepted), and the standard error of tau
    (rounds as independent samples) equal those computed from the raw accepted counts."""
    import statistics

    from tandem.spec.engine import SpecStats

    accepted = [0, 4, 2, 2, 1, 0, 3, 0, 4, 1, 2]
    st = SpecStats()
    for a in accepted:
        st.record(a, 4)
    lengths = [a + 1 for a in accepted]
    assert st.mean_acceptance_length == pytest.approx(statistics.mean(lengths))
    assert st.per_position() == pytest.approx(
        [sum(a >= j for a in accepted) / len(accepted) for j in range(1, 5)])
    want = statistics.stdev(lengths) / len(lengths) ** 0.5
    assert st.tau_stderr() == pytest.approx(want)
    assert SpecStats().tau_stderr() == 0.0
