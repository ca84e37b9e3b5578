"""The router's Prometheus metrics, under vLLM's names where vLLM has one.

Requests are observed as they end, as vLLM's front end observes them, with its buckets:
time to first token, inter-token and per-request output-token latency, end to end, queue,
prefill and decode time, prompt and output lengths, and finished requests by reason, all
labelled `model_name` (the name the router serves). Each worker's load and counters
(cluster/worker_metrics.py) are read at each scrape from the stats the router last
polled, so a worker that is gone has no series left behind; each worker also serves its
own on its node. What vLLM has no name for keeps a splitserve_ name, after Prometheus
conventions (base units, `_total` on counters): refusals, pools, queued tokens, KV
transfers, recomputed tokens, migrations and the prefix index.
"""

from __future__ import annotations

import ssl
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.protocol import DecodeStats, PrefillStats
from cluster.types import ModelInfo, TokenDelta
from cluster.worker_metrics import worker_series
from router.auth import UNAUTHORIZED, http_middleware
from router.router import Final
from router.workers import WorkerRegistry

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_S = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TRANSFER_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def buckets_1_2_5(most: int) -> list[int]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to `most`."""
    out, scale = [], 1
    while scale <= most:
        out += [m * scale for m in (1, 2, 5) if m * scale <= most]
        scale *= 10
    return out


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry, model: ModelInfo) -> None:
        self.registry = CollectorRegistry()
        self.model = model.name
        r, labels = self.registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model.name)

        self.requests = Counter(
            "splitserve_requests", "Requests by how they ended", ["status"], registry=r
        )
        self.refusals = Counter(
            "splitserve_refused_requests",
            "Requests refused by a limit before any work, by the limit (max_pending, "
            "max_pending_per_client, max_tokenize_queue)",
            ["limit"],
            registry=r,
        )
        self.finished = Counter(
            "vllm:request_success",
            "Requests finished, by why (stop, length)",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Arrival to first token", TTFT_S)
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between two streamed tokens", TOKEN_S
        )
        self.tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            TOKEN_S,
        )
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token", REQUEST_S)
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Arrival to admitted by the workers (KV pages reserved)",
            REQUEST_S,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "Admitted to first token sampled", REQUEST_S
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds", "First token to last token", REQUEST_S
        )
        lengths = buckets_1_2_5(model.max_model_len)
        self.prompt_len = histogram("vllm:request_prompt_tokens", "Prompt tokens", lengths)
        self.output_len = histogram("vllm:request_generation_tokens", "Output tokens", lengths)
        self.transfer = Histogram(
            "splitserve_kv_transfer_seconds",
            "First token to the decode worker holding all KV (remote prefills)",
            buckets=TRANSFER_S,
            registry=r,
        )
        self.migrations = Counter(
            "splitserve_request_migrations",
            "Moves of finished requests to another decode worker (their worker died or drained)",
            registry=r,
        )
        r.register(_WorkerLoads(workers, model.name))
        # What the autoscaler reads each tick (splitserve/scaler.py).
        self.recent_ttft = Window()
        self.recent_tpot = Window()

    def observe(self, delta: TokenDelta, final: Final | None, last: float | None) -> float:
        """Record the latencies one streamed delta shows; returns when it was sent."""
        now = time.monotonic()
        if last is not None and delta.token_ids:
            gap = (now - last) / len(delta.token_ids)
            for _ in delta.token_ids:
                self.itl.observe(gap)
        if final is not None:
            self._observe_final(delta, final)
        return now

    def _observe_final(self, delta: TokenDelta, final: Final) -> None:
        self.migrations.inc(final.migrations)
        if delta.finish_reason is not None:
            self.finished.labels(self.model, delta.finish_reason.value).inc()
        t, n = final.timing, final.usage.completion_tokens
        self.ttft.observe(t.first_token_ms / 1e3)
        self.recent_ttft.add(t.first_token_ms / 1e3)
        self.e2e.observe(t.total_ms / 1e3)
        self.queue.observe(t.queue_ms / 1e3)
        self.prefill.observe(t.prefill_ms / 1e3)
        self.decode.observe((t.total_ms - t.first_token_ms) / 1e3)
        self.prompt_len.observe(final.usage.prompt_tokens)
        self.output_len.observe(n)
        if n > 1:
            tpot = (t.total_ms - t.first_token_ms) / 1e3 / (n - 1)
            self.tpot.observe(tpot)
            self.recent_tpot.add(tpot)
        if final.route.prefill is not None:
            self.transfer.observe(t.transfer_ms / 1e3)

    async def scrape(self, request: web.Request) -> web.Response:
        """GET /metrics: the registry in Prometheus' text format."""
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def serve(
        self, host: str, port: int, keys: tuple[str, ...] | None, tls: ssl.SSLContext | None
    ) -> web.AppRunner:
        """Serve GET /metrics on host:port (0: any free port), over TLS with `tls`, to
        scrapers that send one of the `keys` (router/auth.py; None: no check); the started
        runner."""
        refuse = lambda: web.Response(status=401, text=UNAUTHORIZED)
        guard = [] if keys is None else [http_middleware(keys, refuse)]
        app = web.Application(middlewares=guard)
        app.router.add_get("/metrics", self.scrape)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, ssl_context=tls).start()
        except BaseException:
            await runner.cleanup()
            raise
        return runner


class Window:
    """Latencies observed since the last `take_p90` (at most the last `size`)."""

    def __init__(self, size: int = 10_000) -> None:
        self._samples: deque[float] = deque(maxlen=size)

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)

    def take_p90(self) -> float | None:
        """The 90th percentile of the samples, which are then dropped; None if none."""
        if not self._samples:
            return None
        p90 = float(np.percentile(list(self._samples), 90))
        self._samples.clear()
        return p90


class _WorkerLoads(Collector):
    def __init__(self, workers: WorkerRegistry, model: str) -> None:
        self.workers = workers
        self.model = model

    def collect(self) -> Iterator[Metric]:
        stats = self.workers.stats()
        decode = {w: s for w, s in stats.items() if isinstance(s, DecodeStats)}
        prefill = {w: s for w, s in stats.items() if isinstance(s, PrefillStats)}
        pools = GaugeMetricFamily("splitserve_workers", "Live workers per phase", labels=["phase"])
        tokens = GaugeMetricFamily(
            "splitserve_queued_tokens", "Prompt tokens queued, not computed", labels=["phase"]
        )
        for phase, pool in (("prefill", prefill), ("decode", decode)):
            pools.add_metric([phase], len(pool))
            tokens.add_metric([phase], sum(s.queued_tokens for s in pool.values()))
        received = CounterMetricFamily(
            "splitserve_kv_transfer_bytes", "KV bytes written into the worker", labels=["worker"]
        )
        for w, s in decode.items():
            received.add_metric([w], s.bytes_received)
        recomputed = CounterMetricFamily(
            "splitserve_recomputed_tokens",
            "Prompt tokens the prefill worker computed that the decode worker already held",
            labels=["worker"],
        )
        for w, p in prefill.items():
            recomputed.add_metric([w], p.recomputed_tokens)
        indexed = GaugeMetricFamily(
            "splitserve_prefix_index_blocks",
            "Full pages the router's prefix index says the worker holds (from its KV events)",
            labels=["worker"],
        )
        for w in stats:
            indexed.add_metric([w], self.workers.index.held(w))
        yield from (pools, tokens, received, recomputed, indexed)
        yield from worker_series(self.model, stats)
