"""Triton kernels that fuse a decoder layer's elementwise steps on a GPU, one launch each
where PyTorch takes two or three (and a round trip through memory between them):

- `silu_mul`: the MLP's silu(gate) * up, from the fused gate_up projection's output
  (`gelu_mul`: Gemma's GELU in silu's place);
- `add_rms_norm`: the residual add and the RMSNorm after it, x += delta in place and the
  normed row out, in float32 inside as transformers' LlamaRMSNorm computes it;
- `rope_`: rotate-half RoPE of q and k together, in place (PyTorch: four ops); the
  Triton attention backend does it in its KV store instead (paged_kernels.rope_store_kv).

The model uses them on CUDA (cluster/engine/model/model.py); on a CPU tensor they run under
Triton's interpreter, as the tests do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _act_mul_kernel(
    gate_up, out, stride_in, stride_out, inner, GELU: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inner
    gate = tl.load(gate_up + row * stride_in + cols, mask=m, other=0).to(tl.float32)
    up = tl.load(gate_up + row * stride_in + inner + cols, mask=m, other=0).to(tl.float32)
    if GELU:  # tanh's approximation: 0.5 (1 + tanh(u)) = sigmoid(2u)
        y = gate * tl.sigmoid(1.5957691216 * (gate + 0.044715 * gate * gate * gate)) * up
    else:
        y = gate * tl.sigmoid(gate) * up
    tl.store(out + row * stride_out + cols, y.to(out.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """silu(gate) * up of gate_up [N, 2 * inner] (gate first): [N, inner]."""
    return _act_mul(gate_up, block, gelu=False)


def gelu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """GELU(gate) * up (tanh approximation, Gemma's), as silu_mul."""
    return _act_mul(gate_up, block, gelu=True)


def _act_mul(gate_up: torch.Tensor, block: int, gelu: bool) -> torch.Tensor:
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = min(block, triton.next_power_of_2(inner))
    _act_mul_kernel[(rows, triton.cdiv(inner, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), inner, gelu, block
    )
    return out


@triton.jit
def _add_rms_norm_kernel(
    x, delta, weight, h, stride_x, stride_d, stride_h, hidden, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < hidden
    total = tl.load(x + row * stride_x + cols, mask=m, other=0).to(tl.float32)
    total += tl.load(delta + row * stride_d + cols, mask=m, other=0).to(tl.float32)
    residual = total.to(x.dtype.element_ty)  # the sum as PyTorch's add would round it
    tl.store(x + row * stride_x + cols, residual, mask=m)
    v = residual.to(tl.float32)
    normed = v * tl.rsqrt(tl.sum(v * v, 0) / hidden + eps)
    w = tl.load(weight + cols, mask=m, other=0).to(tl.float32)
    tl.store(h + row * stride_h + cols, (normed * w).to(h.dtype.element_ty), mask=m)


def add_rms_norm(
    x: torch.Tensor,  # [N, hidden], the residual stream: x += delta, in place
    delta: torch.Tensor,  # [N, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    """RMSNorm(x + delta) * weight, [N, hidden] in x's dtype; x holds x + delta after."""
    rows, hidden = x.shape
    assert x.stride(1) == delta.stride(1) == 1 and weight.is_contiguous()
    h = torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](
        x, delta, weight, h, x.stride(0), delta.stride(0), h.stride(0), hidden, eps,
        triton.next_power_of_2(hidden),
    )  # fmt: skip
    return h


@triton.jit
def rotated(row, cos_row, sin_row, cols, m, HALF: tl.constexpr):
    """The two halves of rotate-half RoPE of the head vector at `row`, by the cos and
    signed-sin table rows of its position, in float32 (`cols` < HALF where `m`)."""
    x1 = tl.load(row + cols, mask=m, other=0).to(tl.float32)
    x2 = tl.load(row + HALF + cols, mask=m, other=0).to(tl.float32)
    c1 = tl.load(cos_row + cols, mask=m, other=0).to(tl.float32)
    c2 = tl.load(cos_row + HALF + cols, mask=m, other=0).to(tl.float32)
    s1 = tl.load(sin_row + cols, mask=m, other=0).to(tl.float32)  # -sin
    s2 = tl.load(sin_row + HALF + cols, mask=m, other=0).to(tl.float32)  # sin
    return x1 * c1 + x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_kernel(
    x, positions, cos, signed_sin, stride_t, stride_h, stride_c,
    HALF: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    m = cols < HALF
    table = tl.load(positions + t).to(tl.int64) * stride_c
    row = x + t * stride_t + h * stride_h
    y1, y2 = rotated(row, cos + table, signed_sin + table, cols, m, HALF)
    tl.store(row + cols, y1.to(x.dtype.element_ty), mask=m)
    tl.store(row + HALF + cols, y2.to(x.dtype.element_ty), mask=m)


def rope_(
    x: torch.Tensor,  # [N, heads, head_dim], heads and dims contiguous (rows may be strided)
    positions: torch.Tensor,  # [N]
    cos: torch.Tensor,  # [max_position, head_dim], contiguous
    signed_sin: torch.Tensor,  # [max_position, head_dim]: cat(-sin, sin)
) -> None:
    """x * cos + roll(x, head_dim / 2) * signed_sin (model.rotate), in place."""
    tokens, heads, dim = x.shape
    assert x.stride(2) == 1 and cos.is_contiguous() and signed_sin.is_contiguous()
    half = dim // 2
    _rope_kernel[(tokens, heads)](
        x, positions, cos, signed_sin, x.stride(0), x.stride(1), cos.stride(0), half,
        triton.next_power_of_2(half),
    )  # fmt: skip


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """Each head of x [N, heads, head_dim] RMSNorm'd and scaled by weight [head_dim], in
    place (Qwen3's q/k norm): PyTorch's op, not fused on the GPU yet."""
    x.copy_(torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps))
