"""EAGLE draft heads: EAGLE-1/2 (feature head) and EAGLE-3 (fused-feature head, draft vocab).

Both are a decoder layer that reads a token embedding and a feature and predicts the next
feature. A draft position t consumes the pair (feature f_t, token x_{t+1}) and proposes x_{t+2}.
An EAGLE-1/2 head may stack more layers after the first (`num_hidden_layers` > 1, EAGLE's own
`layers.{i}`): plain pre-norm decoder layers, each with its own KV layer in the draft group.

- EAGLE-1/2: f_t is the target's final-normed hidden state at t (or the draft's own output for
  later draft steps). x = fc([embed(x_{t+1}), f_t]) (bias), then a decoder layer WITHOUT input
  norm; the output goes straight to the target's lm_head.
- EAGLE-3: target features are the residual streams entering three target layers (low, mid,
  high), concatenated (3H) and fused by fc (no bias) to H; later steps feed the draft's own H
  output. The layer normalizes embedding and feature separately, attends over their concat
  (2H wide q/k/v), and a final norm + its own lm_head over a reduced draft vocabulary give
  logits; `d2t` maps draft ids to target ids (target = draft + d2t[draft]).

Checkpoint layouts (config.json + model.safetensors or pytorch_model.bin) are those the public
EAGLE and EAGLE-3 heads use: `fc.*`, `layers.0.*` (EAGLE) / `midlayer.*`, `norm.weight`,
`lm_head.weight`, `d2t`, `t2d` (EAGLE-3), and optionally `embed_tokens.weight`. A head's
configuration (`DraftHeadConfig`, read from config.json) is in `tandem.spec.head_config`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine import kernels
from tandem.engine.layers.attention import ForwardContext, HeadLayout, SelfAttention
from tandem.engine.layers.linear import WeightShapeError, check_shape
from tandem.engine.layers.mlp import DenseMLP
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.models.decoder import DecoderLM
from tandem.engine.parallel import ParallelGroup
from tandem.spec.head_config import (DraftHeadConfig, DraftHeadError, detect_kind,
                                     read_head_checkpoint)

# Checkpoint tensors a head may carry beyond what it loads (t2d is derivable from d2t).
_OPTIONAL_KEYS = frozenset({"t2d", "embed_tokens.weight"})


class _LaterLayer(nn.Module):
    """Layer i >= 1 of a multi-layer EAGLE-1/2 head: a pre-norm decoder layer over the previous
    layer's output (EAGLE's `layers.{i}`, which, unlike layer 0, has an input norm)."""

    def __init__(self, index: int, cfg: DraftHeadConfig, heads: HeadLayout,
                 rotary: RotaryEmbedding, tp: ParallelGroup, dtype: torch.dtype) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.attn = SelfAttention(index, h, heads, False, False, None, rotary, tp, dtype)
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = DenseMLP(h, cfg.intermediate_size, tp, dtype)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, ctx: ForwardContext
                ) -> torch.Tensor:  # [T, H] -> [T, H]
        if _fuse(h, self.attn, self.mlp):  # the target's fused decode path, same function
            h = self.attn.forward_fused(positions, h, self.input_norm, ctx)
            return self.mlp.forward_fused(h, self.post_attn_norm)
        h = h + self.attn(positions, self.input_norm(h), ctx)
        return h + self.mlp(self.post_attn_norm(h))


def _fuse(x: torch.Tensor, attn: SelfAttention, mlp: DenseMLP) -> bool:
    """Whether a draft layer given x [T, H] folds its norms and residual adds into the GEMVs
    (few rows on CUDA, inference: a draft step, a small draft-extend), as the target's
    decoder layers do (`kernels.decode_fusion_ok`, which also requires x contiguous), when
    the policy's `fused_draft` allows."""
    return (kernels.current_policy().fused_draft and attn.can_fuse() and mlp.can_fuse()
            and kernels.decode_fusion_ok(x))


def draft_tp(cfg: DraftHeadConfig, target: DecoderLM) -> ParallelGroup:
    """The group a head shards over: the target's attention TP group when the head's KV heads
    split exactly like the target's (same count and size: a prefill -> decode hand-off
    re-slices both alike, kvtransfer/reslice.py) and its heads, MLP and draft vocabulary split
    evenly; else one rank (the head replicated, as `TANDEM_SHARD_DRAFT=0` forces)."""
    tp, mc = target.par.tp, target.cfg
    vocab = cfg.draft_vocab_size if cfg.kind == "eagle3" or cfg.draft_vocab_size < \
        cfg.vocab_size else tp.size
    if (tp.size == 1 or os.environ.get("TANDEM_SHARD_DRAFT", "1") == "0"
            or (cfg.num_kv_heads, cfg.head_dim) != (mc.num_kv_heads, mc.head_dim)
            or cfg.num_heads % tp.size or cfg.intermediate_size % tp.size or vocab % tp.size):
        return ParallelGroup()
    try:
        HeadLayout.for_rank(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)
    except ValueError:
        return ParallelGroup()
    return tp


class EagleHead(nn.Module):
    """One draft layer (EAGLE-1/2: or more, `later`) plus the glue of its kind. Shares the
    target's embedding (and, for EAGLE-1/2, its lm_head). Under TP it shards like a target
    layer where it can (`draft_tp`): attention heads and the MLP over the ranks (o_proj and
    down all-reduce), a draft vocabulary's rows too (each rank scores its slice; the top-1 and
    the normalizer combine over the ranks); fc, the norms and the embedding stay replicated.
    Each rank then reads 1/tp of the head's weights per draft step."""

    def __init__(self, cfg: DraftHeadConfig, target: DecoderLM, dtype: torch.dtype,
                 max_position: int, tp: ParallelGroup | None = None) -> None:
        """tp: the group to shard over (None: `draft_tp`; ParallelGroup() replicates)."""
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.tp = tp = draft_tp(cfg, target) if tp is None else tp
        self.heads = HeadLayout.for_rank(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp)
        # KV heads this rank's draft pages hold, numbered like the target's (the hand-off's
        # re-slicing reads it): sharded, or one rank with the target's heads; None when the
        # head is replicated over a TP group (whole pages, from one sender).
        self.kv_heads: tuple[int, int] | None = None
        if tp.size > 1 or (target.par.tp.size == 1 and (cfg.num_kv_heads, cfg.head_dim)
                           == (target.cfg.num_kv_heads, target.cfg.head_dim)):
            self.kv_heads = (self.heads.kv_part.local_start // cfg.head_dim,
                             self.heads.local_kv_heads)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.target_embed = target.embed  # shared, not owned (not a submodule: no double load)
        self.own_embed: nn.Parameter | None = None
        eagle3 = cfg.kind == "eagle3"
        fc_in = cfg.feature_size if eagle3 else 2 * h
        self.fc = nn.Linear(fc_in, h, bias=cfg.fc_bias, dtype=dtype)
        self.attn = SelfAttention(0, h, self.heads, False, False, None, rotary, tp, dtype,
                                  qkv_in_features=2 * h if eagle3 else h)
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.mlp = DenseMLP(h, cfg.intermediate_size, tp, dtype)
        # Layers 1.. of a multi-layer EAGLE-1/2 head (KV layers 1.. of the draft group).
        self.later = nn.ModuleList(_LaterLayer(i, cfg, self.heads, rotary, tp, dtype)
                                   for i in range(1, cfg.num_layers))
        # This rank's rows of the draft vocabulary (all of it unless the head is sharded).
        self.vocab_sharded = tp.size > 1 and (eagle3 or cfg.draft_vocab_size < cfg.vocab_size)
        self.vocab_start, vocab_end = (tp.shard_range(cfg.draft_vocab_size, "draft_vocab_size")
                                       if self.vocab_sharded else (0, cfg.draft_vocab_size))
        if eagle3:
            self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.lm_head = nn.Linear(h, vocab_end - self.vocab_start, bias=False, dtype=dtype)
            # [draft_vocab] int64: target id = draft id + d2t[draft id]
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        else:
            self.target_lm_head = target.lm_head  # shared
            # A reduced draft vocabulary (FR-Spec style): the head scores only the
            # draft_vocab_size most frequent target tokens, so each draft step reads that many
            # lm_head rows instead of the whole vocabulary (on the 8B shape the full lm_head is
            # ~1 GB a step; on SmolLM2 21% of the target). Drafts stay drafts: verification is
            # unchanged, so output is still lossless; a token outside the subset is simply never
            # proposed. `d2t` as in EAGLE-3; the rows are gathered once `d2t` is known.
            if cfg.draft_vocab_size < cfg.vocab_size:
                self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        # [draft_vocab, H] target lm_head rows of the draft vocabulary (EAGLE-1/2 subset only);
        # derived from d2t, never saved.
        self.register_buffer("draft_rows", None, persistent=False)

    @property
    def subset_vocab(self) -> bool:
        """An EAGLE-1/2 head restricted to a draft vocabulary (see __init__)."""
        return self.cfg.kind == "eagle" and self.cfg.draft_vocab_size < self.cfg.vocab_size

    def build_draft_rows(self) -> None:
        """Gather the target lm_head rows of the draft vocabulary (after d2t is loaded). Under
        TP each rank holds a slice of the vocabulary: gather it whole once (the head is
        replicated)."""
        if not self.subset_vocab:
            return
        lm = self.target_lm_head
        full = lm.head_weight()  # [vocab/tp, H]
        if lm.tp.size > 1:
            full = lm.tp.all_gather_last_dim(full.t().contiguous()).t()  # [vocab, H]
        ids = self._subset_ids()[self.vocab_start : self.vocab_start + self._local_vocab()]
        self.draft_rows = full[ids].contiguous()  # [V_local, H] this rank's slice

    def _local_vocab(self) -> int:
        return self.cfg.draft_vocab_size // (self.tp.size if self.vocab_sharded else 1)

    def _subset_ids(self) -> torch.Tensor:  # [draft_vocab] int64 target ids of the draft vocab
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        if self.own_embed is not None:
            return F.embedding(token_ids, self.own_embed)
        return self.target_embed(token_ids)

    def forward(
        self, token_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """token_ids [T]; features [T, F] (target features, or [T, H] draft hidden from the
        previous step); positions [T] -> next draft hidden [T, H]."""
        emb = self.embed(token_ids).to(features.dtype)
        if self.cfg.kind == "eagle":
            x = self.fc(torch.cat([emb, features], dim=-1))  # [T, H]
            attn_in, residual = x, x
        else:
            if features.shape[-1] != self.cfg.hidden_size:
                features = self.fc(features)  # fuse low/mid/high target features
            attn_in = torch.cat([self.input_norm(emb), self.hidden_norm(features)], dim=-1)
            residual = features
        if _fuse(residual, self.attn, self.mlp):  # adds and norm ride in the GEMVs (TP too)
            h = self.attn.forward_add(positions, attn_in, residual, ctx)
            h = self.mlp.forward_fused(h, self.post_attn_norm)
        else:
            h = residual + self.attn(positions, attn_in, ctx)
            h = h + self.mlp(self.post_attn_norm(h))
        for layer in self.later:
            h = layer(positions, h, ctx)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V_draft] float32 logits over the head's vocabulary."""
        local = self._local_logits(hidden)
        return self.tp.all_gather_last_dim(local) if self.vocab_sharded else local

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V_local] float32: this rank's slice of the vocabulary (all of it
        unless `vocab_sharded`), draft ids vocab_start + column."""
        if self.subset_vocab:
            assert self.draft_rows is not None, "build_draft_rows() after loading d2t"
            return kernels.linear(hidden.to(self.draft_rows.dtype), self.draft_rows,
                                  out_dtype=torch.float32)
        if self.cfg.kind == "eagle":
            return self.target_lm_head(hidden.to(self.target_lm_head.head_weight().dtype))
        return self.lm_head(self.norm(hidden)).float()

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, V_draft] float32 log-probabilities over the head's vocabulary."""
        return torch.log_softmax(self.logits(hidden), dim=-1)

    def target_features(self, hidden: torch.Tensor, aux_hidden: tuple[torch.Tensor, ...]
                        ) -> torch.Tensor:
        """[T, F] feature the head consumes from a target forward: the final hidden (EAGLE)
        or the captured streams (EAGLE-3) concatenated in the config's layer order (the
        forward returns them in increasing layer order)."""
        if self.cfg.kind == "eagle":
            return hidden
        order = sorted(self.cfg.feature_layers)
        return torch.cat([aux_hidden[order.index(i)] for i in self.cfg.feature_layers], dim=-1)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.cfg.kind == "eagle" and not self.subset_vocab:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, H] -> (target ids [n, k] int64, log-probs [n, k] float32), best first. k = 1: a max
        and a logsumexp, not a log-softmax and a radix top-k (3 kernels instead of ~25, ~60 us
        a draft step on an H200 at 32k rows); ties go to the lowest id."""
        if k == 1:
            logits = self._local_logits(hidden)  # [n, V_local]
            best, ids = (t[:, None] for t in kernels.row_max(logits))  # [n, 1] each
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1]
            if self.vocab_sharded:
                best, ids, lse = self._combine(best, ids, lse)
            return self.to_target_ids(ids), best - lse
        logp, ids = torch.topk(self.log_probs(hidden), k, dim=-1)
        return self.to_target_ids(ids), logp

    def top1(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n] int64: `topk(hidden, 1)`'s ids without its normalizer (chain steps never
        read the log-prob; the logsumexps were ~12 of a sharded step's launches)."""
        best, ids = (t[:, None] for t in kernels.row_max(self._local_logits(hidden)))  # [n, 1]
        if self.vocab_sharded:
            _, ids, _ = self._combine(best, ids, None)
        return self.to_target_ids(ids)[:, 0]

    def _combine(self, best: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each rank's top-1 (best [n, 1] float32, local ids [n, 1], lse [n, 1] or None) -> the
        global (best, draft ids, lse), one all-gather; ties to the first rank (lowest id)."""
        cols = [best, (ids + self.vocab_start).float()] + ([lse] if lse is not None else [])
        mine = torch.cat(cols, dim=-1)  # [n, C]; float32 holds ids < 2^24 exactly
        every = self.tp.all_gather_last_dim(mine).view(-1, self.tp.size, len(cols))  # [n, tp, C]
        rank = every[:, :, 0].argmax(dim=-1, keepdim=True)  # [n, 1]
        won = every.gather(1, rank[:, :, None].expand(-1, 1, len(cols)))[:, 0]  # [n, C]
        lse = None if lse is None else torch.logsumexp(every[:, :, 2], dim=-1, keepdim=True)
        return won[:, :1], won[:, 1:2].long(), lse

    # ---- weights ----------------------------------------------------------------------------

    def weight_names(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> destination tensor (this rank's: `_sharded_loaders` slice the
        checkpoint's full tensors into those a sharded head holds a slice of)."""
        eagle3 = self.cfg.kind == "eagle3"
        p = "midlayer" if eagle3 else "layers.0"
        out = {"fc.weight": self.fc.weight, f"{p}.post_attention_layernorm.weight":
               self.post_attn_norm.weight, f"{p}.self_attn.o_proj.weight": self.attn.o_proj.weight,
               f"{p}.mlp.down_proj.weight": self.mlp.down.weight}
        if self.fc.bias is not None:
            out["fc.bias"] = self.fc.bias
        for i, layer in enumerate(self.later, start=1):
            out.update({f"layers.{i}.input_layernorm.weight": layer.input_norm.weight,
                        f"layers.{i}.post_attention_layernorm.weight": layer.post_attn_norm.weight,
                        f"layers.{i}.self_attn.o_proj.weight": layer.attn.o_proj.weight,
                        f"layers.{i}.mlp.down_proj.weight": layer.mlp.down.weight})
        if eagle3:
            out.update({f"{p}.input_layernorm.weight": self.input_norm.weight,
                        f"{p}.hidden_norm.weight": self.hidden_norm.weight,
                        "norm.weight": self.norm.weight, "lm_head.weight": self.lm_head.weight,
                        "d2t": self.d2t})
        elif self.subset_vocab:
            out["d2t"] = self.d2t
        return out

    def load_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Load a head checkpoint's tensors; errors name the missing/misshapen tensor."""
        h = self.cfg.hidden_size
        needed = set(self.weight_names())
        for prefix, _ in self._merged():
            needed |= {f"{prefix}.self_attn.{x}_proj.weight" for x in "qkv"}
            needed |= {f"{prefix}.mlp.{x}_proj.weight" for x in ("gate", "up")}
        missing = sorted(n for n in needed if n not in state)
        if missing:
            raise DraftHeadError(f"{source}: missing draft weight(s) {', '.join(missing[:5])}")
        # Anything else would be silently dropped and give a quietly bad head (a bias the
        # config did not announce, a second layer): refuse it.
        unexpected = sorted(n for n in state if n not in needed and n not in _OPTIONAL_KEYS
                            and not n.endswith("rotary_emb.inv_freq"))
        if unexpected:
            raise DraftHeadError(
                f"{source}: unexpected draft weight(s) {', '.join(unexpected[:5])} for a "
                f"{self.cfg.kind} head")
        try:
            sharded = self._sharded_loaders()
            for name, dst in self.weight_names().items():
                if name in sharded:
                    sharded[name](name, state[name])
                    continue
                check_shape(name, state[name].shape, tuple(dst.shape))
                dst.data.copy_(state[name])
            for prefix, (attn, mlp) in self._merged():
                for part, x in enumerate("qkv"):
                    attn.qkv.load_part(f"{prefix}.self_attn.{x}_proj.weight", part,
                                       state[f"{prefix}.self_attn.{x}_proj.weight"])
                for part, x in enumerate(("gate", "up")):
                    mlp.gate_up.load_part(f"{prefix}.mlp.{x}_proj.weight", part,
                                          state[f"{prefix}.mlp.{x}_proj.weight"])
            emb = state.get("embed_tokens.weight")
            if emb is not None:
                check_shape("embed_tokens.weight", emb.shape, (self.cfg.vocab_size, h))
                self.own_embed = nn.Parameter(
                    emb.to(self.fc.weight.dtype).to(self.fc.weight.device), False)
        except WeightShapeError as exc:
            raise DraftHeadError(f"{source}: {exc}") from exc
        if self.subset_vocab:
            ids = self._subset_ids()
            if bool(((ids < 0) | (ids >= self.cfg.vocab_size)).any()):
                raise DraftHeadError(f"{source}: d2t maps draft ids outside the target "
                                     f"vocabulary of {self.cfg.vocab_size}")
            self.build_draft_rows()

    def _sharded_loaders(self) -> dict:
        """Checkpoint name -> loader(name, full tensor) of the weights a sharded head holds a
        slice of (o_proj and down by input columns, an EAGLE-3 lm_head by vocabulary rows)."""
        if self.tp.size == 1:
            return {}
        eagle3 = self.cfg.kind == "eagle3"
        out = {f"{p}.self_attn.o_proj.weight": attn.o_proj.load_weight
               for p, (attn, _) in self._merged()}
        out.update({f"{p}.mlp.down_proj.weight": mlp.down.load_weight
                    for p, (_, mlp) in self._merged()})
        if eagle3:
            def lm_rows(name: str, full: torch.Tensor) -> None:
                check_shape(name, full.shape, (self.cfg.draft_vocab_size, self.cfg.hidden_size))
                self.lm_head.weight.data.copy_(full[self.vocab_start : self.vocab_start
                                                    + self.lm_head.weight.shape[0]])
            out["lm_head.weight"] = lm_rows
        return out

    def state_for_saving(self) -> dict[str, torch.Tensor]:
        """The checkpoint layout `load_state` reads (q/k/v and gate/up unmerged); a head of
        one rank's (a sharded one holds slices)."""
        if self.tp.size > 1:
            raise ValueError("state_for_saving: a head sharded over TP holds slices only")
        out = {k: v.detach().contiguous() for k, v in self.weight_names().items()}
        for p, (attn, mlp) in self._merged():
            q, k, v = attn.qkv.weight.split(attn.qkv.local_sizes(), dim=0)
            out.update({f"{p}.self_attn.q_proj.weight": q, f"{p}.self_attn.k_proj.weight": k,
                        f"{p}.self_attn.v_proj.weight": v})
            gate, up = mlp.gate_up.weight.chunk(2, dim=0)
            out.update({f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up})
        return {k: t.detach().clone().contiguous() for k, t in out.items()}

    def _merged(self) -> list[tuple[str, tuple[SelfAttention, DenseMLP]]]:
        """(checkpoint prefix, (attention, MLP)) of each layer: the modules whose merged q/k/v
        and gate/up weights are stored as separate tensors."""
        first = "midlayer" if self.cfg.kind == "eagle3" else "layers.0"
        return [(first, (self.attn, self.mlp))] + [
            (f"layers.{i}", (layer.attn, layer.mlp)) for i, layer in enumerate(self.later, 1)]


def load_head(path: Path, target: DecoderLM, dtype: torch.dtype, device: torch.device,
              max_position: int) -> EagleHead:
    raw, state = read_head_checkpoint(path)
    kind = detect_kind(state)
    cfg = DraftHeadConfig.from_json(raw, kind, target.cfg)
    with torch.device(device):
        head = EagleHead(cfg, target, dtype, max_position)
    head.load_state(state, str(path))
    return head.eval()


def dummy_head(cfg: DraftHeadConfig, target: DecoderLM, dtype: torch.dtype,
               device: torch.device, max_position: int, seed: int = 0,
               tp: ParallelGroup | None = None) -> EagleHead:
    """A head with random weights (for tests and timing; accepts almost nothing). Sharded
    (tp, as EagleHead's): every rank loads its slices of the same random checkpoint."""
    with torch.device(device):
        head = EagleHead(cfg, target, dtype, max_position, tp)
    if head.tp.size > 1:
        whole = dummy_head(cfg, target, dtype, device, max_position, seed, ParallelGroup())
        head.load_state(whole.state_for_saving(), "dummy head")
        return head.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in head.named_parameters():
        if name.startswith(("target_", "own_embed")):
            continue
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.05, generator=gen)
    head.build_draft_rows()  # a subset head's d2t is all zeros: the first draft_vocab_size ids
    return head.eval()
