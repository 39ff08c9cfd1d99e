"""Where draft heads come from: a directory the user names, or the head tandem ships for its
default model (`tandem/assets/`)."""

from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_HEADS = {"default": ASSETS / "eagle-smollm2-135m-instruct"}


def resolve_head_dir(draft_model: str | None, target_model: str) -> Path:
    if draft_model:
        path = Path(draft_model).expanduser()
        if not path.is_dir():
            raise ValueError(f"draft_model: '{draft_model}' is not a directory")
        return path
    shipped = SHIPPED_HEADS.get(target_model)
    if shipped is None or not (shipped / "config.json").is_file():
        raise ValueError(
            f"draft_model: no shipped EAGLE head for model '{target_model}'; pass a head "
            "directory (train one with `tandem train-eagle`)"
        )
    return shipped
