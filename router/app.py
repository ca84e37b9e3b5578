"""Assemble a running router from worker handles: loads, placement, policy, gRPC server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from aiohttp import web

from cluster.config import ConfigError, RouterConfig
from cluster.engine.model.model_files import model_path
from cluster.engine.model.tokenizer import Tokenizer
from cluster.protocol import DecodeHandle, PrefillHandle
from cluster.types import ModelInfo
from router.auth import api_key
from router.metrics import RouterMetrics
from router.openai import OpenAIFrontDoor
from router.placement import PlacementStore
from router.policy import PolicyConfig, PolicyName
from router.router import Router
from router.server import GenerationServicer, RouterServer
from router.tls import server_tls
from router.tokenize_pool import TokenizePool
from router.workers import WorkerRegistry

log = logging.getLogger(__name__)


@dataclass
class RouterApp:
    server: RouterServer
    router: Router
    workers: WorkerRegistry
    placements: PlacementStore | None
    metrics: RouterMetrics
    metrics_http: web.AppRunner | None  # /metrics on router.metrics_port, if one was asked for
    http: OpenAIFrontDoor | None  # the OpenAI-compatible API, if one was asked for
    tokenize: TokenizePool

    @property
    def address(self) -> str:
        return self.server.address

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; calls in flight get grace_s to finish, then are aborted."""
        if self.http is not None:
            await asyncio.gather(self.server.stop(grace_s), self.http.stop())
        else:
            await self.server.stop(grace_s)
        if self.metrics_http is not None:
            await self.metrics_http.cleanup()
        await self.router.dispatcher.close()
        self.tokenize.close()
        await self.workers.stop()
        if self.placements is not None:
            await self.placements.close()


async def start_router(
    config: RouterConfig,
    local_prefill_tokens: int,
    prefill: dict[str, PrefillHandle],
    decode: dict[str, DecodeHandle],
    redis_url: str | None,
    model: str | None = None,
    routes: Sequence[web.RouteDef] = (),
) -> RouterApp:
    """Start serving gRPC on config.host:config.port for these workers (and HTTP on
    http_port), both over TLS when router.ssl_certfile is set. `model` is the checkpoint
    the workers run (None: the bundled one): the router tokenizes with it. `routes` go on
    the HTTP API too (splitserve's lab page)."""
    if not decode:
        raise ValueError("a router needs at least one decode worker")
    info: ModelInfo = await next(iter(decode.values())).info.remote()
    if config.served_model_name is not None:
        info = replace(info, name=config.served_model_name)
    path = model_path(model)
    tokenizer = await asyncio.to_thread(Tokenizer.load, path)
    if config.chat_template is not None:
        try:
            tokenizer.hf.chat_template = Path(config.chat_template).read_text()
        except OSError as e:
            raise ConfigError(f"router.chat_template: {e}") from None
    workers = WorkerRegistry(prefill, decode, config.stats_interval_s)
    placements = None
    if redis_url is not None:
        placements = PlacementStore(redis_url, config.session_ttl_s, config.redis_timeout_s)
    policy = PolicyConfig(
        PolicyName(config.policy),
        local_prefill_tokens,
        config.affinity_slack_tokens,
        config.seq_cost_tokens,
        config.prefill_by_cost,
    )
    router = Router(
        policy,
        workers,
        placements,
        config.max_pending,
        max_migrations=config.max_migrations,
        migration_wait_s=config.migration_wait_s,
        max_pending_per_client=config.max_pending_per_client,
        seed=config.seed,
    )
    metrics = RouterMetrics(workers, info)
    pool = TokenizePool(config.tokenize_threads, config.max_tokenize_queue)
    servicer = GenerationServicer(router, tokenizer, info, config, metrics, pool)
    key = api_key(config)
    tls = server_tls(config)
    http_tls = None if tls is None else tls.http  # the HTTP API's and the metrics port's
    server = RouterServer(servicer, config, key, None if tls is None else tls.grpc)
    app = RouterApp(server, router, workers, placements, metrics, None, None, pool)
    try:
        await workers.start()
        await server.start()
        await server.set_serving(bool(workers.snapshot().decode))
        tasks: set[asyncio.Task[None]] = set()

        def on_change(num_decode: int) -> None:
            task = asyncio.get_running_loop().create_task(server.set_serving(num_decode > 0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        workers.on_change = on_change
        workers.on_prefill_died = router.dispatcher.prefill_died
        if config.http_port is not None:
            app.http = OpenAIFrontDoor(
                router,
                tokenizer,
                info,
                config.max_tokens,
                metrics,
                lambda: bool(workers.snapshot().decode),
                pool,
                key,
                config.allowed_origins,
                routes,
                config.reasoning_parser,
                config.tool_call_parser,
            )
            await app.http.start(config.host, config.http_port, config.grace_s, http_tls)
            log.info("router: OpenAI-compatible HTTP API on %s/v1", app.http.address)
        if config.metrics_port is not None:
            app.metrics_http = await metrics.serve(config.host, config.metrics_port, key, http_tls)
            host, port = app.metrics_http.addresses[0][:2]
            scheme = "http" if http_tls is None else "https"
            log.info("router: Prometheus metrics on %s://%s:%d/metrics", scheme, host, port)
        log.info(
            "router: gRPC on %s (policy %s, %d prefill + %d decode workers, model %s)",
            server.address,
            config.policy,
            len(prefill),
            len(decode),
            info.name,
        )
    except BaseException:
        await app.stop(0)  # what started here stops: none of it outlives a failed start
        raise
    return app
