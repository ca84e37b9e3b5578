"""device auto on a host with NVIDIA GPUs and a CPU build of torch says so, loudly."""

from __future__ import annotations

import torch

from cluster.engine.build import cpu_torch_on_gpu_host


def test_a_cpu_torch_on_a_gpu_host_is_named_with_the_fix() -> None:
    why = cpu_torch_on_gpu_host(None, 8)
    assert why is not None
    assert why.startswith(
        f"device auto: this host has 8 NVIDIA GPU(s) but torch {torch.__version__} is a CPU "
        "build, so the engine runs on the CPU; install a CUDA build"
    )
    assert cpu_torch_on_gpu_host("12.8", 8) is None  # a CUDA build: CUDA decides
    assert cpu_torch_on_gpu_host(None, 0) is None  # a CPU host: the CPU is the choice
