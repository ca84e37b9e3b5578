"""splitserve, the product: the command line, the control plane, the planner and the
Python client (the gRPC API it speaks is splitserve_api.v1, generated from its .proto)."""
