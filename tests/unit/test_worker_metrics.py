"""A worker's series under vLLM's names, built from its stats, and its own /metrics."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import worker_metrics
from cluster.config import ConfigError, EngineConfig
from cluster.protocol import EngineCounts, TierCounts
from cluster.worker_loop import WorkerLoop
from tests.unit.worker_stats import decode_stats, prefill_stats

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def series(**stats: object) -> Samples:
    out: Samples = {}
    for family in worker_metrics.worker_series("smol", stats):  # type: ignore[arg-type]
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(worker: str, phase: str) -> tuple[tuple[str, str], ...]:
    return (("model_name", "smol"), ("phase", phase), ("worker", worker))


def test_a_decode_worker_shows_its_batch_its_waiting_requests_its_kv_and_its_counts() -> None:
    counts = EngineCounts(
        prompt_tokens=40, generation_tokens=12, prefix_queries=32, prefix_hits=16, preemptions=1
    )
    stats = decode_stats(
        free_pages=75, running=3, waiting=1, transferring=2, admitting=1, counts=counts
    )
    got = series(d0=stats)
    at = labels("d0", "decode")
    assert got[("vllm:num_requests_running", at)] == 3
    assert got[("vllm:num_requests_waiting", at)] == 1 + 2 + 1  # queued, KV in transfer, pages
    assert got[("vllm:kv_cache_usage_perc", at)] == 0.25
    assert got[("vllm:prompt_tokens_total", at)] == 40
    assert got[("vllm:generation_tokens_total", at)] == 12
    assert got[("vllm:prefix_cache_queries_total", at)] == 32
    assert got[("vllm:prefix_cache_hits_total", at)] == 16
    assert got[("vllm:num_preemptions_total", at)] == 1


def test_a_worker_with_a_kv_tier_shows_its_hits_and_the_bytes_it_moved() -> None:
    tier = TierCounts(
        bytes_held=4096, queries=64, hits=48, spilled_bytes=8192, restored_bytes=2048, dropped=1
    )
    got = series(d0=decode_stats(counts=EngineCounts(0, 0, 0, 0, 0, tier)), d1=decode_stats())
    at = labels("d0", "decode")
    assert got[("splitserve_kv_offload_bytes", at)] == 4096
    assert got[("vllm:external_prefix_cache_queries_total", at)] == 64
    assert got[("vllm:external_prefix_cache_hits_total", at)] == 48
    assert got[("splitserve_kv_offload_spilled_bytes_total", at)] == 8192
    assert got[("splitserve_kv_offload_restored_bytes_total", at)] == 2048
    assert got[("splitserve_kv_offload_dropped_entries_total", at)] == 1
    assert not [k for k in got if "offload" in k[0] and k[1] == labels("d1", "decode")]


def test_a_prefill_worker_running_is_what_it_prefills_and_waiting_the_rest_of_its_queue() -> None:
    got = series(p0=prefill_stats(queued_requests=5, prefilling=2, free_pages=50))
    at = labels("p0", "prefill")
    assert got[("vllm:num_requests_running", at)] == 2
    assert got[("vllm:num_requests_waiting", at)] == 3
    assert got[("vllm:kv_cache_usage_perc", at)] == 0.5


def test_each_worker_is_its_own_series() -> None:
    got = series(d0=decode_stats(running=1), d1=decode_stats(running=2), p0=prefill_stats())
    running = {k[1]: v for k, v in got.items() if k[0] == "vllm:num_requests_running"}
    assert running == {
        labels("d0", "decode"): 1,
        labels("d1", "decode"): 2,
        labels("p0", "prefill"): 0,
    }


def test_a_worker_serves_its_series_over_http_reading_its_stats_at_each_scrape() -> None:
    stats = [decode_stats(running=1), decode_stats(running=4)]
    config = EngineConfig(metrics_host="127.0.0.1", metrics_port=0)
    url = worker_metrics.serve("d0", "smol", lambda: stats.pop(0), config)
    assert url is not None and url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
    for running in (1, 4):
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        assert samples(text)[("vllm:num_requests_running", labels("d0", "decode"))] == running


def test_a_worker_bound_beyond_loopback_asks_for_the_key_of_its_key_file(
    tmp_path: Path,
) -> None:
    """metrics_host 0.0.0.0 is taken only with a key file; then a scrape without the key,
    with another or with another scheme is a 401, with it the series."""
    key_file = tmp_path / "api-key"
    key_file.write_text("s3cret\n")
    config = EngineConfig(
        metrics_host="0.0.0.0", metrics_port=0, metrics_api_key_file=str(key_file)
    )
    url = worker_metrics.serve("d0", "smol", decode_stats, config)
    assert url is not None
    local = url.replace("0.0.0.0", "127.0.0.1")
    for header in (None, "Bearer wrong", "Basic s3cret"):
        request = urllib.request.Request(local, headers={"Authorization": header} if header else {})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401
    keyed = urllib.request.Request(local, headers={"Authorization": "Bearer s3cret"})
    text = urllib.request.urlopen(keyed, timeout=10).read().decode()
    assert ("vllm:num_requests_running", labels("d0", "decode")) in samples(text)
    with pytest.raises(urllib.error.HTTPError) as elsewhere:
        urllib.request.urlopen(local.replace("/metrics", "/other"), timeout=10)
    assert elsewhere.value.code == 404


def test_a_worker_serves_its_series_on_ipv6_loopback_too() -> None:
    config = EngineConfig(metrics_host="::1", metrics_port=0)
    url = worker_metrics.serve("d0", "smol", decode_stats, config)
    assert url is not None and url.startswith("http://[::1]:")
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    assert ("vllm:num_requests_running", labels("d0", "decode")) in samples(text)


def test_an_unreadable_key_file_is_refused_naming_the_field(tmp_path: Path) -> None:
    config = EngineConfig(metrics_port=0, metrics_api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"engine\.metrics_api_key_file: cannot read"):
        worker_metrics.serve("d0", "smol", decode_stats, config)


def test_no_port_no_server() -> None:
    config = EngineConfig(metrics_port=None)
    assert worker_metrics.serve("d0", "smol", decode_stats, config) is None


def test_call_blocking_runs_on_the_engine_thread_and_brings_back_its_result_or_error() -> None:
    loop = WorkerLoop(name="metrics-test-engine")
    assert loop.call_blocking(lambda: threading.current_thread().name, 5.0) == "metrics-test-engine"

    def broken() -> int:
        raise ValueError("no stats")

    with pytest.raises(ValueError, match="no stats"):
        loop.call_blocking(broken, 5.0)
