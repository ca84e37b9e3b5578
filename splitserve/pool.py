"""One phase's pool of worker actors, resized while serving.

- `start`: the first `replicas` workers, spawned at once, each awaited until ready.
- `grow`: one more worker. Ray places it on a node with the phase's resources (on a Ray
  cluster its autoscaler adds such a node if none has room); once it answers, the router
  routes to it.
- `drain`: the router stops routing to a worker; once neither the router nor the worker
  has a request in flight, the worker is killed. Past `drain_timeout_s` a decode worker
  evicts its requests (their routers continue each on another decode worker, as after a
  worker's death) and a prefill worker aborts its own (their decode workers recompute
  them), so a drain always ends.
- `reap`: a worker the router found dead (a call to it failed: Ray reports the actor's
  death) leaves the pool; the scaler then restores the pool's minimum.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from ray.exceptions import RayActorError

from cluster import role_worker
from cluster.config import EngineConfig, PoolConfig, TransferConfig
from cluster.protocol import DecodeHandle, PrefillHandle
from cluster.types import ModelInfo
from decode_worker.worker import spawn as spawn_decode
from prefill_worker.worker import spawn as spawn_prefill
from router.workers import WorkerRegistry
from splitserve.load_bars import BARS

log = logging.getLogger(__name__)

Phase = Literal["prefill", "decode"]
ABORT_WAIT_S = 10.0  # after aborting a drained worker's requests, how long they may take to end
H = TypeVar("H", DecodeHandle, PrefillHandle)


@dataclass(frozen=True)
class Role(Generic[H]):
    """What a pool does differently for each phase's workers."""

    phase: Phase
    spawn: Callable[[str, EngineConfig, TransferConfig, float, float | None, dict[str, float]], H]
    add: Callable[[WorkerRegistry, str, H], Awaitable[None]]  # the router routes to it
    move_off: Callable[[H, str], Awaitable[int]]  # past the drain deadline (why): how many


DECODE = Role[DecodeHandle](
    "decode", spawn_decode, WorkerRegistry.add_decode, lambda h, why: h.evict_all.remote(why)
)
PREFILL = Role[PrefillHandle](
    "prefill", spawn_prefill, WorkerRegistry.add_prefill, lambda h, why: h.abort_all.remote()
)


class WorkerPool(Generic[H]):
    def __init__(
        self, role: Role[H], config: PoolConfig, transfer: TransferConfig, prefix: str = ""
    ) -> None:
        """Workers are named `{prefix}{phase}-{n}`, n counting up from 0, never reused."""
        self.role: Role[H] = role
        self.phase = role.phase
        self.config = config
        self.transfer = transfer
        self.prefix = prefix
        self.workers: dict[str, H] = {}  # ready and known to the router
        self.draining: set[str] = set()
        self._next = 0

    @property
    def serving(self) -> list[str]:
        """Workers the router may route to: the pool's size as the scaler sees it."""
        return [w for w in self.workers if w not in self.draining]

    async def start(self) -> dict[str, H]:
        """The first `replicas` workers, ready; hand them to the router."""
        started = [self._spawn() for _ in range(self.config.replicas)]
        await asyncio.gather(*(self._ready(name, handle) for name, handle in started))
        self.workers.update(started)
        return dict(started)

    async def grow(self, registry: WorkerRegistry) -> str:
        """Start one more worker and route to it once it is ready; its name."""
        name, handle = self._spawn()
        await self._ready(name, handle)
        await self.role.add(registry, name, handle)
        self.workers[name] = handle
        return name

    async def drain(self, registry: WorkerRegistry, name: str) -> None:
        """Stop routing to `name`, let its requests finish (or move them off it past the
        drain deadline), then kill it."""
        handle = self.workers[name]
        self.draining.add(name)
        registry.cordon(name)
        timeout_s = self.config.scaling.drain_timeout_s
        try:
            if not await self._idle(registry, name, handle, timeout_s):
                why = (
                    f"worker {name} was drained (the pool scaled down) and the request was "
                    f"still running after drain_timeout_s={timeout_s:g}"
                )
                moved = await self.role.move_off(handle, why)
                log.warning("%s: drain deadline passed; moved %d requests off it", name, moved)
                await self._idle(registry, name, handle, ABORT_WAIT_S)
        except RayActorError as e:
            log.warning("%s died while draining: %s", name, e)
        finally:
            registry.remove(name)
            self._kill(name, handle)
            del self.workers[name]
            self.draining.discard(name)
        log.info("%s: drained and stopped", name)

    def reap(self, registry: WorkerRegistry) -> list[str]:
        """Drop the workers the router found dead; their names."""
        live = set(registry.names(self.phase))
        dead = [w for w in self.workers if w not in live and w not in self.draining]
        for name in dead:
            self._kill(name, self.workers.pop(name))  # it may only look dead (a failed call)
        return dead

    def stop(self) -> None:
        for name, handle in self.workers.items():
            self._kill(name, handle)
        self.workers.clear()

    def _spawn(self) -> tuple[str, H]:
        name = f"{self.prefix}{self.phase}-{self._next}"
        self._next += 1
        c = self.config
        log.info("%s: starting, loading %s", name, c.engine.model or "the bundled model")
        return name, self.role.spawn(
            name, c.engine, self.transfer, c.num_cpus, c.num_gpus, c.resources
        )

    async def _ready(self, name: str, handle: H) -> None:
        timeout_s = self.config.scaling.start_timeout_s
        started = time.monotonic()
        try:
            info = await asyncio.wait_for(self._loading(name, handle), timeout_s)
        except BaseException as e:
            self._kill(name, handle)
            if isinstance(e, TimeoutError):
                raise TimeoutError(
                    f"{name}: not ready within start_timeout_s={timeout_s:g} (does any node "
                    f"have {self.config.resources or 'the CPUs/GPUs it asks for'}?)"
                ) from None
            raise
        finally:
            BARS.finish(name)
            role_worker.forget_load(name)
        stats = await handle.stats.remote()
        tokens = stats.num_pages * info.page_size
        log.info(
            "%s: ready in %.1fs (%s, max_model_len %d): KV cache %d pages, %d tokens, "
            "%d sequences of the max length",
            name,
            time.monotonic() - started,
            info.name,
            info.max_model_len,
            stats.num_pages,
            tokens,
            tokens // info.max_model_len,
        )

    async def _loading(self, name: str, handle: H) -> ModelInfo:
        """The worker's model info, once it has built its engine; meanwhile its weights'
        loading goes to the terminal's bars, four times a second."""
        info = asyncio.ensure_future(handle.info.remote())
        try:
            while not (await asyncio.wait([info], timeout=0.25))[0]:
                if not BARS.on:  # no terminal: nothing to draw
                    continue
                # A call to Ray's GCS: off the loop that serves requests.
                if (read := await asyncio.to_thread(role_worker.loaded, name)) is not None:
                    BARS.update(name, *read)
        finally:
            info.cancel()  # a timeout's: the worker is killed next
        return info.result()

    async def _idle(self, registry: WorkerRegistry, name: str, handle: H, timeout_s: float) -> bool:
        """Wait until nothing is in flight on the worker; False if timeout_s passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await handle.stats.remote()
            if stats.in_flight == 0 and registry.in_flight(name) == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)

    def _kill(self, name: str, handle: H) -> None:
        role_worker.kill(name, handle, self.config.engine.tensor_parallel_size)


AnyPool = WorkerPool[DecodeHandle] | WorkerPool[PrefillHandle]
