"""Benchmarks. `python -m bench.offline` (or `splitserve bench offline`) runs the offline one."""
