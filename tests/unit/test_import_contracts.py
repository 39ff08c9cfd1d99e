"""The import rules (pyproject.toml [tool.importlinter]; docs/architecture.md "Import rules"):
top-level packages form layers with no cycles, the engine imports no serving code, the router
no torch, engine, spec or kvtransfer, the nodes neither each other nor deploy, and no package
has an import cycle between its modules. `lint-imports` checks every contract statically (lazy
imports inside functions included) and fails naming the import chain that breaks one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lint_imports() -> str:
    """The venv's `lint-imports` (next to this interpreter), else one on PATH."""
    here = Path(sys.executable).with_name("lint-imports")
    found = str(here) if here.is_file() else shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports is missing: install the dev extra (pip install -e '.[dev]')")
    return found


def test_every_import_contract_is_kept():
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout
