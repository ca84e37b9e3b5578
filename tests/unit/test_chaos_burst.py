"""bench/chaos_burst.py: how the burst scenario reads its records (hand-made, no server)."""

from __future__ import annotations

import pytest

from splitserve.bench.chaos_burst import Burst, burst_summary, burst_table
from splitserve.bench.chaos_doors import Call

# Two streams, a piece every 0.1 s until 1.0, then a 0.3 s stall across the burst at 1.0.
STREAMS = [
    Call(0.0, 2.0, "OK", (), 0.1, (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.2, 1.3)),
    Call(0.0, 2.0, "OK", (), 0.1, (0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)),
]
REFUSED = Call(1.0, 1.004, "RESOURCE_EXHAUSTED", (), detail="max_pending")
BY_GRPC = Call(1.0, 1.002, "RESOURCE_EXHAUSTED", (), detail="Concurrent RPC limit exceeded!")
# Quiet 0.5..1.0 s: 0.01 s of router CPU (0.02 s per second); the burst, 1.0..1.004: 0.0001 s.
BURST = Burst(0.5, 1.0, 0.01, 0.0001, [REFUSED, BY_GRPC, REFUSED, REFUSED])


def test_a_burst_is_read_against_the_quiet_window_before_it() -> None:
    s = burst_summary(STREAMS, BURST)
    assert s["sent"] == 4
    assert s["by_status"] == {
        "RESOURCE_EXHAUSTED: max_pending": 3,
        "RESOURCE_EXHAUSTED: Concurrent RPC limit exceeded!": 1,
    }
    assert s["refusal_ms"]["n"] == 4 and s["refusal_ms"]["max"] == pytest.approx(4.0)
    assert s["span_ms"] == pytest.approx(4.0)
    # Before: the gaps ending in [0.5, 1.0), all 0.1 s; during: those overlapping the
    # burst, the first stream's 0.9 -> 1.2 stall (the second ended its pieces before it).
    assert s["itl_before_ms"]["n"] == 10 and s["itl_before_ms"]["p99"] == pytest.approx(100.0)
    assert s["itl_during_ms"]["n"] == 1 and s["itl_during_ms"]["p99"] == pytest.approx(300.0)
    assert s["itl_p99_during_vs_before"] == pytest.approx(3.0)
    assert s["streams_through_burst"] == 2
    # 0.0001 s over the burst less 0.02 s/s x 0.004 s of the streams' own, over 4 refusals.
    assert s["router_cpu_us_per_refusal"] == pytest.approx(1e6 * (1e-4 - 8e-5) / 4)
    assert s["router_cpu_us_per_refusal_raw"] == pytest.approx(25.0)


def test_a_run_with_no_burst_and_one_with_no_gaps_print() -> None:
    quiet = Burst(0.5, 1.0, 0.0, 0.0, [REFUSED])
    s = burst_summary([], quiet)
    assert s["itl_before_ms"] is None and s["itl_p99_during_vs_before"] is None
    run = {"door": "grpc", "streams": 0, "streams_ok": 0, "streams_failed": {}}
    text = burst_table([{**run, "streams_wrong_output": 0, "burst": s},
                        {**run, "streams_wrong_output": 0, "burst": None}])  # fmt: skip
    assert "refusal p50 4.0 ms" in text and "ITL p99: before - ms" in text
    assert "no burst sent" in text
