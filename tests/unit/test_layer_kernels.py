"""The fused layer kernels against the PyTorch ops they replace, float32 and bfloat16: the
Triton ones (on the GPU when there is one, else under Triton's interpreter) and their C
twins for the CPU (layer_ops.c)."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from cluster.engine.kernels import layer_kernels_cpu, native

layer_kernels = pytest.importorskip("cluster.engine.kernels.layer_kernels")

# bfloat16 keeps 8 bits of mantissa: relative error up to 2^-8 per rounding.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-2},
}


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"silu": F.silu, "gelu": _gelu}


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_silu_of_the_gate_half_times_the_up_half(
    dtype: torch.dtype, activation: str, kernel_device: torch.device
) -> None:
    # 70 columns a half: two column blocks of 64, the second ragged (gelu_mul: Gemma's).
    gate_up = torch.randn(5, 140, generator=torch.Generator().manual_seed(0))
    gate_up = gate_up.to(kernel_device, dtype)
    got = getattr(layer_kernels, f"{activation}_mul")(gate_up, block=64)
    gate, up = gate_up.float().chunk(2, dim=-1)
    assert got.dtype == dtype and got.shape == (5, 70)
    expected = ACTIVATIONS[activation](gate) * up
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("arch", ["native", "haswell"])  # this CPU's vectors, and AVX2's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_silu_mul_is_torch_s_within_its_rounding(
    arch: str, dtype: torch.dtype, activation: str
) -> None:
    """Rows of 70 (a partial last vector) over the whole range: exp's overflow and underflow
    sides included, and the two roundings PyTorch's bfloat16 ops make (gelu_mul: Gemma's
    GELU, tanh's approximation, by the same exp)."""
    lib = native.library("layer_ops.c", arch)
    if lib is None:
        pytest.skip("layer_ops.c cannot be built here (no C compiler)")
    ops = layer_kernels_cpu.bind(lib)
    gate_up = torch.randn(5, 140, generator=torch.Generator().manual_seed(3)) * 4
    gate_up[0, :8] = torch.tensor([-200.0, -88.0, -87.0, -20.0, 0.0, 20.0, 88.0, 200.0])
    gate_up = gate_up.to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = getattr(layer_kernels_cpu, f"{activation}_mul")(gate_up, ops)
    assert got.dtype == dtype and got.shape == (5, 70)
    # exp within 2 ulp of expf: float32 within a few ulp; bfloat16 at most one step of its
    # rounding off PyTorch's. Far below -87 the exp is 2^-126 where it rounds to 0: a
    # silu of ~1e-35 for 0.
    rtol = 1e-6 if dtype == torch.float32 else 2**-8
    # PyTorch's GELU takes 1 + tanh(u) where tanh(u) is near -1 (g below about -3): its
    # float32 cancels to within 2^-24 * |g| of ours (which weighs by e^-|2u| exactly), 0 in
    # its far tail where ours is ~1e-7.
    atol = 1e-30 if activation == "silu" else 2**-24 * gate.float().abs().max().item()
    expected = (ACTIVATIONS[activation](gate) * up).float()
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=atol)


@pytest.fixture(params=["triton", "c"])
def fused(
    request: pytest.FixtureRequest, kernel_device: torch.device
) -> tuple[ModuleType, torch.device]:
    """Which kernels, and where their tensors live."""
    if request.param == "triton":
        return layer_kernels, kernel_device
    ops = layer_kernels_cpu.module(torch.float32)
    if ops is None:
        pytest.skip("layer_ops.c cannot be built here (no C compiler)")
    return ops, torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_adds_in_place_and_norms_the_sum(
    dtype: torch.dtype, fused: tuple[ModuleType, torch.device]
) -> None:
    kernels, kernel_device = fused
    g = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(4, 96, generator=g).to(kernel_device, dtype) for _ in range(2))
    weight = (torch.rand(96, generator=g) + 0.5).to(kernel_device, dtype)
    total = x + delta  # as the residual add rounds it
    want = F.rms_norm(total.float(), (96,), weight.float(), 1e-5)
    h = kernels.add_rms_norm(x, delta, weight, 1e-5)
    # Equal in float32; in bfloat16 within its rounding (the interpreter's casts truncate).
    torch.testing.assert_close(x.float(), total.float(), **TOLERANCE[dtype])
    assert h.dtype == dtype
    torch.testing.assert_close(h.float(), want, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_heads_norms_each_q_head_in_place_and_leaves_the_rest(
    dtype: torch.dtype, fused: tuple[ModuleType, torch.device]
) -> None:
    """Qwen3's q/k norm: q's 3 heads of a fused qkv row, each RMSNorm'd alone."""
    kernels, kernel_device = fused
    g = torch.Generator().manual_seed(3)
    dim = 16
    qkv = (4 * torch.randn(3, 5 * dim, generator=g)).to(kernel_device, dtype)
    weight = (torch.rand(dim, generator=g) + 0.5).to(kernel_device, dtype)
    q = qkv[:, : 3 * dim].view(3, 3, dim)
    want = F.rms_norm(q.float(), (dim,), weight.float(), 1e-6)
    rest = qkv[:, 3 * dim :].clone()
    kernels.rms_norm_heads_(q, weight, 1e-6)
    torch.testing.assert_close(q.float(), want, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, 3 * dim :], rest)  # k and v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_q_and_k_in_place_as_the_model_does(
    dtype: torch.dtype, fused: tuple[ModuleType, torch.device]
) -> None:
    """q (3 heads) and k (1 head) side by side in a fused qkv row, as the model has them."""
    kernels, kernel_device = fused
    from cluster.engine.model.model import rotate

    g = torch.Generator().manual_seed(2)
    dim, positions = 16, torch.tensor([0, 5, 9], device=kernel_device)
    freqs = torch.outer(torch.arange(12).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos = torch.cat((freqs, freqs), dim=-1).cos().to(kernel_device, dtype)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(kernel_device, dtype)
    qkv = torch.randn(3, 5 * dim, generator=g).to(kernel_device, dtype)  # q: 3, k: 1, v: 1
    qk = qkv[:, : 4 * dim].view(3, 4, dim)
    want = rotate(qk.float(), cos[positions].float()[:, None], sin[positions].float()[:, None])
    v = qkv[:, 4 * dim :].clone()
    kernels.rope_(qk, positions, cos, sin)
    torch.testing.assert_close(qk.float(), want, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, 4 * dim :], v)  # v untouched
