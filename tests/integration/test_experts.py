"""Mixture-of-Experts models (Mixtral, Qwen3-MoE) on generated checkpoints: a step computes
only the experts its tokens chose, and the experts on our 8- and 4-bit kernels answer
within the quantized modes' bounds of transformers' float32. (Their float32 logits and
greedy tokens against transformers: test_hf_checkpoint.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cluster.config import EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.engine.model.experts import DenseMlp, Experts
from cluster.types import SamplingParams
from tests.helpers import assert_no_leak


class Counted:
    """An expert that counts the rows it computed, call by call."""

    def __init__(self, expert: DenseMlp, calls: list[int]) -> None:
        self.expert, self.calls = expert, calls

    def __call__(self, h: torch.Tensor, silu_mul: Any) -> torch.Tensor:
        self.calls.append(h.shape[0])
        return self.expert(h, silu_mul)


def test_a_decode_step_computes_only_the_experts_its_token_chose(tiny_mixtral_dir: Path):
    engine = LLMEngine(EngineConfig(model=str(tiny_mixtral_dir), dtype="float32", kv_cache_gb=0.01))
    prompt = engine.tokenizer.encode("Hello there, tiny model")
    calls: list[int] = []
    for layer in engine.model.layers:
        assert isinstance(layer.mlp, Experts) and len(layer.mlp.experts) == 8
        layer.mlp.experts = [Counted(e, calls) for e in layer.mlp.experts]  # type: ignore[misc]
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # the prompt: its tokens spread over the experts
    prefill = list(calls)
    assert sum(prefill) == 2 * len(prompt) * len(engine.model.layers)  # two a token
    calls.clear()
    engine.step()  # one token: two experts a layer, one row each
    assert calls == [1] * 2 * len(engine.model.layers)
    while engine.has_unfinished():
        engine.step()
    assert_no_leak(engine)


@pytest.mark.parametrize(("mode", "bound"), [("int8", 0.02), ("int4", 0.1)])
@pytest.mark.parametrize("which", ["tiny_mixtral_dir", "tiny_qwen3_moe_dir"])
def test_experts_on_our_quantized_kernels_stay_within_the_modes_bounds(
    which: str, mode: str, bound: float, request: pytest.FixtureRequest
) -> None:
    from transformers import AutoModelForCausalLM

    path: Path = request.getfixturevalue(which)
    config = EngineConfig(model=str(path), dtype="float32", quantization=mode, kv_cache_gb=0.01)
    engine = LLMEngine(config)
    prompt = engine.tokenizer.encode("Hello there, tiny model")
    sampling = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)
    done = engine.generate([prompt], sampling)[0]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + done.token_ids])).logits[0, len(prompt) - 1 : -1]
    theirs = logits.log_softmax(-1).gather(1, torch.tensor(done.token_ids)[:, None])[:, 0]
    diff = (torch.tensor(done.logprobs) - theirs).abs().max().item()
    print(f"{path.name} {mode}: logprob differences {diff:.2e}")
    assert diff < bound
    assert_no_leak(engine)
