"""The router's Prometheus metrics.

Requests are counted and their latencies observed as they end; the workers' loads are
read at each scrape from the last stats the router polled, so a worker that is gone has
no series left behind. Names follow Prometheus conventions (base units, `_total` on
counters, `_seconds`, `_bytes`, `_ratio`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cluster.protocol import DecodeStats, PrefillStats
from cluster.types import TokenDelta
from router.router import Final
from router.workers import WorkerRegistry

LATENCY_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class RouterMetrics:
    def __init__(self, workers: WorkerRegistry) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.ttft = Histogram(
            "splitserve_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_S,
            registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "splitserve_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            buckets=TOKEN_S,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve_inter_token_latency_seconds",
            "Time between two streamed tokens",
            buckets=TOKEN_S,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve_request_duration_seconds", "Arrival to last token", buckets=LATENCY_S,
            registry=r,
        )  # fmt: skip
        self.transfer = Histogram(
            "splitserve_kv_transfer_seconds",
            "First token to the decode worker holding all KV (remote prefills)",
            buckets=LATENCY_S,
            registry=r,
        )
        self.migrations = Counter(
            "splitserve_request_migrations",
            "Moves of finished requests to another decode worker (their worker died or drained)",
            registry=r,
        )
        r.register(_WorkerLoads(workers))
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
            self.migrations.inc(final.migrations)
            t, n = final.timing, final.usage.completion_tokens
            self.ttft.observe(t.first_token_ms / 1e3)
            self.recent_ttft.add(t.first_token_ms / 1e3)
            self.e2e.observe(t.total_ms / 1e3)
            if n > 1:
                tpot = (t.total_ms - t.first_token_ms) / 1e3 / (n - 1)
                self.tpot.observe(tpot)
                self.recent_tpot.add(tpot)
            if final.route.prefill is not None:
                self.transfer.observe(t.transfer_ms / 1e3)
        return now

    def serve(self, host: str, port: int) -> Any:
        """Serve /metrics on host:port (0: any free port); returns the HTTP server."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server


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
    def __init__(self, workers: WorkerRegistry) -> None:
        self.workers = workers

    def collect(self) -> Iterator[Metric]:
        stats = self.workers.stats()
        decode = {w: s for w, s in stats.items() if isinstance(s, DecodeStats)}
        prefill = {w: s for w, s in stats.items() if isinstance(s, PrefillStats)}
        pools = GaugeMetricFamily("splitserve_workers", "Live workers per phase", labels=["phase"])
        depth = GaugeMetricFamily(
            "splitserve_queue_depth", "Requests admitted, not yet running", labels=["phase"]
        )
        tokens = GaugeMetricFamily(
            "splitserve_queued_tokens", "Prompt tokens queued, not computed", labels=["phase"]
        )
        for phase, pool in (("prefill", prefill), ("decode", decode)):
            pools.add_metric([phase], len(pool))
        depth.add_metric(["prefill"], sum(s.queued_requests for s in prefill.values()))
        depth.add_metric(
            ["decode"], sum(s.waiting + s.transferring + s.admitting for s in decode.values())
        )
        tokens.add_metric(["prefill"], sum(s.queued_tokens for s in prefill.values()))
        tokens.add_metric(["decode"], sum(s.queued_tokens for s in decode.values()))
        yield from (pools, depth, tokens)
        used = GaugeMetricFamily(
            "splitserve_kv_cache_usage_ratio", "KV pages in use", labels=["worker"]
        )
        hits = GaugeMetricFamily(
            "splitserve_prefix_cache_hit_ratio",
            "Prompt tokens found in the prefix cache, of those looked up",
            labels=["worker"],
        )
        received = CounterMetricFamily(
            "splitserve_kv_transfer_bytes", "KV bytes written into the worker", labels=["worker"]
        )
        indexed = GaugeMetricFamily(
            "splitserve_prefix_index_blocks",
            "Full pages the router's prefix index says the worker holds (from its KV events)",
            labels=["worker"],
        )
        for w, s in decode.items():
            used.add_metric([w], 1 - s.free_pages / s.num_pages)
            hits.add_metric([w], s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
            received.add_metric([w], s.bytes_received)
        recomputed = CounterMetricFamily(
            "splitserve_recomputed_tokens",
            "Prompt tokens the prefill worker computed that the decode worker already held",
            labels=["worker"],
        )
        for w, p in prefill.items():
            recomputed.add_metric([w], p.recomputed_tokens)
        for w in stats:
            indexed.add_metric([w], self.workers.index.held(w))
        yield from (used, hits, received, recomputed, indexed)
        yield from _vllm_names(decode, prefill)


def _vllm_names(
    decode: dict[str, DecodeStats], prefill: dict[str, PrefillStats]
) -> Iterator[Metric]:
    """Each worker's load under the names vLLM exports, which gateways and autoscalers
    read (llm-d's endpoint picker, KEDA): running, waiting, KV usage as a fraction."""
    labels = ["worker", "phase"]
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests running", labels=labels)
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting", labels=labels)
    kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage, 0-1", labels=labels)
    for w, s in decode.items():
        running.add_metric([w, "decode"], s.running)
        waiting.add_metric([w, "decode"], s.waiting + s.transferring + s.admitting)
        kv.add_metric([w, "decode"], 1 - s.free_pages / s.num_pages)
    for w, p in prefill.items():
        waiting.add_metric([w, "prefill"], p.queued_requests)
    yield from (running, waiting, kv)
