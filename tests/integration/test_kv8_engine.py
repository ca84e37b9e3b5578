"""8-bit KV pages on the bundled model: greedy tokens the same whatever the batching
(alone, all together, prefix-cache hits, chunked and unchunked prefill, preemption under a
tiny page budget), as float pages' are, because a page's codes do not depend on how its
tokens were batched (kv_cache.py); and the capacity the engine reports for them.

On INVARIANT's weights (each row's matmul its own alone): coding K and V into 8 bits turns
a last-bit difference in them into a whole step now and then, so torch's float matmuls,
whose rows round by the batch's shape, would move tokens that float pages keep."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.engine.engine import LLMEngine
from cluster.types import SamplingParams
from tests.integration.conftest import INVARIANT, MAX_NEW

GREEDY = SamplingParams(max_tokens=MAX_NEW)


def _tokens(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_tokens_do_not_depend_on_the_batching(
    make_engine: Any, prompts: list[list[int]], kv: str
) -> None:
    engine = make_engine(f"{kv}-kv", **INVARIANT, kv_cache_dtype=kv)
    assert engine.layout.scaled and engine.cache.k.dtype.itemsize == 1
    alone = [_tokens(engine, [p])[0] for p in prompts]
    assert _tokens(engine, prompts) == alone  # together, then again from the prefix cache
    hits = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in hits] == alone
    assert any(c.num_cached_tokens for c in hits)
    chunked = make_engine(
        f"{kv}-kv-chunked-32",
        **INVARIANT,
        kv_cache_dtype=kv,
        max_num_batched_tokens=32,
        prefix_caching=False,
    )
    assert _tokens(chunked, prompts) == alone
    unchunked = make_engine(
        f"{kv}-kv-unchunked",
        **INVARIANT,
        kv_cache_dtype=kv,
        chunked_prefill=False,
        max_num_batched_tokens=64,
    )
    assert _tokens(unchunked, prompts) == alone
    # 12 pages of 16 tokens, 8-bit: the longest request needs ~11; together they need ~40.
    # A preempted request's reply so far is prefilled again, where it was decoded: the two
    # kernels round differently in the last bits (conftest's INVARIANT note), which can move
    # a code by a step, so a token now and then; most requests keep every token.
    tiny = 12.5 * engine.layout.bytes_per_page / 2**30
    preempted = make_engine(
        f"{kv}-kv-tiny", **INVARIANT, kv_cache_dtype=kv, kv_cache_gb=tiny, prefix_caching=False
    )
    assert preempted.pool.num_pages == 12
    again = _tokens(preempted, prompts)
    assert preempted.scheduler.num_preemptions > 0
    assert sum(a == b for a, b in zip(again, alone, strict=True)) >= len(prompts) - 2


def test_8bit_pages_hold_twice_the_tokens_in_the_same_memory(make_engine: Any) -> None:
    wide = make_engine("default-kv-0.05", kv_cache_gb=0.05)
    narrow = make_engine("int8-kv-0.05", kv_cache_gb=0.05, kv_cache_dtype="int8")
    assert wide.layout.dtype.itemsize == 4  # EXACT: float32
    assert narrow.pool.num_pages >= 3.9 * wide.pool.num_pages
