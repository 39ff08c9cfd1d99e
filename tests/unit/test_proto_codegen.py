"""The checked-in generated code is what grpcio-tools makes of proto/ today, and it imports."""

from __future__ import annotations

import pytest

from tandem.proto import codegen


@pytest.mark.timeout(60)
def test_checked_in_code_matches_regeneration():
    pytest.importorskip("grpc_tools")
    diff = codegen.diff_against_checked_in()
    assert not diff, f"generated code is stale; run `tandem gen-proto`:\n{diff}"


def test_generated_modules_import_and_describe_the_api():
    from tandem.proto import router_pb2 as pb
    from tandem.proto import router_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.name == "tandem/v1/router.proto"  # canonical name for other languages
    assert pb.DESCRIPTOR.package == "tandem.v1"
    service = pb.DESCRIPTOR.services_by_name["Router"]
    assert sorted(service.methods_by_name) == ["Abort", "Generate", "ListWorkers", "Stats"]
    assert service.methods_by_name["Generate"].server_streaming
    assert hasattr(pb_grpc, "RouterStub") and hasattr(pb_grpc, "RouterServicer")
    # Separate fields (no oneof) so that "prompt and messages" is detectable; int64 token ids
    # so negatives arrive as negatives.
    req = pb.GenerateRequest.DESCRIPTOR
    assert not [o for o in req.oneofs if not o.name.startswith("_")]
    assert req.fields_by_name["prompt_token_ids"].type == req.fields_by_name[
        "prompt_token_ids"].TYPE_INT64
    assert pb.SamplingParams.DESCRIPTOR.fields_by_name["max_tokens"].type == (
        req.fields_by_name["prompt_token_ids"].TYPE_INT32)


def test_stubs_import_the_messages_module_protoc_named():
    """protoc's import in the stubs (`from tandem.v1 import router_pb2`) is the module the face
    hands out: one module, one registration of the descriptor, no rewritten imports."""
    from tandem.proto import router_pb2 as pb
    from tandem.proto import router_pb2_grpc as pb_grpc
    from tandem.v1 import router_pb2

    assert pb is router_pb2 and pb.__name__ == "tandem.v1.router_pb2"
    assert pb_grpc.tandem_dot_v1_dot_router__pb2 is pb


def test_proto_sources_listed():
    assert [str(p) for p in codegen.proto_files()] == ["tandem/v1/router.proto"]
