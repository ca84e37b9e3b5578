"""splitserve.bench.loadgen reads AIPerf's summary: the fixture is a real AIPerf 0.13.0 run's
profile_export_aiperf.json against `splitserve serve`, cut to the metrics it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.bench.loadgen import difference, parse_aiperf

FIXTURE = Path(__file__).parent / "data" / "aiperf_profile_export.json"


def test_aiperf_summary_gives_ttft_and_tpot_p50s_in_ms() -> None:
    doc = json.loads(FIXTURE.read_text())
    figures = parse_aiperf(doc, client_cpu_s=12.5)
    assert figures.requests == 40
    assert (figures.input_tokens, figures.output_tokens) == (128.0, 64.0)
    assert figures.ttft_p50_ms == doc["time_to_first_token"]["p50"]
    assert figures.tpot_p50_ms == doc["inter_token_latency"]["p50"]
    assert figures.client_cpu_s == 12.5


def test_a_metric_in_another_unit_is_refused() -> None:
    doc = json.loads(FIXTURE.read_text())
    doc["time_to_first_token"]["unit"] = "ns"
    with pytest.raises(AssertionError):
        parse_aiperf(doc, client_cpu_s=0.0)


def test_difference_is_relative_to_the_third_party() -> None:
    assert difference(45.0, 50.0) == pytest.approx(-0.1)
