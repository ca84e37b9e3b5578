"""`splitserve bench serve` against a real router: every request is recorded with exact
token counts, metrics and goodput come out, and the JSON says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.serve import main
from tests.integration.router_harness import RouterHarness

WORKLOAD = """
prompt: {dist: uniform, low: 8, high: 40}
output: {dist: uniform, low: 3, high: 6}
"""


def test_a_short_sweep_records_every_request_and_finds_the_goodput(
    workers: Any, tmp_path: Path
) -> None:
    spec = tmp_path / "tiny.yaml"
    spec.write_text(WORKLOAD)
    out = tmp_path / "serve.json"
    # Workers of its own: the shared ones' prefix caches are what other modules' tests expect.
    prefill, decode = workers.prefill("bench-prefill"), workers.decode("bench-decode")
    router = RouterHarness({"bench-prefill": prefill}, {"bench-decode": decode}, None)
    try:
        argv = ["--target", router.address, "--workload", str(spec), "--rates", "4,inf"]
        argv += ["--num-requests", "4", "--warmup", "1", "--slo-ttft", "60", "--slo-tpot", "10"]
        assert main([*argv, "--out", str(out)]) == 0
    finally:
        router.stop()
    result = json.loads(out.read_text())
    assert [run["rate"] for run in result["runs"]] == [4.0, "inf"]
    for run in result["runs"]:
        summary, records = run["summary"], run["records"]
        assert (summary["requests"], summary["completed"], summary["failures"]) == (4, 4, {})
        assert summary["slo_attainment"] == 1.0
        assert all(3 <= sum(k for _, k in r["messages"]) <= 6 for r in records)
        assert all(r["timing"]["total_ms"] > 0 for r in records)
        assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    assert result["goodput"]["goodput_rps"] == 4.0  # the one finite rate, met by all
