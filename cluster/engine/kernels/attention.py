"""The attention backend seam: what one step's attention needs, and who computes it.

Once per step the runner lays the batch out on the host (`StepBatch`, in
cluster/engine/kernels/step_batch.py) and the backend turns it into its own metadata (`prepare`:
device tensors, workspaces, plans). Then every layer calls
`forward(layer, q, k, v, cache, metadata)`, which writes the new K/V into their page
slots and returns the attention output. A backend that `fuses_rope` takes q and k before
RoPE and rotates them as it stores (one kernel); the others take them rotated. Backends:

- `cpu`: PyTorch SDPA and matmuls over gathered pages (cluster/engine/kernels/attention_cpu.py);
- `triton`: our own Triton kernels reading pages in place (attention_triton.py);
- `flashinfer`: FlashInfer's paged kernels, on CUDA when installed (attention_flashinfer.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from cluster.config import ConfigError
from cluster.engine.kernels.kv_cache import QMAX, KVCache, KVLayout, kv_dtype
from cluster.engine.kernels.layer_attention import PLAIN, LayerAttention
from cluster.engine.kernels.step_batch import StepBatch


class AttentionBackend(Protocol):
    """Paged attention for one engine: its cache layout, device and dtype are fixed."""

    name: str  # as in the config, and which kernel ran: what the benchmarks print
    fuses_rope: bool  # forward takes q and k before RoPE, and rotates them

    def prepare(self, batch: StepBatch) -> Any:
        """This step's metadata, read by every layer's `forward`."""
        ...

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [tokens, heads, head_dim]
        k: torch.Tensor,  # [tokens, kv_heads, head_dim]
        v: torch.Tensor,
        cache: KVCache,
        metadata: Any,
    ) -> torch.Tensor:
        """Store k and v of layer `layer` into their slots, then attend: [tokens, heads, dim].
        With `fuses_rope`, q is rotated in place and k as it is stored."""
        ...


def resolve_backend(
    name: str, device: torch.device, dtype: str, kv_cache_dtype: str, plain: bool = True
) -> str:
    """The backend `engine.attention_backend: name` means on `device` at `dtype` (resolved,
    not auto) over pages of `kv_cache_dtype`; ConfigError when it cannot run there. auto: cpu
    on CPU; on CUDA FlashInfer if installed, the dtype is bfloat16 (it has no float32
    kernels) and the pages are not 8-bit (it reads no scale per token and head), else triton.
    fp8 pages on a GPU without fp8 conversions (compute capability below 8.9) are refused.
    `plain`: every layer's attention is PLAIN; else (Gemma's) auto is triton on CUDA, as
    FlashInfer is not given windows, soft-capping or scales here."""
    has = lambda module: importlib.util.find_spec(module) is not None
    kv = kv_dtype(kv_cache_dtype, torch.float32)
    scaled = kv in QMAX
    if scaled and kv != torch.int8 and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"kv_cache_dtype: {kv_cache_dtype} needs fp8 conversions, which this GPU "
                f"(compute capability {major}.{minor}, below 8.9) lacks; kv_cache_dtype int8 "
                f"or bfloat16 serves on it"
            )
    if name == "auto":
        if device.type == "cpu":
            return "cpu"
        fits = has("flashinfer") and dtype == "bfloat16" and not scaled and plain
        return "flashinfer" if fits else "triton"
    if scaled and name == "flashinfer":
        raise ConfigError(
            f"kv_cache_dtype: {kv_cache_dtype} pages carry a scale per token and KV head, which "
            f"FlashInfer's kernels do not read; attention_backend triton (or auto) serves them"
        )
    if name == "triton" and not has("triton"):
        raise ConfigError("attention_backend: triton is not installed (pip install triton)")
    if name == "flashinfer" and (device.type != "cuda" or not has("flashinfer")):
        raise ConfigError(
            f"attention_backend: flashinfer needs a CUDA device and the flashinfer package; "
            f"device is {device.type}, flashinfer {'is' if has('flashinfer') else 'is not'} "
            f"installed"
        )
    if name == "flashinfer" and dtype != "bfloat16":
        raise ConfigError(f"attention_backend: flashinfer has no {dtype} kernels; use bfloat16")
    if name == "cpu" and device.type != "cpu":
        raise ConfigError(f"attention_backend: cpu runs on the CPU only, not {device.type}")
    return name


def make_backend(
    name: str,
    layout: KVLayout,
    num_heads: int,
    device: torch.device,
    rope: tuple[torch.Tensor, torch.Tensor],  # the model's cos and signed-sin tables
    layers: Sequence[LayerAttention] = (),  # each layer's, where any is not PLAIN
) -> AttentionBackend:
    """The backend named by `resolve_backend`, built for this engine's cache."""
    if name == "cpu":
        from cluster.engine.kernels.attention_cpu import CpuBackend

        return CpuBackend(layout, device, layers=layers)
    if name == "triton":
        from cluster.engine.kernels.attention_triton import TritonBackend

        return TritonBackend(device, layout.num_kv_heads, rope, layers=layers)
    assert name == "flashinfer", name
    if any(a != PLAIN for a in layers):
        raise ConfigError(
            "attention_backend: flashinfer is not given this model's sliding windows, "
            "soft-capping and score scale (Gemma's); attention_backend triton serves them"
        )
    from cluster.engine.kernels.attention_flashinfer import FlashInferBackend

    return FlashInferBackend(layout, num_heads, device)
