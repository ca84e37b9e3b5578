"""`splitserve serve`'s memory check, before any worker starts: one worker of each pool must
hold its weights, its runner's workspace and its KV cache (`kv_cache_gb`) in its device's
memory, or its weights and workspace in its share of the GPU (`gpu_memory_utilization`)
with room left for KV (cluster/engine/memory.py has the rules), as the engine checks.

The weights are estimated from the model's shape alone (no weights are read), at the pool's
dtype or quantization. The check runs where the device is known: with a local Ray (no
`ray_address`) every worker runs on this node, whose RAM or GPU is read here. Joined to a
cluster, the GPUs are on other nodes; there each engine applies the same rule at start-up,
before it allocates its KV cache, and its ConfigError ends `serve`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from cluster.config import ConfigError, EngineConfig, ServeConfig
from cluster.engine.build import pick_device, pick_dtype, pick_quantization
from cluster.engine.kernels.attention import resolve_backend
from cluster.engine.memory import device_memory, fits, kv_share
from cluster.engine.model.checkpoint import ModelSpec, read_spec
from cluster.engine.model.model_files import model_path
from cluster.engine.runner import workspace_bytes
from splitserve.capacity import BITS, weight_bytes


def engine_weight_bytes(spec: ModelSpec, engine: EngineConfig, path: Path) -> float:
    """The weights one engine holds, its auto modes resolved for its device: a GGUF's own
    blocks in gguf mode (the file's size), else every parameter at the dtype's or the
    quantization's nominal bits (int8 / int4 group scales, and int4's 8-bit vocabulary, add
    a few percent: the headroom's share)."""
    device = pick_device(engine.device)
    quantization = pick_quantization(engine.quantization, path, device)
    if quantization == "gguf":
        return path.stat().st_size
    return weight_bytes(
        spec, BITS[pick_dtype(engine.dtype, device) if quantization == "none" else quantization]
    )


def engine_workspace_bytes(
    spec: ModelSpec, engine: EngineConfig, device: torch.device, backend: str | None = None
) -> int:
    """What the engine's runner allocates besides weights and KV (runner.workspace_bytes), on
    `backend` or the one its attention_backend resolves to on `device`."""
    dtype = pick_dtype(engine.dtype, device)
    backend = backend or resolve_backend(
        engine.attention_backend,
        device,
        dtype,
        engine.kv_cache_dtype,
        plain=not spec.sandwich_norms,
    )
    item = getattr(torch, dtype).itemsize
    return workspace_bytes(
        spec, item, backend, device, engine.max_num_seqs, engine.max_num_batched_tokens
    )


def check_fit(config: ServeConfig) -> None:
    """ModelLoadError if the model is not here (the router reads its tokenizer from it, so
    it must be, even on a cluster's head); ConfigError, naming the pool and the numbers,
    if a worker on this node would not fit its device."""
    for phase, pool in (("prefill", config.prefill), ("decode", config.decode)):
        engine = pool.engine
        path = model_path(engine.model, engine.revision, engine.download_dir, engine.download)
        spec = read_spec(path)
        if config.ray_address is not None or pool.scaling.max_replicas == 0:
            continue
        device = pick_device(engine.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            continue  # the workers fail on their own, saying so
        weights = engine_weight_bytes(spec, engine, path)
        workspace = engine_workspace_bytes(spec, engine, device)
        memory = device_memory(device)
        share = engine.gpu_memory_utilization
        if share is not None:  # kv_cache_gb null: the KV cache is what the share leaves
            try:
                kv_share(share, device, memory, weights, workspace)
            except ConfigError as e:
                raise ConfigError(f"{phase}.engine.{e}") from None
            continue
        assert engine.kv_cache_gb is not None  # EngineConfig: one of the two
        too_big = fits(weights, engine.kv_cache_gb * 2**30, memory, workspace_bytes=workspace)
        if too_big:
            raise ConfigError(f"{phase}.engine.kv_cache_gb: one {phase} worker: {too_big}")
        _check_tier(phase, engine, weights, workspace, device)


def _check_tier(
    phase: str, engine: EngineConfig, weights: float, workspace: float, device: torch.device
) -> None:
    """The KV tier is host memory: beside the cache, weights and workspace on a CPU (the
    same memory), alone in the host's on a GPU (pinned)."""
    tier = engine.kv_offload_gb * 2**30
    if not tier:
        return
    host = device_memory(torch.device("cpu"))
    assert engine.kv_cache_gb is not None
    on_host = device.type == "cpu"
    too_big = fits(
        weights if on_host else 0,
        tier + (engine.kv_cache_gb * 2**30 if on_host else 0),
        host,
        workspace_bytes=workspace if on_host else 0,
    )
    if too_big:
        raise ConfigError(
            f"{phase}.engine.kv_offload_gb: one {phase} worker's KV tier "
            f"({engine.kv_offload_gb:g} GiB of host memory) does not fit beside it: {too_big}"
        )
