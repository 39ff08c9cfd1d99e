"""Where tandem keeps what it computes once per machine (imported models, kernel tuning): a
module of its own so that kernels can find it without importing the model importer (which
needs gguf, numpy and tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_root() -> Path:
    """`$TANDEM_CACHE` if set, else `~/.cache/tandem`."""
    env = os.environ.get("TANDEM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"
