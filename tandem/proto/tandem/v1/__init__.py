"""Generated from proto/tandem/v1/*.proto by `tandem gen-proto`. Do not edit the *_pb2* files."""
