"""A real router (gRPC on loopback) in a background event loop, over real Ray workers;
or a whole cluster (pools, router, scalers) the same way."""

from __future__ import annotations

import asyncio
import re
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

import ray
from aiohttp import web

from cluster.config import RouterConfig, ServeConfig
from router.app import RouterApp, start_router
from splitserve.client import Client, Reply
from splitserve.launch import Cluster, start_cluster

T = TypeVar("T")


class _LoopThread:
    """An asyncio loop on its own thread: the router's objects live there."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 120) -> T:
        """Run a coroutine on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def _close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class RouterHarness(_LoopThread):
    def __init__(
        self,
        prefill: dict[str, Any],
        decode: dict[str, Any],
        redis_url: str | None,
        local_prefill_tokens: int = 32,
        routes: Sequence[web.RouteDef] = (),
        model: str | None = None,  # the workers' checkpoint (None: the bundled model)
        **router: Any,
    ) -> None:
        super().__init__()
        defaults = {"port": 0, "redis_timeout_s": 0.1, "metrics_port": None, "http_port": None}
        config = RouterConfig(**{**defaults, **router})
        self.app: RouterApp = self.call(
            start_router(
                config, local_prefill_tokens, prefill, decode, redis_url, model, routes=routes
            )
        )

    @property
    def address(self) -> str:
        return self.app.address

    def stop(self) -> None:
        self.call(self.app.stop(1.0))
        self._close()


class ClusterHarness(_LoopThread):
    """`start_cluster` on the Ray this process joined; worker names start with `prefix`."""

    def __init__(self, config: ServeConfig, prefix: str, redis_url: str | None = None) -> None:
        super().__init__()
        self.cluster: Cluster = self.call(start_cluster(config, redis_url, prefix), 300)

    @property
    def address(self) -> str:
        return self.cluster.app.address

    def read(self, fn: Callable[[], T]) -> T:
        """fn() on the cluster's loop (its objects change there)."""

        async def run() -> T:
            return fn()

        return self.call(run())

    def assert_all_pages_free(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            pools = self.read(
                lambda: [h for p in self.cluster.pools.values() for h in p.workers.values()]
            )
            stats = ray.get([h.stats.remote() for h in pools])
            busy = [s for s in stats if s.free_pages != s.num_pages]
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not busy, f"pages still held: {busy}"

    def stop(self) -> None:
        self.call(self.cluster.stop(1.0))
        self._close()


def ask(address: str, prompt: Any, timeout_s: float = 120, **fields: Any) -> Reply:
    """One whole reply over gRPC, from this thread."""

    async def run() -> Reply:
        async with Client(address) as client:
            return await client.generate(prompt, timeout_s=timeout_s, **fields)

    return asyncio.run(run())


def serving(server: subprocess.Popen[str], log: list[str], timeout_s: float = 300) -> str:
    """The gRPC address a `splitserve serve` child says it serves on; its stderr lines go
    to `log`, up to that line here and from then on in a thread."""
    assert server.stderr is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        assert line, "splitserve serve exited early:\n" + "".join(log)
        log.append(line)
        if m := re.search(r"serving on (\S+);", line):
            threading.Thread(target=lambda: log.extend(server.stderr or ()), daemon=True).start()
            return m.group(1)
    raise AssertionError("splitserve serve is not serving yet:\n" + "".join(log))
