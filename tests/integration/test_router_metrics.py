"""The router's Prometheus endpoint: request, latency and worker-load series that move."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_until
from tests.integration.router_harness import RouterHarness, ask


@pytest.fixture(scope="module")
def router(ray_workers: Any) -> Iterator[RouterHarness]:
    prefill = {"prefill": ray_workers.prefill("prefill")}
    decode = {
        "decode": ray_workers.decode("decode", local_prefill_tokens=0),
        "colocated": ray_workers.decode("colocated"),
    }
    harness = RouterHarness(prefill, decode, redis_url=None, metrics_port=0)
    yield harness
    harness.stop()


def scrape(router: RouterHarness) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample on /metrics, by name and labels."""
    assert router.app.metrics_http is not None
    host, port = router.app.metrics_http.server_address[:2]
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_and_latencies_and_show_worker_loads(
    router: RouterHarness, workers: Any
) -> None:
    before = scrape(router)
    story = " ".join(f"The metrics lake reflects cloud number {i}." for i in range(30))
    remote = ask(router.address, story, max_tokens=6)  # long: a prefill worker computes it
    local = ask(router.address, "Snow is", max_tokens=5)
    with pytest.raises(grpc.aio.AioRpcError):
        ask(router.address, "Snow is", max_tokens=0)
    after = scrape(router)

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert remote.prefill_worker == "prefill" and local.prefill_worker == ""
    assert moved("splitserve_requests_total", status="ok") == 2
    assert moved("splitserve_requests_total", status="invalid_argument") == 1
    assert moved("splitserve_time_to_first_token_seconds_count") == 2
    assert moved("splitserve_request_duration_seconds_count") == 2
    assert moved("splitserve_time_per_output_token_seconds_count") == 2
    assert moved("splitserve_inter_token_latency_seconds_count") == 6 - 1 + 5 - 1
    assert moved("splitserve_kv_transfer_seconds_count") == 1
    assert (
        sum(moved("splitserve_kv_transfer_bytes_total", worker=w) for w in ("decode", "colocated"))
        > 0
    )
    assert after[("splitserve_workers", (("phase", "decode"),))] == 2
    assert after[("splitserve_workers", (("phase", "prefill"),))] == 1
    for phase in ("prefill", "decode"):
        assert ("splitserve_queue_depth", (("phase", phase),)) in after
        assert ("splitserve_queued_tokens", (("phase", phase),)) in after
    for w in ("decode", "colocated"):
        assert 0 <= after[("splitserve_kv_cache_usage_ratio", (("worker", w),))] <= 1
        assert 0 <= after[("splitserve_prefix_cache_hit_ratio", (("worker", w),))] <= 1
        # the same loads under vLLM's names, for gateways that balance model servers
        labels = (("phase", "decode"), ("worker", w))
        assert after[("vllm:kv_cache_usage_perc", labels)] == pytest.approx(
            after[("splitserve_kv_cache_usage_ratio", (("worker", w),))]
        )
        assert after[("vllm:num_requests_running", labels)] >= 0  # as last polled
        assert after[("vllm:num_requests_waiting", labels)] >= 0
    assert ("vllm:num_requests_waiting", (("phase", "prefill"), ("worker", "prefill"))) in after
    # The prefill worker's cache holds the story's full pages, once the router reads its events.
    key = ("splitserve_prefix_index_blocks", (("worker", "prefill"),))
    full_pages = remote.usage.prompt_tokens // 16
    wait_until(lambda: scrape(router).get(key, 0) >= full_pages, "the indexed pages")
