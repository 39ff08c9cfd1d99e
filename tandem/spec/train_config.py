"""`tandem train-eagle`'s settings (`TrainConfig`), shared by the answering step
(train_answers.py) and the training loop (train.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.spec.head_config import HeadKind
from tandem.spec.train_data import SelfPromptConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    out_dir: str
    kind: HeadKind = "eagle3"
    draft_vocab_size: int = 8192
    num_prompts: int = 2000
    max_new_tokens: int = 256
    gen_batch_size: int = 32
    max_seq_len: int = 512
    batch_size: int = 8
    epochs: int = 2
    lr: float = 5e-4
    warmup_steps: int = 50
    ttt_steps: int = 3
    save_every: int = 100
    seed: int = 0
    # Sample files answered earlier (e.g. by another prompt set), trained on next to this
    # run's own answers; never regenerated.
    extra_samples: tuple[str, ...] = ()
    # A trained head directory (same kind and shape) to start from instead of a random init,
    # e.g. to train the shipped head further on more data or epochs; None: random init.
    init_head: str | None = None
    # Prompts the target writes itself (train_data.self_prompts), answered next to the built
    # ones: the most varied chat the machine can offer. 0: none.
    self_prompts: int = 0
    # Train against the target's whole next-token distribution (EAGLE's loss) instead of its
    # greedy token alone.
    soft_labels: bool = False
    # More answered samples whose tokens count toward the draft vocabulary only (not trained
    # on): a stage trained on a narrow set keeps the vocabulary of every set the head serves.
    vocab_samples: tuple[str, ...] = ()
    # Style of the self-written prompts (train_data.SelfPromptConfig): "open" or "short".
    self_prompt_style: str = "open"
    # EAGLE-1/2 heads: weight of the smooth-L1 term between each step's hidden and the
    # target's next feature (EAGLE-1 trains with both); 0: token loss alone.
    feature_weight: float = 0.0
    # Decoder layers of an EAGLE-1/2 head. Starting from a head with fewer (--init-head), the
    # new layers copy its last layer with their output projections zeroed: the grown head
    # computes exactly what the old one did, and training goes on from there.
    num_layers: int = 1
    # Seconds the training loop may take (None: no limit). After its first steps the run
    # plans how many it can afford and ends its learning-rate schedule there, so a bounded
    # call (a GPU lease) still ends with the head written.
    max_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_prompts", "max_new_tokens", "batch_size", "epochs", "ttt_steps",
                     "draft_vocab_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.kind not in ("eagle", "eagle3"):
            raise ValueError(f"kind: '{self.kind}' is not one of eagle, eagle3")
        if self.num_layers < 1 or (self.kind == "eagle3" and self.num_layers != 1):
            raise ValueError(f"num_layers: {self.num_layers} is not supported for a {self.kind} "
                             f"head (EAGLE-1/2: 1 or more; EAGLE-3: 1)")
        if self.feature_weight < 0:
            raise ValueError(f"feature_weight: must be >= 0, got {self.feature_weight}")
        if self.feature_weight > 0 and self.kind != "eagle":
            raise ValueError("feature_weight: only an EAGLE-1/2 head's hidden is a target "
                             "feature; an EAGLE-3 head trains on tokens alone")
        SelfPromptConfig.of_style(self.self_prompt_style)  # checks the style's name
        if self.self_prompts < 0:
            raise ValueError(f"self_prompts: must be >= 0, got {self.self_prompts}")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise ValueError(f"max_seconds: must be positive, got {self.max_seconds}")
