"""fedra wire contract: protobuf messages (package fedra.v1), generated stubs, tensor codec."""
