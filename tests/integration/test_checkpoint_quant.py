"""Quantized checkpoints as their quantizers publish them: AWQ (AutoAWQ's GEMM packing),
GPTQ (AutoGPTQ's, v1 zeros, with and without act-order) and FP8 (e4m3 with 128 x 128
block scales, or one scale per tensor), each written from a tiny random Llama
(splitserve/bench/checkpoint_formats.py). Their matrices load exactly as the format
defines them; served, they answer within the bounds of our kernels of transformers
running the same matrices dequantized; what cannot be read is refused naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config import ConfigError, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.kernels.attention_cpu import CpuBackend
from cluster.engine.kernels.kv_cache import KVCache, KVLayout
from cluster.engine.kernels.step_batch import StepBatch
from cluster.engine.model.checkpoint import load_checkpoint
from cluster.engine.model.model import LlamaModel
from cluster.engine.model.model_files import ModelLoadError
from cluster.engine.model.quantization import Fp8Linear, Fp8Rows, GroupQuant
from cluster.types import SamplingParams
from splitserve.bench.checkpoint_formats import FORMATS, write_quantized
from tests.helpers import assert_no_leak
from tests.integration.conftest import TINY, _save_tiny

GROUP = 128  # the published checkpoints' group and block


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama whose matrices have whole groups of 128 inputs."""
    from transformers import LlamaConfig

    shape = {**TINY, "hidden_size": 128, "intermediate_size": 256}
    config = LlamaConfig(**shape, num_key_value_heads=2, tie_word_embeddings=False)
    return Path(_save_tiny(tmp_path_factory.mktemp("ckpt"), "float", config))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_quantized_checkpoints_matrices_load_as_its_format_defines_them(
    fmt: str, float_dir: Path, tmp_path: Path
) -> None:
    quantized, _, exact = write_quantized(float_dir, tmp_path, fmt, GROUP)
    keep = not fmt.startswith("fp8")  # AWQ's and GPTQ's codes as stored, in our 4-bit groups
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
    [
        ("awq", "awq"),
        ("gptq", "gptq"),
        ("gptq-act-order", "gptq"),
        ("fp8-block", "fp8"),
        ("fp8-tensor", "fp8"),
    ],
)
def test_served_on_auto_it_answers_as_transformers_on_the_matrices_it_stands_for(
    fmt: str, mode: str, float_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    quantized, dequantized, _ = write_quantized(float_dir, tmp_path, fmt, GROUP)
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


def _prompt_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Every position's logits from one prefill of `ids` through paged attention."""
    cpu, n, pages = torch.device("cpu"), len(ids), -(-len(ids) // 16)
    cache = KVCache(KVLayout.of(model.spec, 16, torch.float32), pages, cpu)
    attention = CpuBackend(cache.layout, cpu)
    table = torch.arange(pages).view(1, -1)
    batch = StepBatch(0, [0, n], [n], table, torch.arange(n), torch.arange(n))
    rows = torch.arange(n)
    return model.forward(torch.tensor(ids), rows, attention, attention.prepare(batch), cache, rows)


@pytest.mark.parametrize("fmt", ["fp8-tensor", "fp8-block"])
def test_fp8_kept_for_an_fp8_gemm_loads_as_stored_and_answers_as_transformers(
    fmt: str, float_dir: Path, tmp_path: Path
) -> None:
    # As a GPU with an FP8 GEMM loads an FP8 checkpoint (keep): e4m3 codes and a scale a
    # row, multiplied by torch._scaled_mm (here its CPU kernel), activations rounded to
    # e4m3 a row at a time.
    from transformers import AutoModelForCausalLM

    quantized, dequantized, exact = write_quantized(float_dir, tmp_path, fmt, GROUP)
    _, weights = load_checkpoint(quantized, True)
    for key, want in exact.items():
        got = weights.pop(key)
        assert isinstance(got, Fp8Rows) and got.codes.dtype == torch.float8_e4m3fn
        held = got.codes.float() * got.scale[:, None]
        if fmt == "fp8-tensor":  # codes and scale as stored
            assert torch.equal(held, want), key
        else:  # blocks' codes re-rounded under a row's scale: within half a step of e4m3's
            step = want.abs().amax(1, keepdim=True) / 448 * 2**5  # the step at codes 256-448
            assert ((held - want).abs() <= step * 0.5001).all(), key  # ties land on 0.5
    spec, weights = load_checkpoint(quantized, True)
    model = LlamaModel(spec, weights, torch.float32, torch.device("cpu"), "fp8")
    assert isinstance(model.layers[0].qkv, Fp8Linear) and isinstance(model.layers[0].o, Fp8Linear)
    ids = torch.randint(0, 49152, (24,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = _prompt_logits(model, ids).log_softmax(-1)
    ref = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = ref(torch.tensor([ids])).logits[0].log_softmax(-1)
    chosen = theirs.argmax(-1, keepdim=True)
    diff = (ours.gather(1, chosen) - theirs.gather(1, chosen)).abs().max().item()
    print(f"{fmt} on the FP8 GEMM: top logprob differences {diff:.2e}")
    assert diff < 0.05


def test_a_mode_that_is_not_the_checkpoints_own_is_refused_naming_both(
    float_dir: Path, tmp_path: Path
) -> None:
    quantized, _, _ = write_quantized(float_dir, tmp_path, "awq", GROUP)
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
        ({"bits": 3}, "bits 3"),
    ],
)
def test_a_quantization_the_engine_cannot_read_is_refused_at_load_naming_its_key(
    change: dict[str, Any], named: str, float_dir: Path, tmp_path: Path
) -> None:
    quantized, _, _ = write_quantized(float_dir, tmp_path, "gptq", GROUP)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"].update(change)
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=named):
        LLMEngine(EngineConfig(model=str(quantized), kv_cache_gb=0.01))
