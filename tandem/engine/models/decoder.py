"""One decoder-only transformer implementation for every supported family.

Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm), Mixtral and Qwen3-MoE (sparse MoE
blocks) differ only in flags of `ModelConfig`. Weights load through `weight_loaders()`, a map
from each HF checkpoint tensor name to (full shape, loader): the loader slices the full tensor
for this rank. Checkpoint files, dummy weights and every TP/EP layout go through the same map,
so a name the map lacks is "unexpected" and a name never loaded is "missing".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tandem.engine import kernels
from tandem.engine.config import ModelConfig
from tandem.engine.layers.attention import ForwardContext, HeadLayout, SelfAttention
from tandem.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tandem.engine.layers.mlp import DenseMLP, SparseMoE
from tandem.engine.layers.norm import RMSNorm
from tandem.engine.layers.rotary import RotaryEmbedding
from tandem.engine.parallel import ParallelContext


@dataclass(frozen=True, slots=True)
class WeightSlot:
    shape: tuple[int, ...]  # full (unsharded) checkpoint shape
    load: Callable[[torch.Tensor], None]  # copies this rank's slice of the full tensor
    is_norm: bool = False  # dummy init: ones instead of noise


class DecoderLayer(nn.Module):
    def __init__(
        self, idx: int, cfg: ModelConfig, heads: HeadLayout, rotary: RotaryEmbedding,
        par: ParallelContext, dtype: torch.dtype, moe_dispatch: str = "allreduce",
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.post_attn_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.attn = SelfAttention(
            idx, h, heads, cfg.qkv_bias, cfg.o_bias, cfg.rms_norm_eps if cfg.qk_norm else None,
            rotary, par.tp, dtype,
        )
        self.mlp: DenseMLP | SparseMoE
        self.par, self.dp = par, par.dp
        if idx in cfg.moe_layer_ids:
            self.mlp = SparseMoE(
                h, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                cfg.norm_topk_prob, par.ep, par.mlp_tp, dtype, moe_dispatch,
            )
            if self.mlp.dispatches_tokens and par.dp.size > 1 and par.ep.size != par.dp.size:
                raise ValueError("moe_dispatch: all-to-all under DP attention needs the experts "
                                 "over every rank (ep = dp)")
        else:
            self.mlp = DenseMLP(h, cfg.intermediate_size, par.mlp_tp, dtype)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
        ctx: ForwardContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input delta [T, H]; residual: the residual stream before it (None at
        layer 0, or when x already is the stream). Returns (mlp output, residual stream after
        attention), or (stream after the layer, None) from the fused path (T <= gemv_max_rows
        on CUDA: decode batches and speculative verify of up to 8 rows)."""
        if self.dp.size == 1 and self.attn.can_fuse() and kernels.decode_fusion_ok(x):
            return self._forward_fused(positions, x if residual is None else x + residual, ctx)
        if residual is None:
            residual, h = x, self.input_norm(x)
        else:
            h, residual = self.input_norm.add_and_norm(x, residual)
        h = self.attn(positions, h, ctx)
        h, residual = self.post_attn_norm.add_and_norm(h, residual)
        return self.run_mlp(h, ctx.dp_counts), residual

    def run_mlp(self, h: torch.Tensor, dp_counts: tuple[int, ...] | None) -> torch.Tensor:
        """h [T, H] -> [T, H]. With DP attention: gather every DP rank's tokens (from its TP
        lead), run the block sharded over all ranks, keep this DP rank's rows (T may be 0: the
        rank still joins)."""
        if self.dp.size == 1:
            return self.mlp(h)
        assert dp_counts is not None, "DP attention: the runner gathers the token counts"
        if isinstance(self.mlp, SparseMoE) and self.mlp.dispatches_tokens:
            # all-to-all: this DP rank's own rows travel, split over its TP ranks; dp_counts
            # holds each DP rank's count at its TP lead (0 at the others)
            return self.mlp(h, max(dp_counts), self.par.tp)
        mine = h[: self.par.dp_gather_rows(h.shape[0])]
        out = self.mlp(self.dp.all_gather_rows(mine, dp_counts))
        start = self.par.dp_lead_offset(dp_counts)
        return out[start : start + h.shape[0]]

    def _forward_fused(
        self, positions: torch.Tensor, stream: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """stream [T, H], T <= gemv_max_rows on CUDA (batch-1 decode, speculative verify, small
        batches): every norm, activation and residual add rides in a GEMV launch, per row
        (4 GEMVs + rope/store + attention per dense layer instead of ~11 kernels)."""
        stream = self.attn.forward_fused(positions, stream, self.input_norm, ctx)
        if isinstance(self.mlp, DenseMLP) and self.mlp.can_fuse():
            return self.mlp.forward_fused(stream, self.post_attn_norm), None
        return self.mlp(self.post_attn_norm(stream)), stream


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class DecoderOutput:
    hidden: torch.Tensor  # [T, H] final-normed hidden state of every token
    aux_hidden: tuple[torch.Tensor, ...]  # each [T, H]: residual stream entering a captured layer


class DecoderLM(nn.Module):
    def __init__(self, cfg: ModelConfig, par: ParallelContext, dtype: torch.dtype,
                 max_position: int, moe_dispatch: str = "allreduce") -> None:
        super().__init__()
        self.cfg, self.par = cfg, par
        self.heads = HeadLayout.for_rank(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, par.tp)
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.rotary = rotary
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, par.tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(i, cfg, self.heads, rotary, par, dtype, moe_dispatch)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(
            cfg.vocab_size, cfg.hidden_size, par.tp, dtype,
            tied_to=self.embed if cfg.tie_word_embeddings else None,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
        capture_layers: tuple[int, ...] = (),
        input_embeds: torch.Tensor | None = None,
        after_layer: Callable[[int], None] | None = None,
    ) -> DecoderOutput:
        """input_ids [T] int64, positions [T] int64 -> hidden [T, H]. `capture_layers` names
        layers whose input residual stream is returned (EAGLE-3 features). `after_layer(i)` runs
        once layer i returned: its K/V is in the pool (enqueued, on CUDA), see ForwardBatch."""
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        residual: torch.Tensor | None = None
        aux = []
        for i, layer in enumerate(self.layers):
            if i in capture_layers:
                aux.append(x if residual is None else x + residual)
            x, residual = layer(positions, x, residual, ctx)
            if after_layer is not None:
                after_layer(i)
        hidden, _ = self.norm.add_and_norm(x, residual) if residual is not None else (
            self.norm(x), x)
        return DecoderOutput(hidden=hidden, aux_hidden=tuple(aux))

    def dp_idle_forward(self, dp_counts: tuple[int, ...], device: torch.device) -> None:
        """DP attention, a rank with no tokens this step: join every layer's MLP/MoE collectives
        with an empty batch, so the ranks that do have tokens never wait on it forever."""
        empty = torch.empty(0, self.cfg.hidden_size, dtype=self.norm.weight.dtype, device=device)
        for layer in self.layers:
            layer.run_mlp(empty, dp_counts)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V] float32
        return self.lm_head(hidden)

    def weight_loaders(self) -> dict[str, WeightSlot]:
        """HF tensor name -> WeightSlot for every tensor this model needs."""
        cfg, slots = self.cfg, {}
        h, d = cfg.hidden_size, cfg.head_dim
        q_rows, kv_rows = cfg.num_heads * d, cfg.num_kv_heads * d

        def add(name: str, shape: tuple[int, ...], load: Callable[[torch.Tensor], None],
                is_norm: bool = False) -> None:
            slots[name] = WeightSlot(shape, lambda t, n=name, f=load: f(n, t), is_norm)

        add("model.embed_tokens.weight", (cfg.vocab_size, h), self.embed.load_weight)
        add("model.norm.weight", (h,), _copy_into(self.norm.weight), True)
        if not cfg.tie_word_embeddings:
            add("lm_head.weight", (cfg.vocab_size, h), self.lm_head.load_weight)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            attn = layer.attn
            add(f"{p}.input_layernorm.weight", (h,), _copy_into(layer.input_norm.weight), True)
            add(f"{p}.post_attention_layernorm.weight", (h,),
                _copy_into(layer.post_attn_norm.weight), True)
            for part, (proj, rows) in enumerate((("q", q_rows), ("k", kv_rows), ("v", kv_rows))):
                add(f"{p}.self_attn.{proj}_proj.weight", (rows, h),
                    lambda n, t, part=part, a=attn: a.qkv.load_part(n, part, t))
                if cfg.qkv_bias:
                    add(f"{p}.self_attn.{proj}_proj.bias", (rows,),
                        lambda n, t, part=part, a=attn: a.qkv.load_part(n, part, t, True))
            add(f"{p}.self_attn.o_proj.weight", (h, q_rows), attn.o_proj.load_weight)
            if cfg.o_bias:
                add(f"{p}.self_attn.o_proj.bias", (h,), attn.o_proj.load_bias)
            if attn.q_norm is not None and attn.k_norm is not None:
                add(f"{p}.self_attn.q_norm.weight", (d,), _copy_into(attn.q_norm.weight), True)
                add(f"{p}.self_attn.k_norm.weight", (d,), _copy_into(attn.k_norm.weight), True)
            mlp = layer.mlp
            if isinstance(mlp, DenseMLP):
                inter = cfg.intermediate_size
                add(f"{p}.mlp.gate_proj.weight", (inter, h),
                    lambda n, t, m=mlp: m.gate_up.load_part(n, 0, t))
                add(f"{p}.mlp.up_proj.weight", (inter, h),
                    lambda n, t, m=mlp: m.gate_up.load_part(n, 1, t))
                add(f"{p}.mlp.down_proj.weight", (h, inter), mlp.down.load_weight)
            else:
                _add_moe(add, p, cfg, mlp)
        return slots


def _copy_into(param: nn.Parameter) -> Callable[[str, torch.Tensor], None]:
    def load(name: str, full: torch.Tensor) -> None:
        from tandem.engine.layers.linear import check_shape

        check_shape(name, full.shape, tuple(param.shape))
        param.data.copy_(full)

    return load


def _add_moe(add: Callable, prefix: str, cfg: ModelConfig, moe: SparseMoE) -> None:
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    if cfg.family == "mixtral":
        base, names = f"{prefix}.block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}
    else:
        base = f"{prefix}.mlp"
        names = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    add(f"{base}.gate.weight", (cfg.num_experts, h), moe.router.load_weight)
    for e in range(cfg.num_experts):
        for which, hf in names.items():
            shape = (h, inter) if which == "down" else (inter, h)
            add(f"{base}.experts.{e}.{hf}.weight", shape,
                lambda n, t, e=e, w=which: moe.load_expert(n, e, w, t))
