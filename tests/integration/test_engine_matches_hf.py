"""Greedy output is token-identical to transformers on the bundled GGUF, in float32,
whatever the batching: alone, all together, with prefix-cache hits, chunked prefill,
unchunked prefill, and a page budget small enough to force preemption."""

from __future__ import annotations

from typing import Any

import torch

from cluster.engine.engine import LLMEngine
from cluster.engine.sched.page_pool import pages_for
from cluster.engine.sched.scheduler import Step
from cluster.engine.sched.sequence import Sequence
from cluster.types import RequestId, SamplingParams
from tests.integration.conftest import MAX_NEW

GREEDY = SamplingParams(max_tokens=MAX_NEW)


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


def test_one_at_a_time(engine: LLMEngine, prompts: list[list[int]], hf_greedy: list[list[int]]):
    assert [_tokens(engine, [p])[0] for p in prompts] == hf_greedy


def test_all_batched_together(
    engine: LLMEngine, prompts: list[list[int]], hf_greedy: list[list[int]]
):
    assert _tokens(engine, prompts) == hf_greedy


def test_prefix_cache_hits(engine: LLMEngine, prompts: list[list[int]], hf_greedy: list[list[int]]):
    engine.generate(prompts, GREEDY)  # warm the prefix cache
    done = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in done] == hf_greedy
    long_prompts = [i for i, p in enumerate(prompts) if len(p) > 2 * engine.pool.page_size]
    assert long_prompts
    for i in long_prompts:
        # Every full page but the one holding the last prompt token came from the cache.
        ps = engine.pool.page_size
        assert done[i].num_cached_tokens == (len(prompts[i]) - 1) // ps * ps


def test_chunked_prefill_shares_steps_with_decodes(
    make_engine: Any, prompts: list[list[int]], hf_greedy: list[list[int]]
):
    engine = make_engine("chunked-32", max_num_batched_tokens=32, prefix_caching=False)
    assert _tokens(engine, prompts) == hf_greedy


def test_unchunked_prefill(make_engine: Any, prompts: list[list[int]], hf_greedy: list[list[int]]):
    engine = make_engine("unchunked", chunked_prefill=False, max_num_batched_tokens=64)
    assert _tokens(engine, prompts) == hf_greedy


def test_preemption_under_a_tiny_page_budget(
    make_engine: Any, prompts: list[list[int]], hf_greedy: list[list[int]]
):
    # 12 pages of 16 tokens: the longest request needs ~11; together they need ~40.
    engine = make_engine("tiny-kv", kv_cache_gb=12.5 * 16 * 46080 / 2**30, prefix_caching=False)
    assert engine.pool.num_pages == 12
    assert _tokens(engine, prompts) == hf_greedy
    assert engine.scheduler.num_preemptions > 0


def test_logits_match_transformers(engine: LLMEngine, prompts: list[list[int]], hf_model: Any):
    """Prefill and one paged decode step, against transformers' logits at the same positions."""
    worst = 0.0
    for i, ids in enumerate(prompts):
        seq = Sequence(RequestId(f"logits-{i}"), list(ids), len(ids), GREEDY)
        seq.pages = engine.pool.allocate(pages_for(len(ids) + 1, engine.pool.page_size)) or []
        try:
            _, prefill = engine.runner.run(Step(prefills=[(seq, len(ids))]))
            seq.num_computed = len(ids)
            seq.token_ids.append(int(prefill.argmax()))
            _, decode = engine.runner.run(Step(decodes=[seq]))
        finally:
            engine.pool.free(seq.pages)
        with torch.inference_mode():
            ref = hf_model(torch.tensor([seq.token_ids])).logits[0, -2:]
        worst = max(worst, (prefill[0] - ref[0]).abs().max().item())
        worst = max(worst, (decode[0] - ref[1]).abs().max().item())
    print(f"logits max abs difference vs transformers (float32): {worst:.2e}")
    assert worst < 1e-3
