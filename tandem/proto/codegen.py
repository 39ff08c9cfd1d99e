"""Regenerates the checked-in Python code of `proto/tandem/v1/*.proto` (grpcio-tools).

Owns one fix-up of protoc's output: the gRPC plugin imports the messages module by the
.proto's package path (`from tandem.v1 import router_pb2`), which is not importable here -- the
code lives in `tandem.proto.tandem.v1` -- so that one import is rewritten. The descriptors keep
the canonical file name `tandem/v1/router.proto`, which clients in other languages use too.

grpcio-tools is a dev dependency; it is imported only when generating.
"""

from __future__ import annotations

import difflib
import re
import tempfile
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent  # tandem/proto
REPO_ROOT = PACKAGE_ROOT.parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_PACKAGE_DIR = Path("tandem") / "v1"  # relative to PROTO_ROOT and to PACKAGE_ROOT
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_IMPORT_FIX = (re.compile(r"^from tandem\.v1 import ", re.MULTILINE),
               "from tandem.proto.tandem.v1 import ")
# Lines that record the generator's version; masked when comparing so that a newer grpcio-tools
# with identical output does not fail the check.
_VERSION_LINES = re.compile(
    r"^# Protobuf Python Version: .*$|^GRPC_GENERATED_VERSION = .*$"
    r"|ValidateProtobufRuntimeVersion\(.*?\)", re.MULTILINE | re.DOTALL)


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root/tandem/v1/`; return their paths."""
    import importlib.util
    import subprocess
    import sys

    spec = importlib.util.find_spec("grpc_tools")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("grpc_tools is not installed (pip install grpcio-tools)")
    with tempfile.TemporaryDirectory() as tmp:
        well_known = Path(spec.submodule_search_locations[0]) / "_proto"
        args = [f"-I{PROTO_ROOT}", f"-I{well_known}", f"--python_out={tmp}",
                f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                *[str(PROTO_ROOT / p) for p in proto_files()]]
        # protoc runs in its own process: its C++ code loaded into a process that already
        # holds UCX/NIXL, Mooncake and Ray (the test suite) crashed it with SIGSEGV.
        result = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT}: {result.stderr.strip()}")
        written = []
        for src in sorted((Path(tmp) / PROTO_PACKAGE_DIR).iterdir()):
            dst = out_root / PROTO_PACKAGE_DIR / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            text = src.read_text()
            if src.name.endswith("_pb2_grpc.py"):
                text = _IMPORT_FIX[0].sub(_IMPORT_FIX[1], text)
            dst.write_text(text)
            written.append(dst)
        return written


def regenerate_in_place() -> list[Path]:
    """Replace the checked-in generated files (stale ones of deleted .protos are removed)."""
    target = PACKAGE_ROOT / PROTO_PACKAGE_DIR
    for old in target.iterdir():
        if old.name.endswith(GENERATED_SUFFIXES):
            old.unlink()
    return generate(PACKAGE_ROOT)


def diff_against_checked_in() -> str:
    """Regenerate into a temp dir and return a unified diff with the checked-in files ('' if
    identical, generator version lines aside)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root)
        fresh = _generated(fresh_root / PROTO_PACKAGE_DIR)
        current = _generated(PACKAGE_ROOT / PROTO_PACKAGE_DIR)
        out: list[str] = []
        for name in sorted(set(fresh) | set(current)):
            a = _VERSION_LINES.sub("<version>", current.get(name, ""))
            b = _VERSION_LINES.sub("<version>", fresh.get(name, ""))
            if a != b:
                out += difflib.unified_diff(a.splitlines(True), b.splitlines(True),
                                            f"checked-in/{name}", f"regenerated/{name}")
        return "".join(out)


def _generated(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
