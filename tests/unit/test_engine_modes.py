"""The auto modes, the defaults: what `dtype: auto` and `quantization: auto` resolve to on
each device, and what the engine's start-up line says of the choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cluster.config import ConfigError, EngineConfig
from cluster.engine.build import describe_modes, pick_dtype, pick_quantization
from cluster.engine.kernels import qmatmul
from cluster.engine.kernels.cpu_isa import cpu, fast_dtype, native_bf16
from cluster.engine.model import quantization
from cluster.engine.model.model_files import bundled_model_path

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_auto_dtype_is_bfloat16_on_cuda_and_the_cpus_fast_dtype_on_the_cpu() -> None:
    assert pick_dtype("auto", CUDA) == "bfloat16"
    assert pick_dtype("auto", CPU) == fast_dtype("cpu")
    assert pick_dtype("auto", CPU) == ("bfloat16" if native_bf16(cpu()[1]) else "float32")
    assert pick_dtype("float32", CUDA) == "float32"
    assert pick_dtype("bfloat16", CPU) == "bfloat16"


def test_float16_is_a_cuda_dtype_and_refused_on_the_cpu_naming_what_serves() -> None:
    assert EngineConfig(dtype="float16").dtype == "float16"
    assert pick_dtype("float16", CUDA) == "float16"
    with pytest.raises(ConfigError, match=r"dtype: float16 runs on CUDA only .* bfloat16, float32"):
        pick_dtype("float16", CPU)


def test_auto_quantization_serves_a_gguf_as_stored_on_the_cpu_only(tmp_path: Path) -> None:
    gguf, directory = bundled_model_path(), tmp_path / "hf-checkpoint"
    directory.mkdir()
    assert pick_quantization("auto", gguf, CPU) == "gguf"
    assert pick_quantization("auto", directory, CPU) == "none"
    assert pick_quantization("auto", gguf, CUDA) == "none"  # its kernels are CPU ones
    assert pick_quantization("int4", directory, CPU) == "int4"
    assert pick_quantization("none", gguf, CPU) == "none"


def test_an_awq_or_gptq_checkpoint_is_dequantized_on_a_gpu_and_kept_on_the_cpu(
    tmp_path: Path,
) -> None:
    # Our int4 kernel is a CPU one: on a GPU auto takes the float weights the checkpoint's
    # groups dequantize to (as quantization none asks), where it refused them before.
    for method in ("awq", "gptq"):
        directory = tmp_path / method
        directory.mkdir()
        stated = {"quant_method": method, "bits": 4, "group_size": 128, "version": "gemm"}
        (directory / "config.json").write_text(json.dumps({"quantization_config": stated}))
        assert pick_quantization("auto", directory, CPU) == method
        assert pick_quantization("auto", directory, CUDA) == "none"


def test_a_gguf_whose_blocks_have_no_kernel_here_is_served_as_8_bit_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The bundled file's layers are Q4_1 and its embedding Q8_0: without a Q4_1 kernel it
    # is what a K-quant file is today (not float weights: 4x the bytes of a 4-bit file).
    assert pick_quantization("auto", bundled_model_path(), CPU) == "gguf"
    monkeypatch.delitem(quantization.GGUF_BLOCKS, "Q4_1")
    assert pick_quantization("auto", bundled_model_path(), CPU) == "int8"
    line = describe_modes(EngineConfig(), "bfloat16", "int8", "cpu")
    assert "quantization auto: int8 (the GGUF's blocks have no kernel here" in line


def test_the_start_up_line_says_what_auto_chose_and_why() -> None:
    auto = describe_modes(EngineConfig(), fast_dtype("cpu"), "gguf", "cpu")
    why = "native bf16: " if native_bf16(cpu()[1]) else "bf16 would be emulated: "
    assert auto.startswith(f"dtype auto: {fast_dtype('cpu')} ({why}")
    kernel = qmatmul.describe()  # which multiplies the blocks here: ours, or torch's
    assert auto.endswith(f", quantization auto: gguf (the GGUF's blocks as stored) on {kernel}")
    gpu = describe_modes(EngineConfig(device="cuda"), "bfloat16", "none", "cuda")
    assert gpu == "dtype auto: bfloat16 (a GPU), quantization auto: none (float weights)"
    named = EngineConfig(dtype="float32", quantization="none")
    assert describe_modes(named, "float32", "none", "cpu") == "float32, quantization none"
