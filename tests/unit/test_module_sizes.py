"""No library module over 450 lines (generated protobuf code aside): a module that grows past
it has more than one concept in it and is split along its seams (docs/architecture.md,
"Layout"). The speculative round stays one function of at most 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "tandem"
MAX_LINES = 450
GENERATED = PACKAGE / "v1"


def test_no_library_module_over_450_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in sorted(PACKAGE.rglob("*.py"))
            if GENERATED not in p.parents
            and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_speculative_round_is_one_short_function():
    tree = ast.parse((PACKAGE / "spec" / "engine.py").read_text())
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_spec_round"]
    assert fn.end_lineno - fn.lineno + 1 <= 60
