"""Chain verify and draft-extend with their metadata on the device (`SpecGraphRunner`
device_metadata, `device_decode.device_rows_plan`): each of a request's k+1 verify rows is a
decode query at num_cached + j over its page row, so no host planning sits between rounds. On the
CPU (the runner in eager mode, the device-decode kernel's torch twin) it computes what the
planned path computes: the same verify logits and features, the same extend, and plain greedy
decoding's tokens, with drafting ahead too."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import (
    assert_pages_free,
    engine_cfg,
    greedy,
    one_thread,  # noqa: F401 (autouse fixture)
    prompts,
    reference,
    tiny_head,
    tiny_target,
)
from test_spec_graph_padding import _attach_graphs, _running_input

from tandem.spec import SpecConfig, SpecEngine, propose
from tandem.spec.accept import launch_greedy_accept


@pytest.mark.parametrize("kind", ["eagle", "eagle-2layer", "eagle3"])
@pytest.mark.parametrize("steps", [4, 2, 1])
@pytest.mark.parametrize("bs", [1, 3])  # 3 runs padded in the bucket of 4
def test_device_metadata_rounds_equal_plain_greedy(bs, steps, kind, monkeypatch):
    model = tiny_target("llama")
    spec = SpecConfig(num_steps=steps)
    ps, params = prompts(bs, seed=60 + bs), greedy(20)
    want = [c.output_ids for c in reference(model, ps, params)]
    verified = {}
    for ahead in (True, False):
        eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, kind))
        _attach_graphs(eng, monkeypatch, device_metadata=True)
        assert eng.spec_graphs.device_metadata and eng.spec_graphs._verify_planner is None
        eng.set_draft_ahead(ahead)
        seen = verified[ahead] = []
        orig = eng._verify_forward
        monkeypatch.setattr(eng, "_verify_forward",
                            lambda v, orig=orig, seen=seen: seen.append(v.tokens) or orig(v))
        assert [c.output_ids for c in eng.generate(ps, params)] == want
        if kind != "eagle3":  # (the tiny EAGLE-3 head accepts nothing on these prompts)
            assert eng.spec_stats.num_tokens > eng.spec_stats.num_rounds  # drafts accepted
        assert (eng.draft_ahead.used > 0) == (ahead and steps > 1)
        assert_pages_free(eng)
    assert all(torch.equal(a, b) for a, b in zip(verified[True], verified[False]))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("bs", [1, 3])
def test_device_metadata_verify_and_extend_equal_the_planned_ones(bs, kind, monkeypatch):
    """The same round input through both runners: verify logits and features, then the
    extend's hidden, top-k and the draft KV it leaves, agree to float32 rounding."""
    model = tiny_target("llama", live=None)
    spec = SpecConfig(num_steps=4)
    eng = SpecEngine(engine_cfg(), spec, model, tiny_head(model, kind, live=None))
    device = _attach_graphs(eng, monkeypatch, device_metadata=True)
    planned = _attach_graphs(eng, monkeypatch, device_metadata=False)
    inp = _running_input(eng, bs)
    verify = propose(eng.draft, inp, spec)
    out = planned.verify(verify)
    logits, hidden = out.logits.clone(), out.hidden.clone()
    dout = device.verify(verify)
    torch.testing.assert_close(dout.logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dout.hidden, hidden, rtol=1e-5, atol=1e-5)
    pending = launch_greedy_accept(verify, logits, ())
    feats = eng.head.target_features(hidden, tuple(a.clone() for a in out.aux_hidden))
    exts = []
    for graphs in (planned, device):
        if graphs is device:
            device.buf.ver_table.zero_()  # extend alone: it loads the verify's table itself
            device.buf.ver_base.zero_()
            device._ver_loaded = None
        ext = graphs.extend(verify, pending.num_accepted, pending.path, pending.bonus, feats)
        exts.append((ext.hidden.clone(), ext.topk_ids.clone(), ext.topk_logp.clone(),
                     eng.kv_pool.layer("draft", 0).clone()))
    (peh, pid, plp, pkv), (deh, did, dlp, dkv) = exts
    assert torch.equal(did, pid)
    torch.testing.assert_close(deh, peh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dlp, plp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dkv, pkv, rtol=1e-5, atol=1e-5)
