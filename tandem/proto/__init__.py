"""The face of the gRPC API's generated Python code, and the tool that regenerates it.

`router_pb2` (messages) and `router_pb2_grpc` (stubs, servicer base) come from
`proto/tandem/v1/router.proto`; the checked-in code lives in `tandem/v1/`, the package named like
the proto package, so protoc's own imports resolve (see `codegen`). Import it from here
(`from tandem.proto import router_pb2`). Regenerate with `tandem gen-proto` after editing the
.proto (`tests/unit/test_proto_codegen.py` regenerates into a temp dir and diffs). The modules
are imported lazily so that `tandem.proto.codegen` works even when the generated files are
missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["router_pb2", "router_pb2_grpc"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"tandem.v1.{name}")
    raise AttributeError(f"module 'tandem.proto' has no attribute {name!r}")
