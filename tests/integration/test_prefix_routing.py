"""Routing by the global prefix index, on real Ray workers and a real router over gRPC.

A prefix is computed on the second decode worker directly (not through the router), so
the router can only learn where it lives from the workers' KV events; least-loaded
routing would send the burst to the first worker, idle as it is. Requests carry no
session id: the prefix index alone places them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import SamplingParams
from router.dispatch import Dispatcher
from splitserve.client import Client, Reply
from tests.helpers import wait_until
from tests.integration.router_harness import RouterHarness

PAGE = 16
PREFIX_PAGES = 30  # a 480-token system prompt
BURST = 6  # at seq_cost_tokens 64, the holder stays cheapest for 7 requests in flight


@pytest.fixture(scope="module")
def pool(ray_workers: Any) -> dict[str, Any]:
    return {
        "prefill": {"kvp-prefill": ray_workers.prefill("kvp-prefill")},
        "decode": {"kvp-a": ray_workers.decode("kvp-a"), "kvp-b": ray_workers.decode("kvp-b")},
    }


@pytest.fixture
def router(pool: dict[str, Any]) -> Iterator[RouterHarness]:
    harness = RouterHarness(pool["prefill"], pool["decode"], None)
    yield harness
    harness.stop()


def system_prompt(tok: Tokenizer, tag: str) -> list[int]:
    text = " ".join(f"Rule {i} of the {tag} assistant: answer briefly." for i in range(200))
    ids = tok.encode(text)[: PREFIX_PAGES * PAGE]
    assert len(ids) == PREFIX_PAGES * PAGE
    return ids


def questions(tok: Tokenizer, prefix: list[int], n: int, tag: str) -> list[list[int]]:
    return [prefix + tok.encode(f" Question {tag}{i}: what is {i} squared?") for i in range(n)]


def warm(worker: Any, prompt: list[int]) -> None:
    """Run the prompt on the worker directly: its prefix cache then holds the prompt."""

    async def run() -> None:
        disp = Dispatcher()
        async for _ in disp.generate(prompt, SamplingParams(max_tokens=2), worker):
            pass
        await disp.close()

    asyncio.run(run())


def index_answer(router: RouterHarness, prompt: list[int]) -> dict[int, frozenset[str]]:
    """The router's prefix index on the prompt: tokens held -> the workers holding them."""

    async def read() -> dict[int, frozenset[str]]:
        return router.app.workers.cached_tokens(prompt)

    return router.call(read())


def burst(router: RouterHarness, prompts: list[list[int]]) -> list[Reply]:
    """The prompts at once, without session ids."""

    async def run() -> list[Reply]:
        async with Client(router.address) as client:
            calls = [client.generate(p, max_tokens=4, timeout_s=120) for p in prompts]
            return list(await asyncio.gather(*calls))

    return asyncio.run(run())


def assert_served_from_the_prefix(replies: list[Reply], worker: str) -> None:
    """Each request ran on `worker`, prefilled there (its uncached part is short), and
    reused the whole prefix."""
    for reply in replies:
        assert (reply.decode_worker, reply.prefill_worker) == (worker, "")
        assert reply.usage.cached_prompt_tokens == PREFIX_PAGES * PAGE


def test_a_shared_prefix_burst_lands_on_the_worker_that_holds_it(
    workers: Any, pool: dict[str, Any], router: RouterHarness, tok: Tokenizer
) -> None:
    prefix = system_prompt(tok, "burst")
    first, *burst_prompts = questions(tok, prefix, BURST + 1, "b")
    warm(pool["decode"]["kvp-b"], first)
    held = PREFIX_PAGES * PAGE
    wait_until(
        lambda: index_answer(router, burst_prompts[0]) == {held: frozenset({"kvp-b"})},
        "the router's index to learn that kvp-b holds the prefix",
    )
    assert_served_from_the_prefix(burst(router, burst_prompts), "kvp-b")
    # A prompt nobody holds goes by load: to the first of the two idle workers.
    (other,) = burst(router, questions(tok, system_prompt(tok, "fresh"), 1, "f"))
    assert other.decode_worker == "kvp-a" and other.usage.cached_prompt_tokens == 0


def test_a_restarted_router_resyncs_from_the_snapshot_and_routes_the_same_way(
    workers: Any, pool: dict[str, Any], tok: Tokenizer
) -> None:
    prefix = system_prompt(tok, "restart")
    first, *prompts = questions(tok, prefix, 2 * BURST + 1, "r")
    warm(pool["decode"]["kvp-b"], first)
    held = {PREFIX_PAGES * PAGE: frozenset({"kvp-b"})}
    old = RouterHarness(pool["prefill"], pool["decode"], None)
    try:
        wait_until(lambda: index_answer(old, prompts[0]) == held, "the first router's index")
        assert_served_from_the_prefix(burst(old, prompts[:BURST]), "kvp-b")
        # A second router starts while the first serves: its first read of each worker is
        # a snapshot of its cache, and from then on the two agree on every prompt.
        new = RouterHarness(pool["prefill"], pool["decode"], None)
    finally:
        old.stop()
    try:
        assert index_answer(new, prompts[0]) == held  # before any poll of its own
        assert_served_from_the_prefix(burst(new, prompts[BURST:]), "kvp-b")
    finally:
        new.stop()


def test_routers_reading_the_same_workers_agree(
    workers: Any, pool: dict[str, Any], router: RouterHarness, tok: Tokenizer
) -> None:
    prefixes = [system_prompt(tok, tag) for tag in ("agree-1", "agree-2")]
    prompts = [q for i, p in enumerate(prefixes) for q in questions(tok, p, 3, f"a{i}")]
    warm(pool["decode"]["kvp-a"], prompts[0])
    other = RouterHarness(pool["prefill"], pool["decode"], None)
    try:
        burst(router, prompts)  # placed by `router`; `other` only reads the events

        def agree() -> bool:
            answers = [index_answer(r, p) for r in (router, other) for p in prompts]
            return all(answers) and answers[: len(prompts)] == answers[len(prompts) :]

        wait_until(agree, "both routers' indexes to hold every prompt's prefix, alike")
    finally:
        other.stop()
