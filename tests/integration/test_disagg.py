"""Disaggregated prefill and decode on real Ray and real UCX (NIXL over loopback):
the same tokens as colocated serving, conditional disaggregation, and only the pages
the decode worker lacks cross the wire."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from cluster.types import FinishReason, SamplingParams
from router.dispatch import Dispatcher
from tests.integration.disagg import collect, run

GREEDY = SamplingParams(max_tokens=16)
SEEDED = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)


def long_prompt(text: list[int], n: int) -> list[int]:
    """n tokens: real text repeated."""
    return (text * (n // len(text) + 1))[:n]


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_single_requests_match_colocated(
    workers: Any, prompts: list[list[int]], sp: SamplingParams
) -> None:
    p, d, c = workers.trio()

    async def go() -> None:
        disp, remote = Dispatcher(), 0
        for ids in (prompts[0], prompts[7], prompts[8]):
            split = await collect(disp, ids, sp, d, p)
            alone = await collect(disp, ids, sp, c)
            assert split.finish is not None and split.finish is not FinishReason.ERROR
            assert (split.tokens, split.text, split.finish) == (
                alone.tokens,
                alone.text,
                alone.finish,
            )
            # The prefill worker's own time fits between the reservation and the first token.
            done = split.progress
            assert done.admitted_at is not None and done.first_token_at is not None
            if done.remote_prefill:
                remote += 1
                assert done.prefill_s is not None
                assert 0 < done.prefill_s < done.first_token_at - done.admitted_at
            assert alone.progress.prefill_s is None and not alone.progress.remote_prefill
        assert remote, "a prefill worker computed at least one prompt"

    run(go())


def test_a_mixed_batch_of_short_and_long_prompts_matches_colocated(
    workers: Any, prompts: list[list[int]]
) -> None:
    p, d, c = workers.trio()
    batch = [
        prompts[1],
        long_prompt(prompts[7], 600),
        prompts[4],
        prompts[9],
        long_prompt(prompts[3] + prompts[2], 400),
    ]
    params = [GREEDY, SEEDED, SEEDED, GREEDY, GREEDY]
    before = ray.get(p.stats.remote()).sent

    async def go() -> None:
        disp = Dispatcher()
        split = await asyncio.gather(
            *(collect(disp, i, s, d, p) for i, s in zip(batch, params, strict=True))
        )
        alone = await asyncio.gather(
            *(collect(disp, i, s, c) for i, s in zip(batch, params, strict=True))
        )
        for a, b in zip(split, alone, strict=True):
            assert (a.tokens, a.finish) == (b.tokens, b.finish)

    run(go())
    after = ray.get(p.stats.remote()).sent
    assert after.writes > before.writes + len(batch)  # streamed: several WRITEs per request


def test_a_short_uncached_remainder_is_prefilled_on_the_decode_worker(
    workers: Any, prompts: list[list[int]]
) -> None:
    p = workers.prefill("prefill")
    d = workers.decode("decode-conditional", local_prefill_tokens=32)
    c = workers.decode("colocated")
    first = long_prompt(prompts[7], 300)
    second = first + prompts[0]  # the next turn: 300 cached tokens plus a few new ones

    async def go() -> None:
        disp = Dispatcher()
        assert (await collect(disp, first, GREEDY, d, p)).tokens == (
            await collect(disp, first, GREEDY, c)
        ).tokens
        sent = ray.get(p.stats.remote()).sent.pages
        received = ray.get(d.stats.remote()).pages_received
        split = await collect(disp, second, GREEDY, d, p)
        assert ray.get(p.stats.remote()).sent.pages == sent  # nothing moved
        assert ray.get(d.stats.remote()).pages_received == received
        assert split.tokens == (await collect(disp, second, GREEDY, c)).tokens

    run(go())


def test_only_pages_missing_on_the_decode_side_are_sent(
    workers: Any, prompts: list[list[int]]
) -> None:
    p, d, c = workers.trio()
    shared = long_prompt(prompts[2] + prompts[7], 256)  # 16 full pages
    first = shared + prompts[3]
    second = shared + prompts[5] + prompts[6]

    async def go() -> None:
        disp = Dispatcher()
        await collect(disp, first, GREEDY, d, p)
        sent = ray.get(p.stats.remote()).sent.pages
        received = ray.get(d.stats.remote()).pages_received
        split = await collect(disp, second, GREEDY, d, p)
        pages = -(-len(second) // 16) - 16
        assert ray.get(p.stats.remote()).sent.pages - sent == pages
        assert ray.get(d.stats.remote()).pages_received - received == pages
        assert split.tokens == (await collect(disp, second, GREEDY, c)).tokens

    run(go())


def test_without_layer_streaming_one_write_per_request_gives_the_same_tokens(
    workers: Any, prompts: list[list[int]]
) -> None:
    p = workers.prefill("prefill-unstreamed", stream_layers=False)
    d = workers.decode("decode", local_prefill_tokens=0)
    c = workers.decode("colocated")
    ids = long_prompt(prompts[1] + prompts[7], 500)  # two prefill chunks

    async def go() -> None:
        disp = Dispatcher()
        before = ray.get(p.stats.remote()).sent.writes
        split = await collect(disp, ids, SEEDED, d, p)
        assert ray.get(p.stats.remote()).sent.writes == before + 1
        assert split.tokens == (await collect(disp, ids, SEEDED, c)).tokens

    run(go())
