"""An engine's weights + workspace + KV cache against its device's free memory, in
hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ConfigError
from cluster.engine.memory import DeviceMemory, device_memory, fits, kv_share
from cluster.engine.runner import workspace_bytes
from splitserve.capacity import ARCHITECTURES, weight_bytes

L40S = DeviceMemory("L40S", 48 * 10**9, 48 * 10**9)  # 48.0 GB, none of it taken
LLAMA_8B_BF16 = weight_bytes(ARCHITECTURES["llama-3-8b"], 16)  # 8.03e9 x 2 = 16.06 GB


def test_an_8b_bf16_model_and_40_gib_of_kv_do_not_fit_a_48_gb_l40s() -> None:
    """16.06 GB + 42.95 GB = 59.0 GB against 90% of 48 GB = 43.2 GB: refused, and
    (43.2 - 16.06) GB / 2^30 = 25.27 GiB is the most KV that fits."""
    why = fits(LLAMA_8B_BF16, 40 * 2**30, L40S)
    assert why == (
        "weights 16.1 GB + KV cache 42.9 GB (kv_cache_gb 40) = 59.0 GB exceed 90% of "
        "L40S's 48.0 GB (43.2 GB); kv_cache_gb 25.2 at most would fit"
    )


def test_the_advised_kv_cache_fits_and_a_tenth_more_does_not() -> None:
    assert fits(LLAMA_8B_BF16, 25.2 * 2**30, L40S) is None
    assert fits(LLAMA_8B_BF16, 25.3 * 2**30, L40S) is not None


def test_weights_that_alone_overflow_the_device_say_so() -> None:
    """70B at 16 bits: 141 GB of weights on a 48 GB card; no kv_cache_gb helps."""
    why = fits(weight_bytes(ARCHITECTURES["llama-3-70b"], 16), 2**30, L40S)
    assert why is not None and "weights 141.1 GB" in why
    assert why.endswith(
        "the weights alone do not fit: a smaller dtype or quantization, or a larger device"
    )


def test_headroom_is_the_share_of_memory_left_free() -> None:
    device = DeviceMemory("d", 100, 100)
    assert fits(45, 45, device) is None  # 90 of 100 with the default 10% headroom
    assert fits(45, 46, device) is not None
    assert fits(45, 50, device, headroom=0) is None


def test_a_cpu_engine_counts_this_hosts_ram() -> None:
    host = device_memory(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert host.name == "this host's RAM"
    assert abs(host.total_bytes - total_kib * 1024) < 0.05 * host.total_bytes


def test_a_second_worker_on_a_gpu_counts_what_the_first_one_holds() -> None:
    """An 80 GB H100 where a prefill worker already holds 50 GB: 30 GB free, less 8 GB of
    headroom, is 22 GB; the 8B model and 10 GiB of KV (26.8 GB) would pass against the
    total (72 GB) and die of a CUDA OOM."""
    shared = DeviceMemory("cuda:0 (NVIDIA H100 80GB HBM3)", 80 * 10**9, 30 * 10**9)
    why = fits(LLAMA_8B_BF16, 10 * 2**30, shared)
    assert why == (
        "weights 16.1 GB + KV cache 10.7 GB (kv_cache_gb 10) = 26.8 GB exceed the 30.0 GB "
        "free less 10% of cuda:0 (NVIDIA H100 80GB HBM3)'s 80.0 GB (22.0 GB); "
        "kv_cache_gb 5.5 at most would fit"
    )
    assert fits(LLAMA_8B_BF16, 5.5 * 2**30, shared) is None


def test_the_workspace_counts_split_k_partials_and_a_second_copy_for_cuda_graphs() -> None:
    """Llama-3-8B in bf16, 256 sequences, 8192 batched tokens. Per activation row:
    2 x 4096 + (64 + 16) x 128 + 3 x 14336 = 61440 values, 122880 bytes; logits and
    probabilities: 2 x 256 x 128256 x 4 bytes; Triton's partials: 256 sequences x 32
    heads x 32 splits x 130 x 4 bytes; the piecewise graphs: two rows' worth for each of
    their 512 tokens (static buffers, and their pool's temporaries)."""
    llama = ARCHITECTURES["llama-3-8b"]
    row, logits, partials = 122880, 2 * 256 * 128256 * 4, 256 * 32 * 32 * 130 * 4
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    eager = 8192 * row + logits + partials  # 1.007 + 0.263 + 0.136 GB
    assert workspace_bytes(llama, 2, "triton", cpu, 256, 8192) == eager
    graphs = 256 * row + logits + partials + 2 * 512 * row  # 0.031 + 0.263 + 0.136 + 0.126 GB
    assert workspace_bytes(llama, 2, "triton", cuda, 256, 8192) == eager + graphs
    assert workspace_bytes(llama, 2, "cpu", cpu, 256, 8192) == 8192 * row + logits
    # FlashInfer replays the pieces only: its 128 MiB workspace and their buffers.
    flashinfer = 8192 * row + logits + 128 * 2**20 + 2 * 512 * row
    assert workspace_bytes(llama, 2, "flashinfer", cuda, 256, 8192) == flashinfer
    # ... and the fit check counts it: 2.0 GB less room for KV than without it.
    h100 = DeviceMemory("H100", 80 * 10**9, 80 * 10**9)
    kv = 72 * 10**9 - LLAMA_8B_BF16 - eager - graphs + 10**8  # 0.1 GB too much
    assert fits(LLAMA_8B_BF16, kv, h100) is None
    assert "workspace 2.0 GB" in (
        fits(LLAMA_8B_BF16, kv, h100, workspace_bytes=eager + graphs) or ""
    )


CUDA = torch.device("cuda")  # a name only: nothing here touches a GPU
H100_SHARED = DeviceMemory("cuda:0 (NVIDIA H100 80GB HBM3)", 80 * 10**9, 30 * 10**9)


def test_a_share_of_the_gpu_leaves_the_kv_cache_what_weights_and_workspace_do_not_take() -> None:
    """0.9 of an empty 48 GB L40S is 43.2 GB; less 16.06 GB of weights and 1 GB of
    workspace, 26.14 GB of KV: as much as the fit check's 10% headroom lets kv_cache_gb take."""
    kv = kv_share(0.9, CUDA, L40S, LLAMA_8B_BF16, 10**9)
    assert kv == 0.9 * 48 * 10**9 - LLAMA_8B_BF16 - 10**9
    assert fits(LLAMA_8B_BF16, kv, L40S, workspace_bytes=10**9) is None


def test_a_share_larger_than_the_free_memory_is_refused_with_the_share_that_fits() -> None:
    """A prefill worker holds 50 of the H100's 80 GB: 0.9 (72 GB) is more than the 30 GB
    free, 0.37 (29.6 GB) is not."""
    with pytest.raises(ConfigError) as refused:
        kv_share(0.9, CUDA, H100_SHARED, LLAMA_8B_BF16)
    assert str(refused.value) == (
        "gpu_memory_utilization: 0.9 of cuda:0 (NVIDIA H100 80GB HBM3)'s 80.0 GB is 72.0 GB, "
        "but 30.0 GB is free (other processes hold the rest); 0.37 at most would fit"
    )
    assert kv_share(0.37, CUDA, H100_SHARED, LLAMA_8B_BF16) == 0.37 * 80 * 10**9 - LLAMA_8B_BF16


def test_a_share_the_weights_fill_is_refused() -> None:
    with pytest.raises(ConfigError) as refused:
        kv_share(0.9, CUDA, L40S, weight_bytes(ARCHITECTURES["llama-3-70b"], 16))
    assert str(refused.value) == (
        "gpu_memory_utilization: 0.9 of L40S's 48.0 GB is 43.2 GB, and weights 141.1 GB + "
        "workspace 0.0 GB leave no KV cache: a larger share, a smaller dtype or "
        "quantization, or a larger device"
    )


def test_a_share_of_a_gpu_is_refused_on_the_cpu() -> None:
    host = device_memory(torch.device("cpu"))
    with pytest.raises(ConfigError) as refused:
        kv_share(0.9, torch.device("cpu"), host, LLAMA_8B_BF16)
    assert str(refused.value) == (
        "gpu_memory_utilization: a share of a GPU's memory, but this engine runs on cpu: "
        "give kv_cache_gb instead"
    )
