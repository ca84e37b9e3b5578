"""`splitserve bench serve` against a real router: every request is recorded with exact
token counts, metrics and goodput come out, and the JSON says so; the openai backend,
through the router's HTTP front door, measures the same requests as the gRPC one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from splitserve.bench.serve import main
from splitserve.serve_workload import load_workload, make_conversations
from tests.integration.router_harness import RouterHarness

MODEL = "SmolLM2-135M-Instruct.Q4_1"

WORKLOAD = """
prompt: {dist: uniform, low: 8, high: 40}
output: {dist: uniform, low: 3, high: 6}
"""


def _serve(tmp_path: Path, *argv: str) -> dict[str, Any]:
    """bench serve's JSON from 4 requests of WORKLOAD (after 1 warm-up) and `argv`."""
    spec = tmp_path / "tiny.yaml"
    spec.write_text(WORKLOAD)
    out = tmp_path / "serve.json"
    common = ["--workload", str(spec), "--num-requests", "4", "--warmup", "1"]
    common += ["--slo-ttft", "60", "--slo-tpot", "10"]
    assert main([*common, *argv, "--out", str(out)]) == 0
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def router(ray_workers: Any) -> Iterator[RouterHarness]:
    """One router with both front doors, over workers of this module's own."""
    prefill = {"bench-prefill": ray_workers.prefill("bench-prefill")}
    decode = {"bench-decode": ray_workers.decode("bench-decode")}
    harness = RouterHarness(prefill, decode, None, http_port=0)
    yield harness
    harness.stop()


def test_a_short_sweep_records_every_request_and_finds_the_goodput(
    router: RouterHarness, workers: Any, tmp_path: Path
) -> None:
    result = _serve(tmp_path, "--target", router.address, "--rates", "4,inf")
    assert [run["rate"] for run in result["runs"]] == [4.0, "inf"]
    for run in result["runs"]:
        summary, records = run["summary"], run["records"]
        assert (summary["requests"], summary["completed"], summary["failures"]) == (4, 4, {})
        assert summary["slo_attainment"] == 1.0
        assert all(3 <= sum(k for _, k in r["messages"]) <= 6 for r in records)
        assert all(r["timing"]["total_ms"] > 0 for r in records)
        assert 0 < summary["ttft_s"]["p50"] <= summary["ttft_s"]["p99"]
    assert result["goodput"]["goodput_rps"] == 4.0  # the one finite rate, met by all


def _lengths(result: dict[str, Any]) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request, sorted (records come as they end)."""
    records = result["runs"][0]["records"]
    return sorted((r["prompt_tokens"], sum(k for _, k in r["messages"])) for r in records)


def test_the_openai_backend_measures_the_same_requests_as_grpc(
    router: RouterHarness, workers: Any, tmp_path: Path
) -> None:
    assert router.app.http is not None
    grpc = _serve(tmp_path, "--target", router.address, "--rates", "inf")
    http = router.app.http.address
    openai = _serve(tmp_path, "--backend", "openai", "--target", http, "--rates", "inf")
    expected = sorted(
        (len(t.user), t.output_len)
        for c in make_conversations(load_workload(str(tmp_path / "tiny.yaml")), 4, 0, 1)
        for t in c.turns
    )
    assert _lengths(grpc) == _lengths(openai) == expected
    for result in (grpc, openai):
        summary = result["runs"][0]["summary"]
        assert (summary["requests"], summary["completed"], summary["failures"]) == (4, 4, {})
        assert 0 < summary["ttft_s"]["p50"] <= summary["e2e_s"]["p50"]
    assert openai["server"]["models"][0]["id"] == MODEL
    assert all(r["timing"] is None for r in openai["runs"][0]["records"])  # gRPC's own


def test_the_openai_backend_over_chat_gets_every_output_token(
    router: RouterHarness, workers: Any, tmp_path: Path
) -> None:
    assert router.app.http is not None
    http = router.app.http.address
    chat = _serve(tmp_path, "--backend", "openai", "--endpoint", "chat", "--target", http)
    summary = chat["runs"][0]["summary"]
    assert (summary["completed"], summary["failures"]) == (4, {})
    outputs = sorted(o for _, o in _lengths(chat))
    assert outputs == sorted(o for _, o in _lengths(_serve(tmp_path, "--target", router.address)))


SHARED = """
prefixes: 2
prefix: {dist: uniform, low: 64, high: 96}
prompt: {dist: uniform, low: 8, high: 16}
output: {dist: uniform, low: 3, high: 3}
"""


def test_a_shared_prefix_workload_run_in_turn_gets_its_ideal_prefix_hits(
    router: RouterHarness, workers: Any, tmp_path: Path
) -> None:
    """One after another on one decode worker, each request but the first of its system
    prompt finds that prompt's full pages cached: exactly the ideal the workload allows."""
    spec = tmp_path / "shared.yaml"
    spec.write_text(SHARED)
    out = tmp_path / "shared.json"
    # A seed of its own: the other tests' prompts (seed 0) begin with the same token ids.
    argv = ["--workload", str(spec), "--num-requests", "6", "--warmup", "0", "--seed", "11"]
    argv += ["--slo-ttft", "60", "--slo-tpot", "10", "--target", router.address]
    assert main([*argv, "--rates", "inf", "--concurrency", "1", "--out", str(out)]) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert run["summary"]["completed"] == 6
    assert run["summary"]["cached_prompt_tokens"] == run["ideal_cached_prompt_tokens"] >= 4 * 64
