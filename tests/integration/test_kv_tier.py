"""The KV tier on the bundled model: a prefix evicted from the pool comes back from the tier
byte for byte and gives the tokens a run that never evicted gives; an entry whose bytes
are corrupted is dropped and recomputed, never served; every page is free at the end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cluster.engine.engine import LLMEngine
from cluster.engine.sched.page_pool import hash_pages
from cluster.types import BlockHash, RequestId, SamplingParams
from tests.helpers import wait_until
from tests.integration.conftest import INVARIANT, RAW_PROMPTS

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PAGE = 16 * 46080  # one page of the bundled model's float32 K and V, every layer
PROMPT = RAW_PROMPTS[-1]  # the long one: 7 full pages
OTHERS = [f"Story {i}: once upon a time, in a small village by the sea, " * 10 for i in range(6)]


def tier_engine(make_engine: Callable[..., LLMEngine]) -> LLMEngine:
    return make_engine(
        "tier", **INVARIANT, kv_cache_gb=40 * PAGE / 2**30, kv_offload_gb=200 * PAGE / 2**30
    )


def chain(engine: LLMEngine) -> list[BlockHash]:
    ids = engine.tokenizer.encode(PROMPT)
    return hash_pages(ids[: len(ids) - 1], engine.pool.page_size)


def pages_of(engine: LLMEngine, hashes: list[BlockHash]) -> list[tuple[torch.Tensor, ...]]:
    """K and V of every layer of the pool's page for each hash."""
    pages = [engine.pool.cached_page(h) for h in hashes]
    assert None not in pages
    return [(engine.cache.k[:, p].clone(), engine.cache.v[:, p].clone()) for p in pages]


def evict(engine: LLMEngine, hashes: list[BlockHash]) -> None:
    engine.generate(OTHERS, GREEDY)
    assert engine.pool.count_prefix(hashes[:1]) == 0, "the prefix is still in the pool"


def test_an_evicted_prefix_comes_back_byte_identical_with_the_same_tokens(
    make_engine: Callable[..., LLMEngine], twin: LLMEngine
) -> None:
    engine = tier_engine(make_engine)
    hashes = chain(engine)
    first = engine.generate([PROMPT], GREEDY)[0]
    computed = pages_of(engine, hashes)
    before = engine.counts.tier
    assert before is not None
    evict(engine, hashes)
    again = engine.generate([PROMPT], GREEDY)[0]
    after = engine.counts.tier
    assert after is not None
    assert again.token_ids == first.token_ids == twin.generate([PROMPT], GREEDY)[0].token_ids
    assert again.num_cached_tokens == len(hashes) * 16
    assert after.hits - before.hits == len(hashes) * 16
    assert after.restored_bytes - before.restored_bytes == len(hashes) * PAGE
    for (k0, v0), (k1, v1) in zip(computed, pages_of(engine, hashes), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert after.dropped == 0


def test_a_corrupted_entry_is_dropped_and_recomputed_with_the_same_tokens(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = tier_engine(make_engine)
    hashes = chain(engine)
    first = engine.generate([PROMPT], GREEDY)[0]
    evict(engine, hashes)
    tier = engine.tier
    assert tier is not None and engine.pool.tier is not None
    (second,) = engine.pool.tier.take(hashes[1:2])
    tier.slots[second.slot][1000] ^= 0xFF  # one bit pattern of one byte
    dropped = tier.counts.dropped
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == 16  # the first page came back; the rest recomputed
    assert tier.counts.dropped == dropped + 1
    assert hashes[1] in engine.pool.tier  # recomputed, and copied out again


def test_every_page_is_free_after_copies_and_aborts(make_engine: Callable[..., Any]) -> None:
    engine = tier_engine(make_engine)
    hashes = chain(engine)
    engine.generate([PROMPT], GREEDY)
    evict(engine, hashes)
    rid = engine.add_request(PROMPT, GREEDY)
    engine.step()  # admitted to restore its prefix; the copy may still run
    assert engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    assert engine.num_free_pages == engine.pool.num_pages


def test_an_idle_worker_gets_the_pages_its_copies_held_back(
    make_engine: Callable[..., LLMEngine],
) -> None:
    """A decode worker steps only while it has work: once its last request is done, the
    pages its copies to the tier held come back when it next reserves."""
    engine = tier_engine(make_engine)
    engine.add_request(PROMPT, SamplingParams(max_tokens=1))  # its pages copied after
    while engine.scheduler.has_work:  # as decode_worker's loop does
        engine.step()
    whole = list(range(100, 100 + engine.pool.num_pages * 16 - 8))  # every page but none spare
    wait_until(
        lambda: engine.reserve(whole, GREEDY, RequestId("all")) is not None,
        "a reservation of every page",
    )
    assert engine.abort_request(RequestId("all"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_tier_is_pinned_and_round_trips_on_its_own_stream(
    make_engine: Callable[..., LLMEngine],
) -> None:
    engine = make_engine(
        "tier-cuda",
        dtype="float32",
        device="cuda",
        kv_cache_gb=40 * PAGE / 2**30,
        kv_offload_gb=200 * PAGE / 2**30,
    )
    assert engine.tier is not None and engine.tier.slots.is_pinned()
    hashes = chain(engine)
    first = engine.generate([PROMPT], GREEDY)[0]
    computed = pages_of(engine, hashes)
    evict(engine, hashes)
    again = engine.generate([PROMPT], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == len(hashes) * 16
    for (k0, v0), (k1, v1) in zip(computed, pages_of(engine, hashes), strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
