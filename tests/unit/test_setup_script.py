"""`./tandem.sh`, the README's two commands: a second run does no install work, and bad input
gets a clear message."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tandem.sh"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_help_names_both_commands():
    out = _run("--help")
    assert out.returncode == 0
    assert "./tandem.sh demo" in out.stdout and "./tandem.sh test" in out.stdout


def test_unknown_command_fails_with_usage():
    out = _run("frobnicate")
    assert out.returncode != 0
    assert "unknown command 'frobnicate'" in out.stderr


def test_bad_extra_is_named():
    out = _run("setup", env={"TANDEM_EXTRA": "tpu"})
    assert out.returncode != 0
    assert "TANDEM_EXTRA must be cpu or gpu" in out.stderr


def test_second_setup_installs_nothing():
    """In an environment the script made (CI's), set-up again is a no-op: no pip, seconds."""
    venv = Path(sys.prefix)
    if not (venv / ".tandem-setup").is_file():
        pytest.skip("this environment was not made by ./tandem.sh")
    t0 = time.monotonic()
    out = _run("setup", env={"TANDEM_VENV": str(venv)})
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "installing" not in out.stderr, out.stderr
    assert elapsed < 10.0, elapsed
