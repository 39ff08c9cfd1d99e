"""Training the draft head with the Triton kernels on: every trainable weight gets a gradient.

The Triton kernels have no backward. On the GPU the head's training forward used to take them
(rope, RMSNorm, SiLU-and-mul), which cut q/k and the norm weights off the autograd graph:
three sessions of GPU-trained heads kept q_proj, k_proj and the post-attention norm at their
initial values. Here the kernels run on the CPU through TRITON_INTERPRET=1, with the dispatch
told the tensors are on a Triton device, as on the GPU. Skipped when triton is missing."""

from __future__ import annotations

import pytest
import torch
from triton_interp import require_triton_interpreter

require_triton_interpreter()  # before triton is first imported

from hf_tiny import save_tiny

from tandem.engine import EngineConfig, LLMEngine
from tandem.engine.kernels import ops
from tandem.spec import DraftHeadConfig, dummy_head
from tandem.spec.train import check_all_in_graph, trainable
from tandem.spec.ttt import ttt_forward, ttt_loss


def _head_and_backward(tmp_path, kind: str):
    """A tiny target's dummy head of `kind`, one TTT forward + loss + backward; returns
    (head, its trainable weights)."""
    path, _ = save_tiny("llama", tmp_path)
    eng = LLMEngine.from_config(EngineConfig(model=str(path), dtype="float32", num_pages=4))
    model = eng.model
    cfg = DraftHeadConfig.like_target(model.cfg, kind)
    head = dummy_head(cfg, model, torch.float32, torch.device("cpu"), 64, seed=2)
    g = torch.Generator().manual_seed(0)
    b, t = 2, 9
    tokens = torch.randint(0, model.cfg.vocab_size, (b, t), generator=g)
    feats = torch.randn(b, t, cfg.feature_size, generator=g)
    labels = torch.randint(0, model.cfg.vocab_size, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    weights = trainable(head)
    t2d = None
    if kind == "eagle3":  # draft vocabulary = the first draft_vocab_size ids
        t2d = torch.full((model.cfg.vocab_size,), -1, dtype=torch.int64)
        t2d[: cfg.draft_vocab_size] = torch.arange(cfg.draft_vocab_size)
        labels = labels % cfg.draft_vocab_size
    loss, _ = ttt_loss(head, ttt_forward(head, tokens, feats, 3), labels, mask, t2d)
    loss.backward()
    return head, weights


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_every_head_weight_learns_with_the_triton_kernels_on(tmp_path, monkeypatch, kind):
    monkeypatch.setattr(ops, "_on_triton_device", lambda x: True)
    x = torch.randn(3, 64)
    with torch.inference_mode():  # the seam works: inference takes the Triton kernels here
        assert ops._triton_for(x) is not None
    assert ops._triton_for(x) is None  # ... and training the twins
    head, weights = _head_and_backward(tmp_path, kind)
    names = {id(p): n for n, p in head.named_parameters()}
    for p in weights:
        assert p.grad is not None and p.grad.abs().max() > 0, f"{names[id(p)]} got no gradient"
    check_all_in_graph(head, weights)  # what train-eagle checks after every backward


def test_train_eagle_refuses_a_weight_cut_off_the_graph(tmp_path, monkeypatch):
    """The old dispatch (Triton kernels while autograd records) is caught by train-eagle's
    check after the backward, which names the weight."""
    from tandem.engine.kernels import triton_ops

    monkeypatch.setattr(ops, "_triton_for", lambda x: triton_ops)
    head, weights = _head_and_backward(tmp_path, "eagle")
    with pytest.raises(RuntimeError, match="post_attn_norm.weight"):
        check_all_in_graph(head, weights)
