"""Our integer kernel for quantized weights (cluster/engine/kernels/qmatmul.c): what it computes,
held to a numpy model of its rounding, in both its builds (AVX-512 VNNI and AVX2, each
where this CPU runs it); rows independent of their batch; and the fallback to torch's
kernel where it cannot be built."""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from cluster.engine.kernels import native, qmatmul
from cluster.engine.kernels.cpu_isa import cpu
from cluster.engine.model.quantization import (
    GROUP,
    BlockLinear,
    GroupQuant,
    Int4Linear,
    linear,
    quantize,
)

needs_kernel = pytest.mark.skipif(
    not qmatmul.available(), reason="the kernel needs AVX2 or AVX-512 VNNI (torch's is used)"
)


@pytest.fixture(params=["native", "haswell"], ids=["this-cpu", "avx2"])
def build(request: pytest.FixtureRequest) -> ctypes.CDLL:
    """qmatmul.c built for this CPU, and for AVX2 alone (gcc's haswell: AVX2, FMA, F16C)."""
    if request.param == "haswell" and not {"avx2", "fma", "f16c"} <= cpu()[1]:
        pytest.skip("this CPU cannot run an AVX2 build")
    lib = native.library("qmatmul.c", request.param)
    if lib is None or not qmatmul.bind(lib).qmatmul_isa():
        pytest.skip(f"no {request.param} build of qmatmul.c here")
    if request.param == "haswell":
        assert lib.qmatmul_isa() == 1  # the AVX2 path
    return lib


def _model(x: torch.Tensor, w: GroupQuant) -> np.ndarray:
    """qmatmul.c's arithmetic in float64: each input group in steps of max|x| / 127 plus a
    remainder in 254ths of a step, both rounded to nearest even; float16 scales and offsets;
    the offsets times each group's exact sum."""
    x32 = x.numpy().reshape(x.shape[0], -1, GROUP)
    amax = np.abs(x32).max(-1, keepdims=True)
    units = x32 * np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0)
    whole = np.rint(units)
    fine = np.rint((units - whole) * np.float32(254))
    steps = whole.astype(np.float64) + fine / 254
    q = w.q.double().numpy().reshape(w.shape[0], -1, GROUP)
    d = w.scale.half().double().numpy()
    m = w.offset.half().double().numpy()
    dots = np.einsum("rgj,ngj->rng", steps, q)
    scaled = np.einsum("rng,ng,rg->rn", dots, d, amax[..., 0].astype(np.float64) / 127)
    return scaled + np.einsum("ng,rg->rn", m, x32.astype(np.float64).sum(-1))


@pytest.mark.parametrize("mode", ["int4", "int8"])
@pytest.mark.parametrize(("rows", "outputs"), [(1, 96), (3, 100), (7, 16), (9, 33)])
def test_kernel_computes_what_its_rounding_says(
    build: ctypes.CDLL, mode: str, rows: int, outputs: int
) -> None:
    g = torch.Generator().manual_seed(rows * outputs)
    w = quantize(torch.randn(outputs, 6 * GROUP, generator=g), mode)
    x = torch.randn(rows, 6 * GROUP, generator=g)
    x[0, :GROUP] = 0  # a group of zeros has no step
    x[-1, 5] = 40.0  # an outlier sets its group's step
    y = qmatmul.matmul(x, qmatmul.pack(w.q, w.scale, w.offset, w.bits), outputs, w.bits, build)
    assert y.shape == (rows, outputs) and y.dtype == torch.float32
    np.testing.assert_allclose(y.numpy(), _model(x, w), rtol=1e-5, atol=1e-4)
    # and close to the dequantized matrix itself: the remainders keep ~15 bits of each input
    exact = x.double() @ w.dequantize().double().t()
    assert (y.double() - exact).abs().max().item() < 1e-3 * exact.abs().max().item()


@needs_kernel
def test_a_row_gets_the_same_bits_in_any_batch() -> None:
    g = torch.Generator().manual_seed(0)
    layer = BlockLinear(quantize(torch.randn(64, 4 * GROUP, generator=g), "int4"), None)
    x = torch.randn(11, 4 * GROUP, generator=g)
    together = layer(x)
    for i in range(11):
        assert torch.equal(layer(x[i : i + 1])[0], together[i])


@needs_kernel
def test_bias_and_the_activation_dtype_are_kept() -> None:
    g = torch.Generator().manual_seed(1)
    w = quantize(torch.randn(32, 2 * GROUP, generator=g), "int8")
    bias = torch.randn(32, generator=g).to(torch.bfloat16)
    x = torch.randn(2, 2 * GROUP, generator=g).to(torch.bfloat16)
    y = linear(w, bias, torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    ref = x.float() @ w.dequantize().t() + bias.float()
    torch.testing.assert_close(y.float(), ref, rtol=0.02, atol=0.05)


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> Iterator[None]:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    clear = lambda: (qmatmul.kernel.cache_clear(), native.library.cache_clear())
    clear()
    yield
    clear()


def test_without_a_compiler_torch_kernel_multiplies(
    no_compiler: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        layer = linear(quantize(torch.randn(16, GROUP), "int4"), None, torch.float32)
        assert isinstance(layer, Int4Linear)
        linear(quantize(torch.randn(16, GROUP), "int4"), None, torch.float32)
    warnings = [r.getMessage() for r in caplog.records if r.name == "cluster.engine.kernels.native"]
    assert len(warnings) == 1 and "/nonexistent/cc" in warnings[0], warnings
    assert qmatmul.describe() == "torch's int4 kernel"


def test_bfloat16_rows_convert_in_the_kernel_as_torch_would(build: ctypes.CDLL) -> None:
    g = torch.Generator().manual_seed(4)
    w = quantize(torch.randn(40, 3 * GROUP, generator=g), "int4")
    packed = qmatmul.pack(w.q, w.scale, w.offset, w.bits)
    x = torch.randn(5, 3 * GROUP, generator=g).bfloat16()
    y = qmatmul.matmul(x, packed, 40, w.bits, build)
    assert y.dtype == torch.bfloat16
    wide = qmatmul.matmul(x.float(), packed, 40, w.bits, build)  # the same inputs, widened
    assert torch.equal(y, wide.bfloat16())
