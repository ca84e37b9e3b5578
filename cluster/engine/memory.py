"""Does one engine fit its device: weights + workspace + KV cache against the memory free.

`fits` is the decision, pure arithmetic (`kv_share` sizes the KV cache instead where an
engine is given a share of its GPU, gpu_memory_utilization, rather than kv_cache_gb);
`device_memory` reads the numbers they need (a GPU's free and total memory, or this host's
RAM for a CPU engine). `splitserve serve` asks
before any worker starts (splitserve/fit.py), and each engine asks again once its weights
are loaded, before it allocates its KV cache, against what was free before it loaded them:
a second worker on a GPU sees what the first one holds.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from cluster.config import ConfigError

HEADROOM = 0.1  # of the device's memory, left for activations, the CUDA context, fragments


@dataclass(frozen=True)
class DeviceMemory:
    name: str  # as a message names it: "cuda:0 (NVIDIA L40S)", "this host's RAM"
    total_bytes: int
    # What no process holds yet. This host's RAM counts as all free: its page cache and
    # the other engines of a test process come and go, and the OS pages out before failing.
    free_bytes: int


def device_memory(device: torch.device) -> DeviceMemory:
    """The memory an engine on `device` allocates from; a CPU engine, this host's RAM."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        free, total = torch.cuda.mem_get_info(index)
        return DeviceMemory(f"cuda:{index} ({torch.cuda.get_device_name(index)})", total, free)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceMemory("this host's RAM", ram, ram)


def fits(
    weight_bytes: float,
    kv_bytes: float,
    device: DeviceMemory,
    headroom: float = HEADROOM,
    workspace_bytes: float = 0,
) -> str | None:
    """None when weights + workspace (runner.workspace_bytes) + KV fit in the device's free
    memory less `headroom` of its total; else why not, in numbers (GB: 10^9 bytes;
    kv_cache_gb counts GiB, as the engine sizes its cache)."""
    usable = device.free_bytes - device.total_bytes * headroom
    if weight_bytes + workspace_bytes + kv_bytes <= usable:
        return None
    room_gib = math.floor((usable - weight_bytes - workspace_bytes) / 2**30 * 10) / 10
    advice = (
        f"kv_cache_gb {room_gib:g} at most would fit"
        if room_gib > 0
        else "the weights alone do not fit: a smaller dtype or quantization, or a larger device"
    )
    workspace = f"workspace {workspace_bytes / 1e9:.1f} GB + " if workspace_bytes else ""
    total = f"{device.name}'s {device.total_bytes / 1e9:.1f} GB"
    room = (
        f"{1 - headroom:.0%} of {total}"
        if device.free_bytes == device.total_bytes
        else f"the {device.free_bytes / 1e9:.1f} GB free less {headroom:.0%} of {total}"
    )
    need = weight_bytes + workspace_bytes + kv_bytes
    return (
        f"weights {weight_bytes / 1e9:.1f} GB + {workspace}KV cache {kv_bytes / 1e9:.1f} GB "
        f"(kv_cache_gb {kv_bytes / 2**30:g}) = {need / 1e9:.1f} GB exceed {room} "
        f"({usable / 1e9:.1f} GB); {advice}"
    )


def kv_share(
    utilization: float,
    device: torch.device,
    memory: DeviceMemory,
    weight_bytes: float,
    workspace_bytes: float = 0,
) -> float:
    """The KV cache's bytes for an engine that may hold `utilization` of its GPU's total
    memory, weights and workspace included, as vLLM's gpu_memory_utilization: the share
    less weights and workspace; no headroom on top, the share leaves it. ConfigError,
    naming the field and the numbers, on a CPU, when the share is more than is free (other
    processes hold the rest), or when weights and workspace fill it."""
    if device.type != "cuda":
        raise ConfigError(
            f"gpu_memory_utilization: a share of a GPU's memory, but this engine runs on "
            f"{device.type}: give kv_cache_gb instead"
        )
    share = utilization * memory.total_bytes
    of = f"{utilization:g} of {memory.name}'s {memory.total_bytes / 1e9:.1f} GB"
    if share > memory.free_bytes:
        free = memory.free_bytes
        most = math.floor(free / memory.total_bytes * 100) / 100
        raise ConfigError(
            f"gpu_memory_utilization: {of} is {share / 1e9:.1f} GB, but {free / 1e9:.1f} GB "
            f"is free (other processes hold the rest); {most:g} at most would fit"
        )
    kv_bytes = share - weight_bytes - workspace_bytes
    if kv_bytes <= 0:
        raise ConfigError(
            f"gpu_memory_utilization: {of} is {share / 1e9:.1f} GB, and weights "
            f"{weight_bytes / 1e9:.1f} GB + workspace {workspace_bytes / 1e9:.1f} GB leave no "
            "KV cache: a larger share, a smaller dtype or quantization, or a larger device"
        )
    return kv_bytes
