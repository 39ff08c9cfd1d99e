"""The draft-head checkpoint loader on synthetic checkpoints with the public key layouts:

- EAGLE-1/2: `fc.weight` [H, 2H], `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj.weight`,
  `layers.0.mlp.{gate,up,down}_proj.weight`, `layers.0.post_attention_layernorm.weight`,
  optional `embed_tokens.weight`; config.json LlamaForCausalLM-like, num_hidden_layers 1.
- EAGLE-3: `fc.weight` [H, 3H], `midlayer.{input_layernorm,hidden_norm,
  post_attention_layernorm}.weight`, `midlayer.self_attn.q_proj.weight` [Hq*D, 2H] (k, v too),
  `midlayer.mlp.*`, `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` [draft_vocab]
  int64, `t2d` [vocab] bool; config with draft_vocab_size.

Each loaded head's forward (through the paged KV cache, in two chunks) must equal a plain
torch implementation of the architecture written here from the state dict alone, and errors
must name what is wrong."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from spec_helpers import VOCAB, one_thread, tiny_target  # noqa: F401 (autouse fixture)

from tandem.engine import KVPool, SeqSlice, build_metadata, create_backend
from tandem.spec import DraftHeadError, DraftRunner, draft_kv_group, load_head

H = 64  # the tiny target's hidden size
DRAFT_VOCAB = 32
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", live=None)


def _rand(gen, *shape, norm=False):
    t = torch.randn(*shape, generator=gen) * 0.1
    return 1.0 + t if norm else t


def eagle_checkpoint(seed=0, with_embed=False, num_layers=1):
    """(config.json dict, state dict) of an EAGLE-1/2 head: 2 heads x 32, 1 KV head;
    num_layers > 1 adds EAGLE's `layers.{i}` (with an input_layernorm, which layer 0 lacks)."""
    gen = torch.Generator().manual_seed(seed)
    nh, nkv, hd, inter = 2, 1, 32, 96
    sd = {"fc.weight": _rand(gen, H, 2 * H), "fc.bias": _rand(gen, H)}
    for i in range(num_layers):
        p = f"layers.{i}"
        if i:
            sd[f"{p}.input_layernorm.weight"] = _rand(gen, H, norm=True)
        sd.update({
            f"{p}.self_attn.q_proj.weight": _rand(gen, nh * hd, H),
            f"{p}.self_attn.k_proj.weight": _rand(gen, nkv * hd, H),
            f"{p}.self_attn.v_proj.weight": _rand(gen, nkv * hd, H),
            f"{p}.self_attn.o_proj.weight": _rand(gen, H, nh * hd),
            f"{p}.mlp.gate_proj.weight": _rand(gen, inter, H),
            f"{p}.mlp.up_proj.weight": _rand(gen, inter, H),
            f"{p}.mlp.down_proj.weight": _rand(gen, H, inter),
            f"{p}.post_attention_layernorm.weight": _rand(gen, H, norm=True),
        })
    if with_embed:
        sd["embed_tokens.weight"] = _rand(gen, VOCAB, H)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "intermediate_size": inter,
           "num_hidden_layers": num_layers, "rms_norm_eps": 1e-5, "rope_theta": 5000.0,
           "vocab_size": VOCAB, "max_position_embeddings": 512, "hidden_act": "silu",
           "bias": True, "torch_dtype": "float32"}
    return cfg, sd


def eagle3_checkpoint(seed=1, with_embed=False):
    """(config.json, state dict) of an EAGLE-3 head: 4 heads x 16, 2 KV heads, a 32-token
    draft vocabulary, features from target layers 0, 2, 3."""
    gen = torch.Generator().manual_seed(seed)
    nh, nkv, hd, inter = 4, 2, 16, 80
    p = "midlayer"
    targets = torch.randperm(VOCAB, generator=gen)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    sd = {
        "fc.weight": _rand(gen, H, 3 * H),
        f"{p}.input_layernorm.weight": _rand(gen, H, norm=True),
        f"{p}.hidden_norm.weight": _rand(gen, H, norm=True),
        f"{p}.post_attention_layernorm.weight": _rand(gen, H, norm=True),
        f"{p}.self_attn.q_proj.weight": _rand(gen, nh * hd, 2 * H),
        f"{p}.self_attn.k_proj.weight": _rand(gen, nkv * hd, 2 * H),
        f"{p}.self_attn.v_proj.weight": _rand(gen, nkv * hd, 2 * H),
        f"{p}.self_attn.o_proj.weight": _rand(gen, H, nh * hd),
        f"{p}.mlp.gate_proj.weight": _rand(gen, inter, H),
        f"{p}.mlp.up_proj.weight": _rand(gen, inter, H),
        f"{p}.mlp.down_proj.weight": _rand(gen, H, inter),
        "norm.weight": _rand(gen, H, norm=True),
        "lm_head.weight": _rand(gen, DRAFT_VOCAB, H),
        "d2t": targets - torch.arange(DRAFT_VOCAB),  # target id = draft id + d2t[draft id]
        "t2d": t2d,
    }
    if with_embed:
        sd["embed_tokens.weight"] = _rand(gen, VOCAB, H)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "intermediate_size": inter, "num_hidden_layers": 1, "rms_norm_eps": 1e-6,
           "rope_theta": 20000.0, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
           "max_position_embeddings": 512, "hidden_act": "silu", "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}}
    return cfg, sd


def write(tmp_path, cfg, sd, fmt):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    else:
        torch.save(sd, tmp_path / "pytorch_model.bin")
    return tmp_path


def load(path, target):
    return load_head(path, target, torch.float32, CPU, 512)


# ---- the reference: the architecture, written from the state dict --------------------------


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # x [T, heads, D], rotate-half layout
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _attention(x, sd, p, cfg, pos):
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    t = x.shape[0]
    q = (x @ sd[f"{p}.self_attn.q_proj.weight"].T).view(t, nh, hd)
    k = (x @ sd[f"{p}.self_attn.k_proj.weight"].T).view(t, nkv, hd)
    v = (x @ sd[f"{p}.self_attn.v_proj.weight"].T).view(t, nkv, hd)
    q, k = _rope(q, pos, cfg["rope_theta"]), _rope(k, pos, cfg["rope_theta"])
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, nh * hd)
    return out @ sd[f"{p}.self_attn.o_proj.weight"].T


def _mlp(x, sd, p):
    g, u = x @ sd[f"{p}.mlp.gate_proj.weight"].T, x @ sd[f"{p}.mlp.up_proj.weight"].T
    return (F.silu(g) * u) @ sd[f"{p}.mlp.down_proj.weight"].T


def ref_eagle(sd, cfg, target, tokens, feats, pos):
    """EAGLE-1/2: x = fc([embed(token), feature]) (+bias); layer without input norm; the
    target's lm_head on the output. Returns (hidden, logits)."""
    emb = F.embedding(tokens, sd.get("embed_tokens.weight", target.embed.weight))
    x = torch.cat([emb, feats], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    h = x + _attention(x, sd, "layers.0", cfg, pos)
    eps = cfg["rms_norm_eps"]
    out = h + _mlp(_rms(h, sd["layers.0.post_attention_layernorm.weight"], eps), sd, "layers.0")
    for i in range(1, cfg["num_hidden_layers"]):  # later layers: pre-norm decoder layers
        p = f"layers.{i}"
        h = out + _attention(_rms(out, sd[f"{p}.input_layernorm.weight"], eps), sd, p, cfg, pos)
        out = h + _mlp(_rms(h, sd[f"{p}.post_attention_layernorm.weight"], eps), sd, p)
    return out, out @ target.lm_head.weight.T


def ref_eagle3(sd, cfg, target, tokens, feats, pos):
    """EAGLE-3: f = fc(low|mid|high) (no bias) unless already H wide; attention over
    [input_norm(embed), hidden_norm(f)]; residual f; final norm + own lm_head (draft vocab)."""
    eps, p = cfg["rms_norm_eps"], "midlayer"
    emb = F.embedding(tokens, sd.get("embed_tokens.weight", target.embed.weight))
    f = feats @ sd["fc.weight"].T if feats.shape[-1] == 3 * H else feats
    x = torch.cat([_rms(emb, sd[f"{p}.input_layernorm.weight"], eps),
                   _rms(f, sd[f"{p}.hidden_norm.weight"], eps)], -1)
    h = f + _attention(x, sd, p, cfg, pos)
    out = h + _mlp(_rms(h, sd[f"{p}.post_attention_layernorm.weight"], eps), sd, p)
    return out, _rms(out, sd["norm.weight"], eps) @ sd["lm_head.weight"].T


def run_head(head, tokens, feats, split):
    """The head over one sequence through the paged KV cache: tokens [:split] as a prefill
    chunk, the rest as a second chunk attending to the first."""
    pool = KVPool([draft_kv_group(head)], 16, 4, torch.float32, CPU)
    runner = DraftRunner(head, pool, create_backend("torch", CPU), max_kv_len=64)
    pages = [3, 7, 1, 12, 5, 9]
    outs = []
    for start, end in ((0, split), (split, len(tokens))):
        lay = build_metadata([SeqSlice(page_ids=pages, num_cached=start, num_new=end - start)], 4)
        outs.append(runner.forward(tokens[start:end], feats[start:end], lay))
    return torch.cat(outs)


# ---- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_layers", [1, 3], ids=["1-layer", "3-layer"])
@pytest.mark.parametrize("with_embed", [False, True], ids=["shared-embed", "own-embed"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle_head_matches_reference(tmp_path, target, fmt, with_embed, num_layers):
    cfg, sd = eagle_checkpoint(with_embed=with_embed, num_layers=num_layers)
    head = load(write(tmp_path, cfg, sd, fmt), target)
    assert head.cfg.kind == "eagle" and head.cfg.fc_bias and head.cfg.head_dim == 32
    assert head.cfg.num_layers == num_layers and draft_kv_group(head).num_layers == num_layers
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen)
    feats = torch.randn(11, H, generator=gen)
    pos = torch.arange(11)
    got = run_head(head, tokens, feats, split=7)
    want, want_logits = ref_eagle(sd, cfg, target, tokens, feats, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head.log_probs(got), want_logits.log_softmax(-1),
                               atol=1e-5, rtol=1e-5)
    ids, _ = head.topk(got, 3)
    assert torch.equal(ids, want_logits.topk(3).indices)


@pytest.mark.parametrize("with_embed", [False, True], ids=["shared-embed", "own-embed"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_eagle3_head_matches_reference(tmp_path, target, fmt, with_embed):
    cfg, sd = eagle3_checkpoint(with_embed=with_embed)
    head = load(write(tmp_path, cfg, sd, fmt), target)
    c = head.cfg
    assert (c.kind, c.feature_layers, c.draft_vocab_size, c.fc_bias) == (
        "eagle3", (0, 2, 3), DRAFT_VOCAB, False)
    gen = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, VOCAB, (10,), generator=gen)
    for width in (3 * H, H):  # fused target features (draft prefill/extend), own hidden (steps)
        feats = torch.randn(10, width, generator=gen)
        got = run_head(head, tokens, feats, split=4)
        want, want_logits = ref_eagle3(sd, cfg, target, tokens, feats, torch.arange(10))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(head.log_probs(got), want_logits.log_softmax(-1),
                                   atol=1e-5, rtol=1e-5)
        # top-k returns TARGET ids: draft id + d2t[draft id]
        ids, _ = head.topk(got, 4)
        draft_ids = want_logits.topk(4).indices
        assert torch.equal(ids, draft_ids + sd["d2t"][draft_ids])
        assert bool(sd["t2d"][ids].all())  # every proposal is in the draft vocabulary
        assert ids.max() < VOCAB and not torch.equal(ids, draft_ids)


@pytest.mark.parametrize("kind", ["eagle3", "eagle-2layer"])
def test_saved_head_round_trips(tmp_path, target, kind):
    cfg, sd = eagle3_checkpoint() if kind == "eagle3" else eagle_checkpoint(num_layers=2)
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    head = load(write(src, cfg, sd, "safetensors"), target)
    write(out, head.cfg.to_json(), head.state_for_saving(), "safetensors")
    again = load(out, target)
    assert again.cfg == head.cfg
    for name, t in head.state_for_saving().items():
        assert torch.equal(again.state_for_saving()[name], t), name


def _expect_error(tmp_path, target, cfg, sd, match, fmt="safetensors", exc=ValueError):
    with pytest.raises(exc, match=match):
        load(write(tmp_path, cfg, sd, fmt), target)


@pytest.mark.parametrize("name", ["fc.bias", "layers.0.self_attn.k_proj.weight",
                                  "layers.0.mlp.up_proj.weight",
                                  "layers.0.post_attention_layernorm.weight"])
def test_eagle_missing_tensor_is_named(tmp_path, target, name):
    cfg, sd = eagle_checkpoint()
    del sd[name]
    _expect_error(tmp_path, target, cfg, sd, rf"missing draft weight.*{name}", exc=DraftHeadError)


@pytest.mark.parametrize("name", ["d2t", "norm.weight", "lm_head.weight",
                                  "midlayer.hidden_norm.weight",
                                  "midlayer.self_attn.v_proj.weight"])
def test_eagle3_missing_tensor_is_named(tmp_path, target, name):
    cfg, sd = eagle3_checkpoint()
    del sd[name]
    _expect_error(tmp_path, target, cfg, sd, rf"missing draft weight.*{name}", exc=DraftHeadError)


@pytest.mark.parametrize("kind, name, shape", [
    ("eagle", "fc.weight", (H, 2 * H + 1)),
    ("eagle", "layers.0.self_attn.q_proj.weight", (2 * 16, H)),  # head_dim 16, not 32
    ("eagle", "layers.0.mlp.down_proj.weight", (H, 95)),
    ("eagle", "embed_tokens.weight", (VOCAB - 1, H)),
    ("eagle3", "fc.weight", (H, 2 * H)),
    ("eagle3", "midlayer.self_attn.q_proj.weight", (64, H)),  # EAGLE-1 width, not 2H
    ("eagle3", "lm_head.weight", (DRAFT_VOCAB + 1, H)),
    ("eagle3", "d2t", (DRAFT_VOCAB - 1,)),
])
def test_wrong_shape_is_named(tmp_path, target, kind, name, shape):
    cfg, sd = eagle_checkpoint(with_embed=True) if kind == "eagle" else eagle3_checkpoint()
    assert tuple(sd[name].shape) != shape
    sd[name] = torch.zeros(shape, dtype=sd[name].dtype)
    _expect_error(tmp_path, target, cfg, sd, f"{re.escape(name)}.*{re.escape(str(shape))}")


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_hidden_size_mismatch_is_named(tmp_path, target, kind):
    cfg, sd = eagle_checkpoint() if kind == "eagle" else eagle3_checkpoint()
    cfg["hidden_size"] = 48
    _expect_error(tmp_path, target, cfg, sd, r"hidden_size 48 != the target's 64",
                  exc=DraftHeadError)


def test_feature_layers_outside_the_target_are_refused(tmp_path, target):
    cfg, sd = eagle3_checkpoint()
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]  # target has 4 layers
    _expect_error(tmp_path, target, cfg, sd, r"feature layers \(1, 2, 4\) outside \[0, 4\)",
                  exc=DraftHeadError)


def test_directory_problems_are_named(tmp_path, target):
    cfg, sd = eagle_checkpoint()
    with pytest.raises(DraftHeadError, match="no config.json"):
        load(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftHeadError, match="no model.safetensors or pytorch_model.bin"):
        load(tmp_path, target)
    save_file({"fc.weight": sd["fc.weight"]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DraftHeadError, match=r"neither 'layers.0.\*' \(EAGLE\) nor 'midlayer"):
        load(tmp_path, target)
    del cfg["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write(tmp_path, cfg, sd, "safetensors")
    with pytest.raises(DraftHeadError, match="missing field 'num_attention_heads'"):
        load(tmp_path, target)


def test_layer_count_and_checkpoint_must_agree(tmp_path, target):
    """A second layer's tensor missing is named; a layer the config does not announce is
    refused (not silently dropped); EAGLE-3 heads have one layer."""
    for sub in "abc":
        (tmp_path / sub).mkdir()
    cfg, sd = eagle_checkpoint(num_layers=2)
    del sd["layers.1.input_layernorm.weight"]
    _expect_error(tmp_path / "a", target, cfg, sd,
                  r"missing draft weight.*layers.1.input_layernorm", exc=DraftHeadError)
    cfg, sd = eagle_checkpoint(num_layers=2)
    cfg["num_hidden_layers"] = 1
    _expect_error(tmp_path / "b", target, cfg, sd, r"unexpected draft weight.*layers.1.",
                  exc=DraftHeadError)
    cfg, sd = eagle3_checkpoint()
    cfg["num_hidden_layers"] = 2
    _expect_error(tmp_path / "c", target, cfg, sd, "num_hidden_layers: 2 is not supported",
                  exc=DraftHeadError)


def test_unexpected_head_tensor_is_refused(tmp_path):
    """A tensor the head would not load (e.g. a bias its config does not announce) must not be
    silently dropped."""
    import json

    from safetensors.torch import save_file

    from spec_helpers import tiny_head, tiny_target
    from tandem.spec.head import DraftHeadError, load_head

    target = tiny_target("llama")
    head = tiny_head(target, "eagle")
    state = head.state_for_saving()
    state["layers.0.self_attn.q_proj.bias"] = torch.zeros(state["layers.0.self_attn.q_proj.weight"].shape[0])
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(head.cfg.to_json()))
    with pytest.raises(DraftHeadError, match="unexpected draft weight.*q_proj.bias"):
        load_head(tmp_path, target, torch.float32, torch.device("cpu"), 512)


# ---- EAGLE-1/2 heads over a reduced draft vocabulary (tandem draft-vocab) --------------------

def _subset_head_dir(tmp_path, ids):
    from tandem.spec.vocab import restrict_head_vocab

    cfg, sd = eagle_checkpoint()
    cfg["vocab_size"] = VOCAB
    src = tmp_path / "full"
    src.mkdir()
    write(src, cfg, sd, "safetensors")
    return restrict_head_vocab(src, torch.tensor(ids), tmp_path / "subset")


def test_subset_head_scores_only_its_rows(tmp_path, target):
    """Log-probs over the subset are the full head's logits at those ids, renormalized; the
    proposals are target ids inside the subset."""
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:40].tolist())
    full = load(_full_dir(tmp_path), target)
    sub = load(_subset_head_dir(tmp_path, ids), target)
    assert sub.cfg.draft_vocab_size == len(ids) and sub.draft_rows.shape == (len(ids), H)
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(4))
    want = torch.log_softmax(full.log_probs(hidden)[:, ids], dim=-1)
    assert torch.allclose(sub.log_probs(hidden), want, atol=1e-5)
    got, _ = sub.topk(hidden, 3)
    assert set(got.flatten().tolist()) <= set(ids)
    best = torch.tensor(ids)[want.argmax(-1)]
    assert torch.equal(got[:, 0], best)


@pytest.mark.parametrize("subset", [False, True], ids=["full-vocab", "subset-vocab"])
def test_top1_paths_agree_with_the_log_softmax_top_k(tmp_path, target, subset):
    """Chain drafting takes its top-1 by max / argmax over the logits (`topk(h, 1)`, `top1`)
    instead of a log-softmax and a radix top-k: the same target ids, and the log-probability
    the full log-softmax gives that id."""
    ids = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:40].tolist())
    head = load(_subset_head_dir(tmp_path, ids) if subset else _full_dir(tmp_path), target)
    hidden = torch.randn(6, H, generator=torch.Generator().manual_seed(6))
    logp = head.log_probs(hidden)  # [6, V_draft]
    want_logp, want = torch.topk(logp, 1, dim=-1)
    got, got_logp = head.topk(hidden, 1)
    assert torch.equal(got, head.to_target_ids(want))
    assert torch.equal(head.top1(hidden), got[:, 0])
    assert torch.allclose(got_logp, want_logp, atol=1e-5)


def test_a_subset_of_every_token_is_the_full_head(tmp_path, target):
    """`draft-vocab --size` equal to the vocabulary writes a head the loader takes as the
    full one (no d2t), drafting what the full head drafts."""
    full = load(_full_dir(tmp_path), target)
    every = load(_subset_head_dir(tmp_path, list(range(VOCAB))), target)
    assert not every.subset_vocab
    hidden = torch.randn(4, H, generator=torch.Generator().manual_seed(7))
    assert torch.allclose(every.log_probs(hidden), full.log_probs(hidden))


def _full_dir(tmp_path):
    cfg, sd = eagle_checkpoint()
    d = tmp_path / "full_only"
    d.mkdir(exist_ok=True)
    return write(d, cfg, sd, "safetensors")


def test_subset_head_problems_are_named(tmp_path, target):
    d = _subset_head_dir(tmp_path, list(range(0, 64, 2)))
    cfg = json.loads((d / "config.json").read_text())
    from safetensors.torch import load_file

    sd = load_file(str(d / "model.safetensors"))
    for sub in "abc":
        (tmp_path / sub).mkdir()
    bad = dict(sd)
    del bad["d2t"]
    _expect_error(tmp_path / "a", target, cfg, bad, r"missing draft weight.*d2t",
                  exc=DraftHeadError)
    bad = dict(sd, d2t=sd["d2t"] + VOCAB)
    _expect_error(tmp_path / "b", target, cfg, bad, r"d2t maps draft ids outside",
                  exc=DraftHeadError)
    _expect_error(tmp_path / "c", target, dict(cfg, draft_vocab_size=VOCAB + 1), sd,
                  r"draft_vocab_size: 257", exc=DraftHeadError)


def test_draft_vocab_refuses_eagle3_heads_and_bad_ids(tmp_path):
    from tandem.spec.vocab import restrict_head_vocab

    cfg, sd = eagle3_checkpoint()
    write(tmp_path, cfg, sd, "safetensors")
    with pytest.raises(DraftHeadError, match="only EAGLE-1/2"):
        restrict_head_vocab(tmp_path, torch.arange(8), tmp_path / "out")
    with pytest.raises(ValueError, match="strictly increasing"):
        restrict_head_vocab(_full_dir(tmp_path), torch.tensor([3, 1]), tmp_path / "out2")
