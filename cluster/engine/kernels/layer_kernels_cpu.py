"""The CPU twin of layer_kernels.py: the residual add with the RMSNorm after it, Qwen3's
RMSNorm of each q and k head, RoPE of q and k, and silu(gate) * up (GELU's for Gemma), one
C call each (layer_ops.c, built by native.py) where PyTorch takes several ops of a few
microseconds' dispatch each. The model uses them on the CPU where layer_ops.c builds
(`module()`), with the same signatures as the Triton kernels; the runner's C layer loop
(layer_loop.c) calls the same functions."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from types import ModuleType

import torch

from cluster.engine.kernels import native

DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _ops() -> ctypes.CDLL | None:
    lib = native.library("layer_ops.c")
    return None if lib is None else bind(lib)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """A built layer_ops.c with its signatures."""
    i64, ptr, flag = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.add_rms_norm.restype = lib.rope.restype = lib.silu_mul.restype = None
    lib.rms_norm_heads.restype = lib.gelu_mul.restype = None
    lib.add_rms_norm.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, flag]
    lib.rms_norm_heads.argtypes = [ptr, ptr, i64, i64, i64, i64, ctypes.c_float, flag]
    lib.rope.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, flag]
    lib.silu_mul.argtypes = lib.gelu_mul.argtypes = [ptr, ptr, i64, i64, flag]
    return lib


def module(dtype: torch.dtype) -> ModuleType | None:
    """This module, where layer_ops.c is built and takes `dtype`; else None."""
    return sys.modules[__name__] if dtype in DTYPES and _ops() is not None else None


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """layer_kernels.add_rms_norm on the CPU: x += delta in place, RMSNorm(x) * weight out."""
    ops = _ops()
    assert ops is not None and x.stride(1) == delta.stride(1) == 1 and weight.is_contiguous()
    assert delta.dtype == weight.dtype == x.dtype
    h = torch.empty_like(x)
    ops.add_rms_norm(
        x.data_ptr(), delta.data_ptr(), weight.data_ptr(), h.data_ptr(), x.shape[0], x.shape[1],
        x.stride(0), delta.stride(0), h.stride(0), eps, int(x.dtype == torch.bfloat16),
    )  # fmt: skip
    return h


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """layer_kernels.rms_norm_heads_ on the CPU: each head of x [N, heads, head_dim] (a view
    of whole rows' heads) RMSNorm'd and scaled by weight [head_dim] in place."""
    ops = _ops()
    assert ops is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    assert weight.is_contiguous() and weight.dtype == x.dtype
    tokens, heads, dim = x.shape
    ops.rms_norm_heads(
        x.data_ptr(), weight.data_ptr(), tokens, heads, dim, x.stride(0), eps,
        int(x.dtype == torch.bfloat16),
    )  # fmt: skip


def rope_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> None:
    """layer_kernels.rope_ on the CPU: x [N, heads, head_dim] rotated in place."""
    ops = _ops()
    assert ops is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    assert cos.is_contiguous() and signed_sin.is_contiguous() and cos.dtype == x.dtype
    positions = positions.to(torch.int64).contiguous()
    tokens, heads, dim = x.shape
    ops.rope(
        x.data_ptr(), positions.data_ptr(), cos.data_ptr(), signed_sin.data_ptr(), tokens, heads,
        dim, x.stride(0), x.stride(1), cos.stride(0), int(x.dtype == torch.bfloat16),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor, ops: ctypes.CDLL | None = None) -> torch.Tensor:
    """layer_kernels.silu_mul on the CPU: silu(gate) * up of gate_up [N, 2 * inner] (gate
    first): [N, inner], by `ops` (a build of layer_ops.c; this CPU's by default)."""
    ops = ops or _ops()
    assert ops is not None
    return _gated(ops.silu_mul, gate_up)


def gelu_mul(gate_up: torch.Tensor, ops: ctypes.CDLL | None = None) -> torch.Tensor:
    """layer_kernels.gelu_mul on the CPU: GELU(gate) * up (tanh approximation), as
    silu_mul."""
    ops = ops or _ops()
    assert ops is not None
    return _gated(ops.gelu_mul, gate_up)


def _gated(kernel: Callable[..., None], gate_up: torch.Tensor) -> torch.Tensor:
    assert gate_up.is_contiguous()
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inner, dtype=gate_up.dtype)
    kernel(gate_up.data_ptr(), out.data_ptr(), rows, inner, int(out.dtype == torch.bfloat16))
    return out
