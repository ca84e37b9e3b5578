"""Session placements in a real Redis (valkey-server): shared between routers, newest wins,
expire with their TTL, and a Redis that is down or hung costs a miss, never an error."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import pytest
import redis

from router.placement import Placement, PlacementStore
from splitserve.redis_server import EmbeddedRedis
from tests.helpers import until

PREFIX = "splitserve:session:"
PLACEMENT = Placement("decode-0", "epoch-1", "prefill-0", 512, 1_700_000_000.25)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with EmbeddedRedis() as server:
        yield server.url


@asynccontextmanager
async def opened(url: str, **kwargs: Any) -> AsyncIterator[PlacementStore]:
    """A store with a timeout that a loaded CI host does not reach (the router's 50 ms did:
    a put timed out, the store rested, and the newest placement of a race was never sent);
    the tests of a hung Redis pass their own."""
    store = PlacementStore(url, **{"timeout_s": 5.0, **kwargs})
    try:
        yield store
    finally:
        await store.close()


def server_pid(url: str) -> int:
    with redis.Redis.from_url(url) as client:
        return int(client.info("server")["process_id"])


def test_embedded_redis_answers_ping_stops_without_a_trace_and_restarts_on_its_port() -> None:
    with EmbeddedRedis() as server:
        url = server.url
        pid = server_pid(url)
        server.stop()
        server.stop()  # idempotent
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(redis.ConnectionError), redis.Redis.from_url(url) as client:
            client.ping()

        assert server.start() == url
        with redis.Redis.from_url(url) as client:
            assert client.ping()
        assert server_pid(url) != pid


def test_embedded_redis_on_a_taken_port_fails_clearly(redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match="cannot start valkey-server"):
        EmbeddedRedis(port=port).start()


def test_put_then_get_round_trips(redis_url: str) -> None:
    async def go() -> None:
        async with opened(redis_url) as store:
            assert await store.get("never-seen") is None
            assert await store.put("round-trip", PLACEMENT)
            assert await store.get("round-trip") == PLACEMENT
            # A later turn prefilled locally: the old prefill worker must not linger.
            local = replace(PLACEMENT, prefill_worker=None, last_use=PLACEMENT.last_use + 1)
            assert await store.put("round-trip", local)
            assert await store.get("round-trip") == local
            assert store.failures == 0 and store.available

    asyncio.run(go())


def test_placement_expires_after_its_ttl(redis_url: str) -> None:
    async def go() -> None:
        async with opened(redis_url, ttl_s=0.2) as store:
            assert await store.put("short-lived", PLACEMENT)
            with redis.Redis.from_url(redis_url) as client:
                assert 0 < client.pttl(PREFIX + "short-lived") <= 200
            assert await store.get("short-lived") == PLACEMENT

            async def expired() -> bool:
                return await store.get("short-lived") is None

            await until(expired, "Redis to expire the placement", 5)

    asyncio.run(go())


def test_two_routers_see_each_others_placements(redis_url: str) -> None:
    async def go() -> None:
        async with opened(redis_url) as a, opened(redis_url) as b:
            assert await a.put("shared", PLACEMENT)
            assert await b.get("shared") == PLACEMENT
            moved = replace(PLACEMENT, decode_worker="decode-1", last_use=PLACEMENT.last_use + 5)
            assert await b.put("shared", moved)
            assert await a.get("shared") == moved

    asyncio.run(go())


def test_newest_last_use_wins(redis_url: str) -> None:
    newer = replace(PLACEMENT, decode_worker="decode-new", last_use=200.0)
    older = replace(PLACEMENT, decode_worker="decode-old", last_use=100.0)

    async def go() -> None:
        async with opened(redis_url) as a, opened(redis_url) as b:
            assert await a.put("race", newer)
            assert not await b.put("race", older)
            assert await a.get("race") == newer
            same_time = replace(newer, cached_tokens=newer.cached_tokens + 64)
            assert await b.put("race", same_time)
            assert await a.get("race") == same_time

            # Two routers racing many turns: the newest one stays, whatever the order.
            turns = [replace(PLACEMENT, cached_tokens=i, last_use=1000.0 + i) for i in range(40)]
            random.Random(0).shuffle(turns)
            await asyncio.gather(*((a if i % 2 else b).put("many", p) for i, p in enumerate(turns)))
            assert a.failures == b.failures == 0  # every put reached Redis
            assert await a.get("many") == max(turns, key=lambda p: p.last_use)

    asyncio.run(go())


def test_malformed_value_is_a_miss_and_is_overwritten(redis_url: str) -> None:
    with redis.Redis.from_url(redis_url) as client:
        client.set(PREFIX + "text", "not a placement")
        client.rpush(PREFIX + "list", "x")
        client.hset(PREFIX + "bad-hash", mapping=PLACEMENT.to_fields() | {"cached_tokens": "lots"})
        client.hset(PREFIX + "foreign-hash", mapping={"last_use": "9e99", "owner": "someone"})

    async def go() -> None:
        async with opened(redis_url) as store:
            for session in ["text", "list", "bad-hash", "foreign-hash"]:
                assert await store.get(session) is None
            for session in ["text", "list", "bad-hash"]:
                assert await store.put(session, PLACEMENT)
                assert await store.get(session) == PLACEMENT
            assert store.failures == 0 and store.available

    asyncio.run(go())


def test_redis_down_fails_open_with_one_warning_then_recovers_on_restart(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="router.placement")
    retry_s = 1.0
    now = [0.0]  # the store's clock: retry_s passes when the test says so

    async def go(server: EmbeddedRedis) -> None:
        async with opened(server.url, retry_s=retry_s, clock=lambda: now[0]) as store:
            assert await store.put("outage", PLACEMENT)  # leaves a pooled connection behind
            server.stop()
            for _ in range(3):
                assert await store.get("outage") is None
                assert not await store.put("outage", PLACEMENT)
            # Only the first call reached for Redis (one failure counted, one warning); the
            # rest answered at once, waiting out retry_s.
            assert store.failures == 1 and not store.available

            url = server.url
            assert server.start() == url  # the same port
            now[0] = retry_s / 2
            assert await store.get("outage") is None and not store.available  # still resting
            now[0] = retry_s
            assert await store.get("outage") is None  # no persistence: the restart lost it
            assert store.available
            assert await store.put("outage", PLACEMENT)
            assert await store.get("outage") == PLACEMENT
            assert store.failures == 1

    with EmbeddedRedis() as server:
        asyncio.run(go(server))
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unreachable" in warnings[0].getMessage()
    assert "routing without session affinity" in warnings[0].getMessage()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"Redis at {server.url} reachable again; routing with session affinity"
    ]


def test_a_hung_redis_costs_one_timeout() -> None:
    # Accepts connections (the kernel completes the handshake) but never answers.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}"

        async def go() -> None:
            async with opened(url, timeout_s=0.05) as store:
                # The store's own timeout ends the call: the outer one only guards a hang.
                assert await asyncio.wait_for(store.get("hung"), 60) is None
                assert store.failures == 1 and not store.available
                assert await store.get("hung") is None and store.failures == 1  # resting

        asyncio.run(go())
