"""`splitserve plan capacity`: KV capacity and the memory wall, against hand-computed cases
and the engine's own start-up report."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.kv_cache import KVLayout
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
