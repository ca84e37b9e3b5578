"""Quantized checkpoints as their quantizers publish them: AWQ (AutoAWQ's GEMM packing),
GPTQ (AutoGPTQ's, v1 zeros) and FP8 (e4m3 with 128 x 128 block scales, or one scale per
tensor), each written here from a tiny random Llama. Their matrices load exactly as the
format defines them; served, they answer within the bounds of our kernels of transformers
running the same matrices dequantized; what cannot be read is refused naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.config import ConfigError, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.checkpoint import load_checkpoint
from cluster.engine.model.model_files import ModelLoadError
from cluster.engine.model.quantization import GroupQuant
from cluster.types import SamplingParams
from tests.helpers import assert_no_leak
from tests.integration.conftest import TINY, _save_tiny

GROUP = 128  # the published checkpoints' group and block
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FORMATS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
             "sym": False},
    "fp8-block": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                  "weight_block_size": [GROUP, GROUP]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
}  # fmt: skip


def _pack(nibbles: torch.Tensor, along_rows: bool) -> torch.Tensor:
    """Eight 4-bit values to an int32 word, the first in the low bits, as the quantizers
    pack them (along the rows: GPTQ's qweight; along the columns: the rest)."""
    n = nibbles.int()
    n = n.unflatten(0, (-1, 8)).transpose(1, 2) if along_rows else n.unflatten(1, (-1, 8))
    word = torch.zeros(n.shape[:-1], dtype=torch.int64)
    for i in range(8):
        word |= n[..., i].long() << (4 * i)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).int()


def _int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit groups of GROUP inputs, as AWQ and GPTQ store them: codes [in, out],
    zeros and float16 scales [groups, out], and the matrix they stand for [out, in]."""
    t = w.t().unflatten(0, (-1, GROUP))  # [groups, GROUP, out]
    low, high = t.amin(1), t.amax(1)
    scales = ((high - low) / 15).half()
    s = scales.float()
    zeros = (-low / s).round().clamp(0, 15)
    q = ((t / s.unsqueeze(1)).round() + zeros.unsqueeze(1)).clamp(0, 15)
    exact = ((q - zeros.unsqueeze(1)) * s.unsqueeze(1)).flatten(0, 1).t()
    return q.flatten(0, 1), zeros, scales, exact


def _awq(name: str, w: torch.Tensor, out: dict[str, torch.Tensor]) -> torch.Tensor:
    q, zeros, scales, exact = _int4(w)
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # AutoAWQ's order within a word
    cols = (torch.arange(q.shape[1]).view(-1, 8)[:, order]).flatten()
    out[name + "qweight"] = _pack(q[:, cols], False)
    out[name + "qzeros"] = _pack(zeros[:, cols], False)
    out[name + "scales"] = scales
    return exact


def _gptq(name: str, w: torch.Tensor, out: dict[str, torch.Tensor]) -> torch.Tensor:
    q, zeros, scales, exact = _int4(w)
    out[name + "qweight"] = _pack(q, True)
    out[name + "qzeros"] = _pack(zeros - 1, False)  # v1: each zero stored minus one
    out[name + "scales"] = scales
    out[name + "g_idx"] = (torch.arange(q.shape[0]) // GROUP).int()
    return exact


def _fp8(name: str, w: torch.Tensor, out: dict[str, torch.Tensor], block: bool) -> torch.Tensor:
    if block:  # a last block of fewer rows or columns has a scale of its own too
        rows, cols = w.shape
        padded = torch.zeros(-(-rows // GROUP) * GROUP, -(-cols // GROUP) * GROUP)
        padded[:rows, :cols] = w.abs()
        scale = padded.unflatten(0, (-1, GROUP)).unflatten(2, (-1, GROUP)).amax((1, 3)) / 448
        full = scale.repeat_interleave(GROUP, 0)[:rows].repeat_interleave(GROUP, 1)[:, :cols]
        out[name + "weight_scale_inv"] = scale
    else:
        scale = full = w.abs().max() / 448
        out[name + "weight_scale"] = scale
        out[name + "input_scale"] = torch.tensor(0.02)  # static activations: not read here
    codes = (w / full).to(torch.float8_e4m3fn)
    out[name + "weight"] = codes
    return codes.float() * full


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose matrices have whole groups of 128 inputs."""
    from transformers import LlamaConfig

    shape = {**TINY, "hidden_size": 128, "intermediate_size": 256}
    config = LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=False)
    return Path(_save_tiny(tmp_path_factory.mktemp("ckpt"), "float", config))


def _write(float_dir: Path, root: Path, fmt: str) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """`fmt`'s checkpoint of float_dir's model, and a float checkpoint of the matrices it
    stands for (what transformers runs), and those matrices by name."""
    tensors = load_file(str(float_dir / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for key, w in tensors.items():
        name = key.removesuffix("weight")
        if not name.endswith(tuple(p + "." for p in PROJECTIONS)):
            packed[key] = w
            continue
        if fmt == "awq":
            exact[key] = _awq(name, w, packed)
        elif fmt == "gptq":
            exact[key] = _gptq(name, w, packed)
        else:
            exact[key] = _fp8(name, w, packed, fmt == "fp8-block")
    quantized, dequantized = root / fmt, root / f"{fmt}-dequantized"
    for d, held in ((quantized, packed), (dequantized, {**tensors, **exact})):
        shutil.copytree(float_dir, d)
        save_file(held, str(d / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = FORMATS[fmt]
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized, exact


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_checkpoints_matrices_load_as_its_format_defines_them(
    fmt: str, float_dir: Path, tmp_path: Path
) -> None:
    quantized, _, exact = _write(float_dir, tmp_path, fmt)
    keep = fmt in ("awq", "gptq")  # their codes as stored, in our 4-bit groups
    _, weights = load_checkpoint(quantized, keep)
    for key, want in exact.items():
        got = weights.pop(key)
        if keep:
            assert isinstance(got, GroupQuant) and got.bits == 4
            got = got.dequantize()
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, want), key


@pytest.mark.parametrize(
    ("fmt", "mode"),
    [("awq", "awq"), ("gptq", "gptq"), ("fp8-block", "fp8"), ("fp8-tensor", "fp8")],
)
def test_served_on_auto_it_answers_as_transformers_on_the_matrices_it_stands_for(
    fmt: str, mode: str, float_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    quantized, dequantized, _ = _write(float_dir, tmp_path, fmt)
    engine = LLMEngine(EngineConfig(model=str(quantized), dtype="float32", kv_cache_gb=0.01))
    assert engine.quantization == mode  # auto read the checkpoint's own
    ref = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    prompt = engine.tokenizer.encode("Hello there, tiny model")
    done = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True))[
        0
    ]
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + done.token_ids])).logits[0, len(prompt) - 1 : -1]
    ours = torch.tensor(done.logprobs)
    theirs = logits.log_softmax(-1).gather(1, torch.tensor(done.token_ids)[:, None])[:, 0]
    # our kernels round each activation group to 8-bit steps (fp8: the matrices to 8-bit
    # groups too): the tokens we chose are transformers' likely ones, within a bound
    print(f"{fmt}: logprob differences {(ours - theirs).abs().max():.2e}")
    assert (ours - theirs).abs().max() < 0.02
    assert_no_leak(engine)


def test_a_mode_that_is_not_the_checkpoints_own_is_refused_naming_both(
    float_dir: Path, tmp_path: Path
) -> None:
    quantized, _, _ = _write(float_dir, tmp_path, "awq")
    with pytest.raises(
        ConfigError, match=r"quantization: gptq: .*: its weights are not gptq \(they are awq\)"
    ):
        LLMEngine(EngineConfig(model=str(quantized), quantization="gptq", kv_cache_gb=0.01))
    with pytest.raises(
        ConfigError, match=r"quantization: awq: .*: its weights are not awq \(they are none\)"
    ):
        LLMEngine(EngineConfig(model=str(float_dir), quantization="awq", kv_cache_gb=0.01))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
        ({"desc_act": True}, "desc_act True"),
    ],
)
def test_a_quantization_the_engine_cannot_read_is_refused_at_load_naming_its_key(
    change: dict[str, Any], named: str, float_dir: Path, tmp_path: Path
) -> None:
    quantized, _, _ = _write(float_dir, tmp_path, "gptq")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"].update(change)
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=named):
        LLMEngine(EngineConfig(model=str(quantized), kv_cache_gb=0.01))
