"""`splitserve plan capacity`: how many sequences a KV budget holds, and how fast a model
can decode on given hardware (the memory wall). Pure arithmetic over a ModelSpec.

- KV bytes per token and per page are the engine's own page format's (KVLayout): 2 (K and
  V) x layers x KV heads x head dim x the KV dtype's bytes, and an 8-bit page's scale
  bytes; the cache holds whole pages, and a sequence of n tokens needs ceil(n / page_size)
  pages (the engine's own rule, so the numbers equal its start-up report).
- Weight bytes = parameters x bits per weight / 8 (nominal: 16 for bf16, 8 for int8, 4
  for int4; group scales add ~0.5 bits more, which `scale_bits` can include).
- A decode step of B sequences at context C must read the weights once and every
  sequence's KV: bytes = weights + B x C x KV bytes per token; at the hardware's
  bandwidth that is a floor on the step time. It does 2 x parameters x B FLOPs (+ the
  attention's 4 x layers x heads x head dim x C x B); past the ridge point the compute,
  not the memory, sets the floor. Tokens/s per user = 1 / step; in total, B / step.
- Tensor parallelism over `tp` devices (Megatron's split, as vLLM's): each rank holds
  1/tp of the weights and the KV of its share of the KV heads (a head replicated on
  several ranks when tp exceeds them), reads and computes that share each step, and
  joins two all-reduces a layer (after attention and after the MLP) of the batch's
  activations: a ring moves 2 (tp - 1) / tp of their bytes over each rank's link, added
  to the step. A KV cache size is then per rank (each device's budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from cluster.config import KV_CACHE_DTYPES, ConfigError
from cluster.engine.kernels.kv_cache import KVLayout, kv_dtype
from cluster.engine.model.checkpoint import ModelSpec
from splitserve.hardware import Hardware

BITS = {  # a weight's
    "float32": 32, "bfloat16": 16, "float16": 16,
    "int8": 8, "int4": 4, "fp8": 8, "awq": 4, "gptq": 4,
}  # fmt: skip
KV_DTYPES = KV_CACHE_DTYPES[1:]  # the engine's names but auto (the model's dtype)


def num_params(spec: ModelSpec) -> int:
    """Weights of a Llama-family decoder: embeddings, attention, MLP, norms."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    q = spec.num_heads * spec.head_dim
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if spec.qkv_bias else 0)
    mlp = 3 * h * spec.intermediate_size
    per_layer = attention + mlp + 2 * h
    vocab = spec.vocab_size * h * (1 if spec.tie_embeddings else 2)
    return spec.num_layers * per_layer + vocab + h


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """KV heads each of tp ranks holds: its share, or one replicated head past them."""
    return -(-spec.num_kv_heads // tp)


def kv_layout(spec: ModelSpec, name: str, page_size: int = 16, tp: int = 1) -> KVLayout:
    """The pages of KV dtype `name` one rank of tp holds (tp 1: the one device), in the
    engine's own format."""
    if name not in KV_DTYPES:
        raise ConfigError(f"kv_dtype: one of {', '.join(KV_DTYPES)}, got {name!r}")
    heads = kv_heads_per_rank(spec, tp)
    return KVLayout(spec.num_layers, heads, spec.head_dim, page_size, kv_dtype(name, torch.float32))


def kv_bytes_per_token(spec: ModelSpec, kv_dtype: str, tp: int = 1, page_size: int = 16) -> float:
    """KV bytes a token takes on one rank of tp, its share of its page's scales counted."""
    return kv_layout(spec, kv_dtype, page_size, tp).bytes_per_token


@dataclass(frozen=True)
class KVCapacity:
    layout: KVLayout
    pages: int

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def bytes_per_page(self) -> int:
        return self.layout.bytes_per_page

    @property
    def bytes_per_token(self) -> float:
        return self.layout.bytes_per_token

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    def sequences(self, context: int) -> int:
        """Sequences of `context` tokens that fit at once."""
        return self.pages // math.ceil(context / self.page_size)


def kv_capacity(
    spec: ModelSpec, kv_dtype: str, page_size: int, kv_cache_gb: float, tp: int = 1
) -> KVCapacity:
    """Pages of a `kv_cache_gb` GiB cache (on each of tp ranks), as the engine sizes it."""
    layout = kv_layout(spec, kv_dtype, page_size, tp)
    return KVCapacity(layout, layout.pages_for(kv_cache_gb * 2**30))


@dataclass(frozen=True)
class DecodeBound:
    batch: int
    context: int
    bytes_read: float
    flops: float
    memory_s: float  # bytes / bandwidth
    compute_s: float  # flops / peak
    allreduce_s: float = 0.0  # tensor parallel ranks' all-reduces, after the slower one

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s) + self.allreduce_s

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def tokens_per_s_per_user(self) -> float:
        return 1 / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s


def weight_bytes(spec: ModelSpec, weight_bits: float, tp: int = 1) -> float:
    """Weight bytes on one rank of tp."""
    return num_params(spec) * weight_bits / 8 / tp


# What one small all-reduce costs beyond its bytes (launch and synchronisation): an assumed
# figure of the order NCCL reaches on NVLink; at batch 1 it is most of the all-reduce time.
ALLREDUCE_LATENCY_S = 8e-6


Rows = TypeVar("Rows", float, np.ndarray)  # one step's, or many steps' at once


def allreduce_s(spec: ModelSpec, batch: Rows, tp: int, link_gb_s: float) -> Rows:
    """Two ring all-reduces a layer of batch x hidden bfloat16 activations over links of
    link_gb_s each way, each ALLREDUCE_LATENCY_S more; 0 on one device."""
    if tp == 1:
        return batch * 0.0
    if link_gb_s <= 0:
        raise ValueError(f"tensor parallel {tp} needs a link bandwidth > 0, got {link_gb_s}")
    sent = 2 * spec.num_layers * batch * spec.hidden_size * 2 * 2 * (tp - 1) / tp
    return sent / (link_gb_s * 1e9) + 2 * spec.num_layers * ALLREDUCE_LATENCY_S


def decode_bound(
    spec: ModelSpec,
    hw: Hardware,
    weight_bits: float,
    kv_dtype: str,
    batch: int,
    context: int,
    tp: int = 1,
    link_gb_s: float = 0.0,  # with tp > 1: each rank's link, each way
) -> DecodeBound:
    """The floor on one decode step of `batch` sequences at `context` tokens each, on
    one rank of tp (bytes and FLOPs are the rank's)."""
    kv = batch * context * kv_bytes_per_token(spec, kv_dtype, tp)
    read = weight_bytes(spec, weight_bits, tp) + kv
    attention = 4 * spec.num_layers * spec.num_heads * spec.head_dim * context * batch
    flops = (2 * num_params(spec) * batch + attention) / tp
    return DecodeBound(
        batch,
        context,
        read,
        flops,
        read / (hw.bandwidth_gb_s * 1e9),
        flops / (hw.tflops * 1e12),
        allreduce_s(spec, batch, tp, link_gb_s),
    )


# Named architectures (their published shapes), for planning without the files; planning
# reads only the shapes, so norm eps and RoPE base are placeholders.
ARCHITECTURES = {
    name: ModelSpec(*dims, rms_norm_eps=1e-5, rope_theta=1e6, max_position=max_position,
                    tie_embeddings=tied, qkv_bias=bias, eos_token_ids=(), name=name)
    for name, dims, max_position, tied, bias in (
        # (vocab, hidden, intermediate, layers, heads, KV heads, head dim)
        ("smollm2-135m", (49152, 576, 1536, 30, 9, 3, 64), 8192, True, False),
        ("llama-3-8b", (128256, 4096, 14336, 32, 32, 8, 128), 8192, False, False),
        ("llama-3-70b", (128256, 8192, 28672, 80, 64, 8, 128), 8192, False, False),
        ("qwen2-7b", (152064, 3584, 18944, 28, 28, 4, 128), 32768, False, True),
        ("mistral-7b", (32000, 4096, 14336, 32, 32, 8, 128), 32768, False, False),
    )
}  # fmt: skip
