"""Bad input gets an error naming what is wrong, and the engine keeps serving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config import ConfigError, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.checkpoint import load_checkpoint
from cluster.engine.model.model_files import ModelLoadError, bundled_model_path
from cluster.types import InvalidRequestError, SamplingParams
from tests.integration.conftest import INVARIANT


@pytest.mark.parametrize(
    ("prompt", "sampling", "field"),
    [
        ("", SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ([1, 2, 10**9], SamplingParams(), "prompt"),
        ("word " * 9000, SamplingParams(), "prompt"),
        ("Hello", SamplingParams(max_tokens=9000), "max_tokens"),
    ],
)
def test_bad_request_is_refused_by_field(
    engine: LLMEngine, prompt: str | list[int], sampling: SamplingParams, field: str
):
    with pytest.raises(InvalidRequestError, match=f"^{field}:"):
        engine.add_request(prompt, sampling)
    done = engine.generate(["The capital of France is"], SamplingParams(max_tokens=3))
    assert len(done[0].token_ids) == 3


def test_unknown_model_path(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=str(tmp_path / "nope.gguf")))


def test_truncated_gguf(tmp_path: Path):
    bad = tmp_path / "cut.gguf"
    with bundled_model_path().open("rb") as f:
        bad.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match=r"cut\.gguf"):
        load_checkpoint(bad)


def test_corrupt_safetensors(tmp_path: Path, tiny_llama_dir: Path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_checkpoint(broken)


def test_unsupported_architecture(tmp_path: Path, tiny_llama_dir: Path):
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_checkpoint(other)


def test_generate_with_one_bad_prompt_queues_none(engine: LLMEngine):
    with pytest.raises(InvalidRequestError, match=r"^prompt:"):
        engine.generate(["The capital of France is", ""], SamplingParams(max_tokens=3))
    assert not engine.has_unfinished()


def test_a_kv_cache_larger_than_the_device_is_refused_before_it_is_allocated():
    """The engine's own check, for workers on nodes `splitserve serve` cannot see."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = "cuda:0 \\(.*\\)" if device == "cuda" else "this host's RAM"
    with pytest.raises(ConfigError, match=f"^kv_cache_gb: weights .* exceed .*{where}'s"):
        LLMEngine(EngineConfig(device=device, kv_cache_gb=100_000))


def test_a_kv_tier_too_small_for_one_page_is_refused():
    with pytest.raises(ConfigError, match=r"^kv_offload_gb: 1e-06 GiB holds no page of KV"):
        LLMEngine(EngineConfig(kv_cache_gb=0.01, kv_offload_gb=1e-6))


def test_a_share_of_a_gpu_is_refused_by_a_cpu_engine():
    """The engine's own check of gpu_memory_utilization, for workers serve cannot see."""
    config = EngineConfig(device="cpu", kv_cache_gb=None, gpu_memory_utilization=0.5)
    with pytest.raises(ConfigError, match=r"^gpu_memory_utilization: .* runs on cpu: give kv_"):
        LLMEngine(config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_share_of_the_gpu_sizes_the_kv_cache():
    """0.5 of the GPU, less the bundled model's weights: pages for the rest."""
    engine = LLMEngine(EngineConfig(device="cuda", kv_cache_gb=None, gpu_memory_utilization=0.5))
    _, total = torch.cuda.mem_get_info()
    kv_bytes = engine.pool.num_pages * engine.layout.bytes_per_page
    assert 0 < kv_bytes < 0.5 * total - engine.model.weight_bytes


def test_a_kv_cache_smaller_than_the_context_caps_the_served_context(
    make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        small = make_engine("small-kv", kv_cache_gb=0.01, **INVARIANT)  # a fast decode
    held = small.pool.num_pages * small.pool.page_size
    assert small.max_model_len == held == small.model_info.max_model_len < 8192
    assert any("context capped to" in r.getMessage() for r in caplog.records)
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: "):
        small.add_request("Hello", SamplingParams(max_tokens=held))
    done = small.generate(["Hello"], SamplingParams(max_tokens=held - 8, ignore_eos=True))
    assert len(done[0].token_ids) == held - 8  # a whole-context request fits the cache
