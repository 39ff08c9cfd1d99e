"""`tandem train-eagle`'s first step: the target answers the prompts (built ones and, with
`--self-prompts`, ones it writes itself), resumable, next to answers of earlier runs
(`--extra-samples`). The training loop is in train.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.spec.train_config import TrainConfig
from tandem.spec.train_data import (Sample, SelfPromptConfig, build_prompts, generate_samples,
                                     read_samples, self_prompts, unanswered)

if TYPE_CHECKING:
    from tandem.engine import LLMEngine

log = logging.getLogger(__name__)


def extra_samples(cfg: TrainConfig) -> list[Sample]:
    """The samples of `cfg.extra_samples` (answered earlier, e.g. by another prompt set)."""
    return read_all(cfg.extra_samples, "extra_samples")


def read_all(files: tuple[str, ...], field: str) -> list[Sample]:
    for f in files:
        if not Path(f).is_file():
            raise FileNotFoundError(f"{field}: {f} does not exist")
    return [s for f in files for s in read_samples(Path(f))]


def answer_prompts(engine: LLMEngine, cfg: TrainConfig, progress: bool = True,
                   earlier: list[Sample] | None = None) -> Path:
    """Step 1 alone: the target answers `num_prompts` prompts (resumable), less those the
    extra sample files (`earlier`, read here when not given) answered already (same ids).
    Returns the file."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data_path = out / "samples.jsonl"
    prompts = build_prompts(cfg.num_prompts, cfg.seed) + written_prompts(engine, cfg, progress)
    earlier = extra_samples(cfg) if earlier is None else earlier
    if earlier:
        prompts = unanswered(engine.tokenizer, prompts, earlier)
        log.info("%d prompts not answered in --extra-samples", len(prompts))
    for _ in generate_samples(engine, prompts, data_path, cfg.max_new_tokens,
                              cfg.gen_batch_size, progress):
        pass
    return data_path


def written_prompts(engine: LLMEngine, cfg: TrainConfig, progress: bool = True) -> list[str]:
    """`cfg.self_prompts` prompts the target wrote itself, kept in OUT/self_prompts.jsonl
    (resumable: a run that stopped goes on from the prompts already kept)."""
    if cfg.self_prompts == 0:
        return []
    path = Path(cfg.out_dir) / "self_prompts.jsonl"
    kept = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if len(kept) >= cfg.self_prompts:
        return kept[: cfg.self_prompts]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.self_prompts, initial=len(kept), unit="prompt", desc="self-prompts")
    # A resumed run draws from another seed: the prompts already kept are not drawn again.
    seed = cfg.seed * 7919 + len(kept)
    known = set(kept)
    for batch in self_prompts(engine, cfg.self_prompts - len(kept), seed,
                              SelfPromptConfig.of_style(cfg.self_prompt_style),
                              batch_size=max(cfg.gen_batch_size, 64)):
        batch = [p for p in batch if p not in known]
        known.update(batch)
        with path.open("a") as f:
            f.writelines(json.dumps(p) + "\n" for p in batch)
        kept += batch
        if bar is not None:
            bar.update(len(batch))
    if bar is not None:
        bar.close()
    log.info("%d self-written prompts in %s", len(kept), path)
    return kept
