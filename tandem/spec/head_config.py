"""A draft head's configuration: its kind (EAGLE-1/2 or EAGLE-3), its shape, and the target
layers whose features it reads -- validated when built, from the target's config
(`like_target`) or from a head checkpoint's config.json (`from_json`, `to_json` writes it) --,
and a checkpoint directory's files and kind (`read_head_checkpoint`, `detect_kind`).

The network itself (`EagleHead`) and its weight loading live in `tandem.spec.head`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from tandem.engine.config import ModelConfig, RopeScaling, _parse_rope

HeadKind = Literal["eagle", "eagle3"]


class DraftHeadError(ValueError):
    """A draft-head checkpoint or config that does not fit the target."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DraftHeadConfig:
    """A draft head's shape and kind; a config that cannot describe a working head raises
    `DraftHeadError` naming the field."""

    kind: HeadKind
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # == vocab_size for EAGLE-1/2
    fc_bias: bool
    feature_layers: tuple[int, ...]  # target layers whose input stream EAGLE-3 fuses; () for EAGLE
    num_layers: int = 1  # decoder layers; > 1 only for EAGLE-1/2 (EAGLE-3 has one midlayer)
    # P(draft j accepted), j = 1.., as measured for this head (config.json
    # `tandem_acceptance`, e.g. from `tandem eval-eagle`): the adaptive policy's prior; ()
    # when unmeasured. Not part of the head's shape.
    acceptance: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.num_layers < 1 or (self.kind == "eagle3" and self.num_layers != 1):
            raise DraftHeadError(
                f"num_hidden_layers: {self.num_layers} is not supported for a {self.kind} head "
                f"(EAGLE-1/2: 1 or more; EAGLE-3: 1)")
        if any(not 0.0 <= p <= 1.0 for p in self.acceptance) or any(
                b > a for a, b in zip(self.acceptance, self.acceptance[1:])):
            raise DraftHeadError(f"tandem_acceptance: P(draft j accepted) must be in [0, 1] "
                                 f"and not rise with j, got {list(self.acceptance)}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise DraftHeadError(f"draft_vocab_size: {self.draft_vocab_size} is not in [1, "
                                 f"{self.vocab_size}] (the target's vocabulary)")
        if self.kind == "eagle3" and (len(set(self.feature_layers)) < 2
                                      or len(set(self.feature_layers)) != len(self.feature_layers)):
            raise DraftHeadError(
                f"feature_layers: an EAGLE-3 head fuses at least two distinct target layers, "
                f"got {self.feature_layers}")

    @property
    def feature_size(self) -> int:
        """Width of the target feature the head consumes."""
        return self.hidden_size * max(1, len(self.feature_layers))

    @staticmethod
    def like_target(target: ModelConfig, kind: HeadKind = "eagle",
                    draft_vocab_size: int | None = None, num_layers: int = 1) -> DraftHeadConfig:
        """A head shaped like one target layer (what the EAGLE papers and our trainer use), or
        `num_layers` of them."""
        n = target.num_layers
        return DraftHeadConfig(
            kind=kind, hidden_size=target.hidden_size, num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
            intermediate_size=target.intermediate_size, rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            fc_bias=kind == "eagle",
            feature_layers=default_feature_layers(n) if kind == "eagle3" else (),
            num_layers=num_layers,
        )

    def to_json(self) -> dict[str, object]:
        """The config.json we write with a trained head (readable by `from_json`)."""
        out: dict[str, object] = {
            "architectures": ["EagleHead" if self.kind == "eagle" else "Eagle3Head"],
            "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "bias": self.fc_bias,
            "num_hidden_layers": self.num_layers,
        }
        if self.acceptance:
            out["tandem_acceptance"] = list(self.acceptance)
        if self.feature_layers:
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)}
        return out

    @staticmethod
    def from_json(raw: dict, kind: HeadKind, target: ModelConfig) -> DraftHeadConfig:
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
        except KeyError as exc:
            raise DraftHeadError(f"draft config.json: missing field {exc}") from exc
        if hidden != target.hidden_size:
            raise DraftHeadError(
                f"draft config.json: hidden_size {hidden} != the target's {target.hidden_size}"
            )
        theta, scaling = _parse_rope(raw)
        n = target.num_layers
        layers: tuple[int, ...] = ()
        if kind == "eagle3":
            ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            layers = tuple(int(i) for i in ids) if ids else default_feature_layers(n)
            if any(not 0 <= i < n for i in layers):
                raise DraftHeadError(f"draft config.json: feature layers {layers} outside [0, {n})")
        return DraftHeadConfig(
            kind=kind, hidden_size=hidden, num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling,
            vocab_size=target.vocab_size,
            draft_vocab_size=int(raw.get("draft_vocab_size") or target.vocab_size),
            fc_bias=bool(raw.get("bias", kind == "eagle")),
            feature_layers=layers,
            num_layers=int(raw.get("num_hidden_layers") or 1),
            acceptance=tuple(float(p) for p in raw.get("tandem_acceptance") or ()),
        )


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers whose INPUT residual stream EAGLE-3 fuses (the
    EAGLE-3 paper's (2, L/2, L-3)); deduplicated for very shallow targets.

    Convention: id i means the stream entering layer i (= output of layer i-1), which is what
    `DecoderLM.forward(capture_layers=...)` returns. SGLang reads a checkpoint's explicit
    `eagle_aux_hidden_state_layer_ids` as layer OUTPUTS (captures at i+1); heads trained that
    way need their ids shifted by one."""
    n = num_layers
    picks = sorted({min(max(i, 0), n - 1) for i in (2, n // 2, n - 3)})
    if len(picks) < 2:
        picks = sorted({0, n - 1})
    return tuple(picks)


def read_head_checkpoint(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) from a head directory (safetensors or pytorch_model.bin)."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DraftHeadError(f"{path}: no config.json in the draft head directory")
    raw = json.loads(cfg_path.read_text())
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").is_file():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise DraftHeadError(f"{path}: no model.safetensors or pytorch_model.bin")
    return raw, state


def detect_kind(state: dict[str, torch.Tensor]) -> HeadKind:
    if any(k.startswith("midlayer.") for k in state):
        return "eagle3"
    if any(k.startswith("layers.0.") for k in state):
        return "eagle"
    raise DraftHeadError("draft checkpoint has neither 'layers.0.*' (EAGLE) nor 'midlayer.*' "
                         "(EAGLE-3) tensors")
