"""`splitserve serve`: Redis, Ray, a prefill and a decode pool, the gRPC router, and a
scaler per pool.

Start order: the API key (router/auth.py: one is needed beyond loopback) and the TLS
certificate (router/tls.py) load, the memory check (splitserve/fit.py: the model is here
and each pool's worker fits its device), the port check (splitserve/ports.py: each
listening port is free), Redis (embedded valkey-server unless redis_url is set), a local
Ray (or join one), the workers (all spawned at once, then awaited), the router, the
scalers.
SIGINT or SIGTERM: scaling stops, the router stops accepting and gives requests in
flight `grace_s` to finish (then aborts them), and everything started here is stopped
in reverse order, whatever failed before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

import ray

from cluster.config import ServeConfig
from cluster.engine.model.model_files import model_path
from router.app import RouterApp, start_router
from router.auth import api_key
from router.tls import server_tls
from splitserve import lab
from splitserve.fit import check_fit
from splitserve.pool import DECODE, PREFILL, AnyPool, WorkerPool
from splitserve.ports import check_ports
from splitserve.redis_server import EmbeddedRedis
from splitserve.scaler import PhaseScaler, ScalerMetrics

log = logging.getLogger("splitserve")


def serve(config: ServeConfig) -> int:
    # Before anything starts: a host beyond loopback with no key, an unreadable key file, a
    # certificate that does not load.
    api_key(config.router)
    server_tls(config.router)
    check_ports(config)  # in milliseconds, before the model's header is read
    check_fit(config)  # before Redis, Ray or any worker starts
    asyncio.run(_serve(config))
    return 0


async def _serve(config: ServeConfig) -> None:
    stop = asyncio.Event()
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        redis_url = config.redis_url
        if redis_url is None:
            redis = EmbeddedRedis()
            redis_url = redis.start()
            stack.callback(redis.stop)
            supervisor = asyncio.create_task(redis.supervise())  # a killed one comes back
            stack.push_async_callback(_cancel, supervisor)  # before redis.stop
            log.info("redis: embedded valkey-server at %s", redis_url)
        else:
            log.info("redis: %s (external)", redis_url)

        stack.callback(ray.shutdown)  # first: an init that fails halfway leaves nothing
        if config.ray_address is None:
            pools = (config.prefill, config.decode)
            wanted = sum(p.scaling.max_replicas * p.num_cpus for p in pools)
            num_cpus = max(os.cpu_count() or 1, math.ceil(wanted))
            # This machine plays every node type: it has the pools' custom resources.
            custom: dict[str, float] = {}
            for pool in pools:
                for key, amount in pool.resources.items():
                    custom[key] = custom.get(key, 0) + pool.scaling.max_replicas * amount
            ray.init(address="local", num_cpus=num_cpus, resources=custom, include_dashboard=False)
            gcs = ray.get_runtime_context().gcs_address
            log.info("ray: local cluster with %d CPUs, GCS at %s", num_cpus, gcs)
        else:
            ray.init(address=config.ray_address)
            log.info("ray: joined %s, %s", config.ray_address, ray.cluster_resources())
        # After ray.init, which installs its own SIGTERM handler: ours must win.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        cluster = await start_cluster(config, redis_url)
        log.info(
            "splitserve: serving on %s; started in %.1fs; Ctrl-C to stop",
            cluster.app.address,
            time.monotonic() - started,
        )
        await stop.wait()
        log.info("splitserve: stopping; requests in flight get %.0fs", config.router.grace_s)
        await cluster.stop(config.router.grace_s)
    log.info("splitserve: stopped")


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@dataclass
class Cluster:
    """What `start_cluster` runs: the router over both pools, each with its scaler."""

    app: RouterApp
    pools: dict[str, AnyPool]
    scalers: dict[str, PhaseScaler]

    async def stop(self, grace_s: float) -> None:
        """Stop scaling, then the router (in-flight requests get grace_s), then the workers."""
        for scaler in self.scalers.values():
            await scaler.stop()
        try:
            await self.app.stop(grace_s)
        finally:
            for pool in self.pools.values():
                pool.stop()


async def start_cluster(config: ServeConfig, redis_url: str | None, prefix: str = "") -> Cluster:
    """Both pools, the router over them and their scalers, on the Ray this process joined.
    Worker names start with `prefix`."""
    prefill_pool = WorkerPool(PREFILL, config.prefill, config.transfer, prefix)
    decode_pool = WorkerPool(DECODE, config.decode, config.transfer, prefix)
    pools: dict[str, AnyPool] = {"prefill": prefill_pool, "decode": decode_pool}
    try:
        prefill, decode = await asyncio.gather(prefill_pool.start(), decode_pool.start())
        engine = config.decode.engine  # the router tokenizes with the workers' model
        app = await start_router(
            config.router,
            config.transfer.local_prefill_tokens,
            prefill,
            decode,
            redis_url,
            str(model_path(engine.model, engine.revision, engine.download_dir, engine.download)),
            lab.routes(),
        )
    except BaseException:
        for pool in pools.values():
            pool.stop()
        raise
    metrics = ScalerMetrics(app.metrics.registry)
    latencies = {"prefill": app.metrics.recent_ttft, "decode": app.metrics.recent_tpot}
    scalers = {
        phase: PhaseScaler(pool, app.workers, latencies[phase], metrics)
        for phase, pool in pools.items()
    }
    for scaler in scalers.values():
        scaler.start()
    return Cluster(app, pools, scalers)
