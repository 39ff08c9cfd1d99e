"""`tandem train-eagle` end to end on the real SmolLM2 (tiny budget): the target answers
prompts (stored, resumable), the head trains, the exported head loads with `load_head`, an
EAGLE-1/2 head drafts over the requested vocabulary, and a second run resumes instead of
starting over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.engine import EngineConfig, LLMEngine
from tandem.spec import load_head
from tandem.spec.train import TrainConfig, train
from tandem.spec.train_data import HELD_OUT_QUESTIONS, build_prompts, is_held_out, read_samples

pytestmark = pytest.mark.timeout(600)


def test_train_exports_a_loadable_subset_head_and_resumes(smollm2_dir, tmp_path):
    torch.set_num_threads(1)
    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                             num_pages=256, max_num_batched_tokens=512))
    cfg = TrainConfig(out_dir=str(tmp_path), kind="eagle", draft_vocab_size=512, num_prompts=3,
                      max_new_tokens=6, gen_batch_size=3, max_seq_len=96, batch_size=3,
                      epochs=1, save_every=1)
    head_dir = train(eng, cfg, progress=False)
    samples = read_samples(tmp_path / "samples.jsonl")
    assert len(samples) == 3 and all(0 < len(s.answer_ids) <= 6 for s in samples)
    raw = json.loads((head_dir / "config.json").read_text())
    assert raw["draft_vocab_size"] == 512 and raw["tandem_training"]["steps"] == 1
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1]  # the last step logs, with where its time went
    assert log[0]["target_s"] > 0 and log[0]["head_s"] > 0
    assert len(log[0]["acc_early"]) == cfg.ttt_steps  # the first answer positions, apart
    assert log[0]["step_s"] + 2e-4 >= log[0]["target_s"] + log[0]["head_s"]  # (rounded to 1e-4)
    head = load_head(head_dir, eng.model, torch.float32, torch.device("cpu"), 128)
    assert head.subset_vocab and head.draft_rows.shape == (512, eng.model_cfg.hidden_size)
    answered = {t for s in samples for t in s.answer_ids}
    ids = set((torch.arange(512) + head.d2t).tolist())
    assert answered <= ids  # every token the target emitted is draftable
    # A second run finds the answers and the checkpoint: nothing is generated or trained again.
    before = (tmp_path / "samples.jsonl").read_text()
    train(eng, cfg, progress=False)
    assert (tmp_path / "samples.jsonl").read_text() == before
    assert json.loads((head_dir / "config.json").read_text())["tandem_training"][
        "tokens_this_run"] == 0


def test_init_head_starts_training_from_a_trained_subset_head(smollm2_dir, tmp_path):
    """--init-head: the weights of an exported head (with a draft vocabulary) are where
    training starts; with a learning rate of 0 the new head has the old one's weights (its draft
    vocabulary comes from the new run's answers)."""
    torch.set_num_threads(1)
    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                             num_pages=256, max_num_batched_tokens=512))
    base = dict(kind="eagle", draft_vocab_size=512, num_prompts=2, max_new_tokens=4,
                gen_batch_size=2, max_seq_len=64, batch_size=2, epochs=1, save_every=1)
    first = train(eng, TrainConfig(out_dir=str(tmp_path / "a"), **base), progress=False)
    again = train(eng, TrainConfig(out_dir=str(tmp_path / "b"), lr=0.0, init_head=str(first),
                                   seed=1, **base), progress=False)
    a = load_head(first, eng.model, torch.float32, torch.device("cpu"), 128)
    b = load_head(again, eng.model, torch.float32, torch.device("cpu"), 128)
    for name, t in a.state_for_saving().items():  # d2t: from the new run's answers
        assert name == "d2t" or torch.equal(t, b.state_for_saving()[name]), name
    # (this run also takes the soft-label and feature-loss path end to end)
    fresh = train(eng, TrainConfig(out_dir=str(tmp_path / "c"), lr=0.0, seed=1, soft_labels=True,
                                   feature_weight=0.5, **base), progress=False)
    c = load_head(fresh, eng.model, torch.float32, torch.device("cpu"), 128)
    assert not torch.equal(a.fc.weight, c.fc.weight)  # without it: a different random init
    with pytest.raises(ValueError, match="feature_weight"):
        TrainConfig(out_dir="x", kind="eagle3", feature_weight=1.0)
    with pytest.raises(ValueError, match="init_head"):
        train(eng, TrainConfig(out_dir=str(tmp_path / "d"), init_head=str(first),
                               **(base | {"kind": "eagle3"})), progress=False)


def test_no_training_prompt_touches_a_held_out_subject_or_an_eval_prompt():
    """Built and self-written training prompts never mention a held-out subject nor contain
    one of the 50 evaluation chat prompts (any case or punctuation)."""
    from tandem.spec.train_data import EVAL_CHAT_PROMPTS, keep_self_prompt

    prompts = build_prompts(100_000)
    assert len(prompts) > 10_000
    assert not any(is_held_out(p) for p in prompts)
    assert all(is_held_out(q) for q in HELD_OUT_QUESTIONS)
    assert not set(prompts) & set(HELD_OUT_QUESTIONS)
    evals = [q for q in EVAL_CHAT_PROMPTS.read_text().splitlines() if q.strip()]
    assert all(is_held_out(q) for q in evals)
    assert not keep_self_prompt("what are fossils!! Answer in two lines.")  # one of the 50
    assert keep_self_prompt("What are fossil fuels made of?")  # a neighbour is fine


def test_a_new_prompt_set_skips_prompts_answered_in_extra_samples():
    """`unanswered`: a prompt whose stored ids (chat template around it) some extra sample
    already has is not answered again; the rest keep their order."""
    from tandem.spec.train_data import Sample, prompt_ids, unanswered

    class Tok:  # the chat template as ids: one id per character, a fixed header and footer
        def encode_chat(self, messages):
            return [1, 2] + [ord(c) for c in messages[0].content] + [3]

    tok = Tok()
    prompts = ["alpha", "beta", "gamma", "delta"]
    answered = [Sample(prompt_ids=tuple(prompt_ids(tok, "beta")), answer_ids=(5, 6)),
                Sample(prompt_ids=tuple(prompt_ids(tok, "delta")), answer_ids=(7,)),
                Sample(prompt_ids=(9, 9), answer_ids=(1,))]
    assert unanswered(tok, prompts, answered) == ["alpha", "gamma"]
    assert unanswered(tok, prompts, []) == prompts
    assert len(prompt_ids(tok, "x" * 5000)) == 1024  # the stored ids keep the last 1,024


def test_self_written_prompts_are_user_turns_kept_filtered_and_resumable(smollm2_dir, tmp_path):
    """--self-prompts: the target, given the chat template up to a user turn's text, writes
    prompts; only those it ended itself (end of turn) and that pass `keep_self_prompt` are kept,
    distinct, in OUT/self_prompts.jsonl, and a second run reuses them instead of sampling."""
    from tandem.spec.train_answers import written_prompts
    from tandem.spec.train_data import _user_turn_prefix, keep_self_prompt

    torch.set_num_threads(1)
    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                             num_pages=512, max_num_batched_tokens=512))
    prefix = _user_turn_prefix(eng.tokenizer)
    assert prefix.endswith("<|im_start|>user\n") and "system" in prefix
    cfg = TrainConfig(out_dir=str(tmp_path), kind="eagle", num_prompts=1, self_prompts=4,
                      gen_batch_size=8)
    first = written_prompts(eng, cfg, progress=False)
    assert len(first) == 4 and len(set(first)) == 4
    assert all(keep_self_prompt(p) and "<|im" not in p for p in first)
    stored = [json.loads(line) for line in (tmp_path / "self_prompts.jsonl").read_text().splitlines()]
    assert stored == first
    assert written_prompts(eng, cfg, progress=False) == first  # reused, not sampled again
    assert written_prompts(eng, TrainConfig(out_dir=str(tmp_path / "none"), kind="eagle"),
                           progress=False) == []


def test_keep_self_prompt_drops_held_out_subjects_odd_text_and_bad_lengths():
    from tandem.spec.train_data import keep_self_prompt

    assert keep_self_prompt("How do I plan a budget for a small wedding?")
    assert not keep_self_prompt("How do I cook rice?")  # a held-out subject
    assert not keep_self_prompt("Hi")  # too short
    assert not keep_self_prompt("word " * 100)  # too long
    assert not keep_self_prompt("Sin parecerías para similástas desde él ñandú äöü éèê çà")
    assert not keep_self_prompt("{}[]<>{}[]<>{}[]<>##$$%%^^&&**")


def test_target_batch_scores_each_label_with_the_targets_own_distribution(smollm2_dir, tmp_path):
    """The soft labels are the target's distribution for the token each draft position
    proposes: at every trained position their argmax is the token the target answered (greedy,
    same dtype), the feature a position reads is the hidden the previous one's label came from,
    and padding is never trained on."""
    from tandem.spec.train import init_head, target_batch
    from tandem.spec.ttt import target_log_probs

    torch.set_num_threads(1)
    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                             num_pages=256, max_num_batched_tokens=512))
    cfg = TrainConfig(out_dir=str(tmp_path), kind="eagle", num_prompts=3, max_new_tokens=8,
                      gen_batch_size=3)
    from tandem.spec.train_answers import answer_prompts

    samples = read_samples(answer_prompts(eng, cfg, progress=False))
    head = init_head(eng, cfg, None)
    tb = target_batch(eng, samples, head, 256)
    lens = [len(s.prompt_ids) + len(s.answer_ids) for s in samples]
    assert tb.tokens.shape == (3, max(lens) - 1)
    assert tb.mask.sum().item() == sum(len(s.answer_ids) for s in samples)
    for i, s in enumerate(samples):  # the mask covers exactly answer labels
        labels = tb.labels[i][tb.mask[i]].tolist()
        assert labels == list(s.answer_ids)
    logp = target_log_probs(eng.model.lm_head, tb.next_hidden, tb.mask, None)
    assert torch.equal(logp.argmax(-1), tb.labels[tb.mask])
    # EAGLE-1/2: the feature at t+1 is the next hidden of t.
    n = tb.features.shape[1]
    both = tb.mask[:, : n - 1]  # where position t+1 exists too
    torch.testing.assert_close(tb.next_hidden[:, : n - 1][both], tb.features[:, 1:][both])
    # Over a draft vocabulary: renormalized over its ids.
    ids = torch.unique(torch.tensor([t for s in samples for t in s.answer_ids]))
    sub = target_log_probs(eng.model.lm_head, tb.next_hidden, tb.mask, ids)
    torch.testing.assert_close(sub.exp().sum(-1), torch.ones(len(sub)))
    assert torch.equal(ids[sub.argmax(-1)], tb.labels[tb.mask])


def test_eval_eagle_measures_tau_on_a_prompts_file(smollm2_dir, tmp_path, capsys):
    """`tandem eval-eagle --prompts-file`: greedy speculative answers equal the target's in
    float32, tau is printed with P(draft j accepted) per position (non-increasing: draft j is
    accepted only after drafts 1..j-1); a missing or empty file is a clear error."""
    from tandem.cli import main
    from tandem.spec import SpecConfig
    from tandem.spec.evaluate import evaluate_head

    torch.set_num_threads(1)
    cfg = EngineConfig(model="default", dtype="float32", num_pages=256)
    r = evaluate_head(cfg, SpecConfig(num_steps=4), max_new_tokens=12,
                      questions=("What is a glacier?", "Why do stars twinkle at night?"))
    assert r.num_prompts == 2 and r.num_identical == 2 and r.num_rounds > 0
    assert 1.0 <= r.tau <= 5.0 and len(r.per_position) == 4
    assert all(a >= b for a, b in zip(r.per_position, r.per_position[1:]))
    # tau counts the accepted drafts + 1 per round: sum(P(draft j accepted)) + 1
    assert abs(r.tau - (1 + sum(r.per_position))) < 1e-6
    assert 0 < r.tau_stderr < 1
    (tmp_path / "empty.txt").write_text("\n\n")
    assert main(["eval-eagle", "--prompts-file", str(tmp_path / "nope.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["eval-eagle", "--prompts-file", str(tmp_path / "empty.txt")]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    from tandem.spec.train_data import EVAL_CHAT_PROMPTS

    lines = [q for q in EVAL_CHAT_PROMPTS.read_text().splitlines() if q.strip()]
    assert len(lines) == 50 and len(set(lines)) == 50
    assert not set(lines) & set(HELD_OUT_QUESTIONS)


def test_vocab_samples_count_toward_the_draft_vocabulary_only(smollm2_dir, tmp_path):
    """--vocab-samples: tokens frequent there are in the exported head's draft vocabulary even
    when no trained answer has them; a missing file is named."""
    torch.set_num_threads(1)
    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                             num_pages=256, max_num_batched_tokens=512))
    rare = [40001, 40002, 40003]  # tokens a short greedy answer will not contain
    vocab_file = tmp_path / "vocab.jsonl"
    vocab_file.write_text(json.dumps({"p": [1, 2], "a": rare * 400}) + "\n")
    base = dict(kind="eagle", draft_vocab_size=512, num_prompts=2, max_new_tokens=4,
                gen_batch_size=2, max_seq_len=64, batch_size=2, epochs=1, save_every=1, lr=0.0)
    head_dir = train(eng, TrainConfig(out_dir=str(tmp_path / "a"),
                                      vocab_samples=(str(vocab_file),), **base), progress=False)
    trained = read_samples(tmp_path / "a" / "samples.jsonl")
    assert not set(rare) & {t for s in trained for t in s.answer_ids}
    head = load_head(head_dir, eng.model, torch.float32, torch.device("cpu"), 128)
    ids = set((torch.arange(512) + head.d2t).tolist())
    assert set(rare) <= ids
    assert {t for s in trained for t in s.answer_ids} <= ids  # the trained answers' too
    with pytest.raises(FileNotFoundError, match="vocab_samples: .*nope.jsonl"):
        train(eng, TrainConfig(out_dir=str(tmp_path / "b"),
                               vocab_samples=(str(tmp_path / "nope.jsonl"),), **base),
              progress=False)


def test_planned_steps_fit_the_budget_at_the_measured_pace():
    from tandem.spec.train import planned_steps

    # 20 steps in 10 s (0.5 s each), 100 s allowed: 90 s left buy 180 more steps.
    assert planned_steps(1000, 20, 10.0, 20, 100.0) == 200
    assert planned_steps(150, 20, 10.0, 20, 100.0) == 150  # never past the epochs' steps
    assert planned_steps(1000, 20, 120.0, 20, 100.0) == 20  # over budget: stop where it is


def test_max_seconds_ends_the_schedule_early_and_writes_the_head(smollm2_dir, tmp_path,
                                                                  monkeypatch):
    """With a budget the first steps cannot beat, the run plans no more steps than it took,
    ends there and still writes the head (its meta says how many steps it took)."""
    from tandem.spec import train as train_mod

    torch.set_num_threads(1)
    monkeypatch.setattr(train_mod, "_PLAN_AFTER", 1)
    eng = LLMEngine.from_config(EngineConfig(model=str(smollm2_dir), dtype="float32",
                                             num_pages=256, max_num_batched_tokens=512))
    cfg = TrainConfig(out_dir=str(tmp_path), kind="eagle", draft_vocab_size=512, num_prompts=3,
                      max_new_tokens=4, gen_batch_size=3, max_seq_len=64, batch_size=1,
                      epochs=1, save_every=100, max_seconds=1e-6)
    head_dir = train(eng, cfg, progress=False)
    assert json.loads((head_dir / "config.json").read_text())["tandem_training"]["steps"] == 1
    with pytest.raises(ValueError, match="max_seconds"):
        TrainConfig(out_dir=str(tmp_path), max_seconds=0)


def test_early_accuracy_counts_the_first_answer_positions_only(monkeypatch):
    """Answer positions 0 and 1 (t = 2, 3) are early with _EARLY = 2: hits there count, the
    misses later do not, nor does the prompt; step s starts at t >= s."""
    from tandem.spec import train as train_mod

    monkeypatch.setattr(train_mod, "_EARLY", 2)

    class OneHot:
        def log_probs(self, h):
            return h

    labels = torch.tensor([[0, 1, 2, 3, 0, 1]])
    good = torch.nn.functional.one_hot(labels, 4).float()  # [1, 6, 4]: right everywhere
    out = good.clone()
    out[0, 4:] = torch.nn.functional.one_hot(torch.tensor([2, 2]), 4).float()  # wrong late
    out[0, :2] = 0  # the prompt: no hit (not counted either way)
    tb = train_mod.TargetBatch(tokens=labels, features=good, labels=labels,
                               mask=torch.arange(6)[None, :] >= 2, next_hidden=good,
                               answer_start=torch.tensor([2]))
    assert train_mod.early_accuracy(OneHot(), [out, out], tb, None) == [1.0, 1.0]
    monkeypatch.setattr(train_mod, "_EARLY", 4)
    assert train_mod.early_accuracy(OneHot(), [out], tb, None) == [0.5]
