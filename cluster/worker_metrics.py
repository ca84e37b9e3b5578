"""Each worker's load and counters under vLLM's metric names, built from its stats.

Two endpoints show them: the worker's own /metrics (`serve`, started by each worker
actor on EngineConfig.metrics_host:metrics_port, for a per-pod scrape or an endpoint
picker that scores the worker), and the router's, which shows every worker from the
stats it polls. Labels: vLLM's `model_name`, and ours, `worker` and `phase` (prefill |
decode), which stand where vLLM's `engine` does.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from cluster.bearer import authorized, read_key
from cluster.config import EngineConfig
from cluster.protocol import DecodeStats, EngineCounts, PrefillStats, TierCounts

log = logging.getLogger(__name__)

LABELS = ["model_name", "worker", "phase"]
UNAUTHORIZED = b"invalid API key: send Authorization: Bearer <key>\n"
Stats = DecodeStats | PrefillStats
COUNTERS: dict[str, tuple[str, Callable[[EngineCounts], int]]] = {
    "vllm:prompt_tokens": ("Prompt tokens prefilled here", lambda c: c.prompt_tokens),
    "vllm:generation_tokens": ("Tokens sampled here", lambda c: c.generation_tokens),
    "vllm:prefix_cache_queries": (
        "Prompt tokens looked up in the prefix cache",
        lambda c: c.prefix_queries,
    ),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache", lambda c: c.prefix_hits),
    "vllm:num_preemptions": ("Requests preempted to free KV pages", lambda c: c.preemptions),
}
# A worker's KV tier (cluster/engine/kv_tier.py), shown for workers that have one: vLLM
# counts the hits of a KV connector's cache (LMCache, its CPU offloading) as external.
TIER_COUNTERS: dict[str, tuple[str, Callable[[TierCounts], int]]] = {
    "vllm:external_prefix_cache_queries": (
        "Prompt tokens the prefix cache lacked, looked up in the KV tier",
        lambda t: t.queries,
    ),
    "vllm:external_prefix_cache_hits": (
        "Prompt tokens found in the KV tier",
        lambda t: t.hits,
    ),
    "splitserve_kv_offload_spilled_bytes": (
        "Bytes of KV copied from the cache to the KV tier",
        lambda t: t.spilled_bytes,
    ),
    "splitserve_kv_offload_restored_bytes": (
        "Bytes of KV copied back from the KV tier to the cache",
        lambda t: t.restored_bytes,
    ),
    "splitserve_kv_offload_dropped_entries": (
        "KV tier entries dropped, their copy out or their checksum failed (recomputed)",
        lambda t: t.dropped,
    ),
}


def worker_series(model: str, stats: Mapping[str, Stats]) -> Iterator[Metric]:
    """The vLLM series of these workers (by worker id), as their stats last said."""
    running = GaugeMetricFamily(
        "vllm:num_requests_running", "Requests in the engine's running batch", labels=LABELS
    )
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting",
        "Requests admitted, not running: queued, awaiting KV pages or their KV in transfer",
        labels=LABELS,
    )
    kv = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "KV cache pages in use, as a fraction 0-1", labels=LABELS
    )
    counters = {n: CounterMetricFamily(n, doc, labels=LABELS) for n, (doc, _) in COUNTERS.items()}
    tier = {n: CounterMetricFamily(n, doc, labels=LABELS) for n, (doc, _) in TIER_COUNTERS.items()}
    held = GaugeMetricFamily(
        "splitserve_kv_offload_bytes", "Bytes of KV the KV tier holds", labels=LABELS
    )
    for worker, s in stats.items():
        if isinstance(s, DecodeStats):
            labels = [model, worker, "decode"]
            running.add_metric(labels, s.running)
            waiting.add_metric(labels, s.waiting + s.transferring + s.admitting)
        else:
            labels = [model, worker, "prefill"]
            running.add_metric(labels, s.prefilling)
            waiting.add_metric(labels, s.queued_requests - s.prefilling)
        kv.add_metric(labels, (s.num_pages - s.free_pages) / s.num_pages)
        for name, (_, count) in COUNTERS.items():
            counters[name].add_metric(labels, count(s.counts))
        if s.counts.tier is not None:
            held.add_metric(labels, s.counts.tier.bytes_held)
            for name, (_, tier_count) in TIER_COUNTERS.items():
                tier[name].add_metric(labels, tier_count(s.counts.tier))
    yield from (running, waiting, kv, *counters.values(), held, *tier.values())


class _OneWorker:
    def __init__(self, worker: str, model: str, read: Callable[[], Stats]) -> None:
        self.worker, self.model, self.read = worker, model, read

    def collect(self) -> Iterator[Metric]:
        yield from worker_series(self.model, {self.worker: self.read()})


def serve(worker: str, model: str, read: Callable[[], Stats], config: EngineConfig) -> str | None:
    """Serve the worker's series on http://metrics_host:metrics_port/metrics (port 0: any
    free one, None: no server), reading its stats with `read` at each scrape, and asking for
    the key in metrics_api_key_file when there is one; the URL."""
    if config.metrics_port is None:
        return None
    registry = CollectorRegistry()
    registry.register(_OneWorker(worker, model, read))
    path = config.metrics_api_key_file
    key = None if path is None else read_key(path, "engine.metrics_api_key_file")

    class Scrape(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.partition("?")[0] != "/metrics":
                self._answer(404, b"not found: /metrics only\n", "text/plain")
            elif key is not None and not authorized(self.headers.get("Authorization"), (key,)):
                self._answer(401, UNAUTHORIZED, "text/plain")
            else:
                self._answer(200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def _answer(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # no line per scrape

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in config.metrics_host else socket.AF_INET

    server = Server((config.metrics_host, config.metrics_port), Scrape)
    threading.Thread(target=server.serve_forever, name=f"{worker}-metrics", daemon=True).start()
    host = f"[{config.metrics_host}]" if ":" in config.metrics_host else config.metrics_host
    url = f"http://{host}:{server.server_address[1]}/metrics"
    log.info("%s: Prometheus metrics on %s", worker, url)
    return url
