"""Generated protobuf packages (see `tandem.proto`)."""
