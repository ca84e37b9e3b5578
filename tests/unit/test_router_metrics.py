"""The router's metrics: requests observed under vLLM's names and buckets, labelled with
the served model's name, beside every worker's series from the stats the router polled;
and the metrics port, which asks for the API key when one is set."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cluster.protocol import EngineCounts
from cluster.types import FinishReason, RequestId, TokenDelta
from router.metrics import RouterMetrics, buckets_1_2_5
from router.policy import Route
from router.router import Final, Timing, Usage
from tests.unit.worker_stats import decode_stats, prefill_stats, router_metrics


def value(metrics: RouterMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_every_worker_shows_under_vllm_names_with_the_served_model_name() -> None:
    counts = EngineCounts(
        prompt_tokens=30, generation_tokens=1, prefix_queries=16, prefix_hits=0, preemptions=0
    )
    metrics = router_metrics(
        {"p0": prefill_stats(counts=counts, queued_requests=1, prefilling=1)},
        {"d0": decode_stats(running=2, free_pages=90), "d1": decode_stats()},
    )
    p0 = {"model_name": "served-smol", "worker": "p0", "phase": "prefill"}
    d0 = {"model_name": "served-smol", "worker": "d0", "phase": "decode"}
    assert value(metrics, "vllm:prompt_tokens_total", **p0) == 30
    assert value(metrics, "vllm:generation_tokens_total", **p0) == 1
    assert value(metrics, "vllm:num_requests_running", **p0) == 1
    assert value(metrics, "vllm:num_requests_running", **d0) == 2
    assert value(metrics, "vllm:kv_cache_usage_perc", **d0) == 0.1
    assert value(metrics, "splitserve_workers", phase="decode") == 2
    assert value(metrics, "splitserve_workers", phase="prefill") == 1


def test_a_finished_request_is_observed_once_under_each_name() -> None:
    metrics = router_metrics({}, {"d0": decode_stats()})
    last = metrics.observe(TokenDelta(RequestId("r"), 0, (7,), "a"), None, None)
    final = Final(
        Usage(prompt_tokens=30, cached_prompt_tokens=16, completion_tokens=3),
        Timing(queue_ms=5, prefill_ms=45, transfer_ms=10, first_token_ms=50, total_ms=250),
        Route("d0", "p0", "test"),
    )
    end = TokenDelta(RequestId("r"), 1, (8, 9), "bc", finish_reason=FinishReason.LENGTH)
    metrics.observe(end, final, last)
    model = {"model_name": "served-smol"}
    assert value(metrics, "vllm:request_success_total", finished_reason="length", **model) == 1
    assert value(metrics, "vllm:inter_token_latency_seconds_count", **model) == 2
    assert value(metrics, "vllm:time_to_first_token_seconds_sum", **model) == 0.05
    assert value(metrics, "vllm:e2e_request_latency_seconds_sum", **model) == 0.25
    assert value(metrics, "vllm:request_queue_time_seconds_sum", **model) == 0.005
    assert value(metrics, "vllm:request_prefill_time_seconds_sum", **model) == 0.045
    assert value(metrics, "vllm:request_decode_time_seconds_sum", **model) == 0.2
    assert value(metrics, "vllm:request_time_per_output_token_seconds_sum", **model) == 0.1
    assert value(metrics, "vllm:request_prompt_tokens_sum", **model) == 30
    assert value(metrics, "vllm:request_generation_tokens_sum", **model) == 3
    assert value(metrics, "vllm:request_prompt_tokens_bucket", le="50.0", **model) == 1
    assert value(metrics, "vllm:request_prompt_tokens_bucket", le="20.0", **model) == 0
    assert value(metrics, "splitserve_kv_transfer_seconds_count") == 1
    assert metrics.recent_ttft.take_p90() == 0.05


def test_token_count_buckets_are_vllms_1_2_5_up_to_the_context() -> None:
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets_1_2_5(2048) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]


KEY = "sk-test-metrics"


async def _scrape(metrics: RouterMetrics, key: str | None, header: str | None) -> tuple[int, str]:
    """GET /metrics on a metrics port serving `key`, sending `header` as Authorization."""
    runner = await metrics.serve("127.0.0.1", 0, None if key is None else (key,), None)
    host, port = runner.addresses[0][:2]
    url = f"http://{host}:{port}/metrics"
    headers = {} if header is None else {"Authorization": header}
    try:
        async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as r:
            return r.status, await r.text()
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("key", "header", "status"),
    [
        (KEY, None, 401),
        (KEY, "Bearer wrong", 401),
        (KEY, f"Basic {KEY}", 401),
        (KEY, f"Bearer {KEY}", 200),
        (None, None, 200),
        (None, "Bearer anything", 200),
    ],
)
def test_the_metrics_port_asks_for_the_key_when_one_is_set(
    key: str | None, header: str | None, status: int
) -> None:
    metrics = router_metrics({}, {"d0": decode_stats()})
    got, text = asyncio.run(_scrape(metrics, key, header))
    assert got == status
    if status == 200:
        assert 'splitserve_workers{phase="decode"} 1.0' in text
    else:
        assert text == "invalid API key: send Authorization: Bearer <key>"
