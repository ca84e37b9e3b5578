"""Multi-turn conversations in disaggregated mode, on real Ray workers and a real router.

A conversation's decode worker holds its history, replies included; its prefill worker
only ever computed the prompts. Under cache_aware the router sends a later turn to a
prefill worker only if that worker holds as much of the prompt as the decode worker, so
the decode worker prefills the new message itself and no prefill worker recomputes a
reply: PrefillStats.recomputed_tokens stays 0. Under least_loaded (which ignores caches)
the same turns go to the prefill worker, which recomputes the replies, and the counter
says how many tokens. No session ids: the prefix index, fed by KV events, places turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from cluster.engine.model.tokenizer import Tokenizer
from cluster.types import SamplingParams
from router.dispatch import Dispatcher
from splitserve.client import Client, Reply
from tests.helpers import wait_until
from tests.integration.router_harness import RouterHarness

PAGE = 16
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def pool(ray_workers: Any) -> dict[str, Any]:
    return {
        "prefill": {"mt-prefill": ray_workers.prefill("mt-prefill")},
        # The decode worker's own threshold is off: the router alone decides local prefill.
        "decode": {"mt-decode": ray_workers.decode("mt-decode", local_prefill_tokens=0)},
    }


@pytest.fixture
def router(request: pytest.FixtureRequest, pool: dict[str, Any]) -> Iterator[RouterHarness]:
    harness = RouterHarness(pool["prefill"], pool["decode"], None, policy=request.param)
    yield harness
    harness.stop()


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def messages(tok: Tokenizer, tag: str) -> list[list[int]]:
    """Three user messages, each long enough to prefill remotely (> local_prefill_tokens)."""
    facts = [
        " ".join(f"Turn {t} of {tag}: fact {i} about the sea?" for i in range(8)) for t in range(3)
    ]
    return [tok.encode(text) for text in facts]


def held(router: RouterHarness, prompt: list[int], worker: str) -> int:
    """The leading prompt tokens the router's prefix index says `worker` holds."""

    async def read() -> int:
        groups = router.app.workers.cached_tokens(prompt)
        return next((t for t, ws in groups.items() if worker in ws), 0)

    return router.call(read())


def recomputed(pool: dict[str, Any]) -> int:
    return int(ray.get(pool["prefill"]["mt-prefill"].stats.remote()).recomputed_tokens)


def ask(router: RouterHarness, prompt: list[int]) -> Reply:
    async def run() -> Reply:
        async with Client(router.address) as client:
            return await client.generate(
                prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout_s=120
            )

    return asyncio.run(run())


def converse(router: RouterHarness, tok: Tokenizer, tag: str) -> list[tuple[list[int], Reply]]:
    """Three turns, each prompt the history so far plus the next message; before each
    later turn, waits until the index knows the decode worker holds more of it than the
    prefill worker (the decode worker's KV events lag its reply by up to a stats interval)."""
    turns: list[tuple[list[int], Reply]] = []
    history: list[int] = []
    for message in messages(tok, tag):
        prompt = history + message
        if turns:

            def learnt(p: list[int] = prompt) -> bool:
                return held(router, p, "mt-decode") > held(router, p, "mt-prefill")

            wait_until(learnt, "the index to learn the decode worker holds the last reply")
        reply = ask(router, prompt)
        turns.append((prompt, reply))
        history = prompt + reply.token_ids
    return turns


def colocated(worker: Any, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy reply from a worker that prefills itself."""

    async def run() -> list[list[int]]:
        disp = Dispatcher()
        outs = []
        for prompt in prompts:
            ids: list[int] = []
            async for d in disp.generate(prompt, GREEDY, worker):
                ids.extend(d.token_ids)
            outs.append(ids)
        await disp.close()
        return outs

    return asyncio.run(run())


@pytest.mark.parametrize("router", ["cache_aware"], indirect=True)
def test_later_turns_prefill_on_the_decode_worker_and_recompute_nothing(
    ray_workers: Any, pool: dict[str, Any], router: RouterHarness, tok: Tokenizer
) -> None:
    before = recomputed(pool)
    turns = converse(router, tok, "ca")
    first = turns[0][1]
    assert (first.decode_worker, first.prefill_worker) == ("mt-decode", "mt-prefill")
    for (prompt, reply), message in zip(turns[1:], messages(tok, "ca")[1:], strict=True):
        assert (reply.decode_worker, reply.prefill_worker) == ("mt-decode", "")
        # All the history's full pages but the last reply token's (it has no KV yet).
        history = len(prompt) - len(message)
        assert reply.usage.cached_prompt_tokens == (history - 1) // PAGE * PAGE
    assert recomputed(pool) == before
    reference = colocated(ray_workers.decode("colocated"), [p for p, _ in turns])
    assert [r.token_ids for _, r in turns] == reference
    assert all(len(ids) == MAX_TOKENS for ids in reference)


async def costs_measured(router: RouterHarness) -> bool:
    """The router's loads carry each worker's measured costs (what prefill_by_cost weighs):
    seconds per token of its steps, and of a prefill worker's pushes. A fitted slope of 0.0
    is measured (StepRate floors a noisy negative one there): only None is not."""
    snapshot = router.app.workers.snapshot()
    decode = all(d.s_per_token is not None for d in snapshot.decode)
    return decode and all(
        p.s_per_token is not None and p.transfer_s_per_token is not None for p in snapshot.prefill
    )


@pytest.mark.parametrize("router", ["least_loaded"], indirect=True)
def test_without_the_rule_the_prefill_worker_recomputes_the_replies(
    pool: dict[str, Any], router: RouterHarness, tok: Tokenizer
) -> None:
    """The counter's control: least_loaded ignores caches, so every turn prefills remotely
    and the prefill worker computes each reply the decode worker holds."""
    before = recomputed(pool)
    turns = converse(router, tok, "ll")
    assert all(r.prefill_worker == "mt-prefill" for _, r in turns)
    # Each later turn recomputes at least the previous reply's full pages.
    least = sum((MAX_TOKENS - 1) // PAGE * PAGE for _ in turns[1:])
    assert recomputed(pool) - before >= least
    wait_until(lambda: router.call(costs_measured(router)), "the workers' costs in the loads")
