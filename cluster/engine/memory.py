"""Does one engine fit its device: weights + KV cache against the device's memory.

`fits` is the decision, pure arithmetic; `device_memory` reads the one number it needs
(a GPU's total memory, or this host's RAM for a CPU engine). `splitserve serve` asks before
any worker starts (splitserve/fit.py), and each engine asks again once its weights are
loaded, before it allocates its KV cache.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

HEADROOM = 0.1  # of the device's memory, left for activations, the CUDA context, fragments


@dataclass(frozen=True)
class DeviceMemory:
    name: str  # as a message names it: "cuda:0 (NVIDIA L40S)", "this host's RAM"
    total_bytes: int


def device_memory(device: torch.device) -> DeviceMemory:
    """The memory an engine on `device` allocates from; a CPU engine, this host's RAM."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        props = torch.cuda.get_device_properties(index)
        return DeviceMemory(f"cuda:{index} ({props.name})", props.total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceMemory("this host's RAM", ram)


def fits(
    weight_bytes: float,
    kv_bytes: float,
    device: DeviceMemory,
    headroom: float = HEADROOM,
) -> str | None:
    """None when weights + KV fit in (1 - headroom) of the device's memory; else why not,
    in numbers (GB: 10^9 bytes; kv_cache_gb counts GiB, as the engine sizes its cache)."""
    usable = device.total_bytes * (1 - headroom)
    if weight_bytes + kv_bytes <= usable:
        return None
    room_gib = math.floor((usable - weight_bytes) / 2**30 * 10) / 10
    advice = (
        f"kv_cache_gb {room_gib:g} at most would fit"
        if room_gib > 0
        else "the weights alone do not fit: a smaller dtype or quantization, or a larger device"
    )
    return (
        f"weights {weight_bytes / 1e9:.1f} GB + KV cache {kv_bytes / 1e9:.1f} GB "
        f"(kv_cache_gb {kv_bytes / 2**30:g}) = {(weight_bytes + kv_bytes) / 1e9:.1f} GB "
        f"exceed {1 - headroom:.0%} of {device.name}'s {device.total_bytes / 1e9:.1f} GB "
        f"({usable / 1e9:.1f} GB); {advice}"
    )
