"""splitserve's public gRPC API as Python code: v1/ is generated from v1/splitserve.proto,
which ships beside it, by scripts/gen-proto (proto package splitserve.v1).
It imports nothing of ours, so the router and the client both stand on it."""
