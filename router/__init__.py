"""The gRPC front door: validation, routing policy, session placement."""
