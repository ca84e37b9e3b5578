"""The router's Prometheus endpoint: request, latency and worker-load series that move,
under vLLM's names where vLLM has one; and a worker's own endpoint."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import ray
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


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(router: RouterHarness) -> Samples:
    """Every sample on the router's /metrics, by name and labels."""
    assert router.app.metrics_http is not None
    host, port = router.app.metrics_http.addresses[0][:2]
    return scrape_url(f"http://{host}:{port}/metrics")


def scrape_url(url: str) -> Samples:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_requests_and_latencies_and_show_worker_loads(
    router: RouterHarness, workers: Any
) -> None:
    model = ray.get(workers.handles["decode"].info.remote()).name
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
    assert moved("vllm:request_success_total", model_name=model, finished_reason="length") == 2
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert moved(f"{name}_count", model_name=model) == 2, name
    assert moved("vllm:request_generation_tokens_sum", model_name=model) == 6 + 5
    assert moved("vllm:inter_token_latency_seconds_count", model_name=model) == 6 - 1 + 5 - 1
    assert moved("splitserve_kv_transfer_seconds_count") == 1
    assert (
        sum(moved("splitserve_kv_transfer_bytes_total", worker=w) for w in ("decode", "colocated"))
        > 0
    )
    assert after[("splitserve_workers", (("phase", "decode"),))] == 2
    assert after[("splitserve_workers", (("phase", "prefill"),))] == 1
    for phase in ("prefill", "decode"):
        assert ("splitserve_queued_tokens", (("phase", phase),)) in after
    at = {
        w: (("model_name", model), ("phase", phase), ("worker", w))
        for w, phase in (("prefill", "prefill"), ("decode", "decode"), ("colocated", "decode"))
    }
    for w in at:
        assert 0 <= after[("vllm:kv_cache_usage_perc", at[w])] <= 1
        assert after[("vllm:num_requests_running", at[w])] >= 0  # as last polled
        assert after[("vllm:num_requests_waiting", at[w])] >= 0
        hits = after[("vllm:prefix_cache_hits_total", at[w])]
        assert 0 <= hits <= after[("vllm:prefix_cache_queries_total", at[w])]

    # Each prompt counts once, where it was prefilled, and each token where it was sampled
    # (a remote prefill's first on the prefill worker), as the workers' stats next say.
    def tokens(samples: Samples, name: str) -> float:
        return sum(samples.get((name, at[w]), 0.0) - before.get((name, at[w]), 0.0) for w in at)

    prompts = remote.usage.prompt_tokens + local.usage.prompt_tokens
    wait_until(
        lambda: (
            tokens(now := scrape(router), "vllm:prompt_tokens_total") == prompts
            and tokens(now, "vllm:generation_tokens_total") == 6 + 5
        ),
        "the workers' token counts",
    )
    # The prefill worker's cache holds the story's full pages, once the router reads its events.
    key = ("splitserve_prefix_index_blocks", (("worker", "prefill"),))
    full_pages = remote.usage.prompt_tokens // 16
    wait_until(lambda: scrape(router).get(key, 0) >= full_pages, "the indexed pages")


def test_each_worker_serves_its_own_series_on_its_node(router: RouterHarness, workers: Any) -> None:
    ask(router.address, "Rain is", max_tokens=3)
    expected: Samples = {}
    for w, phase in (("prefill", "prefill"), ("colocated", "decode")):
        handle = workers.prefill(w) if phase == "prefill" else workers.decode(w)
        stats = ray.get(handle.stats.remote())
        assert stats.metrics_url is not None and stats.metrics_url.startswith("http://127.0.0.1:")
        own = scrape_url(stats.metrics_url)
        labels = (
            ("model_name", ray.get(handle.info.remote()).name),
            ("phase", phase),
            ("worker", w),
        )
        assert {name for name, at in own if at == labels} >= {
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total",
            "vllm:prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total",
        }
        key = ("vllm:generation_tokens_total", labels)
        expected[key] = own[key]
    # the router shows the same counts once it has polled the workers again
    wait_until(
        lambda: all(scrape(router).get(k) == v for k, v in expected.items()),
        "the workers' own counts on the router",
    )
