"""`tandem --help` (building every subcommand's parser) must not import gRPC, Ray, NIXL or
Mooncake: on a machine where one of them cannot load (the GPU machine's grpcio is older than the
checked-in stubs need) every other subcommand must still run."""

from __future__ import annotations

import subprocess
import sys


def test_building_the_parser_imports_no_heavy_modules():
    code = ("import sys\nimport tandem.cli as c\nc.build_parser()\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'grpc', 'ray', 'nixl', 'mooncake', 'flashinfer', 'matplotlib'})\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "", f"building the CLI parser imported {out.stdout.strip()}"
