"""An engine's weights + KV cache against its device's memory, in hand-computed numbers."""

from __future__ import annotations

import torch

from cluster.engine.memory import DeviceMemory, device_memory, fits
from splitserve.capacity import ARCHITECTURES, weight_bytes
from splitserve.hardware import GPUS

L40S = DeviceMemory("L40S", int(GPUS["L40S"].memory_gb * 1e9))  # 48.0 GB
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
    device = DeviceMemory("d", 100)
    assert fits(45, 45, device) is None  # 90 of 100 with the default 10% headroom
    assert fits(45, 46, device) is not None
    assert fits(45, 50, device, headroom=0) is None


def test_a_cpu_engine_counts_this_hosts_ram() -> None:
    host = device_memory(torch.device("cpu"))
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert host.name == "this host's RAM"
    assert abs(host.total_bytes - total_kib * 1024) < 0.05 * host.total_bytes
