"""`tandem train-eagle`: self-distillation training of an EAGLE head for a target model.

1. Prompts are built from text on the machine (`train_data.build_prompts`); the target answers
   them greedily (stored as token ids, resumable).
2. Each batch: the target runs over prompt + answer (no grad) and yields features; the head is
   trained with the training-time test (`ttt.py`) to predict the target's next tokens.
3. Checkpoints (`ckpt.pt`: head, optimizer, step) are written every `save_every` steps and the
   run resumes from them; `export` writes config.json + model.safetensors in the layout
   `load_head` reads.

For an EAGLE-3 head the draft vocabulary is the `draft_vocab_size` most frequent target tokens
in the answers; its lm_head starts from the target's rows and its norm from the target's
final norm, so the head starts out mapping features to tokens the way the target does.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.engine import ForwardBatch, LLMEngine, SeqSlice, build_metadata
from tandem.spec.head import EagleHead
from tandem.spec.head_config import (DraftHeadConfig, DraftHeadError, detect_kind,
                                     read_head_checkpoint)
from tandem.spec.train_answers import answer_prompts, extra_samples, read_all
from tandem.spec.train_config import TrainConfig
from tandem.spec.train_data import Sample, read_samples
from tandem.spec.ttt import target_log_probs, ttt_forward, ttt_loss
from tandem.spec.vocab import frequent_tokens, restrict_head_vocab

log = logging.getLogger(__name__)


def init_head(engine: LLMEngine, cfg: TrainConfig, vocab_ids: torch.Tensor | None) -> EagleHead:
    target = engine.model
    dcfg = DraftHeadConfig.like_target(
        target.cfg, cfg.kind, draft_vocab_size=len(vocab_ids) if vocab_ids is not None else None,
        num_layers=cfg.num_layers)
    max_len = engine.max_model_len
    with torch.device(engine.device):
        head = EagleHead(dcfg, target, torch.float32, max_len)
    gen = torch.Generator().manual_seed(cfg.seed)  # CPU draws: the same init on any device
    for name, p in head.named_parameters():
        if name.startswith("target_"):
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=gen))
    if cfg.kind == "eagle3":
        assert vocab_ids is not None
        ids = vocab_ids.to(engine.device)
        head.lm_head.weight.data = target.lm_head.head_weight()[ids].float().clone()
        head.norm.weight.data = target.norm.weight.float().clone()
        head.d2t.copy_(ids - torch.arange(len(ids), device=engine.device))
    return head


def start_from(head: EagleHead, path: Path) -> None:
    """Load a trained head's weights into `head` (a resumed checkpoint still wins). An EAGLE-1/2
    head exported with a draft vocabulary keeps the same weights: its `d2t` only picks lm_head
    rows at inference, and training scores the whole vocabulary."""
    raw, state = read_head_checkpoint(path)
    if detect_kind(state) != head.cfg.kind:
        raise DraftHeadError(f"init_head: {path} is a {detect_kind(state)} head, training "
                             f"{head.cfg.kind}")
    if head.cfg.kind == "eagle":
        state.pop("d2t", None)
        state = grow_layers(state, head.cfg.num_layers, str(path))
    head.load_state({k: v.float() if v.is_floating_point() else v for k, v in state.items()},
                    str(path))
    log.info("starting from the head in %s", path)


def grow_layers(state: dict[str, torch.Tensor], num_layers: int, source: str
                ) -> dict[str, torch.Tensor]:
    """An EAGLE-1/2 checkpoint with fewer layers than `num_layers`, grown: each new layer i
    copies the checkpoint's last layer, with an input norm of ones and o_proj and down_proj
    zeroed, so it adds nothing to the residual stream and the grown head's output equals the
    old head's (training then moves the new layers off zero)."""
    have = 0
    while f"layers.{have}.self_attn.q_proj.weight" in state:
        have += 1
    if have > num_layers:
        raise DraftHeadError(f"init_head: {source} has {have} layers, more than the "
                             f"{num_layers} trained (num_layers)")
    out = dict(state)
    last = f"layers.{have - 1}."
    for i in range(have, num_layers):
        for name, t in state.items():
            if name.startswith(last):
                rest = name[len(last):]
                zero = rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
                out[f"layers.{i}.{rest}"] = torch.zeros_like(t) if zero else t.clone()
        norm = state[f"{last}post_attention_layernorm.weight"]
        out[f"layers.{i}.input_layernorm.weight"] = torch.ones_like(norm)
    return out


def check_all_in_graph(head: EagleHead, params: list[torch.nn.Parameter]) -> None:
    """After a backward: every trainable weight must have a gradient (zeros are fine: a grown
    layer's o_proj starts at zero). None means the forward cut it off the autograd graph, as
    the Triton kernels (no backward) once did on the GPU to q/k and the norms, unnoticed for
    five sessions of training."""
    names = {id(p): n for n, p in head.named_parameters()}
    missing = [names.get(id(p), "?") for p in params if p.grad is None]
    if missing:
        raise RuntimeError(f"train-eagle: no gradient reached {', '.join(missing)}: the "
                           f"training forward is cut off the autograd graph there")


def trainable(head: EagleHead) -> list[torch.nn.Parameter]:
    out = []
    for name, p in head.named_parameters():
        if name.startswith("target_"):
            p.requires_grad_(False)
        else:
            p.requires_grad_(True)
            out.append(p)
    return out


@dataclass(frozen=True, slots=True)
class TargetBatch:
    """One training batch from the target, padded to the longest sample (T = its length - 1)."""

    tokens: torch.Tensor  # [B, T] int64: x_{t+1}, the token draft position t consumes
    features: torch.Tensor  # [B, T, F]: the target's feature f_t
    labels: torch.Tensor  # [B, T] int64: x_{t+2}, what draft position t proposes
    mask: torch.Tensor  # [B, T] bool: positions whose label is part of the answer
    next_hidden: torch.Tensor  # [B, T, H]: the target's final-normed hidden at t+1 (scores x_{t+2})
    answer_start: torch.Tensor  # [B] int64: the first t whose label is an answer token


@torch.no_grad()
def target_batch(engine: LLMEngine, samples: list[Sample], head: EagleHead, max_len: int
                 ) -> TargetBatch:
    """Run the target over each sample (one forward for the batch) and lay out what the head
    trains on, on the engine's device."""
    seqs = [list(s.prompt_ids + s.answer_ids)[:max_len] for s in samples]
    plens = [len(s.prompt_ids) for s in samples]
    pages = [engine.allocator.alloc(engine.scheduler.pages_needed(len(x))) for x in seqs]
    dev = engine.device
    try:
        layout = build_metadata([SeqSlice(page_ids=p, num_cached=0, num_new=len(x))
                                 for p, x in zip(pages, seqs)], engine.cfg.page_size, dev)
        flat = torch.tensor([t for x in seqs for t in x], dtype=torch.int64, device=dev)
        out = engine.runner.forward(ForwardBatch(
            input_ids=flat, positions=layout.positions, attn=layout.attn,
            logits_indices=torch.zeros(1, dtype=torch.int64, device=dev),
            capture_layers=head.cfg.feature_layers))
    finally:
        for p in pages:
            engine.allocator.free(p)
    feats = head.target_features(out.hidden, out.aux_hidden).float()  # [N, F]
    hidden = out.hidden.float()  # [N, H]
    b, t_len = len(seqs), max(len(x) for x in seqs) - 1
    # Flat index of position t of sample i (padding points at row 0 and is masked out).
    lens = torch.tensor([len(x) for x in seqs], device=dev)
    starts = torch.cumsum(lens, 0) - lens  # [B]
    t = torch.arange(t_len, device=dev)
    at = (starts[:, None] + t[None, :]).clamp(max=len(flat) - 1)  # [B, T]
    has_token = t[None, :] < (lens - 1)[:, None]  # x_{t+1} exists
    has_label = t[None, :] < (lens - 2)[:, None]  # x_{t+2} exists
    plen = torch.tensor(plens, device=dev)
    # Draft position t predicts x_{t+2}; train where that token is part of the answer.
    start = (plen - 2).clamp(min=0)  # [B]
    mask = has_label & (t[None, :] >= start[:, None])
    nxt = (at + 1).clamp(max=len(flat) - 1)
    return TargetBatch(
        tokens=torch.where(has_token, flat[nxt], 0),
        features=feats[at] * has_token[..., None],
        labels=torch.where(has_label, flat[(at + 2).clamp(max=len(flat) - 1)], 0),
        mask=mask,
        next_hidden=hidden[nxt] * has_token[..., None],
        answer_start=start,
    )


_LOG_EVERY = 25  # steps between lines of train_log.jsonl
# Answer positions logged apart (`acc_early`): chat answers are mostly this short, and a
# head's top-1 there is well below its mean over long answers (benchmarks/head_gap.py: the
# shipped head 0.56-0.62 over the first 128, 0.70-0.75 past them).
_EARLY = 128


@torch.no_grad()
def early_accuracy(head: EagleHead, outs: list[torch.Tensor], tb: TargetBatch,
                   t2d: torch.Tensor | None) -> list[float]:
    """Top-1 accuracy of each unrolled step over the first `_EARLY` answer positions."""
    t = torch.arange(tb.mask.shape[1], device=tb.mask.device)[None, :]  # [1, T]
    early = tb.mask & (t - tb.answer_start[:, None] < _EARLY)  # [B, T]
    labels = tb.labels if t2d is None else t2d[tb.labels]
    accs = []
    for s, h in enumerate(outs):
        valid = early & (t >= s) & (labels >= 0)
        hits = head.log_probs(h[valid]).argmax(-1) == labels[valid] if valid.any() else None
        accs.append(0.0 if hits is None else float(hits.float().mean()))
    return accs
_PLAN_AFTER = 20  # steps timed before a run with max_seconds plans its length


def planned_steps(total: int, step: int, elapsed_s: float, steps_done: int,
                  max_seconds: float) -> int:
    """The steps a run can afford: `total` at most, `step` at least (already taken), at the
    pace of its last `steps_done` steps (`elapsed_s` seconds since the loop started)."""
    pace = elapsed_s / max(steps_done, 1)
    return max(step, min(total, step + int((max_seconds - elapsed_s) / pace)))


def _clock(device: torch.device, sync: bool) -> float:
    """perf_counter, after the device's queued work when `sync` (CUDA runs asynchronously)."""
    if sync and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def export_head(head: EagleHead, out_dir: Path, meta: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
             for k, v in head.state_for_saving().items()}
    save_file(state, str(out_dir / "model.safetensors"))
    cfg = head.cfg.to_json()
    cfg["tandem_training"] = meta
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def train(engine: LLMEngine, cfg: TrainConfig, progress: bool = True) -> Path:
    """Answer the prompts (resumable), train the head on them and write it. Returns the
    head's directory. On CUDA the head's float32 matmuls run as TF32 (the target's forward
    is in its own dtype): full-vocabulary logits in float32 dominate a step otherwise."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return _train(engine, cfg, progress)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _train(engine: LLMEngine, cfg: TrainConfig, progress: bool) -> Path:
    out = Path(cfg.out_dir)
    earlier = extra_samples(cfg)
    data_path = answer_prompts(engine, cfg, progress, earlier)
    samples = read_samples(data_path) + earlier
    samples = [s for s in samples if len(s.answer_ids) >= 2]
    log.info("training on %d samples (%d answer tokens)", len(samples),
             sum(len(s.answer_ids) for s in samples))
    vocab_from = samples + read_all(cfg.vocab_samples, "vocab_samples")
    vocab_ids = (frequent_tokens(vocab_from, cfg.draft_vocab_size, engine.model_cfg.vocab_size)
                 if cfg.kind == "eagle3" else None)
    head = init_head(engine, cfg, vocab_ids)
    if cfg.init_head is not None:
        start_from(head, Path(cfg.init_head))
    params = trainable(head)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_per_epoch = math.ceil(len(samples) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    step = 0
    ckpt = out / "ckpt.pt"
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        step = state["step"]
        log.info("resuming from step %d", step)
    t2d = None
    if vocab_ids is not None:
        t2d = torch.full((engine.model_cfg.vocab_size,), -1, dtype=torch.int64)
        t2d[vocab_ids] = torch.arange(len(vocab_ids))
        t2d = t2d.to(engine.device)
    draft_ids = None if vocab_ids is None else vocab_ids.to(engine.device)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, unit="step", desc="train-eagle")
    started = window = time.perf_counter()
    num_tokens, first, order_epoch, order = 0, step, -1, []
    while step < total_steps:
        # The steps that log also time their parts (synchronised on CUDA): where a step's time
        # goes, the target's forward or the head's training.
        timed = (step + 1) % _LOG_EVERY == 0 or step + 1 == total_steps
        t0 = _clock(engine.device, timed)
        epoch, idx = divmod(step, steps_per_epoch)
        if epoch != order_epoch:
            order_epoch, order = epoch, list(range(len(samples)))
            random.Random(cfg.seed + epoch).shuffle(order)
        batch = [samples[i] for i in order[idx * cfg.batch_size : (idx + 1) * cfg.batch_size]]
        tb = target_batch(engine, batch, head, cfg.max_seq_len)
        t1 = _clock(engine.device, timed)
        lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (
            1 + math.cos(math.pi * step / total_steps))
        for g in opt.param_groups:
            g["lr"] = lr
        outs = ttt_forward(head, tb.tokens, tb.features, cfg.ttt_steps)
        soft = (target_log_probs(engine.model.lm_head, tb.next_hidden, tb.mask, draft_ids)
                if cfg.soft_labels else None)
        loss, accs = ttt_loss(head, outs, tb.labels, tb.mask, t2d, target_logp=soft,
                              next_hidden=tb.next_hidden, feature_weight=cfg.feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        check_all_in_graph(head, params)
        # Per-tensor clipping: fc's gradient is orders of magnitude larger than the rest (it
        # reads raw residual streams); one global norm would shrink every other update to ~0.
        for p in params:
            torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
        step += 1
        num_tokens += int(tb.mask.sum())
        if cfg.max_seconds is not None and step - first == _PLAN_AFTER:
            elapsed = _clock(engine.device, True) - started
            total_steps = planned_steps(total_steps, step, elapsed, step - first,
                                        cfg.max_seconds)
            log.info("%.2f s a step: training %d steps in all (max_seconds %.0f)",
                     elapsed / (step - first), total_steps, cfg.max_seconds)
            if bar is not None:
                bar.total = total_steps
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=",".join(f"{a:.2f}" for a in accs))
        if timed:  # loss, per-step top-1 accuracy, seconds per step since the last log
            t2 = _clock(engine.device, True)
            done = step % _LOG_EVERY or _LOG_EVERY
            with (out / "train_log.jsonl").open("a") as f:
                f.write(json.dumps({"step": step, "loss": round(loss.item(), 4),
                                    "acc": [round(a, 4) for a in accs],
                                    "acc_early": [round(a, 4) for a in
                                                  early_accuracy(head, outs, tb, t2d)],
                                    "step_s": round((t2 - window) / done, 4),
                                    "target_s": round(t1 - t0, 4),
                                    "head_s": round(t2 - t1, 4)}) + "\n")
            window = time.perf_counter()
        if step % cfg.save_every == 0 or step == total_steps:
            torch.save({"head": {k: v for k, v in head.state_dict().items()
                                 if not k.startswith("target_")},
                        "opt": opt.state_dict(), "step": step}, ckpt)
    if bar is not None:
        bar.close()
    meta = {"config": asdict(cfg), "num_samples": len(samples),
            "answer_tokens": sum(len(s.answer_ids) for s in samples),
            "steps": step, "train_seconds": round(time.perf_counter() - started, 1),
            "tokens_this_run": num_tokens}
    export_head(head, out / "head", meta)
    vocab = engine.model_cfg.vocab_size
    if cfg.kind == "eagle" and cfg.draft_vocab_size < vocab:
        # An EAGLE-1/2 head learns over the whole vocabulary and drafts over the most frequent
        # answer tokens (see vocab.py): the same restriction `tandem draft-vocab` applies.
        restrict_head_vocab(out / "head",
                            frequent_tokens(vocab_from, cfg.draft_vocab_size, vocab), out / "head")
    return out / "head"
