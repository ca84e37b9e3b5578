"""`splitserve plan capacity`: KV capacity and the memory wall, against hand-computed cases
and the engine's own start-up report."""

from __future__ import annotations

import pytest
import torch

from cluster.config import ConfigError
from cluster.engine.kernels.kv_cache import KVLayout, kv_dtype
from splitserve.capacity import (
    ARCHITECTURES,
    decode_bound,
    kv_bytes_per_token,
    kv_capacity,
    num_params,
    weight_bytes,
)
from splitserve.hardware import GPUS

SMOL = ARCHITECTURES["smollm2-135m"]


def test_the_textbook_70b_on_an_a100() -> None:
    """140 GB of 16-bit weights / 2 TB/s = 0.07 s a token, 14 tok/s; 35 GB at 4 bits ~57."""
    model, a100 = ARCHITECTURES["llama-3-70b"], GPUS["A100"]
    assert weight_bytes(model, 16) / 1e9 == pytest.approx(141, rel=0.01)
    assert weight_bytes(model, 4) / 1e9 == pytest.approx(35.3, rel=0.01)
    bf16 = decode_bound(model, a100, 16, "bfloat16", batch=1, context=1)
    int4 = decode_bound(model, a100, 4, "bfloat16", batch=1, context=1)
    assert bf16.step_s == pytest.approx(0.069, rel=0.02) and bf16.bound == "memory"
    assert bf16.tokens_per_s_per_user == pytest.approx(14.4, rel=0.02)
    assert int4.tokens_per_s_per_user == pytest.approx(57.8, rel=0.02)


def test_the_70b_split_over_four_a100s_fits_each_and_pays_its_all_reduces() -> None:
    """Tensor parallel 4: 141 / 4 = 35.3 GB of bf16 weights per device, 2 of the 8 KV heads
    (80 layers x 2 x 2 x 128 x 2 bytes = 80 KiB a token), so 40 GiB per device holds 32768
    pages of 16. A batch-1 step reads 35.3 GB at 2039 GB/s (17.3 ms) and joins 160
    all-reduces of 8192 x 2 bytes: 1.5 x 16 KiB / 300 GB/s each, plus 8 us."""
    model, a100 = ARCHITECTURES["llama-3-70b"], GPUS["A100"]
    assert weight_bytes(model, 16, tp=4) / 1e9 == pytest.approx(35.3, rel=0.01)
    assert kv_bytes_per_token(model, "bfloat16", tp=4) == 80 * 1024
    assert kv_capacity(model, "bfloat16", 16, 40, tp=4).pages == 32768
    d = decode_bound(model, a100, 16, "bfloat16", 1, 1, tp=4, link_gb_s=300)
    assert d.memory_s == pytest.approx(35.3e9 / 2039e9, rel=0.01)
    assert d.allreduce_s == pytest.approx(160 * (1.5 * 8192 * 2 / 300e9 + 8e-6))
    assert d.step_s == pytest.approx(d.memory_s + d.allreduce_s)
    # Past the KV heads each rank holds one, replicated: 8 heads over 16 devices.
    for tp in (8, 16):
        assert kv_bytes_per_token(model, "bfloat16", tp=tp) == 2 * 80 * 1 * 128 * 2
    one = decode_bound(model, a100, 16, "bfloat16", 1, 1)
    assert one.allreduce_s == 0 and one.step_s == one.memory_s
    with pytest.raises(ValueError, match="needs a link bandwidth > 0"):
        decode_bound(model, a100, 16, "bfloat16", 1, 1, tp=2)  # no link given


def test_kv_arithmetic_by_hand_and_as_the_engine_reports_it() -> None:
    # 2 (K, V) x 30 layers x 3 KV heads x 64 x 4 bytes = 46,080 bytes = 45.0 KiB a token
    assert kv_bytes_per_token(SMOL, "float32") == 46_080
    assert kv_bytes_per_token(SMOL, "bfloat16") == 23_040
    cap = kv_capacity(SMOL, "float32", 16, 1.0)
    # The engine's start-up line: 1456 pages of 16 tokens, 2 of 8192, 45 of 512, 11 of 2048.
    assert (cap.pages, cap.tokens) == (1456, 23_296)
    assert [cap.sequences(n) for n in (8192, 512, 2048)] == [2, 45, 11]
    for gb in (0.05, 1.0, 7.5):
        for dtype in ("float32", "bfloat16"):
            layout = KVLayout.of(SMOL, 16, getattr(torch, dtype))
            assert kv_capacity(SMOL, dtype, 16, gb).pages == layout.pages_for(gb * 2**30)


def test_8bit_kv_as_the_engine_stores_it_scale_bytes_counted() -> None:
    """An 8-bit token-head is 64 codes + 1 scale byte (16 a 16-token run): 2 x 30 x 3 x 65 =
    11,700 bytes a token at pages of 16, 1.97x bfloat16's tokens in the same GiB (the
    engine's own KVLayout sizes both); a name the engine does not store is refused."""
    for name in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_bytes_per_token(SMOL, name) == 11_700
        layout = KVLayout.of(SMOL, 16, kv_dtype(name, torch.float32))
        assert kv_capacity(SMOL, name, 16, 1.0).pages == layout.pages_for(2**30) == 5735
    assert kv_capacity(SMOL, "bfloat16", 16, 1.0).pages == 2912  # 5735 / 2912 = 1.97
    assert kv_bytes_per_token(SMOL, "int8", page_size=32) == 2 * 30 * 3 * 65
    with pytest.raises(ConfigError, match=r"kv_dtype: one of bfloat16, .*int8, got 'int4'"):
        kv_capacity(SMOL, "int4", 16, 1.0)


def test_parameters_of_published_models() -> None:
    assert num_params(SMOL) == 134_515_008  # the bundled GGUF's tensors, counted
    assert num_params(ARCHITECTURES["llama-3-8b"]) == 8_030_261_248


def test_a_step_turns_compute_bound_past_the_ridge_point() -> None:
    """bf16 weights: a step does 2 FLOPs per weight byte per sequence, so its arithmetic
    intensity is the batch; past the ridge (H100: 295 FLOP/byte) compute sets the floor."""
    model, h100 = ARCHITECTURES["llama-3-8b"], GPUS["H100"]
    assert h100.ridge_flop_per_byte == pytest.approx(295, rel=0.01)
    below = decode_bound(model, h100, 16, "bfloat16", batch=256, context=1)
    above = decode_bound(model, h100, 16, "bfloat16", batch=512, context=1)
    assert (below.bound, above.bound) == ("memory", "compute")
    assert above.step_s == pytest.approx(2 * num_params(model) * 512 / 989e12, rel=0.01)


def test_plan_capacity_reports_per_device_figures_under_tensor_parallelism() -> None:
    from splitserve.plan import report

    model = ARCHITECTURES["llama-3-70b"]
    args = ("llama-3-70b", model, GPUS["A100"], "bfloat16", 16, 40.0, [512, 2048, 8192], [1, 64])
    one = report(*args).splitlines()
    four = report(*args, tp=4, link_gb_s=300).splitlines()
    assert "with 40 GiB of KV, the device's 80 GB hold: bf16 no, int8 no, int4 yes" in one
    assert (
        "tensor parallel over 4 devices: each holds 1/4 of the weights and 2 of the 8 KV "
        "heads; two all-reduces a layer over 300 GB/s links" in four
    )
    assert "weights per device: bf16 35.3 GB, int8 17.6 GB, int4 8.82 GB" in four
    assert (
        "with 40 GiB of KV per device, the device's 80 GB hold: bf16 yes, int8 yes, int4 yes"
        in four
    )
    assert "      40      1024       256        64" in four  # 32768 pages per device
    [bf16_b1] = [line for line in four if line.split()[:2] == ["bf16", "1"]]
    assert bf16_b1.split()[-1] == "1.29"  # ms of all-reduces in the step
