"""KV page transport between workers: the wire format and the UCX endpoint (NIXL)."""
