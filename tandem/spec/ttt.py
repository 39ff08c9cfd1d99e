"""The draft head's training forward with EAGLE-3's training-time test (TTT).

At inference, draft step s at position p consumes the draft's OWN hidden from step s-1 and
attends to the true-feature keys of positions <= p - s plus the keys its previous steps wrote
(one per step, on the diagonal). TTT reproduces exactly that during training, for every
position at once, so the head learns to continue from its own outputs:

    step 0, position t: input (f_t, x_{t+1}); keys K_0[0..t]
    step s, position t: input (h_{s-1}[t-1], x_{t+1}); keys K_0[0..t-s] and K_j[t-s+j], j=1..s

and every step's output at position t is trained to predict x_{t+2}. This module reuses the
head's own submodules, so the trained weights are the ones inference runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engine.layers.attention import HeadLayout
from tandem.spec.head import EagleHead


def _layer_inputs(head: EagleHead, emb: torch.Tensor, feat: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention input, residual) exactly as EagleHead.forward builds them."""
    if head.cfg.kind == "eagle":
        x = head.fc(torch.cat([emb, feat], dim=-1))
        return x, x
    if feat.shape[-1] != head.cfg.hidden_size:
        feat = head.fc(feat)
    return torch.cat([head.input_norm(emb), head.hidden_norm(feat)], dim=-1), feat


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, t] -> x[:, t - by] along dim 1 (zeros where t < by)."""
    if by == 0:
        return x
    out = torch.zeros_like(x)
    out[:, by:] = x[:, :-by]
    return out


def ttt_forward(
    head: EagleHead,
    tokens: torch.Tensor,  # [B, T] int64, x_{t+1} for draft position t
    features: torch.Tensor,  # [B, T, F] target features f_t
    num_steps: int,
) -> list[torch.Tensor]:
    """Returns the draft hidden of each unrolled step, each [B, T, H]. Step s is meaningful
    at positions t >= s. Every layer of the head keeps its own keys per step, as every layer
    has its own KV layer at inference."""
    b, t_len = tokens.shape
    positions = torch.arange(t_len, device=tokens.device).repeat(b)  # [B*T]
    emb = head.embed(tokens.reshape(-1)).view(b, t_len, -1).to(features.dtype)
    causal = torch.ones(t_len, t_len, dtype=torch.bool, device=tokens.device).tril()
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(1 + len(head.later))]
    outs = []
    feat = features
    for s in range(num_steps):
        attn_in, residual = _layer_inputs(head, emb, feat)
        h = residual + head.attn.o_proj(_attend(head.heads, head.attn, attn_in, positions,
                                                causal, kv[0], s))
        h = h + head.mlp(head.post_attn_norm(h))
        for layer, layer_kv in zip(head.later, kv[1:]):
            h = h + layer.attn.o_proj(_attend(head.heads, layer.attn, layer.input_norm(h),
                                              positions, causal, layer_kv, s))
            h = h + layer.mlp(layer.post_attn_norm(h))
        outs.append(h)
        feat = _shift(h, 1)  # step s+1 at position t continues from step s at t-1
    return outs


def _attend(heads: HeadLayout, attn: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor,
            causal: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]], s: int
            ) -> torch.Tensor:
    """One layer's attention at unrolled step s: x [B, T, in] -> [B, T, Hq*D] (before o_proj).
    Appends this step's (keys, values) to `kv`; the step attends to step 0's keys of positions
    <= t - s and, on the diagonal, to the key each later step j wrote at t - s + j."""
    b, t_len = x.shape[:2]
    d, hq, hkv = heads.head_dim, heads.local_heads, heads.local_kv_heads
    group = hq // hkv
    q, k, v = attn.qkv(x).split(attn.qkv.local_sizes(), dim=-1)
    q, k = attn.rotary(positions, q.reshape(b * t_len, hq, d), k.reshape(b * t_len, hkv, d))
    q = q.view(b, t_len, hq, d).transpose(1, 2)  # [B, Hq, T, D]
    k = k.view(b, t_len, hkv, d).transpose(1, 2).repeat_interleave(group, dim=1)
    v = v.view(b, t_len, hkv, d).transpose(1, 2).repeat_interleave(group, dim=1)
    kv.append((k, v))
    scale = d**-0.5
    # Scores against the true-feature keys of positions <= t - s.
    s0 = (q @ kv[0][0].transpose(-1, -2)) * scale  # [B, Hq, T, T]
    mask0 = _shift(causal.unsqueeze(0), s)[0] if s else causal
    s0 = s0.masked_fill(~mask0, float("-inf"))
    diag = [((q * _shift_t(kv[j][0], s - j)).sum(-1) * scale).unsqueeze(-1)  # [B, Hq, T, 1]
            for j in range(1, s + 1)]
    probs = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
    # Rows t < s have no valid key among K_0 and may be all -inf: zero them (ignored).
    probs = torch.nan_to_num(probs, nan=0.0)
    o = probs[..., :t_len] @ kv[0][1]
    for idx, j in enumerate(range(1, s + 1)):
        o = o + probs[..., t_len + idx : t_len + idx + 1] * _shift_t(kv[j][1], s - j)
    return o.transpose(1, 2).reshape(b, t_len, hq * d)


def _shift_t(x: torch.Tensor, by: int) -> torch.Tensor:
    """[B, H, T, D]: x[..., t, :] -> x[..., t - by, :]."""
    if by == 0:
        return x
    out = torch.zeros_like(x)
    out[:, :, by:] = x[:, :, :-by]
    return out


def ttt_loss(
    head: EagleHead, outs: list[torch.Tensor], labels: torch.Tensor, mask: torch.Tensor,
    t2d: torch.Tensor | None, step_decay: float = 0.8,
    target_logp: torch.Tensor | None = None,
    next_hidden: torch.Tensor | None = None, feature_weight: float = 0.0,
) -> tuple[torch.Tensor, list[float]]:
    """Loss of each step's prediction of x_{t+2} (labels [B, T] target ids, mask [B, T] bool),
    weighted by step_decay**s. Returns (loss, top-1 accuracy per step against the labels).

    - Hard labels (target_logp None): cross-entropy against x_{t+2}; t2d maps target ids to
      draft ids (-1 = not in the draft vocabulary, ignored).
    - Soft labels: cross-entropy against the target's whole distribution for x_{t+2}
      (target_logp [n, V_draft] float32 log-probs at the mask's positions, in mask order; see
      `target_log_probs`), as EAGLE trains: the head learns which tokens the target also
      considered, not only its first choice.
    - feature_weight > 0 (EAGLE-1/2 heads): also smooth-L1 between the step's hidden and the
      target's next feature (next_hidden [B, T, H], the target's final-normed hidden at t+1),
      EAGLE-1's regression term, which keeps the hidden the next step reads close to a
      real feature.
    """
    total = torch.zeros((), device=labels.device)
    accs = []
    draft_labels = labels if t2d is None else t2d[labels]
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    for s, h in enumerate(outs):
        valid = mask & (positions >= s)
        if target_logp is None:
            valid &= draft_labels >= 0
        if not valid.any():
            accs.append(0.0)
            continue
        logp = head.log_probs(h[valid])  # [n, V_draft]
        if target_logp is None:
            step_loss = F.nll_loss(logp, draft_labels[valid])
        else:
            p = target_logp[valid[mask]].exp()  # [n, V_draft]
            step_loss = -(p * logp).sum(-1).mean()
        if feature_weight > 0:
            assert next_hidden is not None
            step_loss = step_loss + feature_weight * F.smooth_l1_loss(
                h[valid].float(), next_hidden[valid].float())
        total = total + (step_decay**s) * step_loss
        target = draft_labels[valid]
        accs.append((logp.argmax(-1) == target).float().mean().item())
    return total, accs


@torch.no_grad()
def target_log_probs(target_lm_head: torch.nn.Module, next_hidden: torch.Tensor,
                     mask: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """[n, V_draft] float32: the target's log-probabilities for x_{t+2} at the mask's
    positions (next_hidden [B, T, H] = the target's final-normed hidden at t+1), over the
    draft vocabulary `vocab_ids` (renormalized there) or the whole vocabulary (None)."""
    hidden = next_hidden[mask]
    dtype = target_lm_head.head_weight().dtype
    logits = target_lm_head(hidden.to(dtype))  # [n, V] float32
    if vocab_ids is not None:
        logits = logits[:, vocab_ids]
    return torch.log_softmax(logits, dim=-1)
