"""TreeServe engine: token trees, tree builders, verification (pure library: no Ray, no gRPC)."""
