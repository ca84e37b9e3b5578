"""Serving metrics on hand-made traces with answers worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from splitserve.serve_metrics import (
    RequestRecord,
    ServerTiming,
    Slo,
    highest_rate_meeting,
    interpolated_goodput,
    percentile,
    slo_attainment,
    stats,
    summarize,
)


def record(
    send: float, messages: list[tuple[float, int]], end: float, status: str = "OK"
) -> RequestRecord:
    return RequestRecord(send, end, tuple(messages), prompt_tokens=10, status=status)


def test_percentiles_interpolate_linearly_between_closest_ranks() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]  # sorted 1 2 3 4: rank p/100 * 3
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert (percentile(xs, 0), percentile(xs, 100)) == (1.0, 4.0)
    assert percentile([7.0], 99) == 7.0


def test_percentiles_match_numpys_default_method() -> None:
    xs = list(np.random.default_rng(3).lognormal(0, 1, 37))
    for p in (1, 50, 90, 99):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_stats_are_none_without_samples() -> None:
    assert stats([]) is None
    s = stats([1.0, 2.0, 3.0, 10.0])
    assert s is not None
    assert (s.mean, s.p50) == (4.0, 2.5)


def test_ttft_tpot_and_e2e_of_one_token_per_message() -> None:
    r = record(10.0, [(10.5, 1), (10.7, 1), (10.9, 1), (11.1, 1)], 11.1)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.2)  # (1.1 - 0.5) / 3
    assert r.itl() == pytest.approx([0.2, 0.2, 0.2])
    assert r.output_tokens == 4


def test_a_message_of_k_tokens_counts_its_gap_once_and_k_minus_1_zero_gaps() -> None:
    r = record(0.0, [(1.0, 2), (1.3, 3), (1.4, 1)], 1.4)
    assert r.itl() == pytest.approx([0.0, 0.3, 0.0, 0.0, 0.1])
    assert len(r.itl()) == r.output_tokens - 1
    assert sum(r.itl()) == pytest.approx(r.e2e - (r.ttft or 0))
    assert r.tpot == pytest.approx(0.4 / 5)


def test_tpot_is_undefined_for_a_one_token_reply() -> None:
    r = record(0.0, [(0.3, 1)], 0.3)
    assert (r.tpot, r.itl()) == (None, [])


def test_attainment_counts_failures_as_misses() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)
    records = [
        record(0.0, [(0.5, 1), (0.6, 1)], 0.6),  # meets both
        record(0.0, [(0.9, 1)], 0.9),  # one token: TPOT met trivially
        record(0.0, [(1.5, 1), (1.6, 1)], 1.6),  # TTFT missed
        record(0.0, [(0.5, 1), (0.8, 1)], 0.8),  # TPOT 0.3 missed
        record(0.0, [(0.2, 1)], 0.4, status="DEADLINE_EXCEEDED"),  # fast, but failed
        record(0.0, [], 0.1, status="UNAVAILABLE"),
    ]
    assert slo_attainment(records, slo) == pytest.approx(2 / 6)


def test_summary_of_a_run_with_a_failure() -> None:
    timing = ServerTiming(1.0, 2.0, 3.0, 4.0, 10.0)
    records = [
        RequestRecord(0.0, 2.0, ((1.0, 1), (2.0, 1)), 10, timing=timing, cached_prompt_tokens=3),
        RequestRecord(1.0, 4.0, ((2.0, 2), (3.0, 2)), 20, timing=timing),
        record(2.0, [], 3.0, status="RESOURCE_EXHAUSTED"),
        record(3.0, [], 4.0, status="RESOURCE_EXHAUSTED"),
    ]
    s = summarize(records, Slo(ttft_s=1.0, tpot_s=1.0))
    assert (s.requests, s.completed, s.failures) == (4, 2, {"RESOURCE_EXHAUSTED": 2})
    assert s.duration_s == 4.0  # first send 0, last end 4
    assert s.request_throughput == pytest.approx(2 / 4)
    assert s.output_throughput == pytest.approx(6 / 4)  # failures' tokens do not count
    assert s.cached_prompt_tokens == 3
    assert s.ttft_s is not None and s.ttft_s.mean == pytest.approx(1.0)
    assert s.tpot_s is not None and s.tpot_s.p50 == pytest.approx((1.0 + 2 / 3) / 2)
    assert s.itl_s is not None and s.itl_s.mean == pytest.approx(2.0 / 4)  # 1 | 0 1 0 0
    assert s.slo_attainment == pytest.approx(2 / 4)
    assert s.server_ms["total_ms"] == 10.0


def test_summary_when_every_request_failed() -> None:
    s = summarize([record(0.0, [], 1.0, status="UNAVAILABLE")], Slo(1.0, 1.0))
    assert (s.completed, s.ttft_s, s.slo_attainment, s.server_ms) == (0, None, 0.0, {})


def test_goodput_is_none_when_no_rate_meets_the_goal() -> None:
    sweep = {0.5: 0.85, 1.0: 0.6, 2.0: 0.1}
    assert highest_rate_meeting(sweep) is None
    assert interpolated_goodput(sweep) is None


def test_goodput_is_the_highest_rate_when_every_rate_meets_it() -> None:
    sweep = {0.5: 1.0, 1.0: 0.95, 2.0: 0.9}
    assert highest_rate_meeting(sweep) == 2.0
    assert interpolated_goodput(sweep) == 2.0  # no extrapolation beyond the sweep


def test_goodput_interpolates_where_attainment_crosses_the_goal() -> None:
    sweep = {2.0: 0.5, 0.5: 1.0, 1.0: 0.95}  # crossing between 1.0 (0.95) and 2.0 (0.5)
    assert highest_rate_meeting(sweep) == 1.0
    assert interpolated_goodput(sweep) == pytest.approx(1.0 + 1.0 * 0.05 / 0.45)


def test_goodput_takes_the_highest_meeting_rate_of_a_noisy_sweep() -> None:
    sweep = {1.0: 0.95, 2.0: 0.8, 3.0: 0.92, 4.0: 0.82}
    assert highest_rate_meeting(sweep) == 3.0
    assert interpolated_goodput(sweep) == pytest.approx(3.0 + 0.02 / 0.10)


def test_a_fifo_server_queues_each_request_behind_the_one_before() -> None:
    from splitserve.bench.compare import fifo

    # Two requests arrive at 0 and 1 s; each takes 2 s (tokens at 0.5 s and 2 s after it starts).
    records = fifo([0.0, 1.0], [[0.5, 2.0], [0.5, 2.0]], [10, 20])
    assert [r.ttft for r in records] == [0.5, 1.5]  # the second waited 1 s for the first
    assert [r.e2e for r in records] == [2.0, 3.0]
    assert [r.tpot for r in records] == [1.5, 1.5]
    assert [r.prompt_tokens for r in records] == [10, 20]
