"""The coordinator daemon: gRPC services, round engine, aggregation strategies."""
