"""Weight quantization: group-wise int8/int4, GGUF blocks read exactly, the int4 kernel
multiplying 4-bit and 8-bit groups like the dequantized matrix would, and the FP8 GEMM
(torch._scaled_mm, here on the CPU) multiplying FP8 rows like theirs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from cluster.engine.build import on_gpu
from cluster.engine.model.quantization import (
    GROUP,
    DenseLinear,
    Fp8Linear,
    Fp8Rows,
    GroupQuant,
    Int4Linear,
    QuantizationError,
    fp8_rows,
    from_gguf_blocks,
    linear,
    quantize,
)


def _matrix(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("mode", "levels"), [("int8", (-128, 127)), ("int4", (0, 15))])
def test_quantize_rounds_each_weight_to_its_groups_nearest_level(
    mode: str, levels: tuple[int, int]
) -> None:
    w = _matrix(48, 4 * GROUP)
    q = quantize(w, mode)
    assert q.shape == (48, 4 * GROUP) and q.scale.shape == (48, 4)
    step = q.scale.repeat_interleave(GROUP, dim=1)
    err = (q.dequantize() - w).abs()
    assert bool((err <= step / 2 + 1e-6).all())
    # Each group spans its levels: its smallest weight is the lowest, its largest the top.
    groups = q.q.int().view(48, 4, GROUP)
    assert bool((groups.amin(-1) == levels[0]).all() and (groups.amax(-1) == levels[1]).all())


def test_quantize_refuses_inputs_not_a_multiple_of_the_group() -> None:
    with pytest.raises(QuantizationError, match="multiple of the group size 32"):
        quantize(_matrix(4, 48), "int4")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_read_exactly_as_gguf_dequantizes_them(kind: str) -> None:
    w = _matrix(8, 3 * GROUP).numpy()
    qtype = GGMLQuantizationType[kind]
    raw = gguf_quantize(w, qtype)
    ours = from_gguf_blocks(kind, raw, 8, 3 * GROUP).dequantize().numpy()
    np.testing.assert_array_equal(ours, gguf_dequantize(raw, qtype).reshape(8, -1))


def test_widening_4bit_groups_to_8bit_is_exact() -> None:
    q = quantize(_matrix(16, 2 * GROUP), "int4")
    wide = q.as_8bit()
    assert wide.bits == 8 and wide.q.dtype == torch.int8
    torch.testing.assert_close(wide.dequantize(), q.dequantize(), rtol=0, atol=1e-6)
    mixed = GroupQuant.cat([q, quantize(_matrix(4, 2 * GROUP, seed=1), "int8")])
    assert mixed.bits == 8 and mixed.shape == (20, 2 * GROUP)
    torch.testing.assert_close(mixed.dequantize()[:16], q.dequantize(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_int4_kernel_multiplies_like_the_dequantized_matrix(mode: str, rows: int) -> None:
    w = _matrix(96, 4 * GROUP)
    q = quantize(w, mode)
    bias = torch.randn(96)
    layer = Int4Linear(q, bias)  # where our kernel (test_qmatmul.py) cannot run
    assert len(layer.parts) == (2 if mode == "int8" else 1)  # 8-bit: hi and lo nibbles
    x = torch.randn(rows, 4 * GROUP, generator=torch.Generator().manual_seed(2))
    ref = x @ q.dequantize().t() + bias
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    # The kernel computes in bfloat16: errors of its input rounding, not of the weights.
    assert (out - ref).abs().max().item() < 0.02 * ref.abs().max().item()
    assert not any(t.is_floating_point() and t.shape == w.shape for t in layer.tensors)


def test_float_weights_stay_dense_in_the_engine_dtype() -> None:
    layer = linear(_matrix(8, GROUP), None, torch.bfloat16)
    assert isinstance(layer, DenseLinear) and layer.w.dtype == torch.bfloat16
    assert layer.w.shape == (GROUP, 8)  # stored [in, out]


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_the_fp8_gemm_multiplies_like_the_dequantized_matrix(rows: int) -> None:
    w = fp8_rows(_matrix(96, 4 * GROUP))
    assert w.codes.dtype == torch.float8_e4m3fn and w.scale.shape == (96,)
    # each row's largest weight is e4m3's largest code
    assert torch.equal(w.codes.float().abs().amax(1), torch.full((96,), 448.0))
    bias = torch.randn(96)
    layer = linear(w, bias, torch.float32)
    assert isinstance(layer, Fp8Linear)
    x = torch.randn(2, rows, 4 * GROUP, generator=torch.Generator().manual_seed(2))
    ref = x @ (w.codes.float() * w.scale[:, None]).t() + bias
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (2, rows, 96)
    # the activations rounded to e4m3 under a scale a row (3 bits of mantissa): a dot
    # product of 128 such terms lands within a few percent of the largest output
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert 0 < err < 0.05
    stacked = Fp8Rows.cat([w, fp8_rows(_matrix(32, 4 * GROUP, seed=1))])
    assert stacked.shape == (128, 4 * GROUP) and torch.equal(
        stacked.codes[:96].float(), w.codes.float()
    )


def test_only_fp8_runs_on_a_gpu_and_only_on_one_with_an_fp8_gemm() -> None:
    on_gpu("fp8", (9, 0))  # Hopper
    on_gpu("fp8", (8, 9))  # Ada
    with pytest.raises(
        QuantizationError, match=r"compute capability 8\.9 or later; this GPU's is 8\.0"
    ):
        on_gpu("fp8", (8, 0))
    for mode in ("int8", "int4", "gguf", "awq", "gptq"):
        with pytest.raises(QuantizationError, match="CPU only"):
            on_gpu(mode, (9, 0))
