"""What the server exports is what its readers expect: every vllm: name is one vLLM
exports, with vLLM's buckets, and every query of the Grafana dashboard in deploy/ names
only metrics the router, the autoscaler or a worker exports."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from prometheus_client.core import Metric

from cluster.worker_metrics import worker_series
from splitserve.scaler import ScalerMetrics
from tests.unit.worker_stats import decode_stats, prefill_stats, router_metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"

# vLLM's metric families (vllm/v1/metrics/loggers.py, docs/design/metrics.md; counters
# without the _total their samples carry), the deprecated and the optional ones left out.
VLLM = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:engine_sleep_state",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries",
    "vllm:external_prefix_cache_hits",
    "vllm:mm_cache_queries",
    "vllm:mm_cache_hits",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:cache_config_info",
}
# vLLM's buckets for its latency histograms, in seconds
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
TTFT += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
TOKEN += [10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0]
REQUEST += [120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": TTFT,
    "vllm:inter_token_latency_seconds": TOKEN,
    "vllm:request_time_per_output_token_seconds": TOKEN,
    "vllm:e2e_request_latency_seconds": REQUEST,
    "vllm:request_queue_time_seconds": REQUEST,
    "vllm:request_prefill_time_seconds": REQUEST,
    "vllm:request_decode_time_seconds": REQUEST,
}
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}


def exported() -> list[Metric]:
    """The families of the router's registry, with the autoscaler's in it as serve runs
    them, and of a worker's own endpoint, each with a worker of each phase polled."""
    metrics = router_metrics({"p0": prefill_stats()}, {"d0": decode_stats()})
    ScalerMetrics(metrics.registry)
    return [*metrics.registry.collect(), *worker_series("smol", {"p0": prefill_stats()})]


def queryable(families: Iterable[Metric]) -> set[str]:
    """The names a query can ask for: each family's sample names by its type."""
    return {f.name + suffix for f in families for suffix in SUFFIXES[f.type]}


def test_every_vllm_name_exported_is_one_vllm_exports() -> None:
    ours = {f.name for f in exported() if f.name.startswith("vllm:")}
    assert ours - VLLM == set()
    assert {"vllm:prompt_tokens", "vllm:generation_tokens", "vllm:kv_cache_usage_perc"} <= ours


def test_every_other_name_is_splitserves_own() -> None:
    assert all(f.name.startswith(("vllm:", "splitserve_")) for f in exported())


def test_latency_histograms_have_vllms_buckets() -> None:
    metrics = router_metrics({}, {"d0": decode_stats()})
    for name, buckets in VLLM_BUCKETS.items():
        (family,) = [f for f in metrics.registry.collect() if f.name == name]
        bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
        assert bounds == [*buckets, float("inf")], name


def test_every_dashboard_query_names_only_exported_metrics() -> None:
    names = queryable(exported())
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            asked = set(re.findall(r"(?:vllm:|splitserve_)[A-Za-z0-9_:]*", target["expr"]))
            assert asked, f"{panel['title']}: {target['expr']} names no metric"
            assert asked <= names, f"{panel['title']}: not exported: {asked - names}"
