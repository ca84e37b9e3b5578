"""splitserve's public client side: the gRPC API (splitserve.v1) and a Python client."""
