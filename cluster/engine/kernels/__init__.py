"""Kernels: the KV cache tensors, the attention backends and the C and Triton kernels, with
their native build. Imports only `sched/` of the engine (page math)."""
