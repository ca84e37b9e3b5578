"""The embedded valkey-server: killed, it is restarted on its port by its supervisor."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from cluster.redis_server import EmbeddedRedis


def _pings(url: str) -> bool:
    try:
        return bool(Redis.from_url(url, socket_timeout=0.5).ping())
    except (RedisConnectionError, TimeoutError):
        return False


async def _until(probe: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(probe):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_a_killed_valkey_server_is_restarted_on_its_port_and_answers() -> None:
    async def go() -> None:
        with EmbeddedRedis() as server:
            url, first = server.url, server.pid
            assert first is not None and _pings(url)
            Redis.from_url(url).set("before", "1")
            supervisor = asyncio.create_task(server.supervise(every_s=0.05, misses=2))
            try:
                os.kill(first, signal.SIGKILL)
                await _until(lambda: server.pid not in (None, first), "a new valkey-server")
                await _until(lambda: _pings(url), "PING on the same port")
                assert server.url == url and server.healthy()
                assert Redis.from_url(url).get("before") is None  # back empty, as documented
            finally:
                supervisor.cancel()
                await asyncio.gather(supervisor, return_exceptions=True)
        assert not _pings(url)

    asyncio.run(go())
