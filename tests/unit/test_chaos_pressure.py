"""bench/chaos_pressure.py's summaries, on hand-made records: streams against their
references, refusals by how they were sent, the flood against the idle latency."""

from __future__ import annotations

from splitserve.bench.chaos_doors import Call
from splitserve.bench.chaos_pressure import flood_summary, overload_summary, pressure_table


def test_overload_counts_streams_wrong_outputs_and_refusals_by_mode() -> None:
    reference = [Call(0.0, 1.0, "OK", (1, 2)), Call(1.0, 2.0, "OK", (3, 4))]
    streams = [
        Call(5.0, 9.0, "OK", (1, 2)),  # prompt 0, right
        Call(5.0, 9.0, "OK", (3, 5)),  # prompt 1, wrong
        Call(5.0, 9.0, "OK", (1, 2)),  # prompt 0, right
        Call(5.0, 6.0, "INTERNAL", (3,)),
    ]
    refusals = {
        "at_once": [(6.0, 6.002, "RESOURCE_EXHAUSTED"), (6.001, 6.010, "RESOURCE_EXHAUSTED")],
        "one_by_one": [(7.0, 7.001, "RESOURCE_EXHAUSTED"), (7.001, 7.5, "OK")],
    }
    s = overload_summary("grpc", reference, streams, refusals)
    assert (s["streams"], s["streams_ok"], s["streams_wrong_output"]) == (4, 3, 1)
    assert s["streams_failed"] == {"INTERNAL": 1}
    at_once, in_turn = s["burst"]["at_once"], s["burst"]["one_by_one"]
    assert at_once["by_status"] == {"RESOURCE_EXHAUSTED": 2}
    assert round(at_once["refusal_ms"]["max"], 6) == 9.0
    assert round(at_once["sent_ms"], 6) == 1.0 and round(at_once["span_ms"], 6) == 10.0
    assert in_turn["refusal_ms"]["n"] == 1  # the one accepted is not a refusal
    text = pressure_table({"overload": [{**s, "router_cpu_us_per_token": 50.0}]})
    assert "3/4 streams OK" in text and "wrong output 1" in text


def test_flood_compares_the_normal_requests_with_their_idle_latency() -> None:
    idle = [Call(0.0, 1.0, "OK", ()), Call(1.0, 2.0, "OK", ())]
    during = [Call(3.0, 4.5, "OK", ()), Call(4.5, 6.0, "OK", ()), Call(6.0, 6.1, "UNAVAILABLE", ())]
    floods = [Call(3.0, 3.01, "INVALID_ARGUMENT", ()), Call(3.0, 3.001, "RESOURCE_EXHAUSTED", ())]
    s = flood_summary(idle, during, idle, floods, router_cpu_s=0.02, text_chars=100)
    assert s["normal_during_vs_idle_p50"] == 1.5
    assert s["normal_failed"] == 1
    assert s["flood_by_status"] == {"INVALID_ARGUMENT": 1, "RESOURCE_EXHAUSTED": 1}
    assert s["router_cpu_ms_per_flood_request"] == 10.0
    assert "(1.50x)" in pressure_table({"flood": s})
