"""The engine with the triton attention backend: on the CPU under Triton's interpreter it
produces the CPU backend's greedy tokens and logprobs on a two-layer Llama with grouped
KV heads, with float and int8 KV pages (prefix hit and chunked prefill included; the
bundled model's 30 layers took the interpreter 43 s), on Gemma 2 and 3's windowed,
soft-capped layers, Qwen3 and Qwen3-MoE; and one decode step of this GPU path
stays within its host budget.
On a CUDA device, decode runs as CUDA graphs and matches the CPU engine on the bundled
model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from cluster.config import ConfigError, EngineConfig
from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from splitserve.bench.step_budget import counting
from tests.helpers import assert_no_leak

# Small enough for the interpreter: a 12-token budget cuts the story into chunks.
ENGINE = dict(
    dtype="float32",
    quantization="none",
    kv_cache_gb=0.01,
    max_num_batched_tokens=12,
    max_model_len=256,
)


@pytest.mark.parametrize(
    "which", ["tiny_gemma2_dir", "tiny_gemma3_dir", "tiny_qwen3_dir", "tiny_qwen3_moe_dir"]
)
def test_triton_backend_serves_each_family_as_the_cpu_backend(
    which: str, request: pytest.FixtureRequest
) -> None:
    # Sliding windows of 8 tokens (the story is 20), soft-capping (Gemma 2), each layer's
    # RoPE tables (Gemma 3's sliding layers), Qwen3's q/k norms before the kernel's RoPE,
    # Qwen3-MoE's experts, over chunked prefill and paged decode.
    model = str(request.getfixturevalue(which))
    triton = LLMEngine(
        EngineConfig(model=model, attention_backend="triton", device="cpu", **ENGINE)
    )
    cpu = LLMEngine(EngineConfig(model=model, device="cpu", **ENGINE))
    assert triton.runner.attention.name == "triton" and cpu.runner.attention.name == "cpu"
    story = cpu.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    greedy = SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)
    [want], [got] = cpu.generate([story], greedy), triton.generate([story], greedy)
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert_no_leak(triton)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_triton_backend_greedy_tokens_equal_the_cpu_backend(tiny_llama_dir: Path, kv: str) -> None:
    """int8 KV: each backend codes its pages as KVLayout.store does and reads them in place."""
    model = str(tiny_llama_dir)
    triton = LLMEngine(
        EngineConfig(
            model=model, attention_backend="triton", device="cpu", kv_cache_dtype=kv, **ENGINE
        )
    )
    cpu = LLMEngine(EngineConfig(model=model, device="cpu", kv_cache_dtype=kv, **ENGINE))
    assert triton.runner.attention.name == "triton"
    assert triton.dtype == "float32"  # auto on the CPU: exact, as transformers
    assert cpu.runner.attention.name == "cpu"
    assert triton.spec.num_kv_heads < triton.spec.num_heads  # grouped KV heads
    tok = cpu.tokenizer
    story = tok.encode("Once upon a time, in a small village by the sea, there lived an old")
    prompts = [story + tok.encode(" fisherman who"), tok.encode("The capital of France is")]
    greedy = SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)
    want = cpu.generate(prompts, greedy)
    got = triton.generate(prompts, greedy)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    # Again: the story's full pages now come from the prefix cache.
    again = triton.generate([prompts[0]], greedy)[0]
    assert again.num_cached_tokens == 16 and again.token_ids == want[0].token_ids
    assert_no_leak(triton)
    assert_no_leak(cpu)


def _decode_budget(engine: LLMEngine, rows: int) -> tuple[int, int, list[str]]:
    """Ops, kernel launches and syncs of one decode-only step of `rows` sequences."""
    # Two tokens: the prefill samples the first, the counted decode step the second.
    params = [SamplingParams(max_tokens=2, ignore_eos=True)] * (rows // 2) + [
        SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.8)
    ] * (rows - rows // 2)
    for i, p in enumerate(params):
        engine.add_request([1, 2, 3, 4 + i], p)
    while any(s.num_computed < s.num_prompt for s in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()
    with counting() as budget:
        outputs = engine.step()
    assert len(outputs) == rows and not engine.has_unfinished()
    return budget.ops, budget.launches, budget.syncs


def test_one_decode_step_syncs_once_and_its_ops_do_not_grow_with_the_batch(
    tiny_llama_dir: Path,
) -> None:
    # Two layers of GQA: the interpreter's time goes to kernels, not to what is counted.
    config = EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", attention_backend="triton", device="cpu"
    )
    engine = LLMEngine(replace(config, kv_cache_gb=0.01))
    ops4, launches4, syncs4 = _decode_budget(engine, 4)
    ops8, launches8, syncs8 = _decode_budget(engine, 8)
    assert syncs4 == syncs8 == ["tolist"]  # the sampled tokens, one copy
    assert ops4 == ops8  # no per-row work
    assert launches4 == launches8 == 3 * engine.spec.num_layers  # store, decode, reduce
    assert_no_leak(engine)


def test_attention_backend_is_validated_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ConfigError, match="attention_backend: flashinfer needs a CUDA device"):
        LLMEngine(EngineConfig(attention_backend="flashinfer", device="cpu", kv_cache_gb=0.05))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_matches_the_cpu_engine(
    engine: LLMEngine, prompts: list[list[int]]
) -> None:
    config = EngineConfig(dtype="float32", device="cuda", attention_backend="triton")
    gpu = LLMEngine(replace(config, kv_cache_gb=0.5))
    assert gpu.runner.graphs is not None
    greedy = SamplingParams(max_tokens=16)
    with counting() as budget:
        got = [c.token_ids for c in gpu.generate(prompts, greedy)]
    assert got == [c.token_ids for c in engine.generate(prompts, greedy)]
    assert budget.replays > 0
    assert_no_leak(gpu)
