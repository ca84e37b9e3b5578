"""The same engine code on CUDA (runs where a GPU is): in float32 its greedy tokens equal
the CPU engine's; by default it runs bfloat16."""

from __future__ import annotations

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from tests.helpers import assert_no_leak


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_matches_cpu(engine: LLMEngine, prompts: list[list[int]]):
    gpu = LLMEngine(EngineConfig(dtype="float32", device="cuda", kv_cache_gb=0.5))
    greedy = SamplingParams(max_tokens=16)
    assert [c.token_ids for c in gpu.generate(prompts, greedy)] == [
        c.token_ids for c in engine.generate(prompts, greedy)
    ]
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=3)
    alone = gpu.generate([prompts[0]], seeded)[0].token_ids
    assert gpu.generate([prompts[1], prompts[0]], seeded)[1].token_ids == alone
    assert_no_leak(gpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_runs_bfloat16_by_default(prompts: list[list[int]]):
    gpu = LLMEngine(EngineConfig(device="cuda", kv_cache_gb=0.5))
    assert gpu.dtype == "bfloat16" and gpu.cache.k.dtype == torch.bfloat16
    [out] = gpu.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out.token_ids) == 8
    assert_no_leak(gpu)


def test_the_reference_engines_run_on_the_cpu_on_any_host(engine: LLMEngine, twin: LLMEngine):
    """What the GPU tests compare against is the CPU engine, GPU host or not."""
    assert engine.device.type == twin.device.type == "cpu"
