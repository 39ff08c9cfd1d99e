"""Regenerates the checked-in Python code of `proto/tandem/v1/*.proto` (grpcio-tools).

protoc names a generated module after the .proto's path under its `-I` root: with `-I proto`,
`proto/tandem/v1/router.proto` becomes the module `tandem.v1.router_pb2`, and the gRPC plugin's
stubs import it as `from tandem.v1 import router_pb2`. The output goes to the folder that holds
the `tandem` package, so the code lands in `tandem/v1/` -- exactly that import path -- and is
written as protoc emits it, with no fix-up. The descriptors keep the canonical file name
`tandem/v1/router.proto` (which server reflection reports and clients in other languages
import) and the package `tandem.v1` (the gRPC method paths).

grpcio-tools is a dev dependency; it is imported only when generating.
"""

from __future__ import annotations

import difflib
import re
import shutil
import tempfile
from pathlib import Path

# The folder that holds the `tandem` package (the repository root): protoc's --*_out root.
SOURCE_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = SOURCE_ROOT / "proto"  # protoc's -I root
# The one path that makes the imports right: the .protos' folder under PROTO_ROOT is the
# generated package's folder under SOURCE_ROOT (proto package tandem.v1 = Python tandem.v1).
PROTO_PACKAGE_DIR = Path("tandem") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

# Lines that record the generator's version; masked when comparing so that a newer grpcio-tools
# with identical output does not fail the check.
_VERSION_LINES = re.compile(
    r"^# Protobuf Python Version: .*$|^GRPC_GENERATED_VERSION = .*$"
    r"|ValidateProtobufRuntimeVersion\(.*?\)", re.MULTILINE | re.DOTALL)


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root/tandem/v1/` as protoc emits them; return
    their paths."""
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
        # protoc writes into a temp dir: a failed run leaves out_root as it was.
        written = []
        for src in sorted((Path(tmp) / PROTO_PACKAGE_DIR).iterdir()):
            dst = out_root / PROTO_PACKAGE_DIR / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            written.append(dst)
        return written


def regenerate_in_place() -> list[Path]:
    """Replace the checked-in generated files (stale ones of deleted .protos are removed)."""
    written = generate(SOURCE_ROOT)
    for old in (SOURCE_ROOT / PROTO_PACKAGE_DIR).iterdir():
        if old.name.endswith(GENERATED_SUFFIXES) and old not in written:
            old.unlink()
    return written


def diff_against_checked_in() -> str:
    """Regenerate into a temp dir and return a unified diff with the checked-in files ('' if
    identical, generator version lines aside)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh_root = Path(tmp)
        generate(fresh_root)
        fresh = _generated(fresh_root / PROTO_PACKAGE_DIR)
        current = _generated(SOURCE_ROOT / PROTO_PACKAGE_DIR)
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
