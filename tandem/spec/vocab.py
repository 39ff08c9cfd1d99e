"""Reduced draft vocabularies for EAGLE-1/2 heads (FR-Spec style).

An EAGLE-1/2 head scores its drafts with the target's lm_head: every draft step reads the whole
[vocab, hidden] matrix, which is a large part of a round when the vocabulary is big next to the
model (SmolLM2: 49,152 x 576 = 21% of the target's weights; Llama-3.1-8B: 128,256 x 4,096 = 1 GB a
step). Restricting the drafts to the tokens the target actually emits most often keeps nearly
every accepted draft (the target verifies, so output does not change) and reads a fraction of
the rows. The restriction is stored the EAGLE-3 way: `draft_vocab_size` in config.json and a
`d2t` tensor (target id = draft id + d2t[draft id]) next to the head's weights.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import torch

from tandem.spec.head_config import DraftHeadError, detect_kind, read_head_checkpoint
from tandem.spec.train_data import Sample


def frequent_tokens(samples: list[Sample], size: int, vocab_size: int) -> torch.Tensor:
    """[size] int64 target ids, sorted: the `size` most frequent answer tokens (ties by id),
    padded with the lowest unused ids when the answers have fewer distinct tokens."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"size: {size} is not in [1, {vocab_size}]")
    counts = Counter(t for s in samples for t in s.answer_ids)
    ids = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
           if 0 <= t < vocab_size][:size]
    used = set(ids)
    ids += [t for t in range(vocab_size) if t not in used][: size - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.int64)


def coverage(samples: list[Sample], ids: torch.Tensor) -> float:
    """Fraction of answer tokens inside the draft vocabulary (an upper bound on how often a
    draft can still match the target)."""
    keep = set(ids.tolist())
    total = sum(len(s.answer_ids) for s in samples)
    inside = sum(1 for s in samples for t in s.answer_ids if t in keep)
    return inside / max(1, total)


def restrict_head_vocab(head_dir: Path, ids: torch.Tensor, out_dir: Path) -> Path:
    """Write a copy of the EAGLE-1/2 head in `head_dir` to `out_dir` that drafts over `ids`
    only (sorted target ids). The head's weights are unchanged."""
    raw, state = read_head_checkpoint(head_dir)
    if detect_kind(state) != "eagle":
        raise DraftHeadError(f"{head_dir}: only EAGLE-1/2 heads share the target's lm_head; an "
                             f"EAGLE-3 head has its own draft vocabulary already")
    vocab = int(raw.get("vocab_size") or 0)
    ids = ids.to(torch.int64)
    if ids.ndim != 1 or len(ids) == 0 or not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("ids: must be a non-empty, strictly increasing list of target ids")
    if vocab and int(ids[-1]) >= vocab:
        raise ValueError(f"ids: {int(ids[-1])} is outside the vocabulary of {vocab}")
    if vocab and len(ids) == vocab:  # every id: the whole vocabulary, no restriction
        state.pop("d2t", None)
    else:
        state["d2t"] = ids - torch.arange(len(ids))
    raw["draft_vocab_size"] = len(ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    same = head_dir.resolve() == out_dir.resolve()
    for extra in [] if same else head_dir.iterdir():  # README and the like travel along
        if extra.is_file() and extra.suffix in (".md", ".txt"):
            shutil.copy(extra, out_dir / extra.name)
    return out_dir
