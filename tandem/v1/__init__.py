"""Generated from proto/tandem/v1/*.proto by `tandem gen-proto`; do not edit the *_pb2* files.

The folder is named after the proto package `tandem.v1`, so the imports protoc writes
(`from tandem.v1 import router_pb2`) resolve as emitted. Import through `tandem.proto`.
"""
