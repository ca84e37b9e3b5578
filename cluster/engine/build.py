"""Building an engine: what `engine.device`, `dtype` and `quantization` mean on this host,
the model loaded in its mode (and split over its ranks), and the KV cache's pages sized
from its budget. Every worker resolves an `auto` alike (from the CPU's flags and the
checkpoint, never a timing), so their KV matches."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cluster.config import ConfigError, EngineConfig
from cluster.engine.kernels import qmatmul
from cluster.engine.kernels.cpu_isa import BF16_FLAGS, cpu, fast_dtype, isa, native_bf16
from cluster.engine.kernels.kv_cache import KVLayout
from cluster.engine.memory import DeviceMemory, fits, kv_share
from cluster.engine.model.checkpoint import (
    ModelSpec,
    Progress,
    gguf_blocks_servable,
    load_checkpoint,
)
from cluster.engine.model.checkpoint_quant import METHODS, PACKED, checkpoint_quant
from cluster.engine.model.model import LlamaModel
from cluster.engine.model.quantization import QuantizationError

if TYPE_CHECKING:  # torch.distributed loads for TP only
    from cluster.engine.model.tensor_parallel import TensorGroup

log = logging.getLogger(__name__)


def load_model(
    path: Path,
    quantization: str,
    dtype: torch.dtype,
    device: torch.device,
    progress: Progress | None,
    split: Callable[[ModelSpec], TensorGroup] | None,
) -> tuple[ModelSpec, LlamaModel]:
    """The checkpoint as a model whose weights are stored as `quantization` says (`split`:
    its shard on this rank, once the rank has joined the group `split` returns);
    ConfigError naming the field when this model cannot take that mode or split."""
    try:
        if quantization != "none" and device.type != "cpu":
            on_gpu(quantization, torch.cuda.get_device_capability(device))
        stated = checkpoint_quant(path) if path.is_dir() else None
        if quantization in METHODS and (stated is None or stated.method != quantization):
            had = "none" if stated is None else stated.method
            raise QuantizationError(f"{path}: its weights are not {quantization} (they are {had})")
        # int8 / int4 quantize from float32, as they were measured; a quantized checkpoint
        # dequantizes in float32 too
        load_dtype = dtype if quantization == "none" and stated is None else torch.float32
        # awq / gptq / gguf codes as stored for our CPU kernels; fp8's for a GPU's FP8 GEMM
        keep = quantization in ("gguf", *PACKED) or (quantization == "fp8" and device.type != "cpu")
        spec, weights = load_checkpoint(path, keep, load_dtype, device, progress)
        if split is None:
            return spec, LlamaModel(spec, weights, dtype, device, quantization)
        from cluster.engine.model.tensor_parallel import ShardedWeights

        group = split(spec)
        sharded = ShardedWeights(weights, group.shard, spec.head_dim)
        local = group.shard.local(spec)
        return spec, LlamaModel(local, sharded, dtype, device, quantization, group)
    except QuantizationError as e:
        raise ConfigError(f"quantization: {quantization}: {e}") from None


def on_gpu(quantization: str, capability: tuple[int, int]) -> None:
    """QuantizationError unless a GPU of this compute capability runs `quantization`: only
    fp8, on the FP8 GEMM of 8.9 (Ada) and later; every other mode's kernels are the CPU's."""
    if quantization != "fp8":
        raise QuantizationError("its kernels run on the CPU only so far, not on a GPU")
    if capability < (8, 9):
        major, minor = capability
        raise QuantizationError(
            f"an FP8 GEMM needs compute capability 8.9 or later; this GPU's is {major}.{minor}"
        )


def pick_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        why = cpu_torch_on_gpu_host(torch.version.cuda, _nvidia_gpus())
        if why:
            log.warning("%s", why)
        return torch.device("cpu")
    return torch.device(name)


def cpu_torch_on_gpu_host(torch_cuda: str | None, nvidia_gpus: int) -> str | None:
    """Why device auto takes the CPU of a host with NVIDIA GPUs when torch is a CPU build
    (as a pip index or a pin can choose: scripts/setup's torch==2.13.0 is one where pip
    reads the CPU index); None otherwise."""
    if torch_cuda is not None or nvidia_gpus == 0:
        return None
    return (
        f"device auto: this host has {nvidia_gpus} NVIDIA GPU(s) but torch "
        f"{torch.__version__} is a CPU build, so the engine runs on the CPU; install a CUDA "
        f"build (pip install torch --index-url https://download.pytorch.org/whl/cu128)"
    )


def _nvidia_gpus() -> int:
    """GPUs the NVIDIA driver lists (Linux); 0 without the driver."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def pick_dtype(name: str, device: torch.device) -> str:
    """The dtype `engine.dtype: name` means on `device`. auto: bfloat16 on CUDA (half the
    weight bytes, tensor cores) and on a CPU with native bf16 arithmetic; float32 on any
    other CPU, where torch emulates bf16 several times slower (cluster/engine/kernels/cpu_isa.py).
    The rule reads the CPU's flags, never a timing, so every worker on a host resolves it
    alike: their KV must match. Every user of an engine's dtype (its KV layout, the
    compatibility hash, the fit check) reads this resolved name, never "auto". float16 is
    refused on a CPU: none of our kernels there take it, and torch's are several times
    slower than bfloat16's or float32's."""
    if name == "float16" and device.type == "cpu":
        raise ConfigError(
            "dtype: float16 runs on CUDA only here (no CPU kernel takes it); on the CPU "
            "bfloat16, float32 or auto (the fast one of the two for this CPU) serve"
        )
    if name != "auto":
        return name
    return fast_dtype(device.type)


def pick_quantization(name: str, path: Path, device: torch.device) -> str:
    """The weight mode `engine.quantization: name` means for the model at `path`. auto: a
    GGUF file's own blocks as stored (gguf) on the CPU, whose kernels read them, when each
    block type has a kernel; a checkpoint directory's own quantization (fp8 on either
    device, `on_gpu`; awq and gptq on the CPU, whose int4 kernel reads them, and
    dequantized to float weights on a GPU, which has no 4-bit kernel here yet); a GGUF
    whose block types lack a kernel (K-quants) as our 8-bit groups on the CPU (its blocks
    dequantized: half of bfloat16's bytes, within int8's accuracy of them); float weights
    (none) otherwise: a float directory, a GPU. Read from the files, never timed: every
    worker resolves it alike."""
    if name != "auto":
        return name
    if path.is_dir():
        stated = checkpoint_quant(path)
        if stated is None or (stated.method in PACKED and device.type != "cpu"):
            return "none"
        return stated.method
    if path.suffix != ".gguf" or not path.is_file() or device.type != "cpu":
        return "none"
    return "gguf" if gguf_blocks_servable(path) else "int8"


def describe_modes(config: EngineConfig, dtype: str, quantization: str, device: str) -> str:
    """What the start-up line says of the modes: each as chosen, and why when auto chose."""
    parts = [dtype]
    if config.dtype == "auto":
        flags = cpu()[1]
        why = (
            "a GPU"
            if device == "cuda"
            else f"native bf16: {' '.join(sorted(flags & BF16_FLAGS))}"
            if native_bf16(flags)
            else f"bf16 would be emulated: {isa(flags)}"
        )
        parts = [f"dtype auto: {dtype} ({why})"]
    if config.quantization == "auto":
        why = {
            "gguf": "the GGUF's blocks as stored",
            "int8": "the GGUF's blocks have no kernel here: dequantized into 8-bit groups",
            "none": "float weights",
            "fp8": "the checkpoint's FP8 weights on an FP8 GEMM"
            if device == "cuda"
            else "the checkpoint's FP8 weights as 8-bit groups",
        }.get(quantization, f"the checkpoint's own {quantization} 4-bit groups")
        parts.append(f"quantization auto: {quantization} ({why})")
    else:
        parts.append(f"quantization {quantization}")
    if quantization != "none" and device == "cpu":
        parts[-1] += f" on {qmatmul.describe()}"
    return ", ".join(parts)


def kv_pages(
    config: EngineConfig,
    layout: KVLayout,
    device: torch.device,
    memory: DeviceMemory,
    weight_bytes: int,
    workspace: int,
    group: TensorGroup | None,
) -> int:
    """Pages of KV the cache holds: kv_cache_gb's, or (kv_cache_gb null) what the share
    gpu_memory_utilization leaves beside the weights and the workspace; with tensor
    parallelism, the fewest any rank holds (every rank's cache holds as many as rank 0's)."""
    share = config.gpu_memory_utilization
    if share is not None:
        kv_bytes = kv_share(share, device, memory, weight_bytes, workspace)
    else:
        assert config.kv_cache_gb is not None  # EngineConfig: one of the two
        kv_bytes = config.kv_cache_gb * 2**30
        too_big = fits(weight_bytes, kv_bytes, memory, workspace_bytes=workspace)
        if too_big:
            raise ConfigError(f"kv_cache_gb: {too_big}")
    num_pages = layout.pages_for(kv_bytes)
    if group is not None:
        num_pages = group.fewest(num_pages)
    if num_pages < 1:
        raise ValueError(f"kv_cache_gb: {kv_bytes / 2**30:g} GiB holds no page of KV")
    return num_pages
