"""The same engine code on CUDA: greedy tokens equal the CPU engine's (runs where a GPU is)."""

from __future__ import annotations

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from tests.helpers import assert_no_leak


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_greedy_matches_cpu(engine: LLMEngine, prompts: list[list[int]]):
    gpu = LLMEngine(EngineConfig(device="cuda", kv_cache_gb=0.5))
    greedy = SamplingParams(max_tokens=16)
    assert [c.token_ids for c in gpu.generate(prompts, greedy)] == [
        c.token_ids for c in engine.generate(prompts, greedy)
    ]
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=3)
    alone = gpu.generate([prompts[0]], seeded)[0].token_ids
    assert gpu.generate([prompts[1], prompts[0]], seeded)[1].token_ids == alone
    assert_no_leak(gpu)
