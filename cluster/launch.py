"""`splitserve serve`: Redis, Ray, a prefill and a decode pool, and the gRPC router.

Start order: Redis (embedded valkey-server unless redis_url is set), a local Ray, the
workers (all spawned at once, then awaited), the router. SIGINT or SIGTERM: the router
stops accepting and gives requests in flight `grace_s` to finish (then aborts them),
and everything started here is stopped in reverse order, whatever failed before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
from contextlib import AsyncExitStack
from typing import Any

import ray

from cluster.config import PoolConfig, ServeConfig
from cluster.redis_server import EmbeddedRedis
from decode_worker.worker import spawn as spawn_decode
from prefill_worker.worker import spawn as spawn_prefill
from router.app import start_router

log = logging.getLogger("splitserve")


def serve(config: ServeConfig) -> int:
    asyncio.run(_serve(config))
    return 0


async def _serve(config: ServeConfig) -> None:
    stop = asyncio.Event()
    async with AsyncExitStack() as stack:
        redis_url = config.redis_url
        if redis_url is None:
            redis = EmbeddedRedis()
            redis_url = redis.start()
            stack.callback(redis.stop)
            log.info("redis: embedded valkey-server at %s", redis_url)
        else:
            log.info("redis: %s (external)", redis_url)

        if config.ray_address is None:
            pools = (config.prefill, config.decode)
            wanted = sum(p.replicas * p.num_cpus for p in pools)
            num_cpus = max(os.cpu_count() or 1, math.ceil(wanted))
            # This machine plays every node type: it has the pools' custom resources.
            custom: dict[str, float] = {}
            for pool in pools:
                for key, amount in pool.resources.items():
                    custom[key] = custom.get(key, 0) + pool.replicas * amount
            ray.init(address="local", num_cpus=num_cpus, resources=custom, include_dashboard=False)
            gcs = ray.get_runtime_context().gcs_address
            log.info("ray: local cluster with %d CPUs, GCS at %s", num_cpus, gcs)
        else:
            ray.init(address=config.ray_address)
            log.info("ray: joined %s, %s", config.ray_address, ray.cluster_resources())
        stack.callback(ray.shutdown)
        # After ray.init, which installs its own SIGTERM handler: ours must win.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        prefill = _spawn("prefill", config.prefill, config, spawn_prefill)
        decode = _spawn("decode", config.decode, config, spawn_decode)
        workers = {**prefill, **decode}
        for handle in workers.values():
            stack.callback(ray.kill, handle)
        for name, handle in workers.items():
            info = await handle.info.remote()
            log.info("%s: ready (%s, max_model_len %d)", name, info.name, info.max_model_len)

        app = await start_router(
            config.router,
            config.transfer.local_prefill_tokens,
            prefill,
            decode,
            redis_url,
            config.decode.engine.model,
        )
        log.info("splitserve: serving on %s; Ctrl-C to stop", app.address)
        await stop.wait()
        log.info("splitserve: stopping; requests in flight get %.0fs", config.router.grace_s)
        await app.stop(config.router.grace_s)
    log.info("splitserve: stopped")


def _spawn(phase: str, pool: PoolConfig, config: ServeConfig, spawn: Any) -> dict[str, Any]:
    return {
        f"{phase}-{i}": spawn(
            f"{phase}-{i}",
            pool.engine,
            config.transfer,
            pool.num_cpus,
            pool.num_gpus,
            pool.resources,
        )
        for i in range(pool.replicas)
    }
