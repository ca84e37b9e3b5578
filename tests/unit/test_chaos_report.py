"""bench/chaos_report.py: how the chaos benchmark counts what it saw, on hand-made records."""

from __future__ import annotations

from splitserve.bench.chaos_report import (
    Fault,
    Outcome,
    WorkerPages,
    divergence,
    message_class,
    summarize,
    table,
)

IDLE = [Outcome(0, 0.0, 1.0, (5, 6, 7)), Outcome(1, 1.0, 3.0, (8, 9))]


def test_divergence_is_the_first_differing_token_or_where_one_ends() -> None:
    assert divergence([1, 2, 3], [1, 2, 3]) is None
    assert divergence([1, 2, 3], [1, 4, 3]) == 1
    assert divergence([1, 2, 3], [1, 2]) == 2
    assert divergence([1, 2], [1, 2, 3]) == 2


def test_message_class_masks_numbers_and_ids() -> None:
    a = message_class("decode worker decode-1 died (request 3f2a9c11deadbeef after 12.5 s)")
    b = message_class("decode worker decode-3 died (request 0011aabbccddeeff after 7 s)")
    assert a == b == "decode worker decode-# died (request # after # s)"
    assert len(message_class("x" * 1000)) == 80


def test_counts_add_up_and_wrong_tokens_are_found() -> None:
    run = [
        Outcome(0, 10.0, 12.0, (5, 6, 7)),  # right, in flight at the kill at 11
        Outcome(1, 10.0, 13.0, (8, 1)),  # wrong from token 1, at the kill
        Outcome(0, 13.0, 13.5, (5,), "INTERNAL", "decode worker died"),  # right so far
        Outcome(1, 13.0, 13.5, (2,), "INTERNAL", "decode worker died"),  # wrong, then failed
        Outcome(0, 20.0, 21.5, (5, 6, 7)),  # right, no kill in flight
    ]
    faults = [
        Fault("decode", 42, 11.0, "decode-0", "decode-2", 9.0),
        Fault("redis", 43, 20.5, "", "", 3.0),  # not a worker: no request is "at a kill"
        Fault("prefill", 44, 30.0, "prefill-1", "", None),
    ]
    pages = [WorkerPages("decode-1", 10, 10), WorkerPages("prefill-0", 9, 10)]
    s = summarize(IDLE, run, faults, pages)
    assert (s["sent"], s["completed"], s["failed"]) == (5, 3, 2)
    assert s["failed_by_status"] == {"INTERNAL: decode worker died": 2}
    assert s["wrong_tokens"] == 1
    assert s["wrong_token_requests"] == [{"item": 1, "first_divergence": 1}]
    assert s["failed_after_wrong_tokens"] == 1
    at_kill, others = s["extra_latency_s"]["at_a_kill"], s["extra_latency_s"]["not_at_a_kill"]
    assert (at_kill["n"], at_kill["max"]) == (2, 1.0)  # 2 - 1 and 3 - 2
    assert (others["n"], others["max"]) == (1, 0.5)
    assert s["recovery"]["decode"] == {
        "kills": 1,
        "not_recovered": 0,
        "recovery_s": {"n": 1, "p50": 9.0, "p99": 9.0, "max": 9.0},
    }
    assert s["recovery"]["prefill"]["not_recovered"] == 1
    assert s["pages_all_free"] is False
    text = table("chaos", s)
    assert "sent 5, completed 3, failed 2, wrong tokens 1" in text
    assert "NOT all free" in text


def test_a_clean_run_reports_nothing_wrong() -> None:
    s = summarize(IDLE, IDLE, [], [WorkerPages("decode-0", 4, 4)])
    assert (s["sent"], s["completed"], s["failed"], s["wrong_tokens"]) == (2, 2, 0, 0)
    assert s["recovery"] == {} and s["pages_all_free"] is True
