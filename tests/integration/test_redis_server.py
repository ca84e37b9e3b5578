"""The embedded valkey-server: killed, it is restarted on its port by its supervisor."""

from __future__ import annotations

import asyncio
import os
import signal

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from splitserve.redis_server import EmbeddedRedis
from tests.helpers import until


def _pings(url: str) -> bool:
    try:
        return bool(Redis.from_url(url, socket_timeout=0.5).ping())
    except (RedisConnectionError, TimeoutError):
        return False


def test_a_killed_valkey_server_is_restarted_on_its_port_and_answers() -> None:
    async def go() -> None:
        with EmbeddedRedis() as server:
            url, first = server.url, server.pid
            assert first is not None and _pings(url)
            Redis.from_url(url).set("before", "1")
            supervisor = asyncio.create_task(server.supervise(every_s=0.05, misses=2))
            try:
                os.kill(first, signal.SIGKILL)
                restarted = lambda: server.pid not in (None, first)
                await until(lambda: asyncio.to_thread(restarted), "a new valkey-server", 30)
                await until(lambda: asyncio.to_thread(_pings, url), "PING on its port", 30)
                assert server.url == url and server.healthy()
                assert Redis.from_url(url).get("before") is None  # back empty, as documented
            finally:
                supervisor.cancel()
                await asyncio.gather(supervisor, return_exceptions=True)
        assert not _pings(url)

    asyncio.run(go())
