"""A real router (gRPC on loopback) in a background event loop, over real Ray workers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from cluster.config import RouterConfig
from router.app import RouterApp, start_router
from splitserve.client import Client, Reply

T = TypeVar("T")


class RouterHarness:
    def __init__(
        self,
        prefill: dict[str, Any],
        decode: dict[str, Any],
        redis_url: str | None,
        local_prefill_tokens: int = 32,
        **router: Any,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = RouterConfig(**{"port": 0, "redis_timeout_s": 0.1, "metrics_port": None, **router})
        self.app: RouterApp = self.call(
            start_router(config, local_prefill_tokens, prefill, decode, redis_url)
        )

    @property
    def address(self) -> str:
        return self.app.address

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        """Run a coroutine on the router's loop (its objects live there)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.call(self.app.stop(1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def ask(address: str, prompt: Any, timeout_s: float = 120, **fields: Any) -> Reply:
    """One whole reply over gRPC, from this thread."""

    async def run() -> Reply:
        async with Client(address) as client:
            return await client.generate(prompt, timeout_s=timeout_s, **fields)

    return asyncio.run(run())
