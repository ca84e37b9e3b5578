"""The health service follows the decode pool: NOT_SERVING once no decode worker is alive."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc
import pytest
import ray

from splitserve.client import Client
from tests.helpers import wait_until
from tests.integration.router_harness import RouterHarness, ask


async def _health(address: str) -> str:
    async with Client(address) as client:
        return await client.health("splitserve.v1.Generation")


def test_health_is_not_serving_when_the_decode_worker_dies(ray_workers: Any) -> None:
    handle = ray_workers.decode("doomed")
    # Its streams wait this long for another decode worker to move to, then end.
    router = RouterHarness({}, {"doomed": handle}, redis_url=None, migration_wait_s=1.0)
    try:
        assert asyncio.run(_health(router.address)) == "SERVING"
        assert ask(router.address, "Ice is", max_tokens=3).decode_worker == "doomed"
        errors: list[grpc.aio.AioRpcError] = []

        def stream_until_killed() -> None:
            try:
                ask(router.address, "Tell me a long story.", max_tokens=400, ignore_eos=True)
            except grpc.aio.AioRpcError as e:
                errors.append(e)

        streaming = threading.Thread(target=stream_until_killed)
        streaming.start()
        running = lambda: ray.get(handle.stats.remote()).running >= 1
        wait_until(running, "the long request to be decoding", 30)
        ray.kill(ray_workers.handles.pop("doomed"))
        streaming.join(30)
        assert not streaming.is_alive(), "a stream whose worker died must end, not hang"
        assert errors and errors[0].code() == grpc.StatusCode.UNAVAILABLE, errors
        assert "migration_wait_s=1" in (errors[0].details() or "")
        not_serving = lambda: asyncio.run(_health(router.address)) == "NOT_SERVING"
        wait_until(not_serving, "health to be NOT_SERVING with no decode worker", 5)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            ask(router.address, "Ice is", max_tokens=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.stop()
